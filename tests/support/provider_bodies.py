"""Provider responses as the real SDKs model them, with free text in every place a
provider puts it: OpenAI's Responses object echoes the request (`instructions`,
`tools`, `text`, `metadata`, `user`, `prompt`…); Anthropic's message carries a cache
diagnosis.  Built and checked with the `openai` and `anthropic` SDKs' own models, so
their shapes are the providers'.  Shared by the unit, e2e and privacy tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic.types
import openai.types.chat
import openai.types.responses

from tests.support.hardening import Handler, chunked, response_head

Mark = Callable[[str], str]
"""Makes a piece of free text that must never reach a digest recording."""


def openai_response(mark: Mark, model: str = "gpt-5.6") -> dict[str, Any]:
    """A Responses API response object that echoes a request full of text."""
    body = {
        "id": "resp_0a1b2c",
        "object": "response",
        "created_at": 1796116471.0,
        "completed_at": 1796116473.5,
        "status": "completed",
        "model": model,
        "instructions": mark("instructions"),
        "input_transformations": [],
        "output": [
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": mark("reasoning-summary")}],
                "encrypted_content": mark("encrypted"),
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": mark("reply"), "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "shell",
                "arguments": '{"cmd": "' + mark("arguments") + '"}',
                "status": "completed",
            },
        ],
        "parallel_tool_calls": True,
        "tool_choice": {"type": "function", "name": "shell"},
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": mark("tool-description"),
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                "strict": False,
            }
        ],
        "temperature": 1.0,
        "top_p": 1.0,
        "max_output_tokens": 4096,
        "previous_response_id": "resp_09",
        "conversation": {"id": "conv_77"},
        "metadata": {"note": mark("metadata")},
        "user": mark("user"),
        "safety_identifier": mark("safety-identifier"),
        "prompt": {"id": "pmpt_1", "variables": {"city": mark("prompt-variable")}},
        "prompt_cache_key": mark("cache-key"),
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {
            "mode": "explicit",
            "ttl": "30m",
            "comparison_response_id": "resp_08",
        },
        "prompt_cache_diagnostics": {
            "type": "cache_miss",
            "reason": "tools_changed",
            "cache_missed_tokens": 5120,
            "comparison_reusable_tokens": 1024,
        },
        "reasoning": {"effort": "high", "summary": "auto"},
        "service_tier": "default",
        "text": {
            "format": {
                "type": "json_schema",
                "name": "answer",
                "description": mark("format-description"),
                "schema": {"type": "object", "description": mark("schema-description")},
                "strict": True,
            },
            "verbosity": "low",
        },
        "truncation": "disabled",
        "usage": {
            "input_tokens": 6144,
            "input_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 5120},
            "output_tokens": 12,
            "output_tokens_details": {"reasoning_tokens": 4},
            "total_tokens": 6156,
        },
        "error": None,
        "incomplete_details": None,
        "background": False,
        "store": True,
        "top_logprobs": 0,
    }
    # The SDK's own model decides that this is a Responses object.
    return openai.types.responses.Response.model_validate(body).model_dump(
        mode="json", exclude_unset=True
    )


def anthropic_message(mark: Mark, diagnostics: Any = "miss") -> dict[str, Any]:
    """A Messages API response with a cache diagnosis (R37) beside its text."""
    diag: Any = {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 4096}}
    if diagnostics != "miss":
        diag = diagnostics
    body: dict[str, Any] = {
        "id": "msg_01XYZ",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-6",
        "content": [
            {"type": "thinking", "thinking": mark("thinking"), "signature": "sig"},
            {"type": "text", "text": mark("text")},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"p": mark("input")}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 4096,
            "cache_read_input_tokens": 2048,
            "cache_creation": {"ephemeral_5m_input_tokens": 4096, "ephemeral_1h_input_tokens": 0},
            "output_tokens": 30,
            "service_tier": "standard",
        },
        "diagnostics": diag,
    }
    checked = anthropic.types.Message.model_validate(body).model_dump(
        mode="json", exclude_unset=True
    )
    return checked


# -- a provider upstream: what Anthropic's and OpenAI's APIs answer, headers included --

ANTHROPIC_REQUEST_ID = "req_011CXprov1der"
OPENAI_REQUEST_ID = "req_8f1e2d3c4b5a"


def provider_headers(api: str, secret: str) -> dict[str, str]:
    """The response headers a provider sends beside the body (wire-formats.md); the
    account and rate-limit values hold `secret`, which no recording may hold."""
    if api == "anthropic":
        return {
            "request-id": ANTHROPIC_REQUEST_ID,
            "anthropic-organization-id": f"org-{secret}",
            "anthropic-workspace-id": f"wrkspc-{secret}",
            "anthropic-ratelimit-tokens-remaining": f"{secret}-tokens",
            "anthropic-ratelimit-requests-reset": f"{secret}-reset",
            "cf-ray": f"{secret}-ray",
            "set-cookie": f"__cf_bm={secret}; HttpOnly",
        }
    return {
        "x-request-id": OPENAI_REQUEST_ID,
        "openai-processing-ms": "412",
        "openai-version": "2020-10-01",
        "openai-organization": f"user-{secret}",
        "openai-project": f"proj_{secret}",
        "x-ratelimit-remaining-tokens": f"{secret}-left",
        "set-cookie": f"__cf_bm={secret}; HttpOnly",
    }


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_events(mark: Mark) -> list[bytes]:
    """A streamed message: the diagnosis on `message_start` (R37), text, the end."""
    start = anthropic_message(mark)
    del start["content"]
    start.update(content=[], stop_reason=None)
    return [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        _sse(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": mark("streamed-text")},
            },
        ),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 5},
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]


def responses_events(mark: Mark) -> list[bytes]:
    """A streamed Responses answer: `response.created` (the echo already in it), a text
    delta, `response.completed` with the whole object."""
    full = openai_response(mark)
    created = {**full, "status": "in_progress", "output": [], "usage": None}
    item = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    return [
        _sse(
            "response.created",
            {"type": "response.created", "sequence_number": 0, "response": created},
        ),
        _sse(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "sequence_number": 1,
                "output_index": 0,
                "item": item,
            },
        ),
        _sse(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "sequence_number": 2,
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": mark("streamed-delta"),
                "logprobs": [],
            },
        ),
        _sse(
            "response.completed",
            {"type": "response.completed", "sequence_number": 3, "response": full},
        ),
    ]


def chat_events(mark: Mark) -> list[bytes]:
    """A streamed chat completion whose usage comes in a last chunk (`include_usage`),
    with OpenRouter's `cost` and `cache_discount` beside the counts."""
    base = {
        "id": "gen-1",
        "object": "chat.completion.chunk",
        "created": 1796116471,
        "model": "gpt-5.6",
    }
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": mark("chat")}}],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": 2048,
                "completion_tokens": 3,
                "total_tokens": 2051,
                "prompt_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 0},
                "cost": 0.0042,
                "cache_discount": 0.0011,
            },
        },
    ]
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def chat_completion(mark: Mark) -> dict[str, Any]:
    """A whole chat completion, checked by the `openai` SDK's model."""
    body = {
        "id": "gen-2",
        "object": "chat.completion",
        "created": 1796116471,
        "model": "gpt-5.6",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": mark("chat")},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 2048,
            "completion_tokens": 3,
            "total_tokens": 2051,
            "prompt_tokens_details": {"cached_tokens": 1024},
        },
    }
    return openai.types.chat.ChatCompletion.model_validate(body).model_dump(
        mode="json", exclude_unset=True
    )


def provider_handler(mark: Mark, secret: str) -> Handler:
    """A `tests.support.hardening.RawUpstream` handler that answers like the providers:
    `/v1/messages` as Anthropic, `/v1/responses` and `/v1/chat/completions` as OpenAI,
    streamed or not as the request asks."""

    def handle(method: str, target: str, body: bytes) -> tuple[list[bytes], str]:
        request = json.loads(body) if body else {}
        path = target.split("?", 1)[0]
        api = "anthropic" if path.endswith("/v1/messages") else "openai"
        headers = provider_headers(api, secret)
        if request.get("stream"):
            if api == "anthropic":
                events = anthropic_events(mark)
            elif path.endswith("/v1/responses"):
                events = responses_events(mark)
            else:
                events = chat_events(mark)
            return [
                response_head(200, "text/event-stream", extra=headers),
                *chunked(events),
            ], "keep"
        if api == "anthropic":
            reply = anthropic_message(mark)
        elif path.endswith("/v1/responses"):
            reply = openai_response(mark)
        else:
            reply = chat_completion(mark)
        data = json.dumps(reply).encode()
        head = response_head(200, "application/json", length=len(data), extra=headers)
        return [head, data], "keep"

    return handle
