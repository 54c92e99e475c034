"""Provider responses as the real SDKs model them, with free text in every place a
provider puts it: OpenAI's Responses object echoes the request (`instructions`,
`tools`, `text`, `metadata`, `user`, `prompt`…); Anthropic's message carries a cache
diagnosis.  Built and checked with the `openai` and `anthropic` SDKs' own models, so
their shapes are the providers'.  Shared by the unit, e2e and privacy tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic.types
import openai.types.responses

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
