"""Privacy: what a recording may never hold.

- Digest mode writes no text: traffic whose every free-text field carries a
  marker (system, user, assistant and tool messages, content parts, reasoning,
  tool definitions, tool call arguments, response content and reasoning,
  non-chat bodies, bodies that are not JSON, compressed bodies, SSE comments and
  event names, extra headers) leaves no marker in the file, nor in the proxy's
  log. Tool names, tool call ids, the model name and the path are kept by design
  (R4, R5, format v1), so the markers stay out of those.
- Credentials never appear in either mode: ``Authorization``, ``X-Api-Key``,
  ``Cookie``, ``Set-Cookie``, ``Proxy-Authorization`` and the credentials a
  client gives a forward proxy, with and without mitmproxy's own ``proxyauth``.
- Recordings are created 0600, whatever the umask, including the default file.
"""

from __future__ import annotations

import base64
import datetime
import gzip
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmp.format.schema import (
    ACCOUNT_HEADERS,
    NAME_ONLY_PREFIXES,
    PROVIDER_HEADERS,
    SERVER_HEADERS,
)
from tests.support.hardening import RawUpstream, chunked, response_head
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.provider_bodies import provider_handler
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

MARK = "ZQXJ"  # never in a hash (hex), a time or a count
SECRET = "s3cr3t-TOKEN-9f8e7d"
PROXY_USER, PROXY_PASS = "agent", "pr0xy-PASS-77"
CREDS_B64 = base64.b64encode(f"{PROXY_USER}:{PROXY_PASS}".encode()).decode()
FORBIDDEN = (SECRET, PROXY_PASS, CREDS_B64)


def m(n: int | str) -> str:
    """A marker: free text that must never reach a digest recording."""
    return f"{MARK}{n} private words {MARK}{n}end"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": m("tool-description"),
            "parameters": {
                "type": "object",
                "properties": {
                    f"{MARK}prop": {"type": "string", "description": m("param-description")},
                    "city": {"type": "string", "enum": [m("enum")]},
                },
                "required": ["city"],
            },
        },
    }
]


def openai_body(stream: bool) -> dict[str, Any]:
    return {
        "model": "smol",
        "stream": stream,
        "messages": [
            {"role": "system", "content": m("system")},
            {"role": "user", "content": [{"type": "text", "text": m("user-part")}]},
            {
                "role": "assistant",
                "content": m("assistant"),
                "reasoning_content": m("assistant-reasoning"),
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": m("tool-args")}),
                        },
                    }
                ],
            },
            # Long enough for its chunks (format.chunks): numbers and hex digits, no text.
            {"role": "tool", "tool_call_id": "call_1", "content": m("tool-result") * 40},
            {"role": "user", "content": m("user") + " tell me more"},
        ],
        "tools": TOOLS,
        "stop": [m("stop")],
        "user": m("user-field"),
        "metadata": {m("meta-key"): m("meta-value")},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"description": m("schema")}},
        },
        "grammar": m("grammar"),
    }


def ollama_body(stream: bool) -> dict[str, Any]:
    return {
        "model": "qwen3",
        "stream": stream,
        "think": True,
        "messages": [
            {"role": "system", "content": m("o-system")},
            {
                "role": "user",
                "content": m("o-user-1"),
                "images": [base64.b64encode(m("img").encode()).decode()],
            },
            {
                "role": "assistant",
                "content": m("o-assistant"),
                "thinking": m("o-thinking"),
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": m("o-args")}}}
                ],
            },
            {"role": "tool", "tool_name": "get_weather", "content": m("o-tool-result")},
            {"role": "user", "content": m("o-user") + " go on"},
        ],
        "tools": TOOLS,
        "format": {"type": "object", "description": m("o-format")},
        "options": {"stop": [m("o-stop")], "num_ctx": 4096},
    }


HEADERS = {
    "Authorization": f"Bearer {SECRET}",
    "X-Api-Key": SECRET,
    "Cookie": f"session={SECRET}; other={SECRET}",
    "OpenAI-Organization": m("org"),
    "X-Request-Id": m("request-id"),
    f"X-{MARK}-Custom": m("custom-header"),
}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _raw_handler(method: str, target: str, body: bytes) -> tuple[list[bytes], str]:
    """Responses full of markers, in every place a server may put text."""
    extra = {
        # R34 keeps a provider's request id verbatim (an id, not text), an account only
        # hashed, a rate limit by its name alone, and no other header.
        "X-Request-Id": "req_9d8c7b6a",
        "OpenAI-Organization": m("resp-org"),
        "Anthropic-Ratelimit-Tokens-Remaining": m("resp-ratelimit"),
        f"X-{MARK}-Resp": m("resp-header"),
        "Set-Cookie": f"session={SECRET}; HttpOnly",
    }
    if target.startswith("/err/"):
        payload = json.dumps({"error": {"message": m("error-body")}}).encode()
        return [
            response_head(500, "application/json", length=len(payload), extra=extra),
            payload,
        ], "keep"
    if target.startswith(("/v1/", "/sniff/")):
        delta = {"role": "assistant", "content": m("raw-content")}
        events = [
            f": {m('comment')}\n\n".encode(),
            f"event: {m('event-name')}\nid: {m('event-id')}\n".encode()
            + _sse({"choices": [{"index": 0, "delta": delta}]}),
            _sse({"choices": [{"index": 0, "delta": {"reasoning_content": m("raw-reasoning")}}]}),
            _sse(
                {
                    "choices": [
                        {
                            "index": 0,
                            "delta": {
                                "tool_calls": [
                                    {
                                        "index": 0,
                                        "id": "call_9",
                                        "type": "function",
                                        "function": {
                                            "name": "get_weather",
                                            "arguments": json.dumps({"city": m("raw-args")}),
                                        },
                                    }
                                ]
                            },
                        }
                    ]
                }
            ),
            f"data: {m('bad-event')} not json\n\n".encode(),
            _sse(
                {
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                    "usage": {"prompt_tokens": 5},
                }
            ),
            b"data: [DONE]\n\n",
        ]
        ctype = None if "sniff" in target else "text/event-stream"
        return [response_head(200, ctype, extra=extra), *chunked(events)], "keep"
    if target.startswith("/api/chat"):
        lines = [
            json.dumps(
                {
                    "message": {
                        "role": "assistant",
                        "content": m("nd-content"),
                        "thinking": m("nd-thinking"),
                    },
                    "done": False,
                }
            ).encode()
            + b"\n",
            f"{m('nd-bad-line')}\n".encode(),
            json.dumps(
                {
                    "message": {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "function": {
                                    "name": "get_weather",
                                    "arguments": {"city": m("nd-args")},
                                }
                            }
                        ],
                    },
                    "done": True,
                    "eval_count": 3,
                }
            ).encode()
            + b"\n",
        ]
        return [response_head(200, "application/x-ndjson", extra=extra), *chunked(lines)], "keep"
    payload = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": m("plain-content"),
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": m("plain-args")},
                            }
                        ],
                    },
                    "finish_reason": "stop",
                }
            ]
        }
    ).encode()
    return [
        response_head(200, "application/json", length=len(payload), extra=extra),
        payload,
    ], "keep"


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama", reply=m("reply"), reasoning=m("reasoning")) as up:
        yield up


@pytest.fixture(scope="module")
def oll() -> Iterator[Upstream]:
    with Upstream("ollama", reply=m("o-reply"), reasoning=m("o-reasoning")) as up:
        yield up


@pytest.fixture(scope="module")
def raw() -> Iterator[RawUpstream]:
    with RawUpstream(_raw_handler) as up:
        yield up


def _traffic(proxy: str, llama: Upstream, oll: Upstream, raw: RawUpstream) -> int:
    """Send every kind of exchange through ``proxy`` (a URL with credentials); return how many."""
    n = 0
    with httpx.Client(proxy=proxy, trust_env=False, timeout=30, headers=HEADERS) as c:

        def post(url: str, **kw: Any) -> httpx.Response:
            nonlocal n
            n += 1
            return c.post(url, **kw)

        for stream in (True, False):
            r = post(llama.url + "/v1/chat/completions", json=openai_body(stream))
            assert r.status_code == 200 and MARK in r.text
            r = post(oll.url + "/api/chat", json=ollama_body(stream))
            assert r.status_code == 200 and MARK in r.text
            r = post(
                oll.url + "/v1/chat/completions", json={**openai_body(stream), "model": "qwen3"}
            )
            assert r.status_code == 200 and MARK in r.text
        r = post(
            llama.url + "/v1/chat/completions",
            json=openai_body(True),
            headers={"x-fake": "context_error"},
        )
        assert r.status_code == 400
        # not chat: bodies are never digested, so never written
        r = post(llama.url + "/tokenize", json={"content": m("tokenize"), "with_pieces": True})
        assert MARK in r.text
        r = post(llama.url + "/apply-template", json=openai_body(False))
        assert MARK in r.text
        # chat bodies that are not JSON, or compressed
        post(llama.url + "/v1/chat/completions", content=f"{m('not-json')} {{".encode())
        post(
            llama.url + "/v1/chat/completions",
            content=gzip.compress(json.dumps(openai_body(False)).encode()),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        # a server that puts text everywhere
        for path in (
            "/v1/chat/completions",
            "/sniff/v1/chat/completions",
            "/api/chat",
            "/err/v1/chat/completions",
            "/plain/v1/chat/completions",
        ):
            body = ollama_body(True) if path == "/api/chat" else openai_body(True)
            r = post(raw.url + path, json=body)
            assert MARK in r.text
    return n


def _assert_clean(data: bytes, what: str, markers: bool) -> None:
    text = data.decode("utf-8", "replace")
    for secret in FORBIDDEN:
        assert secret not in text, f"{what}: a credential was written: {secret!r}"
    low = text.lower()
    assert "session=" not in low, f"{what}: a cookie was written"
    if markers:
        at = low.find(MARK.lower())
        assert at < 0, f"{what}: text was written: {text[max(0, at - 200) : at + 100]!r}"


def test_digest_recording_holds_no_text_and_no_credentials(
    llama: Upstream, oll: Upstream, raw: RawUpstream, tmp_path: Path
) -> None:
    path = tmp_path / "digest.jsonl"
    with Mitmdump(None, path, {"llmp_body": "digest"}, mode="regular") as proxy:
        creds = proxy.url.replace("http://", f"http://{PROXY_USER}:{PROXY_PASS}@")
        n = _traffic(creds, llama, oll, raw)
        records = wait_for_records(path, n, timeout=20)
        log = proxy.log_text()
    assert len(records) == n
    _assert_clean(path.read_bytes(), "digest recording", markers=True)
    _assert_clean(log.encode(), "proxy log", markers=True)
    # Not vacuous: the chat exchanges were digested, hashes and counts in place of text.
    first = records[0]
    dig = first["request"]["digest"]
    assert [msg["role"] for msg in dig["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
    ]
    assert dig["messages"][1]["chars"] == len(m("user-part"))
    assert dig["messages"][1]["chunks"] is None  # short
    (level,) = dig["messages"][3]["chunks"]  # long: sizes, ends and hex digits only
    assert set(level) == {"size", "ends", "hashes"} and set(level["hashes"]) <= set(
        "0123456789abcdef"
    )
    assert all(type(v) is int for v in (level["size"], *level["ends"]))
    assert dig["tools"][0]["name"] == "get_weather" and dig["params"]["grammar"] is True
    out = first["response"]["digest"]["output"]
    assert out["content_chars"] == len(m("reply")) and out["reasoning_chars"] == len(m("reasoning"))
    digested = [r for r in records if r["response"] and r["response"]["digest"]]
    assert len(digested) >= 10
    for rec in records:
        for part in (rec["request"], rec["response"] or {}):
            assert part.get("body") is None and part.get("body_text") is None


def test_full_recording_holds_no_credentials_even_with_proxyauth(
    llama: Upstream, oll: Upstream, raw: RawUpstream, tmp_path: Path
) -> None:
    path = tmp_path / "full.jsonl"
    opts = {"llmp_body": "full", "proxyauth": f"{PROXY_USER}:{PROXY_PASS}"}
    with Mitmdump(None, path, opts, mode="regular") as proxy:
        creds = proxy.url.replace("http://", f"http://{PROXY_USER}:{PROXY_PASS}@")
        n = _traffic(creds, llama, oll, raw)
        wrong = proxy.url.replace("http://", f"http://{PROXY_USER}:{SECRET}@")
        r = httpx.get(llama.url + "/health", proxy=wrong, trust_env=False, timeout=30)
        assert r.status_code == 407
        records = wait_for_records(path, n, timeout=20)
    data = path.read_bytes()
    _assert_clean(data, "full recording", markers=False)
    assert MARK.encode() in data  # full mode keeps bodies: the check above is not vacuous
    assert len([r for r in records if r["request"]["body"] is not None]) >= n - 2
    r15 = {"user-agent", "content-type", "content-length", "transfer-encoding"}
    # A response also keeps `server` (a program's name) and R34's provider headers.
    r34 = set(SERVER_HEADERS + PROVIDER_HEADERS + ACCOUNT_HEADERS)
    for rec in records:
        assert set(rec["request"].get("headers", {})) <= r15
        for name, value in ((rec["response"] or {}).get("headers", {})).items():
            assert name in r15 | r34 or (name.startswith(NAME_ONLY_PREFIXES) and value == "")


def test_recordings_are_created_0600_whatever_the_umask(
    llama: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    old = os.umask(0)
    try:
        explicit = tmp_path / "explicit.jsonl"
        with Mitmdump(llama.url, explicit) as proxy:
            httpx.get(proxy.url + "/health", timeout=30)
            wait_for_records(explicit, 1)
        # no llmp_file: llmp-<date>.jsonl in the current directory
        with Mitmdump(llama.url, None) as proxy:
            httpx.get(proxy.url + "/health", timeout=30)
            default = wait_for_default(tmp_path)
    finally:
        os.umask(old)
    for path in (explicit, default):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def wait_for_default(directory: Path) -> Path:
    today = datetime.date.today().isoformat()
    candidates = [directory / f"llmp-{today}.jsonl"]
    yesterday = (datetime.date.today() - datetime.timedelta(days=1)).isoformat()
    candidates.append(directory / f"llmp-{yesterday}.jsonl")  # run across midnight
    for path in candidates:
        if path.exists():
            wait_for_records(path, 1)
            return path
    raise AssertionError(f"no default recording in {directory}: {sorted(os.listdir(directory))}")


# -- cloud providers (R34, R35, R37): the cache fields, the echo, the diagnosis ---------


def _provider_bodies() -> dict[str, dict[str, Any]]:
    """Requests with text in every field R35's `cache` digest reads, and elsewhere."""
    odd_marker = {"type": "ephemeral", "ttl": m("ttl")}
    return {
        "/v1/messages": {
            "model": "claude-sonnet-4-6",
            "max_tokens": 16,
            "system": [{"type": "text", "text": m("a-system"), "cache_control": odd_marker}],
            "tools": [
                {
                    "name": "get_weather",
                    "description": m("a-tool"),
                    "input_schema": {"type": "object", "description": m("a-schema")},
                    "cache_control": odd_marker,
                }
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": m("a-user"), "cache_control": odd_marker},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": m("a-result"), "cache_control": odd_marker}
                            ],
                        },
                    ],
                }
            ],
            "tool_choice": {"type": "tool", "name": "get_weather", "note": m("a-choice")},
            "thinking": {"type": "enabled", "budget_tokens": 1024, "note": m("a-thinking")},
            "speed": m("a-speed"),
            "metadata": {"user_id": m("a-user-id")},
            "stop_sequences": [m("a-stop")],
            "cache_control": odd_marker,
            "diagnostics": {"previous_message_id": m("a-previous")},
        },
        "/v1/responses": {
            "model": "gpt-5.6",
            "instructions": m("r-instructions"),
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": m("r-input"),
                            "prompt_cache_breakpoint": {"mode": m("r-mode"), "ttl": m("r-ttl")},
                        }
                    ],
                },
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_text", "text": m("r-out")}],
                },
            ],
            "text": {
                "verbosity": m("r-verbosity"),
                "format": {"type": "json_schema", "schema": {"description": m("r-schema")}},
            },
            "reasoning": {"effort": m("r-effort"), "summary": "auto"},
            "prompt_cache_key": m("r-key"),
            "prompt_cache_retention": m("r-retention"),
            "prompt_cache_options": {
                "mode": m("r-mode"),
                "ttl": "30m",
                "comparison_response_id": m("r-compare"),
            },
            "service_tier": m("r-tier"),
            "metadata": {"k": m("r-metadata")},
            "user": m("r-user"),
            "safety_identifier": m("r-safety"),
        },
        "/v1/chat/completions": {
            "model": "anthropic/claude-sonnet-4.6",
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": m("c-system"), "cache_control": odd_marker}
                    ],
                },
                {"role": "user", "content": m("c-user")},
            ],
            "reasoning_effort": m("c-effort"),
            "verbosity": m("c-verbosity"),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"description": m("c-schema")},
            },
            "stream_options": {"include_usage": True},
            "prompt_cache_key": m("c-key"),
        },
    }


def test_provider_traffic_leaves_no_text_and_no_account(tmp_path: Path) -> None:
    """A provider's exchanges, each free-text field marked: in the request's cache
    fields, in OpenAI's echo of it, in Anthropic's diagnosis; accounts and rate limits
    in the response headers. Nothing of it reaches a digest recording."""
    path = tmp_path / "provider.jsonl"
    n = 0
    with (
        RawUpstream(provider_handler(m, SECRET)) as up,
        Mitmdump(None, path, {"llmp_body": "digest"}, mode="regular") as proxy,
        httpx.Client(proxy=proxy.url, trust_env=False, timeout=30, headers=HEADERS) as c,
    ):
        for target, body in _provider_bodies().items():
            for stream in (False, True):
                r = c.post(up.url + target, json={**body, "stream": stream})
                assert r.status_code == 200 and MARK in r.text  # the provider answered text
                n += 1
        records = wait_for_records(path, n, timeout=20)
        log = proxy.log_text()
    _assert_clean(path.read_bytes(), "provider digest recording", markers=True)
    _assert_clean(log.encode(), "proxy log", markers=True)
    # Not vacuous: the cache digests and the diagnoses were written, without their text.
    caches = [r["request"]["digest"]["cache"] for r in records]
    assert all(c is not None and c["breakpoints"] for c in caches[:4])
    assert {
        r["response"]["headers"].get("anthropic-ratelimit-tokens-remaining") for r in records[:2]
    } == {""}
    diagnoses = [r["response"]["digest"]["usage"].get("diagnostics") for r in records[:2]]
    assert (
        diagnoses
        == [{"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 4096}}]
        * 2
    )
    echoes = [r["response"]["digest"]["usage"] for r in records[2:4]]
    assert all(e["prompt_cache_diagnostics"]["type"] == "cache_miss" for e in echoes)
