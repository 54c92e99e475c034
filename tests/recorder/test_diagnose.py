"""The opt-in provider diagnosis (R37), its pure part: bodies, headers, chains, ids."""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest

from llmp.apis.providers import ANTHROPIC, OPENAI, facts
from llmp.recorder.diagnose import Chains, Diagnosis, Turn, response_id, wants

BETA = facts()["anthropic"]["diagnosis_beta"]
SYSTEM: list[dict[str, Any]] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.7c2; cch=11111;"},
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
]


def messages_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    """An Anthropic request as a client writes it, with its own spacing and number text."""
    body = {"model": "claude-sonnet-5", "max_tokens": 1024, "system": SYSTEM, "messages": messages}
    body.update(extra)
    # Spaced like json.dumps, and a number written as `1.0`: bytes a re-serialisation
    # would change.
    return json.dumps(body, indent=1).replace('"max_tokens": 1024', '"max_tokens": 1024.0').encode()


def responses_body(model: str, items: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {"model": model, "input": items, "stream": True, **extra}
    return json.dumps(body).encode()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def anthropic_json(rid: str) -> list[bytes]:
    body = {"id": rid, "type": "message", "content": [{"type": "text", "text": "ok"}]}
    text = orjson.dumps(body)
    return [text[:7], text[7:]]  # split: the id is read across pieces


def anthropic_sse(rid: str) -> list[bytes]:
    start = {"type": "message_start", "message": {"id": rid, "type": "message", "content": []}}
    return [
        b"event: message_start\ndata: " + orjson.dumps(start)[:20],
        orjson.dumps(start)[20:] + b"\n\n",
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ]


def responses_sse(rid: str) -> list[bytes]:
    created = {"type": "response.created", "response": {"id": rid, "status": "in_progress"}}
    return [b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"]


def without(new: bytes, inserted: bytes) -> bytes:
    """`new` with one occurrence of `inserted` taken out."""
    assert new.count(inserted) == 1, (new, inserted)
    return new.replace(inserted, b"", 1)


# -- what may be asked ---------------------------------------------------------------


def test_wants_only_the_providers_diagnosed_apis() -> None:
    assert wants(ANTHROPIC, "anthropic_messages")
    assert wants(OPENAI, "openai_responses")
    assert not wants(OPENAI, "openai_chat")
    assert not wants(ANTHROPIC, "openai_responses")
    assert not wants(None, "anthropic_messages")  # a local server or an unknown host
    assert not wants("openrouter", "anthropic_messages")


# -- Anthropic -----------------------------------------------------------------------


def test_anthropic_first_turn_asks_with_null_and_keeps_every_client_byte() -> None:
    d = Diagnosis()
    data = messages_body([user("hi")])
    rw = d.request(1, ANTHROPIC, "anthropic_messages", data, [])
    assert rw is not None and rw.body is not None
    assert rw.added == ("diagnostics", "anthropic-beta")
    assert without(rw.body, b',"diagnostics":{"previous_message_id":null}') == data
    assert json.loads(rw.body)["diagnostics"] == {"previous_message_id": None}
    assert rw.beta == [BETA]


def test_anthropic_beta_is_appended_once() -> None:
    d = Diagnosis()
    data = messages_body([user("hi")])
    rw = d.request(1, ANTHROPIC, "anthropic_messages", data, ["a-1", "b-2,c-3"])
    assert rw is not None and rw.beta == ["a-1", f"b-2,c-3,{BETA}"]
    rw = d.request(2, ANTHROPIC, "anthropic_messages", data, [f"a-1, {BETA}"])
    assert rw is not None and rw.beta is None and rw.added == ("diagnostics",)


def test_anthropic_client_that_asked_itself_is_left_alone() -> None:
    d = Diagnosis()
    data = messages_body([user("hi")], diagnostics={"previous_message_id": "msg_own"})
    rw = d.request(1, ANTHROPIC, "anthropic_messages", data, [])
    assert rw is not None and (rw.body, rw.beta, rw.added) == (None, None, ())


def test_anthropic_chain_over_three_turns_and_a_second_conversation() -> None:
    d = Diagnosis()
    turn1 = [user("read calc.py")]
    turn2 = [*turn1, assistant("It adds."), user("and tests?")]
    turn3 = [*turn2, assistant("None."), user("write one")]
    other = [user("something else")]

    def ask(seq: int, messages: list[dict[str, Any]], system: Any = SYSTEM) -> Any:
        data = messages_body(messages, system=system)
        rw = d.request(seq, ANTHROPIC, "anthropic_messages", data, [])
        assert rw is not None and rw.body is not None
        return json.loads(rw.body)["diagnostics"]["previous_message_id"]

    assert ask(1, turn1) is None
    d.responded(1, anthropic_sse("msg_1"), None)
    assert ask(2, other) is None  # another conversation starts
    d.responded(2, anthropic_json("msg_2"), None)
    assert ask(3, turn2) == "msg_1"
    d.responded(3, [gzip.compress(b"".join(anthropic_sse("msg_3")))], "gzip")
    # The billing line changed (a per-request `cch`): still the same system prompt.
    billed = [{**SYSTEM[0], "text": SYSTEM[0]["text"].replace("11111", "22222")}, SYSTEM[1]]
    assert ask(4, turn3, billed) == "msg_3"
    d.responded(4, anthropic_json("msg_4"), None)
    assert ask(5, [*other, assistant("Sure."), user("go on")]) == "msg_2"


def test_a_failed_turn_is_not_chained_to() -> None:
    d = Diagnosis()
    turn1 = [user("a")]
    turn2 = [*turn1, assistant("b"), user("c")]
    d.request(1, ANTHROPIC, "anthropic_messages", messages_body(turn1), [])
    d.responded(1, anthropic_json("msg_1"), None)
    d.request(2, ANTHROPIC, "anthropic_messages", messages_body(turn2), [])
    d.forget(2)  # e.g. a 529: no id
    rw = d.request(3, ANTHROPIC, "anthropic_messages", messages_body(turn2), [])  # its retry
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["diagnostics"]["previous_message_id"] == "msg_1"


# -- OpenAI Responses ----------------------------------------------------------------


def test_openai_explicit_model_chains_and_merges_into_prompt_cache_options() -> None:
    d = Diagnosis()
    first = [item("developer", "be terse"), item("user", "hi")]
    second = [*first, item("assistant", "hello"), item("user", "more")]
    data = responses_body("gpt-5.6", first)
    rw = d.request(1, OPENAI, "openai_responses", data, [])
    assert rw is not None and (rw.body, rw.added) == (None, ())  # a first turn: nothing
    d.responded(1, responses_sse("resp_1"), None)
    data = responses_body("gpt-5.6", second, prompt_cache_options={"mode": "explicit"})
    rw = d.request(2, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is not None
    assert rw.added == ("prompt_cache_options.comparison_response_id",)
    assert without(rw.body, b'"comparison_response_id":"resp_1",') == data
    assert json.loads(rw.body)["prompt_cache_options"] == {
        "comparison_response_id": "resp_1",
        "mode": "explicit",
    }


@pytest.mark.parametrize(
    ("options", "want"),
    [
        (None, {"comparison_response_id": "resp_1"}),
        ({}, {"comparison_response_id": "resp_1"}),
    ],
)
def test_openai_absent_empty_and_null_options(options: Any, want: dict[str, Any]) -> None:
    d = Diagnosis()
    first = [item("user", "hi")]
    d.request(1, OPENAI, "openai_responses", responses_body("gpt-5.6-codex", first), [])
    d.responded(1, responses_sse("resp_1"), None)
    second = [*first, item("assistant", "yo"), item("user", "again")]
    extra = {} if options is None else {"prompt_cache_options": options}
    rw = d.request(
        2, OPENAI, "openai_responses", responses_body("gpt-5.6-codex", second, **extra), []
    )
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["prompt_cache_options"] == want
    data = responses_body("gpt-5.6-codex", second, prompt_cache_options=None)
    rw = d.request(3, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["prompt_cache_options"] == want


def test_openai_own_comparison_older_generation_and_previous_response_id() -> None:
    d = Diagnosis()
    own = {"comparison_response_id": "resp_own"}
    data = responses_body("gpt-5.6", [item("user", "hi")], prompt_cache_options=own)
    rw = d.request(1, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is None and rw.added == ()
    # Before GPT-5.6 there is no diagnosis to ask for.
    assert (
        d.request(
            2, OPENAI, "openai_responses", responses_body("gpt-5.5", [item("user", "hi")]), []
        )
        is None
    )
    # A stateful client names its previous response itself: that one is compared.
    data = responses_body("gpt-5.6", [item("user", "next")], previous_response_id="resp_prev")
    rw = d.request(3, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["prompt_cache_options"] == {"comparison_response_id": "resp_prev"}


def test_openai_side_call_without_tools_is_not_the_turn_before_the_next() -> None:
    """Codex's compaction request resends the history under the same (absent) system
    prompt but without its tools; the turn after it, which resends the first turn's
    prompt, is compared with that first turn, as the analysis links it."""
    d = Diagnosis()
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
    first = [item("developer", "be terse"), item("user", "read calc.py")]
    compact = [*first, item("assistant", "It adds."), item("user", "summarise")]
    after = [*first, item("user", "the summary"), item("user", "go on")]
    d.request(1, OPENAI, "openai_responses", responses_body("gpt-5.6", first, tools=tools), [])
    d.responded(1, responses_sse("resp_turn"), None)
    rw = d.request(2, OPENAI, "openai_responses", responses_body("gpt-5.6", compact), [])
    assert rw is not None and rw.body is not None  # the side-call itself: the only candidate
    assert json.loads(rw.body)["prompt_cache_options"]["comparison_response_id"] == "resp_turn"
    d.responded(2, responses_sse("resp_compact"), None)
    data = responses_body("gpt-5.6", after, tools=tools)
    rw = d.request(3, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["prompt_cache_options"]["comparison_response_id"] == "resp_turn"
    d.responded(3, responses_sse("resp_after"), None)
    # Where no candidate has its tools, the longest start still counts: the provider can
    # say `tools_changed`.
    changed = [{**tools[0], "name": "shell"}]
    data = responses_body("gpt-5.6", [*after, item("user", "more")], tools=changed)
    rw = d.request(4, OPENAI, "openai_responses", data, [])
    assert rw is not None and rw.body is not None
    assert json.loads(rw.body)["prompt_cache_options"]["comparison_response_id"] == "resp_after"


def test_nothing_for_a_local_server_or_a_body_that_is_no_json() -> None:
    d = Diagnosis()
    assert d.request(1, None, "anthropic_messages", messages_body([user("hi")]), []) is None  # type: ignore[arg-type]
    assert d.request(2, ANTHROPIC, "anthropic_messages", b"{not json", []) is None
    assert d.request(3, ANTHROPIC, "anthropic_messages", b"[1, 2]", []) is None


# -- chains ----------------------------------------------------------------------------


def turn(model: str, head: int, *hashes: str) -> Turn:
    chained: list[int] = []
    h = 0
    for x in hashes:
        h = hash((h, x))
        chained.append(h)
    return Turn("anthropic_messages", model, head, tuple(chained))


def test_chains_prefer_the_same_system_but_still_link_a_changed_one() -> None:
    c = Chains()
    c.remember(1, turn("m", 1, "a"), "msg_main")
    c.remember(2, turn("m", 2, "a"), "msg_side")  # the same history under another system
    assert c.previous(3, turn("m", 1, "a", "b", "c")) == "msg_main"
    assert c.previous(3, turn("m", 9, "a", "b", "c")) == "msg_side"  # none has it: the latest
    # On another model, the latest request with those messages: the conversation went on
    # with another model, and the provider can say `model_changed`.
    assert c.previous(3, turn("other-model", 1, "a", "b", "c")) == "msg_side"
    c.remember(3, turn("other-model", 1, "a", "b", "c"), "msg_other")
    assert c.previous(4, turn("other-model", 1, "a", "b", "c", "d")) == "msg_other"
    assert c.previous(2, turn("m", 2, "a", "b")) is None  # only earlier requests count
    assert c.previous(3, turn("m", 1, "x", "a")) is None  # not a prefix


def test_chains_are_bounded() -> None:
    c = Chains(max_turns=2)
    c.remember(1, turn("m", 1, "a"), "r1")
    c.remember(2, turn("m", 1, "b"), "r2")
    c.remember(3, turn("m", 1, "c"), "r3")
    assert len(c) == 2
    assert c.previous(9, turn("m", 1, "a", "z")) is None
    assert c.previous(9, turn("m", 1, "c", "z")) == "r3"


# -- response ids ----------------------------------------------------------------------


def test_response_ids() -> None:
    assert response_id(anthropic_json("msg_a"), None) == "msg_a"
    assert response_id(anthropic_sse("msg_b"), None) == "msg_b"
    assert response_id(responses_sse("resp_c"), None) == "resp_c"
    gz = gzip.compress(b"".join(responses_sse("resp_d")))
    assert response_id([gz[:10], gz[10:]], "gzip") == "resp_d"
    assert response_id([b"not json"], None) is None
    assert response_id([b'{"type": "error"}'], None) is None
    assert response_id([], None) is None


def test_the_diagnosis_digests_hashes_only_and_leaves_the_records_chunks() -> None:
    """On the client's request path the diagnosis reads only the hashes: its digests keep
    no chunks, and the same hashes as the record's digest, which still keeps them."""
    from llmp.apis.anthropic_messages import AnthropicMessages
    from llmp.apis.base import hashes_only

    long = " ".join(f"line {i} of a pasted file" for i in range(200))
    body = messages_body([user(long), assistant("ok"), user(long + " and more")])
    kept = AnthropicMessages().request_digest_bytes(body)
    with hashes_only():
        light = AnthropicMessages().request_digest_bytes(body)
    assert kept is not None and light is not None
    assert [m["hash"] for m in light["messages"]] == [m["hash"] for m in kept["messages"]]
    assert all(m["chunks"] is None for m in light["messages"])
    assert any(m["chunks"] is not None for m in kept["messages"])  # outside: back again
    assert AnthropicMessages().request_digest_bytes(body) == kept
    d = Diagnosis()
    d.request(1, ANTHROPIC, "anthropic_messages", body, ())
    api = d._api("anthropic_messages")
    assert api is not None and api._cache is not None and len(api._cache) > 0
    digests = [e[0] for e in api._cache._map.values() if isinstance(e[0], dict)]
    assert digests and all(m["chunks"] is None for m in digests)
