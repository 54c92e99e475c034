"""The live view, in process: reordering, lines, thresholds, ring, summary, event files.

Records come from the analyzer's scenario generator (tests/scenarios.py) and
are fed in END order, as the recorder's writer sees them; every verdict is
checked against `llmp analyze` on the same traffic.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis.causes import WORDS as CAUSE_WORDS
from llmp.analysis.rows import Loss, Row
from llmp.apis.base import Counts
from llmp.live.contract import TURN_FIELDS, LiveConfig, LiveError
from llmp.live.eventfiles import CsvFile, EventFile, csv_cell
from llmp.live.events import cause_text, over_threshold, request_line
from llmp.live.view import LiveView, Reorder
from llmp.recorder import options as llmp_options
from llmp.recorder import proxy
from tests.support import scenarios as sc

DOCS = Path(__file__).resolve().parents[2] / "docs" / "live.md"
MARK = "MARKER-live-9Qx"


def records(traffic: sc.Traffic, mode: str = "digest") -> list[dict[str, Any]]:
    """The traffic's records in the order the writer sees them: by end time."""
    return [orjson.loads(line) for line in traffic.lines(mode, "end")]


def run(traffic: sc.Traffic, mode: str = "digest", **cfg: Any) -> tuple[LiveView, dict[str, Any]]:
    view = LiveView(LiveConfig(**cfg), body=mode)
    for rec in records(traffic, mode):
        view.on_record(rec)
    summary = view.close()
    assert summary is not None
    return view, summary


# -- the reorder buffer ------------------------------------------------------


def rec(i: int, body_bytes: int = 0) -> dict[str, Any]:
    body = {"x": 1} if body_bytes else None
    return {"id": i, "request": {"body": body, "body_bytes": body_bytes}, "response": None}


def ids(recs: list[dict[str, Any]]) -> list[int]:
    return [r["id"] for r in recs]


def test_reorder_releases_in_id_order() -> None:
    r = Reorder()
    assert ids(r.push(rec(2))) == []
    assert ids(r.push(rec(3))) == []
    assert r.waiting == 2
    assert ids(r.push(rec(1))) == [1, 2, 3]
    assert ids(r.push(rec(4))) == [4]
    assert (r.waiting, r.gave_up, r.late) == (0, 0, 0)


def test_reorder_is_bounded_by_count() -> None:
    r = Reorder(max_records=3)
    out = [ids(r.push(rec(i))) for i in (2, 3, 4)]
    assert out == [[], [], []]
    assert ids(r.push(rec(5))) == [2, 3, 4, 5]  # four waiting: give up on 1
    assert r.gave_up == 1 and r.waiting == 0
    assert ids(r.push(rec(1))) == []  # too late: left out, not fed out of order
    assert r.late == 1
    assert ids(r.push(rec(6))) == [6]


def test_reorder_is_bounded_by_full_body_bytes() -> None:
    r = Reorder(max_records=100, max_bytes=1000)
    assert ids(r.push(rec(2, 600))) == []
    assert ids(r.push(rec(3))) == []  # digest records weigh nothing
    assert ids(r.push(rec(4, 600))) == [2, 3, 4]
    assert r.bytes == 0 and r.gave_up == 1


def test_reorder_flush_and_odd_input() -> None:
    r = Reorder()
    for i in (3, 5, 4):
        assert r.push(rec(i)) == []
    assert r.push({"id": "7"}) == [] and r.push(rec(3)) == []  # no int id; a duplicate
    assert r.late == 2
    assert ids(r.flush()) == [3, 4, 5]
    assert r.gave_up == 2 and r.next_id == 6


def test_end_order_gives_the_reports_rows(tmp_path: Path) -> None:
    """Every scenario, fed in END order, gets the report's verdict on every row."""
    for name, make in sc.SCENARIOS.items():
        traffic = make()
        (tmp_path / name).mkdir()
        report = sc.analyse(traffic, tmp_path / name)
        view, summary = run(traffic, warn_tokens=300)
        events = {e["id"]: e for e in view.ring}
        assert set(events) == {r["id"] for r in report["rows"]}, name
        for row in report["rows"]:
            ev = events[row["id"]]
            lost = [row[k]["tokens"] for k in ("lost_client", "lost_external") if row[k]]
            assert (ev["kind"], ev["conversation"], ev["turn"], ev["linked_to"]) == (
                row["kind"],
                row["conversation"],
                row["turn"],
                row["linked_to"],
            ), name
            assert ev["cause"] == row["cause"], (name, row["id"])
            assert (ev["lost_tokens"] or 0) == sum(lost), (name, row["id"])
            assert ev["break_cause"] == row["break_cause"]
            # A label is final only at the end: it may gain " #n" later.
            assert row["client"].startswith(ev["client"])
        t = report["time"]
        assert summary["lost_tokens"] == t["lost_tokens"], name
        assert summary["prefill_ms"] == sc.value(t["prefill_ms"]), name
        assert summary["lost_ms"] == sc.value(t["lost_ms"]), name
        assert {k: (v["tokens"], v["rows"]) for k, v in summary["by_cause"].items()} == {
            k: (v["tokens"], v["rows"]) for k, v in t["by_cause"].items()
        }, name
        cov = report["coverage"]
        assert (summary["turns"], summary["conversations"]) == (cov["turns"], cov["conversations"])
        assert summary["records"] == cov["records"]


def test_full_mode_agrees_with_digest_mode() -> None:
    traffic = sc.title_side_call()
    digest, _ = run(traffic, "digest")
    full, _ = run(traffic, "full")
    assert list(digest.ring) == list(full.ring)


# -- lines and thresholds ----------------------------------------------------


def event(**over: Any) -> dict[str, Any]:
    ev: dict[str, Any] = dict.fromkeys(TURN_FIELDS)
    ev.update(
        v=1,
        id=9,
        kind="turn",
        client="aider/0.86",
        conversation=2,
        turn=5,
        prompt_tokens=12304,
        reuse=0.9712,
        prefill_ms=310.2,
        lost_tokens=0,
        lost_ms=0,
        warn=False,
    )
    ev.update(over)
    return ev


def test_turn_line() -> None:
    assert (
        request_line(event())
        == "llmp: aider/0.86 conv 2 turn 5: 12,304 prompt tokens, 97% reused, prefill 310 ms"
    )


def test_lines_say_what_was_not_measured() -> None:
    ev = event(prompt_tokens=None, reuse=None, prefill_ms=None, lost_tokens=None, lost_ms=None)
    assert request_line(ev) == (
        "llmp: aider/0.86 conv 2 turn 5: prompt tokens not reported, reuse not reported, "
        "prefill not timed"
    )


def test_side_call_and_stateless_lines_are_short() -> None:
    side = event(kind="side_call", side_call_shape="summarise", prefill_ms=3100, lost_tokens=None)
    assert request_line(side) == (
        "llmp: aider/0.86 side-call, summary: 12,304 prompt tokens, prefill 3.1 s"
    )
    probe = event(kind="stateless", prompt_tokens=3, prefill_ms=4, lost_tokens=None)
    assert (
        request_line(probe) == "llmp: aider/0.86 stateless request: 3 prompt tokens, prefill 4 ms"
    )


def test_warning_line_names_the_cause() -> None:
    ev = event(
        reuse=0.03,
        prefill_ms=6200,
        lost_tokens=11900,
        lost_ms=6000,
        cause_text="system prompt changed",
        warn=True,
    )
    assert request_line(ev) == (
        "llmp: warning: aider/0.86 conv 2 turn 5: 12,304 prompt tokens, 3% reused, "
        "prefill 6.2 s; lost 11,900 tokens (6.0 s): system prompt changed"
    )


@pytest.mark.parametrize(
    ("tokens", "ms", "warn"),
    [
        (0, 0, False),
        (None, None, False),
        (2000, 2000, False),  # at the threshold: not over it
        (2001, 10, True),  # tokens alone
        (10, 2000.5, True),  # ms alone
        (5000, None, True),  # tokens, not timed
        (10, None, False),
    ],
)
def test_thresholds(tokens: int | None, ms: float | None, warn: bool) -> None:
    ev = event(lost_tokens=tokens, lost_ms=ms)
    assert over_threshold(ev, 2000, 2000) is warn


def test_side_calls_never_warn() -> None:
    assert not over_threshold(event(kind="side_call", lost_tokens=9999, lost_ms=9999), 0, 0)


def test_warnings_are_logged_at_warning_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    run(sc.title_side_call(), warn_tokens=500)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    msg = warned[0].getMessage()
    assert msg.startswith("llmp: warning: opencode/1.0.0 conv 1 turn 4: ")
    assert msg.endswith(
        f"{CAUSE_WORDS['side_call']}; 1 side-call from opencode/1.0.0 ran in between"
    )
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("conv 1 turn" in m for m in info) == 4
    assert any(m.startswith("llmp: opencode/1.0.0 side-call, one-off") for m in info)
    assert info[-1].startswith("llmp: live view: 5 turns in 1 conversation, 1 side-call;")


def test_warning_thresholds_from_the_options(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    run(sc.title_side_call(), warn_tokens=10**9, warn_ms=10**9)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    run(sc.title_side_call(), warn_tokens=10**9, warn_ms=100)  # ms alone triggers
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def _row(**over: Any) -> Row:
    base: dict[str, Any] = dict(
        id=7,
        api="openai_chat",
        model="m",
        client=0,
        t_start_ms=0,
        kind="turn",
        side_call_shape=None,
        session=1,
        conversation=1,
        turn=3,
        counts=Counts(),
        composition=((0, "estimate"),) * 4,
    )
    base.update(over)
    return Row(**base)


def test_cause_text_orders_losses_and_notes_undetermined() -> None:
    both = _row(
        cause="structural",
        lost_client=Loss("tools_changed", 900, None),
        lost_external=Loss("server_empty", 100, None),
    )
    assert cause_text(both, None, str) == (
        "tool definitions changed, and server lost its whole cache"
    )
    undetermined = _row(cause="undetermined", lost_external=Loss("server_empty", 500, None))
    assert cause_text(undetermined, None, str) == (
        "server lost its whole cache (or a failed chat request in between evicted it)"
    )
    assert cause_text(_row(), None, str) is None


def test_what_ran_in_between_names_clients_and_models(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    run(sc.two_harnesses(), warn_tokens=100)
    run(sc.other_model(), warn_tokens=100)
    text = caplog.text
    assert "1 request of other conversations from OpenAI/Python 1.99.0 #2 ran in between" in text
    assert f"{CAUSE_WORDS['other_model']}; 1 request to llama3.2:3b ran in between" in text


# -- the ring and the summary ------------------------------------------------


def test_ring_is_bounded() -> None:
    traffic = sc.Traffic()
    sc.work(sc.Agent(traffic, sc.LlamaServer()), 12)
    view = LiveView(LiveConfig(ring=4))
    for r in records(traffic):
        view.on_record(r)
    s = view.summary()
    assert s["ring"] == 4 and [e["id"] for e in s["recent"]] == [9, 10, 11, 12]
    assert s["turns"] == 12 and s["requests"] == 12  # the sums keep everything
    view.close()


def marked_traffic() -> sc.Traffic:
    traffic = sc.Traffic()
    agent = sc.Agent(traffic, sc.LlamaServer(), system=f"{MARK} system. " * 50)
    agent.turn(f"{MARK} first ask", f"{MARK} first answer")
    agent.side_call(f"{MARK} title", f"{MARK} title ask", f"{MARK} title", max_tokens=16)
    agent.tool_step(f"{MARK} read", "read_file", {"path": f"{MARK}.py"}, f"{MARK} " * 300)
    agent.turn(f"{MARK} again", f"{MARK} done")
    return traffic


@pytest.mark.parametrize("mode", ["digest", "full"])
def test_summary_holds_no_message_text(mode: str) -> None:
    view = LiveView(LiveConfig(warn_tokens=1), body=mode)
    for r in records(marked_traffic(), mode):
        view.on_record(r)
    body = view.summary_json()
    assert MARK not in body.decode() and "system." not in body.decode()
    s = json.loads(body)
    assert s["v"] == 1 and s["body"] == mode and s["warnings"] >= 1
    assert len(s["recent"]) == 4
    view.close()


def test_summary_fields_are_documented() -> None:
    view, final = run(sc.title_side_call())
    documented = doc_table("Summary fields")
    live_summary = view._summary(recent=True)
    assert list(live_summary) == documented
    assert list(final) == [f for f in documented if f not in ("ring", "recent")]


def test_summary_merges_clients_by_label() -> None:
    _, s = run(sc.two_harnesses())
    names = [c["client"] for c in s["clients"]]
    assert names == ["OpenAI/Python 1.99.0 #1", "OpenAI/Python 1.99.0 #2"]
    assert sum(c["requests"] for c in s["clients"]) == s["requests"]


def _break_on(view: LiveView, rid: int) -> None:
    """Make the engine raise on one record id, as a bug would."""
    feed = view.engine.feed

    def broken(session: int, rec: dict[str, Any]) -> Any:
        if rec["id"] == rid:
            raise RuntimeError("engine bug")
        return feed(session, rec)

    view.engine.feed = broken  # type: ignore[method-assign, assignment]


def test_a_failing_record_never_reaches_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    view = LiveView()
    _break_on(view, 1)
    view.on_record({"id": 1, "t_start_ms": 0})
    assert view.errors == 1
    for r in records(sc.clean_chat()):
        r["id"] += 1
        view.on_record(r)
    assert view.summary()["turns"] == 5  # it goes on
    assert "live view failed on record 1" in caplog.text
    view.close()


def test_a_bad_record_in_a_burst_costs_only_itself() -> None:
    recs = records(sc.clean_chat())
    recs.sort(key=lambda r: r["id"])
    view = LiveView()
    _break_on(view, 1)  # record 1 breaks the engine...
    for r in recs[1:]:
        view.on_record(r)  # ...and 2-5 wait for it
    assert view.reorder.waiting == 4
    view.on_record(recs[0])
    assert view.errors == 1 and [e["id"] for e in view.ring] == [2, 3, 4, 5]
    view.close()


# -- event files -------------------------------------------------------------


def doc_table(title: str) -> list[str]:
    """The field names of a table in docs/live.md, in order."""
    text = DOCS.read_text()
    start = text.index(f"### {title}")
    end = text.find("\n#", start + 4)
    section = text[start : end if end >= 0 else None]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_turn_fields_are_documented() -> None:
    assert doc_table("LLMP_TURN fields") == list(TURN_FIELDS)


def test_event_file_and_csv(tmp_path: Path) -> None:
    events, table = tmp_path / "ev.txt", tmp_path / "t.csv"
    view, summary = run(sc.title_side_call(), events=str(events), events_csv=str(table))
    assert stat.S_IMODE(os.stat(events).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(table).st_mode) == 0o600
    lines = events.read_bytes().splitlines()
    tags = [line.split(b" ", 1)[0] for line in lines]
    assert tags == [b"LLMP_TURN"] * 6 + [b"LLMP_SUMMARY"]
    turns = [json.loads(line.split(b" ", 1)[1]) for line in lines[:-1]]
    assert turns == list(view.ring)
    assert all(list(t) == list(TURN_FIELDS) for t in turns)
    assert json.loads(lines[-1].split(b" ", 1)[1]) == summary
    with table.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and list(rows[0]) == list(TURN_FIELDS)
    for row, ev in zip(rows, turns, strict=True):
        for name in TURN_FIELDS:
            assert row[name] == str(csv_cell(ev[name])), name
    assert rows[4]["warn"] == "true" and rows[4]["cause"] == "side_call"
    assert rows[3]["conversation"] == ""  # the side-call: null is empty


def test_event_files_append_and_check_their_header(tmp_path: Path) -> None:
    events, table = tmp_path / "ev.txt", tmp_path / "t.csv"
    events.write_bytes(b"LLMP_TURN {}")  # a partial line from elsewhere
    for _ in range(2):
        run(sc.clean_chat(), events=str(events), events_csv=str(table))
    assert events.read_bytes().startswith(b"LLMP_TURN {}\nLLMP_TURN {")
    assert events.read_bytes().count(b"LLMP_SUMMARY") == 2
    assert table.read_bytes().count(b"\nv,id,") == 0 and table.read_bytes().startswith(b"v,id,")
    assert len(table.read_bytes().splitlines()) == 1 + 10
    other = tmp_path / "other.csv"
    other.write_text("id,cause\n1,x\n")
    with pytest.raises(LiveError, match="already holds other columns"):
        CsvFile(str(other))


def test_an_event_file_in_use_is_refused(tmp_path: Path) -> None:
    first = EventFile(str(tmp_path / "ev.txt"))
    with pytest.raises(LiveError, match="in use by another recorder"):
        LiveView(LiveConfig(events=str(tmp_path / "ev.txt")))
    first.close()
    with pytest.raises(LiveError, match="cannot open llmp_events_csv"):
        LiveView(LiveConfig(events_csv=str(tmp_path / "no" / "t.csv")))


def test_abandon_writes_no_summary(tmp_path: Path) -> None:
    events = tmp_path / "ev.txt"
    view = LiveView(LiveConfig(events=str(events)))
    view.abandon()
    assert events.read_bytes() == b""


# -- options -----------------------------------------------------------------


def test_option_defaults_and_checks(tmp_path: Path) -> None:
    s = llmp_options.validate({})
    assert (s.live, s.live_warn_ms, s.live_warn_tokens, s.events, s.events_csv) == (
        True,
        2000,
        2000,
        "",
        "",
    )
    bad: list[tuple[dict[str, Any], str]] = [
        ({"llmp_live": "yes"}, "llmp_live must be true or false"),
        ({"llmp_live_warn_ms": -1}, "llmp_live_warn_ms must be a whole number"),
        ({"llmp_live_warn_tokens": True}, "llmp_live_warn_tokens must be a whole number"),
        ({"llmp_live": False, "llmp_events": "e"}, "need the live view"),
        ({"llmp_file": "a", "llmp_events_csv": "./a"}, "name the same file"),
    ]
    for values, reason in bad:
        with pytest.raises(llmp_options.OptionError, match=reason):
            llmp_options.validate(values)


def test_proxy_flags(tmp_path: Path) -> None:
    parser = _proxy_parser()
    args = parser.parse_args(
        [
            "proxy",
            "--upstream",
            "127.0.0.1:8080",
            "--out",
            str(tmp_path / "r.jsonl"),
            "--warn-ms",
            "500",
            "--warn-tokens",
            "1_000",
            "--events",
            str(tmp_path / "e.txt"),
            "--events-csv",
            str(tmp_path / "e.csv"),
        ]
    )
    opts = proxy.build_config(args).recorder_options()
    assert opts["llmp_live"] is True
    assert (opts["llmp_live_warn_ms"], opts["llmp_live_warn_tokens"]) == (500, 1000)
    assert opts["llmp_events"] == str(tmp_path / "e.txt")
    off = parser.parse_args(["proxy", "--upstream", "127.0.0.1:8080", "--no-live"])
    assert proxy.build_config(off).recorder_options()["llmp_live"] is False
    both = parser.parse_args(
        ["proxy", "--upstream", "127.0.0.1:8080", "--no-live", "--events", "x"]
    )
    with pytest.raises(
        proxy.UsageError, match="--events, --events-csv and --live-log need the live view"
    ):
        proxy.build_config(both)
    assert proxy._flagify("llmp_live_warn_ms, llmp_live, llmp_events_csv") == (
        "--warn-ms, --no-live, --events-csv"
    )


def _proxy_parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    proxy.register(parser.add_subparsers())
    return parser
