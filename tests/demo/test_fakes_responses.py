"""The fake llama-server's `/v1/responses` (OpenAI Responses API), driven by the real SDK.

`responses.create(stream=True)` reads llama-server's stream; the SDK's
`responses.stream()` helper fails on it (no `content_index`), so it is not used.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.upstreams import LLAMA_MODEL_FILE, MIDSTREAM_ERROR_MESSAGE, PING, Upstream

TIMINGS_KEYS = [
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
]
WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
DEVELOPER: Any = {
    "type": "message",
    "id": "msg_dev",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are Codex. " * 40}],
}
TEXT_STREAM = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",  # the reasoning item
    *["response.reasoning_text.delta"] * 5,
    "response.output_item.added",  # the message item
    "response.content_part.added",
    *["response.output_text.delta"] * 4,
    "response.output_item.done",  # reasoning
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",  # message
    "response.completed",
]


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as st:
        yield st


def oai(stack: contextlib.ExitStack, url: str, **headers: str) -> openai.OpenAI:
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=10, default_headers=headers
    )
    return stack.enter_context(client)


def codex_input(prompt: str = "list the files") -> list[Any]:
    """What Codex sends: developer instructions as an item, the environment, the prompt."""
    env = {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "<environment_context>cwd</environment_context>"}
        ],
    }
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}
    return [DEVELOPER, env, ask]


def raw(url: str, req: dict[str, Any], **headers: str) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.post(url + "/v1/responses", json=req, headers=headers)


def events(up: Upstream) -> list[tuple[str | None, dict[str, Any]]]:
    return [(name, json.loads(data)) for name, data in up.last.sse_events()]


# ------------------------------------------------------------------ the SDK


def test_create_not_streamed(llama: Upstream, stack: contextlib.ExitStack) -> None:
    r = oai(stack, llama.url).responses.create(model="gpt-5", instructions="Be brief.", input="hi")
    assert r.output_text == "Hello from fake llama"
    assert r.status == "completed" and r.model == LLAMA_MODEL_FILE and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "Let me think about it."
    assert r.usage is not None and r.usage.output_tokens == 9
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + 9
    obj = json.loads(llama.wait_for_requests(1)[0].body)
    assert "timings" not in obj and "timings" not in (r.model_extra or {})
    assert list(obj) == [
        "completed_at",
        "created_at",
        "id",
        "model",
        "object",
        "output",
        "status",
        "usage",
    ]
    assert obj["output"][1]["id"].startswith("msg_") and obj["output"][0]["id"].startswith("rs_")
    assert llama.last.response_header("content-type") == "application/json; charset=utf-8"


def test_create_streamed(llama: Upstream, stack: contextlib.ExitStack) -> None:
    stream = oai(stack, llama.url).responses.create(model="m", input=codex_input(), stream=True)
    evs = list(stream)
    assert [e.type for e in evs] == TEXT_STREAM
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == "Hello from fake llama"
    last = evs[-1]
    assert last.type == "response.completed"
    assert last.response.output_text == "Hello from fake llama"
    usage = last.response.usage
    assert usage is not None and usage.output_tokens == 9
    timings = (last.model_extra or {})["timings"]  # beside `response`
    assert list(timings) == TIMINGS_KEYS
    assert timings["cache_n"] + timings["prompt_n"] == usage.input_tokens
    assert timings["cache_n"] == usage.input_tokens_details.cached_tokens
    assert all("timings" not in (e.model_extra or {}) for e in evs[:-1])
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "complete" and ex.response_header("content-type") == "text/event-stream"


def test_stream_framing(llama: Upstream) -> None:
    r = raw(llama.url, {"model": "m", "input": "hi", "stream": True})
    ex = llama.wait_for_requests(1)[0]
    assert r.status_code == 200 and r.content == ex.body
    data = ex.decoded_body
    assert data.startswith(PING + b"event: response.created\ndata: {")
    assert b"[DONE]" not in data
    blocks = data.split(b"\n\n")
    assert blocks[-1] == b""
    for block in blocks[1:-1]:
        name, payload = block.split(b"\n")
        assert json.loads(payload[6:])["type"] == name.removeprefix(b"event: ").decode()
    assert [w for _, w in ex.writes] == [b + b"\n\n" for b in blocks[:-1]]
    evs = events(llama)
    assert [n for n, _ in evs] == TEXT_STREAM
    for _, e in evs:  # llama-server numbers nothing
        assert not {"output_index", "content_index", "sequence_number"} & set(e)
    assert evs[0][1] == {
        "type": "response.created",
        "response": {
            "id": evs[-1][1]["response"]["id"],
            "object": "response",
            "status": "in_progress",
        },
    }
    completed = evs[-1][1]
    assert list(completed) == ["type", "response", "timings"]
    assert all("timings" not in e for _, e in evs[:-1])
    assert list(completed["response"]["usage"]) == [
        "input_tokens",
        "output_tokens",
        "total_tokens",
        "input_tokens_details",
    ]
    added = [e["item"] for n, e in evs if n == "response.output_item.added"]
    assert added[1] == {
        "content": [],
        "id": added[1]["id"],
        "role": "assistant",
        "status": "in_progress",
        "type": "message",
    }
    delta = next(e for n, e in evs if n == "response.output_text.delta")
    assert list(delta) == ["type", "item_id", "delta"] and delta["item_id"] == added[1]["id"]
    done = [e["item"] for n, e in evs if n == "response.output_item.done"]
    assert completed["response"]["output"] == done


def test_no_ping_old_build_no_reasoning(llama: Upstream) -> None:
    raw(llama.url, {"input": "hi", "stream": True}, **{"x-fake": "no_ping"})
    assert llama.last.decoded_body.startswith(b"event: response.created\n")
    raw(llama.url, {"input": "hi", "stream": True}, **{"x-fake": "old_build"})
    completed = events(llama)[-1][1]
    assert PING not in llama.last.decoded_body
    assert (
        "timings" not in completed and "input_tokens_details" not in completed["response"]["usage"]
    )
    r = raw(llama.url, {"input": "hi"}, **{"x-fake": "no_reasoning"})
    assert [o["type"] for o in r.json()["output"]] == ["message"]


# ------------------------------------------------------------------- counters


def test_prefix_reuse(llama: Upstream, stack: contextlib.ExitStack) -> None:
    client = oai(stack, llama.url)
    first = client.responses.create(model="m", input=codex_input(), tools=[WEATHER_TOOL])
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    # the next turn resends everything, with the reply and a reasoning item (not in the prompt)
    turn2 = [
        *codex_input(),
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": first.output_text}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "and then?"}],
        },
    ]
    stream = client.responses.create(model="m", input=turn2, tools=[WEATHER_TOOL], stream=True)
    last = list(stream)[-1]
    assert last.type == "response.completed" and last.response.usage is not None
    usage = last.response.usage
    cached = usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 1  # input_tokens includes the cached part
    timings = (last.model_extra or {})["timings"]
    assert timings["cache_n"] == cached and timings["prompt_n"] == usage.input_tokens - cached


def test_same_slot_as_chat(llama: Upstream, stack: contextlib.ExitStack) -> None:
    client = oai(stack, llama.url)
    chat = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Be brief. " * 20},
            {"role": "user", "content": "hi"},
        ],
    )
    assert chat.usage is not None
    r = client.responses.create(model="m", instructions="Be brief. " * 20, input="hi")
    assert r.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1


# ---------------------------------------------------------------------- tools


def test_function_call(llama: Upstream, stack: contextlib.ExitStack) -> None:
    client = oai(stack, llama.url)
    ask: Any = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    evs: list[Any] = list(
        client.responses.create(model="m", input=ask, tools=[WEATHER_TOOL], stream=True)
    )
    call = evs[-1].response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Tokyo"} and call.status == "completed"
    assert call.call_id.startswith("fc_") and call.id is None
    frags = [e.delta for e in evs if e.type == "response.function_call_arguments.delta"]
    assert len(frags) >= 2 and "".join(frags) == call.arguments
    added = [e for _, e in events(llama) if e["type"] == "response.output_item.added"]
    assert added[-1]["item"] == {
        "arguments": "",
        "call_id": call.call_id,
        "name": "get_weather",
        "type": "function_call",
        "status": "in_progress",
    }
    first_input = evs[-1].response.usage.input_tokens
    # Codex sends the call and its output back: the model answers in text
    turn2: Any = [
        *ask,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    r = client.responses.create(model="m", input=turn2, tools=[WEATHER_TOOL])
    assert r.output_text == "Hello from fake llama" and r.usage is not None
    assert r.usage.input_tokens_details.cached_tokens >= first_input - 1
    plain = client.responses.create(model="m", input=ask, tools=[WEATHER_TOOL])
    assert plain.output[-1].type == "function_call"


def test_previous_response_id(llama: Upstream, stack: contextlib.ExitStack) -> None:
    client = oai(stack, llama.url)
    first = client.responses.create(model="m", input="hi " * 30)
    assert first.usage is not None
    second = client.responses.create(model="m", input="more", previous_response_id=first.id)
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the stored turn came along
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    unstored = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", previous_response_id=unstored.id)


def test_max_output_tokens(llama: Upstream) -> None:
    r = raw(llama.url, {"input": "hi", "max_output_tokens": 7}).json()
    assert r["status"] == "completed"  # llama-server does not say incomplete
    assert r["usage"]["output_tokens"] == 7
    assert r["output"][-1]["content"][0]["text"] == "Hello from"


# --------------------------------------------------------------------- faults


def test_context_error() -> None:
    with Upstream("llama", n_ctx=16) as small:
        r = raw(small.url, {"input": "x" * 100, "stream": True})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert "exceeds the available context size (16 tokens)" in err["message"]
        client = openai.OpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0)
        with client, pytest.raises(openai.BadRequestError):
            client.responses.create(model="m", input="x" * 100)


def test_cut_before_completed(llama: Upstream, stack: contextlib.ExitStack) -> None:
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream(
            "POST",
            llama.url + "/v1/responses",
            json={"input": "hi", "stream": True},
            headers={"x-fake": "die_midstream,error_after=12"},
        ) as r:
            for piece in r.iter_raw():
                got += piece
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "died" and got == ex.body
    assert len(ex.sse_events()) == 12 and b"response.completed" not in got
    raw(llama.url, {"input": "hi", "stream": True}, **{"x-fake": "midstream_error"})
    ex = llama.wait_for_requests(2)[1]
    assert ex.outcome == "error_event"
    name, data = ex.sse_events()[-1]
    assert name == "error"
    assert json.loads(data)["error"] == {
        "code": 500,
        "message": MIDSTREAM_ERROR_MESSAGE,
        "type": "server_error",
    }
    client = oai(stack, llama.url, **{"x-fake": "midstream_error,error_after=6"})
    with pytest.raises(openai.APIError, match="error while generating"):
        for _ in client.responses.create(model="m", input="hi", stream=True):
            pass


def test_delays_garbage_gzip(llama: Upstream) -> None:
    raw(llama.url, {"input": "hi", "stream": True}, **{"x-fake": "slow,no_ping"})
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(llama.last.event_times))
    raw(llama.url, {"input": "hi", "stream": True}, **{"x-fake": "garbage"})
    assert [d for _, d in llama.last.sse_events()][2] == "not json"
    r = raw(
        llama.url, {"input": "hi", "stream": True}, **{"x-fake": "gzip", "accept-encoding": "gzip"}
    )
    assert r.headers["content-encoding"] == "gzip"
    assert llama.last.decoded_body.endswith(b"\n\n") and b"response.completed" in r.content
    r = raw(llama.url, {"input": "hi"}, **{"x-fake": "status=500"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    r = httpx.post(llama.url + "/v1/responses", content=b"[1]")
    assert r.status_code == 400
