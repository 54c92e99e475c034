"""Each scenario has one known cause; the report must name it, and size it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from llmp.analysis.config import Config
from tests.support import scenarios as sc
from tests.support.scenarios import analyse, rows_by_id, value


def kinds(report: dict[str, Any]) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def finding(report: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert len(found) == 1, report["findings"]
    return found[0]


def lost_ms(row: dict[str, Any], key: str) -> float:
    c = row["counts"]
    return row[key]["tokens"] * value(c["prefill_ms"]) / value(c["evaluated_tokens"])


def check_totals(report: dict[str, Any]) -> None:
    """Every number outside rows is a sum over rows."""
    rows = report["rows"]
    t = report["time"]
    prefill = [value(r["counts"]["prefill_ms"]) for r in rows if r["counts"]["prefill_ms"]]
    assert value(t["prefill_ms"]) == pytest.approx(sum(prefill), abs=0.01)
    losses = [r[k] for r in rows for k in ("lost_client", "lost_external") if r[k]]
    assert t["lost_tokens"] == sum(x["tokens"] for x in losses)
    assert value(t["lost_ms"]) == pytest.approx(
        sum(value(x["ms"]) for x in losses if x["ms"]), abs=0.01
    )
    for cause, c in t["by_cause"].items():
        mine = [x for x in losses if x["cause"] == cause]
        assert c["rows"] == len(mine)
        assert c["tokens"] == sum(x["tokens"] for x in mine)
    for part in ("system", "tools", "history", "new_content"):
        assert report["composition"][part] == sum(r["composition"][part]["value"] for r in rows)
    cov = report["coverage"]
    turns = [r for r in rows if r["kind"] == "turn"]
    assert cov["analysed"] == len(rows)
    assert cov["turns"] == len(turns)
    assert cov["conversations"] == len({r["conversation"] for r in turns})
    assert cov["turns_with_reuse"] == sum(
        1
        for r in turns
        if r["counts"]["reused_tokens"]
        and "server"
        in (
            r["counts"]["reused_tokens"]["source"],
            (r["counts"]["evaluated_tokens"] or {}).get("source"),
        )
    )
    assert cov["turns_with_timing"] == sum(1 for r in turns if r["counts"]["prefill_ms"])
    assert sum(c["requests"] for c in report["clients"]) == len(rows)


def one_conversation(report: dict[str, Any]) -> None:
    turns = [r for r in report["rows"] if r["kind"] == "turn"]
    assert {r["conversation"] for r in turns} == {1}
    assert [r["turn"] for r in turns] == list(range(1, len(turns) + 1))
    assert [r["linked_to"] for r in turns] == [None] + [r["id"] for r in turns[:-1]]


@pytest.fixture(params=["digest", "full"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_clean_multi_turn_chat(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.clean_chat(), tmp_path, mode)
    one_conversation(rep)
    for r in rep["rows"]:
        assert r["kind"] == "turn" and r["cause"] is None and r["break_cause"] is None
        assert r["lost_client"] is None and r["lost_external"] is None
        assert r["loss_measured"] is True
    rows = rep["rows"]
    # The server reused exactly the previous prompt, as predicted.
    for prev, row in itertools.pairwise(rows):
        assert value(row["counts"]["reused_tokens"]) == value(prev["counts"]["prompt_tokens"])
        assert row["predicted_reuse"] == row["observed_reuse"]
        assert row["composition"]["history"]["value"] > 0
    assert rows[0]["predicted_reuse"] == 0.0 and rows[0]["prefix_tokens"] is None
    assert rep["findings"] == []
    assert rep["time"]["lost_tokens"] == 0
    assert rep["time"]["lost_ms"] == {"value": 0, "source": "server"}
    assert rep["time"]["by_cause"] == {}
    check_totals(rep)


def test_changed_system_prompt(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.changed_system(), tmp_path, mode)
    one_conversation(rep)
    r = rows_by_id(rep)
    assert r[4]["break_cause"] == "system_changed"
    # R31: the break begins where the date was appended, near the end of the one system
    # message (its chunks place it within one, format.chunks), not at the message's start.
    system = r[4]["composition"]["system"]["value"]
    assert 0 < system - r[4]["prefix_tokens"] <= 0.25 * system
    kept = r[4]["changed"][0]["kept_chars"]
    assert len(sc.SYSTEM) - 4 * 64 <= kept <= len(sc.SYSTEM)  # at or before the change
    # In tokens P is the kept characters' share of an estimate: exact up to its margin.
    assert 0 < r[4]["predicted_reuse"] <= 1.1 * r[4]["observed_reuse"]
    assert r[4]["cause"] == "structural"
    assert r[4]["lost_external"] is None
    lc = r[4]["lost_client"]
    # Everything after the system prompt that turn 3 had was re-processed:
    # turn 3's prompt minus its system block (~350 tokens), within the estimate.
    expected = value(r[3]["counts"]["prompt_tokens"]) - value(r[4]["counts"]["reused_tokens"])
    assert lc["cause"] == "system_changed"
    assert abs(lc["tokens"] - expected) < 0.05 * expected
    assert value(lc["ms"]) == pytest.approx(lost_ms(r[4], "lost_client"), rel=1e-3)
    assert r[5]["break_cause"] is None and r[5]["cause"] is None
    f = finding(rep, "prefix_break")
    assert f["client"] == "opencode/1.0.0" and f["rows"] == [4]
    ev = dict(f["evidence"])
    tip = ev.pop("advice")
    changed = ev.pop("changed")
    assert ev == {"break_cause": "system_changed", "links": 4, "broken": 1, "share": 0.25}
    # The date was appended at the end of the one system message: its last 256 characters.
    assert changed[0]["index"] == 0 and changed[0]["role"] == "system"
    assert changed[0]["within"] == "last_256" and changed[0]["rows"] == 1
    assert "near its end" in tip["text"] and "latest user message" in tip["text"]
    assert "already comes after the stable instructions" in tip["text"]
    assert "move that part after the stable instructions" not in tip["text"]
    if mode == "full":  # the text itself, only in full mode
        assert changed[0]["offset"] == len(sc.SYSTEM) and "2026-08-21" in changed[0]["context"]
        assert tip["confidence"] == "high"
    else:
        assert "offset" not in changed[0] and tip["confidence"] == "medium"
    assert r[4]["changed"][0]["within"] == "last_256"
    assert f["lost_tokens"] == lc["tokens"]
    assert rep["time"]["by_cause"]["system_changed"]["rows"] == 1
    check_totals(rep)


def test_changed_tools(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.changed_tools(), tmp_path, mode)
    one_conversation(rep)
    r = rows_by_id(rep)
    assert r[4]["break_cause"] == "tools_changed"
    assert r[4]["prefix_tokens"] == r[4]["composition"]["system"]["value"]
    assert r[4]["cause"] == "structural"
    # The history after the tools is lost; the system prompt before them is not.
    expected = value(r[3]["counts"]["prompt_tokens"]) - value(r[3]["counts"]["prompt_tokens"]) // 2
    assert r[4]["lost_client"]["tokens"] > 300
    assert r[4]["lost_client"]["tokens"] < expected + 200
    assert finding(rep, "prefix_break")["evidence"]["break_cause"] == "tools_changed"
    check_totals(rep)


def test_rewritten_history(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.rewritten_history(), tmp_path, mode)
    one_conversation(rep)
    r = rows_by_id(rep)
    assert r[5]["break_cause"] == "history_rewritten"
    assert r[5]["compaction"] is False
    assert r[5]["cause"] == "structural"
    # The server reused what the prefix predicted, and no more.
    assert r[5]["observed_reuse"] == pytest.approx(r[5]["predicted_reuse"], abs=0.01)
    assert r[5]["lost_client"]["tokens"] > 300
    assert r[5]["lost_external"] is None
    assert finding(rep, "prefix_break")["evidence"]["break_cause"] == "history_rewritten"
    check_totals(rep)


def test_compaction(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.compaction(), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[7]["kind"] == "side_call" and r[7]["side_call_shape"] == "summarise"
    assert r[7]["conversation"] is None and r[7]["linked_to"] is None
    # The compacted turn stays in its conversation, charged nothing.
    assert r[8]["conversation"] == 1 and r[8]["linked_to"] == 6
    assert r[8]["compaction"] is True and r[8]["new_conversation"] is False
    assert r[8]["break_cause"] == "history_rewritten"
    assert r[8]["lost_client"] is None
    assert r[8]["composition"]["history"]["value"] == 0
    # What it could still reuse (system and tools) the summary call evicted.
    assert (
        r[8]["prefix_tokens"]
        == r[8]["composition"]["system"]["value"] + r[8]["composition"]["tools"]["value"]
    )
    assert r[8]["lost_external"]["cause"] == "side_call"
    assert r[8]["side_calls_between"] == [7]
    assert r[9]["linked_to"] == 8 and r[9]["cause"] is None
    assert "prefix_break" not in kinds(rep)
    check_totals(rep)


def test_title_side_call_evicts(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.title_side_call(), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[4]["kind"] == "side_call" and r[4]["side_call_shape"] == "oneshot"
    assert r[4]["client"] == "opencode/1.0.0"
    assert r[5]["linked_to"] == 3 and r[5]["side_calls_between"] == [4]
    assert r[5]["other_conversations_between"] == [] and r[5]["other_domains_between"] == []
    assert r[5]["cause"] == "side_call"
    ext = r[5]["lost_external"]
    assert ext["cause"] == "side_call"
    # Predicted: turn 3's whole prompt; observed: the template head.
    assert ext["tokens"] == value(r[3]["counts"]["prompt_tokens"]) - value(
        r[5]["counts"]["reused_tokens"]
    )
    assert ext["ms"]["source"] == "server"
    assert value(ext["ms"]) == pytest.approx(lost_ms(r[5], "lost_external"), rel=1e-3)
    f = finding(rep, "side_call_on_conversation_model")
    assert f["model"] == sc.LLAMA_MODEL and f["client"] is None
    assert f["rows"] == [5] and f["confidence"] == "high"
    assert f["evidence"] == {
        "shapes": {"oneshot": 1},
        "side_calls": 1,
        "turns_after_side_calls": 1,
        "clients": ["opencode/1.0.0"],
    }
    assert f["lost_tokens"] == ext["tokens"] and f["untimed_rows"] == []
    assert rep["time"]["by_cause"]["side_call"]["tokens"] == ext["tokens"]
    check_totals(rep)


def test_structured_side_call(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.structured_side_call(), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[4]["kind"] == "side_call" and r[4]["side_call_shape"] == "structured"
    assert r[5]["cause"] == "side_call"
    assert finding(rep, "side_call_on_conversation_model")["evidence"]["shapes"] == {
        "structured": 1
    }
    check_totals(rep)


def test_weak_model_side_call_on_the_same_server(tmp_path: Path, mode: str) -> None:
    # R20: llama-server answers both models with its model file, so the weak
    # model's commit message is a side-call on the conversation's model.
    rep = analyse(sc.weak_model_side_call(), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[2]["kind"] == "side_call" and r[2]["model"] == "smol-weak"
    assert r[3]["model"] == "smol" and r[3]["linked_to"] == 1
    assert r[3]["cause"] == "side_call" and r[3]["other_domains_between"] == []
    assert "other_model_eviction" not in kinds(rep)
    assert finding(rep, "side_call_on_conversation_model")["evidence"]["clients"] == [
        "aider/0.86.1"
    ]


def test_two_harnesses_with_one_user_agent(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.two_harnesses(), tmp_path, mode)
    ua = "OpenAI/Python 1.99.0"
    r = rows_by_id(rep)
    assert [r[i]["client"] for i in range(1, 7)] == [f"{ua} #1", f"{ua} #2"] * 3
    assert [r[i]["conversation"] for i in range(1, 7)] == [1, 2] * 3
    assert [r[i]["linked_to"] for i in range(1, 7)] == [None, None, 1, 2, 3, 4]
    for i in (3, 4, 5, 6):
        assert r[i]["cause"] == "other_conversation"
        assert r[i]["other_conversations_between"] == [i - 1]
    assert [c["client"] for c in rep["clients"]] == [f"{ua} #1", f"{ua} #2"]
    assert all(c["user_agent"] == ua and c["conversations"] == 1 for c in rep["clients"])
    assert rep["clients"][0]["tools"] == ["read_file", "write_file"]
    f = finding(rep, "other_conversation_eviction")
    assert f["rows"] == [3, 4, 5, 6]
    assert f["evidence"] == {"other_conversations": 2, "clients": [f"{ua} #1", f"{ua} #2"]}
    check_totals(rep)


def test_subagent_stays_with_its_parent(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.subagent(), tmp_path, mode)
    r = rows_by_id(rep)
    assert {row["client"] for row in rep["rows"]} == {"opencode/1.0.0"}
    assert len(rep["clients"]) == 1 and rep["clients"][0]["conversations"] == 2
    assert [r[i]["conversation"] for i in range(1, 8)] == [1, 1, 2, 2, 2, 1, 1]
    assert r[3]["linked_to"] is None and r[3]["new_conversation"] is False
    assert r[6]["linked_to"] == 2 and r[6]["other_conversations_between"] == [3, 4, 5]
    assert r[6]["cause"] == "other_conversation"
    assert r[7]["cause"] is None
    assert finding(rep, "other_conversation_eviction")["evidence"]["other_conversations"] == 1
    check_totals(rep)


def test_another_model_in_between(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.other_model(), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[5]["linked_to"] == 3 and r[5]["other_domains_between"] == [4]
    assert r[5]["side_calls_between"] == [] and r[5]["other_conversations_between"] == []
    assert r[5]["cause"] == "other_model"
    assert r[5]["lost_external"]["cause"] == "other_model"
    assert value(r[5]["counts"]["load_ms"]) == pytest.approx(1500.0)
    f = finding(rep, "other_model_eviction")
    assert f["model"] == "qwen3:8b" and f["evidence"] == {"other_models": ["llama3.2:3b"]}
    check_totals(rep)


def test_server_reset(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.server_reset(), tmp_path, mode)
    one_conversation(rep)
    r = rows_by_id(rep)
    assert value(r[4]["counts"]["reused_tokens"]) == 0
    assert r[4]["cause"] == "server_reset"
    assert r[4]["lost_external"]["cause"] == "server_empty"
    assert r[4]["lost_external"]["tokens"] == value(r[3]["counts"]["prompt_tokens"])
    assert (
        r[4]["side_calls_between"],
        r[4]["other_conversations_between"],
        r[4]["other_domains_between"],
    ) == ([], [], [])
    f = finding(rep, "server_cache_loss")
    assert (
        f["evidence"] == {"kind": "server_empty", "server": "llama-server"}
        and f["confidence"] == "high"
    )
    check_totals(rep)


def test_server_keeps_only_the_head(tmp_path: Path, mode: str) -> None:
    rep = analyse(sc.head_only(), tmp_path, mode)
    r = rows_by_id(rep)
    assert value(r[5]["counts"]["reused_tokens"]) == 200
    assert r[5]["cause"] == "server_reset"
    assert r[5]["lost_external"]["cause"] == "server_head_only"
    assert r[5]["lost_external"]["tokens"] == value(r[4]["counts"]["prompt_tokens"]) - 200
    assert finding(rep, "server_cache_loss")["evidence"] == {
        "kind": "server_head_only",
        "server": "llama-server",
    }
    check_totals(rep)


def test_server_rollback_to_a_checkpoint(tmp_path: Path) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer(checkpoint=256)
    a = sc.Agent(tr, srv)
    sc.work(a, 4, size=1200)
    rep = analyse(tr, tmp_path)
    rolled = [r for r in rep["rows"] if r["lost_external"]]
    assert rolled and all(r["lost_external"]["cause"] == "server_rollback" for r in rolled)
    assert all(r["cause"] == "server_reset" for r in rolled)
    f = finding(rep, "server_cache_loss")
    assert (
        f["evidence"] == {"kind": "server_rollback", "server": "llama-server"}
        and f["confidence"] == "medium"
    )


@pytest.mark.parametrize("meaning", ["cached", "whole", "evaluated"])
def test_ollama_counters_in_each_meaning(tmp_path: Path, meaning: str) -> None:
    rep = analyse(sc.ollama_meanings(meaning), tmp_path, "mixed")
    r = rows_by_id(rep)
    assert rep["servers"][0]["api"] == "ollama_chat"
    for row in rep["rows"]:
        c = row["counts"]
        assert c["prefill_ms"]["source"] == "server" and c["load_ms"]["source"] == "server"
        assert c["completion_tokens"]["source"] == "server"
    assert value(r[4]["counts"]["load_ms"]) == pytest.approx(1500.0)
    if meaning == "cached":
        assert value(r[2]["counts"]["reused_tokens"]) == value(r[1]["counts"]["prompt_tokens"])
        assert r[2]["counts"]["reused_tokens"]["source"] == "server"
        assert r[4]["lost_external"]["cause"] == "server_empty"
        assert r[4]["loss_measured"] is True
        assert "reused_tokens" in rep["servers"][0]["fields"]
    elif meaning == "whole":
        # The whole prompt, and no cache counter: reuse is not measured.
        for row in rep["rows"]:
            assert row["counts"]["reused_tokens"] is None and row["loss_measured"] is False
            assert row["counts"]["prompt_tokens"]["source"] == "server"
            assert row["lost_external"] is None and row["cause"] is None
        assert rep["coverage"]["turns_with_reuse"] == 0
        assert rep["time"]["by_cause"] == {}
        assert "reused_tokens" not in rep["servers"][0]["fields"]
    else:
        # Only the evaluated part: reuse is derived from the estimate.
        assert r[2]["counts"]["evaluated_tokens"]["source"] == "server"
        assert r[2]["counts"]["reused_tokens"]["source"] == "estimate"
        assert r[2]["observed_reuse"] == pytest.approx(r[2]["predicted_reuse"], abs=0.03)
        assert r[2]["cause"] is None
        # After the reload everything was evaluated again: a server loss.
        assert r[4]["lost_external"]["cause"] == "server_empty"
        assert r[4]["lost_external"]["ms"]["source"] == "estimate"
    check_totals(rep)


def test_bad_lines_out_of_order_ids_and_two_sessions(tmp_path: Path) -> None:
    from llmp.analysis import analyze

    path = sc.mixed_file(tmp_path)
    result = analyze([str(path)])
    rep = result.report()
    result.close()
    assert rep["coverage"]["bad_lines"] == 3
    assert rep["coverage"]["records"] == 5
    assert [(r["session"], r["id"]) for r in rep["rows"]] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 1),
        (2, 2),
    ]
    # Conversations never link across sessions.
    assert [r["conversation"] for r in rep["rows"]] == [1, 1, 1, 2, 2]
    assert [r["linked_to"] for r in rep["rows"]] == [None, 1, 2, None, 1]
    assert result.stats.sessions == 2
    check_totals(rep)


def test_a_side_call_that_comes_first(tmp_path: Path, mode: str) -> None:
    """opencode's title call comes before the first turn: still a side-call (§5)."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    a.side_call(
        "You generate a short title for a conversation.",
        sc.text("t0 ask", 200),
        "Fix the parser",
        max_tokens=32,
    )
    sc.work(a, 3)
    rep = analyse(tr, tmp_path, mode)
    r = rows_by_id(rep)
    assert r[1]["kind"] == "side_call" and r[1]["side_call_shape"] == "oneshot"
    assert r[1]["conversation"] is None and r[1]["turn"] is None
    assert [r[i]["conversation"] for i in (2, 3, 4)] == [1, 1, 1]
    assert [r[i]["turn"] for i in (2, 3, 4)] == [1, 2, 3]
    assert rep["coverage"]["conversations"] == 1 and rep["coverage"]["turns"] == 3
    assert r[2]["linked_to"] is None and r[2]["break_cause"] is None
    check_totals(rep)
    # Without the look-ahead (--side-call-lookahead 0), as the live view sees it: a turn.
    live = rows_by_id(analyse(tr, tmp_path, mode, cfg=Config(side_call_lookahead=0)))
    assert live[1]["kind"] == "turn" and live[1]["conversation"] == 1
    # ...and the first real turn would look like a broken continuation of it.
    assert live[2]["linked_to"] == 1 and live[2]["break_cause"] == "system_changed"


def test_a_first_turn_without_tools_stays_a_turn(tmp_path: Path, mode: str) -> None:
    """A chat that starts without tools and goes on without them is a conversation."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer(), tools=None)
    a.turn(sc.text("t0 ask", 150), sc.text("t0 answer", 300))
    a.turn(sc.text("t1 ask", 150), sc.text("t1 answer", 300))
    rep = analyse(tr, tmp_path, mode)
    r = rows_by_id(rep)
    assert r[1]["kind"] == "turn" and r[1]["conversation"] == 1
    assert r[2]["linked_to"] == 1 and rep["coverage"]["conversations"] == 1


def test_a_side_call_that_works_on_the_history(tmp_path: Path, mode: str) -> None:
    """Qwen Code's memory extraction: the whole history under another system prompt,
    with a few of the conversation's tools, after every turn; a side-call, not a break."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    sc.work(a, 2)
    memory = [{"role": "system", "content": "You extract memories. " * 30}, *a.messages[1:]]
    memory.append({"role": "user", "content": "Scan the recent conversation for memories."})
    body = {"model": a.model, "messages": memory, "tools": (a.tools or [])[:2], "stream": False}
    tr.chat(a.server, a.ua, body, {"role": "assistant", "content": "Nothing to keep."})
    sc.work(a, 2, seed="u")
    rep = analyse(tr, tmp_path, mode)
    r = rows_by_id(rep)
    assert r[3]["kind"] == "side_call" and r[3]["side_call_shape"] == "summarise"
    assert r[3]["break_cause"] is None and r[3]["lost_client"] is None
    assert r[4]["conversation"] == 1 and r[4]["linked_to"] == 2
    assert r[4]["lost_external"] is not None and r[4]["lost_external"]["cause"] == "side_call"
    assert not any(f["kind"] == "prefix_break" for f in rep["findings"])
    # A subagent (its own system prompt and a subset of the tools, its own first message)
    # is still a conversation of its own.
    tr2 = sc.Traffic()
    parent = sc.Agent(tr2, sc.LlamaServer())
    sc.work(parent, 2)
    sub = sc.Agent(
        tr2, parent.server, system="You are a sub-agent. " * 30, tools=(parent.tools or [])[:2]
    )
    sc.work(sub, 1, seed="s")
    rows = rows_by_id(analyse(tr2, tmp_path, mode))
    assert rows[3]["kind"] == "turn" and rows[3]["conversation"] == 2
