"""The report v1: every field, nulls, skips, clients, tools, findings, equivalence."""

from __future__ import annotations

import io
import random
from pathlib import Path

import orjson
import pytest

from llmp.analysis import Config, analyze
from llmp.apis.openai_chat import OpenAIChat
from tests.support import scenarios as sc
from tests.support.report_shape import check_shape
from tests.support.scenarios import analyse, rows_by_id


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_field_is_present(tmp_path: Path, name: str) -> None:
    check_shape(analyse(sc.SCENARIOS[name](), tmp_path))


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_full_digest_and_mixed_recordings_give_the_same_report(tmp_path: Path, name: str) -> None:
    tr = sc.SCENARIOS[name]()
    outs = []
    for mode in ("digest", "full", "mixed"):
        path = tr.write(tmp_path / f"{mode}.jsonl", mode)
        result = analyze([str(path)])
        buf = io.BytesIO()
        result.write_json(buf)
        result.close()
        outs.append(buf.getvalue())
    reports = [orjson.loads(out) for out in outs]
    # Only full mode can say at which character a message changed, and show it.
    for row in reports[0]["rows"]:
        for c in row["changed"] or []:
            assert c["offset"] is None and c["context"] is None and c["was"] is None
    for rep in reports[1:]:
        for row in rep["rows"]:
            for c in row["changed"] or []:
                c.update(offset=None, context=None, was=None)
    for rep in reports:  # full mode sees the text: surer advice, the change at its offset
        for f in rep["findings"]:
            for c in (
                f["evidence"].get("changed", [])
                if isinstance(f["evidence"].get("changed"), list)
                else []
            ):
                for key in ("offset", "context", "was"):
                    c.pop(key, None)
            tip = f["evidence"].get("advice")
            if tip is not None:
                tip.pop("confidence")
                tip.pop("because")
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]["coverage"]["analysed"] == len(tr.records)


def test_skipped_records_by_reason(tmp_path: Path) -> None:
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    sc.work(a, 2)
    tr.other("GET", "/v1/models")
    tr.other("GET", "/health?full=1")
    tr.other("GET", "/v1/models")
    tr.failed(a.ua, a.body(), error="client_disconnected", status=200)
    tr.failed(a.ua, a.body(), error="upstream_unreachable", status=0)
    tr.failed(a.ua, a.body(), error=None, status=400)
    sc.work(a, 1, seed="u")
    full = tr.full()
    broken = dict(full[0])
    broken["request"] = dict(broken["request"], body=None, body_text="not json {")
    tr.records.append({**broken, "id": tr.next_id, "t_start_ms": tr.t, "t_end_ms": tr.t + 1})
    rep = analyse(tr, tmp_path, "full")
    cov = rep["coverage"]
    assert cov["records"] == 10
    assert cov["analysed"] == 3
    assert cov["skipped"] == {"not_chat": 3, "error": 2, "non_2xx": 1, "unparsed": 1}
    assert cov["paths"] == {"/health": 1, "/v1/models": 2}
    # The errored chat requests ran between turns 2 and 9: nothing named, but
    # no server reset is claimed either.
    r = rows_by_id(rep)
    assert r[9]["linked_to"] == 2
    assert r[9]["cause"] in (None, "undetermined")


def test_undetermined_when_only_a_skipped_request_ran_in_between(tmp_path: Path) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv)
    sc.work(a, 2)
    tr.failed(a.ua, a.body(), error="client_disconnected", status=200)
    srv.reset()  # what the failed request did to the slot, unseen
    sc.work(a, 1, seed="u")
    rep = analyse(tr, tmp_path)
    row = rows_by_id(rep)[4]
    assert row["cause"] == "undetermined"
    assert row["lost_external"]["cause"] == "server_empty"
    # The loss is in a finding (R38), which says a failed request may have run.
    (f,) = [f for f in rep["findings"] if f["kind"] == "server_cache_loss"]
    assert f["rows"] == [4] and f["evidence"]["after_skipped"] == 1
    assert f["confidence"] == "low"


def test_empty_recording(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\n{bad\n")
    result = analyze([str(path)])
    rep = result.report()
    result.close()
    assert rep["window"] is None
    assert rep["coverage"]["records"] == 0 and rep["coverage"]["bad_lines"] == 1
    assert rep["time"] == {"prefill_ms": None, "lost_ms": None, "lost_tokens": 0, "by_cause": {}}
    assert rep["rows"] == [] and rep["findings"] == [] and rep["clients"] == []


def test_untimed_server_gives_nulls_not_zeros(tmp_path: Path) -> None:
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    a.stream = False
    sc.work(a, 3)
    for rec in tr.records:
        body = rec["response"]["body"]
        del body["timings"]
        del body["usage"]["prompt_tokens_details"]
        rec["response"]["stream"] = None
    rep = analyse(tr, tmp_path)
    assert rep["time"]["prefill_ms"] is None
    assert rep["time"]["lost_ms"] is None
    for row in rep["rows"]:
        assert row["counts"]["prefill_ms"] is None and row["counts"]["reused_tokens"] is None
        assert row["observed_reuse"] is None and row["loss_measured"] is False
    assert rep["coverage"]["turns_with_timing"] == 0 and rep["coverage"]["turns_with_reuse"] == 0
    assert rep["servers"] == [
        {
            "api": "openai_chat",
            "server": "unknown",
            "fields": ["prompt_tokens", "completion_tokens"],
        }
    ]


def test_side_calls_without_cache_counters_are_a_low_confidence_risk(tmp_path: Path) -> None:
    tr = sc.title_side_call()
    for rec in tr.records:
        body = rec["response"]["body"]
        del body["timings"]
        del body["usage"]["prompt_tokens_details"]
    rep = analyse(tr, tmp_path)
    f = next(f for f in rep["findings"] if f["kind"] == "side_call_on_conversation_model")
    assert f["confidence"] == "low"
    assert f["rows"] == [5] and f["lost_tokens"] is None and f["lost_ms"] is None
    assert f["untimed_rows"] == [5]
    assert rows_by_id(rep)[5]["cause"] is None


def test_unknown_user_agent_and_stateless_probe(tmp_path: Path) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    probe = sc.Agent(tr, srv, ua=None, tools=None, system="")
    probe.turn("ping", "pong", max_tokens=1)
    a = sc.Agent(tr, srv, ua=None)
    sc.work(a, 2)
    rep = analyse(tr, tmp_path)
    r = rows_by_id(rep)
    assert (
        r[1]["kind"] == "stateless"
        and r[1]["conversation"] is None
        and r[1]["side_call_shape"] is None
    )
    assert r[2]["kind"] == "turn" and r[2]["conversation"] == 1
    assert rep["clients"][0]["client"] == "unknown" and rep["clients"][0]["user_agent"] is None
    assert rep["coverage"]["turns"] == 2


def test_a_new_conversation_sharing_the_system_prompt(tmp_path: Path) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv)
    sc.work(a, 2)
    b = sc.Agent(tr, srv)  # the same harness, a new session: same system and tools
    sc.work(b, 2, seed="new")
    rep = analyse(tr, tmp_path)
    r = rows_by_id(rep)
    assert r[3]["new_conversation"] is True and r[3]["linked_to"] == 2
    assert r[3]["conversation"] == 2 and r[3]["turn"] == 1
    assert r[3]["break_cause"] is None and r[3]["lost_client"] is None
    assert (
        r[3]["prefix_tokens"]
        == r[3]["composition"]["system"]["value"] + r[3]["composition"]["tools"]["value"]
    )
    assert r[3]["lost_external"] is None  # the server did reuse the system prompt
    assert r[4]["linked_to"] == 3 and r[4]["new_conversation"] is False
    assert rep["coverage"]["conversations"] == 2


def test_tool_table_and_tool_findings(tmp_path: Path) -> None:
    tr = sc.Traffic()
    big = sc.tool("browser", "Drive a web browser. " * 300, url="string")
    a = sc.Agent(tr, sc.LlamaServer(), tools=[*sc.CODING_TOOLS, big])
    sc.work(a, 6)
    cfg = Config(unused_tool_min_offered=5, large_tool_tokens=1000, large_system_tokens=300)
    rep = analyse(tr, tmp_path, cfg=cfg)
    tools = {t["name"]: t for t in rep["tools"]}
    assert [t["name"] for t in rep["tools"]] == [
        "read_file",
        "write_file",
        "run",
        "search",
        "browser",
    ]
    assert tools["read_file"]["offered"] == 6 and tools["read_file"]["called"] == 3
    assert tools["browser"]["schema_tokens"] > 1000 and tools["browser"]["called"] == 0
    kinds = {(f["kind"], f["evidence"].get("tool")) for f in rep["findings"]}
    assert ("unused_tool", "browser") in kinds and ("unused_tool", "search") in kinds
    assert ("unused_tool", "read_file") not in kinds
    assert ("large_tool_schema", "browser") in kinds
    big_f = next(f for f in rep["findings"] if f["kind"] == "large_tool_schema")
    assert big_f["model"] is None and big_f["rows"] == [] and big_f["client"] == "opencode/1.0.0"
    assert big_f["context_tokens"] == tools["browser"]["schema_tokens"]
    assert big_f["confidence"] == "medium"  # estimated, not tokenized
    unused = next(
        f
        for f in rep["findings"]
        if f["kind"] == "unused_tool" and f["evidence"]["tool"] == "browser"
    )
    assert unused["evidence"]["offered"] == 6 and unused["evidence"]["sessions"] == 1
    sysf = next(f for f in rep["findings"] if f["kind"] == "large_system_prompt")
    assert sysf["rows"] == [1] and sysf["evidence"]["threshold"] == 300
    assert sysf["context_tokens"] == sysf["evidence"]["system_tokens"]
    # Context findings have no loss; they sort after nothing else here.
    assert all(f["lost_tokens"] is None for f in rep["findings"])


def test_tokenizer_counts_are_used_for_composition(tmp_path: Path) -> None:
    tr = sc.clean_chat()
    for rec in tr.records:
        d = OpenAIChat().request_digest(rec["request"]["body"])
        assert d is not None
        rec["tokens"] = {
            "messages": {m["hash"]: max(1, m["chars"] // 3) for m in d["messages"]},
            "tools": {t["hash"]: t["chars"] // 3 for t in d["tools"]},
        }
    rep = analyse(tr, tmp_path, "full")
    for row in rep["rows"]:
        assert {v["source"] for v in row["composition"].values()} == {"tokenizer"}
    est = analyse(sc.clean_chat(), tmp_path, "full")
    assert rep["composition"]["system"] > est["composition"]["system"]


def test_rows_are_written_in_order_and_conversations_are_bounded(tmp_path: Path) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer(np=4)
    agents = [sc.Agent(tr, srv, system=f"Agent {i}. " * 50) for i in range(6)]
    for step in range(3):
        for i, ag in enumerate(agents):
            sc.work(ag, 1, seed=f"{i}-{step}")
    rep = analyse(tr, tmp_path, cfg=Config(max_conversations=2))
    assert [r["id"] for r in rep["rows"]] == list(range(1, 19))
    # With only two conversations kept, the third agent's next turn finds nothing.
    assert rep["coverage"]["conversations"] > 6
    full = analyse(tr, tmp_path)
    assert full["coverage"]["conversations"] == 6


def test_exact_mode_gives_the_same_report(tmp_path: Path) -> None:
    tr = sc.two_harnesses()
    lines = tr.lines("digest", "id")
    random.Random(7).shuffle(lines)
    path = tmp_path / "shuffled.jsonl"
    path.write_bytes(b"".join(lines))
    outs = []
    for window in (None, 2):
        result = analyze([str(path)], window_lines=window)
        assert result.stats.exact == (window == 2)
        buf = io.BytesIO()
        result.write_json(buf)
        result.close()
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    ref = analyse(tr, tmp_path)
    assert orjson.loads(outs[0])["rows"] == ref["rows"]
