"""The builder's fast paths give what the plain paths give, byte for byte.

Two of them, both taken in the builder child for every chat exchange:

- `SSEMerger.add_same_run` folds an event that repeats the last one but for
  the string it appends (llama-server's content delta) from its text;
  the plain path parses every event and merges it (`add`).
- `ChatApi.request_digest_bytes` looks each message's digest up by its
  bytes (`DigestCache`); the plain path parses the whole body and digests
  every message.

Each is compared with its plain path on the harness captures, whole
records included, and on random and hostile input.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmp.apis import APIS, api_for
from llmp.apis.base import ChatApi, DigestCache
from llmp.format import canonical
from llmp.recorder import stream as stream_mod
from llmp.recorder.capture import Capture
from llmp.recorder.record import build_line
from llmp.recorder.stream import StreamCapture
from tests.support.replay import load_capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness"
CAPTURES = sorted(FIXTURES.glob("*.jsonl.gz"))
_OPENAI = api_for("POST", "/v1/chat/completions")
assert _OPENAI is not None
OPENAI: ChatApi = _OPENAI


def plain_digest(api: ChatApi, data: bytes) -> Any:
    """The request digest the plain way: the whole body parsed, then digested."""
    try:
        body = canonical.loads(data)
    except canonical.NotJSON:
        return None
    return api.request_digest(body) if isinstance(body, dict) else None


def _outcome(fn: Any) -> Any:
    try:
        return "ok", canonical.record_dumps(fn())
    except Exception as exc:  # the same failure counts as the same outcome
        return "error", type(exc).__name__


def same_digest(api: ChatApi, data: bytes) -> None:
    want = _outcome(lambda: plain_digest(api, data))
    assert _outcome(lambda: api.request_digest_bytes(data)) == want  # cold or warm
    assert _outcome(lambda: api.request_digest_bytes(data)) == want  # warm


class _PlainStream(StreamCapture):
    """`StreamCapture` with the fast path off: every event parsed and merged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run = None


def _stream_outcome(cls: type[StreamCapture], pieces: list[bytes]) -> Any:
    s = cls("sse", sum(map(len, pieces)) + 1, OPENAI)
    for piece in pieces:
        s.feed(piece)
    s.close()
    merged = s.merged()
    return (
        None if merged is None else canonical.record_dumps(merged),
        s.chunks,
        s.bad_chunks,
        s.done_seen,
        s.internal_errors,
    )


def same_stream(pieces: list[bytes]) -> None:
    assert _stream_outcome(StreamCapture, pieces) == _stream_outcome(_PlainStream, pieces)


# ------------------------------------------------------------------ the captures


def _capture(ex: Any, n: int) -> Capture:
    cap = Capture(id=n, conn=ex.conn, t_start_ms=int(ex.t_start * 1000))
    cap.raw_method = ex.method.encode()
    cap.raw_path = ex.path.encode()
    cap.request_fields = tuple((k.encode(), v.encode()) for k, v in ex.request_headers)
    cap.request_complete = True
    cap.request_body = ex.request_body
    cap.request_body_bytes = len(ex.request_body)
    if ex.status is not None:
        cap.status = ex.status
        cap.response_fields = tuple((k.encode(), v.encode()) for k, v in ex.response_headers)
        cap.tapped = True
        cap.pieces = [p for _, p in ex.pieces]
        cap.times = [t for t, _ in ex.pieces]
    cap.t_end_ms = int((ex.t_end or ex.t_start) * 1000)
    return cap


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
@pytest.mark.parametrize("mode", ["digest", "full"])
def test_capture_records_are_the_same(
    path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    exchanges = load_capture(path)
    fast = [build_line(_capture(ex, n), mode) for n, ex in enumerate(exchanges)]
    fast_again = [build_line(_capture(ex, n), mode) for n, ex in enumerate(exchanges)]
    monkeypatch.setattr(ChatApi, "request_digest_bytes", plain_digest)
    monkeypatch.setattr(stream_mod, "StreamCapture", _PlainStream)
    import llmp.recorder.record as record_mod

    monkeypatch.setattr(record_mod, "StreamCapture", _PlainStream)
    plain = [build_line(_capture(ex, n), mode) for n, ex in enumerate(exchanges)]
    assert fast == plain
    assert fast_again == plain


def test_the_captures_take_the_fast_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: the captures' bodies hit the cache, their streams are folded."""
    parsed = 0
    real_loads = canonical.loads

    def counting_loads(*args: Any, **kwargs: Any) -> Any:
        nonlocal parsed
        parsed += 1
        return real_loads(*args, **kwargs)

    hits = chunks = 0
    for path in CAPTURES:
        for ex in load_capture(path):
            api = api_for(ex.method, ex.path)
            if api is None or not ex.request_body:
                continue
            cache = api._cache = DigestCache()
            api.request_digest_bytes(ex.request_body)
            before = len(cache)
            api.request_digest_bytes(ex.request_body)
            hits += before > 0 and len(cache) == before
            if api is OPENAI and ex.pieces:
                s = StreamCapture("sse", 1 << 30, api)
                with monkeypatch.context() as m:
                    m.setattr(canonical, "loads", counting_loads)
                    for _, p in ex.pieces:
                        s.feed(p)
                chunks += s.chunks
    assert hits > 10
    assert chunks - parsed > 100  # events folded without a parse


# ------------------------------------------------------------ request digests

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", None, 3])
MARKER = st.fixed_dictionaries({}, optional={"ttl": JSON, "type": st.just("ephemeral")}) | JSON
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "tool_result", "input_text"])},
    optional={
        "text": st.text(max_size=4),
        "cache_control": MARKER,
        "prompt_cache_breakpoint": MARKER,
        "content": st.lists(
            st.fixed_dictionaries({"type": st.just("image")}, optional={"cache_control": MARKER}),
            max_size=2,
        ),
    },
)
"""A content block with R35's cache markers, nested ones and images (R35's `cache`)."""
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.text(max_size=20) | st.lists(PART | JSON, max_size=3) | JSON,
        "output": st.lists(PART, max_size=2),
        "tool_calls": st.lists(JSON, max_size=2),
        "tool_call_id": st.text(max_size=5),
        "name": st.text(max_size=5),
        "type": st.sampled_from(["message", "function_call", "function_call_output"]),
        "call_id": st.text(max_size=5),
    },
)
ITEM = MESSAGE | JSON
BODY = st.fixed_dictionaries(
    {"messages": st.lists(ITEM, max_size=6)},
    optional={
        "model": st.text(max_size=6) | JSON,
        "stream": st.booleans() | JSON,
        "tools": st.lists(
            st.fixed_dictionaries({"name": st.text(max_size=3)}, optional={"cache_control": MARKER})
            | JSON,
            max_size=3,
        )
        | JSON,
        "system": st.text(max_size=10) | st.lists(PART | JSON, max_size=2),
        "instructions": st.text(max_size=10),
        "max_tokens": st.integers(-5, 1 << 66),
        "response_format": JSON,
        # R35's `cache`: the top-level fields it reads
        "cache_control": MARKER,
        "prompt_cache_key": st.text(max_size=6) | JSON,
        "prompt_cache_retention": JSON,
        "prompt_cache_options": st.fixed_dictionaries(
            {}, optional={"mode": JSON, "ttl": JSON, "comparison_response_id": JSON}
        )
        | JSON,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON}) | JSON,
        "thinking": JSON,
        "tool_choice": JSON,
        "reasoning": st.fixed_dictionaries({}, optional={"effort": JSON}) | JSON,
        "text": st.fixed_dictionaries({}, optional={"verbosity": JSON, "format": JSON}) | JSON,
        "speed": JSON,
    },
)


def _dump(value: Any, rng: random.Random) -> str:
    """JSON text of a value with random spacing and escaping (floats spelled oddly too)."""
    if isinstance(value, dict):
        sep = rng.choice([",", ", ", " ,\n"])
        colon = rng.choice([":", ": ", " : "])
        inner = sep.join(_dump(k, rng) + colon + _dump(v, rng) for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + rng.choice([",", ", "]).join(_dump(v, rng) for v in value) + "]"
    if isinstance(value, float):
        return rng.choice([repr(value), f"{value:.17e}", json.dumps(value)])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def _mangle(text: bytes, rng: random.Random) -> bytes:
    """Sometimes break the body the way hostile traffic would."""
    roll = rng.random()
    at = rng.randrange(len(text) + 1)
    if roll < 0.1:
        return text[:at] + b"\xff" + text[at:]  # invalid UTF-8
    if roll < 0.2 and text.startswith(b"{"):
        return b'{"messages":[{"role":"\xff"}],' + text[1:]  # a repeated key, hiding bad text
    if roll < 0.3 and text.startswith(b"{"):
        return b'{"messages":"x",' + text[1:]  # a repeated key, first not an array
    if roll < 0.35:
        return text[:at] + b'"\\ud800"' + text[at:]
    if roll < 0.4:
        return text[:at]
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODY, st.randoms(use_true_random=False))
def test_random_bodies_digest_the_same(body: dict[str, Any], rng: random.Random) -> None:
    data = _mangle(_dump(body, rng).encode("utf-8", "surrogatepass"), rng)
    for api in APIS:
        same_digest(api, data)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_hostile_bodies_digest_the_same(api: ChatApi) -> None:
    m = '{"role":"user","content":"hi"}'
    cases = [
        "{}",
        "[]",
        '{"messages":[]}',
        '{"messages":null}',
        '{"messages":"text"}',
        '{"input":"text","messages":[1]}',
        f'{{"messages":[{m},{m}]}}',
        f'{{"messages":[{m}],"messages":[{m},{m}]}}',  # repeated key: the last wins
        f'{{"messages":[{m}],"model":"a","model":"b"}}',
        f'{{"model":1,"messages":[{m}],"model":12}}',
        f'{{"messages":[{m}]}} x',
        f' \r\n{{ "messages" : [ {m} ] }}\n',
        f'{{"mess\\u0061ges":[{m}]}}',
        '{"messages":[{"role":"user","content":"\\ud800"}]}',
        '{"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}',
        '{"messages":[{"role":"user","content":1.50,"x":1e400}]}',
        '{"messages":[{"role":"user","content":1.5}]}',  # not the same bytes as 1.50
        '{"messages":[{"role":"user","content":123456789012345678901234567890}]}',
        '{"messages":[{"role":"user","content":-0}]}',
        '{"messages":[{"role":"user","content":"a","content":"b"}]}',
        *(f'{{"messages":[{{"content":{_nested(d)}}}]}}' for d in (123, 124, 125, 126, 127)),
        *(f'{{"messages":[{_nested(d)}]}}' for d in (124, 125, 126, 127)),
        *(f'{{"tools":{_nested(d)},"messages":[]}}' for d in (125, 126, 127)),
    ]
    for text in cases:
        same_digest(api, text.encode())
    same_digest(api, b'{"messages":[{"role":"\xff"}]}')
    same_digest(api, b"\xef\xbb\xbf" + f'{{"messages":[{m}]}}'.encode())


def test_the_cache_is_bounded_in_bytes() -> None:
    cache = DigestCache(max_bytes=10_000)
    for i in range(100):
        cache.put(b"x" * 1000 + str(i).encode(), {"i": i})
    assert cache.size <= 10_000
    assert 0 < len(cache) < 10
    assert cache.get(b"x" * 1000 + b"99") == {"i": 99}
    assert cache.get(b"x" * 1000 + b"0") is None  # the oldest went first
    cache.put(b"y" * 20_000, {"i": -1})
    assert cache.get(b"y" * 20_000) is None  # larger than the whole cache: not kept
    # A long message's entry counts its chunk lists too (about 1-2 KB beyond its bytes).
    short, long = DigestCache(max_bytes=100_000), DigestCache(max_bytes=100_000)
    short.put(b"s" * 400, {})
    long.put(b"l" * 600, {})
    assert long.size - short.size > 200 + 1000


def test_a_growing_conversation_hits_all_but_the_new_messages() -> None:
    api = OPENAI
    cache = api._cache = DigestCache()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for turn in range(5):
        messages.append({"role": "user", "content": f"question {turn}"})
        data = json.dumps({"model": "m", "messages": messages}).encode()
        before = len(cache)
        same_digest(api, data)
        assert len(cache) == before + 2  # the last reply and the new question
        messages.append({"role": "assistant", "content": f"answer {turn}"})


# ------------------------------------------------------------------ streams

_CHUNK = (
    '{{"choices":[{{"finish_reason":null,"index":0,"delta":{{{delta}}}}}]{extra},'
    '"created":1760000000,"id":"chatcmpl-x","model":"m","object":"chat.completion.chunk"}}'
)


def _event(text: str) -> bytes:
    return b"data: " + text.encode("utf-8", "surrogatepass") + b"\n\n"


def _content(value: str, key: str = "content", ascii_only: bool = False) -> str:
    return _CHUNK.format(delta=f'"{key}":{json.dumps(value, ensure_ascii=ascii_only)}', extra="")


def test_llama_server_stream_is_folded_the_same() -> None:
    events = [_CHUNK.format(delta='"role":"assistant","content":null', extra="")]
    events += [_content(f" w{i}") for i in range(50)]
    events.append(_CHUNK.format(delta="", extra=',"timings":{"prompt_n":1,"prompt_ms":1.50}'))
    pieces = [_event(e) for e in events] + [b"data: [DONE]\n\n"]
    same_stream(pieces)
    same_stream([b"".join(pieces)])


ODD = [
    'a"b',
    "a\\",
    '","role":"x',
    '"},{"index":1,"delta":{"content":"z',
    "\\ud800",
    "\\u0041",
    "\x01",
    "\x7f",
    "\u2028",
    "\U0001f600",
    "",
    'x","content":"y',
    "\\n",
    "\\",
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("content"), st.text(max_size=6), st.booleans()),
            st.tuples(st.just("reasoning_content"), st.text(max_size=6), st.booleans()),
            st.tuples(st.just("raw"), st.sampled_from(ODD), st.booleans()),
            st.tuples(st.just("other"), st.sampled_from(range(8)), st.booleans()),
        ),
        max_size=12,
    )
)
def test_random_streams_are_folded_the_same(steps: list[tuple[str, Any, bool]]) -> None:
    others = [
        _CHUNK.format(delta='"role":"assistant","content":null', extra=""),
        _CHUNK.format(delta='"content":"a","content":"b"', extra=""),
        _CHUNK.format(delta='"content":"a"', extra=',"usage":{"x":1}'),
        _CHUNK.format(delta='"content":"a"', extra=',"usage":null'),
        _CHUNK.format(delta='"content":"a","reasoning":"r"', extra=""),
        _CHUNK.format(delta='"tool_calls":[{"index":0,"function":{"arguments":"{"}}]', extra=""),
        '{"choices":[{"index":0,"delta":{"content":"q"},"logprobs":{"content":[1]}}]}',
        '{"choices":[{"index":0,"text":"t","delta":{"content":"q"}}]}',
    ]
    events = []
    for kind, value, flag in steps:
        if kind == "raw":
            events.append(_CHUNK.format(delta=f'"content":"{value}"', extra=""))
        elif kind == "other":
            events.append(others[value])
        else:
            events.append(_content(value, kind, flag))
    pieces = [_event(e) for e in events]
    same_stream(pieces)
    same_stream([b"".join(pieces)])
