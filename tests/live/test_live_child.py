"""The live view in the builder child: same verdicts as in process, lines and summary relayed.

The writer builds records in a child process, and the live view runs there
too, fed each record as it is built (llmp.recorder.builder). These tests drive a real
`RecordWriter` with its real child, and check what reaches the parent: the
per-request lines (in the parent's log), the summary (over the child's
summary channel), and the event file the child writes, against a live view
fed the written recording in this process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.format import canonical
from llmp.format.canonical import record_dumps
from llmp.format.lockfile import open_locked
from llmp.live.view import LINE_ATTR, LiveConfig, LiveError, LiveView
from llmp.recorder.capture import Capture
from llmp.recorder.writer import LiveSpec, RecordingFile, RecordWriter
from tests.support import scenarios as sc


def captures(traffic: sc.Traffic) -> list[Capture]:
    """The traffic's exchanges as the addon would hand them over, in end order."""
    caps = []
    for rec in sorted(traffic.full(), key=lambda r: (r["t_end_ms"], r["id"])):
        req, resp = rec["request"], rec["response"]
        body = record_dumps(req["body"])
        reply = record_dumps(resp["body"])
        caps.append(
            Capture(
                id=rec["id"],
                conn=rec["conn"],
                t_start_ms=rec["t_start_ms"],
                method=req["method"],
                path=req["path"],
                request_headers=dict(req["headers"]),
                request_body=body,
                request_body_bytes=len(body),
                request_complete=True,
                status=resp["status"],
                response_headers={"content-type": "application/json"},
                pieces=[reply],
                response_body_bytes=len(reply),
                stored_bytes=len(reply),
                t_first_byte_ms=rec["t_first_byte_ms"],
                t_end_ms=rec["t_end_ms"],
            )
        )
    return caps


def live_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, LINE_ATTR, False)]


def in_process(
    path: Path, cfg: LiveConfig, mode: str = "digest"
) -> tuple[list[str], list[dict[str, Any]]]:
    """The lines and events of a live view fed the recording here, as `llmp analyze` reads it."""
    lines: list[str] = []
    cfg = dataclasses.replace(cfg, events="", events_csv="")
    view = LiveView(cfg, body=mode, say=lambda level, line: lines.append(line))
    for raw in path.read_bytes().splitlines():
        view.on_record(canonical.loads(raw) if mode == "full" else orjson.loads(raw))
    view.close()
    return lines, list(view.ring)


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        tag, _, text = line.partition(" ")
        if tag == "LLMP_TURN":
            out.append(json.loads(text))
    return out


@pytest.mark.parametrize("mode", ["digest", "full"])
def test_the_child_runs_the_live_view(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    rec, ev_file = tmp_path / "rec.jsonl", tmp_path / "events.txt"
    cfg = LiveConfig(warn_tokens=1, events=str(ev_file))
    writer = RecordWriter(RecordingFile(str(rec)), mode)
    assert writer._builder is not None
    writer.set_live(LiveSpec(cfg, first_id=1))
    # The child holds the event file; this process does not even have it open.
    mine = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    assert str(ev_file.resolve()) not in mine
    caps = captures(sc.changed_system())
    for cap in caps:
        writer.submit(cap)
    summary = None
    for _ in range(500):
        data = writer.live_summary()
        summary = json.loads(data) if data else None
        if summary is not None and summary["records"] == len(caps):
            break
        time.sleep(0.01)
    assert summary is not None and summary["records"] == len(caps)
    assert summary["warnings"] >= 1 and summary["lost_tokens"] > 0
    writer.close()

    assert summary["body"] == mode
    want_lines, want_events = in_process(rec, cfg, mode)
    got = live_lines(caplog)
    assert got == want_lines and any("llmp: warning:" in line for line in got)
    assert [r.levelno for r in caplog.records if getattr(r, LINE_ATTR, False)] == [
        logging.WARNING if "warning:" in line else logging.INFO for line in got
    ]
    assert events(ev_file) == want_events
    assert summary["recent"] == want_events
    assert ev_file.read_text().splitlines()[-1].startswith("LLMP_SUMMARY ")
    assert "llmp: live view:" in caplog.text  # the summary line at shutdown, relayed


def test_held_lines_wait_for_the_relay(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With `hold_logs` (the addon's setting), lines are logged when the loop asks."""
    caplog.set_level(logging.INFO, logger="llmp")
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest")
    writer.hold_logs = True
    writer.set_live(LiveSpec(LiveConfig(), first_id=1))
    caps = captures(sc.clean_chat())
    for cap in caps:
        writer.submit(cap)
    for _ in range(500):  # a record counts as written once its answer, logs included, is in
        if writer.written == len(caps):
            break
        time.sleep(0.01)
    assert writer.written == len(caps) and live_lines(caplog) == []
    writer.relay_logs()
    assert len(live_lines(caplog)) == len(caps)
    writer.close()  # the shutdown's lines are relayed by close itself
    assert "llmp: live view:" in caplog.text


def test_a_dead_child_hands_the_live_view_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    ev_file = tmp_path / "events.txt"
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest")
    writer.set_live(LiveSpec(LiveConfig(events=str(ev_file)), first_id=1))
    caps = captures(sc.clean_chat())
    half = len(caps) // 2
    for cap in caps[:half]:
        writer.submit(cap)
    while writer.written < half:
        time.sleep(0.01)
    builder = writer._builder
    assert builder is not None
    builder.proc.kill()
    builder.proc.wait()
    for cap in caps[half:]:
        writer.submit(cap)
    writer.close()
    assert writer._builder is None
    assert "live view restarted in the proxy's process" in caplog.text
    # Every request got its line: the first half from the child, the rest from here.
    assert len(live_lines(caplog)) == len(caps)
    assert [e["id"] for e in events(ev_file)] == [c.id for c in caps]


def test_an_event_file_in_use_is_a_live_error(tmp_path: Path) -> None:
    ev_file = tmp_path / "events.txt"
    fd = open_locked(str(ev_file), "test", "")
    try:
        writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest")
        with pytest.raises(LiveError, match="in use by another recorder"):
            writer.set_live(LiveSpec(LiveConfig(events=str(ev_file)), first_id=1))
        assert writer.live_summary() is None  # no live view runs
        writer.submit(captures(sc.clean_chat())[0])
        writer.close()
        assert writer.written == 1
    finally:
        os.close(fd)


def test_changing_the_thresholds_keeps_the_event_file(tmp_path: Path) -> None:
    """A new live view on the same event file: the old one closes first (it holds the lock)."""
    ev_file = tmp_path / "events.txt"
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest")
    writer.set_live(LiveSpec(LiveConfig(events=str(ev_file)), first_id=1))
    caps = captures(sc.clean_chat())
    writer.submit(caps[0])
    writer.set_live(LiveSpec(LiveConfig(events=str(ev_file), warn_tokens=1), first_id=2))
    for cap in caps[1:]:
        writer.submit(cap)
    writer.set_live(None)
    assert writer.live_summary() is None
    writer.close()
    tags = [line.split(" ", 1)[0] for line in ev_file.read_text().splitlines()]
    assert tags == ["LLMP_TURN", "LLMP_SUMMARY"] + ["LLMP_TURN"] * (len(caps) - 1) + [
        "LLMP_SUMMARY"
    ]


def test_in_thread_writer_runs_the_live_view_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    rec = tmp_path / "rec.jsonl"
    writer = RecordWriter(RecordingFile(str(rec)), "full", child=False)
    writer.hold_logs = True  # its lines wait for the event loop, as the child's do
    cfg = LiveConfig(warn_tokens=1)
    writer.set_live(LiveSpec(cfg, first_id=1))
    caps = captures(sc.changed_system())
    for cap in caps:
        writer.submit(cap)
    for _ in range(500):  # one held line per request, logged by nobody yet
        if len(writer._held) == len(caps):
            break
        time.sleep(0.01)
    assert len(writer._held) == len(caps) and live_lines(caplog) == []
    writer.relay_logs()
    assert len(live_lines(caplog)) == len(caps)
    writer.close()
    want_lines, _ = in_process(rec, cfg, "full")
    assert live_lines(caplog) == want_lines
