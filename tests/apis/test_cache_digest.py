"""R35's `cache` of a request digest, per API: breakpoints, blocks, settings, key.

Expected values are written by hand (hashes of hand-written canonical JSON), then
both digest paths are held to them: the plain one (`request_digest` of the parsed
body) and the recorder's (`request_digest_bytes`, whose message digests and marks
come from its cache by the items' bytes).  The harness captures show the real
shapes: Claude Code's breakpoints and Codex's `prompt_cache_key`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmp.apis import api_for
from llmp.apis.anthropic_messages import AnthropicMessages
from llmp.apis.base import ChatApi, DigestCache
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat
from llmp.apis.openai_responses import OpenAIResponses
from llmp.format import canonical
from llmp.format.canonical import hash_bytes
from llmp.recorder.capture import keep_request_headers
from tests.support.replay import load_capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness"
EPHEMERAL = {"type": "ephemeral"}


def tag(canon: str) -> str:
    """`fnv1a:<16 hex>` of hand-written canonical JSON (or of a value's bytes)."""
    return "fnv1a:" + hash_bytes(canon.encode("utf-8"))


def both_paths(api: ChatApi, body: dict[str, Any]) -> Any:
    """The `cache` digest, the same on the plain path and on the cached one (cold, warm)."""
    data = json.dumps(body).encode()
    plain = api.request_digest(canonical.loads(data))
    api._cache = DigestCache()
    cold = api.request_digest_bytes(data)
    warm = api.request_digest_bytes(data)
    assert cold is not None and warm is not None
    assert canonical.dumps(cold) == canonical.dumps(plain) == canonical.dumps(warm)
    return json.loads(canonical.dumps(plain["cache"]))


# ---------------------------------------------------------------- Anthropic


def test_anthropic_breakpoints_blocks_and_settings() -> None:
    body = {
        "model": "claude-sonnet-4-6",
        "system": [
            {"type": "text", "text": "billing"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "Rules.", "cache_control": {**EPHEMERAL, "ttl": "1h"}},
        ],
        "tools": [
            {"name": "Read", "input_schema": {}},
            {"name": "Edit", "input_schema": {}, "cache_control": EPHEMERAL},
        ],
        "messages": [
            {"role": "user", "content": "hello"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "file", "cache_control": EPHEMERAL},
                            {"type": "image", "source": {"type": "base64", "data": "AA=="}},
                        ],
                    },
                    {"type": "image", "source": {"type": "base64", "data": "AA=="}},
                    {"type": "text", "text": "now?", "cache_control": {**EPHEMERAL, "ttl": "5m"}},
                ],
            },
        ],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "speed": "fast",
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
    assert both_paths(AnthropicMessages(), body) == {
        "breakpoints": [
            {"at": "tools", "index": 1, "block": 0, "ttl": None},
            {"at": "messages", "index": 1, "block": 0, "ttl": None},
            {"at": "messages", "index": 2, "block": 0, "ttl": "1h"},
            {"at": "messages", "index": 5, "block": 0, "ttl": None},  # inside the result
            {"at": "messages", "index": 5, "block": 2, "ttl": "5m"},
        ],
        "auto": {"ttl": "1h"},
        "blocks": [1, 1, 1, 1, 2, 3],
        "settings": {
            "tool_choice": tag('{"type":"auto"}'),
            "thinking": tag('{"budget_tokens":1024,"type":"enabled"}'),
            "images": 2,
            "speed": "fast",
        },
        "key": None,
        "retention": None,
        "options": None,
        "include_usage": None,
    }


def test_anthropic_string_system_and_no_markers() -> None:
    body = {"model": "m", "system": "Be brief.", "messages": [{"role": "user", "content": []}]}
    assert both_paths(AnthropicMessages(), body) == {
        "breakpoints": [],
        "auto": None,
        "blocks": [1, 0],
        "settings": {"tool_choice": None, "thinking": None, "images": 0, "speed": None},
        "key": None,
        "retention": None,
        "options": None,
        "include_usage": None,
    }


def test_marker_values_keep_no_text() -> None:
    """A `ttl` or `speed` that is not a short enum is hashed: it could be text."""
    odd = "five minutes, please"
    body = {
        "model": "m",
        "speed": {"mode": odd},
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"ttl": odd}}],
            },
            {"role": "user", "content": [{"type": "text", "text": "y", "cache_control": None}]},
        ],
    }
    cache = both_paths(AnthropicMessages(), body)
    assert cache["breakpoints"] == [
        {"at": "messages", "index": 0, "block": 0, "ttl": tag(json.dumps(odd))}
    ]  # a null marker is no breakpoint
    assert cache["settings"]["speed"] == tag('{"mode":"five minutes, please"}')
    assert odd not in json.dumps(cache)


def test_moving_a_marker_changes_the_cache_digest_not_the_hashes() -> None:
    """R22 strips `cache_control` before hashing; R35's digest records where it was."""
    api = AnthropicMessages()

    def body(at: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": t} for t in ("a", "b")]
        content[at]["cache_control"] = EPHEMERAL
        return {"model": "m", "messages": [{"role": "user", "content": content}]}

    d0, d1 = api.request_digest(body(0)), api.request_digest(body(1))
    assert d0["messages"] == d1["messages"] and d0["tools_hash"] == d1["tools_hash"]
    assert [b["block"] for b in both_paths(api, body(0))["breakpoints"]] == [0]
    assert [b["block"] for b in both_paths(api, body(1))["breakpoints"]] == [1]


# ---------------------------------------------------------------- OpenAI Responses


def test_responses_breakpoints_settings_key_and_options() -> None:
    mark = {"mode": "explicit", "ttl": "30m"}
    body = {
        "model": "gpt-5.6",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b", "prompt_cache_breakpoint": mark},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [
                    {
                        "type": "input_text",
                        "text": "ok",
                        "prompt_cache_breakpoint": {"mode": "explicit"},
                    }
                ],
            },
            {"role": "user", "content": "next"},
        ],
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {
            "verbosity": "low",
            "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}},
        },
        "parallel_tool_calls": False,
        "service_tier": "priority",
        "prompt_cache_key": "019b-conversation",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {
            "mode": "explicit",
            "ttl": "30m",
            "comparison_response_id": "resp_9",
        },
        "stream_options": {"include_obfuscation": False},
    }
    assert both_paths(OpenAIResponses(), body) == {
        "breakpoints": [
            {"at": "messages", "index": 1, "block": 1, "ttl": "30m"},
            {"at": "messages", "index": 3, "block": 0, "ttl": None},
        ],
        "auto": None,
        "blocks": [1, 2, 1, 1, 1],
        "settings": {
            "reasoning_effort": "high",
            "verbosity": "low",
            "text_format": tag('{"name":"out","schema":{"type":"object"},"type":"json_schema"}'),
            "parallel_tool_calls": False,
            "service_tier": "priority",
        },
        "key": tag("019b-conversation"),  # the value's bytes, as R32 hashes a header
        "retention": "24h",
        "options": {"mode": "explicit", "ttl": "30m", "comparison": True},
        "include_usage": None,
    }
    assert "resp_9" not in json.dumps(both_paths(OpenAIResponses(), body))


def test_responses_string_input_and_nothing_set() -> None:
    cache = OpenAIResponses().request_digest({"model": "m", "input": "hi"})["cache"]
    assert cache is not None
    assert cache["blocks"] == [1] and cache["breakpoints"] == []
    assert cache["settings"] == dict.fromkeys(
        ("reasoning_effort", "verbosity", "text_format", "parallel_tool_calls", "service_tier")
    )
    assert cache["key"] is None and cache["options"] is None


# ---------------------------------------------------------------- OpenAI Chat


def test_chat_parts_markers_tool_calls_and_include_usage() -> None:
    body = {
        "model": "anthropic/claude-sonnet-4.6",
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "sys", "cache_control": EPHEMERAL}],
            },
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "q",
                        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                    }
                ],
            },
        ],
        "tools": [
            {"type": "function", "function": {"name": "f"}, "cache_control": EPHEMERAL},
        ],
        "reasoning": {"effort": "medium"},
        "response_format": {"type": "json_object"},
        "parallel_tool_calls": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": "k",
    }
    assert both_paths(OpenAIChat(), body) == {
        "breakpoints": [
            {"at": "tools", "index": 0, "block": 0, "ttl": None},
            {"at": "messages", "index": 0, "block": 0, "ttl": None},
            {"at": "messages", "index": 4, "block": 0, "ttl": "12h"},
        ],
        "auto": None,
        "blocks": [1, 1, 2, 1, 1],
        "settings": {
            "reasoning_effort": "medium",
            "verbosity": None,
            "text_format": tag('{"type":"json_object"}'),
            "parallel_tool_calls": True,
            "service_tier": None,
        },
        "key": tag("k"),
        "retention": None,
        "options": None,
        "include_usage": True,
    }


def test_ollama_api_chat_has_no_cache_digest() -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}
    data = json.dumps(body).encode()
    assert OllamaChat().request_digest(body)["cache"] is None
    digest = OllamaChat().request_digest_bytes(data)
    assert digest is not None and digest["cache"] is None
    # Ollama's OpenAI endpoint is chat completions: it has one.
    assert OpenAIChat().request_digest(body)["cache"] is not None


# ---------------------------------------------------------------- the harnesses' shapes


def _requests(name: str) -> list[tuple[Any, dict[str, Any], bytes]]:
    out = []
    for ex in load_capture(FIXTURES / name):
        api = api_for(ex.method, ex.path)
        if api is not None and ex.request_body:
            out.append((ex, json.loads(ex.request_body), ex.request_body))
    assert out
    return out


@pytest.mark.parametrize("name", ["claude-2.jsonl.gz", "claude-5.jsonl.gz", "claude-7.jsonl.gz"])
def test_claude_code_requests(name: str) -> None:
    """Breakpoints on system blocks and on the last user block; one block count per
    digest message; the thinking setting hashed; `anthropic-beta` kept verbatim."""
    api = AnthropicMessages()
    seen = 0
    for ex, body, data in _requests(name):
        digest = api.request_digest_bytes(data)
        assert digest is not None
        cache = json.loads(canonical.dumps(digest["cache"]))
        system = body.get("system")
        system = [system] if isinstance(system, str) else (system or [])
        contents = [m["content"] for m in body["messages"]]
        assert cache["blocks"] == [1] * len(system) + [
            1 if isinstance(c, str) else len(c) for c in contents
        ]
        assert len(cache["blocks"]) == len(digest["messages"])
        want = [
            (i, 0) for i, b in enumerate(system) if isinstance(b, dict) and b.get("cache_control")
        ]
        for k, c in enumerate(contents):
            if isinstance(c, list):
                want += [(len(system) + k, j) for j, b in enumerate(c) if b.get("cache_control")]
        assert [(b["index"], b["block"]) for b in cache["breakpoints"]] == want
        assert all(b["at"] == "messages" for b in cache["breakpoints"])
        thinking = body.get("thinking")
        assert cache["settings"]["thinking"] == (
            None if thinking is None else "fnv1a:" + hash_bytes(canonical.dumps(thinking))
        )
        headers = keep_request_headers(ex.request_headers)
        beta = dict((k.lower(), v) for k, v in ex.request_headers).get("anthropic-beta")
        assert headers.get("anthropic-beta") == beta
        seen += len(want)
    assert seen >= 2  # not vacuous: Claude Code marks its system blocks and last block


@pytest.mark.parametrize("name", ["codex-1.jsonl.gz", "codex-3.jsonl.gz"])
def test_codex_requests(name: str) -> None:
    """Codex sets `prompt_cache_key` to its session id: the digest's key is the hash
    the record keeps of its `session-id` header; an item's blocks are its parts."""
    api = OpenAIResponses()
    for ex, body, data in _requests(name):
        digest = api.request_digest_bytes(data)
        assert digest is not None
        cache = json.loads(canonical.dumps(digest["cache"]))
        headers = keep_request_headers(ex.request_headers)
        assert cache["key"] == headers["session-id"] == tag(body["prompt_cache_key"])
        items = body["input"]
        lead = [1] if body.get("instructions") else []
        assert cache["blocks"] == lead + [
            len(i["content"]) if isinstance(i.get("content"), list) else 1 for i in items
        ]
        assert cache["breakpoints"] == []  # before GPT-5.6: no markers
        settings = cache["settings"]
        assert settings["parallel_tool_calls"] == body.get("parallel_tool_calls")
        assert settings["reasoning_effort"] == (body.get("reasoning") or {}).get("effort")
