"""Property tests: the stream code never raises, is split-invariant, and loses nothing.

The parsers are checked against small reference implementations written
straight from the rules (whole-buffer, no incremental state), so the
properties assert exact values, not just "no crash".
"""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.apis.ndjson import NDJSONParser
from llmp.apis.ollama_chat import NDJSONMerger
from llmp.apis.openai_chat import SSEMerger
from llmp.apis.sse import SSEParser
from llmp.format import canonical
from llmp.recorder.stream import StreamCapture

FUZZ = settings(max_examples=200, deadline=None)

# Bytes that exercise the interesting paths: line endings, colons, spaces,
# a BOM, multi-byte and invalid UTF-8, field names.
_ATOMS = [
    b"\n",
    b"\r",
    b"\r\n",
    b":",
    b" ",
    b"data",
    b"data:",
    b"data: ",
    b"event: x",
    b"id",
    b"{}",
    b'{"a":1}',
    b"[DONE]",
    b"\xef\xbb\xbf",
    b"\xc3\xa9",
    b"\xe2\x82\xac",
    b"\xe2\x82",
    b"\xff",
    b"\x80",
    b"x",
]
stream_bytes = st.one_of(
    st.binary(max_size=200),
    st.lists(st.sampled_from(_ATOMS), max_size=40).map(b"".join),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


# ----------------------------------------------------------------- references


def ref_sse(data: bytes) -> tuple[list[str], bool]:
    """WHATWG event-stream parsing of a whole buffer, written the obvious way."""
    text = data.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = re.split(r"\r\n|\r|\n", text)
    complete, tail = lines[:-1], lines[-1]
    out: list[str] = []
    buf: list[str] = []

    def field(line: str) -> None:
        if line.startswith(":"):
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            buf.append(value)

    for line in complete:
        if line == "":
            data_ = "\n".join(buf)
            buf.clear()
            if data_:
                out.append(data_)
        else:
            field(line)
    if tail:
        field(tail)
    return out, "\n".join(buf) != ""


def run_sse(pieces: list[bytes]) -> tuple[list[str], bool]:
    parser = SSEParser()
    out: list[str] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return out, parser.close()


def ref_ndjson(data: bytes) -> list[bytes]:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    out = []
    for line in data.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.strip(b" \t\r"):
            out.append(line)
    return out


def run_ndjson(pieces: list[bytes]) -> list[bytes]:
    parser = NDJSONParser()
    out: list[bytes] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return out + parser.close()


# ------------------------------------------------------------------ parsers


@FUZZ
@given(stream_bytes, st.lists(st.integers(0, 200), max_size=6))
def test_sse_parser_matches_reference_in_any_split(data: bytes, cuts: list[int]) -> None:
    assert run_sse(split(data, cuts)) == ref_sse(data)


@FUZZ
@given(stream_bytes)
def test_sse_parser_byte_by_byte(data: bytes) -> None:
    assert run_sse([data[i : i + 1] for i in range(len(data))]) == ref_sse(data)


@FUZZ
@given(stream_bytes, st.lists(st.integers(0, 200), max_size=6))
def test_ndjson_parser_matches_reference_in_any_split(data: bytes, cuts: list[int]) -> None:
    assert run_ndjson(split(data, cuts)) == ref_ndjson(data)


# ------------------------------------------------------------------ mergers

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
_KEYS = [
    "choices",
    "index",
    "delta",
    "message",
    "content",
    "role",
    "reasoning",
    "reasoning_content",
    "thinking",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "id",
    "type",
    "finish_reason",
    "logprobs",
    "text",
    "usage",
    "done",
    "error",
    "response",
    "object",
]
# Objects whose keys are the ones the mergers look at, with values of any type.
shaped = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5),
    ),
    max_leaves=25,
)
events_st = st.lists(
    st.one_of(st.dictionaries(st.sampled_from(_KEYS), shaped, max_size=5), json_values),
    max_size=8,
)


@FUZZ
@given(events_st)
def test_sse_merger_never_raises(events: list[Any]) -> None:
    merger = SSEMerger()
    for event in events:
        merger.add(event)
    result = merger.result()
    if not any(isinstance(e, dict) for e in events):
        assert result is None
        return
    assert result is not None
    assert result["object"] == "chat.completion"
    assert isinstance(result["choices"], list)
    indexes = [c["index"] for c in result["choices"]]
    assert indexes == sorted(set(indexes))
    canonical.dumps(result)  # serialisable
    assert canonical.dumps(merger.result()) == canonical.dumps(result)  # repeatable


@FUZZ
@given(events_st)
def test_ndjson_merger_never_raises(events: list[Any]) -> None:
    merger = NDJSONMerger()
    for event in events:
        merger.add(event)
    result = merger.result()
    dicts = [e for e in events if isinstance(e, dict)]
    if not dicts:
        assert result is None
        return
    assert result is not None
    canonical.dumps(result)
    done = [d for d in dicts if d.get("done") is True]
    base = done[-1] if done else dicts[-1]
    special = {"message", "error", "response", "thinking"}
    assert {k: v for k, v in result.items() if k not in special} == {
        k: v for k, v in base.items() if k not in special
    }


# One step of a synthetic OpenAI-style stream: (choice index, what, text).
step = st.tuples(
    st.integers(0, 2),
    st.sampled_from(["content", "reasoning_content", "reasoning", "tool0", "tool1"]),
    st.text(max_size=4),
)


@FUZZ
@given(st.lists(step, max_size=30))
def test_sse_merger_concatenates_exactly(steps: list[tuple[int, str, str]]) -> None:
    merger = SSEMerger()
    expected: dict[int, dict[str, str]] = {}
    for index, what, text in steps:
        got = expected.setdefault(index, {})
        if what.startswith("tool"):
            tool = int(what[-1])
            delta: dict[str, Any] = {
                "tool_calls": [
                    {"index": tool, "id": f"c{tool}", "function": {"name": "f", "arguments": text}}
                ]
            }
        else:
            delta = {what: text}
        got[what] = got.get(what, "") + text
        merger.add({"choices": [{"index": index, "delta": delta, "finish_reason": None}]})
    result = merger.result()
    if not steps:
        assert result is None
        return
    assert result is not None
    assert [c["index"] for c in result["choices"]] == sorted(expected)
    for choice in result["choices"]:
        want = expected[choice["index"]]
        msg = choice["message"]
        assert msg["content"] == want.get("content")  # None when no content delta
        for key in ("reasoning_content", "reasoning"):
            assert msg.get(key) == want.get(key)
        tools = [t for t in ("tool0", "tool1") if t in want]
        if tools:
            assert msg["tool_calls"] == [
                {
                    "id": f"c{t[-1]}",
                    "type": None,
                    "function": {"name": "f", "arguments": want[t]},
                }
                for t in tools
            ]
        else:
            assert "tool_calls" not in msg


ndjson_line = st.tuples(
    st.text(max_size=4),
    st.none() | st.text(max_size=4),
    st.lists(st.dictionaries(st.sampled_from(["id", "x"]), st.integers(0, 9)), max_size=2),
)


@FUZZ
@given(st.lists(ndjson_line, max_size=10), st.booleans())
def test_ndjson_merger_concatenates_exactly(
    lines: list[tuple[str, str | None, list[dict[str, int]]]], with_done: bool
) -> None:
    merger = NDJSONMerger()
    for content, thinking, tools in lines:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking is not None:
            msg["thinking"] = thinking
        if tools:
            msg["tool_calls"] = tools
        merger.add({"message": msg, "done": False})
    if with_done:
        merger.add({"message": {"role": "assistant", "content": ""}, "done": True, "eval_count": 3})
    result = merger.result()
    if not lines and not with_done:
        assert result is None
        return
    assert result is not None
    msg = result["message"]
    assert msg["content"] == "".join(c for c, _, _ in lines)
    thinking_parts = [t for _, t, _ in lines if t is not None]
    if thinking_parts:
        assert msg["thinking"] == "".join(thinking_parts)
    else:
        assert "thinking" not in msg
    all_tools = [t for _, _, tools in lines for t in tools]
    assert msg.get("tool_calls") == (all_tools or None)
    assert result["done"] is with_done
    assert ("eval_count" in result) is with_done


# ------------------------------------------------------------- StreamCapture


@FUZZ
@given(
    st.sampled_from(["sse", "ndjson"]),
    st.lists(stream_bytes, max_size=5),
    st.integers(0, 400),
)
def test_capture_never_raises_and_accounts_bytes(
    kind: str, pieces: list[bytes], limit: int
) -> None:
    cap = StreamCapture(kind, limit)
    for piece in pieces:
        cap.feed(piece)
    cap.close()
    total = sum(len(p) for p in pieces)
    assert cap.body_bytes == total
    assert cap.truncated is (total > limit)
    assert 0 <= cap.bad_chunks <= cap.chunks
    assert cap.internal_errors == 0
    merged = cap.merged()
    if merged is not None:
        canonical.dumps(merged)
    assert cap.internal_errors == 0


@FUZZ
@given(st.sampled_from(["sse", "ndjson"]), stream_bytes, st.lists(st.integers(0, 200), max_size=4))
def test_capture_is_split_invariant(kind: str, data: bytes, cuts: list[int]) -> None:
    def run(pieces: list[bytes]) -> tuple[Any, ...]:
        cap = StreamCapture(kind, 1 << 20)
        for piece in pieces:
            cap.feed(piece)
        cap.close()
        return cap.chunks, cap.bad_chunks, cap.done_seen, canonical.dumps(cap.merged())

    assert run(split(data, cuts)) == run([data])


def _is_object(text: str) -> bool:
    try:
        return isinstance(canonical.loads(text), dict)
    except canonical.NotJSON:
        return False


# A garbage event: one line of text that is not a JSON object (and not the
# [DONE] sentinel), or valid JSON that is not an object.
garbage = st.one_of(
    st.text(min_size=1, max_size=20),
    json_scalars.map(lambda v: json.dumps(v)),
    st.lists(json_scalars, max_size=3).map(json.dumps),
).filter(
    lambda g: (
        g.strip(" \t") != ""
        and not any(c in g for c in "\r\n\ufeff")
        and g.strip() != "[DONE]"
        and not _is_object(g)
    )
)
valid_texts = st.lists(st.text(max_size=6), min_size=1, max_size=8)
placements = st.lists(st.tuples(st.integers(0, 8), garbage), max_size=4)


@FUZZ
@given(valid_texts, placements, st.lists(st.integers(0, 2000), max_size=4))
def test_sse_garbage_events_lose_nothing(
    texts: list[str], bad: list[tuple[int, str]], cuts: list[int]
) -> None:
    events = [
        "data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": t}}]}, ensure_ascii=False)
        + "\n\n"
        for t in texts
    ]
    for pos, g in sorted(bad, key=lambda x: x[0], reverse=True):
        events.insert(min(pos, len(events)), f"data: {g}\n\n:\n\n")
    data = ("".join(events) + "data: [DONE]\n\n").encode()
    cap = StreamCapture("sse", 1 << 20)
    for piece in split(data, cuts):
        cap.feed(piece)
    cap.close()
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (len(texts) + len(bad), len(bad), True)
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "".join(texts)


@FUZZ
@given(valid_texts, placements, st.lists(st.integers(0, 2000), max_size=4))
def test_ndjson_garbage_lines_lose_nothing(
    texts: list[str], bad: list[tuple[int, str]], cuts: list[int]
) -> None:
    lines = [
        json.dumps({"message": {"role": "assistant", "content": t}, "done": False}) + "\n"
        for t in texts
    ]
    for pos, g in sorted(bad, key=lambda x: x[0], reverse=True):
        lines.insert(min(pos, len(lines)), g + "\n\n")
    lines.append('{"message":{"role":"assistant","content":""},"done":true,"eval_count":7}')
    data = "".join(lines).encode()
    cap = StreamCapture("ndjson", 1 << 20)
    for piece in split(data, cuts):
        cap.feed(piece)
    cap.close()
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (
        len(texts) + len(bad) + 1,
        len(bad),
        True,
    )
    merged = cap.merged()
    assert merged == {
        "message": {"role": "assistant", "content": "".join(texts)},
        "done": True,
        "eval_count": 7,
    }
