"""A new recording file each local day: nothing lost, nothing split at the switch."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import time
from pathlib import Path

from llmp.format.canonical import record_dumps
from llmp.recorder.capture import Capture
from llmp.recorder.rotate import DailyFile, path_for
from llmp.recorder.writer import RecordWriter
from tests.support import scenarios as sc

DAY1 = dt.date(2026, 12, 1)
DAY2 = dt.date(2026, 12, 2)


class Clock:
    """The local day, set by the test."""

    def __init__(self, day: dt.date) -> None:
        self.day = day

    def __call__(self) -> dt.date:
        return self.day


def test_path_for() -> None:
    assert path_for("/v/llmp-2026-12-01.jsonl", DAY2) == "/v/llmp-2026-12-02.jsonl"
    assert path_for("team.jsonl", DAY2) == "team-2026-12-02.jsonl"
    assert path_for("/v/rec", DAY2) == "/v/rec-2026-12-02"
    assert (
        path_for("/2026-01-01/x.jsonl", DAY2) == "/2026-01-01/x-2026-12-02.jsonl"
    )  # the name only


def test_the_day_switches_at_the_next_line(tmp_path: Path) -> None:
    clock = Clock(DAY1)
    f = DailyFile(str(tmp_path / "llmp-2026-12-01.jsonl"), today=clock)
    f.write_line(b'{"a":1}\n')
    clock.day = DAY2
    assert f.path.endswith("llmp-2026-12-01.jsonl")  # nothing happens until a line comes
    f.write_line(b'{"a":2}\n')
    f.write_line(b'{"a":3}\n')
    f.close()
    one = tmp_path / "llmp-2026-12-01.jsonl"
    two = tmp_path / "llmp-2026-12-02.jsonl"
    assert one.read_bytes() == b'{"a":1}\n'
    assert two.read_bytes() == b'{"a":2}\n{"a":3}\n'
    assert stat.S_IMODE(os.stat(two).st_mode) == 0o600


def _captures(n: int) -> list[Capture]:
    recs = sc.clean_chat().full()
    caps = []
    for i in range(n):
        rec = recs[i % len(recs)]
        body = record_dumps(rec["request"]["body"])
        reply = record_dumps(rec["response"]["body"])
        caps.append(
            Capture(
                id=i + 1,
                conn=1,
                t_start_ms=rec["t_start_ms"] + i,
                method="POST",
                path="/v1/chat/completions",
                request_headers={"content-type": "application/json"},
                request_body=body,
                request_body_bytes=len(body),
                request_complete=True,
                status=200,
                response_headers={"content-type": "application/json"},
                pieces=[reply],
                times=[time.time()],
                response_body_bytes=len(reply),
                stored_bytes=len(reply),
                t_end_ms=rec["t_end_ms"] + i,
            )
        )
    return caps


def test_midnight_loses_no_exchange_in_flight(tmp_path: Path) -> None:
    """Exchanges that started before midnight and end after it are written, whole, to the
    new day's file; every exchange is in exactly one of the two files."""
    clock = Clock(DAY1)
    f = DailyFile(str(tmp_path / "team.jsonl"), today=clock)
    writer = RecordWriter(f, "digest")
    caps = _captures(12)
    for cap in caps[:4]:  # ended before midnight
        writer.submit(cap)
    in_flight = caps[4:8]  # started before midnight (their ids and t_start are earlier)
    for _ in range(500):
        if writer.written == 4:
            break
        time.sleep(0.01)
    clock.day = DAY2
    for cap in in_flight + caps[8:]:
        writer.submit(cap)
    writer.close()
    one = [json.loads(x) for x in (tmp_path / "team-2026-12-01.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "team-2026-12-02.jsonl").read_text().splitlines()]
    assert [r["id"] for r in one] == [1, 2, 3, 4]
    assert [r["id"] for r in two] == list(range(5, 13))
    assert all(r["request"]["digest"] is not None for r in one + two)
    assert writer.written == 12 and writer.lost == 0


def test_a_day_file_in_use_keeps_the_old_one(tmp_path: Path) -> None:
    """If the new day's file cannot be had, records go on into the old one."""
    from llmp.format.lockfile import close_locked, open_locked

    clock = Clock(DAY1)
    f = DailyFile(str(tmp_path / "team.jsonl"), today=clock)
    other = open_locked(str(tmp_path / "team-2026-12-02.jsonl"), "test", "")
    try:
        f.write_line(b"1\n")
        clock.day = DAY2
        f.write_line(b"2\n")
        f.write_line(b"3\n")
    finally:
        close_locked(other)
        f.close()
    assert (tmp_path / "team-2026-12-01.jsonl").read_bytes() == b"1\n2\n3\n"
