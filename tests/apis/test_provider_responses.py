"""Provider responses digested without text (R27, R37, "digest mode writes no text").

OpenAI's Responses object echoes the request: R27's "every top-level field but
`output`" would write its instructions, tool descriptions, schema, metadata and
user into a digest, so the digest keeps an allow-list (`response_top`).
Anthropic's `diagnostics` keeps its structure, its reason's `type` and its
counts.  The bodies come from the SDKs' own models (`tests.support.provider_bodies`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmp.apis.anthropic_messages import AnthropicMessages, anthropic_counts
from llmp.apis.base import diagnosis_safe
from llmp.apis.openai_responses import OpenAIResponses, response_top, responses_counts
from llmp.format.canonical import hash_bytes
from tests.support.provider_bodies import anthropic_message, openai_response

MARK = "QXZV"


def m(what: str) -> str:
    return f"{MARK}-{what} some private words"


def test_openai_echo_leaves_no_text() -> None:
    body = openai_response(m)
    echoed = json.dumps(body)
    for what in ("instructions", "tool-description", "metadata", "user", "prompt-variable"):
        assert m(what) in echoed  # the echo is full of text
    for what in ("format-description", "schema-description", "cache-key", "safety-identifier"):
        assert m(what) in echoed
    digest = OpenAIResponses().response_digest(body)
    assert MARK not in json.dumps(digest)
    assert digest["usage"] == {
        "id": "resp_0a1b2c",
        "object": "response",
        "created_at": 1796116471.0,
        "completed_at": 1796116473.5,
        "status": "completed",
        "model": "gpt-5.6",
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_output_tokens": 4096,
        "previous_response_id": "resp_09",
        "conversation": {"id": "conv_77"},
        "prompt_cache_key": "fnv1a:" + hash_bytes(m("cache-key").encode()),
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "explicit", "ttl": "30m", "comparison": True},
        "prompt_cache_diagnostics": {
            "type": "cache_miss",
            "reason": "tools_changed",
            "cache_missed_tokens": 5120,
            "comparison_reusable_tokens": 1024,
        },
        "reasoning": {"effort": "high", "summary": "auto"},
        "service_tier": "default",
        "text": {"verbosity": "low", "format": {"type": "json_schema"}},
        "truncation": "disabled",
        "usage": body["usage"],
        "error": None,
        "incomplete_details": None,
        "background": False,
        "store": True,
        "top_logprobs": 0,
    }
    assert digest["output"] == {
        "content_chars": len(m("reply")),
        "reasoning_chars": len(m("reasoning-summary")),
        "tool_calls": [{"id": "call_1", "name": "shell"}],
    }
    counts = responses_counts(digest["usage"])  # R27's counters still read
    assert counts.prompt_tokens == (6144, "server") and counts.reused_tokens == (1024, "server")


def test_local_servers_keep_their_counters() -> None:
    """llama-server's `timings` beside the response; unknown strings and objects go."""
    body = {
        "id": "resp_x",
        "object": "response",
        "created_at": 1,
        "model": "gemma",
        "status": "completed",
        "output": [],
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}},
        "timings": {"cache_n": 4, "prompt_n": 5, "prompt_ms": 12.5},
        "input_messages": [{"role": "user", "content": m("vllm-echo")}],
        "kv_transfer_params": {"remote": m("kv")},
        "unknown_string": m("unknown"),
    }
    top = response_top(body)
    assert top == {
        k: body[k] for k in ("id", "object", "created_at", "model", "status", "usage", "timings")
    }
    assert responses_counts(top).prefill_ms is not None  # the timings still read


@pytest.mark.parametrize(
    ("diagnostics", "kept"),
    [
        (
            "miss",
            {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 4096}},
        ),
        (None, None),  # compared, nothing diverged
        ({"cache_miss_reason": None}, {"cache_miss_reason": None}),  # not ready
        (
            {"cache_miss_reason": {"type": "previous_message_not_found"}},
            {"cache_miss_reason": {"type": "previous_message_not_found"}},
        ),
    ],
)
def test_anthropic_diagnostics_keep_type_and_counts(diagnostics: Any, kept: Any) -> None:
    body = anthropic_message(m, diagnostics)
    digest = AnthropicMessages().response_digest(body)
    assert digest["usage"]["diagnostics"] == kept
    assert MARK not in json.dumps(digest)
    counts = anthropic_counts(digest["usage"])
    assert counts.reused_tokens == (2048, "server") and counts.evaluated_tokens == (4108, "server")


def test_diagnosis_keeps_no_text_whatever_comes() -> None:
    """A future field with text in it, a list, a non-enum `type`: all go."""
    value = {
        "cache_miss_reason": {
            "type": "messages_changed",
            "cache_missed_input_tokens": 7,
            "detail": m("detail"),
            "where": [m("list")],
            "nested": {"reason": "input_changed", "text": m("nested"), "n": 1.5, "ok": True},
        },
        "note": m("note"),
        "type": m("type-with-words"),
    }
    assert diagnosis_safe(value) == {
        "cache_miss_reason": {
            "type": "messages_changed",
            "cache_missed_input_tokens": 7,
            "nested": {"reason": "input_changed", "n": 1.5, "ok": True},
        }
    }
    assert diagnosis_safe(m("top")) is None
    assert diagnosis_safe(3) == 3


def test_an_anthropic_stream_keeps_the_diagnosis_of_message_start() -> None:
    """Streamed, the diagnosis comes on `message_start` (R37) and is kept the same way."""
    api = AnthropicMessages()
    merger = api.merger()
    start = anthropic_message(m)
    content = start.pop("content")
    merger.add({"type": "message_start", "message": {**start, "content": []}})
    merger.add({"type": "content_block_start", "index": 0, "content_block": content[1]})
    merger.add(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3},
        }
    )
    merger.add({"type": "message_stop"})
    merged = merger.result()
    assert merged is not None
    digest = api.response_digest(merged)
    assert digest["usage"]["diagnostics"] == {
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 4096}
    }
    assert MARK not in json.dumps(digest)
