"""`canonical.loads` (msgspec, then `_settle`) gives what `loads_stdlib` gives, or the same error.

msgspec differs from the stdlib path (and serde_json) in two ways, each
tested here: it has no depth limit, and it gives a plain `int` for an
integer outside 64 bits, where the recording keeps the text (`RawInt`; past
4000 digits `RawFloat`, as `_parse_int` does).  Everything msgspec refuses
goes to the stdlib path, so errors are the stdlib's own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from llmp.format import canonical
from llmp.format.canonical import NotJSON, RawFloat, RawInt


def _shape(value: Any) -> Any:
    """The value with every type spelled out: equal shapes mean equal records."""
    if isinstance(value, dict):
        return ("dict", [(k, _shape(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [_shape(v) for v in value])
    if isinstance(value, (RawFloat, RawInt)):
        return (type(value).__name__, value.text)
    return (type(value).__name__, repr(value))


def _outcome(fn: Any, data: bytes | bytearray | memoryview | str) -> Any:
    try:
        value = fn(data)
    except NotJSON:
        return "NotJSON"
    return _shape(value), canonical.dumps(value), canonical.record_dumps(value)


def _same(data: bytes | bytearray | memoryview | str) -> None:
    assert _outcome(canonical.loads, data) == _outcome(canonical.loads_stdlib, data)


CASES = [
    b"{}",
    b"[]",
    b" \t\r\n{} \n",
    b'{"a":1,"b":2,"a":3}',  # duplicates: first place, last value
    b"-0",
    b"-0.0",
    b"1E400",
    b"1.0e+2",
    b"[-1.5e-3, 0.10]",
    b"9223372036854775807",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"18446744073709551615",
    b"18446744073709551616",
    b"123456789012345678901234567890",
    b'{"n":[1,{"m":-123456789012345678901234567890}]}',
    ("1" * 4000).encode(),
    ("1" * 4001).encode(),  # the stdlib path keeps it as RawFloat
    ("[-" + "1" * 4100 + "]").encode(),
    ("[" + "1" * 4500 + "]").encode(),  # msgspec refuses; the stdlib keeps the text
    b"[" * 127 + b"]" * 127,
    b"[" * 128 + b"]" * 128,  # msgspec has no depth limit
    b'{"a":' * 128 + b"1" + b"}" * 128,
    b"[" * 100000 + b"]" * 100000,
    b'"\\ud83d\\ude00"',
    b'"\\ud800"',
    b'"\\udc00x"',
    b'{"\\ud800":1}',
    b'"\\ud800\\u0041"',
    b'"\xff"',
    b'"\xed\xa0\x80"',
    b'"\xc0\xaf"',
    b'"\xf4\x90\x80\x80"',
    b"\xef\xbb\xbf{}",
    b'"a\x01b"',
    b'"\\u0000\x7f"',
    b"NaN",
    b"Infinity",
    b"[1,]",
    b"01",
    b"1.",
    b".5",
    b"",
    b" ",
    b"{}\x00",
    b'{"a":1}garbage',
    b"\xc2\xa0{}",
    b"true",
    b"null",
]


@pytest.mark.parametrize("data", CASES, ids=lambda d: repr(d[:24]))
def test_fast_path_matches_the_stdlib_path(data: bytes) -> None:
    _same(data)
    if b"\xff" not in data and not data.startswith(b"\xef"):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return
        _same(text)


@pytest.mark.parametrize("text", ['"\ud800"', '{"x":"\udc80"}', '["a", "\udfff"]'])
def test_a_str_with_a_lone_surrogate_is_not_json(text: str) -> None:
    with pytest.raises(NotJSON):
        canonical.loads(text)
    _same(text)


def test_the_differences_are_repaired() -> None:
    big = canonical.loads(b'{"a":[18446744073709551616,-9223372036854775809,5]}')
    assert isinstance(big["a"][0], RawInt) and big["a"][0].text == "18446744073709551616"
    assert isinstance(big["a"][1], RawInt) and big["a"][1].text == "-9223372036854775809"
    assert type(big["a"][2]) is int
    assert isinstance(canonical.loads(b"18446744073709551616"), RawInt)
    with pytest.raises(NotJSON, match="recursion"):
        canonical.loads(b"[" * 128 + b"]" * 128)


def test_memoryview_and_bytearray_inputs() -> None:
    data = b'{"t":[1.0,18446744073709551616]}'
    _same(bytearray(data))
    assert _outcome(canonical.loads, memoryview(data)) == _outcome(canonical.loads, data)


def test_every_vector_row_both_ways(shared_dir: Path) -> None:
    with open(shared_dir / "vectors" / "canonical.tsv", encoding="utf-8", newline="\n") as fh:
        rows = [line.rstrip("\n").split("\t", 2)[0] for line in fh if line.strip()]
    assert len(rows) >= 40
    for inp in rows:
        _same(inp.encode("utf-8"))


def _random_json(rng: random.Random, depth: int = 0) -> str:
    """JSON text with the numbers and strings where the two parsers could part."""
    pick = rng.randrange(9 if depth < 6 else 5)
    if pick == 0:
        return rng.choice(["0", "-0", "1", "-1", "9223372036854775807", "18446744073709551615"])
    if pick == 1:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 45)))
        return rng.choice(["", "-"]) + (digits.lstrip("0") or "0")
    if pick == 2:
        return rng.choice(["1.0", "1E5", "1e+5", "1e-5", "0.10", "-0.0", "3.14159265358979323846"])
    if pick == 3:
        return json.dumps(rng.choice(["", "é", "\u2028", "😀", "a\\b", "\x00\x1f", "x" * 30]))
    if pick == 4:
        return rng.choice(["true", "false", "null"])
    items = [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick < 7:
        return "[" + ",".join(items) + "]"
    keys = [rng.choice(["a", "b", "é", "Z", ""]) for _ in items]  # repeats: duplicate keys
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in zip(keys, items, strict=True)) + "}"


def test_random_documents_agree() -> None:
    rng = random.Random(14)
    for _ in range(2000):
        text = _random_json(rng)
        _same(text.encode("utf-8"))
        _same(text)


# -- short_ints_only and short_ints: a stream's events skip the walk when no integer can be huge


def test_short_ints_only_finds_19_digits() -> None:
    for text in ('{"n":-9223372036854775809}', '{"n":18446744073709551616}', "1" * 19):
        assert not canonical.short_ints_only(text)
        assert not canonical.short_ints_only(text.encode())


def test_short_ints_only_needs_19_in_a_row() -> None:
    for text in (
        "922337203685477580 x 1760000000",  # 18 digits, then 10
        "123456789 012345678",  # 18 with a break
        "chatcmpl-Xq3vR8bT0mK2wL9pZ4sN7cY1fH6dJ5aE",
        "\uff11" * 19,  # not ASCII digits, which are all a JSON integer can hold
    ):
        assert canonical.short_ints_only(text)
        assert canonical.short_ints_only(text.encode("utf-8"))


def test_short_ints_still_rejects_deep_nesting() -> None:
    with pytest.raises(NotJSON, match="recursion"):
        canonical.loads("[" * 128 + "]" * 128, short_ints=True)
    with pytest.raises(NotJSON, match="recursion"):
        canonical.loads(b"[" * 128 + b"]" * 128, short_ints=True)
    assert canonical.loads(b"[" * 127 + b"]" * 127, short_ints=True) == _nested(126)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def test_short_ints_gives_the_same_values_without_huge_integers() -> None:
    rng = random.Random(41)
    for _ in range(500):
        text = _random_json(rng)
        if not canonical.short_ints_only(text):
            continue
        assert _outcome(lambda d: canonical.loads(d, short_ints=True), text) == _outcome(
            canonical.loads_stdlib, text
        )


def test_a_stream_event_with_a_huge_integer_keeps_its_text() -> None:
    from llmp.apis import api_for
    from llmp.recorder.stream import StreamCapture

    api = api_for("POST", "/v1/chat/completions")
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"n":1}}\n\n'
        b'data: {"choices":[],"usage":{"n":18446744073709551616}}\n\n'
        b"data: [DONE]\n\n"
    )
    for cut in range(0, len(body) + 1, 7):
        stream = StreamCapture("sse", 1 << 20, api)
        stream.feed(body[:cut])
        stream.feed(body[cut:])
        stream.close()
        merged = stream.merged()
        assert merged is not None
        n = merged["usage"]["n"]
        assert isinstance(n, RawInt) and n.text == "18446744073709551616", cut


def test_the_raw_fnv_call_matches_the_reference_loop() -> None:
    rng = random.Random(3)
    for size in (0, 1, 7, 255, 256, 4096, 70000):
        data = rng.randbytes(size)
        assert canonical.hash_bytes(data) == format(canonical._fnv1a64_py(data), "016x")
    text = "é\ud800x"  # a lone surrogate: passed through as its UTF-8-like bytes
    assert canonical.hash_text(text) == format(
        canonical._fnv1a64_py(text.encode("utf-8", "surrogatepass")), "016x"
    )
