"""`llmp analyze --jobs N` gives the one-process report, byte for byte.

Sessions are analysed in worker processes and put together in the parent
(`analysis.parallel`, docs/analysis.md "Parallel analysis").  Every scenario
recording is cut into sessions (ids restarting from 1, as a restarted proxy
writes them) and spread over files: a session that spans two files, files
given out of order, bad lines, a user-agent per file.  The report of
`--jobs 2` and `--jobs 3` must be the bytes of `--jobs 1`.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmp.analysis import analyze, command, parallel
from llmp.analysis.classify import TURN
from llmp.analysis.command import _print_readable
from llmp.analysis.linking import RingEntry
from llmp.analysis.loss import Between
from llmp.cli import main
from tests.support import scenarios as sc
from tests.support.traffic import TRAFFIC, report_bytes

ID_RE = re.compile(rb'^\{"v":1,"id":\d+,')
UA_RE = re.compile(rb'"user-agent":"')


@pytest.fixture(autouse=True)
def small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test recordings are small: cut them into units anyway."""
    monkeypatch.setattr(parallel, "UNIT_BYTES", 0)


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The units the parent put together (so a test knows the workers ran)."""
    seen: list[int] = []
    unit = parallel._Replay.unit

    def spy(self: parallel._Replay, done: Any) -> None:
        seen.append(done.records)
        unit(self, done)

    monkeypatch.setattr(parallel._Replay, "unit", spy)
    return seen


def renumbered(lines: list[bytes]) -> list[bytes]:
    """A session's lines with ids from 1, as a proxy process numbers them."""
    return [ID_RE.sub(b'{"v":1,"id":%d,' % (i + 1), line, count=1) for i, line in enumerate(lines)]


def layout(
    lines: list[bytes],
    cuts: list[int],
    n_files: int,
    *,
    span: bool = False,
    bad: bool = False,
    agents: bool = False,
) -> list[list[bytes]]:
    """Lines cut into sessions at `cuts`, spread over `n_files` files in blocks; `span`
    puts the middle session's second half in the next file, `bad` adds lines the
    reader drops, `agents` gives each file its own user-agent prefix."""
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(lines)), len(lines)]
    sessions = [renumbered(lines[a:b]) for a, b in itertools.pairwise(bounds) if a < b]
    files: list[list[bytes]] = [[] for _ in range(n_files)]
    for i, sess in enumerate(sessions):
        f = i * n_files // len(sessions)
        if span and i == len(sessions) // 2 and len(sess) > 1 and f + 1 < n_files:
            half = len(sess) // 2
            files[f] += sess[:half]
            files[f + 1] += sess[half:]
        else:
            files[f] += sess
    if agents:
        files = [
            [UA_RE.sub(b'"user-agent":"proxy%d/' % k, line) for line in lines]
            for k, lines in enumerate(files)
        ]
    if bad:
        files[0][1:1] = [b"{not json\n", b"\n", b'{"v":2,"id":99,"t_start_ms":1}\n', b"[1,2]\n"]
        files[-1].append(b"   \n")
    return files


def write(tmp: Path, files: list[list[bytes]], reverse: bool = False) -> list[Path]:
    paths = []
    for k, lines in enumerate(files):
        p = tmp / f"proxy{k}.jsonl"
        p.write_bytes(b"".join(lines))
        paths.append(p)
    return paths[::-1] if reverse else paths


def report(paths: list[Path], jobs: int, **kw: Any) -> bytes:
    """`llmp analyze --json --jobs N`, as bytes."""
    return report_bytes(paths, jobs=jobs, **kw)


def readable(paths: list[Path], jobs: int) -> str:
    result = analyze([str(p) for p in paths], progress=False, rows=False, jobs=jobs)
    try:
        out = io.StringIO()
        _print_readable(result, result.header(), out)
        return out.getvalue()
    finally:
        result.close()


def cuts_of(n: int) -> list[int]:
    """Three sessions of unequal length."""
    return [max(1, n // 3), max(2, n // 3 + n // 4)]


@pytest.mark.parametrize("mode", ["digest", "mixed"])
@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_jobs_give_the_one_process_report(
    name: str, mode: str, tmp_path: Path, replayed: list[int]
) -> None:
    lines = TRAFFIC[name]().lines(mode, "id")
    files = layout(lines, cuts_of(len(lines)), 2, span=True, bad=True, agents=name < "o")
    paths = write(tmp_path, files, reverse=True)
    one = report(paths, 1)
    assert not replayed
    assert report(paths, 2) == one
    assert len(replayed) >= 2  # the workers ran
    assert report(paths, 3) == one


@pytest.mark.parametrize("per_job", [1, 10_000])
@pytest.mark.parametrize("name", ["both_agents", "subagent", "changed_tools", "llama_refusing"])
def test_one_session_per_unit_or_a_few(
    name: str, per_job: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replayed: list[int]
) -> None:
    """Units of single sessions, and of several: tool families made in one unit and
    joined in a later one, conversations numbered across them."""
    monkeypatch.setattr(parallel, "UNITS_PER_JOB", per_job)
    lines = TRAFFIC[name]().lines("digest", "id")
    cuts = list(range(2, len(lines), 3))  # sessions of 2 and 3 records: first turns held at ends
    paths = write(tmp_path, layout(lines, cuts, 3, span=True))
    one = report(paths, 1)
    assert report(paths, 2) == one
    if per_job > 1:
        assert len(replayed) == len(cuts) + 1
    assert report(paths, 3) == one


def test_a_family_made_in_one_session_is_joined_in_a_later_one(
    tmp_path: Path, replayed: list[int]
) -> None:
    """Two harnesses behind one user-agent, each restart a session: the labels `#n`."""
    lines = sc.two_harnesses().lines("digest", "id") + sc.subagent().lines("digest", "id")
    paths = write(tmp_path, layout(lines, list(range(1, len(lines))), 2))
    one = report(paths, 1)
    assert b"#2" in one
    assert report(paths, 2) == one
    assert len(replayed) >= 2


def same_tools_again() -> sc.Traffic:
    """One user-agent, families {a,b} and {a,c}; {a} joins the later one; {a,b} is used
    again; then {a} again, in the very tools array of before.  The registry takes the
    family it gave that array last time without looking (`ClientRegistry.family_for`),
    so the parent must hand it the same object as one process would."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    ua = "OpenAI/Python 1.99.0"
    a, b, c = sc.CODING_TOOLS[:3]
    ab = sc.Agent(tr, srv, ua=ua, system="You are harness AB. " * 40, tools=[a, b])
    ac = sc.Agent(tr, srv, ua=ua, system="You are harness AC. " * 40, tools=[a, c])
    one = sc.Agent(tr, srv, ua=ua, system="You are harness A. " * 40, tools=[a])
    two = sc.Agent(tr, srv, ua=ua, system="You are another A. " * 40, tools=[a])
    sc.work(ab, 1, seed="ab")
    sc.work(ac, 1, seed="ac")
    sc.work(one, 1, seed="one")
    sc.work(ab, 2, seed="ab2")
    sc.work(two, 1, seed="two")
    return tr


@pytest.mark.parametrize("before", [0, 1])
def test_the_same_tools_array_joins_the_family_it_joined_before(
    before: int, tmp_path: Path, replayed: list[int]
) -> None:
    """The array's second use opens a later session (whose unit is another worker's)."""
    lines = same_tools_again().lines("digest", "id")
    cuts = [5]
    if before:  # the whole of it after another session, in the same unit or not
        first = sc.clean_chat().lines("digest", "id")
        lines, cuts = first + lines, [len(first), len(first) + 5]
    paths = write(tmp_path, layout(lines, cuts, 2))
    one = report(paths, 1)
    assert report(paths, 2) == one
    assert replayed


def three_at_once() -> sc.Traffic:
    """Three conversations taking turns on one server: each turn's "between" holds the
    other two's last turns, so consecutive rows share ring entries."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    agents = [
        sc.Agent(tr, srv, ua=f"agent{k}/1.0", system=f"You are agent {k}. " * 40) for k in range(3)
    ]
    for i in range(3):
        for k, agent in enumerate(agents):
            sc.work(agent, 1, seed=f"a{k}t{i}")
    return tr


def test_rows_that_saw_the_same_rows_between(tmp_path: Path, replayed: list[int]) -> None:
    """In a later unit (its client keys and conversation numbers not the worker's)."""
    first = sc.clean_chat().lines("digest", "id")
    lines = first + three_at_once().lines("digest", "id")
    paths = write(tmp_path, layout(lines, [len(first)], 2))
    one = report(paths, 1)
    assert report(paths, 2) == one
    assert len(replayed) >= 2


def evicted_by_a_title_call() -> sc.Traffic:
    """A first turn held back evicts another client's cache; that client's next turn is
    a row before the held one proves a title side-call, and its finding counts the
    held turn as the other conversation it then was."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    y = sc.Agent(tr, srv, ua="other/1.0", system="You are agent Y. " * 40)
    sc.work(y, 1, seed="y0")
    title = sc.Agent(tr, srv, system="You generate a short title. ", tools=None)
    title.turn(sc.text("title ask", 200), "A title")
    sc.work(y, 1, seed="y1")
    sc.work(sc.Agent(tr, srv), 2, seed="x")
    return tr


def test_a_held_turn_seen_before_it_proves_a_side_call(tmp_path: Path, replayed: list[int]) -> None:
    first = sc.clean_chat().lines("digest", "id")
    lines = first + sc.shifted(evicted_by_a_title_call(), 1).lines("digest", "id")
    paths = write(tmp_path, layout(lines, [len(first)], 2))
    one = report(paths, 1)
    assert b'"other_conversations":1' in one
    assert report(paths, 2) == one
    assert replayed


@pytest.mark.parametrize("name", ["both_agents", "two_harnesses", "llama_refusing"])
def test_the_readable_report_is_the_same(name: str, tmp_path: Path, replayed: list[int]) -> None:
    lines = TRAFFIC[name]().lines("mixed", "id")
    paths = write(tmp_path, layout(lines, cuts_of(len(lines)), 2, span=True, bad=True))
    one = readable(paths, 1)
    assert readable(paths, 2) == one
    assert replayed


def test_concurrent_proxies_need_the_exact_order_and_still_run_in_parallel(
    tmp_path: Path, replayed: list[int]
) -> None:
    """Two proxies at once: their files overlap in time, so the reader sorts every
    line (exact mode), and sessions start wherever the merged ids fail to increase."""
    a = sc.both_agents().lines("digest", "id")
    b = sc.subagent().lines("digest", "id")
    paths = write(tmp_path, [a, b])
    one = report(paths, 1)
    assert report(paths, 2) == one
    assert len(replayed) >= 2


def test_another_producers_lines(tmp_path: Path, replayed: list[int]) -> None:
    """Lines whose keys come in another order: the reader parses them for their key."""
    lines = sc.both_agents().lines("digest", "id")
    files = layout(lines, cuts_of(len(lines)), 2, span=True)
    for k, line in enumerate(files[1]):
        rec = orjson.loads(line)
        files[1][k] = orjson.dumps({"id": rec.pop("id"), **rec}) + b"\n"
    paths = write(tmp_path, files)
    one = report(paths, 1)
    assert report(paths, 2) == one
    assert replayed


@given(
    st.sampled_from(["both_agents", "two_harnesses", "title_side_call", "llama_refusing"]),
    st.lists(st.integers(1, 40), max_size=6),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.integers(2, 3),
)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_any_cut_into_sessions_and_files(
    tmp_path: Path, name: str, cuts: list[int], n_files: int, span: bool, rev: bool, jobs: int
) -> None:
    lines = TRAFFIC[name]().lines("digest", "id")
    case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    case.mkdir()
    paths = write(case, layout(lines, cuts, n_files, span=span, bad=True), reverse=rev)
    assert report(paths, jobs) == report(paths, 1)


# -- what runs in one process, and says so -----------------------------------


def test_a_line_that_looks_like_a_record_but_does_not_decode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The key scan takes it for a record; its worker finds it is not: one process."""
    lines = sc.both_agents().lines("digest", "id")
    files = layout(lines, cuts_of(len(lines)), 2)
    files[1].append(b'{"v":1,"id":99,"conn":1,"t_start_ms":1788599999999,"request":\n')
    paths = write(tmp_path, files)
    one = report(paths, 1)
    capsys.readouterr()
    assert report(paths, 2) == one
    assert "does not decode; analysed in one process" in capsys.readouterr().err
    assert b'"bad_lines":1' in one


def test_one_unit_runs_in_process(tmp_path: Path, replayed: list[int]) -> None:
    path = sc.two_harnesses().write(tmp_path / "rec.jsonl")
    assert report([path], 4) == report([path], 1)
    assert not replayed


def test_html_runs_in_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: list[int]
) -> None:
    lines = sc.both_agents().lines("digest", "id")
    paths = [str(p) for p in write(tmp_path, layout(lines, cuts_of(len(lines)), 2))]
    assert main(["analyze", *paths, "--html", str(tmp_path / "one.html")]) == 0
    first = capsys.readouterr()
    assert main(["analyze", *paths, "--html", str(tmp_path / "two.html"), "--jobs", "2"]) == 0
    second = capsys.readouterr()
    assert second.out == first.out
    assert "--html" in second.err and "one process" in second.err
    assert (tmp_path / "two.html").read_bytes() == (tmp_path / "one.html").read_bytes()
    assert not replayed


# -- the command line ----------------------------------------------------------


def test_rows_and_the_gate_with_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: list[int]
) -> None:
    lines = sc.changed_system().lines("digest", "id") + sc.title_side_call().lines("digest", "id")
    paths = [str(p) for p in write(tmp_path, layout(lines, cuts_of(len(lines)), 2, span=True))]
    gate = ["--fail-on", "prefix_break,side_call_on_conversation_model"]
    outs: list[tuple[int, str, str, bytes]] = []
    for jobs in ("1", "2"):
        table = tmp_path / f"rows{jobs}.csv"
        code = main(["analyze", *paths, "--json", "--rows", str(table), *gate, "--jobs", jobs])
        got = capsys.readouterr()
        outs.append((code, got.out, got.err.replace(table.name, "rows.csv"), table.read_bytes()))
    assert outs[0][0] == outs[1][0] == 1
    assert "FAIL prefix_break" in outs[0][2]
    assert outs[0][1:] == outs[1][1:]
    assert replayed


def test_stdin_with_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replayed: list[int]
) -> None:
    lines = sc.both_agents().lines("digest", "id")
    files = layout(lines, cuts_of(len(lines)), 1)
    data = b"".join(files[0])
    result = analyze(["-"], progress=False, stdin=io.BytesIO(data), jobs=2)
    out = io.BytesIO()
    result.write_json(out)
    result.close()
    path = write(tmp_path, files)
    assert out.getvalue() == report(path, 1)
    assert replayed


@pytest.mark.parametrize("bad", ["0", "-1", "x", "1.5", ""])
def test_bad_jobs_exit_2(bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = sc.clean_chat().write(tmp_path / "rec.jsonl")
    assert main(["analyze", str(path), "--jobs", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmp analyze: --jobs must be a whole number of 1 or more, or auto")


def test_parse_jobs() -> None:
    assert command.parse_jobs("auto") == (os.cpu_count() or 1)
    assert command.parse_jobs("3") == 3
    assert command.parse_jobs("0") is None


def test_the_console_script_on_several_files(tmp_path: Path) -> None:
    """`llmp analyze --jobs 2` as a user runs it: the same bytes as `--jobs 1`."""
    llmp = shutil.which("llmp", path=os.path.dirname(sys.executable))
    assert llmp is not None
    lines = sc.both_agents().lines("digest", "id") + sc.two_harnesses().lines("digest", "id")
    files = layout(lines, list(range(3, len(lines), 4)), 3, span=True, bad=True)
    paths = [str(p) for p in write(tmp_path, files, reverse=True)]
    env = {**os.environ, "LLMP_ANALYZE_UNIT_BYTES": "0"}

    def run(jobs: str) -> bytes:
        done = subprocess.run(
            [llmp, "analyze", *paths, "--json", "--jobs", jobs],
            capture_output=True,
            check=True,
            env=env,
            timeout=120,
        )
        assert done.stderr == b""
        return done.stdout

    one = run("1")
    assert run("2") == one
    assert run("auto") == one


def test_remap_moves_the_turns_conversation_with_its_entries() -> None:
    """What ran between a turn and its link keeps sorting the same after the parent
    renumbers a unit's conversations: the turn's own number moves with the entries'."""
    own = RingEntry(5, "m", TURN, 2, None, 0, "m")
    other = RingEntry(6, "m", TURN, 1, None, 1, "m")
    btw = Between([], [6], [], [own, other], None, False, "m", 2)
    assert btw.other_entries == [other]
    done: set[int] = set()
    parallel._remap(btw, {0: 7, 1: 8}, 10, done)
    parallel._remap(btw, {7: 0, 8: 0}, 10, done)  # a second sight of the same objects
    assert (btw.conversation, own.conversation, other.conversation) == (12, 12, 11)
    assert (own.client, other.client) == (7, 8)
    assert btw.other_entries == [other]
