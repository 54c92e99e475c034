"""End to end: the real mitmdump with the addon, real clients, fake upstreams on loopback.

Each test drives real `openai`, `ollama` or `httpx` clients through
`mitmdump -s addon/llmp_addon.py` and checks both sides: what the client got
(byte for byte against what upstream wrote) and what was recorded.
"""

from __future__ import annotations

import json
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from llmp.apis.openai_chat import OpenAIChat
from llmp.format import canonical
from llmp.format.schema import NAMING_HEADERS, SERVER_HEADERS, SESSION_HEADERS
from tests.support.mitm import Mitmdump, MitmdumpError, read_records, wait_for_records
from tests.support.upstreams import BlackHole, ClosedPort, Upstream

pytestmark = pytest.mark.e2e

SECRET = "sk-SECRET-should-never-be-written"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture(scope="module")
def ollama_up() -> Iterator[Upstream]:
    with Upstream("ollama") as up:
        yield up


@pytest.fixture()
def rec_path(tmp_path: Path) -> Path:
    return tmp_path / "rec.jsonl"


def _messages(n: int = 1) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse. Temperature 0.70 matters."}
    ]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i} about the weather in Tokyo"})
        if i < n - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return msgs


def _assert_common(rec: dict[str, Any]) -> None:
    assert rec["v"] == 1
    assert isinstance(rec["id"], int) and rec["id"] >= 1
    assert isinstance(rec["conn"], int) and rec["conn"] >= 1
    tokens = rec["tokens"]  # the upstream tokenizer's counts (llmp_tokenize), or none
    if tokens is not None:
        assert set(tokens) == {"messages", "tools"}
        for part in tokens.values():
            assert all(type(n) is int and n >= 0 for n in part.values())
    assert rec["t_start_ms"] <= rec["t_end_ms"]
    if rec["t_first_byte_ms"] is not None:
        assert rec["t_start_ms"] <= rec["t_first_byte_ms"] <= rec["t_end_ms"]
    plain = {"user-agent", "content-type", "content-length", "transfer-encoding"}
    # R32: a request also keeps the harness's identity headers (the SDK's retry count).
    request_headers = plain | set(NAMING_HEADERS) | set(SESSION_HEADERS)
    # A response also keeps the program that served it (`server`).
    response_headers = plain | set(SERVER_HEADERS)
    for part, allowed in (
        (rec["request"], request_headers),
        (rec["response"] or {}, response_headers),
    ):
        headers = part.get("headers", {})
        assert set(headers) <= allowed
        set_fields = [k for k in ("body", "body_text", "digest") if part.get(k) is not None]
        assert len(set_fields) <= 1


def test_openai_streamed_with_tools_and_usage(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, max_retries=0)
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model="smol",
            messages=_messages(2),
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.7,
        )
        content, reasoning, args, names, usage = [], [], [], [], None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                d = choice.delta
                if d.content:
                    content.append(d.content)
                extra = d.model_extra or {}
                if extra.get("reasoning_content"):
                    reasoning.append(extra["reasoning_content"])
                for tc in d.tool_calls or []:
                    if tc.function and tc.function.name:
                        names.append(tc.function.name)
                    if tc.function and tc.function.arguments:
                        args.append(tc.function.arguments)
        records = wait_for_records(rec_path, 1)
    assert usage is not None
    (rec,) = records
    _assert_common(rec)
    assert rec["id"] == 1 and rec["error"] is None
    req, resp = rec["request"], rec["response"]
    assert req["method"] == "POST" and req["path"] == "/v1/chat/completions"
    assert req["headers"]["content-type"] == "application/json"
    assert req["headers"]["user-agent"].startswith("OpenAI/Python")
    assert req["body_bytes"] == len(llama.log[-1].request_body)
    dig = req["digest"]
    assert dig == OpenAIChat().request_digest(canonical.loads(llama.log[-1].request_body))
    assert dig["params"]["stream"] is True and dig["tools"][0]["name"] == "get_weather"
    assert [m["role"] for m in dig["messages"]] == ["system", "user", "assistant", "user"]
    assert resp["status"] == 200 and resp["stream"] == "sse"
    upstream_events = [d for d in llama.log[-1].sse_data() if d != "[DONE]"]
    assert resp["chunks"] == len(upstream_events) and resp["bad_chunks"] == 0
    assert resp["body_bytes"] == len(llama.log[-1].body) and resp["truncated"] is False
    out = resp["digest"]["output"]
    assert out["content_chars"] == len("".join(content))
    assert out["reasoning_chars"] == len("".join(reasoning))
    assert [c["name"] for c in out["tool_calls"]] == names == ["get_weather"]
    counters = resp["digest"]["usage"]
    assert counters["usage"]["prompt_tokens"] == usage.prompt_tokens
    assert set(counters["timings"]) >= {"cache_n", "prompt_n", "prompt_ms", "predicted_ms"}
    text = rec_path.read_text()
    assert SECRET not in text and "Tokyo" not in text and "terse" not in text
    assert stat.S_IMODE(rec_path.stat().st_mode) == 0o600


def test_full_mode_merges_stream_like_the_client(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path, {"llmp_body": "full"}) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model="smol",
            messages=_messages(1),
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, args = [], []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    content.append(choice.delta.content)
                for tc in choice.delta.tool_calls or []:
                    if tc.function and tc.function.arguments:
                        args.append(tc.function.arguments)
        (rec,) = wait_for_records(rec_path, 1)
    body = rec["response"]["body"]
    msg = body["choices"][0]["message"]
    assert (msg["content"] or "") == "".join(content)
    assert msg["tool_calls"][0]["function"]["arguments"] == "".join(args)
    assert "index" not in msg["tool_calls"][0]
    assert body["object"] == "chat.completion" and "timings" in body and "usage" in body
    assert rec["request"]["body"] == json.loads(llama.log[-1].request_body)
    assert rec["request"]["digest"] is None


def test_openai_not_streamed(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path, {"llmp_body": "full"}) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        result = client.chat.completions.create(model="smol", messages=_messages(1))  # type: ignore[arg-type]
        (rec,) = wait_for_records(rec_path, 1)
    resp = rec["response"]
    assert resp["stream"] is None and resp["chunks"] is None and resp["bad_chunks"] is None
    assert resp["body"]["choices"][0]["message"]["content"] == result.choices[0].message.content
    assert resp["body_bytes"] == len(llama.log[-1].body)
    assert rec["t_first_byte_ms"] is not None


def test_httpx_bytes_identical_and_not_buffered(llama: Upstream, rec_path: Path) -> None:
    body = {
        "model": "m",
        "stream": True,
        "messages": _messages(1),
        "stream_options": {"include_usage": True},
    }
    with Mitmdump(llama.url, rec_path) as proxy:
        got: list[tuple[float, bytes]] = []
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"x-fake": "delay_ms=150"},
            ) as resp,
        ):
            for piece in resp.iter_raw():
                got.append((time.monotonic(), piece))
        (rec,) = wait_for_records(rec_path, 1)
    ex = llama.log[-1]
    assert b"".join(p for _, p in got) == ex.body
    assert b":\n\n" in ex.body and ex.body.endswith(b"data: [DONE]\n\n")
    # The first content event reached the client long before upstream wrote its last byte.
    first_content = next(t for t, p in got if b'"content":"' in p)
    assert ex.t_end is not None and first_content < ex.t_end - 0.3
    assert rec["response"]["body_bytes"] == len(ex.body)
    assert rec["t_first_byte_ms"] < rec["t_end_ms"] - 300


def test_ollama_streamed_and_not(ollama_up: Upstream, rec_path: Path) -> None:
    with Mitmdump(ollama_up.url, rec_path, {"llmp_body": "full"}) as proxy:
        client = ollama.Client(host=proxy.url)
        parts: list[str] = []
        thinking: list[str] = []
        calls: list[Any] = []
        final: Any = None
        for part in client.chat(
            model="qwen3", messages=_messages(1), tools=TOOLS, stream=True, think=True
        ):
            if part.message.content:
                parts.append(part.message.content)
            if part.message.thinking:
                thinking.append(part.message.thinking)
            calls += part.message.tool_calls or []
            if part.done:
                final = part
        single = client.chat(model="qwen3", messages=_messages(1), stream=False)
        records = wait_for_records(rec_path, 2)
    assert final is not None
    streamed, plain = records
    for rec in records:
        _assert_common(rec)
        assert rec["request"]["path"] == "/api/chat"
    assert streamed["response"]["stream"] == "ndjson"
    assert streamed["response"]["chunks"] == len(ollama_up.log[-2].ndjson_lines())
    body = streamed["response"]["body"]
    assert body["message"]["content"] == "".join(parts)
    assert body["message"].get("thinking", "") == "".join(thinking)
    assert [c["function"]["name"] for c in body["message"].get("tool_calls", [])] == [
        c.function.name for c in calls
    ]
    assert body["done"] is True and body["prompt_eval_count"] == final.prompt_eval_count
    assert plain["response"]["stream"] is None
    assert plain["response"]["body"]["message"]["content"] == single.message.content


def test_ollama_digest_counters(ollama_up: Upstream, rec_path: Path) -> None:
    with Mitmdump(ollama_up.url, rec_path) as proxy:
        client = ollama.Client(host=proxy.url)
        list(client.chat(model="qwen3", messages=_messages(1), stream=True))
        (rec,) = wait_for_records(rec_path, 1)
    dig = rec["request"]["digest"]
    assert dig["params"]["stream"] is True and dig["model"] == "qwen3"
    usage = rec["response"]["digest"]["usage"]
    assert {"prompt_eval_count", "prompt_eval_duration", "eval_count", "done"} <= set(usage)


def test_midstream_error_without_done(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path) as proxy:
        with httpx.Client(timeout=30) as client:
            r = client.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"x-fake": "midstream_error"}
            )
        (rec,) = wait_for_records(rec_path, 1)
    assert b"[DONE]" not in r.content and r.content == llama.log[-1].body
    assert rec["error"] is None and rec["response"]["status"] == 200
    assert rec["response"]["digest"]["usage"]["error"]["type"] == "server_error"


def test_garbage_event_is_a_bad_chunk(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path) as proxy:
        with httpx.Client(timeout=30) as client:
            r = client.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"x-fake": "garbage"}
            )
        (rec,) = wait_for_records(rec_path, 1)
    assert r.content == llama.log[-1].body
    assert rec["response"]["bad_chunks"] == 1
    assert rec["response"]["digest"]["output"]["content_chars"] == len(llama.reply)


def test_closed_port_is_upstream_unreachable(rec_path: Path) -> None:
    with ClosedPort() as closed, Mitmdump(closed.url, rec_path) as proxy:
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
        (rec,) = wait_for_records(rec_path, 1)
    assert r.status_code == 502
    assert rec["error"] == "upstream_unreachable" and rec["response"] is None
    assert rec["t_first_byte_ms"] is None


def test_connect_that_never_completes_is_timeout(rec_path: Path) -> None:
    hole = BlackHole()
    try:
        with Mitmdump(hole.url, rec_path, {"llmp_connect_timeout": "1"}) as proxy:
            t0 = time.monotonic()
            r = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
            elapsed = time.monotonic() - t0
            (rec,) = wait_for_records(rec_path, 1)
    finally:
        hole.close()
    assert 0.9 <= elapsed < 10 and r.status_code >= 500
    assert rec["error"] == "timeout" and rec["response"] is None


def test_upstream_dies_midstream_is_upstream_reset(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path, {"llmp_body": "full"}) as proxy:
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=30) as client:
            client.post(
                proxy.url + "/v1/chat/completions", json=body, headers={"x-fake": "die_midstream"}
            )
        (rec,) = wait_for_records(rec_path, 1)
    assert rec["error"] == "upstream_reset"
    assert rec["response"]["status"] == 200 and rec["response"]["chunks"] >= 2
    assert rec["response"]["body"]["choices"][0]["message"]["role"] == "assistant"


def test_upstream_closes_before_head_is_upstream_reset(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path) as proxy:
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={"messages": []},
            headers={"x-fake": "die_before_head"},
            timeout=30,
        )
        (rec,) = wait_for_records(rec_path, 1)
    assert r.status_code == 502
    assert rec["error"] == "upstream_reset" and rec["response"] is None


def test_client_hangs_up_midstream(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path) as proxy:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"x-fake": "events=40,delay_ms=50"},
            ) as resp,
        ):
            for n, _ in enumerate(resp.iter_raw()):
                if n == 3:
                    break
        (rec,) = wait_for_records(rec_path, 1, timeout=20)
    assert rec["error"] == "client_disconnected"
    assert rec["response"]["status"] == 200
    assert (
        0
        < rec["response"]["body_bytes"]
        < len(b"".join(p for p in [llama.log[-1].body]) or b"x" * 10**9)
    )


def test_request_over_the_limit(llama: Upstream, rec_path: Path) -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    with Mitmdump(llama.url, rec_path, {"llmp_limit": "1000", "llmp_body": "full"}) as proxy:
        r = httpx.post(proxy.url + "/v1/chat/completions", json=big, timeout=30)
        (rec,) = wait_for_records(rec_path, 1)
    assert r.status_code == 200
    assert json.loads(llama.log[-1].request_body) == big  # forwarded unchanged
    assert rec["error"] == "body_too_large"
    req = rec["request"]
    assert req["body"] is None and req["body_text"] is None and req["digest"] is None
    assert req["body_bytes"] == len(llama.log[-1].request_body)
    assert rec["response"]["status"] == 200


def test_response_over_the_limit_is_truncated(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path, {"llmp_limit": "4000", "llmp_body": "full"}) as proxy:
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"x-fake": "events=300"},
            timeout=30,
        )
        (rec,) = wait_for_records(rec_path, 1)
    assert r.content == llama.log[-1].body and len(r.content) > 4000
    resp = rec["response"]
    assert resp["truncated"] is True and resp["body_bytes"] == len(r.content)
    assert 0 < resp["chunks"] < 300 and resp["bad_chunks"] == 0
    assert resp["body"]["choices"][0]["message"]["content"]


def test_gzip_stream_passes_untouched(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    with Mitmdump(llama.url, rec_path) as proxy:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"x-fake": "gzip", "accept-encoding": "gzip"},
            ) as resp,
        ):
            raw = b"".join(resp.iter_raw())
            assert resp.headers["content-encoding"] == "gzip"
        (rec,) = wait_for_records(rec_path, 1)
    assert raw == llama.log[-1].body
    assert rec["response"]["body_bytes"] == len(raw)
    assert rec["response"]["digest"]["output"]["content_chars"] == len(llama.reply)


def test_no_credentials_in_either_mode(llama: Upstream, tmp_path: Path) -> None:
    for mode in ("digest", "full"):
        path = tmp_path / f"{mode}.jsonl"
        with Mitmdump(llama.url, path, {"llmp_body": mode}) as proxy:
            httpx.post(
                proxy.url + "/v1/chat/completions?key=1",
                json={"model": "m", "messages": _messages(1)},
                headers={
                    "authorization": f"Bearer {SECRET}",
                    "x-api-key": SECRET,
                    "cookie": f"s={SECRET}",
                    "proxy-authorization": f"Basic {SECRET}",
                },
                timeout=30,
            )
            (rec,) = wait_for_records(path, 1)
        text = path.read_text()
        assert SECRET not in text
        assert rec["request"]["path"] == "/v1/chat/completions?key=1"


def test_ids_conns_and_non_chat_paths(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path) as proxy:
        with httpx.Client(timeout=30) as client:
            client.get(proxy.url + "/health")
            client.get(proxy.url + "/v1/models")
        httpx.get(proxy.url + "/props", timeout=30)
        records = wait_for_records(rec_path, 3)
    assert [r["id"] for r in records] == [1, 2, 3]
    assert records[0]["conn"] == records[1]["conn"] != records[2]["conn"]
    for rec in records:
        _assert_common(rec)
        assert rec["request"]["digest"] is None and rec["response"]["digest"] is None
        assert rec["response"]["status"] == 200


def test_sigterm_writes_inflight_exchange(llama: Upstream, rec_path: Path) -> None:
    body = {"model": "m", "stream": True, "messages": _messages(1)}
    proxy = Mitmdump(llama.url, rec_path, {"llmp_body": "full"}).start()
    try:
        with httpx.Client(timeout=30) as client:
            httpx.get(proxy.url + "/health", timeout=30)
            with (
                pytest.raises(httpx.HTTPError),
                client.stream(
                    "POST",
                    proxy.url + "/v1/chat/completions",
                    json=body,
                    headers={"x-fake": "hang_midstream,hang_s=30"},
                ) as resp,
            ):
                it = resp.iter_raw()
                next(it)
                time.sleep(0.5)
                code = proxy.stop(signal.SIGTERM)
                list(it)
    finally:
        proxy.close()
    records = read_records(rec_path)
    assert [r["id"] for r in records] == [1, 2]
    assert records[1]["error"] == "upstream_reset"
    assert records[1]["response"]["status"] == 200 and records[1]["response"]["chunks"] >= 1
    assert code == 0
    assert rec_path.read_bytes().endswith(b"\n")


def test_bad_option_stops_startup(llama: Upstream, rec_path: Path) -> None:
    for opts, reason in (
        ({"llmp_body": "ful"}, "llmp_body must be 'digest' or 'full'"),
        ({"llmp_limit": "0"}, "llmp_limit must be a positive"),
        ({"llmp_connect_timeout": "-1"}, "llmp_connect_timeout must be a positive"),
    ):
        proxy = Mitmdump(llama.url, rec_path, opts, timeout=20)
        with pytest.raises(MitmdumpError):
            proxy.start()
        assert reason in proxy.log_text()
        proxy.close()


def test_unwritable_path_stops_startup(llama: Upstream, tmp_path: Path) -> None:
    proxy = Mitmdump(llama.url, tmp_path / "no-such-dir" / "rec.jsonl", timeout=20)
    with pytest.raises(MitmdumpError):
        proxy.start()
    assert "cannot open recording" in proxy.log_text()
    proxy.close()


def test_second_recorder_on_same_file_refuses(llama: Upstream, rec_path: Path) -> None:
    with Mitmdump(llama.url, rec_path):
        second = Mitmdump(llama.url, rec_path, timeout=20)
        with pytest.raises(MitmdumpError):
            second.start()
        assert "in use by another recorder" in second.log_text()
        second.close()


def test_full_and_digest_recordings_hash_alike(llama: Upstream, tmp_path: Path) -> None:
    bodies = [
        {"model": "m", "messages": _messages(2), "tools": TOOLS, "temperature": 0.70, "top_p": 1e0},
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a\u2028b"}]}],
            "stream": True,
        },
    ]
    raw = [
        json.dumps(b).replace('"temperature": 0.7', '"temperature": 0.70').encode() for b in bodies
    ]
    digests: dict[str, list[Any]] = {}
    for mode in ("full", "digest"):
        path = tmp_path / f"{mode}.jsonl"
        with Mitmdump(llama.url, path, {"llmp_body": mode}) as proxy:
            for data in raw:
                httpx.post(
                    proxy.url + "/v1/chat/completions",
                    content=data,
                    headers={"content-type": "application/json"},
                    timeout=30,
                )
            records = wait_for_records(path, 2)
        if mode == "full":
            # Re-read the full bodies as the analyzer does: number text kept (R2).
            lines = [canonical.loads(line) for line in path.read_bytes().splitlines()]
            digests[mode] = [
                OpenAIChat().request_digest(r["request"]["body"])
                for r in sorted(lines, key=lambda r: r["id"])
            ]
        else:
            digests[mode] = [r["request"]["digest"] for r in records]
    assert digests["full"] == digests["digest"]
    assert b'"temperature":0.70' in (tmp_path / "full.jsonl").read_bytes()
