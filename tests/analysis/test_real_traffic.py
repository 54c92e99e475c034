"""Misattributions found on real aider traffic (bench/real_harness.py), as regressions.

Each test replays a small synthetic equivalent of what the real recording
showed (tests/scenarios.py); docs/real-harness.md has the real numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmp.analysis.linking import may_have_run
from tests.support import scenarios as sc
from tests.support.scenarios import analyse, rows_by_id, value

MODES = ["full", "digest", "mixed"]


def _kinds(rep: dict[str, Any]) -> list[str]:
    return [f["kind"] for f in rep["findings"]]


# -- aider's /ask: another system prompt, the same history -----------------------


@pytest.mark.parametrize("mode", MODES)
def test_ask_mode_stays_in_the_conversation(tmp_path: Path, mode: str) -> None:
    """Real: the /ask request was a new conversation, and the code turn after it lost
    714 tokens to "other_conversation" although aider itself had switched modes."""
    rep = analyse(sc.aider_ask_mode(), tmp_path, mode)
    r = rows_by_id(rep)
    assert rep["coverage"]["conversations"] == 1
    assert [r[i]["conversation"] for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    ask, back = r[3], r[4]
    assert ask["linked_to"] == 2 and not ask["new_conversation"]
    assert back["linked_to"] == 3 and back["other_conversations_between"] == []
    for row in (ask, back):
        assert row["break_cause"] == "system_changed"
        assert row["cause"] == "structural"
        assert row["lost_external"] is None
        assert row["lost_client"]["cause"] == "system_changed"
        assert row["lost_client"]["tokens"] > 0
    assert "other_conversation_eviction" not in _kinds(rep)
    (brk,) = [f for f in rep["findings"] if f["kind"] == "prefix_break"]
    assert brk["evidence"]["break_cause"] == "system_changed" and brk["rows"] == [3, 4]


@pytest.mark.parametrize("resends_reply", [False, True])
def test_shared_scaffolding_links_only_with_the_reply(tmp_path: Path, resends_reply: bool) -> None:
    """Two shared messages (a repo map and its canned answer) are not enough to link a
    request under another system prompt; with the turn's reply resent, they are."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    scaffold = [
        {"role": "user", "content": "Here are summaries of some files.\n" + sc.text("map", 900)},
        {"role": "assistant", "content": "Ok, I won't try and edit those files without asking."},
    ]
    history = [
        {"role": r, "content": sc.text(f"{r} {i}", 300)}
        for i in range(3)
        for r in ("user", "assistant")
    ]
    reply = {"role": "assistant", "content": sc.text("the reply", 333)}
    code = [{"role": "user", "content": "examples"}, *scaffold, *history]
    tr.chat(srv, sc.AIDER_UA, sc._aider_body(sc.AIDER_CODE_SYSTEM, code, [], "go"), reply)
    ask = [{"role": "user", "content": "I am working with you on code."}, *scaffold]
    if resends_reply:
        ask += [{"role": "user", "content": "go"}, reply]
    tr.chat(srv, sc.AIDER_UA, sc._aider_body(sc.AIDER_ASK_SYSTEM, ask, [], "What is it?"),
            {"role": "assistant", "content": "x"})  # fmt: skip
    row = rows_by_id(analyse(tr, tmp_path, "full"))[2]
    if resends_reply:
        assert row["linked_to"] == 1 and row["conversation"] == 1
        assert row["break_cause"] == "system_changed"
    else:
        assert row["linked_to"] is None and row["conversation"] == 2


# -- errors that never reached a slot ---------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_server_restart_while_retrying_is_a_server_reset(tmp_path: Path, mode: str) -> None:
    """Real: llama-server restarted while aider retried (502 from the proxy, 503
    "Loading model"); the turn then had an empty cache.  Neither error reached a
    slot, so the loss is the server's, not `undetermined`."""
    tr = sc.outage_retries()
    rep = analyse(tr, tmp_path, mode)
    r = rows_by_id(rep)
    assert rep["coverage"]["skipped"]["error"] == 1 and rep["coverage"]["skipped"]["non_2xx"] == 1
    after = r[5]
    assert after["linked_to"] == 2
    assert after["cause"] == "server_reset"
    assert after["lost_external"]["cause"] == "server_empty"
    assert after["lost_external"]["tokens"] == value(r[2]["counts"]["prompt_tokens"])
    (loss,) = [f for f in rep["findings"] if f["kind"] == "server_cache_loss"]
    assert loss["rows"] == [5] and loss["evidence"]["kind"] == "server_empty"


@pytest.mark.parametrize(
    ("error", "status", "cause"),
    [
        ("upstream_unreachable", 0, "server_reset"),
        ("timeout", 0, "server_reset"),
        (None, 400, "server_reset"),  # a context refusal: counted, never evaluated
        (None, 503, "server_reset"),  # "Loading model"
        ("client_disconnected", 200, "undetermined"),  # it ran; nothing says what it was
        ("upstream_reset", 0, "undetermined"),
        (None, 500, "undetermined"),
    ],
)
def test_a_skipped_request_in_between(
    tmp_path: Path, error: str | None, status: int, cause: str
) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua=sc.AIDER_UA, model="smol", tools=None)
    a.turn(sc.text("first", 300), sc.text("answer", 400))
    srv.reset()
    tr.failed(a.ua, a.body(), error=error, status=status)
    a.turn(sc.text("second", 300), sc.text("answer 2", 400))
    row = rows_by_id(analyse(tr, tmp_path, "full"))[3]
    assert row["lost_external"]["cause"] == "server_empty"
    assert row["cause"] == cause


def test_may_have_run() -> None:
    def rec(error: Any, status: Any) -> dict[str, Any]:
        return {"error": error, "response": None if status is None else {"status": status}}

    assert not may_have_run(rec("upstream_unreachable", None))
    assert not may_have_run(rec("timeout", None))
    assert not may_have_run(rec(None, 404))
    assert not may_have_run(rec(None, 429))
    assert not may_have_run(rec(None, 503))
    assert may_have_run(rec("client_disconnected", None))
    assert may_have_run(rec("upstream_reset", 200))
    assert may_have_run(rec("body_too_large", 200))
    assert may_have_run(rec(None, 500))
    assert may_have_run(rec(None, 200))  # a 2xx that could not be read
    assert may_have_run(rec(["odd"], None))  # a damaged record: assume it may have


# -- tools the chat template drops ------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "mixed"])
def test_tools_the_template_drops_are_not_counted(tmp_path: Path, mode: str) -> None:
    """Real: SmolLM2's template ignored two tools of 100 tokens (a 37-token prompt).
    Counted anyway, they made a rewritten turn look like a server rollback and every
    turn look like a cut prompt."""
    rep = analyse(sc.template_drops_tools(), tmp_path, mode)
    r = rows_by_id(rep)
    for row in r.values():
        assert value(row["composition"]["tools"]) == 0
        assert row["composition"]["tools"]["source"] == "tokenizer"
        assert row["lost_external"] is None
    assert r[3]["break_cause"] == "history_rewritten" and r[3]["cause"] is None
    assert _kinds(rep) == []
    assert rep["composition"]["tools"] == 0
    # The tools are still reported as offered, with their schema size.
    assert {t["name"] for t in rep["tools"]} == {"read_file", "write_file", "run", "search"}
    assert all(t["schema_tokens"] > 0 for t in rep["tools"])


def test_rendered_tools_are_kept(tmp_path: Path) -> None:
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer(), ua="OpenAI/Python 3.57.0", model="smol")
    a.turn(sc.text("first", 400), sc.text("answer", 400))
    a.turn(sc.text("second", 400), sc.text("answer 2", 400))
    rep = analyse(sc.tokenized(tr), tmp_path, "full")
    for row in rep["rows"]:
        assert value(row["composition"]["tools"]) > 200
        assert row["composition"]["tools"]["source"] == "tokenizer"


def test_estimates_drop_the_tools_only_on_a_wide_gap(tmp_path: Path) -> None:
    """Without tokenizer counts the rule needs a wide gap: the server's prompt matches
    the messages' estimate and falls far short of messages and tools together."""
    tr = sc.template_drops_tools()
    for rec in tr.records:
        rec["tokens"] = None
    rep = analyse(tr, tmp_path, "full")
    turns = [r for r in rep["rows"] if r["kind"] == "turn"]
    assert all(value(row["composition"]["tools"]) == 0 for row in turns)
    assert not any(r["lost_external"] for r in turns)  # no server loss made up by the tools
    # Where the template renders the tools, the same estimates keep them.
    rendered = analyse(sc.changed_tools(), tmp_path, "digest")
    assert all(value(r["composition"]["tools"]) > 200 for r in rendered["rows"])
