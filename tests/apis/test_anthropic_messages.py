"""The Anthropic Messages API module: matching (R21), request digest (R22),
stream merge (R23), response digest and counters (R24), end event (R29).

Bodies and streams follow wire-formats.md: what Claude Code sends, and the
event shapes llama-server's `/v1/messages` streams (a keep-alive comment
first, `event:` lines, no `[DONE]`).  Expected hashes are computed here from
hand-written canonical JSON, so a wrong canonical form fails.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.apis import APIS, api_by_name, api_for, api_name, request_digest_of
from llmp.apis.anthropic_messages import (
    AnthropicMessages,
    MessagesMerger,
    anthropic_counts,
    block_text,
    strip_cache_control,
)
from llmp.apis.base import CountHints
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat
from llmp.format import canonical
from llmp.format.canonical import EMPTY_HASH, hash_bytes, hash_text
from llmp.recorder.stream import StreamCapture

API = AnthropicMessages()
MiB = 1 << 20
EPHEMERAL = {"type": "ephemeral"}
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.7c2; cc_entrypoint=sdk-cli;"
IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."


def body_of(text: str) -> dict[str, Any]:
    """A request body parsed as the recorder parses it (number text kept, R2)."""
    value = canonical.loads(text)
    assert isinstance(value, dict)
    return value


def digest(body: dict[str, Any]) -> Any:
    return API.request_digest(body)


def msg_hash(canon: str) -> str:
    """The hash of a hand-written canonical `[role, content, null, null, null]`."""
    return hash_bytes(canon.encode("utf-8"))


# ----------------------------------------------------------------------- R21


def test_messages_paths_are_chat() -> None:
    assert api_name("POST", "/v1/messages") == "anthropic_messages"
    assert api_name("POST", "/v1/messages?beta=true") == "anthropic_messages"  # Claude Code
    assert api_name("POST", "/anthropic/v1/messages") == "anthropic_messages"  # mounted
    assert api_name("POST", "/v1/messages#frag") == "anthropic_messages"
    assert api_for("POST", "/v1/messages?beta=true") is api_by_name("anthropic_messages")


def test_count_tokens_and_others_are_not_chat() -> None:
    assert api_name("POST", "/v1/messages/count_tokens") == "other"
    assert api_name("POST", "/v1/messages/count_tokens?beta=true") == "other"
    assert api_name("GET", "/v1/messages") == "other"
    assert api_name("POST", "/messages") == "other"
    assert api_name("POST", "/v1/messages/batches") == "other"
    assert api_name("POST", "/v1/messagesx") == "other"
    assert not API.matches("GET", "/v1/messages")
    assert API.matches("post", "/v1/messages")


def test_registered_after_the_two_defaults() -> None:
    assert isinstance(APIS[0], OpenAIChat) and APIS[0].name == "openai_chat"
    assert isinstance(APIS[1], OllamaChat) and APIS[1].name == "ollama_chat"
    registered = api_by_name("anthropic_messages")
    assert isinstance(registered, AnthropicMessages)
    assert registered.stream == "sse"
    assert [a.name for a in APIS].count("anthropic_messages") == 1


# ----------------------------------------------------------------------- R22


def test_system_string_is_one_text_block_message() -> None:
    d = digest({"system": "You are terse.", "messages": []})
    assert len(d["messages"]) == 1
    m = d["messages"][0]
    assert m["role"] == "system"
    assert m["hash"] == msg_hash(
        '["system",[{"text":"You are terse.","type":"text"}],null,null,null]'
    )
    assert m["chars"] == len("You are terse.")
    assert m["head"] == m["tail"] == hash_text("You are terse.")
    assert m["tool_calls"] == [] and m["tool_call_id"] is None and m["name"] is None


def test_system_blocks_give_one_message_each_without_cache_control() -> None:
    body = {
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": IDENTITY, "cache_control": EPHEMERAL},
            {"type": "text", "text": "Long instructions", "cache_control": EPHEMERAL},
        ],
        "messages": [],
    }
    msgs = digest(body)["messages"]
    assert [m["role"] for m in msgs] == ["system"] * 3
    assert msgs[0]["hash"] == msg_hash(
        '["system",[{"text":"x-anthropic-billing-header: cc_version=2.1.328.7c2;'
        ' cc_entrypoint=sdk-cli;","type":"text"}],null,null,null]'
    )
    assert msgs[1]["hash"] == msg_hash(
        '["system",[{"text":"You are Claude Code, Anthropic\'s official CLI for Claude.",'
        '"type":"text"}],null,null,null]'
    )
    assert msgs[2]["hash"] == msg_hash(
        '["system",[{"text":"Long instructions","type":"text"}],null,null,null]'
    )
    assert [m["chars"] for m in msgs] == [len(BILLING), len(IDENTITY), len("Long instructions")]


def test_system_string_equals_one_block_system() -> None:
    as_string = digest({"system": "Be brief."})["messages"]
    as_block = digest(
        {"system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}]}
    )
    assert as_string == as_block["messages"]


def test_empty_or_odd_system_values() -> None:
    assert digest({"system": []})["messages"] == []
    assert digest({"system": None})["messages"] == []
    assert digest({"system": 7})["messages"] == []
    empty = digest({"system": ""})["messages"]
    assert len(empty) == 1
    assert empty[0]["hash"] == msg_hash('["system",[{"text":"","type":"text"}],null,null,null]')
    assert empty[0]["chars"] == 0 and empty[0]["head"] == EMPTY_HASH


def test_string_content_equals_one_text_block() -> None:
    turn1 = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Fix the bug", "cache_control": EPHEMERAL}],
            }
        ]
    }
    turn2 = {"messages": [{"role": "user", "content": "Fix the bug"}]}
    a, b = digest(turn1)["messages"][0], digest(turn2)["messages"][0]
    assert a == b
    assert a["hash"] == msg_hash('["user",[{"text":"Fix the bug","type":"text"}],null,null,null]')
    # A different text is a different hash: the content really is covered.
    other = digest({"messages": [{"role": "user", "content": "Fix the bugs"}]})["messages"][0]
    assert other["hash"] != a["hash"]


def test_canonical_escapes_and_raw_utf8_in_the_hash() -> None:
    text = 'héllo\n"q"\t/€\x01'
    m = digest({"messages": [{"role": "user", "content": text}]})["messages"][0]
    expected = '["user",[{"text":"héllo\\n\\"q\\"\\t/€\\u0001","type":"text"}],null,null,null]'
    assert m["hash"] == msg_hash(expected)
    assert m["chars"] == len(text)


def test_moving_cache_control_keeps_every_hash() -> None:
    """Claude Code puts the marker on the last blocks; the next turn moves it."""
    system: list[dict[str, Any]] = [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": IDENTITY, "cache_control": EPHEMERAL},
    ]
    tools = [
        {
            "name": "Read",
            "description": "Reads a file",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
            "cache_control": EPHEMERAL,
        }
    ]
    turn1 = {
        "system": system,
        "tools": tools,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "<env>cwd=/w</env>"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Read a.txt", "cache_control": EPHEMERAL}],
            },
        ],
    }
    turn2 = {
        "system": [dict(system[0], cache_control=EPHEMERAL), {"type": "text", "text": IDENTITY}],
        "tools": [{k: v for k, v in tools[0].items() if k != "cache_control"}],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "<env>cwd=/w</env>"}]},
            {"role": "user", "content": "Read a.txt"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Read",
                        "input": {"file_path": "a.txt"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "hi", "cache_control": EPHEMERAL}],
                        "cache_control": EPHEMERAL,
                    }
                ],
            },
        ],
    }
    d1, d2 = digest(turn1), digest(turn2)
    assert [m["hash"] for m in d1["messages"]] == [m["hash"] for m in d2["messages"][:4]]
    assert d1["tools"] == d2["tools"]
    assert d1["tools_hash"] == d2["tools_hash"] is not None
    # the tool_result's nested marker is gone too
    result_block = (
        '{"content":[{"text":"hi","type":"text"}],"tool_use_id":"toolu_01","type":"tool_result"}'
    )
    assert d2["messages"][5]["hash"] == msg_hash(f'["user",[{result_block}],null,null,null]')


def test_cache_control_removed_at_every_depth() -> None:
    value = {
        "cache_control": EPHEMERAL,
        "a": [{"cache_control": 1, "b": {"cache_control": None, "c": 2}}],
        "d": "cache_control",
    }
    assert strip_cache_control(value) == {"a": [{"b": {"c": 2}}], "d": "cache_control"}
    assert value["cache_control"] == EPHEMERAL  # the input is not changed


def test_block_texts_by_type() -> None:
    body = body_of(
        """{"messages":[{"role":"assistant","content":[
        {"type":"thinking","thinking":"Let me see.","signature":"sig"},
        {"type":"redacted_thinking","data":"xxx"},
        {"type":"text","text":"Reading."},
        {"type":"tool_use","id":"toolu_01","name":"Read",
         "input":{"file_path":"/a","limit":1.50},"cache_control":{"type":"ephemeral"}},
        {"type":"image","source":{"type":"base64","data":"AAAA"}}
        ]}]}"""
    )
    (m,) = digest(body)["messages"]
    tool_json = (
        '{"id":"toolu_01","input":{"file_path":"/a","limit":1.50},"name":"Read","type":"tool_use"}'
    )
    text = "Let me see." + "Reading." + tool_json
    assert m["chars"] == len(text)
    assert m["head"] == hash_text(text)
    assert m["tool_calls"] == [{"id": "toolu_01", "name": "Read"}]
    assert m["tool_call_id"] is None
    assert m["name"] is None
    (pair,) = API.messages_with_text(body)
    assert pair[1] == text
    assert pair[0] == m


def test_tool_result_texts_and_id() -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_A", "content": "line1\nline2"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_B",
                        "content": [
                            {"type": "text", "text": "x"},
                            {"type": "image", "source": {}},
                            {"type": "text", "text": "y"},
                            {"type": "text", "text": 5},
                        ],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_C"},
                    {"type": "text", "text": "done?"},
                ],
            }
        ]
    }
    (pair,) = API.messages_with_text(body)
    m, text = pair
    assert text == "line1\nline2" + "xy" + "done?"
    assert m["chars"] == len(text)
    assert m["tool_call_id"] == "toolu_A"  # the first tool_result
    assert m["tool_calls"] == []


def test_block_text_helper() -> None:
    assert block_text({"type": "text", "text": "a"}) == "a"
    assert block_text({"type": "text", "text": None}) == ""
    assert block_text({"type": "thinking", "thinking": "t"}) == "t"
    assert block_text({"type": "tool_use", "name": "f", "input": {}}) == (
        '{"input":{},"name":"f","type":"tool_use"}'
    )
    assert block_text({"type": "document", "text": "no"}) == ""
    assert block_text("text") == ""


def test_messages_in_order_with_their_roles() -> None:
    body = {
        "system": "S",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
        ],
    }
    assert [m["role"] for m in digest(body)["messages"]] == [
        "system",
        "system",
        "user",
        "assistant",
    ]


def test_odd_messages_cost_only_themselves() -> None:
    body = {
        "system": [{"type": "text", "text": "S"}, "plain", None],
        "messages": [
            "not an object",
            {"role": "user"},
            {"role": "user", "content": 5},
            {"role": "user", "content": [None, 3, {"type": "text", "text": "ok"}]},
        ],
        "tools": "nope",
    }
    d = digest(body)
    msgs = d["messages"]
    assert len(msgs) == 7
    assert msgs[1]["hash"] == msg_hash('["system",["plain"],null,null,null]')
    assert msgs[1]["chars"] == 0
    assert msgs[3]["hash"] == msg_hash("[null,null,null,null,null]")
    assert msgs[4]["hash"] == msg_hash('["user",null,null,null,null]')
    assert msgs[5]["hash"] == msg_hash('["user",5,null,null,null]')
    assert msgs[6]["chars"] == 2
    assert d["tools"] == [] and d["tools_hash"] is None


def test_tools_digest_without_cache_control() -> None:
    tools = [
        {
            "name": "Read",
            "description": "Reads",
            "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}},
            "cache_control": EPHEMERAL,
        },
        {"name": "Bash", "input_schema": {"type": "object"}},
    ]
    d = digest({"tools": tools})
    read = '{"description":"Reads","input_schema":{"properties":{"p":{"type":"string"}},"type":"object"},"name":"Read"}'
    bash = '{"input_schema":{"type":"object"},"name":"Bash"}'
    assert d["tools"] == [
        {"name": "Read", "hash": hash_bytes(read.encode()), "chars": len(read)},
        {"name": "Bash", "hash": hash_bytes(bash.encode()), "chars": len(bash)},
    ]
    assert d["tools_hash"] == hash_bytes(f"[{read},{bash}]".encode())
    assert API.tool_json(tools[0]) == read.encode()


def test_params() -> None:
    base = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "messages": []}
    d = digest({**base, "stream": True, "output_config": {"effort": "high"}})
    assert d["model"] == "claude-sonnet-4-5"
    assert d["params"] == {
        "max_tokens": 32000,
        "response_format": False,
        "grammar": False,
        "stream": True,
    }
    assert "previous_response" not in d["params"]
    assert digest(base)["params"]["stream"] is False  # absent -> false
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    assert digest({**base, "output_format": fmt})["params"]["response_format"] is True
    assert digest({**base, "output_config": {"format": fmt}})["params"]["response_format"] is True
    assert digest({**base, "output_format": None})["params"]["response_format"] is False
    assert digest({**base, "output_format": ""})["params"]["response_format"] is False
    assert digest({**base, "output_config": "x"})["params"]["response_format"] is False
    # only max_tokens counts; odd values give null
    assert digest({"max_tokens": -1, "n_predict": 5})["params"]["max_tokens"] is None
    assert digest({"max_tokens": True})["params"]["max_tokens"] is None
    assert digest({"model": 3, "stream": "yes"})["model"] is None
    assert digest({"stream": "yes"})["params"]["stream"] is False
    assert digest({"grammar": "root ::= x"})["params"]["grammar"] is False


def test_full_body_gives_the_recorded_digest() -> None:
    body = body_of('{"model":"m","system":"S","messages":[{"role":"user","content":"x"}]}')
    assert request_digest_of({"body": body, "digest": None}, API) == digest(body)


def test_count_targets_texts_and_tools() -> None:
    body = {
        "system": [{"type": "text", "text": "S", "cache_control": EPHEMERAL}],
        "messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}],
        "tools": [{"name": "T", "input_schema": {}, "cache_control": EPHEMERAL}],
    }
    messages, tools = API.count_targets(body)
    sys_hash = msg_hash('["system",[{"text":"S","type":"text"}],null,null,null]')
    user_hash = msg_hash('["user",[{"text":"q","type":"text"}],null,null,null]')
    assert messages == {sys_hash: "S", user_hash: "q"}
    tool = '{"input_schema":{},"name":"T"}'
    assert tools == {hash_bytes(tool.encode()): tool}


# ------------------------------------------------------------- stream fixtures

MODEL = "/models/qwen3.6-35b-a3b-q4_k_m.gguf"
START: dict[str, Any] = {
    "type": "message_start",
    "message": {
        "id": "chatcmpl-Ab3Cd5Ef",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 0, "input_tokens": 4244, "output_tokens": 0},
    },
}
STOP = {"type": "message_stop"}


def ev(name: str, data: dict[str, Any] | str) -> bytes:
    """One llama-server event: `event: <name>` then `data: <compact JSON>`, raw UTF-8."""
    text = (
        data
        if isinstance(data, str)
        else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    )
    return f"event: {name}\ndata: {text}\n\n".encode()


def stream(*events: dict[str, Any]) -> bytes:
    """A keep-alive comment, then the events named by their own type."""
    return b":\n\n" + b"".join(ev(str(e["type"]), e) for e in events)


def block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def delta(index: int, **d: Any) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": d}


def block_stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def message_delta(reason: str, output_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
        **extra,
    }


TEXT_EVENTS = [
    START,
    block_start(0, {"type": "text", "text": ""}),
    delta(0, type="text_delta", text=" Cl"),
    delta(0, type="text_delta", text="aude ü€"),
    block_stop(0),
    message_delta("max_tokens", 3948),
    STOP,
]
TEXT_MERGED = {
    "id": "chatcmpl-Ab3Cd5Ef",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": " Claude ü€"}],
    "model": MODEL,
    "stop_reason": "max_tokens",
    "stop_sequence": None,
    "usage": {"cache_read_input_tokens": 0, "input_tokens": 4244, "output_tokens": 3948},
}

TOOL_ARGS = '{"file_path": "/tmp/ü€.txt", "limit": 1.50, "offset": 1E2, "deep": [null]}'
TOOL_EVENTS = [
    START,
    block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
    delta(0, type="thinking_delta", thinking="The user wants "),
    delta(0, type="thinking_delta", thinking="the file."),
    delta(0, type="signature_delta", signature="EqQBCgIYAhIM"),
    block_stop(0),
    {"type": "ping"},
    block_start(1, {"type": "text", "text": ""}),
    delta(1, type="text_delta", text="Reading it."),
    block_stop(1),
    block_start(2, {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {}}),
    delta(2, type="input_json_delta", partial_json=""),
    delta(2, type="input_json_delta", partial_json=TOOL_ARGS[:7]),
    delta(2, type="input_json_delta", partial_json=TOOL_ARGS[7:20]),
    delta(2, type="input_json_delta", partial_json=TOOL_ARGS[20:41]),
    delta(2, type="input_json_delta", partial_json=TOOL_ARGS[41:]),
    block_stop(2),
    message_delta("tool_use", 61),
    STOP,
]
TOOL_BYTES = stream(*TOOL_EVENTS)
TOOL_INPUT_CANON = (
    b'{"deep":[null],"file_path":"/tmp/\xc3\xbc\xe2\x82\xac.txt","limit":1.50,"offset":1E2}'
)


def merge(*events: Any) -> dict[str, Any] | None:
    merger = MessagesMerger()
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


# ----------------------------------------------------------------------- R23


def test_llama_text_stream_through_capture() -> None:
    cap = capture(stream(*TEXT_EVENTS))
    assert cap.merged() == TEXT_MERGED
    assert list(cap.merged() or {}) == list(TEXT_MERGED)  # message_start's key order
    assert cap.chunks == len(TEXT_EVENTS)  # the keep-alive comment is no chunk
    assert cap.bad_chunks == 0
    assert cap.done_seen is True  # message_stop, with no [DONE] (R29)
    assert cap.internal_errors == 0


def test_tool_stream_merged() -> None:
    merged = merge(*TOOL_EVENTS)
    assert merged is not None
    content = merged["content"]
    assert content[0] == {
        "type": "thinking",
        "thinking": "The user wants the file.",
        "signature": "EqQBCgIYAhIM",
    }
    assert content[1] == {"type": "text", "text": "Reading it."}
    assert content[2]["type"] == "tool_use"
    assert content[2]["id"] == "toolu_01" and content[2]["name"] == "Read"
    assert canonical.dumps(content[2]["input"]) == TOOL_INPUT_CANON  # number text kept (R2)
    assert merged["stop_reason"] == "tool_use"
    assert merged["usage"]["output_tokens"] == 61
    out = API.response_digest(merged)["output"]
    assert out == {
        "content_chars": len("Reading it."),
        "reasoning_chars": len("The user wants the file."),
        "tool_calls": [{"id": "toolu_01", "name": "Read"}],
    }


def test_input_json_split_at_every_byte() -> None:
    whole = state(capture(TOOL_BYTES))
    assert whole[3] is True
    merged = capture(TOOL_BYTES).merged()
    assert merged is not None
    assert canonical.dumps(merged["content"][2]["input"]) == TOOL_INPUT_CANON
    for cut in range(1, len(TOOL_BYTES)):
        assert state(capture(TOOL_BYTES[:cut], TOOL_BYTES[cut:])) == whole, cut


def test_input_json_random_multiway_splits() -> None:
    whole = state(capture(TOOL_BYTES))
    rng = random.Random(20261201)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(TOOL_BYTES)), rng.randint(2, 40)))
        pieces = [
            TOOL_BYTES[a:b] for a, b in zip([0, *cuts], [*cuts, len(TOOL_BYTES)], strict=True)
        ]
        assert b"".join(pieces) == TOOL_BYTES
        assert state(capture(*pieces)) == whole, cuts
    one_by_one = [TOOL_BYTES[i : i + 1] for i in range(len(TOOL_BYTES))]
    assert state(capture(*one_by_one)) == whole


def test_crlf_framing_merges_the_same() -> None:
    crlf = TOOL_BYTES.replace(b"\n", b"\r\n")
    assert state(capture(crlf))[:2] == state(capture(TOOL_BYTES))[:2]
    assert capture(crlf).merged() == capture(TOOL_BYTES).merged()


def test_invalid_input_json_keeps_the_text() -> None:
    merged = merge(
        block_start(0, {"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        delta(0, type="input_json_delta", partial_json='{"a": tru'),
    )
    assert merged is not None
    assert merged["content"][0]["input"] == '{"a": tru'


def test_input_without_delta_stays_as_started() -> None:
    start = {"type": "tool_use", "id": "t", "name": "f", "input": {"preset": 1}}
    assert merge(block_start(0, start))["content"][0]["input"] == {"preset": 1}  # type: ignore[index]
    only_empty = merge(block_start(0, start), delta(0, type="input_json_delta", partial_json=""))
    assert only_empty is not None
    assert only_empty["content"][0]["input"] == {"preset": 1}
    replaced = merge(block_start(0, start), delta(0, type="input_json_delta", partial_json="{}"))
    assert replaced is not None
    assert replaced["content"][0]["input"] == {}


def test_message_delta_sets_delta_usage_and_other_keys() -> None:
    timings = {"cache_n": 236, "prompt_n": 1, "prompt_ms": 30.958, "predicted_ms": 661.06}
    merged = merge(
        START,
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None, "container": None},
            "usage": {"output_tokens": 12, "input_tokens": None, "cache_read_input_tokens": 5},
            "timings": timings,
        },
        {"type": "message_delta", "usage": {"output_tokens": 13}},
    )
    assert merged is not None
    assert merged["stop_reason"] == "end_turn"
    assert "container" in merged and merged["container"] is None
    assert merged["timings"] == timings
    assert merged["type"] == "message"  # the event's own `type` is not copied
    # usage keys merged into message_start's usage; a null does not erase a count
    assert merged["usage"] == {
        "cache_read_input_tokens": 5,
        "input_tokens": 4244,
        "output_tokens": 13,
    }


def test_message_delta_without_start_creates_usage() -> None:
    merged = merge(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2},
        }
    )
    assert merged == {"stop_reason": "end_turn", "usage": {"output_tokens": 2}, "content": []}


def test_error_event_is_kept_and_does_not_end() -> None:
    err = {"type": "overloaded_error", "message": "Overloaded"}
    cap = capture(
        stream(
            START,
            block_start(0, {"type": "text", "text": ""}),
            delta(0, type="text_delta", text="Hi"),
        )
        + ev("error", {"type": "error", "error": err})
    )
    merged = cap.merged()
    assert merged is not None
    assert merged["error"] == err
    assert merged["content"] == [{"type": "text", "text": "Hi"}]
    assert cap.done_seen is False


def test_blocks_output_in_index_order() -> None:
    merged = merge(
        START,
        block_start(2, {"type": "text", "text": ""}),
        block_start(0, {"type": "text", "text": "a"}),
        delta(2, type="text_delta", text="c"),
        block_start(1, {"type": "text", "text": ""}),
        delta(1, type="text_delta", text="b"),
    )
    assert merged is not None
    assert [b["text"] for b in merged["content"]] == ["a", "b", "c"]  # start text kept, then deltas


def test_stream_cut_before_message_stop() -> None:
    cut = TOOL_BYTES[: TOOL_BYTES.index(b"event: message_stop")]
    cap = capture(cut)
    assert cap.done_seen is False
    merged = cap.merged()
    assert merged is not None
    assert merged["stop_reason"] == "tool_use"
    assert canonical.dumps(merged["content"][2]["input"]) == TOOL_INPUT_CANON
    assert cap.chunks == len(TOOL_EVENTS) - 1 and cap.bad_chunks == 0


def test_stream_cut_inside_the_tool_input() -> None:
    # inside the last fragment's event, which is left unterminated
    cut = TOOL_BYTES[: TOOL_BYTES.index(b'\\"offset') + 3]
    cap = capture(cut)
    assert cap.done_seen is False
    merged = cap.merged()
    assert merged is not None
    assert merged["stop_reason"] is None  # message_start's value
    assert merged["usage"] == START["message"]["usage"]
    assert merged["content"][0]["thinking"] == "The user wants the file."
    assert merged["content"][2]["input"] == TOOL_ARGS[:41]  # the JSON text so far
    assert cap.bad_chunks == 1  # the cut event


def test_truncated_capture_keeps_complete_events() -> None:
    limit = TOOL_BYTES.index(b"event: message_delta") + 5
    cap = capture(TOOL_BYTES, limit=limit)
    assert cap.truncated is True
    assert cap.done_seen is False
    merged = cap.merged()
    assert merged is not None
    assert merged["stop_reason"] is None
    assert canonical.dumps(merged["content"][2]["input"]) == TOOL_INPUT_CANON


def test_the_data_type_decides_not_the_event_name() -> None:
    data = (
        b":\n\n"
        + ev("ping", START)
        + ev("message_stop", block_start(0, {"type": "text", "text": ""}))
        + ev("content_block_delta", delta(0, type="text_delta", text="x"))
        + ev("ping", STOP)
    )
    ends_early = capture(data[: data.rindex(b"event: ping")])
    assert ends_early.done_seen is False  # named message_stop, but its type is not
    cap = capture(data)
    assert cap.done_seen is True
    merged = cap.merged()
    assert merged is not None
    assert merged["content"] == [{"type": "text", "text": "x"}]
    assert merged["model"] == MODEL


def test_ended_only_on_message_stop() -> None:
    merger = MessagesMerger()
    for e in TEXT_EVENTS[:-1]:
        merger.add(e)
        assert merger.ended is False
    merger.add({"type": "ping"})
    assert merger.ended is False
    merger.add(STOP)
    assert merger.ended is True


def test_ping_and_stop_events_add_nothing() -> None:
    plain = merge(*TEXT_EVENTS)
    noisy = merge(
        {"type": "ping"},
        *TEXT_EVENTS[:3],
        {"type": "ping"},
        block_stop(0),
        block_stop(7),
        *TEXT_EVENTS[3:],
        {"type": "ping"},
        {"type": "unknown_future_event", "x": 1},
    )
    assert noisy == plain


def test_no_event_gives_none_and_non_objects_are_ignored() -> None:
    assert MessagesMerger().result() is None
    merger = MessagesMerger()
    merger.add("nope")  # type: ignore[arg-type]
    merger.add([1])  # type: ignore[arg-type]
    assert merger.result() is None
    merger.add({"type": "ping"})
    assert merger.result() == {"content": []}


def test_odd_events_cost_only_their_field() -> None:
    merged = merge(
        {"type": "message_start", "message": "not an object"},
        START,
        block_start(0, {"type": "text", "text": 5}),  # a non-string start text
        delta(0, type="text_delta", text="a"),
        delta(0, type="text_delta", text=None),
        delta(0, type="citations_delta", citation={"x": 1}),
        {"type": "content_block_delta", "index": 0, "delta": "nope"},
        {"type": "content_block_start", "index": True, "content_block": None},  # no int index
        delta(5, type="thinking_delta", thinking="t"),  # never started
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "z"}},
        {"type": "message_delta", "delta": 3, "usage": [1]},
        {"type": "error"},
    )
    assert merged is not None
    assert merged["content"] == [
        {"type": "text", "text": "a"},
        {"text": "z"},  # the index-less start got the next index; the index-less delta went to it
        {"type": "thinking", "thinking": "t"},
    ]
    assert "error" not in merged
    assert merged["usage"] == START["message"]["usage"]


def test_result_is_repeatable_and_does_not_alias_events() -> None:
    merger = MessagesMerger()
    events = json.loads(json.dumps(TOOL_EVENTS))
    for e in events:
        merger.add(e)
    first = merger.result()
    assert first is not None
    first["usage"]["output_tokens"] = -1
    first["content"][1]["text"] = "changed"
    again = merger.result()
    assert again is not None
    assert again["usage"]["output_tokens"] == 61
    assert again["content"][1]["text"] == "Reading it."
    assert events[0]["message"]["usage"]["output_tokens"] == 0


_KEYS = [
    "type",
    "index",
    "message",
    "content_block",
    "delta",
    "usage",
    "error",
    "text",
    "partial_json",
]
_TYPES = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "message_delta",
    "message_stop",
    "error",
    "ping",
    "text_delta",
    "input_json_delta",
    "thinking_delta",
    "signature_delta",
]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4), st.sampled_from(_TYPES)
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
    merger = MessagesMerger()
    for e in events:
        merger.add(e)
    result = merger.result()
    if not any(isinstance(e, dict) for e in events):
        assert result is None
        return
    assert result is not None
    assert isinstance(result["content"], list)
    canonical.dumps(result)
    assert canonical.dumps(merger.result()) == canonical.dumps(result)
    assert merger.ended == any(
        isinstance(e, dict) and e.get("type") == "message_stop" for e in events
    )
    API.response_digest(result)
    API.counts(API.response_digest(result)["usage"], CountHints())


# ----------------------------------------------------------------------- R24

NON_STREAMED = body_of(
    '{"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"Hello there"}],'
    '"model":"/models/m.gguf","stop_reason":"max_tokens","stop_sequence":null,'
    '"usage":{"cache_read_input_tokens":18,"input_tokens":1,"output_tokens":8}}'
)


def test_response_digest_keeps_every_field_but_content() -> None:
    d = API.response_digest(NON_STREAMED)
    assert d["usage"] == {k: v for k, v in NON_STREAMED.items() if k != "content"}
    assert "content" not in d["usage"]
    assert d["usage"]["model"] == "/models/m.gguf"
    assert d["output"] == {"content_chars": 11, "reasoning_chars": 0, "tool_calls": []}


def test_response_digest_counts_block_kinds() -> None:
    body = {
        "content": [
            {"type": "thinking", "thinking": "abc", "signature": "s"},
            {"type": "redacted_thinking", "data": "zzzz"},
            {"type": "text", "text": "de"},
            {"type": "text", "text": "f"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "name": "Glob", "input": {}},
            "junk",
        ],
        "usage": {},
    }
    d = API.response_digest(body)
    assert d["output"] == {
        "content_chars": 3,
        "reasoning_chars": 3,
        "tool_calls": [{"id": "toolu_1", "name": "Bash"}, {"id": None, "name": "Glob"}],
    }
    assert API.response_digest({"content": "plain"})["output"]["content_chars"] == 5
    assert API.response_digest({"content": None})["output"]["content_chars"] == 0


def test_llama_server_counters() -> None:
    c = API.counts(API.response_digest(NON_STREAMED)["usage"], CountHints())
    assert c.reused_tokens == (18, "server")
    assert c.evaluated_tokens == (1, "server")
    assert c.prompt_tokens == (19, "server")
    assert c.completion_tokens == (8, "server")
    assert c.prefill_ms is None and c.decode_ms is None and c.load_ms is None
    assert c.reported() == [
        "prompt_tokens",
        "completion_tokens",
        "reused_tokens",
        "evaluated_tokens",
    ]


def test_cache_creation_counts_as_evaluated() -> None:
    usage = {
        "input_tokens": 10,
        "cache_creation_input_tokens": 2000,
        "cache_read_input_tokens": 30000,
        "output_tokens": 500,
    }
    c = anthropic_counts({"usage": usage})
    assert c.evaluated_tokens == (2010, "server")
    assert c.reused_tokens == (30000, "server")
    assert c.prompt_tokens == (32010, "server")
    assert c.completion_tokens == (500, "server")


def test_counters_with_absent_or_odd_values() -> None:
    c = anthropic_counts({"usage": {"input_tokens": 7, "cache_creation_input_tokens": None}})
    assert c.evaluated_tokens == (7, "server") and c.prompt_tokens == (7, "server")
    assert c.reused_tokens is None and c.completion_tokens is None
    c = anthropic_counts({"usage": {"cache_read_input_tokens": 5, "output_tokens": "3"}})
    assert c.prompt_tokens is None and c.evaluated_tokens is None
    assert c.reused_tokens == (5, "server") and c.completion_tokens is None
    c = anthropic_counts({"usage": {"input_tokens": -1, "output_tokens": True}})
    assert c.prompt_tokens is None and c.completion_tokens is None
    empty = anthropic_counts({"usage": "x", "timings": [1]})
    assert empty.reported() == []


def test_counters_with_timings() -> None:
    timings = {
        "cache_n": 18,
        "prompt_n": 1,
        "prompt_ms": 30.958,
        "predicted_n": 8,
        "predicted_ms": 661.06,
    }
    merged = merge(*TEXT_EVENTS[:-2], message_delta("end_turn", 8, timings=timings), STOP)
    assert merged is not None
    usage = API.response_digest(merged)["usage"]
    assert usage["timings"] == timings
    c = API.counts(usage, CountHints())
    assert c.prefill_ms == (30.958, "server")
    assert c.decode_ms == (661.06, "server")
    assert c.reused_tokens == (0, "server")  # the counters still come from usage
    assert c.evaluated_tokens == (4244, "server")
    assert c.completion_tokens == (8, "server")


@pytest.mark.parametrize("end", [b"", b'event: message_stop\ndata: {"type":"message_stop"}\n\n'])
def test_done_seen_follows_message_stop(end: bytes) -> None:
    data = stream(*TEXT_EVENTS[:-1]) + end
    assert capture(data).done_seen is bool(end)


_BODY_KEYS = [
    "system",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "thinking",
    "tool_use_id",
    "cache_control",
    "tools",
    "name",
    "max_tokens",
    "output_format",
    "output_config",
    "format",
    "stream",
]
_BLOCK_TYPES = ["text", "thinking", "tool_use", "tool_result", "image"]
_body_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-2, 2),
        st.text(max_size=3),
        st.sampled_from(_BLOCK_TYPES),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_BODY_KEYS), inner, max_size=5)
    ),
    max_leaves=25,
)


CACHE_CONTROL_BYTES = b'"cache_control"'


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_BODY_KEYS), _body_values, max_size=6))
def test_request_digest_never_raises(body: dict[str, Any]) -> None:
    d = API.request_digest(body)
    pairs = API.messages_with_text(body)
    assert [p[0] for p in pairs] == d["messages"]
    assert all(m["chars"] == len(t) for m, t in pairs)
    assert all(isinstance(m["hash"], str) and len(m["hash"]) == 16 for m in d["messages"])
    assert CACHE_CONTROL_BYTES not in API.tool_json(body.get("tools"))
    API.count_targets(body)
