"""Hostile input, fuzzed (hypothesis, bounded for CI): what tests/test_stream_fuzz.py lacks.

test_stream_fuzz.py already checks the SSE and NDJSON parsers against reference
parsers for any split of any bytes, the mergers for any shape of event, and
text garbage between valid events. This file adds:

- canonical JSON: ``loads`` returns a value or raises ``NotJSON`` for any bytes
  or text, and what it returns round-trips through ``dumps``;
- *binary* garbage (invalid UTF-8, NUL, lone CR, truncated events) between
  valid SSE events and NDJSON lines: the valid ones all survive, in order;
- hostile events (right keys, wrong types) between valid deltas: the merged
  content, reasoning and tool calls are exactly the valid ones';
- the recording reader (``llmp.analysis.reader``): never raises on any file, and reads
  every valid record around bad and partial lines.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from llmp.analysis.reader import read_all
from llmp.apis.ndjson import NDJSONParser
from llmp.apis.ollama_chat import NDJSONMerger
from llmp.apis.openai_chat import SSEMerger
from llmp.apis.sse import SSEParser
from llmp.format import canonical
from llmp.format.canonical import NotJSON
from llmp.format.lines import parse_line
from llmp.recorder.stream import StreamCapture

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


# ------------------------------------------------------------ canonical JSON

# JSON-ish text: valid JSON, near misses, and serde_json's edge cases.
_NUMBER = st.from_regex(
    r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][+-]?[0-9]{1,4})?", fullmatch=True
)
_BAD_NUMBER = st.sampled_from(
    ["01", "-", "1.", ".5", "1e", "+1", "NaN", "Infinity", "-Infinity", "0x10", "1_0"]
)
_ESCAPES = st.sampled_from(
    ["\\n", "\\u0000", "\\ud83d\\ude00", "\\ud800", "\\udc00x", "\\uDBFF\\uDFFF", "\\/", "\\x"]
)
_STRING = st.builds(
    lambda parts: '"' + "".join(parts) + '"',
    st.lists(
        st.one_of(st.text(max_size=4).map(lambda s: json.dumps(s)[1:-1]), _ESCAPES), max_size=4
    ),
)
_WS = st.sampled_from(["", " ", "\n", "\t", "\r\n"])


def _json_text() -> st.SearchStrategy[str]:
    scalar = st.one_of(
        _NUMBER, _BAD_NUMBER, _STRING, st.sampled_from(["true", "false", "null", "tru", "nul"])
    )

    def containers(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        arr = st.builds(
            lambda items, ws: "[" + ws + ",".join(items) + "]", st.lists(inner, max_size=4), _WS
        )
        obj = st.builds(
            lambda pairs, ws: "{" + ws + ",".join(f"{k}{ws}:{v}" for k, v in pairs) + "}",
            st.lists(st.tuples(_STRING, inner), max_size=4),
            _WS,
        )
        return st.one_of(arr, obj)

    return st.recursive(scalar, containers, max_leaves=20)


_MUTATIONS = st.sampled_from(["", ",", "]", "}", " x", "\x00", "\ufeff"])
json_texts = st.builds(
    lambda pre, body, post: pre + body + post,
    st.sampled_from(["", " ", "\ufeff", "["]),
    _json_text(),
    _MUTATIONS,
)
# Deep nesting around serde_json's limit of 127.
deep = st.builds(
    lambda n, kind: (("[" * n) + ("]" * n)) if kind else ('{"a":' * n + "1" + "}" * n),
    st.integers(120, 135),
    st.booleans(),
)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)


def _roundtrip(value: Any) -> None:
    out = canonical.dumps(value)
    again = canonical.loads(out)
    assert again == value
    assert canonical.dumps(again) == out  # idempotent
    assert canonical.loads(canonical.record_dumps(value)) == value


def _check_loads(data: bytes | str) -> None:
    try:
        value = canonical.loads(data)
    except NotJSON:
        return
    _roundtrip(value)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_texts.map(str.encode), deep.map(str.encode)))
@example(b"[1e400, -0, -0.0, 18446744073709551616, -9223372036854775809, 0.10]")
@example(b'"\\ud83d\\ude00"')
def test_canonical_loads_any_bytes(data: bytes) -> None:
    """Bytes in: a value that round-trips, or NotJSON; nothing else ever escapes."""
    _check_loads(data)


@FUZZ
@given(st.one_of(any_text, json_texts))
@example('"\ud800"')  # a raw lone surrogate, not an escape
def test_canonical_loads_any_text(text: str) -> None:
    """Text in (as the SSE parser hands events over): the same contract as bytes."""
    _check_loads(text)


@FUZZ
@given(json_texts)
def test_canonical_loads_agrees_with_python_on_plain_json(text: str) -> None:
    """Where Python's strict parser and the serde rules agree, so does loads."""
    try:
        expected = json.loads(text)
    except ValueError:
        return
    try:
        value = canonical.loads(text)
    except NotJSON:
        return  # serde_json rejects more (surrogates, NaN, depth, BOM): covered by vectors
    assert json.loads(canonical.dumps(value)) == expected


def test_loads_accepts_long_integers_like_serde() -> None:
    """serde_json (arbitrary_precision) parses an integer of any length; Python's int()
    refuses more than 4300 digits, which must not turn a JSON body into body_text."""
    big = b'{"n":' + b"7" * 5000 + b"}"
    value = canonical.loads(big)
    assert canonical.dumps(value) == big


# ------------------------------------------- binary garbage between events

# Garbage with no "{" can never be a JSON object, so it cannot add content.
garbage_bytes = st.binary(max_size=40).filter(lambda g: b"{" not in g)
texts = st.lists(st.text(max_size=6), min_size=1, max_size=8)


def _sse_event(text: str) -> bytes:
    obj = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@FUZZ
@given(
    texts,
    st.lists(
        st.tuples(st.integers(0, 8), st.one_of(garbage_bytes, st.integers(1, 60))), max_size=4
    ),
    st.lists(st.integers(0, 3000), max_size=5),
)
def test_sse_binary_garbage_loses_no_valid_event(
    valid: list[str], bad: list[tuple[int, bytes | int]], cuts: list[int]
) -> None:
    """Any bytes (or a truncated event) as a block of their own between valid events."""
    blocks = [_sse_event(t) for t in valid]
    for pos, g in sorted(bad, key=lambda x: x[0], reverse=True):
        if isinstance(g, int):  # a valid event cut short: what a dying server leaves
            g = _sse_event("cut")[:g].rstrip(b"\n")
        blocks.insert(min(pos, len(blocks)), g + b"\n\n")
    data = b"".join(blocks) + b"data: [DONE]\n\n"
    # the parser: the valid events come out whole, in order
    parser = SSEParser()
    events = [e for piece in split(data, cuts) for e in parser.feed(piece)]
    parser.close()
    wanted = [_sse_event(t)[6:-2].decode() for t in valid]
    it = iter(events)
    assert all(any(e == w for e in it) for w in wanted), (wanted, events)
    # the capture: merged content is exactly the valid events'
    cap = StreamCapture("sse", 1 << 20)
    for piece in split(data, cuts):
        cap.feed(piece)
    cap.close()
    assert cap.internal_errors == 0
    assert cap.chunks - cap.bad_chunks == len(valid)
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "".join(valid)


def _nd_line(text: str) -> bytes:
    obj = {"message": {"role": "assistant", "content": text}, "done": False}
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


@FUZZ
@given(
    texts,
    st.lists(
        st.tuples(
            st.integers(0, 8),
            st.one_of(garbage_bytes.map(lambda g: g.replace(b"\n", b"")), st.integers(1, 50)),
        ),
        max_size=4,
    ),
    st.lists(st.integers(0, 3000), max_size=5),
)
def test_ndjson_binary_garbage_loses_no_valid_line(
    valid: list[str], bad: list[tuple[int, bytes | int]], cuts: list[int]
) -> None:
    lines = [_nd_line(t) for t in valid]
    for pos, g in sorted(bad, key=lambda x: x[0], reverse=True):
        if isinstance(g, int):
            g = _nd_line("cut")[:g].rstrip(b"\n")
        lines.insert(min(pos, len(lines)), g + b"\n")
    done = b'{"message":{"role":"assistant","content":""},"done":true,"eval_count":3}\n'
    data = b"".join(lines) + done
    parser = NDJSONParser()
    out = [ln for piece in split(data, cuts) for ln in parser.feed(piece)] + parser.close()
    wanted = [_nd_line(t)[:-1] for t in valid]
    assert [ln for ln in out if ln in wanted] == wanted
    cap = StreamCapture("ndjson", 1 << 20)
    for piece in split(data, cuts):
        cap.feed(piece)
    cap.close()
    assert cap.internal_errors == 0 and cap.done_seen
    assert cap.chunks - cap.bad_chunks == len(valid) + 1
    merged = cap.merged()
    assert merged is not None and merged["eval_count"] == 3
    assert merged["message"]["content"] == "".join(valid)


# ------------------------------------------- hostile events between valid ones

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3))
_nonstr = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.lists(_scalar, max_size=2),
    st.dictionaries(st.text(max_size=3), _scalar, max_size=2),
)
_nonlist = st.one_of(_scalar, st.dictionaries(st.text(max_size=3), _scalar, max_size=2))
_nondict = st.one_of(_scalar, st.lists(_scalar, max_size=2))

hostile_sse = st.one_of(
    _nondict,  # not an object at all
    st.fixed_dictionaries({"choices": _nonlist}),
    st.fixed_dictionaries({"choices": st.lists(_nondict, max_size=2)}),
    st.fixed_dictionaries(
        {
            "choices": st.lists(
                st.fixed_dictionaries({"index": _nonstr, "delta": _nondict}), max_size=2
            )
        }
    ),
    st.fixed_dictionaries(
        {
            "choices": st.builds(lambda: [{"index": 0}]),
            "usage": _nonstr,
            "error": _nonstr,
            "object": _nonstr,
        }
    ),
    st.builds(
        lambda content, reasoning, tools: {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "content": content,
                        "reasoning_content": reasoning,
                        "tool_calls": tools,
                    },
                }
            ]
        },
        _nonstr,
        _nonstr,
        st.one_of(
            _nonlist,
            st.lists(_nondict, max_size=2),
            # fragments for other indexes, with junk in every field
            st.lists(
                st.fixed_dictionaries(
                    {"index": st.integers(10, 12), "id": _nonstr, "function": _nonstr}
                ),
                max_size=2,
            ),
        ),
    ),
)

valid_sse_step = st.tuples(
    st.sampled_from(["content", "reasoning_content", "tool0", "tool1"]), st.text(max_size=4)
)


@FUZZ
@given(
    st.lists(valid_sse_step, min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(0, 12), hostile_sse), max_size=6),
)
def test_sse_merger_hostile_events_cost_nothing_valid(
    steps: list[tuple[str, str]], hostile: list[tuple[int, Any]]
) -> None:
    events: list[Any] = []
    want: dict[str, str] = {}
    for what, text in steps:
        if what.startswith("tool"):
            i = int(what[-1])
            delta: dict[str, Any] = {
                "tool_calls": [
                    {
                        "index": i,
                        "id": f"call{i}",
                        "type": "function",
                        "function": {"name": f"f{i}", "arguments": text},
                    }
                ]
            }
        else:
            delta = {what: text}
        want[what] = want.get(what, "") + text
        events.append({"choices": [{"index": 0, "delta": delta}]})
    for pos, ev in sorted(hostile, key=lambda x: x[0], reverse=True):
        events.insert(min(pos, len(events)), ev)
    merger = SSEMerger()
    for ev in events:
        merger.add(ev)
    result = merger.result()
    assert result is not None
    canonical.dumps(result)
    (choice,) = [c for c in result["choices"] if c["index"] == 0]
    msg = choice["message"]
    assert msg["content"] == want.get("content")
    assert msg.get("reasoning_content") == want.get("reasoning_content")
    tools = [
        {
            "id": f"call{t[-1]}",
            "type": "function",
            "function": {"name": f"f{t[-1]}", "arguments": want[t]},
        }
        for t in ("tool0", "tool1")
        if t in want
    ]
    assert msg.get("tool_calls", [])[: len(tools)] == tools


hostile_nd = st.one_of(
    _nondict,
    st.fixed_dictionaries({"message": _nondict}),
    st.fixed_dictionaries(
        {
            "message": st.fixed_dictionaries(
                {"content": _nonstr, "thinking": _nonstr, "tool_calls": _nonlist}
            )
        }
    ),
    st.fixed_dictionaries({"done": _nonstr, "error": _nonstr}),
)
valid_nd = st.tuples(st.text(max_size=4), st.text(max_size=4), st.booleans())


@FUZZ
@given(
    st.lists(valid_nd, min_size=1, max_size=10),
    st.lists(st.tuples(st.integers(0, 10), hostile_nd), max_size=6),
)
def test_ndjson_merger_hostile_lines_cost_nothing_valid(
    lines: list[tuple[str, str, bool]], hostile: list[tuple[int, Any]]
) -> None:
    events: list[Any] = []
    calls: list[dict[str, Any]] = []
    for i, (content, thinking, tool) in enumerate(lines):
        msg: dict[str, Any] = {"role": "assistant", "content": content, "thinking": thinking}
        if tool:
            call = {"function": {"name": f"f{i}", "arguments": {"i": i}}}
            msg["tool_calls"] = [call]
            calls.append(call)
        events.append({"message": msg, "done": False})
    for pos, ev in sorted(hostile, key=lambda x: x[0], reverse=True):
        events.insert(min(pos, len(events)), ev)
    merger = NDJSONMerger()
    for ev in events:
        merger.add(ev)
    result = merger.result()
    assert result is not None
    canonical.dumps(result)
    msg = result["message"]
    assert msg["content"] == "".join(c for c, _, _ in lines)
    assert msg["thinking"] == "".join(t for _, t, _ in lines)
    assert msg.get("tool_calls", []) == calls


# ------------------------------------------------------------------- reader


def _record_line(rid: int, t: int) -> bytes:
    rec = {
        "v": 1,
        "id": rid,
        "conn": 1,
        "t_start_ms": t,
        "t_first_byte_ms": None,
        "t_end_ms": t + 1,
        "request": {"method": "GET", "path": "/", "body": None},
        "response": None,
        "error": None,
        "tokens": None,
    }
    return canonical.record_dumps(rec) + b"\n"


def _read(data: bytes) -> tuple[list[tuple[int, int]], Any]:
    fd, name = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)

        def consume(records: Iterator[tuple[int, dict[str, Any]]]) -> list[tuple[int, int]]:
            return [(session, rec["id"]) for session, rec in records]

        return read_all([name], consume, progress=False, window_lines=4)
    finally:
        os.unlink(name)


def _nonblank_lines(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip())


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        st.lists(
            st.sampled_from(
                [
                    b"\n",
                    b"{",
                    b"}",
                    b'"v":1',
                    b'{"v":1,"id":',
                    b'"t_start_ms":',
                    b"7",
                    b",",
                    b"\xff",
                    b"\r",
                    b" ",
                    b'{"v":1,"id":2,"conn":1,"t_start_ms":5}',
                    b'{"v":1,"id":1,"conn":1,"t_start_ms":9,"x":',
                    b"null",
                ]
            ),
            max_size=40,
        ).map(b"".join),
    )
)
def test_reader_never_raises_and_accounts_every_line(data: bytes) -> None:
    got, stats = _read(data)
    assert stats.records == len(got)
    assert stats.records + stats.bad_lines == _nonblank_lines(data)
    for line in data.split(b"\n"):
        rec = parse_line(line)
        assert rec is None or isinstance(rec, dict)


@FUZZ
@given(
    st.integers(1, 12),
    st.lists(
        st.tuples(
            st.integers(0, 12),
            st.one_of(
                st.binary(max_size=30).map(lambda g: g.replace(b"\n", b"")),
                st.integers(1, 150),  # a record line cut short
            ),
        ),
        max_size=5,
    ),
    st.one_of(st.none(), st.integers(1, 150)),
)
def test_reader_keeps_every_valid_record_around_bad_lines(
    n: int, bad: list[tuple[int, bytes | int]], partial_tail: int | None
) -> None:
    lines = [_record_line(i, 1000 + 10 * i) for i in range(1, n + 1)]
    n_bad = 0
    for pos, g in sorted(bad, key=lambda x: x[0], reverse=True):
        if isinstance(g, int):
            g = _record_line(pos + 1, 1000 + 10 * (pos + 1))[:g].rstrip(b"\n")
        assume(parse_line(g) is None)
        if g.strip():
            n_bad += 1
        lines.insert(min(pos, len(lines)), g + b"\n")
    data = b"".join(lines)
    if partial_tail is not None:  # what a killed writer would leave, without its newline
        tail = _record_line(n + 1, 1000 + 10 * (n + 1))[: min(partial_tail, 150)].rstrip(b"\n")
        assume(tail.strip() and parse_line(tail) is None)
        data += tail
        n_bad += 1
    got, stats = _read(data)
    assert got == [(1, i) for i in range(1, n + 1)]
    assert stats.bad_lines == n_bad and stats.sessions == 1
