"""The engine fed one record at a time, as the recorder's live view will feed it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from llmp.analysis import Config, Engine
from llmp.analysis.loss import Between
from llmp.analysis.rows import Row
from llmp.format.lines import parse_line
from tests.support import scenarios as sc
from tests.support.scenarios import analyse


def records(traffic: sc.Traffic) -> list[dict[str, Any]]:
    out = []
    for line in traffic.lines("digest", "id"):
        rec = parse_line(line)
        assert rec is not None
        out.append(rec)
    return out


def test_rows_come_out_one_record_at_a_time(tmp_path: Path) -> None:
    tr = sc.title_side_call()
    seen: list[tuple[Row, Between | None]] = []
    engine = Engine(spill=False)
    for rec in records(tr):
        fed = engine.feed(1, rec)  # the row exists as soon as its record
        assert fed is not None and fed.row.id == rec["id"] and fed.exchange.id == rec["id"]
        seen.append((fed.row, fed.between))
    batch = analyse(tr, tmp_path)
    labels = engine.clients.label
    assert [row.as_json(labels(row.client)) for row, _ in seen] == batch["rows"]
    # What ran in between, as the live view's warning will name it.
    row, btw = seen[4]
    assert row.cause == "side_call" and btw is not None
    assert [(e.id, e.kind, e.shape, labels(e.client)) for e in btw.entries] == [
        (4, "side_call", "oneshot", "opencode/1.0.0")
    ]
    # Totals and findings are available without any rows kept.
    header = engine.header(None)
    assert header["findings"][0]["kind"] == "side_call_on_conversation_model"
    assert header["coverage"]["analysed"] == 6


def test_header_tolerates_no_reader_stats() -> None:
    engine = Engine(spill=False)
    header = engine.header(None)
    assert header["coverage"]["bad_lines"] == 0 and header["window"] is None


def test_records_fed_out_of_order_do_not_break_the_engine() -> None:
    tr = sc.two_harnesses()
    recs = records(tr)
    recs[2], recs[3] = recs[3], recs[2]
    engine = Engine(spill=False)
    rows = [engine.feed(1, r) for r in recs]
    assert all(r is not None for r in rows)
    assert engine.totals.turns == 6


def test_memory_is_bounded_by_live_conversations() -> None:
    # Many short conversations one after another: the engine keeps at most
    # `max_conversations` of them, whatever the length of the recording.
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    for i in range(40):
        a = sc.Agent(tr, srv, system=f"Agent {i}. " * 20, tools=None)
        sc.work(a, 2, seed=f"c{i}")
    engine = Engine(Config(max_conversations=8), spill=False)
    for rec in records(tr):
        engine.feed(1, rec)
    session = engine.session
    assert session is not None
    assert len(session.lru) == 8
    assert sum(len(g) for g in session.by_key.values()) == 8
    assert sum(len(b) for b in session.by_first.values()) == 8
    assert engine.totals.conversations == 40


def test_spilled_rows_keep_the_final_client_label(tmp_path: Path) -> None:
    # The second tool family appears only later: earlier rows are relabelled.
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    ua = "OpenAI/Python 1.99.0"
    a = sc.Agent(tr, srv, ua=ua, tools=sc.CODING_TOOLS[:2])
    sc.work(a, 2)
    b = sc.Agent(
        tr,
        srv,
        ua=ua,
        system="Other harness. " * 30,
        tools=[sc.tool("browse", "Open.", url="string")],
    )
    sc.work(b, 1, seed="b")
    rep = analyse(tr, tmp_path)
    assert [r["client"] for r in rep["rows"]] == [f"{ua} #1", f"{ua} #1", f"{ua} #2"]
    raw = orjson.dumps(rep["rows"])
    assert b'"client":0' not in raw
