"""The OpenAI Responses API module: matching (R21), request digest (R25),
stream merge (R26), response digest and counters (R27), end events (R29).

Bodies follow what Codex sends (wire-formats.md); streams follow the event
shapes llama-server's `/v1/responses` sends (a keep-alive comment first,
`event:` lines, no `[DONE]`, no indexes, `timings` beside `response` on
`response.completed`), and OpenAI's own (with indexes and sequence numbers).
Expected hashes are computed here from hand-written canonical JSON.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.apis import APIS, api_by_name, api_for, api_name, request_digest_of
from llmp.apis.base import CountHints
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat
from llmp.apis.openai_responses import (
    OpenAIResponses,
    ResponsesMerger,
    item_text,
    reasoning_text,
    responses_counts,
)
from llmp.format import canonical
from llmp.format.canonical import hash_bytes, hash_text
from llmp.recorder.stream import StreamCapture

API = OpenAIResponses()
MiB = 1 << 20


def body_of(text: str) -> dict[str, Any]:
    """A request body parsed as the recorder parses it (number text kept, R2)."""
    value = canonical.loads(text)
    assert isinstance(value, dict)
    return value


def digest(body: dict[str, Any]) -> Any:
    return API.request_digest(body)


def h(canon: str) -> str:
    """The hash of hand-written canonical JSON."""
    return hash_bytes(canon.encode("utf-8"))


# ----------------------------------------------------------------------- R21


def test_responses_paths_are_chat() -> None:
    assert api_name("POST", "/v1/responses") == "openai_responses"
    assert api_name("POST", "/responses") == "openai_responses"  # llama-server's alias
    assert api_name("POST", "/openai/v1/responses") == "openai_responses"  # mounted
    assert api_name("POST", "/v1/responses?stream=true") == "openai_responses"
    assert api_for("POST", "/v1/responses") is api_by_name("openai_responses")


def test_other_responses_paths_are_not_chat() -> None:
    assert api_name("GET", "/v1/responses") == "other"
    assert api_name("POST", "/v1/responses/resp_123") == "other"
    assert api_name("POST", "/v1/responses/input_tokens") == "other"
    assert api_name("POST", "/api/responses") == "other"
    assert api_name("POST", "/x/responses") == "other"
    assert not API.matches("DELETE", "/v1/responses")
    assert API.matches("post", "/responses")


def test_registered_after_the_two_defaults() -> None:
    assert isinstance(APIS[0], OpenAIChat) and isinstance(APIS[1], OllamaChat)
    registered = api_by_name("openai_responses")
    assert isinstance(registered, OpenAIResponses)
    assert registered.stream == "sse"
    assert [a.name for a in APIS].count("openai_responses") == 1
    assert len({a.name for a in APIS}) == len(APIS)


# ----------------------------------------------------------------------- R25

DEVELOPER = {
    "type": "message",
    "id": "msg_dev",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are Codex."}],
}
ENV = {
    "type": "message",
    "role": "user",
    "content": [{"type": "input_text", "text": "<environment_context>/w</environment_context>"}],
}
PROMPT = {
    "type": "message",
    "role": "user",
    "content": [{"type": "input_text", "text": "List files"}],
}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "Plan: "}],
    "content": [{"type": "reasoning_text", "text": "run ls"}],
    "encrypted_content": "gAAAAB",
}
CALL = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "exec_command",
    "arguments": '{"cmd":"ls"}',
    "status": "completed",
}
CALL_CANON = (
    '{"arguments":"{\\"cmd\\":\\"ls\\"}","call_id":"call_1","id":"fc_1",'
    '"name":"exec_command","status":"completed","type":"function_call"}'
)
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"}
TOOL = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
TOOL_CANON = (
    '{"description":"Runs a command","name":"exec_command","parameters":{"properties":'
    '{"cmd":{"type":"string"}},"type":"object"},"strict":false,"type":"function"}'
)
CODEX_BODY = {
    "model": "gpt-5-codex",
    "input": [DEVELOPER, ENV, PROMPT, REASONING, CALL, OUTPUT],
    "tools": [TOOL],
    "store": False,
    "stream": True,
    "reasoning": {"summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "sess-1",
}


def test_instructions_are_a_system_message() -> None:
    d = digest({"instructions": "Be brief.", "input": "hi"})
    system, user = d["messages"]
    assert system["role"] == "system"
    assert system["hash"] == h('["system",{"content":"Be brief.","role":"system"},null,null,null]')
    assert system["chars"] == len("Be brief.")
    assert system["head"] == system["tail"] == hash_text("Be brief.")
    assert user["role"] == "user"
    assert user["hash"] == h('["user",{"content":"hi","role":"user"},null,null,null]')
    assert user["chars"] == 2


def test_unset_instructions_give_no_message() -> None:
    assert digest({"instructions": "", "input": "x"})["messages"][0]["role"] == "user"
    assert len(digest({"instructions": None, "input": "x"})["messages"]) == 1
    assert digest({})["messages"] == []
    assert digest({"input": 5})["messages"] == []


def test_input_items_of_codex() -> None:
    msgs = digest(CODEX_BODY)["messages"]
    assert [m["role"] for m in msgs] == [
        "developer",
        "user",
        "user",
        "reasoning",
        "function_call",
        "function_call_output",
    ]
    dev = msgs[0]
    assert dev["hash"] == h(
        '["developer",{"content":[{"text":"You are Codex.","type":"input_text"}],'
        '"role":"developer","type":"message"},null,null,null]'
    )
    assert dev["chars"] == len("You are Codex.")
    reasoning = msgs[3]
    assert reasoning["chars"] == len("Plan: run ls")
    assert reasoning["head"] == hash_text("Plan: run ls")
    call = msgs[4]
    hashed = CALL_CANON.replace('"id":"fc_1",', "")  # R30: the `id` leaves the hash
    assert call["hash"] == h(f'["function_call",{hashed},null,null,null]')
    assert call["chars"] == len(CALL_CANON)
    assert call["head"] == hash_text(CALL_CANON)
    assert call["tool_calls"] == [{"id": "call_1", "name": "exec_command"}]
    assert call["tool_call_id"] is None
    out = msgs[5]
    assert out["tool_call_id"] == "call_1"
    assert out["tool_calls"] == []
    assert out["chars"] == len("a.txt\nb.txt")
    assert out["hash"] == h(
        '["function_call_output",{"call_id":"call_1","output":"a.txt\\nb.txt",'
        '"type":"function_call_output"},null,null,null]'
    )
    assert all(m["name"] is None for m in msgs)
    texts = [t for _, t in API.messages_with_text(CODEX_BODY)]
    assert texts == [
        "You are Codex.",
        "<environment_context>/w</environment_context>",
        "List files",
        "Plan: run ls",
        CALL_CANON,
        "a.txt\nb.txt",
    ]


def test_the_whole_item_is_hashed_but_its_id() -> None:
    """Unlike a chat message, every key of an item is part of its identity, but the
    `id` the server never renders and Codex renews after a compaction (R30)."""
    a = digest({"input": [PROMPT]})["messages"][0]["hash"]
    b = digest({"input": [{**PROMPT, "id": "msg_9"}]})["messages"][0]["hash"]
    c = digest({"input": [{**PROMPT, "id": "msg_10"}]})["messages"][0]["hash"]
    d = digest({"input": [{**PROMPT, "status": "completed"}]})["messages"][0]["hash"]
    assert a == b == c != d
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    e = digest({"input": [{**call, "id": "fc_1"}]})["messages"][0]
    f = digest({"input": [{**call, "id": "fc_2"}]})["messages"][0]
    g = digest({"input": [{**call, "id": "fc_1", "call_id": "c2"}]})["messages"][0]
    assert e["hash"] == f["hash"] != g["hash"]  # `call_id` is what the model sees
    assert e["chars"] == len(
        canonical.dumps({**call, "id": "fc_1"}).decode()
    )  # the text keeps the `id`
    assert a == h(
        '["user",{"content":[{"text":"List files","type":"input_text"}],'
        '"role":"user","type":"message"},null,null,null]'
    )


def test_string_input_and_short_messages() -> None:
    short = {"role": "assistant", "content": "Done."}
    d = digest({"input": [short, {"role": "user", "content": [{"type": "text", "text": "ok"}]}]})
    assert [m["role"] for m in d["messages"]] == ["assistant", "user"]
    assert [m["chars"] for m in d["messages"]] == [5, 2]
    assert d["messages"][0]["hash"] == h(
        '["assistant",{"content":"Done.","role":"assistant"},null,null,null]'
    )
    # a string input is the same as the short user message item
    assert (
        digest({"input": "hi"})["messages"]
        == digest({"input": [{"role": "user", "content": "hi"}]})["messages"]
    )


def test_item_texts_by_type() -> None:
    assert (
        item_text(
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "a"},
                    {"type": "refusal", "refusal": "no"},
                    {"type": "input_image", "image_url": "data:"},
                    {"type": "input_text", "text": "b"},
                    {"type": "text", "text": "c"},
                    {"type": "output_text", "text": None},
                ],
            }
        )
        == "abc"
    )
    assert (
        item_text(
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [
                    {"type": "input_text", "text": "x"},
                    {"type": "input_image"},
                    {"type": "output_text", "text": "y"},
                ],
            }
        )
        == "xy"
    )
    assert item_text({"type": "function_call_output", "output": None}) == ""
    assert (
        item_text({"type": "function_call", "name": "f"}) == '{"name":"f","type":"function_call"}'
    )
    assert item_text({"type": "local_shell_call", "action": {"command": ["ls"]}}) == ""
    assert item_text({"type": "item_reference", "id": "x"}) == ""
    assert item_text("string item") == ""
    assert (
        reasoning_text({"summary": [{"text": "s"}, "bad"], "content": [{"text": "c"}, {"text": 1}]})
        == "sc"
    )
    assert reasoning_text({"summary": None}) == ""


def test_other_items_take_their_type_as_role() -> None:
    d = digest(
        {
            "input": [
                {"type": "local_shell_call", "call_id": "c9", "action": {}},
                {"type": "custom_tool_call_output", "call_id": "c8", "output": "x"},
                "odd",
                {"role": None, "type": None},
                {"type": "message", "content": "no role"},
            ]
        }
    )
    msgs = d["messages"]
    assert [m["role"] for m in msgs] == [
        "local_shell_call",
        "custom_tool_call_output",
        None,
        None,
        "message",
    ]
    assert msgs[0]["tool_calls"] == [] and msgs[0]["tool_call_id"] is None
    assert msgs[1]["tool_call_id"] is None  # only function_call_output carries one
    assert msgs[1]["chars"] == 0
    assert msgs[2]["hash"] == h('[null,"odd",null,null,null]')
    assert msgs[3]["hash"] == h('[null,{"role":null,"type":null},null,null,null]')
    assert msgs[4]["chars"] == len("no role")


def test_number_text_kept_in_item_hashes() -> None:
    body = body_of(
        '{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}","x":1.50}]}'
    )
    (m,) = digest(body)["messages"]
    canon = '{"arguments":"{}","call_id":"c","name":"f","type":"function_call","x":1.50}'
    assert m["hash"] == h(f'["function_call",{canon},null,null,null]')
    assert m["chars"] == len(canon)


def test_tools_digest() -> None:
    chat_shape = {"type": "function", "function": {"name": "legacy", "parameters": {}}}
    d = digest({"tools": [TOOL, chat_shape, {"type": "web_search"}]})
    chat_canon = '{"function":{"name":"legacy","parameters":{}},"type":"function"}'
    web_canon = '{"type":"web_search"}'
    assert d["tools"] == [
        {"name": "exec_command", "hash": h(TOOL_CANON), "chars": len(TOOL_CANON)},
        {"name": "legacy", "hash": h(chat_canon), "chars": len(chat_canon)},
        {"name": None, "hash": h(web_canon), "chars": len(web_canon)},
    ]
    assert d["tools_hash"] == h(f"[{TOOL_CANON},{chat_canon},{web_canon}]")
    assert digest({"tools": []})["tools_hash"] is None
    assert digest({})["tools"] == []


def test_params() -> None:
    d = digest({**CODEX_BODY, "max_output_tokens": 4096})
    assert d["model"] == "gpt-5-codex"
    assert d["params"] == {
        "max_tokens": 4096,
        "response_format": False,
        "grammar": False,
        "stream": True,
        "previous_response": False,
    }
    assert digest({})["params"] == {
        "max_tokens": None,
        "response_format": False,
        "grammar": False,
        "stream": False,
        "previous_response": False,
    }
    assert digest({"max_tokens": 5})["params"]["max_tokens"] is None  # not this API's key
    assert digest({"max_output_tokens": -2})["params"]["max_tokens"] is None
    schema = {"format": {"type": "json_schema", "name": "x", "schema": {}}}
    assert digest({"text": schema})["params"]["response_format"] is True
    assert (
        digest({"text": {"format": {"type": "json_object"}}})["params"]["response_format"] is True
    )
    assert digest({"text": {"format": {"type": "text"}}})["params"]["response_format"] is False
    assert digest({"text": {"format": {"type": ""}}})["params"]["response_format"] is False
    assert digest({"text": {"verbosity": "low"}})["params"]["response_format"] is False
    assert (
        digest({"response_format": {"type": "json_object"}})["params"]["response_format"] is False
    )
    assert digest({"grammar": "x", "json_schema": {}})["params"]["grammar"] is False
    assert digest({"stream": 1})["params"]["stream"] is False


def test_previous_response_id() -> None:
    assert (
        digest({"previous_response_id": "resp_1", "input": "more"})["params"]["previous_response"]
        is True
    )
    assert digest({"previous_response_id": ""})["params"]["previous_response"] is False
    assert digest({"previous_response_id": None})["params"]["previous_response"] is False


def test_full_body_gives_the_recorded_digest_and_targets() -> None:
    assert request_digest_of({"body": CODEX_BODY, "digest": None}, API) == digest(CODEX_BODY)
    messages, tools = API.count_targets(
        {"instructions": "I", "input": [PROMPT, PROMPT], "tools": [TOOL]}
    )
    assert messages == {
        h('["system",{"content":"I","role":"system"},null,null,null]'): "I",
        digest({"input": [PROMPT]})["messages"][0]["hash"]: "List files",
    }
    assert tools == {h(TOOL_CANON): TOOL_CANON}


# ------------------------------------------------------------- stream fixtures

MODEL = "/models/qwen3.6-35b-a3b-q4_k_m.gguf"
IN_PROGRESS = {"id": "resp_1", "object": "response", "status": "in_progress"}
MSG_ADDED = {
    "content": [],
    "id": "msg_1",
    "role": "assistant",
    "status": "in_progress",
    "type": "message",
}
PART = {"type": "output_text", "text": "", "annotations": []}
TEXT = "I see ü€ two files."
MSG_DONE = {
    "content": [{"type": "output_text", "text": TEXT, "annotations": []}],
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "type": "message",
}
USAGE = {
    "input_tokens": 19,
    "output_tokens": 8,
    "total_tokens": 27,
    "input_tokens_details": {"cached_tokens": 0},
}
TIMINGS = {
    "cache_n": 0,
    "prompt_n": 19,
    "prompt_ms": 122.3,
    "prompt_per_token_ms": 6.43,
    "prompt_per_second": 155.3,
    "predicted_n": 8,
    "predicted_ms": 95.5,
    "predicted_per_token_ms": 11.9,
    "predicted_per_second": 83.7,
}
COMPLETED_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1796100000,
    "status": "completed",
    "model": MODEL,
    "output": [MSG_DONE],
    "usage": USAGE,
}


def llama_events(text: str = TEXT) -> list[dict[str, Any]]:
    """llama-server's order: no output_index, content_index or sequence_number."""
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    return [
        {"type": "response.created", "response": IN_PROGRESS},
        {"type": "response.in_progress", "response": IN_PROGRESS},
        {"type": "response.output_item.added", "item": MSG_ADDED},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": PART},
        *({"type": "response.output_text.delta", "item_id": "msg_1", "delta": p} for p in pieces),
        {"type": "response.output_text.done", "item_id": "msg_1", "text": text},
        {"type": "response.content_part.done", "item_id": "msg_1", "part": dict(PART, text=text)},
        {"type": "response.output_item.done", "item": MSG_DONE},
        {"type": "response.completed", "response": COMPLETED_RESPONSE, "timings": TIMINGS},
    ]


def ev(name: str, data: dict[str, Any]) -> bytes:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {text}\n\n".encode()


def stream(events: list[dict[str, Any]]) -> bytes:
    """A keep-alive comment, then each event named by its type; no [DONE]."""
    return b":\n\n" + b"".join(ev(str(e["type"]), e) for e in events)


LLAMA_EVENTS = llama_events()
LLAMA_BYTES = stream(LLAMA_EVENTS)


def merge(*events: Any) -> dict[str, Any] | None:
    merger = ResponsesMerger()
    for e in events:
        merger.add(e)
    return merger.result()


def capture(*pieces: bytes, limit: int = 32 * MiB) -> StreamCapture:
    cap = StreamCapture("sse", limit, API)
    for piece in pieces:
        cap.feed(piece)
    cap.close()
    return cap


def state(cap: StreamCapture) -> tuple[Any, ...]:
    return (
        cap.chunks,
        cap.bad_chunks,
        cap.body_bytes,
        cap.done_seen,
        canonical.dumps(cap.merged()),
        cap.internal_errors,
    )


# ----------------------------------------------------------------------- R26


def test_llama_stream_is_the_completed_response_with_timings() -> None:
    cap = capture(LLAMA_BYTES)
    assert cap.merged() == {**COMPLETED_RESPONSE, "timings": TIMINGS}
    assert list(cap.merged() or {}) == [*COMPLETED_RESPONSE, "timings"]
    assert cap.done_seen is True  # response.completed, no [DONE] (R29)
    assert cap.chunks == len(LLAMA_EVENTS) and cap.bad_chunks == 0
    assert cap.internal_errors == 0


def test_llama_stream_split_at_every_byte() -> None:
    whole = state(capture(LLAMA_BYTES))
    for cut in range(1, len(LLAMA_BYTES)):
        assert state(capture(LLAMA_BYTES[:cut], LLAMA_BYTES[cut:])) == whole, cut
    rng = random.Random(169)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(LLAMA_BYTES)), rng.randint(2, 30)))
        pieces = [
            LLAMA_BYTES[a:b] for a, b in zip([0, *cuts], [*cuts, len(LLAMA_BYTES)], strict=True)
        ]
        assert state(capture(*pieces)) == whole, cuts


def test_stream_cut_before_completed_is_rebuilt_from_deltas() -> None:
    cut = LLAMA_BYTES[: LLAMA_BYTES.index(b"event: response.output_text.done")]
    cap = capture(cut)
    assert cap.done_seen is False
    assert cap.merged() == {
        **IN_PROGRESS,
        "output": [{**MSG_ADDED, "content": [{**PART, "text": TEXT}]}],
    }
    assert API.response_digest(cap.merged() or {})["output"]["content_chars"] == len(TEXT)


def test_stream_cut_after_item_done_uses_the_done_item() -> None:
    cut = LLAMA_BYTES[: LLAMA_BYTES.index(b"event: response.completed")]
    cap = capture(cut)
    assert cap.done_seen is False
    assert cap.merged() == {**IN_PROGRESS, "output": [MSG_DONE]}


def test_stream_cut_mid_event() -> None:
    cut = LLAMA_BYTES[: LLAMA_BYTES.index(b"event: response.completed") + 40]
    cap = capture(cut)
    assert cap.done_seen is False
    assert cap.bad_chunks == 1  # the unterminated event
    assert cap.merged() == {**IN_PROGRESS, "output": [MSG_DONE]}


def test_cut_stream_output_done_items_first_then_pending() -> None:
    call_added = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "exec_command",
        "arguments": "",
        "status": "in_progress",
    }
    call_done = {**call_added, "arguments": '{"cmd":"ls"}', "status": "completed"}
    merged = merge(
        {"type": "response.created", "response": IN_PROGRESS},
        {"type": "response.output_item.added", "item": MSG_ADDED},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": PART},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Let me "},
        {"type": "response.output_item.added", "item": call_added},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": '{"cmd"'},
        {"type": "response.output_item.done", "item": call_done},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "look."},
        {"type": "response.output_text.delta", "item_id": "msg_unknown", "delta": "lost"},
    )
    assert merged is not None
    assert merged["output"] == [
        call_done,
        {**MSG_ADDED, "content": [{**PART, "text": "Let me look."}]},
    ]
    assert "arguments" not in merged and "delta" not in merged and "item_id" not in merged


def test_openai_shaped_stream_with_indexes() -> None:
    """OpenAI's events carry output_index, content_index, sequence_number, logprobs
    and obfuscation; deltas found by output_index and content_index."""
    added = {
        "id": "msg_7",
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    events = [
        {
            "type": "response.created",
            "sequence_number": 0,
            "response": {"id": "resp_7", "status": "in_progress", "output": []},
        },
        {
            "type": "response.output_item.added",
            "sequence_number": 1,
            "output_index": 0,
            "item": added,
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 2,
            "item_id": "msg_7",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": ""},
        },
        {
            "type": "response.output_text.delta",
            "sequence_number": 3,
            "output_index": 0,
            "content_index": 0,
            "delta": "Hel",
            "logprobs": [{"token": "Hel"}],
            "obfuscation": "q9",
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 4,
            "item_id": "msg_7",
            "output_index": 0,
            "content_index": 1,
            "part": {"type": "output_text", "annotations": [], "text": "<"},
        },
        {
            "type": "response.output_text.delta",
            "sequence_number": 5,
            "item_id": "msg_7",
            "output_index": 0,
            "content_index": 1,
            "delta": "b>",
        },
        {
            "type": "response.output_text.delta",
            "sequence_number": 6,
            "item_id": "msg_7",
            "output_index": 0,
            "content_index": 0,
            "delta": "lo",
        },
    ]
    merged = merge(*events)
    assert merged == {
        "id": "resp_7",
        "status": "in_progress",
        "output": [
            {
                **added,
                "content": [
                    {"type": "output_text", "annotations": [], "logprobs": [], "text": "Hello"},
                    {"type": "output_text", "annotations": [], "text": "<b>"},
                ],
            }
        ],
    }


def test_deltas_without_a_part_event() -> None:
    merged = merge(
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {"id": "m", "type": "message", "content": []},
        },
        {"type": "response.output_text.delta", "output_index": 0, "delta": "a"},
        {"type": "response.output_text.delta", "item_id": "m", "delta": "b"},
        {"type": "response.output_text.delta", "item_id": "m", "delta": 3},
    )
    assert merged == {
        "output": [
            {"id": "m", "type": "message", "content": [{"type": "output_text", "text": "ab"}]}
        ]
    }


def test_other_top_level_keys_go_on_the_body() -> None:
    merged = merge(
        {
            "type": "response.created",
            "response": IN_PROGRESS,
            "sequence_number": 0,
            "x_server": {"slot": 1},
        },
        {
            "type": "response.output_text.delta",
            "item_id": "m",
            "delta": "a",
            "timings": {"prompt_ms": 1.5},
        },
        {
            "type": "response.completed",
            "response": COMPLETED_RESPONSE,
            "timings": TIMINGS,
            "sequence_number": 9,
        },
    )
    assert merged == {**COMPLETED_RESPONSE, "x_server": {"slot": 1}, "timings": TIMINGS}


def test_item_payload_keys_stay_off_the_body() -> None:
    """Interpretation: OpenAI's per-item payload keys carry generated text, not counters."""
    merged = merge(
        {"type": "response.created", "response": IN_PROGRESS},
        {
            "type": "response.function_call_arguments.done",
            "item_id": "fc",
            "output_index": 1,
            "arguments": '{"cmd":"cat secret"}',
            "name": "exec_command",
        },
        {
            "type": "response.refusal.done",
            "item_id": "m",
            "output_index": 0,
            "content_index": 0,
            "refusal": "No.",
        },
        {
            "type": "response.custom_tool_call_input.done",
            "item_id": "ct",
            "output_index": 2,
            "input": "*** Begin Patch",
        },
        {
            "type": "response.output_text.annotation.added",
            "item_id": "m",
            "annotation_index": 0,
            "annotation": {"url": "u"},
        },
        {"type": "response.code_interpreter_call_code.done", "item_id": "ci", "code": "print(1)"},
        {
            "type": "response.reasoning_summary_part.added",
            "item_id": "rs",
            "summary_index": 0,
            "part": {},
        },
    )
    assert merged == {**IN_PROGRESS, "output": []}


def test_error_events() -> None:
    llama = merge(
        {"type": "response.created", "response": IN_PROGRESS},
        {"type": "error", "error": {"code": 500, "message": "boom", "type": "server_error"}},
    )
    assert llama == {
        **IN_PROGRESS,
        "output": [],
        "error": {"code": 500, "message": "boom", "type": "server_error"},
    }
    openai = merge(
        {
            "type": "error",
            "code": "server_error",
            "message": "boom",
            "param": None,
            "sequence_number": 4,
        }
    )
    assert openai is not None
    assert openai["error"] == {"code": "server_error", "message": "boom", "param": None}
    assert openai["output"] == []
    merger = ResponsesMerger()
    merger.add({"type": "error", "error": {"message": "x"}})
    assert merger.ended is False


@pytest.mark.parametrize("end", ["response.completed", "response.incomplete", "response.failed"])
def test_each_end_event_ends_and_gives_its_response(end: str) -> None:
    final: dict[str, Any] = {
        "id": "resp_1",
        "status": end.split(".")[1],
        "output": [],
        "error": None,
    }
    data = stream([{"type": "response.created", "response": IN_PROGRESS}])
    assert capture(data).done_seen is False
    cap = capture(data + ev(end, {"type": end, "response": final}))
    assert cap.done_seen is True
    assert cap.merged() == final


def test_last_end_event_wins_and_ended_stays() -> None:
    merger = ResponsesMerger()
    merger.add({"type": "response.incomplete", "response": {"id": "a", "status": "incomplete"}})
    assert merger.ended is True
    merger.add({"type": "response.completed", "response": {"id": "b", "status": "completed"}})
    merger.add({"type": "response.in_progress", "response": {"id": "c"}})
    assert merger.ended is True
    assert merger.result() == {"id": "b", "status": "completed"}


def test_ended_only_on_end_events() -> None:
    merger = ResponsesMerger()
    for e in LLAMA_EVENTS[:-1]:
        merger.add(e)
        assert merger.ended is False
    merger.add({"type": "response.done"})  # not one of the three
    assert merger.ended is False
    merger.add(LLAMA_EVENTS[-1])
    assert merger.ended is True


def test_the_data_type_decides_not_the_event_name() -> None:
    completed = {"type": "response.completed", "response": COMPLETED_RESPONSE}
    cap = capture(b":\n\n" + ev("response.in_progress", completed))
    assert cap.done_seen is True
    assert cap.merged() == COMPLETED_RESPONSE
    fake = capture(
        b":\n\n"
        + ev("response.completed", {"type": "response.in_progress", "response": IN_PROGRESS})
    )
    assert fake.done_seen is False


def test_end_event_without_a_response_object() -> None:
    merged = merge(
        {"type": "response.created", "response": IN_PROGRESS},
        {"type": "response.output_item.done", "item": MSG_DONE},
        {"type": "response.completed", "response": "broken"},
    )
    assert merged == {**IN_PROGRESS, "output": [MSG_DONE]}


def test_no_event_gives_none_and_odd_events_cost_their_field() -> None:
    assert ResponsesMerger().result() is None
    merger = ResponsesMerger()
    merger.add("x")  # type: ignore[arg-type]
    assert merger.result() is None
    merged = merge(
        {"type": "response.output_item.added", "item": "not an object"},
        {"type": "response.output_item.done", "item": None},
        {"type": "response.content_part.added", "item_id": 5, "part": {}},
        {"type": "response.output_text.delta", "delta": "orphan"},
        {"type": None},
    )
    assert merged == {"output": []}


def test_result_is_repeatable_and_does_not_alias_events() -> None:
    events = json.loads(json.dumps(llama_events()[:-3]))
    merger = ResponsesMerger()
    for e in events:
        merger.add(e)
    first = merger.result()
    assert first is not None
    first["output"][0]["content"][0]["text"] = "changed"
    again = merger.result()
    assert again is not None
    assert again["output"][0]["content"][0]["text"] == TEXT
    assert events[2]["item"]["content"] == []


_KEYS = [
    "type",
    "response",
    "item",
    "delta",
    "item_id",
    "output_index",
    "content_index",
    "part",
    "id",
    "content",
    "text",
    "error",
    "timings",
]
_TYPES = [
    "response.created",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.output_text.delta",
    "response.completed",
    "response.failed",
    "error",
    "m",
]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 2), st.text(max_size=3), st.sampled_from(_TYPES)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.dictionaries(st.sampled_from(_KEYS), _values, max_size=5), _values),
        max_size=10,
    )
)
def test_merger_never_raises(events: list[Any]) -> None:
    merger = ResponsesMerger()
    for e in events:
        merger.add(e)
    result = merger.result()
    if not any(isinstance(e, dict) for e in events):
        assert result is None
        return
    assert isinstance(result, dict)
    canonical.dumps(result)
    assert canonical.dumps(merger.result()) == canonical.dumps(result)
    ends = ("response.completed", "response.incomplete", "response.failed")
    assert merger.ended == any(isinstance(e, dict) and e.get("type") in ends for e in events)
    d = API.response_digest(result)
    API.counts(d["usage"], CountHints())


# ----------------------------------------------------------------------- R27


def test_response_digest_keeps_every_field_but_output() -> None:
    body = {**COMPLETED_RESPONSE, "output_text": TEXT, "timings": TIMINGS}
    d = API.response_digest(body)
    assert d["usage"] == {k: v for k, v in body.items() if k not in ("output", "output_text")}
    assert "output" not in d["usage"] and "output_text" not in d["usage"]
    assert d["usage"]["model"] == MODEL
    assert d["output"] == {"content_chars": len(TEXT), "reasoning_chars": 0, "tool_calls": []}


def test_response_digest_counts_item_kinds() -> None:
    body = {
        "output": [
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "ab"}],
                "content": [{"type": "reasoning_text", "text": "cde"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "xy"},
                    {"type": "refusal", "refusal": "no"},
                    {"type": "text", "text": "not output_text"},
                ],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": "{}",
            },
            {"type": "function_call", "name": "apply"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "..."},
            "junk",
        ]
    }
    assert API.response_digest(body)["output"] == {
        "content_chars": 2,
        "reasoning_chars": 5,
        "tool_calls": [{"id": "call_1", "name": "exec_command"}, {"id": None, "name": "apply"}],
    }
    assert API.response_digest({"output": "x"})["output"]["content_chars"] == 0


def test_counters_without_timings() -> None:
    """A non-streamed llama-server response: no timings."""
    usage = {
        "input_tokens": 1200,
        "output_tokens": 30,
        "input_tokens_details": {"cached_tokens": 1150},
    }
    c = API.counts(API.response_digest({"usage": usage, "output": []})["usage"], CountHints())
    assert c.prompt_tokens == (1200, "server")  # it includes the cached part
    assert c.reused_tokens == (1150, "server")
    assert c.evaluated_tokens == (50, "server")
    assert c.completion_tokens == (30, "server")
    assert c.prefill_ms is None and c.decode_ms is None and c.load_ms is None


def test_counters_with_timings_from_the_stream() -> None:
    merged = capture(LLAMA_BYTES).merged()
    assert merged is not None
    c = API.counts(API.response_digest(merged)["usage"], CountHints())
    assert c.prompt_tokens == (19, "server")
    assert c.reused_tokens == (0, "server")
    assert c.evaluated_tokens == (19, "server")
    assert c.completion_tokens == (8, "server")
    assert c.prefill_ms == (122.3, "server")
    assert c.decode_ms == (95.5, "server")
    assert c.reported() == [
        "prompt_tokens",
        "completion_tokens",
        "reused_tokens",
        "evaluated_tokens",
        "prefill_ms",
        "decode_ms",
    ]


def test_counters_with_missing_or_odd_values() -> None:
    c = responses_counts({"usage": {"input_tokens": 10}})
    assert c.prompt_tokens == (10, "server")
    assert c.reused_tokens is None and c.evaluated_tokens is None and c.completion_tokens is None
    c = responses_counts(
        {"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 12}}}
    )
    assert c.evaluated_tokens == (0, "server")  # never negative
    c = responses_counts(
        {"usage": {"input_tokens": "10", "output_tokens": -1, "input_tokens_details": []}}
    )
    assert c.reported() == []
    c = responses_counts({"usage": {"input_tokens_details": {"cached_tokens": 4}}})
    assert (
        c.reused_tokens == (4, "server") and c.prompt_tokens is None and c.evaluated_tokens is None
    )
    assert responses_counts({"usage": None, "timings": "x"}).reported() == []
    assert responses_counts({"timings": {"prompt_ms": 5}}).prefill_ms == (5.0, "server")


_BODY_KEYS = [
    "instructions",
    "input",
    "role",
    "type",
    "content",
    "text",
    "output",
    "summary",
    "call_id",
    "name",
    "tools",
    "function",
    "format",
    "max_output_tokens",
    "previous_response_id",
    "stream",
]
_ITEM_TYPES = [
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "input_text",
    "output_text",
]
_body_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-2, 2),
        st.text(max_size=3),
        st.sampled_from(_ITEM_TYPES),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_BODY_KEYS), inner, max_size=5)
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_BODY_KEYS), _body_values, max_size=6))
def test_request_digest_never_raises(body: dict[str, Any]) -> None:
    d = API.request_digest(body)
    pairs = API.messages_with_text(body)
    assert [p[0] for p in pairs] == d["messages"]
    assert all(m["chars"] == len(t) for m, t in pairs)
    assert isinstance(d["params"]["previous_response"], bool)
    API.count_targets(body)


def test_cut_stream_keeps_done_items_in_their_order() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "s"}],
    }
    call = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"}
    merged = merge(
        {"type": "response.in_progress", "response": IN_PROGRESS},
        {"type": "response.output_item.added", "item": {**reasoning, "summary": []}},
        {"type": "response.output_item.added", "item": {**call, "arguments": ""}},
        {"type": "response.output_item.done", "item": reasoning},
        {"type": "response.output_item.done", "item": call},
        {"type": "response.output_item.added", "item": MSG_ADDED},
    )
    assert merged == {**IN_PROGRESS, "output": [reasoning, call, MSG_ADDED]}


def test_index_less_deltas_follow_the_last_announced_part() -> None:
    """llama-server sends no content_index: a delta belongs to the part announced last."""
    merged = merge(
        {"type": "response.output_item.added", "item": MSG_ADDED},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": PART},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "first"},
        {
            "type": "response.content_part.added",
            "item_id": "msg_1",
            "part": {"type": "output_text", "text": ">"},
        },
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "second"},
    )
    assert merged is not None
    assert merged["output"][0]["content"] == [
        {**PART, "text": "first"},
        {"type": "output_text", "text": ">second"},
    ]


def test_response_digest_keeps_no_echoed_request_text() -> None:
    """OpenAI's response object echoes `instructions`, `input` and `tools`; digest mode
    writes no message text, so they stay out of `usage`."""
    body = {
        "id": "resp_1",
        "model": "m",
        "instructions": "SECRET system prompt",
        "input": [{"role": "user", "content": "SECRET question"}],
        "tools": [{"type": "function", "name": "f", "description": "SECRET"}],
        "output": [],
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    digest = OpenAIResponses().response_digest(body)
    assert set(digest["usage"]) == {"id", "model", "usage"}
    assert "SECRET" not in json.dumps(digest)
