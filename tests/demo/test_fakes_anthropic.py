"""The fake llama-server's `/v1/messages` (Anthropic Messages API), driven by the real SDK."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.upstreams import LLAMA_MODEL_FILE, MIDSTREAM_ERROR_MESSAGE, PING, Upstream

SYSTEM: Any = [
    {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=2.1.328.7c2; cc_entrypoint=cli;",
    },
    {
        "type": "text",
        "text": "You are Claude Code. " * 40,
        "cache_control": {"type": "ephemeral"},
    },
]
WEATHER_TOOL: Any = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as st:
        yield st


def client(stack: contextlib.ExitStack, url: str, **headers: str) -> anthropic.Anthropic:
    c = anthropic.Anthropic(
        base_url=url, api_key="x", max_retries=0, timeout=10, default_headers=headers
    )
    return stack.enter_context(c)


def body(*messages: Any, stream: bool = True, **extra: Any) -> dict[str, Any]:
    msgs = list(messages) or [{"role": "user", "content": "hi there"}]
    return {"model": "claude", "max_tokens": 32000, "messages": msgs, "stream": stream} | extra


def raw(url: str, req: dict[str, Any], **headers: str) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.post(url + "/v1/messages?beta=true", json=req, headers=headers)


def events(up: Upstream) -> list[tuple[str | None, dict[str, Any]]]:
    return [(name, json.loads(data)) for name, data in up.last.sse_events()]


# ------------------------------------------------------------------ the SDK


def test_create_not_streamed(llama: Upstream, stack: contextlib.ExitStack) -> None:
    msg = client(stack, llama.url).messages.create(
        model="claude-sonnet",
        max_tokens=1000,
        system=SYSTEM,
        messages=[{"role": "user", "content": "hi there"}],
    )
    assert msg.model == LLAMA_MODEL_FILE and msg.id.startswith("chatcmpl-")
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert [b.type for b in msg.content] == ["thinking", "text"]
    thinking, text = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think about it."
    assert thinking.signature == ""
    assert text.type == "text" and text.text == "Hello from fake llama"
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.output_tokens == 9
    ex = llama.wait_for_requests(1)[0]
    assert ex.response_header("content-type") == "application/json; charset=utf-8"
    obj = json.loads(ex.body)
    keys = ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]
    assert list(obj) == keys  # no timings
    assert list(obj["usage"]) == ["cache_read_input_tokens", "input_tokens", "output_tokens"]
    # input_tokens is the whole prompt here: nothing was cached yet
    count = client(stack, llama.url).messages.count_tokens(
        model="claude-sonnet", system=SYSTEM, messages=[{"role": "user", "content": "hi there"}]
    )
    assert count.input_tokens == msg.usage.input_tokens
    assert json.loads(llama.last.body) == {"input_tokens": count.input_tokens}


def test_stream_helper_and_final_message(llama: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, llama.url)
    with c.messages.stream(
        model="claude", max_tokens=1000, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from fake llama"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == "Let me think about it."
    assert final.stop_reason == "end_turn" and final.model == LLAMA_MODEL_FILE
    assert final.usage.output_tokens == 9 and final.usage.cache_read_input_tokens == 0
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "complete" and ex.response_header("content-type") == "text/event-stream"


def test_stream_framing(llama: Upstream) -> None:
    r = raw(llama.url, body(system=SYSTEM))
    ex = llama.wait_for_requests(1)[0]
    assert r.status_code == 200 and r.content == ex.body
    data = ex.decoded_body
    assert data.startswith(PING + b"event: message_start\ndata: {")  # the keep-alive comes first
    assert b"[DONE]" not in data and b"timings" not in data
    blocks = data.split(b"\n\n")
    assert blocks[-1] == b"" and blocks[0] == b":"
    for block in blocks[1:-1]:
        name, payload = block.split(b"\n")
        assert name.startswith(b"event: ") and payload.startswith(b"data: ")
        assert json.loads(payload[6:])["type"] == name[7:].decode()
    # each event, the ping too, is one write
    assert [w for _, w in ex.writes] == [b + b"\n\n" for b in blocks[:-1]]
    evs = events(llama)
    assert {n for n, _ in evs} == EVENTS
    assert [n for n, _ in evs][-2:] == ["message_delta", "message_stop"]
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    # the blocks are all closed at the end: thinking (with an empty signature), then text
    names = [n for n, _ in evs]
    first_stop = names.index("content_block_stop")
    assert "content_block_start" not in names[first_stop:]
    starts = [e["content_block"] for n, e in evs if n == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": ""}, {"type": "text", "text": ""}]
    deltas = [e["delta"] for n, e in evs if n == "content_block_delta"]
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}
    assert "".join(d.get("thinking", "") for d in deltas) == "Let me think about it."
    assert "".join(d.get("text", "") for d in deltas) == "Hello from fake llama"
    assert [e["index"] for n, e in evs if n == "content_block_stop"] == [0, 1]
    final = evs[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"] == {"output_tokens": 9}
    assert ex.path == "/v1/messages?beta=true"


def test_no_ping_and_old_build(llama: Upstream) -> None:
    raw(llama.url, body(), **{"x-fake": "no_ping"})
    assert llama.last.decoded_body.startswith(b"event: message_start\n")
    raw(llama.url, body(), **{"x-fake": "old_build"})
    assert PING not in llama.last.decoded_body
    usage = events(llama)[0][1]["message"]["usage"]
    assert list(usage) == ["input_tokens", "output_tokens"]  # no cache counter, whole prompt
    r = raw(llama.url, body(stream=False), **{"x-fake": "no_reasoning"})
    assert [b["type"] for b in r.json()["content"]] == ["text"]


# ------------------------------------------------------------------- counters


def test_prefix_reuse_cache_control_ignored(llama: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, llama.url)
    turn1: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    first = c.messages.create(model="c", max_tokens=100, system=SYSTEM, messages=turn1)
    assert first.usage.cache_read_input_tokens == 0
    # Claude Code's next turn: the same user message as a plain string, cache_control moved
    turn2: Any = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello from fake llama"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and more", "cache_control": {"type": "ephemeral"}}
            ],
        },
    ]
    system2: Any = [SYSTEM[0], {"type": "text", "text": SYSTEM[1]["text"]}]
    with c.messages.stream(model="c", max_tokens=100, system=system2, messages=turn2) as s:
        second = s.get_final_message()
    cached = second.usage.cache_read_input_tokens or 0
    assert cached >= first.usage.input_tokens - 1
    total = c.messages.count_tokens(model="c", system=system2, messages=turn2).input_tokens
    assert second.usage.input_tokens + cached == total  # input_tokens: the evaluated part only
    # count_tokens does not touch the slot: the same prompt again is all cached but one token
    third = c.messages.create(model="c", max_tokens=100, system=system2, messages=turn2)
    assert third.usage.input_tokens == 1 and third.usage.cache_read_input_tokens == total - 1
    # a changed first block (the billing header's suffix) leaves nothing to reuse
    system3: Any = [
        {"type": "text", "text": SYSTEM[0]["text"].replace("7c2", "119")},
        system2[1],
    ]
    fourth = c.messages.create(model="c", max_tokens=100, system=system3, messages=turn2)
    assert (fourth.usage.cache_read_input_tokens or 0) < 20


def test_same_slot_as_chat(llama: Upstream, stack: contextlib.ExitStack) -> None:
    """A conversation sent to chat and then to /v1/messages is the same prompt."""
    o = stack.enter_context(openai.OpenAI(base_url=llama.url + "/v1", api_key="x", max_retries=0))
    chat = o.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "You are terse. " * 20},
            {"role": "user", "content": "hi"},
        ],
    )
    assert chat.usage is not None
    msg = client(stack, llama.url).messages.create(
        model="m",
        max_tokens=50,
        system="You are terse. " * 20,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    )
    assert msg.usage.input_tokens == 1
    assert msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens - 1


# ---------------------------------------------------------------------- tools


def test_tool_use(llama: Upstream, stack: contextlib.ExitStack) -> None:
    c = client(stack, llama.url)
    ask: Any = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    with c.messages.stream(model="c", max_tokens=100, tools=[WEATHER_TOOL], messages=ask) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    tool = final.content[-1]
    assert tool.type == "tool_use" and tool.name == "get_weather"
    assert tool.input == {"city": "Tokyo"}
    assert len(tool.id) == 32 and tool.id.isalnum()
    evs = events(llama)
    starts = [e for n, e in evs if n == "content_block_start"]
    assert starts[-1]["content_block"] == {"type": "tool_use", "id": tool.id, "name": "get_weather"}
    fragments = [
        e["delta"]["partial_json"]
        for n, e in evs
        if n == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == {"city": "Tokyo"}
    assert {e["index"] for n, e in evs if n == "content_block_delta"} == {0, 1}
    # not streamed, then the tool result: the model answers in text, reusing the prompt
    full = c.messages.create(model="c", max_tokens=100, tools=[WEATHER_TOOL], messages=ask)
    assert full.content[-1].type == "tool_use" and full.content[-1].input == {"city": "Tokyo"}
    assert full.usage.input_tokens == 1  # the same prompt again
    history: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in full.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "sunny"}],
        },
    ]
    answer = c.messages.create(model="c", max_tokens=100, tools=[WEATHER_TOOL], messages=history)
    assert answer.stop_reason == "end_turn" and answer.content[-1].type == "text"
    assert (answer.usage.cache_read_input_tokens or 0) >= full.usage.input_tokens + (
        full.usage.cache_read_input_tokens or 0
    ) - 1


def test_max_tokens_cuts(llama: Upstream, stack: contextlib.ExitStack) -> None:
    msg = client(stack, llama.url).messages.create(
        model="c", max_tokens=7, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 7
    assert msg.content[-1].type == "text" and msg.content[-1].text == "Hello from"


# --------------------------------------------------------------------- faults


def test_context_error(stack: contextlib.ExitStack) -> None:
    with Upstream("llama", n_ctx=16) as small:
        with pytest.raises(anthropic.BadRequestError, match="exceeds the available context"):
            with client(stack, small.url).messages.stream(
                model="c", max_tokens=10, messages=[{"role": "user", "content": "x" * 100}]
            ) as s:
                s.get_final_message()
        r = raw(small.url, body({"role": "user", "content": "x" * 100}))
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error" and err["code"] == 400
        # counting is no generation: no context check
        counted = httpx.post(
            small.url + "/v1/messages/count_tokens?beta=true",
            json={"model": "c", "messages": [{"role": "user", "content": "x" * 100}]},
        )
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 16


def test_cut_before_message_stop(llama: Upstream, stack: contextlib.ExitStack) -> None:
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream(
            "POST",
            llama.url + "/v1/messages",
            json=body(),
            headers={"x-fake": "die_midstream,error_after=4"},
        ) as r:
            for piece in r.iter_raw():
                got += piece
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "died" and got == ex.body
    assert len(ex.sse_events()) == 4 and b"message_stop" not in got
    # the error event, then a clean end
    raw(llama.url, body(), **{"x-fake": "midstream_error,error_after=3"})
    ex = llama.wait_for_requests(2)[1]
    assert ex.outcome == "error_event"
    name, data = ex.sse_events()[-1]
    assert name == "error" and json.loads(data) == {
        "type": "error",
        "error": {"code": 500, "message": MIDSTREAM_ERROR_MESSAGE, "type": "server_error"},
    }
    c = client(stack, llama.url, **{"x-fake": "midstream_error,error_after=5"})
    with pytest.raises(anthropic.APIStatusError, match="error while generating"):
        with c.messages.stream(
            model="c", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            s.get_final_message()
    with pytest.raises(httpx.HTTPError):
        with httpx.stream(
            "POST", llama.url + "/v1/messages", json=body(), headers={"x-fake": "reset_midstream"}
        ) as r:
            for _ in r.iter_raw():
                pass
    assert llama.wait_for_requests(4)[3].outcome == "reset"


def test_delays_and_split(llama: Upstream) -> None:
    raw(llama.url, body(), **{"x-fake": "slow,no_ping"})
    ex = llama.last
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(ex.event_times))
    raw(llama.url, body(), **{"x-fake": "split,events=20,no_reasoning"})
    ex = llama.last
    texts = [json.loads(d).get("delta", {}).get("text") for _, d in ex.sse_events()]
    assert len([t for t in texts if t]) == 20
    assert len(ex.writes) == 2 * (len(ex.sse_events()) + 1)  # every event and the ping, in two
    r = raw(llama.url, body(), **{"x-fake": "status=503"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
    r = raw(llama.url, body(stream=False), **{"x-fake": "cache_miss"})
    assert r.json()["usage"]["cache_read_input_tokens"] == 0


def test_bad_body_and_other_methods(llama: Upstream) -> None:
    r = httpx.post(llama.url + "/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(llama.url + "/v1/messages").status_code == 404
    with Upstream("ollama") as oll:  # the Ollama fake does not serve it
        assert httpx.post(oll.url + "/v1/messages", json=body()).status_code == 404
