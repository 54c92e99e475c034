"""SSE (R9) and NDJSON (R10) merges, stream sniffing (R8) and StreamCapture (R8, R12).

Payloads follow wire-formats.md: llama-server, Ollama /v1 and Ollama /api/chat.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from llmp.apis.ollama_chat import NDJSONMerger
from llmp.apis.openai_chat import SSEMerger
from llmp.format import canonical
from llmp.recorder.stream import StreamCapture, sniff_stream

MiB = 1 << 20

# ------------------------------------------------------------------ builders

LLAMA_ID = "chatcmpl-Xq3Zb7Kd9Lm2Np4Rs6Tv8Wx0Yz1Ab3Cd"
TOOL_ID = "aB3dE5gH7jK9mN1pQ3sT5vX7zA9cE1gH"  # 32 alphanumerics
LLAMA_TOP = {
    "created": 1788595136,
    "id": LLAMA_ID,
    "model": "qwen3.6-35b-a3b-q4_k_m.gguf",
    "system_fingerprint": "b6123-8d6f5a1e",
    "object": "chat.completion.chunk",
}
USAGE = {
    "completion_tokens": 35,
    "prompt_tokens": 237,
    "total_tokens": 272,
    "prompt_tokens_details": {"cached_tokens": 236},
}
TIMINGS = {
    "cache_n": 236,
    "prompt_n": 1,
    "prompt_ms": 30.958,
    "prompt_per_token_ms": 30.958,
    "prompt_per_second": 32.3,
    "predicted_n": 35,
    "predicted_ms": 661.06,
    "predicted_per_token_ms": 18.89,
    "predicted_per_second": 52.94,
}


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0, **extra: Any) -> dict:
    """A llama-server chunk, keys in llama-server's order."""
    choice = {"finish_reason": finish, "index": index, "delta": delta}
    return {"choices": [choice], **LLAMA_TOP, **extra}


def usage_chunk(**extra: Any) -> dict:
    return {"choices": [], **LLAMA_TOP, "usage": USAGE, "timings": TIMINGS, **extra}


def sse(*events: dict | str) -> bytes:
    """Encode events as llama-server does: ``data: <compact JSON>\\n\\n``."""
    out = []
    for event in events:
        text = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        out.append(f"data: {text}\n\n".encode())
    return b"".join(out)


def merge_sse(*events: dict) -> dict | None:
    merger = SSEMerger()
    for event in events:
        merger.add(event)
    return merger.result()


def merge_ndjson(*objs: dict) -> dict | None:
    merger = NDJSONMerger()
    for obj in objs:
        merger.add(obj)
    return merger.result()


def capture(kind: str, *pieces: bytes, limit: int = 32 * MiB) -> StreamCapture:
    cap = StreamCapture(kind, limit)
    for piece in pieces:
        cap.feed(piece)
    cap.close()
    return cap


def state(cap: StreamCapture) -> tuple[Any, ...]:
    """Everything a capture reports, for split-invariance comparisons."""
    return (
        cap.chunks,
        cap.bad_chunks,
        cap.body_bytes,
        cap.truncated,
        cap.done_seen,
        canonical.dumps(cap.merged()),
        cap.internal_errors,
    )


# llama-server: role delta, reasoning, content, finish, usage chunk with timings.
LLAMA_CHAT = [
    chunk({"role": "assistant", "content": None}),
    chunk({"reasoning_content": "Let me"}),
    chunk({"reasoning_content": " think."}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo ü€!"}),
    chunk({}, finish="stop"),
    usage_chunk(),
]
LLAMA_CHAT_MERGED = {
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hello ü€!",
                "reasoning_content": "Let me think.",
            },
            "finish_reason": "stop",
        }
    ],
    "created": 1788595136,
    "id": LLAMA_ID,
    "model": "qwen3.6-35b-a3b-q4_k_m.gguf",
    "system_fingerprint": "b6123-8d6f5a1e",
    "object": "chat.completion",
    "usage": USAGE,
    "timings": TIMINGS,
}
LLAMA_CHAT_BYTES = sse(LLAMA_CHAT[0]) + b":\n\n" + sse(*LLAMA_CHAT[1:], "[DONE]")


# llama-server tool call: header delta, then argument fragments (newer builds).
LLAMA_TOOL = [
    chunk({"role": "assistant", "content": None}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": TOOL_ID,
                    "type": "function",
                    "function": {"name": "get_weather"},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Tok'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'yo"}'}}]}),
    chunk({}, finish="tool_calls"),
    usage_chunk(),
]
TOOL_CALL_MERGED = {
    "id": TOOL_ID,
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'},
}


# ------------------------------------------------------------------ SSEMerger


def test_llama_reasoning_and_content() -> None:
    merged = merge_sse(*LLAMA_CHAT)
    assert merged == LLAMA_CHAT_MERGED
    assert list(merged) == list(LLAMA_CHAT_MERGED)  # llama-server's key order kept
    assert list(merged["choices"][0]["message"]) == ["role", "content", "reasoning_content"]


def test_no_event_gives_none() -> None:
    assert SSEMerger().result() is None
    merger = SSEMerger()
    merger.add("not a dict")  # type: ignore[arg-type]
    assert merger.result() is None


def test_llama_tool_call_header_and_fragments() -> None:
    merged = merge_sse(*LLAMA_TOOL)
    assert merged is not None
    assert merged["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL_MERGED]},
            "finish_reason": "tool_calls",
        }
    ]
    assert merged["usage"] == USAGE
    assert merged["timings"] == TIMINGS


def test_older_llama_builds_repeat_arguments_and_function() -> None:
    older = [
        chunk({"role": "assistant", "content": None}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": TOOL_ID,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":'},
                    }
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "function": {"name": "", "arguments": '"Tokyo"}'}},
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}),
        chunk({}, finish="tool_calls"),
    ]
    merged = merge_sse(*older)
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"] == [TOOL_CALL_MERGED]


def test_parallel_tool_calls_merged_by_index_and_sorted() -> None:
    events = [
        chunk({"role": "assistant", "content": None}),
        chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "b" * 32, "type": "function", "function": {"name": "g"}}
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "a" * 32, "type": "function", "function": {"name": "f"}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"y":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "2}"}}]}),
    ]
    merged = merge_sse(*events)
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"] == [
        {"id": "a" * 32, "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b" * 32, "type": "function", "function": {"name": "g", "arguments": '{"y":2}'}},
    ]


def test_tool_call_without_index_uses_position_in_its_delta() -> None:
    events = [
        chunk(
            {
                "tool_calls": [
                    {"id": "x1", "type": "function", "function": {"name": "f", "arguments": "{"}},
                    {"id": "x2", "type": "function", "function": {"name": "g", "arguments": "["}},
                ]
            }
        ),
        chunk({"tool_calls": [{"function": {"arguments": "}"}}, {"function": {"arguments": "]"}}]}),
    ]
    merged = merge_sse(*events)
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"] == [
        {"id": "x1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "x2", "type": "function", "function": {"name": "g", "arguments": "[]"}},
    ]


def test_tool_call_missing_fields_are_null_and_arguments_empty() -> None:
    merged = merge_sse(chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}))
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"] == [
        {"id": None, "type": None, "function": {"name": "f", "arguments": ""}}
    ]


def test_tool_call_extra_keys_kept_last_non_null() -> None:
    merged = merge_sse(
        chunk({"tool_calls": [{"index": 0, "x": 1, "function": {"name": "f", "strict": True}}]}),
        chunk({"tool_calls": [{"index": 0, "x": None, "function": {"strict": None}}]}),
    )
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"] == [
        {
            "id": None,
            "type": None,
            "function": {"name": "f", "arguments": "", "strict": True},
            "x": 1,
        }
    ]


def test_tool_call_object_arguments_kept_when_no_string_came() -> None:
    merged = merge_sse(
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": {"a": 1}}}]})
    )
    assert merged is not None
    assert merged["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_no_tool_calls_key_when_none_seen() -> None:
    merged = merge_sse(chunk({"content": "x", "tool_calls": []}))
    assert merged is not None
    assert merged["choices"][0]["message"] == {"role": None, "content": "x"}


def test_content_null_when_no_delta_carried_a_string() -> None:
    merged = merge_sse(chunk({"role": "assistant", "content": None}), chunk({}, finish="stop"))
    assert merged is not None
    assert merged["choices"][0]["message"] == {"role": "assistant", "content": None}


def test_content_empty_string_is_a_string() -> None:
    merged = merge_sse(chunk({"role": "assistant", "content": ""}))
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == ""


def test_non_string_content_is_ignored() -> None:
    merged = merge_sse(chunk({"content": [{"type": "text", "text": "x"}]}), chunk({"content": 5}))
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] is None


def test_role_is_first_non_null() -> None:
    merged = merge_sse(chunk({"role": None}), chunk({"role": "assistant"}), chunk({"role": "tool"}))
    assert merged is not None
    assert merged["choices"][0]["message"]["role"] == "assistant"


def test_return_progress_chunks_repeat_role_and_prompt_progress_last_wins() -> None:
    events = [
        chunk(
            {"role": "assistant", "content": None},
            prompt_progress={"total": 2000, "cache": 0, "processed": 1000, "time_ms": 500},
        ),
        chunk(
            {"role": "assistant", "content": None},
            prompt_progress={"total": 2000, "cache": 0, "processed": 2000, "time_ms": 990},
        ),
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "ok"}),
        chunk({}, finish="stop", timings=TIMINGS),
    ]
    merged = merge_sse(*events)
    assert merged is not None
    assert merged["prompt_progress"] == {
        "total": 2000,
        "cache": 0,
        "processed": 2000,
        "time_ms": 990,
    }
    assert merged["timings"] == TIMINGS  # on the finish chunk when there is no usage chunk
    assert merged["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert "usage" not in merged


def test_timings_per_token_last_wins() -> None:
    events = [
        chunk({"content": "a"}, timings={"predicted_n": 1, "predicted_ms": 18.5}),
        chunk({"content": "b"}, timings={"predicted_n": 2, "predicted_ms": 37.1}),
        chunk({}, finish="length", timings={"predicted_n": 2, "predicted_ms": 38.0}),
    ]
    merged = merge_sse(*events)
    assert merged is not None
    assert merged["timings"] == {"predicted_n": 2, "predicted_ms": 38.0}
    assert merged["choices"][0]["finish_reason"] == "length"


def test_usage_only_chunk_updates_usage_and_timings() -> None:
    merged = merge_sse(chunk({"content": "a"}, usage=None), usage_chunk())
    assert merged is not None
    assert merged["usage"] == USAGE
    assert merged["timings"] == TIMINGS
    assert merged["choices"] == [
        {"index": 0, "message": {"role": None, "content": "a"}, "finish_reason": None}
    ]


def test_top_level_last_non_null_and_null_only_kept_as_null() -> None:
    merged = merge_sse(
        {"choices": [], "a": 1, "b": None, "c": {"x": 1}},
        {"choices": [], "a": None, "c": {"y": 2}, "d": "new"},
    )
    assert merged == {
        "choices": [],
        "a": 1,
        "b": None,
        "c": {"y": 2},
        "d": "new",
        "object": "chat.completion",
    }


def test_object_and_choices_always_present() -> None:
    assert merge_sse({"error": {"code": 500}}) == {
        "error": {"code": 500},
        "choices": [],
        "object": "chat.completion",
    }


def test_mid_stream_error_kept() -> None:
    error = {"code": 500, "message": "Failed to decode the batch", "type": "server_error"}
    merged = merge_sse(
        chunk({"role": "assistant", "content": None}), chunk({"content": "Par"}), {"error": error}
    )
    assert merged is not None
    assert merged["error"] == error
    assert merged["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Par"}, "finish_reason": None}
    ]
    assert merged["object"] == "chat.completion"


def test_n_greater_than_one() -> None:
    events = [
        chunk({"role": "assistant", "content": None}, index=0),
        chunk({"role": "assistant", "content": None}, index=1),
        chunk({"content": "B1"}, index=1),
        chunk({"content": "A1"}, index=0),
        chunk({"content": "B2"}, index=1),
        chunk({}, finish="length", index=1),
        chunk({"content": "A2"}, index=0),
        chunk({}, finish="stop", index=0),
        usage_chunk(),
    ]
    merged = merge_sse(*events)
    assert merged is not None
    assert merged["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "A1A2"}, "finish_reason": "stop"},
        {
            "index": 1,
            "message": {"role": "assistant", "content": "B1B2"},
            "finish_reason": "length",
        },
    ]


def test_choice_without_index_uses_position() -> None:
    merged = merge_sse(
        {"choices": [{"delta": {"content": "a"}}, {"delta": {"content": "b"}}]},
        {"choices": [{"delta": {"content": "c"}}, {"index": 1, "delta": {"content": "d"}}]},
    )
    assert merged is not None
    assert [c["message"]["content"] for c in merged["choices"]] == ["ac", "bd"]


def test_finish_reason_last_non_null() -> None:
    merged = merge_sse(chunk({}, finish="tool_calls"), chunk({}, finish=None))
    assert merged is not None
    assert merged["choices"][0]["finish_reason"] == "tool_calls"


OLLAMA_V1_TOP = {
    "id": "chatcmpl-412",
    "object": "chat.completion.chunk",
    "created": 1788595136,
    "model": "qwen3:8b",
    "system_fingerprint": "fp_ollama",
}


def ollama_v1(delta: dict[str, Any], finish: str | None = None) -> dict:
    return {**OLLAMA_V1_TOP, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_ollama_v1_reasoning_and_whole_tool_calls() -> None:
    events = [
        ollama_v1({"role": "assistant", "content": "", "reasoning": "The user"}),
        ollama_v1({"role": "assistant", "content": "", "reasoning": " wants weather."}),
        ollama_v1(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_ab12cd34",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'},
                    }
                ],
            }
        ),
        ollama_v1({"role": "assistant", "content": ""}, finish="tool_calls"),
        {
            **OLLAMA_V1_TOP,
            "choices": [],
            "usage": {"prompt_tokens": 150, "completion_tokens": 20, "total_tokens": 170},
        },
    ]
    merged = merge_sse(*events)
    assert merged == {
        "id": "chatcmpl-412",
        "object": "chat.completion",
        "created": 1788595136,
        "model": "qwen3:8b",
        "system_fingerprint": "fp_ollama",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "",
                    "reasoning": "The user wants weather.",
                    "tool_calls": [
                        {
                            "id": "call_ab12cd34",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Tokyo"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 150, "completion_tokens": 20, "total_tokens": 170},
    }


def test_both_reasoning_keys_kept_in_first_seen_order() -> None:
    merged = merge_sse(
        chunk({"reasoning": "r1"}),
        chunk({"reasoning_content": "c1", "reasoning": "r2"}),
        chunk({"reasoning_content": "c2", "reasoning": None}),
    )
    assert merged is not None
    message = merged["choices"][0]["message"]
    assert message == {
        "role": None,
        "content": None,
        "reasoning": "r1r2",
        "reasoning_content": "c1c2",
    }
    assert list(message) == ["role", "content", "reasoning", "reasoning_content"]


def test_reasoning_key_absent_when_only_null() -> None:
    merged = merge_sse(chunk({"content": "x", "reasoning_content": None}))
    assert merged is not None
    assert merged["choices"][0]["message"] == {"role": None, "content": "x"}


def test_other_message_and_choice_keys_last_non_null() -> None:
    merged = merge_sse(
        {"choices": [{"index": 0, "delta": {"refusal": None, "audio": {"id": 1}}, "x": 1}]},
        {"choices": [{"index": 0, "delta": {"refusal": "no", "audio": None}, "x": None}]},
    )
    assert merged is not None
    assert merged["choices"] == [
        {
            "index": 0,
            "message": {"role": None, "content": None, "refusal": "no", "audio": {"id": 1}},
            "finish_reason": None,
            "x": 1,
        }
    ]


def test_logprobs_token_lists_concatenated() -> None:
    t1 = {"token": "He", "logprob": -0.1, "bytes": [72, 101], "top_logprobs": []}
    t2 = {"token": "llo", "logprob": -0.2, "bytes": [108, 108, 111], "top_logprobs": []}
    merged = merge_sse(
        {"choices": [{"index": 0, "delta": {"content": "He"}, "logprobs": {"content": [t1]}}]},
        {"choices": [{"index": 0, "delta": {}, "logprobs": None}]},
        {"choices": [{"index": 0, "delta": {"content": "llo"}, "logprobs": {"content": [t2]}}]},
    )
    assert merged is not None
    assert merged["choices"][0]["logprobs"] == {"content": [t1, t2]}


def test_logprobs_result_is_a_copy() -> None:
    t1 = {"token": "a", "logprob": -0.1}
    t2 = {"token": "b", "logprob": -0.2}
    merger = SSEMerger()
    merger.add({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [t1]}}]})
    first = merger.result()
    merger.add({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [t2]}}]})
    assert first is not None
    assert first["choices"][0]["logprobs"] == {"content": [t1]}
    second = merger.result()
    assert second is not None
    assert second["choices"][0]["logprobs"] == {"content": [t1, t2]}


def test_message_instead_of_delta_and_legacy_text() -> None:
    merged = merge_sse(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}]},
        {"choices": [{"index": 0, "text": "x"}]},
        {"choices": [{"index": 0, "text": "y"}]},
    )
    assert merged is not None
    assert merged["choices"] == [
        {
            "index": 0,
            "text": "xy",
            "message": {"role": "assistant", "content": "a"},
            "finish_reason": None,
        }
    ]


def test_garbage_shapes_are_ignored() -> None:
    merged = merge_sse(
        {"choices": None},
        {"choices": ["x", 1, None, {"index": True, "delta": "x"}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": "x", "content": "ok"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [1, None, {"function": "x"}]}}]},
    )
    assert merged is not None
    # {"index": True} is not an integer index: it took position 3.
    assert merged["choices"] == [
        {
            "index": 0,
            "message": {
                "role": None,
                "content": "ok",
                "tool_calls": [
                    {"id": None, "type": None, "function": {"name": None, "arguments": ""}}
                ],
            },
            "finish_reason": None,
        },
        {"index": 3, "message": {"role": None, "content": None}, "finish_reason": None},
    ]


def test_result_is_repeatable_and_independent() -> None:
    merger = SSEMerger()
    for event in LLAMA_TOOL:
        merger.add(event)
    first = merger.result()
    assert first is not None
    first["choices"][0]["message"]["tool_calls"].clear()
    assert merger.result() == merge_sse(*LLAMA_TOOL)


# --------------------------------------------------------------- NDJSONMerger

OLLAMA_TOP = {"model": "qwen3:8b"}


def line(n: int, message: dict[str, Any] | None = None, done: bool = False, **extra: Any) -> dict:
    obj: dict[str, Any] = {**OLLAMA_TOP, "created_at": f"2026-08-21T10:00:00.{n:04d}Z"}
    if message is not None:
        obj["message"] = {"role": "assistant", **message}
    obj["done"] = done
    obj.update(extra)
    return obj


FINAL_COUNTERS = {
    "done_reason": "stop",
    "total_duration": 5043500667,
    "load_duration": 5025959,
    "prompt_eval_count": 26,
    "prompt_eval_duration": 325953000,
    "eval_count": 290,
    "eval_duration": 4709213000,
    "prompt_eval_cached_count": 20,
}
OLLAMA_TOOL = {
    "id": "call_ab12cd34",
    "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}},
}

OLLAMA_CHAT = [
    line(1, {"content": "", "thinking": "Let"}),
    line(2, {"content": "", "thinking": " me see."}),
    line(3, {"content": "It is"}),
    line(4, {"content": " sunny ☀"}),
    line(5, {"content": "", "tool_calls": [OLLAMA_TOOL]}, done=True, **FINAL_COUNTERS),
]
OLLAMA_CHAT_MERGED = {
    "model": "qwen3:8b",
    "created_at": "2026-08-21T10:00:00.0005Z",
    "message": {
        "role": "assistant",
        "content": "It is sunny ☀",
        "thinking": "Let me see.",
        "tool_calls": [OLLAMA_TOOL],
    },
    "done": True,
    **FINAL_COUNTERS,
}


def test_ollama_chat_thinking_content_tool_calls_on_final_line() -> None:
    merged = merge_ndjson(*OLLAMA_CHAT)
    assert merged == OLLAMA_CHAT_MERGED
    assert list(merged) == list(OLLAMA_CHAT_MERGED)
    assert list(merged["message"]) == ["role", "content", "thinking", "tool_calls"]


def test_ndjson_no_line_gives_none() -> None:
    assert NDJSONMerger().result() is None


def test_ndjson_no_thinking_no_tool_calls_keys_when_absent() -> None:
    merged = merge_ndjson(
        line(1, {"content": "Hi"}),
        line(2, {"content": "!"}, done=True, done_reason="stop", eval_count=2),
    )
    assert merged == {
        "model": "qwen3:8b",
        "created_at": "2026-08-21T10:00:00.0002Z",
        "message": {"role": "assistant", "content": "Hi!"},
        "done": True,
        "done_reason": "stop",
        "eval_count": 2,
    }


def test_ndjson_tool_calls_collected_in_order_across_lines() -> None:
    t1 = {"function": {"index": 0, "name": "a", "arguments": {}}}
    t2 = {"function": {"index": 1, "name": "b", "arguments": {"x": 1}}}
    merged = merge_ndjson(
        line(1, {"content": "", "tool_calls": [t1]}),
        line(2, {"content": "", "tool_calls": [t2]}),
        line(3, {"content": ""}, done=True, done_reason="stop"),
    )
    assert merged is not None
    assert merged["message"] == {"role": "assistant", "content": "", "tool_calls": [t1, t2]}


def test_ndjson_mid_stream_error_line_without_done() -> None:
    error = "an error was encountered while running the model: unexpected EOF"
    merged = merge_ndjson(
        line(1, {"content": "", "thinking": "Hm"}),
        line(2, {"content": "Par"}),
        line(3, {"content": "tial"}),
        {"error": error},
    )
    assert merged == {
        "error": error,
        "message": {"role": "assistant", "content": "Partial", "thinking": "Hm"},
    }


def test_ndjson_error_kept_even_with_a_done_line() -> None:
    merged = merge_ndjson(
        line(1, {"content": "a"}), {"error": "boom"}, line(2, {"content": "b"}, done=True)
    )
    assert merged is not None
    assert merged["error"] == "boom"
    assert merged["done"] is True
    assert merged["message"] == {"role": "assistant", "content": "ab"}


def test_ndjson_error_only_line() -> None:
    assert merge_ndjson({"error": "model not found"}) == {"error": "model not found"}


def test_ndjson_reset_without_done_starts_from_last_line() -> None:
    merged = merge_ndjson(line(1, {"content": "a"}), line(2, {"content": "b"}))
    assert merged == {
        "model": "qwen3:8b",
        "created_at": "2026-08-21T10:00:00.0002Z",
        "message": {"role": "assistant", "content": "ab"},
        "done": False,
    }


def test_ndjson_last_done_line_is_the_base() -> None:
    merged = merge_ndjson(
        line(1, {"content": "a"}, done=True, eval_count=1),
        line(2, {"content": "b"}, done=True, eval_count=2),
        line(3, {"content": "c"}),
    )
    assert merged is not None
    assert merged["eval_count"] == 2
    assert merged["created_at"] == "2026-08-21T10:00:00.0002Z"
    assert merged["message"]["content"] == "abc"


def test_ndjson_generate_response_concatenated() -> None:
    merged = merge_ndjson(
        {"model": "m", "response": "He", "thinking": "t1", "done": False},
        {"model": "m", "response": "llo", "done": False},
        {"model": "m", "response": "", "done": True, "context": [1, 2]},
    )
    assert merged == {
        "model": "m",
        "response": "Hello",
        "done": True,
        "context": [1, 2],
        "thinking": "t1",
    }


def test_ndjson_garbage_shapes_ignored() -> None:
    merger = NDJSONMerger()
    merger.add([1, 2])  # type: ignore[arg-type]
    assert merger.result() is None
    merged = merge_ndjson(
        {"message": "x"},
        {"message": {"content": 5, "thinking": None, "tool_calls": "x"}},
        {"message": {"content": "ok"}, "done": "true"},
    )
    # thinking only when a line had a string; tool_calls only when a call was seen.
    assert merged == {"message": {"content": "ok"}, "done": "true"}


def test_ndjson_result_does_not_alias_the_input() -> None:
    final = line(2, {"content": "b"}, done=True)
    merged = merge_ndjson(line(1, {"content": "a"}), final)
    assert merged is not None
    assert final["message"]["content"] == "b"
    merged["message"]["content"] = "zzz"
    assert final["message"]["content"] == "b"


# --------------------------------------------------------------------- sniff


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("text/event-stream", "sse"),
        ("text/event-stream; charset=utf-8", "sse"),
        ("Text/Event-Stream;charset=UTF-8", "sse"),
        (" text/event-stream ", "sse"),
        ("application/x-ndjson", "ndjson"),
        ("application/x-ndjson; charset=utf-8", "ndjson"),
        ("APPLICATION/X-NDJSON", "ndjson"),
        ("application/ndjson", "ndjson"),
        ("application/jsonl", "ndjson"),
        ("application/json", None),
        ("application/json; charset=utf-8", None),
        ("text/html", None),
        ("application/json-seq", None),
    ],
)
def test_sniff_by_content_type(content_type: str, expected: str | None) -> None:
    # The content type wins over whatever the body looks like.
    assert sniff_stream(content_type, b'data: {"a":1}\n\n') == expected


@pytest.mark.parametrize(
    "content_type", [None, "", "application/octet-stream", "text/plain; charset=utf-8"]
)
@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'data: {"choices":[]}\n\n', "sse"),
        (b"\xef\xbb\xbf\r\n  data:x", "sse"),
        (b":\n\ndata: x\n\n", "sse"),
        (b": keep-alive\n\n", "sse"),
        (b"event: message\ndata: x\n\n", "sse"),
        (b"id: 1\n", "sse"),
        (b'{"model":"qwen3","done":false}\n{"model":"qwen3"', "ndjson"),
        (b'\xef\xbb\xbf\n{"a":1}\r\n{"b":2}\n', "ndjson"),
        (b'{"a":1}\n', None),  # one line only: could be a plain JSON body
        (b'{"a":1}\n   \n', None),
        (b'{"a":1}', None),
        (b'{\n  "a": 1\n}\n', None),  # pretty-printed JSON body
        (b"[1]\n[2]\n", None),
        (b"{bad\n{}\n", None),
        (b"hello\nworld\n", None),
        (b"", None),
        (b"datax: 1\n", None),
    ],
)
def test_sniff_generic_content_type_by_body(
    content_type: str | None, head: bytes, expected: str | None
) -> None:
    assert sniff_stream(content_type, head) == expected


# --------------------------------------------------------------- StreamCapture


def test_capture_llama_chat() -> None:
    cap = capture("sse", LLAMA_CHAT_BYTES)
    assert cap.kind == "sse"
    assert cap.chunks == len(LLAMA_CHAT)  # ping and [DONE] not counted
    assert cap.bad_chunks == 0
    assert cap.body_bytes == len(LLAMA_CHAT_BYTES)
    assert cap.truncated is False
    assert cap.done_seen is True
    assert cap.merged() == LLAMA_CHAT_MERGED
    assert cap.internal_errors == 0


def test_capture_keeps_number_text() -> None:
    cap = capture("sse", sse('{"choices":[],"timings":{"prompt_ms":1.50,"big":1e400}}'))
    merged = cap.merged()
    assert merged is not None
    assert canonical.dumps(merged["timings"]) == b'{"big":1e400,"prompt_ms":1.50}'


def test_capture_every_two_piece_split_equals_whole() -> None:
    data = sse(*LLAMA_TOOL) + b":\n\n" + sse("[DONE]")
    whole = state(capture("sse", data))
    assert whole[:5] == (len(LLAMA_TOOL), 0, len(data), False, True)
    for i in range(len(data) + 1):
        assert state(capture("sse", data[:i], data[i:])) == whole, i


SHORT_SSE = (
    b'data: {"choices":[{"index":0,"delta":{"content":"\xc3\xa9"}}]}\r\n\r\n'
    b":\r\r"
    b'data: {"choices":[{"index":0,"delta":{"content":"\xe2\x82\xac"}}]}\r\r'
    b"data: oops\n\n"
    b"data: [DONE]\r\n\r\n"
)


def test_capture_every_three_piece_split_equals_whole() -> None:
    whole = state(capture("sse", SHORT_SSE))
    assert whole[:5] == (3, 1, len(SHORT_SSE), False, True)
    merged = capture("sse", SHORT_SSE).merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "é€"
    n = len(SHORT_SSE)
    for i, j in itertools.combinations_with_replacement(range(0, n + 1, 2), 2):
        got = state(capture("sse", SHORT_SSE[:i], SHORT_SSE[i:j], SHORT_SSE[j:]))
        assert got == whole, (i, j)


SHORT_NDJSON = (
    b'{"message":{"role":"assistant","content":"\xc3\xa9"},"done":false}\r\n'
    b"\n"
    b"garbage\n"
    b'{"message":{"role":"assistant","content":"\xe2\x82\xac"},"done":true,"eval_count":2}'
)


def test_capture_ndjson_every_three_piece_split_equals_whole() -> None:
    cap = capture("ndjson", SHORT_NDJSON)
    whole = state(cap)
    assert whole[:5] == (3, 1, len(SHORT_NDJSON), False, True)
    assert cap.merged() == {
        "message": {"role": "assistant", "content": "é€"},
        "done": True,
        "eval_count": 2,
    }
    n = len(SHORT_NDJSON)
    for i, j in itertools.combinations_with_replacement(range(0, n + 1, 2), 2):
        got = state(capture("ndjson", SHORT_NDJSON[:i], SHORT_NDJSON[i:j], SHORT_NDJSON[j:]))
        assert got == whole, (i, j)


def test_capture_bad_chunks_counted_and_skipped() -> None:
    data = (
        sse(chunk({"content": "a"}))
        + b"data: not json\n\n"
        + b"data: [1,2]\n\n"
        + b'data: "str"\n\n'
        + b'data: {"a":NaN}\n\n'
        + b'data: {"a":1,}\n\n'
        + b'data: {"a":"\xff"}\n\n'  # decoded as U+FFFD (WHATWG): a valid object
        + sse(chunk({"content": "b"}), "[DONE]")
    )
    cap = capture("sse", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (8, 5, True)
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "ab"


def test_capture_multiline_data_event_is_one_chunk() -> None:
    cap = capture("sse", b'data: {"choices":\ndata: []}\n\n')
    assert (cap.chunks, cap.bad_chunks) == (1, 0)
    assert cap.merged() == {"choices": [], "object": "chat.completion"}


def test_capture_mid_stream_error_no_done() -> None:
    error = {"code": 500, "message": "Failed to decode", "type": "server_error"}
    data = sse(
        chunk({"role": "assistant", "content": None}), chunk({"content": "Hi"}), {"error": error}
    )
    cap = capture("sse", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen, cap.truncated) == (3, 0, False, False)
    merged = cap.merged()
    assert merged is not None
    assert merged["error"] == error
    assert merged["choices"][0]["message"]["content"] == "Hi"


def test_capture_unterminated_event_is_a_bad_chunk_not_merged() -> None:
    data = (
        sse(chunk({"content": "a"})) + b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n'
    )
    cap = capture("sse", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (2, 1, False)
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "a"


def test_capture_unterminated_done_sets_done_seen_only() -> None:
    cap = capture("sse", sse(chunk({"content": "a"})) + b"data: [DONE]\n")
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (1, 0, True)


def test_capture_only_garbage_gives_no_merge() -> None:
    cap = capture("sse", b"data: nope\n\n: ping\n\n")
    assert (cap.chunks, cap.bad_chunks, cap.merged()) == (1, 1, None)
    empty = capture("sse")
    assert (empty.chunks, empty.bad_chunks, empty.body_bytes, empty.merged()) == (0, 0, 0, None)


def test_capture_limit_cuts_inside_an_event() -> None:
    events = [chunk({"content": str(i)}) for i in range(10)]
    data = sse(*events, "[DONE]")
    first4 = len(sse(*events[:4]))
    limit = first4 + 10  # inside the fifth event
    cap = capture("sse", data[:100], data[100:], limit=limit)
    assert cap.truncated is True
    assert cap.body_bytes == len(data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (4, 0, False)  # cut event not bad
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "0123"


def test_capture_limit_at_exact_end_is_not_truncated() -> None:
    data = sse(chunk({"content": "a"}), "[DONE]")
    cap = capture("sse", data, limit=len(data))
    assert (cap.truncated, cap.chunks, cap.done_seen) == (False, 1, True)
    cap = capture("sse", data, b"\n", limit=len(data))
    assert (cap.truncated, cap.chunks, cap.done_seen, cap.body_bytes) == (
        True,
        1,
        True,
        len(data) + 1,
    )


def test_capture_zero_limit() -> None:
    cap = capture("sse", sse(chunk({"content": "a"})), limit=0)
    assert (cap.truncated, cap.chunks, cap.bad_chunks, cap.merged()) == (True, 0, 0, None)
    cap = capture("sse", b"", limit=0)
    assert cap.truncated is False


def test_capture_ndjson_ollama_chat() -> None:
    data = b"".join(json.dumps(obj, ensure_ascii=False).encode() + b"\n" for obj in OLLAMA_CHAT)
    cap = capture("ndjson", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen, cap.truncated) == (5, 0, True, False)
    assert cap.merged() == OLLAMA_CHAT_MERGED


def test_capture_ndjson_error_line() -> None:
    data = (
        json.dumps(line(1, {"content": "Hi"})).encode()
        + b"\n"
        + b'{"error":"an error was encountered while running the model"}\n'
    )
    cap = capture("ndjson", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (2, 0, False)
    assert cap.merged() == {
        "error": "an error was encountered while running the model",
        "message": {"role": "assistant", "content": "Hi"},
    }


def test_capture_ndjson_unterminated_last_line_is_parsed() -> None:
    data = b'{"message":{"content":"a"},"done":false}\n{"message":{"content":"b"},"done":true}'
    cap = capture("ndjson", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (2, 0, True)
    merged = cap.merged()
    assert merged is not None
    assert merged["message"] == {"content": "ab"}


def test_capture_ndjson_bad_lines() -> None:
    data = b'{"a":1}\n[1]\n{"a":"\xff"}\n{"a":1,}\nnull\n\x0c\n{"done":true}\n'
    cap = capture("ndjson", data)
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (7, 5, True)


def test_capture_ndjson_bad_unterminated_last_line() -> None:
    cap = capture("ndjson", b'{"done":false}\n{"done":tr')
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (2, 1, False)


def test_capture_ndjson_limit_cut_line_ignored() -> None:
    data = b'{"message":{"content":"a"}}\n{"message":{"content":"b"}}\n'
    cap = capture("ndjson", data, limit=len(data) - 5)
    assert (cap.truncated, cap.chunks, cap.bad_chunks, cap.body_bytes) == (True, 1, 0, len(data))
    assert cap.merged() == {"message": {"content": "a"}}


def test_capture_unknown_kind() -> None:
    with pytest.raises(ValueError):
        StreamCapture("json", 10)


def test_capture_feed_never_raises_on_wrong_types() -> None:
    cap = StreamCapture("sse", 100)
    cap.feed(None)  # type: ignore[arg-type]
    cap.feed("data: {}\n\n")  # type: ignore[arg-type]
    assert cap.internal_errors == 2
    cap.feed(bytearray(b"data: {}\n\n"))
    cap.close()
    assert (cap.chunks, cap.bad_chunks, cap.body_bytes) == (1, 0, 10)


class _Boom:
    def feed(self, data: bytes) -> list[str]:
        raise RuntimeError("bug")

    def close(self) -> bool:
        raise RuntimeError("bug")

    def add(self, obj: dict) -> None:
        raise RuntimeError("bug")

    def result(self) -> dict:
        raise RuntimeError("bug")


def test_capture_survives_a_broken_parser_and_merger() -> None:
    cap = StreamCapture("sse", 1000)
    cap._parser = _Boom()  # type: ignore[assignment]
    cap.feed(b"data: {}\n\n")
    cap.close()
    assert cap.merged() is None
    assert cap.body_bytes == 10
    assert cap.internal_errors == 2
    cap._merger = _Boom()  # type: ignore[assignment]
    assert cap.merged() is None
    assert cap.internal_errors == 3


def test_capture_merger_failure_on_one_event_keeps_the_others() -> None:
    class Flaky(SSEMerger):
        def add(self, event: dict[str, Any]) -> None:
            if event.get("boom"):
                raise RuntimeError("bug")
            super().add(event)

    cap = StreamCapture("sse", 1000)
    cap._merger = Flaky()
    cap.feed(sse(chunk({"content": "a"}), {"boom": 1}, chunk({"content": "b"})))
    cap.close()
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "ab"
    assert (cap.chunks, cap.bad_chunks, cap.internal_errors) == (3, 0, 1)


def test_capture_close_is_idempotent_and_feed_after_close_counts_bytes_only() -> None:
    cap = StreamCapture("sse", 1000)
    cap.feed(b"data: x\n")
    cap.close()
    cap.close()
    assert (cap.chunks, cap.bad_chunks) == (1, 1)
    cap.feed(b"data: {}\n\n")
    assert (cap.chunks, cap.body_bytes) == (1, 18)


def test_capture_large_stream_is_linear() -> None:
    # ~3 MB in 16 KiB pieces: finishes fast and counts exactly.
    events = [chunk({"content": "tok "}) for _ in range(20_000)]
    data = sse(*events, "[DONE]")
    cap = StreamCapture("sse", 32 * MiB)
    for i in range(0, len(data), 16384):
        cap.feed(data[i : i + 16384])
    cap.close()
    assert (cap.chunks, cap.bad_chunks, cap.done_seen) == (20_000, 0, True)
    merged = cap.merged()
    assert merged is not None
    assert merged["choices"][0]["message"]["content"] == "tok " * 20_000
