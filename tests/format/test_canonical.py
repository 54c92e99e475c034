"""Canonical JSON and FNV-1a against the serde_json-written vectors (R1-R3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmp.format import canonical
from llmp.format.canonical import NotJSON, RawFloat, RawInt


def _vectors(shared: Path) -> list[tuple[str, str, str]]:
    rows = []
    with open(shared / "vectors" / "canonical.tsv", encoding="utf-8", newline="\n") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if line:
                inp, digest, canon = line.split("\t", 2)
                rows.append((inp, digest, canon))
    return rows


def test_every_vector_row(shared_dir: Path) -> None:
    rows = _vectors(shared_dir)
    assert len(rows) >= 40
    failures = []
    for inp, digest, canon in rows:
        if digest == "ERR":
            with pytest.raises(NotJSON):
                canonical.loads(inp.encode("utf-8"))
            continue
        value = canonical.loads(inp.encode("utf-8"))
        out = canonical.dumps(value)
        if out.decode("utf-8") != canon or canonical.hash_bytes(out) != digest:
            failures.append(inp[:80])
    assert failures == []


def test_fnv_known_values() -> None:
    assert canonical.hash_bytes(b"") == "cbf29ce484222325"
    assert canonical.EMPTY_HASH == "cbf29ce484222325"
    assert canonical.hash_bytes(b"a") == "af63dc4c8601ec8c"
    assert canonical._fnv1a64_py(b"hello world") == canonical.fnv1a64(b"hello world")


def test_number_text_is_kept() -> None:
    value = canonical.loads(b'{"t":[1.0,1E5,0.10,-0.0,-0,18446744073709551616,25]}')
    nums = value["t"]
    assert isinstance(nums[0], RawFloat) and nums[0].text == "1.0"
    assert isinstance(nums[5], RawInt)
    assert nums[4] == 0 and type(nums[4]) is int
    assert canonical.dumps(value) == b'{"t":[1.0,1E5,0.10,-0.0,0,18446744073709551616,25]}'
    # kept text still behaves as a number
    assert nums[0] + 1 == 2.0


def test_record_dumps_keeps_order_and_numbers() -> None:
    value = canonical.loads(b'{"b":0.50,"a":1}')
    assert canonical.record_dumps(value) == b'{"b":0.50,"a":1}'


@pytest.mark.parametrize(
    "bad",
    [
        b"\xff",
        b'"\\ud800"',
        b"NaN",
        b"[1,]",
        b"-Infinity",
        b"[" * 128 + b"]" * 128,
        b"\xef\xbb\xbf{}",
    ],
)
def test_rejects_what_serde_rejects(bad: bytes) -> None:
    with pytest.raises(NotJSON):
        canonical.loads(bad)


def test_depth_limit_boundary() -> None:
    canonical.loads(b"[" * 127 + b"]" * 127)
    with pytest.raises(NotJSON):
        canonical.loads(b"[" * 128 + b"]" * 128)
    with pytest.raises(NotJSON):
        canonical.loads(b'{"a":' * 128 + b"1" + b"}" * 128)
