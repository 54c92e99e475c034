"""The live view end to end: the real mitmdump, the fake llama-server, a scripted agent.

One scripted session (turns, a title side-call that evicts the fake's
one-slot cache and ends *after* the next turn, a changed system prompt) is
recorded with the live view on.  Its per-turn lines, warnings, summary
endpoint, event file and CSV must agree with `llmp analyze --json` on the
same recording, and none of them may hold message text.
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmp.analysis.causes import WORDS as CAUSE_WORDS
from llmp.analysis.render import duration
from llmp.live import contract as live
from llmp.live.contract import SUMMARY_TAG, TURN_FIELDS, TURN_TAG
from llmp.recorder.addon import Recorder
from tests.support.live_checks import analyze, chat, check_event, lost, value
from tests.support.mitm import Mitmdump, MitmdumpError, read_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

LLMP = Path(sys.executable).parent / "llmp"
MARK = "MARKER-q7Zt"  # in every message; must appear in no live output
UA = "aider/0.86.1"
SYSTEM = f"You are a careful coding agent ({MARK}). Read before you write. " * 30
TITLE_SYSTEM = f"Write a five-word title for this conversation ({MARK})."


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


def _ask(n: int) -> dict[str, str]:
    return {"role": "user", "content": f"step {n} ({MARK}): " + f"please change file {n}. " * 10}


def _session(client: httpx.Client, llama: Upstream) -> None:
    """Six requests: turns 1-2, a title side-call, turns 3-5 (turn 4 changes the system)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, _ask(1)]
    msgs.append(chat(client, msgs))  # id 1: turn 1
    msgs.append(_ask(2))
    msgs.append(chat(client, msgs, stream=True))  # id 2: turn 2, streamed
    seen = len(llama.log)
    title = [{"role": "system", "content": TITLE_SYSTEM}, msgs[1]]
    # id 3: the title call is slow, so id 4 ends (and is written) before it.
    slow = threading.Thread(
        target=chat, args=(client, title), kwargs={"max_tokens": 16, "fake": "prefill_ms=700"}
    )
    slow.start()
    deadline = time.monotonic() + 5
    while len(llama.log) <= seen:
        assert time.monotonic() < deadline, "the title call never reached upstream"
        time.sleep(0.005)
    time.sleep(0.05)  # the fake has planned it: its slot now holds the title prompt
    msgs.append(_ask(3))
    msgs.append(chat(client, msgs))  # id 4: turn 3, evicted by the title call
    slow.join(10)
    msgs[0] = {"role": "system", "content": SYSTEM + " Today is 2026-08-21."}
    msgs.append(_ask(4))
    msgs.append(chat(client, msgs))  # id 5: turn 4, system prompt changed
    msgs.append(_ask(5))
    msgs.append(chat(client, msgs))  # id 6: turn 5, clean


def test_live_view_agrees_with_the_report(llama: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    events = tmp_path / "events.txt"
    table = tmp_path / "turns.csv"
    opts = {
        "llmp_live_warn_tokens": "100",
        "llmp_live_warn_ms": "600000",
        "llmp_events": str(events),
        "llmp_events_csv": str(table),
    }
    llama.reset_cache()
    with Mitmdump(llama.url, rec, opts) as md:
        md.wait_for_log("llmp: live view on")
        with httpx.Client(base_url=md.url, headers={"user-agent": UA}, timeout=20) as client:
            _session(client, llama)
            md.wait_for_log("conv 1 turn 5:")
            upstream_before = len(llama.log)
            summary = client.get("/_llmp/summary")
            missing = client.get("/_llmp/nothing")
            wrong = client.post("/_llmp/summary", json={})
            time.sleep(0.2)  # anything forwarded would have reached the fake by now
            assert len(llama.log) == upstream_before
        assert md.stop() == 0
        log = md.log_text()

    assert summary.status_code == 200
    assert summary.headers["content-type"] == "application/json"
    assert missing.status_code == 404 and wrong.status_code == 405
    written = [json.loads(line)["id"] for line in rec.read_bytes().splitlines()]
    assert written.index(4) < written.index(3)  # the title call ended last: reordered live
    records = read_records(rec)
    assert [r["id"] for r in records] == [1, 2, 3, 4, 5, 6]  # the /_llmp/ requests made none
    assert all(r["request"]["path"] == "/v1/chat/completions" for r in records)

    report = analyze(rec)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["kind"] for i in range(1, 7)] == ["turn", "turn", "side_call"] + ["turn"] * 3
    assert rows[4]["cause"] == "side_call" and rows[4]["side_calls_between"] == [3]
    assert rows[5]["cause"] == "structural" and rows[5]["break_cause"] == "system_changed"
    assert rows[6]["cause"] is None

    # One line per analysed request, with the report's numbers.
    for row in report["rows"]:
        c = row["counts"]
        prompt = f"{value(c['prompt_tokens']):,} prompt tokens"
        prefill = f"prefill {duration(value(c['prefill_ms']))}"
        if row["kind"] == "turn":
            head = f"{UA} conv {row['conversation']} turn {row['turn']}: "
            expect = f"{head}{prompt}, {row['observed_reuse']:.0%} reused, {prefill}"
        else:
            expect = f"{UA} side-call, one-off (title, commit message): {prompt}, {prefill}"
        assert expect in log, (expect, log)
    # Warnings for exactly the two turns that lost their cache, worded as the report words it.
    warnings = [line for line in log.splitlines() if "llmp: warning:" in line]
    assert len(warnings) == 2, warnings
    evicted, changed = warnings
    assert f"{UA} conv 1 turn 3:" in evicted
    assert f"lost {lost(rows[4]):,} tokens" in evicted
    words = CAUSE_WORDS[rows[4]["lost_external"]["cause"]]
    assert f"{words}; 1 side-call from {UA} ran in between" in evicted
    assert f"{UA} conv 1 turn 4:" in changed
    assert f"lost {lost(rows[5]):,} tokens" in changed
    assert CAUSE_WORDS["system_changed"] in changed
    assert "live view: 5 turns in 1 conversation, 1 side-call" in log

    # The summary endpoint: versioned, sums that agree, no text.
    body = summary.text
    assert MARK not in body and "careful coding agent" not in body
    s = summary.json()
    t = report["time"]
    assert s["v"] == 1 and s["body"] == "digest"
    assert (s["turns"], s["side_calls"], s["conversations"]) == (5, 1, 1)
    assert s["lost_tokens"] == t["lost_tokens"] and s["prefill_ms"] == value(t["prefill_ms"])
    assert s["warnings"] == 2 and s["reorder"] == {"waiting": 0, "gave_up": 0, "late": 0}
    assert [e["id"] for e in s["recent"]] == [1, 2, 3, 4, 5, 6]
    assert s["clients"][0]["client"] == UA

    # The event file: LLMP_TURN per row in id order, then LLMP_SUMMARY.
    assert stat.S_IMODE(os.stat(events).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(table).st_mode) == 0o600
    text = events.read_text()
    assert MARK not in text and MARK not in table.read_text() and MARK not in log
    lines = text.splitlines()
    assert [ln.split(" ", 1)[0] for ln in lines] == [TURN_TAG] * 6 + [SUMMARY_TAG]
    turns = [json.loads(ln.split(" ", 1)[1]) for ln in lines[:-1]]
    final = json.loads(lines[-1].split(" ", 1)[1])
    for ev in turns:
        check_event(ev, rows[ev["id"]])
        assert ev["warn"] == (ev["id"] in (4, 5))
    assert final["lost_tokens"] == t["lost_tokens"]
    assert final["prefill_ms"] == value(t["prefill_ms"])
    assert final["lost_ms"] == value(t["lost_ms"])
    assert {k: (v["tokens"], v["rows"]) for k, v in final["by_cause"].items()} == {
        k: (v["tokens"], v["rows"]) for k, v in t["by_cause"].items()
    }
    assert final["turns"] == report["coverage"]["turns"]
    assert "recent" not in final

    # The CSV: the same fields by column name, empty for null.
    with table.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == TURN_FIELDS
        table_rows = list(reader)
    assert [int(r["id"]) for r in table_rows] == [1, 2, 3, 4, 5, 6]
    for r, ev in zip(table_rows, turns, strict=True):
        assert r["cause"] == (ev["cause"] or "")
        assert r["lost_tokens"] == ("" if ev["lost_tokens"] is None else str(ev["lost_tokens"]))
        assert r["warn"] == ("true" if ev["warn"] else "false")
        assert float(r["prefill_ms"]) == ev["prefill_ms"]


def test_live_view_off(llama: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with Mitmdump(llama.url, rec, {"llmp_live": "false"}) as md:
        with httpx.Client(base_url=md.url, headers={"user-agent": UA}, timeout=20) as client:
            chat(client, [{"role": "user", "content": f"hello {MARK}"}])
            before = len(llama.log)
            off = client.get("/_llmp/summary")
            time.sleep(0.1)
            assert len(llama.log) == before
        md.stop()
        log = md.log_text()
    assert off.status_code == 404 and "live view is off" in off.json()["error"]
    assert "prompt tokens" not in log and "live view" not in log
    assert [r["id"] for r in read_records(rec)] == [1]


def test_events_need_the_live_view(llama: Upstream, tmp_path: Path) -> None:
    opts = {"llmp_live": "false", "llmp_events": str(tmp_path / "ev.txt")}
    proxy = Mitmdump(llama.url, tmp_path / "rec.jsonl", opts, timeout=20)
    with pytest.raises(MitmdumpError):
        proxy.start()
    assert "llmp_events, llmp_events_csv and llmp_live_log need the live view" in proxy.log_text()
    proxy.close()
    assert not (tmp_path / "ev.txt").exists()


def test_the_addon_in_process(tmp_path: Path) -> None:
    """Reserved paths take no id; live lines skip mitmproxy's deprecated add_log path."""
    import asyncio
    import logging

    from mitmproxy.test import taddons, tflow

    async def check() -> None:
        rec = Recorder()
        with taddons.context(rec) as tctx:
            tctx.configure(rec, llmp_file=str(tmp_path / "r.jsonl"))
            rec.running()
            legacy = tctx.master._legacy_log_events
            line = logging.LogRecord("llmp", logging.INFO, "", 0, "x", None, None)
            setattr(line, live.LINE_ATTR, True)
            other = logging.LogRecord("llmp", logging.INFO, "", 0, "y", None, None)
            assert not legacy.filter(line) and legacy.filter(other)
            for method, path, status in (
                ("GET", "/_llmp/summary?x=1", 200),
                ("POST", "/_llmp/summary", 405),
                ("GET", "/_llmp/other", 404),
            ):
                f = tflow.tflow()
                f.request.method, f.request.path = method, path
                rec.requestheaders(f)
                await rec.request(f)
                assert f.response is not None and f.response.status_code == status
                assert json.loads(f.response.content or b"")["v"] == 1
            assert rec._last_id == 0  # no ids taken, so no records
            chat = tflow.tflow()
            chat.request.path = "/v1/chat/completions"
            rec.requestheaders(chat)
            assert rec._last_id == 1 and chat.response is None
            rec.done()

    asyncio.run(check())


def test_a_refused_live_change_at_run_time_rolls_back(tmp_path: Path) -> None:
    """An event file in use: the change is refused, and the old live view runs again."""
    import asyncio

    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from llmp.format.lockfile import open_locked

    good, held = tmp_path / "good.txt", tmp_path / "held.txt"
    fd = open_locked(str(held), "test", "")

    async def check() -> None:
        rec = Recorder()
        with taddons.context(rec) as tctx:
            tctx.configure(rec, llmp_file=str(tmp_path / "r.jsonl"), llmp_events=str(good))
            rec.running()
            assert rec.writer is not None
            with pytest.raises(exceptions.OptionsError, match="in use by another recorder"):
                tctx.configure(rec, llmp_events=str(held))
            assert tctx.options.llmp_events == str(good)
            summary = await asyncio.to_thread(rec.writer.live_summary)
            assert summary is not None and json.loads(summary)["v"] == 1
            rec.done()

    try:
        asyncio.run(check())
    finally:
        os.close(fd)
    # The first view closed before the refused one tried, and the restored one closed at the end.
    tags = [line.split(" ", 1)[0] for line in good.read_text().splitlines()]
    assert tags == ["LLMP_SUMMARY", "LLMP_SUMMARY"]
    assert held.read_text() == ""


def test_an_event_file_that_cannot_be_opened_stops_the_start(
    llama: Upstream, tmp_path: Path
) -> None:
    """One line says why; the recording file this start would have made is not left behind."""
    rec = tmp_path / "rec.jsonl"
    opts = {"llmp_events": str(tmp_path / "no" / "such" / "dir" / "ev.txt")}
    proxy = Mitmdump(llama.url, rec, opts, timeout=20)
    with pytest.raises(MitmdumpError):
        proxy.start()
    log = proxy.log_text()
    proxy.close()
    lines = [ln for ln in log.splitlines() if "cannot open llmp_events" in ln]
    assert len(lines) == 1 and "No such file or directory" in lines[0]
    assert "Traceback" not in log
    assert not rec.exists()
