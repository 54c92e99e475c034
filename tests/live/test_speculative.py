"""Speculative decoding in the live view: the turn's draft counts on its line and event.

The unit tests feed the live view records whose `timings` carry llama-server's
`draft_n` / `draft_n_accepted`; the end-to-end test records the fake
llama-server in its `draft` mode through the real mitmdump, with the live
view's event file on, and checks the lines, the events and `llmp analyze`
against the recorded counters.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from llmp.demo.fakes.model import draft_counts
from llmp.live.contract import TURN_FIELDS, TURN_TAG, LiveConfig
from llmp.live.events import request_line
from llmp.live.view import LiveView
from tests.support import scenarios as sc
from tests.support.live_checks import analyze, chat
from tests.support.mitm import Mitmdump, read_records
from tests.support.upstreams import Upstream


def drafted(skip: int = 2) -> sc.Traffic:
    """A conversation whose responses carry draft counts, except record `skip`."""
    tr = sc.Traffic()
    sc.work(sc.Agent(tr, sc.LlamaServer()), 4)
    for rec in tr.records:
        if rec["id"] != skip:
            rec["response"]["body"]["timings"].update(
                draft_n=10 * rec["id"], draft_n_accepted=7 * rec["id"]
            )
    return tr


def test_the_turn_event_and_line_carry_the_draft(tmp_path: Path) -> None:
    table = tmp_path / "turns.csv"
    view = LiveView(LiveConfig(events_csv=str(table)), say=lambda level, line: None)
    for line in drafted().lines("digest", "end"):
        view.on_record(orjson.loads(line))
    view.close()
    events = {ev["id"]: ev for ev in view.ring}
    assert list(events) == [1, 2, 3, 4]
    # Additive, after every field before them (later additions come after them in turn).
    at = TURN_FIELDS.index("draft_n")
    assert list(TURN_FIELDS[at : at + 2]) == ["draft_n", "draft_n_accepted"]
    assert at > TURN_FIELDS.index("warn")
    for rid, ev in events.items():
        assert list(ev) == list(TURN_FIELDS)
        text = request_line(ev)
        if rid == 2:
            assert (ev["draft_n"], ev["draft_n_accepted"]) == (None, None)
            assert "draft" not in text
        else:
            assert (ev["draft_n"], ev["draft_n_accepted"]) == (10 * rid, 7 * rid)
            assert f", draft 70% accepted ({7 * rid:,} of {10 * rid:,})" in text
    with table.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == TURN_FIELDS
        cells = {int(r["id"]): (r["draft_n"], r["draft_n_accepted"]) for r in reader}
    assert cells == {1: ("10", "7"), 2: ("", ""), 3: ("30", "21"), 4: ("40", "28")}


def test_a_draft_of_nothing_adds_nothing_to_the_line() -> None:
    ev = {"kind": "stateless", "client": "c", "prompt_tokens": 3, "prefill_ms": 4.0,
          "draft_n": 0, "draft_n_accepted": 0}  # fmt: skip
    assert request_line(ev) == "llmp: c stateless request: 3 prompt tokens, prefill 4 ms"


# -- end to end: the fake llama-server's draft mode through the real mitmdump -----

UA = "opencode/1.0.0"


@pytest.mark.e2e
def test_fake_llama_draft_mode_through_the_proxy(tmp_path: Path) -> None:
    rec, events = tmp_path / "rec.jsonl", tmp_path / "events.txt"
    with Upstream("llama") as llama, Mitmdump(llama.url, rec, {"llmp_events": str(events)}) as md:
        md.wait_for_log("llmp: live view on")
        with httpx.Client(base_url=md.url, headers={"user-agent": UA}, timeout=20) as client:
            msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " * 20}]
            for i in range(3):
                msgs.append({"role": "user", "content": f"question {i}: " + "why? " * 30})
                msgs.append(chat(client, msgs, fake="draft=60", stream=i % 2 == 1))
            md.wait_for_log("conv 1 turn 3:")
        assert md.stop() == 0
        log = md.log_text()

    records = read_records(rec)
    assert len(records) == 3
    timings = [r["response"]["digest"]["usage"]["timings"] for r in records]
    for t in timings:  # the recording keeps the counters verbatim
        assert (t["draft_n"], t["draft_n_accepted"]) == draft_counts(t["predicted_n"], 0.6)
    report = analyze(rec)
    [spec] = report["speculative"]
    drafted = sum(t["draft_n"] for t in timings)
    accepted = sum(t["draft_n_accepted"] for t in timings)
    assert (spec["rows"], spec["draft_n"], spec["draft_n_accepted"]) == (3, drafted, accepted)
    assert spec["acceptance"] == round(accepted / drafted, 4)
    assert spec["model"] == records[0]["response"]["digest"]["usage"]["model"]

    turns = [
        json.loads(line.split(" ", 1)[1])
        for line in events.read_text().splitlines()
        if line.startswith(TURN_TAG + " ")
    ]
    by_id = {r["id"]: t for r, t in zip(records, timings, strict=True)}
    assert [ev["id"] for ev in turns] == [1, 2, 3]
    for ev in turns:
        t = by_id[ev["id"]]
        assert (ev["draft_n"], ev["draft_n_accepted"]) == (t["draft_n"], t["draft_n_accepted"])
        pct = t["draft_n_accepted"] / t["draft_n"]
        words = f"draft {pct:.0%} accepted ({t['draft_n_accepted']:,} of {t['draft_n']:,})"
        assert f"turn {ev['turn']}: " in log and words in log
