"""The C line splitter (`_keyedlines.c`) gives the reader the items its Python path gives.

`Recording._keyed_lines` hands `in_order` every line with its key: from
`_keyedlines.KeyedLines` where it was built, else from `_file_lines` and `KEY_RE`.
The C side takes only the plainest key itself and passes every other line to the
Python code, so the two must agree on any bytes at all: the same items in the same
order, and the same bad lines counted, whatever the block size cuts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.analysis import reader
from llmp.analysis.reader import Recording, _Progress

try:
    from llmp.analysis._keyedlines import KeyedLines
except ImportError:  # pragma: no cover - reported by test_the_c_splitter_is_built
    KeyedLines = None  # type: ignore[assignment, misc]


def test_the_c_splitter_is_built() -> None:
    # setup builds it (pyproject: ext-modules); without a C compiler the reader still
    # works, on `_file_lines`, and this test says so.
    assert KeyedLines is not None, "llmp.analysis._keyedlines was not built (no C compiler?)"
    assert reader.KeyedLines is KeyedLines


def keyed_items(paths: list[str], c: bool, block: int) -> tuple[list[Any], int, list[int]]:
    """`_keyed_lines`' items, bad lines and the sizes a progress bar was given."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(reader, "KeyedLines", KeyedLines if c else None)
        m.setattr(reader, "BLOCK", block)
        bar = _Bar()
        with Recording(paths, progress=False) as rec:
            items = list(rec._keyed_lines(bar))
            return items, rec.stats.bad_lines, bar.sizes


class _Bar(_Progress):
    """A progress bar that keeps the sizes it is given."""

    shown = True

    def __init__(self) -> None:
        super().__init__(False, 0)
        self.sizes: list[int] = []

    def advance(self, n: int) -> None:
        self.sizes.append(n)


KEYS = [
    b'{"v":1,"id":7,"conn":3,"t_start_ms":1788595000000,',
    b'{"v":1,"id":7,"conn":-1,"t_start_ms":-5}',
    b'{"v":1,"id":0012,"conn":0,"t_start_ms":0012,"x":1}',
    b'{"v":2,"id":7,"conn":3,"t_start_ms":1,',  # another version: a bad line
    b'{"v":01,"id":7,"conn":3,"t_start_ms":1,',  # KEY_RE's v is b"01": bad
    b'{"v":1,"id":123456789012345678,"conn":1,"t_start_ms":1,',  # 18 digits: C
    b'{"v":1,"id":1234567890123456789,"conn":1,"t_start_ms":1,',  # 19: Python
    b'{"v":1,"id":99999999999999999999999,"conn":1,"t_start_ms":1,',
    b'{"v":1,"id":7,"conn":3,"t_start_ms":-123456789012345678,',
    b'{"v":1,"id":7,"conn":12345678901234567890,"t_start_ms":1,',
    b'{"v":1,"id":-7,"conn":3,"t_start_ms":1,',  # no match: parsed
    b'{"v":1,"id":7,"conn":3,"t_start_ms":1 ,',
    b'{"v":1,"id":7,"conn":3,"t_start_ms":1',  # cut short
    b'{"v":1,"id":7,"conn":3,"t_start_ms":',
    b'{"v":1,"id":7,"conn":3,"t_start_ms":1.5,',
    b'{"v": 1, "id": 7, "conn": 3, "t_start_ms": 9, "request": {}}',  # another producer
    b'{"id":8,"v":1,"t_start_ms":9}',
    b"{",
    b"not json",
    b"",
    b"   ",
    b"\t\r",
    b"[1,2]",
    b'"v"',
    '{"v":1,"id":\u0661,"conn":1,"t_start_ms":1,'.encode(),  # Arabic-Indic 1
]

line_parts = st.one_of(
    st.sampled_from(KEYS),
    st.builds(lambda k, tail: k + tail, st.sampled_from(KEYS[:3]), st.binary(max_size=40)),
    st.binary(max_size=60),
)


def build(parts: list[bytes], newline_at_end: bool) -> bytes:
    text = b"\n".join(p.replace(b"\n", b" ") for p in parts)
    return text + b"\n" if newline_at_end and parts else text


@settings(max_examples=300, deadline=None)
@given(
    files=st.lists(
        st.tuples(st.lists(line_parts, max_size=12), st.booleans()), min_size=1, max_size=3
    ),
    block=st.sampled_from([1, 2, 3, 7, 16, 64, 4096]),
)
def test_the_same_items_as_the_python_path(
    tmp_path_factory: pytest.TempPathFactory,
    files: list[tuple[list[bytes], bool]],
    block: int,
) -> None:
    d = tmp_path_factory.mktemp("k")
    paths = []
    for i, (parts, nl) in enumerate(files):
        p = d / f"{i}.jsonl"
        p.write_bytes(build(parts, nl))
        paths.append(str(p))
    want = keyed_items(paths, False, block)
    got = keyed_items(paths, True, block)
    assert got == want


def test_the_plain_keys_are_taken_in_c(tmp_path: Path) -> None:
    # The recorder's lines must not all fall back to Python, or the comparison above
    # would only test the fallback.
    p = tmp_path / "r.jsonl"
    p.write_bytes(
        b'{"v":1,"id":1,"conn":1,"t_start_ms":5,"x":1}\n{"v":1,"id":2,"conn":1,"t_start_ms":6}'
    )
    assert KeyedLines is not None
    slow: list[bytes] = []
    with p.open("rb", buffering=0) as f:
        items = list(KeyedLines(f.read, 3, 0, lambda line: slow.append(line)))
    assert slow == []
    assert [(i[0], i[2], i[3]) for i in items] == [((5, 1), 45, 0), ((6, 2), 38, 0)]
    assert b"".join(i[1] for i in items) == p.read_bytes()


def test_an_error_of_the_slow_path_is_raised(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_bytes(b"bad\n")
    assert KeyedLines is not None

    def slow(line: bytes) -> None:
        raise ValueError(line)

    with p.open("rb", buffering=0) as f, pytest.raises(ValueError, match="bad"):
        list(KeyedLines(f.read, 4096, 0, slow))
