"""The recording reader: bad lines, sessions (R16), several files (R17), order."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis.reader import (
    NeedsExactOrder,
    ReadStats,
    Recording,
    in_order,
    read_all,
    sorted_index,
)
from llmp.format.canonical import RawFloat, record_dumps
from llmp.format.lines import parse_line
from tests.support import scenarios as sc
from tests.support.scenarios import Agent, LlamaServer, Traffic, work


def rec(rid: int, t: int, **extra: Any) -> bytes:
    r = {"v": 1, "id": rid, "conn": 1, "t_start_ms": t, "t_first_byte_ms": None, "t_end_ms": t + 5}
    r.update(extra)
    return record_dumps(r) + b"\n"


def read(paths: list[str], **kw: Any) -> tuple[list[tuple[int, int]], Any]:
    def consume(records: Any) -> list[tuple[int, int]]:
        return [(session, r["id"]) for session, r in records]

    return read_all(paths, consume, **kw)


def write(tmp: Path, name: str, lines: list[bytes]) -> str:
    path = tmp / name
    path.write_bytes(b"".join(lines))
    return str(path)


def test_bad_lines_are_counted_and_the_rest_is_read(tmp_path: Path) -> None:
    lines = [
        rec(1, 100),
        b"\n",
        b"   \n",
        b"{not json\n",
        b"[1, 2]\n",
        b'"a string"\n',
        b'{"v": 2, "id": 2, "t_start_ms": 101}\n',
        b'{"v": true, "id": 2, "t_start_ms": 101}\n',
        b'{"v": 1, "t_start_ms": 101}\n',
        b'{"v": 1, "id": "3", "t_start_ms": 101}\n',
        b'{"v":1,"id":4,"conn":1,"t_start_ms":102,broken\n',
        rec(2, 103),
        rec(3, 104)[:-1],  # a last line without its newline is still whole
    ]
    got, stats = read([write(tmp_path, "r.jsonl", lines)])
    assert got == [(1, 1), (1, 2), (1, 3)]
    assert stats.bad_lines == 8
    assert stats.records == 3
    assert stats.sessions == 1


def test_records_are_sorted_by_id_within_a_session(tmp_path: Path) -> None:
    lines = [rec(2, 101), rec(3, 102), rec(1, 100), rec(5, 104), rec(4, 103)]
    got, stats = read([write(tmp_path, "r.jsonl", lines)])
    assert got == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    assert not stats.exact


def test_two_sessions_in_one_file(tmp_path: Path) -> None:
    first = [rec(2, 101), rec(1, 100), rec(3, 102)]
    second = [rec(1, 5000), rec(3, 5002), rec(2, 5001)]
    got, stats = read([write(tmp_path, "r.jsonl", first + second)])
    assert got == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    assert stats.sessions == 2


def test_several_files_are_one_recording_in_time_order(tmp_path: Path) -> None:
    early = write(tmp_path, "a.jsonl", [rec(1, 100), rec(2, 101)])
    late = write(tmp_path, "b.jsonl", [rec(1, 900), rec(2, 901)])
    got, stats = read([late, early])  # given out of date order
    assert got == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert not stats.exact  # ordering the files avoided the fallback


def test_a_gap_in_ids_waits_for_the_window(tmp_path: Path) -> None:
    # id 2 never arrives (a killed proxy lost it); the rest still comes out in order.
    lines = [rec(1, 100), rec(3, 102), rec(5, 104), rec(4, 103)]
    got, stats = read([write(tmp_path, "r.jsonl", lines)], window_lines=2)
    assert got == [(1, 1), (1, 3), (1, 4), (1, 5)]
    assert not stats.exact


def test_a_record_later_than_the_window_falls_back_to_exact_order(tmp_path: Path) -> None:
    # A long exchange (id 1) is written after many later ones.
    lines = [rec(i, 100 + i) for i in range(2, 40)] + [rec(1, 101)]
    random.Random(4).shuffle(lines)
    path = write(tmp_path, "r.jsonl", lines)
    streamed, s1 = read([path])
    small, s2 = read([path], window_lines=3)
    assert streamed == small == [(1, i) for i in range(1, 40)]
    assert not s1.exact and s2.exact
    assert s2.bad_lines == 0 and s2.records == 39


def test_concurrent_proxies_follow_r16_literally(tmp_path: Path) -> None:
    # Two proxies ran at the same time into two files: by (t_start_ms, id) the
    # ids fail to increase at every switch, and each switch is a new session.
    a = write(tmp_path, "a.jsonl", [rec(1, 100), rec(2, 102)])
    b = write(tmp_path, "b.jsonl", [rec(1, 101), rec(2, 103)])
    got, stats = read([a, b])
    assert got == [(1, 1), (2, 1), (2, 2), (3, 2)]
    assert stats.exact


def test_stdin_is_read_like_a_file(tmp_path: Path) -> None:
    data = b"".join([rec(2, 101), rec(1, 100), b"junk\n"])
    got, stats = read(["-"], stdin=io.BytesIO(data))
    assert got == [(1, 1), (1, 2)]
    assert stats.bad_lines == 1


def test_stdin_can_be_restarted_in_exact_mode() -> None:
    lines = [rec(i, 100 + i) for i in range(2, 12)] + [rec(1, 101)]
    got, stats = read(["-"], stdin=io.BytesIO(b"".join(lines)), window_lines=2)
    assert got == [(1, i) for i in range(1, 12)]
    assert stats.exact


def test_full_bodies_keep_their_number_text() -> None:
    body = {"model": "m", "messages": [], "temperature": RawFloat("0.10"), "x": RawFloat("1E5")}
    line = rec(1, 100, request={"method": "POST", "path": "/v1/chat/completions", "body": body})
    parsed = parse_line(line)
    assert parsed is not None
    got = parsed["request"]["body"]
    assert isinstance(got["temperature"], RawFloat) and got["temperature"].text == "0.10"
    assert got["x"].text == "1E5"
    # Digest lines are parsed once, with orjson.
    digest_line = rec(2, 100, request={"method": "POST", "path": "/x", "body": None, "x": 0.10})
    parsed = parse_line(digest_line)
    assert parsed is not None and not isinstance(parsed["request"]["x"], RawFloat)


def test_progress_on_request_does_not_break_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "r.jsonl", [rec(1, 100), rec(2, 101)])
    got, _ = read([path], progress=True)
    assert got == [(1, 1), (1, 2)]


def test_recording_from_the_generator_reads_in_order(tmp_path: Path) -> None:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 4)
    lines = tr.lines("digest")
    random.Random(1).shuffle(lines)
    got, _ = read([write(tmp_path, "r.jsonl", lines)])
    assert got == [(1, i) for i in range(1, 5)]
    with Recording([str(tmp_path / "r.jsonl")]) as recording:
        ids = [orjson.loads(orjson.dumps(r))["id"] for _, r in recording.exact()]
    assert ids == [1, 2, 3, 4]


def test_another_producers_key_order_reads_the_same(tmp_path: Path) -> None:
    # A recorder in another language may write the keys in any order: such
    # lines are parsed to find their key, and read exactly like ours.
    from llmp.analysis import analyze
    from llmp.format.canonical import dumps

    tr = sc.title_side_call()
    ours = tr.write(tmp_path / "ours.jsonl", "full")
    sorted_lines = [dumps(parse_line(line)) + b"\n" for line in tr.lines("full")]
    assert not sorted_lines[0].startswith(b'{"v":1,"id":')
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_bytes(b"".join(sorted_lines))
    reports = []
    for path in (ours, theirs):
        result = analyze([str(path)])
        buf = io.BytesIO()
        result.write_json(buf)
        result.close()
        reports.append(buf.getvalue())
    assert reports[0] == reports[1]


@pytest.mark.parametrize("block", [1, 2, 7, 64, 1 << 20])
def test_lines_across_blocks_are_the_files_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    from llmp.analysis import reader

    data = b"".join(
        [b"\n", b"a\n", b"x" * 200 + b"\n", b"\n\n", b"bc\n", b"y" * 129 + b"\n", b"last"]
    )
    path = write(tmp_path, "r.jsonl", [data])
    monkeypatch.setattr(reader, "BLOCK", block)
    with open(path, "rb", buffering=0) as f:
        got = list(reader._file_lines(f))
    assert got == data.splitlines(keepends=True)
    assert all(type(line) is bytes for line in got)


_TRUNCATE_WHILE_READING = """
import os, sys
from llmp.analysis.reader import Recording
path, cut = sys.argv[1], int(sys.argv[2])
with Recording([path]) as rec:
    ids = []
    for _, r, _ in rec.stream_sourced():
        if not ids:
            os.truncate(path, cut)  # as the recorder trims a partial tail on restart
        ids.append(r["id"])
print(len(ids), ids[-1], rec.stats.records, rec.stats.bad_lines)
"""


def test_a_file_truncated_while_it_is_read_ends_with_a_bad_line(tmp_path: Path) -> None:
    """Another process may truncate a recording under the reader: the reader sees the
    shorter file (the line cut in two is a bad line), and the process does not die.
    A mapped file would kill it with SIGBUS at the first page past the new end, so the
    reader runs in a child process whose exit the test reads."""
    pad = "p" * 900
    lines = [rec(i, 100 + i, pad=pad) for i in range(1, 6001)]  # ~5.6 MB: several blocks
    path = write(tmp_path, "r.jsonl", lines)
    cut = sum(map(len, lines[:4000])) + len(lines[4000]) // 2  # mid-line 4001
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_WHILE_READING, path, str(cut)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    n, last, records, bad = map(int, done.stdout.split())
    assert (n, last, records, bad) == (4000, 4000, 4000, 1)


def _offer(keys: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int, int, int]]:
    """`in_order`'s input: each key with its position as the item, 10 bytes, file 0."""
    return [(key, i, 10, 0) for i, key in enumerate(keys)]


def test_in_order_numbers_sessions_and_skips_what_take_refuses() -> None:
    # ids 1 2 3, then a second proxy's 1 2 (a new session), item 2 refused by `take`.
    keys = [(100, 1), (101, 2), (102, 3), (103, 1), (104, 2)]
    seen: list[tuple[int, bool]] = []

    def take(item: int, direct: bool) -> int | None:
        seen.append((item, direct))
        return None if item == 2 else item * 10

    stats = ReadStats()
    got = list(in_order(_offer(keys), take, stats, 100, 1 << 20))
    assert got == [(1, 0, 0), (1, 10, 0), (2, 30, 0), (2, 40, 0)]
    assert stats.sessions == 2
    assert all(direct for _, direct in seen)  # all in order: none waited


def test_in_order_holds_a_gap_until_the_window_is_full() -> None:
    keys = [(101, 3), (102, 4), (103, 5)]  # ids 1 and 2 never come
    released: list[int] = []

    def take(item: int, direct: bool) -> int:
        released.append(item)
        assert not direct
        return item

    got = iter(in_order(_offer(keys), take, ReadStats(), 2, 1 << 20))
    assert next(got) == (1, 0, 0)  # released when the third line overflowed the window
    assert released == [0]
    assert list(got) == [(1, 1, 0), (1, 2, 0)]  # then id 4 is the next, and 5


def test_in_order_says_when_a_line_sorts_before_one_released() -> None:
    keys = [(100, 1), (101, 2), (99, 7)]
    with pytest.raises(NeedsExactOrder):
        list(in_order(_offer(keys), lambda item, direct: item, ReadStats(), 100, 1 << 20))


def test_exact_order_is_in_order_over_the_sorted_index() -> None:
    index = [(102, 3, 0, 20, 10), (100, 1, 1, 0, 10), (101, 2, 0, 0, 10), (100, 1, 0, 10, 10)]
    got = list(in_order(sorted_index(index), lambda item, direct: item, ReadStats(), 0, 0))
    # (100, 1) twice: the id fails to increase, so the second starts a session (R16).
    assert got == [(1, (0, 10, 10), 0), (2, (1, 0, 10), 1), (2, (0, 0, 10), 0), (2, (0, 20, 10), 0)]
