"""`llmp analyze --jobs N`: sessions analysed in worker processes, one process's report.

Sessions (R16) share almost nothing in the engine: the client registry (keys
in order of first request, tool families a later session can join),
conversation numbers that run across sessions, and the totals, findings and
rows summed in `Engine._final`.  So:

1. `plan` finds the sessions as the reader does, with the reader's own
   `reader.in_order` (the same file order, window and session starts, and the
   exact order when a line goes back in time), from each line's key only, and keeps each
   session's lines as byte ranges of its files, cut into units of whole
   sessions handed to the workers as soon as they are complete.
2. A worker runs the engine over one unit with a registry that hands out
   local tokens and logs its calls, and writes what `_final` is given (row,
   what ran between, the few request fields the totals read), the refusals
   and the registry's calls to a temporary file, in the order they happen.
3. The parent takes the units in order, replays each log on the one real
   registry, maps tokens to client keys and local conversation numbers to
   global ones, and runs `_final` as one process would have, in the same order.

What the plan cannot prove the same as one process (a line the key scan took
for a record that does not decode, more distinct tools arrays than the engine
caches, `--html`'s "what changed") runs in one process instead, with one line
on stderr.
"""

from __future__ import annotations

import copyreg
import gc
import multiprocessing
import os
import pickle
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from typing import IO, TYPE_CHECKING, Any, cast

from llmp.analysis.clients import ClientRegistry
from llmp.analysis.config import Config
from llmp.analysis.engine import Engine, Fed
from llmp.analysis.exchange import Exchange, Tools, read_record
from llmp.analysis.findings import Findings
from llmp.analysis.linking import RingEntry
from llmp.analysis.loss import Between
from llmp.analysis.reader import (
    WINDOW_BYTES,
    WINDOW_LINES,
    NeedsExactOrder,
    ReadStats,
    Recording,
    in_order,
    index_lines,
    keyed_spans,
    sorted_index,
)
from llmp.analysis.result import Analysis
from llmp.format.lines import KEY_RE, key_and_record, parse_line, with_number_text

if TYPE_CHECKING:
    from llmp.analysis.overflow import Refusal

UNITS_PER_JOB = 4
"""Units per worker, so that one long session does not leave the others idle."""
UNIT_BYTES = 4 << 20
"""The least a unit holds (bar the last): each costs a file and a task.
`LLMP_ANALYZE_UNIT_BYTES` sets another (small recordings cut into units anyway)."""
UNIT_BYTES_ENV = "LLMP_ANALYZE_UNIT_BYTES"
TOOLS_CACHED = 4096
"""Distinct tools arrays the engine keeps one object of (`exchange._tools_of`); beyond
that its cache starts again and the family lookup's identity shortcut with it."""


# -- the plan: sessions as byte ranges ---------------------------------------


Run = tuple[int, int, int, int, bool]
"""`(session, file, start, end, direct)`: whole lines of one file and one session, read
in file order; `direct` says they left the reader at once (a line parsed for its key
stays that parse) rather than through its window or its exact order (every line read
with `read`)."""


@dataclass(slots=True)
class Unit:
    """Consecutive sessions for one worker: their lines, in the reader's order."""

    runs: list[Run] = field(default_factory=list)
    records: int = 0
    size: int = 0

    def add(self, session: int, fi: int, start: int, n: int, direct: bool) -> None:
        self.records += 1
        self.size += n
        runs = self.runs
        if runs:
            se, f, s, e, d = runs[-1]
            if se == session and f == fi and e == start and d == direct:
                runs[-1] = (se, f, s, start + n, d)
                return
        runs.append((session, fi, start, start + n, direct))


@dataclass
class Plan:
    """The units, and the reader's counts as one process would make them."""

    files: list[str]
    """The file read for each of the paths given (standard input spooled)."""
    units: list[Unit]
    stats: ReadStats


class _Cut:
    """Releases into units of whole sessions of about `size` bytes each; `ready` gets
    each unit once the next one starts (so only when there are two or more)."""

    def __init__(self, size: int, ready: Callable[[Unit], None]) -> None:
        self.size = size
        self.units: list[Unit] = []
        self.session = 0
        self._ready = ready

    def __call__(self, session: int, fi: int, start: int, n: int, direct: bool) -> None:
        if session != self.session:
            self.session = session
            units = self.units
            if not units or units[-1].size >= self.size:
                if units:
                    self._ready(units[-1])
                units.append(Unit())
        self.units[-1].add(session, fi, start, n, direct)

    def end(self) -> None:
        if len(self.units) > 1:
            self._ready(self.units[-1])


def _ignore(unit: Unit) -> None:
    pass


def _ignore_restart() -> None:
    pass


def plan(
    rec: Recording,
    size: int,
    window_lines: int = WINDOW_LINES,
    window_bytes: int = WINDOW_BYTES,
    *,
    ready: Callable[[Unit], None] = _ignore,
    restart: Callable[[], None] = _ignore_restart,
) -> Plan:
    """The sessions of an open `Recording` as `read_sourced` finds them, cut into units
    of about `size` bytes of whole sessions.

    From each line's key only: a line that matches the recorder's key is taken for a
    record here, and the worker checks that it decodes (else the plan is void).  The
    first pass is `stream_sourced`'s (`in_order` through the window); where a line
    sorts before one released, the reader starts again in exact order
    (`exact_sourced`), and so does the plan, after calling `restart` (the units given
    to `ready` so far are void).
    """
    try:
        cut = _Cut(size, ready)
        stats = _stream(rec, cut, window_lines, window_bytes)
    except NeedsExactOrder:
        restart()
        cut = _Cut(size, ready)
        stats = _exact(rec, cut)
    cut.end()
    stats.records = sum(u.records for u in cut.units)
    stats.sessions = cut.session
    return Plan(rec.files(), cut.units, stats)


def _where(item: tuple[int, int], direct: bool) -> tuple[int, int, bool]:
    """What the plan keeps of a line `in_order` releases: where it lies, and how."""
    return item[0], item[1], direct


def _where_sorted(item: tuple[int, int, int], direct: bool) -> tuple[int, int, bool]:
    """`_where` in exact order, where every line is read with `read` (never direct)."""
    return item[1], item[2], False


def _stream(rec: Recording, release: _Cut, window_lines: int, window_bytes: int) -> ReadStats:
    """`Recording.stream_sourced` on keys."""
    stats = ReadStats(bytes_total=rec.stats.bytes_total)
    lines = keyed_spans(rec.ordered(), stats)
    for session, (start, n, direct), fi in in_order(
        lines, _where, stats, window_lines, window_bytes
    ):
        release(session, fi, start, n, direct)
    return stats


def _exact(rec: Recording, release: _Cut) -> ReadStats:
    """`Recording.exact_sourced` on keys: an index of every line, sorted."""
    stats = ReadStats(bytes_total=rec.stats.bytes_total, exact=True)
    index = index_lines(enumerate(rec.files()), stats)
    for session, (start, n, direct), fi in in_order(
        sorted_index(index), _where_sorted, stats, 0, 0
    ):
        release(session, fi, start, n, direct)
    return stats


# -- the worker ----------------------------------------------------------------


class _Void(Exception):
    """What the plan took for a record did not decode: the plan is not the reader's."""


@dataclass(slots=True)
class _Seen:
    """What `Engine._final` reads of a row's request besides the row."""

    stored_prompt: int
    tools: Tools | None
    """None when it is the engine's cached object of `tools_hash` (shared by requests)."""
    tools_hash: str | None
    t_start: int
    out_tool_names: Any
    num_ctx: int | None


class _Cache(dict[str, Tools]):
    """The engine's tools cache, noting what it made (`exchange._tools_of`)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_names: dict[int, str] = {}
        self.restarted = False

    def __setitem__(self, key: str, value: Tools) -> None:
        super().__setitem__(key, value)
        self.by_names[id(value.names)] = key

    def clear(self) -> None:
        self.restarted = True
        super().clear()


def _by_fields(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    names = tuple(f.name for f in fields(cls))

    def reduce(obj: Any) -> tuple[Any, ...]:
        return cls, tuple([getattr(obj, name) for name in names])

    return reduce


def _reducers() -> dict[type, Callable[[Any], Any]]:
    """Dataclasses pickled as their constructor's arguments: half the time of a state
    dict per object.  Only those whose every field is an argument and that do nothing
    after `__init__` (else the default way)."""
    from llmp.analysis.rows import Loss, Row
    from llmp.apis.base import Counts

    out: dict[type, Callable[[Any], Any]] = dict(copyreg.dispatch_table)
    for cls in (Row, Counts, Loss, RingEntry, _Seen):
        if all(f.init for f in fields(cls)) and not hasattr(cls, "__post_init__"):
            out[cls] = _by_fields(cls)
    out[Between] = _between_args
    return out


def _between_args(b: Between) -> tuple[Any, ...]:
    """`Between` (a plain class) pickled as its constructor's arguments."""
    args = (b.side_calls, b.other_conversations, b.other_domains, b.entries)
    return Between, (*args, b.last_same, b.skipped, b.served, b.conversation)


class _Log:
    """Events, pickled a batch at a time (one memo: the tools, names and models that
    the events of a batch share are written once)."""

    BATCH = 1024

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self.batch: list[tuple[Any, ...]] = []
        self._reducers = _reducers()

    def __call__(self, event: tuple[Any, ...]) -> None:
        batch = self.batch
        batch.append(event)
        if len(batch) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            pickler = pickle.Pickler(self._out, pickle.HIGHEST_PROTOCOL)
            pickler.dispatch_table = self._reducers
            pickler.dump(self.batch)
            self.batch = []


class _LoggingRegistry(ClientRegistry):
    """Tokens for families and keys, and a log of the calls for the real registry."""

    def __init__(self, log: _Log, cache: _Cache) -> None:
        super().__init__()
        self._log = log
        self._cache = cache
        self._n_families = 0
        self._n_keys = 0

    def family_for(self, ua: str | None, names: frozenset[str]) -> int | None:
        if not names:
            return None
        token = self._n_families
        self._n_families += 1
        th = self._cache.by_names.get(id(names))
        self._log(("f", token, ua, names if th is None else None, th))
        return token

    def widen(self, ua: str | None, family: int | None, names: frozenset[str]) -> None:
        if family is not None and names:
            self._log(("w", ua, family, names))

    def name(self, name: str | None, user_agent: str | None) -> None:
        if name != user_agent:
            self._log(("n", name, user_agent))

    def key(self, ua: str | None, family: int | None) -> int:
        token = self._n_keys
        self._n_keys += 1
        self._log(("k", token, ua, family))
        return token


class _LoggedRefusals(Findings):
    def __init__(self, cfg: Config, log: _Log) -> None:
        super().__init__(cfg)
        self._log = log

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        self._log(("r", session, record_id, refusal))


class _UnitEngine(Engine):
    """The engine over one session, whose `_final` logs what it is given."""

    def __init__(self, cfg: Config, log: _Log) -> None:
        super().__init__(cfg, spill=False, summaries=False)
        self._log = log
        self._tools_cache = self.cache = _Cache()
        self.clients = _LoggingRegistry(log, self.cache)
        self.findings = _LoggedRefusals(self.cfg, log)

    def _final(self, fed: Fed) -> None:
        btw = fed.between
        held = self._held
        if btw is not None and held is not None and any(e is held.entry for e in btw.entries):
            btw = _frozen(btw, held.entry)
        ex = fed.exchange
        tools = ex.tools
        th = tools.hash
        cached = th is not None and self.cache.get(th) is tools
        seen = _Seen(
            ex.stored_prompt,
            None if cached else tools,
            th,
            ex.t_start,
            ex.out_tool_names,
            ex.num_ctx,
        )
        self._log(("e", fed.row, btw, seen))


def _frozen(btw: Between, entry: RingEntry) -> Between:
    """`btw` with a copy of the held first turn's ring entry, which the engine changes
    when it proves a side-call (`Engine._decide_held`) after rows that saw it as it
    was: the log is pickled later."""
    copy = RingEntry(
        entry.id,
        entry.served,
        entry.kind,
        entry.conversation,
        entry.shape,
        entry.client,
        entry.model,
    )
    return Between(
        btw.side_calls,
        btw.other_conversations,
        btw.other_domains,
        [copy if e is entry else e for e in btw.entries],
        btw.last_same,
        btw.skipped,
        btw.served,
        btw.conversation,
    )


@dataclass
class _Done:
    """A worker's session: its log, and what the parent sums besides the log."""

    log: str
    conversations: int
    records: int
    start_ms: int | None
    end_ms: int | None
    skipped: Counter[str]
    paths: Counter[str]
    tools: dict[str, Tools]
    void: bool


def _lines(f: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    f.seek(start)
    pos = start
    readline = f.readline
    while pos < end:
        line = readline()
        if not line:
            return
        pos += len(line)
        yield line


def _work(files: list[str], unit: Unit, cfg: Config, fast: bool, log_path: str) -> _Done:
    """Analyse one unit's sessions (in a worker process) into the log at `log_path`."""
    gc.disable()  # as `analyze` does: records make no cycles
    read: Callable[[bytes], Any] = read_record if fast else parse_line
    match = KEY_RE.match
    with open(log_path, "wb", buffering=1 << 20) as out:
        engine = _UnitEngine(cfg, _Log(out))
        void = False
        handles: dict[int, IO[bytes]] = {}
        try:
            for session, fi, start, end, direct in unit.runs:
                f = handles.get(fi)
                if f is None:
                    f = handles[fi] = open(files[fi], "rb")  # closed below
                engine.recording = fi
                for line in _lines(f, start, end):
                    if direct and match(line) is None:
                        parsed = key_and_record(line)[1]
                        assert parsed is not None
                        rec = with_number_text(parsed, line)
                    else:
                        rec = read(line)
                        if rec is None:
                            raise _Void
                    engine.feed(session, rec)
            engine.flush()
            engine._log.flush()
        except _Void:
            void = True
        finally:
            for f in handles.values():
                f.close()
    totals = engine.totals
    return _Done(
        log_path,
        engine.conversations,
        totals.records,
        totals.start_ms,
        totals.end_ms,
        totals.skipped,
        totals.paths,
        dict(engine.cache),
        void or engine.cache.restarted,
    )


# -- the parent ----------------------------------------------------------------


def _batches(path: str) -> Iterator[list[tuple[Any, ...]]]:
    with open(path, "rb", buffering=1 << 20) as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


class _Replay:
    """The one real registry, tools objects and conversation numbers, session after session."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tools: dict[str, Tools] = {}
        """Per tools hash, the one object one process would have cached (its first)."""
        self.offset = 0

    def unit(self, done: _Done) -> None:
        engine = self.engine
        for th, cached in done.tools.items():
            self.tools.setdefault(th, cached)
        registry = engine.clients
        families: dict[int, int | None] = {}
        keys: dict[int, int] = {}
        offset = self.offset
        tools = self.tools
        emit = engine._final
        for event, seen_entries in _events(done.log):
            tag = event[0]
            if tag == "e":
                row, btw, seen = event[1], event[2], event[3]
                row.client = keys[row.client]
                if row.conversation is not None:
                    row.conversation += offset
                if btw is not None:
                    _remap(btw, keys, offset, seen_entries)
                if seen.tools is None:
                    seen.tools = tools[seen.tools_hash]
                emit(Fed(row, btw, cast(Exchange, seen)))
            elif tag == "k":
                fam = event[3]
                keys[event[1]] = registry.key(event[2], None if fam is None else families[fam])
            elif tag == "f":
                names = event[3] if event[4] is None else tools[event[4]].names
                families[event[1]] = registry.family_for(event[2], names)
            elif tag == "w":
                registry.widen(event[1], families[event[2]], event[3])
            elif tag == "n":
                registry.name(event[1], event[2])
            else:  # "r"
                engine.findings.refused(event[1], event[2], event[3])
        self.offset += done.conversations
        engine.conversations = self.offset
        totals = engine.totals
        totals.records += done.records
        for t in (done.start_ms, done.end_ms):
            if t is not None:
                if totals.start_ms is None or t < totals.start_ms:
                    totals.start_ms = t
                if totals.end_ms is None or t > totals.end_ms:
                    totals.end_ms = t
        totals.skipped.update(done.skipped)
        totals.paths.update(done.paths)


def _events(path: str) -> Iterator[tuple[tuple[Any, ...], set[int]]]:
    """The events of a log, each with the ring entries of its batch remapped so far
    (the rows of a batch share entries: each is remapped once)."""
    for batch in _batches(path):
        remapped: set[int] = set()  # ids of objects the batch keeps alive
        for event in batch:
            yield event, remapped


def _remap(btw: Between, keys: dict[int, int], offset: int, done: set[int]) -> None:
    """Ring entries with real client keys and conversation numbers, each entry once;
    the turn's own conversation too (the findings sort `entries` by it)."""
    if id(btw) not in done:
        done.add(id(btw))
        if btw.conversation is not None:
            btw.conversation += offset
    for e in btw.entries:
        if id(e) in done:
            continue
        done.add(id(e))
        e.client = keys[e.client]
        if e.conversation is not None:
            e.conversation += offset


def one_process(reason: str) -> None:
    """Say once on stderr why `--jobs` ran in one process."""
    print(f"llmp analyze: --jobs: {reason}; analysed in one process", file=sys.stderr)


def analyze_parallel(
    paths: Sequence[str],
    cfg: Config | None,
    jobs: int,
    *,
    stdin: IO[bytes] | None = None,
    window_lines: int | None = None,
    rows: bool = True,
    summaries: bool | None = None,
    keep: bool = False,
    fast: bool = True,
    alone: Callable[[list[str]], Analysis],
) -> Analysis:
    """`analyze(...)` with sessions in up to `jobs` processes.

    `alone(files)` is the one-process analysis of the files to read (standard input
    spooled): what runs when the plan proves void (said on stderr) or makes one unit.
    """
    cfg = cfg or Config()
    with (
        Recording(paths, progress=False, stdin=stdin) as rec,
        tempfile.TemporaryDirectory(prefix="llmp-jobs-") as tmp,
        _Pool(jobs, rec.files(), cfg, fast, tmp) as pool,
    ):
        least = int(os.environ.get(UNIT_BYTES_ENV) or UNIT_BYTES)
        size = max(rec.stats.bytes_total // (jobs * UNITS_PER_JOB), least)
        found = plan(
            rec, size, window_lines or WINDOW_LINES, ready=pool.submit, restart=pool.restart
        )
        if len(found.units) < 2:
            return _alone(alone, rec.files(), paths)
        want = not rows if summaries is None else summaries
        engine = Engine(cfg, spill=rows, summaries=want, keep=keep)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            ok = pool.replay(engine)
        except BaseException:
            engine.close()
            raise
        finally:
            if was_enabled:
                gc.enable()
        if not ok:
            engine.close()
            return _alone(alone, rec.files(), paths)
    return Analysis(engine, found.stats, None, list(paths))


def _alone(
    alone: Callable[[list[str]], Analysis], files: list[str], paths: Sequence[str]
) -> Analysis:
    result = alone(files)
    result.paths = list(paths)
    return result


class _Pool:
    """Worker processes, started with the first unit the plan makes ready."""

    def __init__(self, jobs: int, files: list[str], cfg: Config, fast: bool, tmp: str) -> None:
        self.jobs = jobs
        self.files = files
        self.cfg = cfg
        self.fast = fast
        self.tmp = tmp
        self._pool: ProcessPoolExecutor | None = None
        self.futures: list[Future[_Done]] = []
        self._n = 0

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restart()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def submit(self, unit: Unit) -> None:
        pool = self._pool
        if pool is None:
            ctx = multiprocessing.get_context("forkserver" if os.name == "posix" else "spawn")
            if os.name == "posix":
                ctx.set_forkserver_preload(["llmp.analysis.parallel"])  # once, not per worker
            pool = self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx)
        self._n += 1
        log = os.path.join(self.tmp, f"{self._n}.pickle")
        self.futures.append(pool.submit(_work, self.files, unit, self.cfg, self.fast, log))

    def restart(self) -> None:
        """Drop the units submitted so far (what still runs is let finish, unread)."""
        for fut in self.futures:
            fut.cancel()
        self.futures = []

    def replay(self, engine: Engine) -> bool:
        """Each unit's log into `engine`, in order; False when one process must do it."""
        replay = _Replay(engine)
        for fut in self.futures:
            done = fut.result()
            if done.void:
                return self._void("a line that looks like a record does not decode")
            replay.unit(done)
            os.unlink(done.log)
            if len(replay.tools) > TOOLS_CACHED:
                return self._void(f"more than {TOOLS_CACHED} distinct tools arrays")
        return True

    def _void(self, reason: str) -> bool:
        """Say why one process must do it, and leave the workers nothing more to do."""
        one_process(reason)
        self.restart()
        return False


__all__ = ["Plan", "Unit", "analyze_parallel", "one_process", "plan"]
