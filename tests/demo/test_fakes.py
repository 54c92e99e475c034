"""The fake upstreams speak the real wire formats, driven by the real clients."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.support.mitm import Mitmdump, read_records
from tests.support.upstreams import (
    LLAMA_MODEL_FILE,
    MIDSTREAM_ERROR_MESSAGE,
    PING,
    TOOL_ARGS,
    BlackHole,
    ClosedPort,
    Upstream,
    count_tokens,
    prompt_text,
)

LLAMA_KEYS = ["choices", "created", "id", "model", "system_fingerprint", "object"]
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
Stack = contextlib.ExitStack
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture
def ollama_up() -> Iterator[Upstream]:
    with Upstream("ollama") as up:
        yield up


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Closes the clients a test opens."""
    with contextlib.ExitStack() as st:
        yield st


def oai(stack: contextlib.ExitStack, url: str, **headers: str) -> openai.OpenAI:
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=10, default_headers=headers
    )
    return stack.enter_context(client)


def oll(stack: contextlib.ExitStack, url: str, **headers: str) -> ollama.Client:
    return stack.enter_context(ollama.Client(host=url, headers=headers))


def chat_body(content: str = "hi there", *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body = {"model": "smol", "messages": [{"role": "user", "content": content}], "stream": stream}
    return body | extra


def raw_stream(url: str, body: dict[str, Any], **headers: str) -> tuple[httpx.Response, bytes]:
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", url, json=body, headers=headers) as r:
            data = b"".join(r.iter_raw())
    return r, data


def raw_http(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def dechunk(body: bytes) -> list[bytes]:
    """Split a chunked body into its chunk payloads; assert the terminator."""
    chunks: list[bytes] = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n"
            return chunks
        chunks.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


# --------------------------------------------------------------- llama: openai


def test_llama_openai_stream(llama: Upstream, stack: Stack) -> None:
    client = oai(stack, llama.url)
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "hi there"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    content, reasoning, usage, timings, models = "", "", None, None, set()
    finish = None
    for chunk in stream:
        models.add(chunk.model)
        if chunk.usage is not None:
            usage = chunk.usage
        extra = chunk.model_extra or {}
        timings = extra.get("timings", timings)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert content == "Hello from fake llama"
    assert reasoning == "Let me think about it."
    assert finish == "stop"
    assert models == {LLAMA_MODEL_FILE}
    assert usage is not None and usage.prompt_tokens_details is not None
    prompt_tokens = count_tokens(prompt_text(chat_body("hi there")))
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == 9  # 5 reasoning + 4 content pieces
    assert usage.total_tokens == prompt_tokens + 9
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert timings is not None and list(timings) == TIMINGS_KEYS
    assert timings["cache_n"] + timings["prompt_n"] == usage.prompt_tokens
    assert timings["predicted_n"] == 9
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "complete" and ex.status == 200
    assert ex.request_json["model"] == "smol"


def test_llama_openai_not_streamed(llama: Upstream, stack: Stack) -> None:
    resp = oai(stack, llama.url).chat.completions.create(
        model="whatever", messages=[{"role": "user", "content": "hi there"}]
    )
    assert resp.model == LLAMA_MODEL_FILE
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.content == "Hello from fake llama"
    assert (msg.model_extra or {})["reasoning_content"] == "Let me think about it."
    assert resp.usage is not None and resp.usage.completion_tokens == 9
    timings = (resp.model_extra or {})["timings"]
    assert timings["prompt_n"] == resp.usage.prompt_tokens
    ex = llama.wait_for_requests(1)[0]
    assert ex.response_header("content-type") == "application/json; charset=utf-8"
    assert ex.response_header("content-length") == str(len(ex.body))
    assert list(json.loads(ex.body)) == [*LLAMA_KEYS, "usage", "timings"]


def test_llama_tool_call_stream_and_not(llama: Upstream, stack: Stack) -> None:
    client = oai(stack, llama.url)
    messages: Any = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    stream = client.chat.completions.create(
        model="smol", messages=messages, tools=[WEATHER_TOOL], stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    content = ""
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id or ""
                if tc.function is not None:
                    call["name"] = call["name"] or tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert content == ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Tokyo"}
    assert len(calls[0]["id"]) == 32 and calls[0]["id"].isalnum()
    # header delta, then argument fragments without name
    deltas = [json.loads(d)["choices"] for d in llama.last.sse_data()[:-1]]
    tool_deltas = [
        c[0]["delta"]["tool_calls"][0] for c in deltas if c and "tool_calls" in c[0]["delta"]
    ]
    assert tool_deltas[0]["function"] == {"name": "get_weather"}
    assert tool_deltas[1] == {"index": 0, "function": {"arguments": '{"city":"Tok'}}

    resp = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL])
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert msg.content == ""
    assert msg.tool_calls is not None and msg.tool_calls[0].type == "function"
    first_call: Any = msg.tool_calls[0]
    fn = first_call.function
    assert fn.name == "get_weather" and json.loads(fn.arguments) == {"city": "Tokyo"}
    # after the tool result, the model answers in text
    messages += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]
    resp = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL])
    assert resp.choices[0].message.content == "Hello from fake llama"


def test_llama_prefix_cache(llama: Upstream, stack: Stack) -> None:
    client = oai(stack, llama.url)
    messages: Any = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "hi there"},
    ]
    first = client.chat.completions.create(model="smol", messages=messages)
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": "Hello from fake llama"},
        {"role": "user", "content": "and again"},
    ]
    second = client.chat.completions.create(model="smol", messages=messages)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    timings = (second.model_extra or {})["timings"]
    assert timings["cache_n"] == cached
    assert cached >= first.usage.prompt_tokens - 1
    assert timings["cache_n"] + timings["prompt_n"] == second.usage.prompt_tokens
    assert timings["prompt_ms"] == pytest.approx(timings["prompt_n"] * 0.5)
    # the same prompt again: everything but one token is cached
    third = client.chat.completions.create(model="smol", messages=messages)
    t3 = (third.model_extra or {})["timings"]
    assert t3["prompt_n"] == 1 and t3["cache_n"] == second.usage.prompt_tokens - 1
    # another conversation evicts the single slot
    fourth = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "something else entirely"}]
    )
    t4 = (fourth.model_extra or {})["timings"]
    assert t4["cache_n"] <= 1


# ---------------------------------------------------------- llama: raw framing


def test_llama_raw_sse_framing(llama: Upstream) -> None:
    body = chat_body(stream_options={"include_usage": True})
    r, data = raw_stream(llama.url + "/v1/chat/completions", body)
    ex = llama.wait_for_requests(1)[0]
    assert r.headers["content-type"] == "text/event-stream"
    assert r.headers["transfer-encoding"] == "chunked"
    assert data == ex.body == ex.decoded_body
    events = data.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert events.count(b":") == 2  # keep-alive pings
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert all(e.startswith(b"data: ") or e == b":" for e in events)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    for p in payloads:
        keys = list(p)
        assert keys[:6] == LLAMA_KEYS
        assert keys[6:] in ([], ["timings"], ["usage", "timings"])
    assert "timings" in payloads[-1] and "usage" in payloads[-1]
    assert payloads[-1]["choices"] == []
    assert all("timings" not in p for p in payloads[:-1])
    assert payloads[-2]["choices"][0] == {"finish_reason": "stop", "index": 0, "delta": {}}
    assert len({p["id"] for p in payloads}) == 1
    # each event (pings included) was one write
    assert [w for _, w in ex.writes] == [e + b"\n\n" for e in events]
    assert ex.sse_data()[-1] == "[DONE]"


def test_llama_one_chunk_per_event(llama: Upstream) -> None:
    req = json.dumps(chat_body()).encode()
    raw = raw_http(
        llama.port,
        b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(req), req),
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding: chunked" in head
    ex = llama.wait_for_requests(1)[0]
    assert dechunk(body) == [w for _, w in ex.writes]


def test_llama_no_usage_timings_on_finish_chunk(llama: Upstream) -> None:
    _, data = raw_stream(llama.url + "/v1/chat/completions", chat_body(), **{"x-fake": "no_ping"})
    assert PING not in data
    payloads = [json.loads(d) for d in llama.last.sse_data() if d != "[DONE]"]
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert "timings" in payloads[-1] and "usage" not in payloads[-1]


def test_llama_midstream_error(llama: Upstream, stack: Stack) -> None:
    r, data = raw_stream(
        llama.url + "/v1/chat/completions", chat_body(), **{"x-fake": "midstream_error"}
    )
    ex = llama.wait_for_requests(1)[0]
    assert r.status_code == 200 and data == ex.body
    assert ex.outcome == "error_event"
    assert b"[DONE]" not in data
    data_events = ex.sse_data()
    assert len(data_events) == 4  # 3 events, then the error
    assert json.loads(data_events[-1]) == {
        "error": {"code": 500, "message": MIDSTREAM_ERROR_MESSAGE, "type": "server_error"}
    }
    assert data.endswith(b"\n\n")
    # the openai client raises on the error event
    client = oai(stack, llama.url, **{"x-fake": "midstream_error,error_after=5"})
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="error while generating"):
        for _ in stream:
            pass


def test_llama_die_midstream_and_before_head(llama: Upstream) -> None:
    got = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream(
            "POST",
            llama.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"x-fake": "die_midstream,error_after=2"},
        ) as r:
            for piece in r.iter_raw():
                got += piece
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "died"
    assert got == ex.body and len(ex.sse_data()) == 2
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(
            llama.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"x-fake": "die_before_head"},
        )
    ex = llama.wait_for_requests(2)[1]
    assert ex.outcome == "no_response" and ex.status is None and ex.writes == []
    with pytest.raises(httpx.HTTPError):
        with httpx.stream(
            "POST",
            llama.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"x-fake": "reset_midstream"},
        ) as r:
            for _ in r.iter_raw():
                pass
    assert llama.wait_for_requests(3)[2].outcome == "reset"


def test_llama_context_error_even_when_streaming(llama: Upstream, stack: Stack) -> None:
    r = httpx.post(
        llama.url + "/v1/chat/completions", json=chat_body(), headers={"x-fake": "context_error"}
    )
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == 400
    assert "exceeds the available context size (8192 tokens)" in err["message"]
    with Upstream("llama", n_ctx=16) as small:
        with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
            oai(stack, small.url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 100}], stream=True
            )


def test_llama_garbage_slow_and_timing(llama: Upstream) -> None:
    t_first = None
    with httpx.stream(
        "POST",
        llama.url + "/v1/chat/completions",
        json=chat_body(),
        headers={"x-fake": "garbage,slow"},
    ) as r:
        data = b""
        for piece in r.iter_raw():
            if t_first is None:
                t_first = time.monotonic()
            data += piece
    ex = llama.wait_for_requests(1)[0]
    assert b"data: not json\n\n" in data and data == ex.body
    assert ex.sse_data()[2] == "not json"
    times = ex.event_times
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(times))
    assert t_first is not None and ex.t_end is not None
    assert t_first < ex.t_end - 0.3  # the first token arrived long before the end


def test_llama_short_content_length(llama: Upstream) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(
            llama.url + "/v1/chat/completions",
            json=chat_body(stream=False),
            headers={"x-fake": "short_content_length"},
        )
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "short_body"
    assert int(ex.response_header("content-length") or 0) == len(ex.body) + 100


def test_llama_gzip(llama: Upstream) -> None:
    with httpx.Client() as c:
        with c.stream(
            "POST",
            llama.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"x-fake": "gzip", "accept-encoding": "gzip"},
        ) as r:
            raw = b"".join(r.iter_raw())
    ex = llama.wait_for_requests(1)[0]
    assert r.headers["content-encoding"] == "gzip"
    assert raw == ex.body
    assert gzip.decompress(raw) == ex.decoded_body
    assert ex.decoded_body.endswith(b"data: [DONE]\n\n")
    # without accept-encoding gzip the mode does nothing
    r2, raw2 = raw_stream(
        llama.url + "/v1/chat/completions",
        chat_body(),
        **{"x-fake": "gzip", "accept-encoding": "identity"},
    )
    assert "content-encoding" not in r2.headers and raw2.endswith(b"data: [DONE]\n\n")


def test_llama_big_response_split_keepalive(llama: Upstream) -> None:
    with httpx.Client() as c:
        for _ in range(2):
            with c.stream(
                "POST",
                llama.url + "/v1/chat/completions",
                json=chat_body(),
                headers={"x-fake": "events=500,split,no_reasoning"},
            ) as r:
                raw = b"".join(r.iter_raw())
    a, b = llama.wait_for_requests(2)
    assert a.conn == b.conn  # the client reused the connection
    data = b.sse_data()
    assert len(data) == 1 + 500 + 1 + 1  # role, deltas, finish, [DONE]
    assert raw == b.body
    assert len(b.writes) == 2 * (len(data) + 2)  # every event, pings included, in two chunks


def test_llama_hang_after_head(llama: Upstream) -> None:
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST",
            llama.url + "/v1/chat/completions",
            json=chat_body(),
            headers={"x-fake": "hang_after_head"},
            timeout=httpx.Timeout(5, read=0.3),
        ) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                pass
    assert time.monotonic() - t0 < 2
    assert llama.log[0].outcome == "hung"


def test_llama_modes_compose_and_client_gone(llama: Upstream) -> None:
    _, data = raw_stream(
        llama.url + "/v1/chat/completions",
        chat_body(),
        **{"x-fake": "slow,midstream_error,error_after=2,no_ping"},
    )
    ex = llama.wait_for_requests(1)[0]
    assert ex.outcome == "error_event" and len(ex.sse_data()) == 3 and PING not in data
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(ex.event_times))
    # a client that leaves mid-stream
    with httpx.stream(
        "POST", llama.url + "/v1/chat/completions", json=chat_body(), headers={"x-fake": "slow"}
    ) as r:
        next(r.iter_raw())
    ex = llama.wait_for_requests(2)[1]
    assert ex.outcome == "client_gone" and b"[DONE]" not in ex.body


def test_llama_request_switches(llama: Upstream) -> None:
    url = llama.url + "/v1/chat/completions"
    inline = httpx.post(url, json=chat_body(stream=False, reasoning_format="none")).json()
    message = inline["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "<think>Let me think about it.</think>Hello from fake llama",
    }
    capped = httpx.post(url, json=chat_body(stream=False, max_tokens=7)).json()
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == 7
    assert capped["choices"][0]["message"]["content"] == "Hello from"
    llama.reset_cache()  # a cold prompt: progress at half and at the end of prefill
    _, data = raw_stream(url, chat_body(return_progress=True, timings_per_token=True))
    events = [json.loads(d) for d in llama.last.sse_data()[:-1]]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(progress) == 2 and progress[-1]["processed"] == progress[-1]["total"]
    assert all("timings" in e for e in events)
    old_body = chat_body("weather?", tools=[WEATHER_TOOL])
    _, data = raw_stream(url, old_body, **{"x-fake": "old_build"})
    assert PING not in data
    events = [json.loads(d) for d in llama.last.sse_data()[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    frags = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert frags[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert frags[1]["function"] == {"name": "get_weather", "arguments": '{"city":"Tok'}
    full = httpx.post(url, json=old_body | {"stream": False}, headers={"x-fake": "old_build"})
    assert full.json()["choices"][0]["message"]["content"] is None
    assert "prompt_tokens_details" not in full.json()["usage"]


def test_llama_unknown_mode_is_loud(llama: Upstream) -> None:
    r = httpx.post(llama.url + "/v1/chat/completions", json=chat_body(), headers={"x-fake": "slwo"})
    assert r.status_code == 400 and "slwo" in r.text


def test_llama_other_endpoints(llama: Upstream) -> None:
    with httpx.Client(base_url=llama.url) as c:
        assert c.get("/health").json() == {"status": "ok"}
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192
        assert props["model_path"] == LLAMA_MODEL_FILE and props["total_slots"] == 1
        assert c.get("/v1/models").json()["data"][0]["id"] == LLAMA_MODEL_FILE
        tokens = c.post("/tokenize", json={"content": "hello world!", "add_special": False}).json()
        assert len(tokens["tokens"]) == 3 and all(isinstance(t, int) for t in tokens["tokens"])
        pieces = c.post("/tokenize", json={"content": "hello", "with_pieces": True}).json()
        assert [p["piece"] for p in pieces["tokens"]] == ["hell", "o"]
        missing = c.get("/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"
        loading = c.get("/health", headers={"x-fake": "status=503"})
        assert loading.status_code == 503


# ------------------------------------------------------------------- Ollama


def test_ollama_client_stream(ollama_up: Upstream, stack: Stack) -> None:
    client = oll(stack, ollama_up.url)
    content, thinking, final = "", "", None
    hi = [{"role": "user", "content": "hi"}]
    for part in client.chat(model="qwen3", messages=hi, stream=True):
        content += part.message.content or ""
        thinking += part.message.thinking or ""
        if part.done:
            final = part
    assert content == "Hello from fake ollama"
    assert thinking == "Let me think about it."
    assert final is not None and final.done_reason == "stop" and final.model == "qwen3"
    assert final.eval_count == 9
    assert final.prompt_eval_count == count_tokens(
        prompt_text({"messages": [{"role": "user", "content": "hi"}]})
    )
    assert final.eval_duration == round(9 * 18.89 * 1e6)
    assert final.total_duration is not None and final.load_duration is not None
    assert final.total_duration > final.eval_duration
    ex = ollama_up.wait_for_requests(1)[0]
    assert ex.response_header("content-type") == "application/x-ndjson"
    assert ex.response_header("transfer-encoding") == "chunked"
    lines = [json.loads(line) for line in ex.ndjson_lines()]
    assert [w.decode() for _, w in ex.writes] == [line + "\n" for line in ex.ndjson_lines()]
    assert list(lines[0]) == ["model", "created_at", "message", "done"]
    assert lines[0]["message"] == {"role": "assistant", "content": "", "thinking": "Let"}
    assert lines[-1]["prompt_eval_cached_count"] == 0
    assert list(lines[-1])[:5] == ["model", "created_at", "message", "done_reason", "done"]
    assert lines[-1]["created_at"].endswith("Z")


def test_ollama_client_not_streamed_tools_and_cache(ollama_up: Upstream, stack: Stack) -> None:
    client = oll(stack, ollama_up.url)
    messages: Any = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    resp = client.chat(model="qwen3", messages=messages, tools=[WEATHER_TOOL])
    calls = resp.message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Tokyo"}
    assert resp.message.thinking == "Let me think about it."
    ex = ollama_up.last
    assert ex.response_header("content-type") == "application/json; charset=utf-8"
    obj = json.loads(ex.body)
    assert obj["message"]["tool_calls"][0]["id"].startswith("call_")
    assert obj["message"]["tool_calls"][0]["function"]["index"] == 0
    # streamed tool calls arrive whole, on the final line only
    parts = list(client.chat(model="qwen3", messages=messages, tools=[WEATHER_TOOL], stream=True))
    assert [p.done for p in parts if p.message.tool_calls] == [True]
    final = json.loads(ollama_up.last.ndjson_lines()[-1])
    assert final["prompt_eval_cached_count"] == final["prompt_eval_count"] - 1
    # think=False: no thinking
    resp = client.chat(model="qwen3", messages=[{"role": "user", "content": "hi"}], think=False)
    assert resp.message.thinking is None and resp.message.content == "Hello from fake ollama"


def test_ollama_midstream_error_and_old_build(ollama_up: Upstream, stack: Stack) -> None:
    body: Any = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}  # streams
    r, data = raw_stream(ollama_up.url + "/api/chat", body, **{"x-fake": "midstream_error"})
    assert r.status_code == 200
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert lines[-1] == {"error": MIDSTREAM_ERROR_MESSAGE}
    assert not any(line.get("done") for line in lines)
    client = oll(stack, ollama_up.url, **{"x-fake": "midstream_error"})
    with pytest.raises(ollama.ResponseError, match="error while generating"):
        for _ in client.chat(model="qwen3", messages=body["messages"], stream=True):
            pass
    _, data = raw_stream(ollama_up.url + "/api/chat", body, **{"x-fake": "old_build"})
    final = json.loads(data.decode().splitlines()[-1])
    assert "prompt_eval_cached_count" not in final
    assert final["prompt_eval_count"] == 1  # only the evaluated part


def test_ollama_html_escaping(ollama_up: Upstream) -> None:
    """Go's encoder escapes <, > and & in strings."""
    up = Upstream("ollama", reply="a <b> & c")
    try:
        r = httpx.post(up.url + "/api/chat", json={**chat_body(), "stream": False})
        assert b"a \\u003cb\\u003e \\u0026 c" in r.content
        assert r.json()["message"]["content"] == "a <b> & c"
    finally:
        up.close()


def test_ollama_openai_compat(ollama_up: Upstream, stack: Stack) -> None:
    client = oai(stack, ollama_up.url)
    stream = client.chat.completions.create(
        model="qwen3",
        messages=[{"role": "user", "content": "weather in Tokyo?"}],
        tools=[WEATHER_TOOL],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.system_fingerprint for c in chunks} == {"fp_ollama"}
    assert {c.model for c in chunks} == {"qwen3"}
    assert chunks[0].id.startswith("chatcmpl-") and chunks[0].id[9:].isdigit()
    reasoning = "".join(
        (ch.delta.model_extra or {}).get("reasoning") or "" for c in chunks for ch in c.choices
    )
    assert reasoning == "Let me think about it."
    tool_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(tool_chunks) == 1  # whole, in one chunk
    tc: Any = tool_chunks[0].choices[0].delta.tool_calls[0]  # type: ignore[index]
    assert tc.function is not None and json.loads(tc.function.arguments or "") == TOOL_ARGS
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is None
    assert not (chunks[-1].model_extra or {}).get("timings")
    assert ollama_up.last.sse_data()[-1] == "[DONE]"
    hi: Any = [{"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model="qwen3", messages=hi)
    assert resp.choices[0].message.content == "Hello from fake ollama"
    assert (resp.choices[0].message.model_extra or {})["reasoning"] == "Let me think about it."


def test_ollama_other_endpoints(ollama_up: Upstream, stack: Stack) -> None:
    with httpx.Client(base_url=ollama_up.url) as c:
        assert c.get("/api/version").json() == {"version": "0.34.0"}
        assert c.get("/api/tags").json()["models"][0]["name"] == "qwen3:latest"
        assert c.get("/").text == "Ollama is running"
        assert c.post("/api/tokenize", json={}).status_code == 404
    assert oll(stack, ollama_up.url).list().models[0].model == "qwen3:latest"


# -------------------------------------------------------------- dead addresses


def test_black_hole_hangs_connect() -> None:
    with BlackHole() as bh:
        s = socket.socket()
        s.settimeout(2)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            s.connect((bh.host, bh.port))
        assert time.monotonic() - t0 >= 1.9
        s.close()


def test_closed_port_refuses() -> None:
    with ClosedPort() as cp:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", cp.port), timeout=2)
        with pytest.raises(httpx.ConnectError):
            httpx.get(cp.url)


# ---------------------------------------------------------- through mitmdump


def test_mitmdump_without_addon_passes_stream(llama: Upstream, stack: Stack) -> None:
    with Mitmdump(llama.url, script=None, wait_ready=False) as md:
        assert "listening at 127.0.0.1:" in md.log_text()
        client = oai(stack, md.url)
        stream = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert content == "Hello from fake llama"
        with client.chat.completions.with_streaming_response.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], stream=True
        ) as resp:
            got = b"".join(resp.iter_bytes())
        ex = llama.wait_for_requests(2)[1]
        assert got == ex.body
        assert ex.request_header("x-fake") is None
        assert md.stop() == 0


def test_mitmdump_regular_mode(llama: Upstream, tmp_path: Any) -> None:
    with Mitmdump(mode="regular", script=None, wait_ready=False) as md:
        with httpx.Client(proxy=md.url) as c:
            r = c.post(llama.url + "/v1/chat/completions", json=chat_body(stream=False))
        assert r.json()["choices"][0]["message"]["content"] == "Hello from fake llama"
        assert r.content == llama.wait_for_requests(1)[0].body
    assert md.returncode == 0
    assert read_records(tmp_path / "missing.jsonl") == []
    (tmp_path / "r.jsonl").write_text('{"id":2,"v":1}\n\n{"id":1,"v":1}\n')
    assert [r["id"] for r in read_records(tmp_path / "r.jsonl")] == [1, 2]
