"""The live view in the builder child: same verdicts as in process; lines written by the child.

The writer builds records in a child process, and the live view runs there
too, fed each record as it is built (llmp.recorder.child). These tests drive a
real `RecordWriter` with its real child, and check what it produces: the
per-request lines (which the child writes itself to the proxy's terminal, or
to `llmp_live_log`), the summary (over the child's summary channel), and the
event file the child writes, against a live view fed the written recording
in this process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.format import canonical
from llmp.format.canonical import record_dumps
from llmp.format.lockfile import open_locked
from llmp.live.contract import LINE_ATTR, LiveConfig, LiveError
from llmp.live.view import LiveView
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


STAMP = re.compile(r"^\[\d\d:\d\d:\d\d\.\d{3}\] ")


def terminal(path: Path) -> int:
    """A file to stand in for the proxy's terminal (the child writes its lines there)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def written_lines(path: Path) -> list[str]:
    """The lines the child wrote, without mitmproxy's `[HH:MM:SS.mmm] ` time stamp."""
    out = []
    for line in path.read_text().splitlines():
        assert STAMP.match(line), line
        out.append(STAMP.sub("", line))
    return out


def wait_written(writer: RecordWriter, n: int) -> None:
    for _ in range(1000):
        if writer.written >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{writer.written} of {n} records written")


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
    rec, ev_file, term = tmp_path / "rec.jsonl", tmp_path / "events.txt", tmp_path / "term"
    cfg = LiveConfig(warn_tokens=1, events=str(ev_file))
    fd = terminal(term)
    writer = RecordWriter(RecordingFile(str(rec)), mode, terminal=fd)
    os.close(fd)  # the child has its own copy
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
    got = written_lines(term)
    # Every line, the summary line at shutdown last; none through this process's log.
    assert got == want_lines and any("llmp: warning:" in line for line in got)
    assert got[-1].startswith("llmp: live view:")
    assert live_lines(caplog) == [] and "llmp: live view:" not in caplog.text
    assert events(ev_file) == want_events
    assert summary["recent"] == want_events
    assert ev_file.read_text().splitlines()[-1].startswith("LLMP_SUMMARY ")


def test_lines_are_written_as_records_are_built(tmp_path: Path) -> None:
    """The child writes a record's line before it answers: nothing waits for the proxy."""
    term = tmp_path / "term"
    fd = terminal(term)
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest", terminal=fd)
    os.close(fd)
    writer.set_live(LiveSpec(LiveConfig(), first_id=1))
    caps = captures(sc.clean_chat())
    for cap in caps:
        writer.submit(cap)
    wait_written(writer, len(caps))
    assert len(written_lines(term)) == len(caps)
    writer.close()
    assert written_lines(term)[-1].startswith("llmp: live view:")


def test_the_terminal_level_drops_info_lines(tmp_path: Path) -> None:
    """`termlog_verbosity=warn`: only the warnings reach the terminal."""
    term = tmp_path / "term"
    fd = terminal(term)
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest", terminal=fd)
    os.close(fd)
    writer.set_live(LiveSpec(LiveConfig(warn_tokens=1, log_level=logging.WARNING), first_id=1))
    caps = captures(sc.changed_system())
    for cap in caps:
        writer.submit(cap)
    writer.close()
    got = written_lines(term)
    assert got and all(line.startswith("llmp: warning:") for line in got)


def test_a_live_log_file_takes_the_lines(tmp_path: Path) -> None:
    """`llmp_live_log`: the lines go to that file (0600), not to the terminal."""
    term, live_log = tmp_path / "term", tmp_path / "live.log"
    fd = terminal(term)
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest", terminal=fd)
    os.close(fd)
    writer.set_live(LiveSpec(LiveConfig(log_file=str(live_log)), first_id=1))
    caps = captures(sc.clean_chat())
    for cap in caps:
        writer.submit(cap)
    writer.close()
    lines = written_lines(live_log)
    assert len(lines) == len(caps) + 1 and lines[-1].startswith("llmp: live view:")
    assert written_lines(term) == []
    assert live_log.stat().st_mode & 0o777 == 0o600


def test_a_live_log_that_cannot_be_opened_is_a_live_error(tmp_path: Path) -> None:
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest")
    with pytest.raises(LiveError, match="llmp_live_log"):
        writer.set_live(LiveSpec(LiveConfig(log_file=str(tmp_path / "no" / "x")), first_id=1))
    assert writer.live_summary() is None
    writer.close()


def test_a_dead_child_hands_the_live_view_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmp")
    ev_file, term = tmp_path / "events.txt", tmp_path / "term"
    fd = terminal(term)
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "digest", terminal=fd)
    os.close(fd)
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
    assert len(written_lines(term)) == half
    here = live_lines(caplog)
    assert len(here) == len(caps) - half + 1 and here[-1].startswith("llmp: live view:")
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
    cfg = LiveConfig(warn_tokens=1)
    writer.set_live(LiveSpec(cfg, first_id=1))
    caps = captures(sc.changed_system())
    for cap in caps:
        writer.submit(cap)
    wait_written(writer, len(caps))
    writer.close()
    want_lines, _ = in_process(rec, cfg, "full")
    assert live_lines(caplog) == want_lines


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text, by name and labels; the `_created` times left out."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("child", [True, False], ids=["child", "in-thread"])
def test_metrics_are_the_live_views_wherever_it_runs(tmp_path: Path, child: bool) -> None:
    """`GET /_llmp/metrics`'s body: from the child's channel, or the writer's own view."""
    rec = tmp_path / "rec.jsonl"
    writer = RecordWriter(RecordingFile(str(rec)), "digest", child=child)
    assert writer.live_metrics() is None  # no live view: the endpoint says it is off
    writer.set_live(LiveSpec(LiveConfig(), first_id=1))
    caps = captures(sc.changed_system())
    for cap in caps:
        writer.submit(cap)
    wait_written(writer, len(caps))
    # What a live view fed the written recording here says, with the same totals.
    mine = LiveView(LiveConfig(), body="digest", say=lambda level, line: None)
    for raw in rec.read_bytes().splitlines():
        mine.on_record(orjson.loads(raw))
    want = samples(mine.metrics_text(len(caps), 0))
    mine.close()
    answer, got = None, {}
    for _ in range(500):  # the child may still be feeding its view the last record
        answer = writer.live_metrics()
        assert answer is not None
        got = samples(answer[0])
        if got == want:
            break
        time.sleep(0.01)
    writer.close()
    assert answer is not None
    content_type = answer[1]
    assert content_type.startswith("text/plain; version=")
    assert got == want
    assert sum(v for (name, _), v in got.items() if name == "llmp_requests_total") > 0
    assert got[("llmp_records_failed_total", ())] == 0
