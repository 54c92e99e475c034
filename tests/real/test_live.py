"""The live view in front of the real llama-server, driven by the real openai client.

One slot (``-np 1``), the host-memory prompt cache off, so that a side-call
evicts the conversation's cache for real. Through one mitmdump with the live
view on (its thresholds at 1 token, so every loss warns), the events file
and the CSV:

1. turns 1-3 of a conversation, streamed;
2. a title side-call with another system prompt (it takes the slot);
3. turn 4: the server lost the conversation's cache to the side-call;
4. turn 5: the client changed its system prompt (a clock), so the prefix broke.

Every line, warning and event must say what `llmp analyze` says of the same
recording. Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``; skipped
without them.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmp.live.contract import SUMMARY_TAG, TURN_TAG
from llmp.live.eventfiles import csv_cell
from llmp.live.events import request_line
from tests.support.live_checks import analyze, check_event, value
from tests.support.mitm import Mitmdump, read_records
from tests.support.real import LlamaServer, real_server_marks

openai = pytest.importorskip("openai")

pytestmark = real_server_marks()

MARK = "MARKER-real-live-4Kd"  # in every message; must appear in no live output
SYSTEM = f"You are a terse assistant ({MARK}). Answer in one short sentence."
TITLE = f"Write a five-word title for this conversation ({MARK})."
QUESTIONS = [f"{q} ({MARK})" for q in ("Capital of France?", "Of Italy?", "Of Spain?")]
MORE = [f"{q} ({MARK})" for q in ("Of Portugal?", "Of Greece?")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama-live")
    with LlamaServer(ctx=2048, log_path=tmp / "llama-server.log") as server:
        yield server


def _turn(client: Any, messages: list[dict[str, Any]], **extra: Any) -> str:
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=8,
        temperature=0,
        **extra,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_live_view_agrees_with_the_report_on_a_real_server(
    llama: LlamaServer, tmp_path: Path
) -> None:
    rec, events, table = tmp_path / "rec.jsonl", tmp_path / "events.txt", tmp_path / "turns.csv"
    opts = {
        "llmp_live_warn_tokens": "1",
        "llmp_events": str(events),
        "llmp_events_csv": str(table),
    }
    with Mitmdump(llama.url, rec, opts, log_path=tmp_path / "mitm.log") as md:
        md.wait_for_log("llmp: live view on")
        client = openai.OpenAI(base_url=md.url + "/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for q in QUESTIONS:  # ids 1-3
            msgs.append({"role": "user", "content": q})
            msgs.append({"role": "assistant", "content": _turn(client, msgs)})
        _turn(client, [{"role": "system", "content": TITLE}, msgs[1]])  # id 4
        msgs.append({"role": "user", "content": MORE[0]})
        msgs.append({"role": "assistant", "content": _turn(client, msgs)})  # id 5
        msgs[0] = {"role": "system", "content": SYSTEM + " Time: 12:00:01."}
        msgs.append({"role": "user", "content": MORE[1]})
        _turn(client, msgs)  # id 6
        client.close()
        md.wait_for_log("conv 1 turn 5:")
        summary = httpx.get(md.url + "/_llmp/summary", timeout=10)
        assert md.stop() == 0
        log = md.log_text()

    assert [r["id"] for r in read_records(rec)] == [1, 2, 3, 4, 5, 6]
    report = analyze(rec)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["kind"] for i in range(1, 7)] == ["turn"] * 3 + ["side_call", "turn", "turn"]
    assert rows[5]["lost_external"] is not None and rows[5]["side_calls_between"] == [4]
    assert rows[6]["break_cause"] == "system_changed" and rows[6]["lost_client"] is not None

    lines = events.read_text().splitlines()
    assert [ln.split(" ", 1)[0] for ln in lines] == [TURN_TAG] * 6 + [SUMMARY_TAG]
    turns = [json.loads(ln.split(" ", 1)[1]) for ln in lines[:-1]]
    for ev in turns:
        check_event(ev, rows[ev["id"]])
        # The line in mitmdump's log is this event's line, word for word.
        assert request_line(ev) in log, (request_line(ev), log)
    warned = {ev["id"] for ev in turns if ev["warn"]}
    assert {5, 6} <= warned
    assert len([ln for ln in log.splitlines() if "llmp: warning:" in ln]) == len(warned)
    assert "1 side-call from OpenAI/Python" in next(
        ln for ln in log.splitlines() if "conv 1 turn 4:" in ln
    )

    final = json.loads(lines[-1].split(" ", 1)[1])
    t = report["time"]
    assert final["lost_tokens"] == t["lost_tokens"] and final["lost_tokens"] > 0
    assert final["prefill_ms"] == value(t["prefill_ms"])
    assert summary.status_code == 200
    s = summary.json()
    assert s["records"] == 6 and s["warnings"] == len(warned)
    assert [e["id"] for e in s["recent"]] == [1, 2, 3, 4, 5, 6]
    with table.open(newline="") as fh:
        table_rows = list(csv.DictReader(fh))
    assert [r["cause"] for r in table_rows] == [csv_cell(ev["cause"]) for ev in turns]
    for text in (summary.text, events.read_text(), table.read_text(), log):
        assert MARK not in text
