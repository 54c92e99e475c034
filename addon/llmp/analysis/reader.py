"""Read recordings: bad lines, sessions (R16), several files as one (R17).

The reader yields ``(session, record)`` in the order R16 defines without
holding the file: lines wait in a bounded window keyed by
``(t_start_ms, id)`` and leave it as soon as no later line can sort before
them.  If a line ever proves the window too small, the caller restarts in
exact mode, which sorts a small index of the whole input (see
``docs/analysis.md``, "Ordering without holding the file").
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from llmp.format.lines import (
    KEY_RE,
    is_blank,
    key_and_record,
    line_key,
    matched_key,
    parse_line,
    with_number_text,
)

try:
    from llmp.analysis._keyedlines import KeyedLines
except ImportError:  # not built: `_file_lines` and `keyed` give the same items
    KeyedLines = None  # type: ignore[assignment, misc]

__all__ = [
    "Keyed",
    "NeedsExactOrder",
    "ReadStats",
    "Recording",
    "Sourced",
    "in_order",
    "index_lines",
    "keyed_spans",
    "read_all",
    "read_sourced",
    "sorted_index",
]

WINDOW_LINES = 20_000
WINDOW_BYTES = 64 << 20
_PROGRESS_STEP = 1 << 20
BLOCK = 256 << 10
"""Bytes read at a time (`_file_lines`): ~25 lines of a digest recording.  Larger
blocks cost page faults: the allocator hands each new megabyte back to the system."""


def _file_lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of a file as its iteration gives them (each with its `\n`), read in
    large blocks.

    A block is one read of `BLOCK` bytes, and each line a slice of it: one copy per
    line, which the fast path needs anyway (it cuts and keeps `bytes`), and no copy
    per line into a buffered reader's buffer and out.  A read never faults: a file
    another process truncates while it is read (the recorder trims a partial tail on
    restart) only ends sooner, where a mapped file's missing pages would kill the
    process with SIGBUS.  A line cut by the truncation is what the file now ends
    with: a bad line, as any partial tail.  Lines appended meanwhile are read too.
    """
    read = f.read
    pending: list[bytes] = []  # the start of a line that spans blocks
    while block := read(BLOCK):
        find = block.find
        end = find(b"\n")
        if end < 0:
            pending.append(block)
            continue
        end += 1
        pos = 0
        if pending:
            pending.append(block[:end])
            yield b"".join(pending)
            pending = []
            pos = end
        while (end := find(b"\n", pos)) >= 0:
            end += 1
            yield block[pos:end]
            pos = end
        if pos < len(block):
            pending.append(block[pos:])
    if pending:
        yield b"".join(pending)


Sourced = tuple[int, Any, int]
"""`(session, record, file)`: `file` indexes the paths as given (R17 reads them as one).

The record is what the reader's `read` made of the line: a parsed dict by default
(`format.lines.parse_line`); the analysis reads digest lines its fast way
(`exchange.read_record`)."""


class NeedsExactOrder(Exception):
    """A line sorts before one already released: restart in exact mode."""


@dataclass(slots=True)
class ReadStats:
    """What the reader saw, for `coverage.records` and `coverage.bad_lines`."""

    records: int = 0
    bad_lines: int = 0
    sessions: int = 0
    exact: bool = False
    bytes_total: int = 0


@dataclass(slots=True)
class _Input:
    path: str
    size: int
    first_key: tuple[int, int] | None = None


class _Progress:
    """Bytes read, on stderr with rich; a no-op when not wanted."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._done = 0
        self._shown = 0
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("reading", total=total)

    @property
    def shown(self) -> bool:
        """Whether there is a bar to advance."""
        return self._bar is not None

    def restart(self, description: str, total: int) -> None:
        if self._bar is not None:
            self._bar.reset(self._task, total=total, description=description)
        self._done = self._shown = 0

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None and self._done - self._shown >= _PROGRESS_STEP:
            self._bar.update(self._task, completed=self._done)
            self._shown = self._done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@dataclass
class Recording:
    """One or more recording files (or `-`), read as one recording (R17).

    Use as a context manager: standard input is copied to a temporary file so
    that exact mode can read it again.
    """

    paths: Sequence[str]
    progress: bool | None = None
    window_lines: int = WINDOW_LINES
    window_bytes: int = WINDOW_BYTES
    stdin: IO[bytes] | None = None
    read: Callable[[bytes | memoryview], Any] = parse_line
    """How a line becomes a record (None: a bad line); lines parsed already to find
    their sort key (another producer's key order) stay parsed dicts."""
    stats: ReadStats = field(default_factory=ReadStats)
    _inputs: list[_Input] = field(default_factory=list)
    _spool: str | None = None
    _bar: _Progress | None = None

    def __enter__(self) -> Recording:
        for path in self.paths:
            if path == "-":
                path = self._spool_stdin()
            self._inputs.append(_Input(path, os.path.getsize(path)))
        self.stats.bytes_total = sum(i.size for i in self._inputs)
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        self._bar = _Progress(bool(show), self.stats.bytes_total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._spool is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._spool)
            self._spool = None

    def _spool_stdin(self) -> str:
        if self._spool is not None:
            return self._spool  # `-` given twice reads the same input
        src = self.stdin if self.stdin is not None else sys.stdin.buffer
        fd, name = tempfile.mkstemp(prefix="llmp-stdin-", suffix=".jsonl")
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        self._spool = name
        return name

    # -- ordering -------------------------------------------------------

    def _ordered_inputs(self) -> list[tuple[int, _Input]]:
        """Inputs by the key of their first good line, so that files given
        out of date order do not force exact mode."""
        for inp in self._inputs:
            with open(inp.path, "rb") as f:
                for line in f:
                    if is_blank(line):
                        continue
                    inp.first_key = line_key(line)
                    if inp.first_key is not None:
                        break
        far = (1 << 63, 1 << 63)
        return sorted(enumerate(self._inputs), key=lambda p: (p[1].first_key or far, p[0]))

    def ordered(self) -> list[tuple[int, str]]:
        """The files in the order `stream_sourced` reads them: (index in `paths`, file)."""
        return [(fi, inp.path) for fi, inp in self._ordered_inputs()]

    def files(self) -> list[str]:
        """The file read for each of `paths` (standard input spooled), in their order."""
        return [inp.path for inp in self._inputs]

    def stream(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Records in R16 order through a bounded window.

        Raises NeedsExactOrder when a line sorts before one already yielded;
        the caller discards its work and calls `exact()`.
        """
        for session, rec, _ in self.stream_sourced():
            yield session, rec

    def exact(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Records in R16 order by sorting an index of every line."""
        for session, rec, _ in self.exact_sourced():
            yield session, rec

    def stream_sourced(self) -> Iterator[Sourced]:
        """`stream()`, each record with the index of the file it came from.

        `in_order` itself, not a generator around it: one frame less per record."""
        self.stats = ReadStats(bytes_total=self.stats.bytes_total)
        bar = self._bar or _Progress(False, 0)
        bar.restart("reading", self.stats.bytes_total)
        return in_order(
            self._keyed_lines(bar), self._take, self.stats, self.window_lines, self.window_bytes
        )

    def _keyed_lines(self, bar: _Progress) -> Iterator[Keyed]:
        """Every line of the files in `ordered` order with its key, bar bad and blank ones.

        The item is the line, or `(line, parsed)` when finding its key took a parse
        (another producer's key order): `_take` keeps that parse for a line that
        leaves the window at once.  `_keyedlines.KeyedLines` (C) splits the lines
        and reads the recorder's plainest keys; every other line goes to `keyed`."""
        match = KEY_RE.match
        stats = self.stats
        advance = bar.advance if bar.shown else None

        def keyed(line: bytes, fi: int) -> Keyed | None:
            m = match(line)
            if m is not None:  # the recorder's way: the key without a parse
                key = matched_key(m)
                if key is None:
                    stats.bad_lines += 1
                    return None
                return key, line, len(line), fi
            if is_blank(line):
                return None
            key, parsed = key_and_record(line)
            if key is None:
                stats.bad_lines += 1
                return None
            return key, (line, parsed), len(line), fi

        for fi, inp in self._ordered_inputs():
            with open(inp.path, "rb", buffering=0) as f:
                if KeyedLines is not None:
                    yield from KeyedLines(f.read, BLOCK, fi, partial(keyed, fi=fi), advance)
                    continue
                for line in _file_lines(f):
                    if advance is not None:
                        advance(len(line))
                    item = keyed(line, fi)
                    if item is not None:
                        yield item

    def _take(self, item: bytes | tuple[bytes, Any], direct: bool) -> Any:
        """The record a line becomes (`read`), or None for a bad line (counted)."""
        if isinstance(item, tuple):
            line, parsed = item
            rec = with_number_text(parsed, line) if direct else self.read(line)
        else:
            rec = self.read(item)
        if rec is None:
            self.stats.bad_lines += 1
        else:
            self.stats.records += 1
        return rec

    def exact_sourced(self) -> Iterator[Sourced]:
        """`exact()`, each record with the index of the file it came from."""
        self.stats = ReadStats(bytes_total=self.stats.bytes_total, exact=True)
        bar = self._bar or _Progress(False, 0)
        bar.restart("indexing", self.stats.bytes_total)
        paths = enumerate(inp.path for inp in self._inputs)
        index = index_lines(paths, self.stats, bar.advance if bar.shown else None)
        bar.restart("analysing", self.stats.bytes_total)
        files = [open(inp.path, "rb") for inp in self._inputs]
        take = self._take

        def read_at(item: tuple[int, int, int], direct: bool) -> Any:
            fi, off, n = item
            f = files[fi]
            f.seek(off)
            bar.advance(n)
            return take(f.read(n), False)

        try:
            yield from in_order(sorted_index(index), read_at, self.stats, 0, 0)
        finally:
            for f in files:
                f.close()


Keyed = tuple[tuple[int, int], Any, int, int]
"""`(key, item, size, file)`: a line offered to `in_order`: its sort key
`(t_start_ms, id)`, what `take` makes a record of, its bytes (the window counts
them) and the index of its file."""


def in_order(
    lines: Iterable[Keyed],
    take: Callable[[Any, bool], Any],
    stats: ReadStats,
    window_lines: int,
    window_bytes: int,
) -> Iterator[Sourced]:
    """R16, written once: records in `(t_start_ms, id)` order, numbered by session.

    Lines wait in a window of at most `window_lines` lines and `window_bytes` bytes,
    and leave it as soon as no later line can sort before them: the line is the
    next of its session (id 1, or one more than the last id released), or the
    window is full.  A line that sorts before one released raises NeedsExactOrder.
    Each line leaves through `take(item, direct)`, which says what it became: None
    for a line that is no record (it counts for nothing here); `direct` says it
    left at once, never held.  A new session starts wherever a record's id fails
    to increase.  Sets `stats.sessions`.

    Both readings use it: the reader's (`take` reads the record) and the plan of
    `--jobs` (`take` notes where the line lies), and exact mode feeds it the whole
    input sorted (`sorted_index`), which then never waits out of order.
    """
    heap: list[tuple[int, int, int, Any, int, int]] = []
    held = seq = session = 0
    last_key: tuple[int, int] | None = None
    last_id: int | None = None
    it = iter(lines)
    more = True
    while more:
        for key, item, n, fi in it:
            if last_key is not None and key < last_key:
                raise NeedsExactOrder
            rid = key[1]
            if not heap and (rid == 1 or (last_id is not None and rid == last_id + 1)):
                # The usual case: the next record, in order; no need to wait.
                rec = take(item, True)
                if rec is None:
                    continue
                if last_id is None or rid <= last_id:  # R16 step 2
                    session += 1
                last_key, last_id = key, rid
                yield session, rec, fi
                continue
            seq += 1
            heapq.heappush(heap, (key[0], rid, seq, item, n, fi))
            held += n
            break
        else:
            more = False  # the end: everything held leaves
        while heap:
            rid = heap[0][1]
            if more and not (
                rid == 1
                or (last_id is not None and rid == last_id + 1)
                or len(heap) > window_lines
                or held > window_bytes
            ):
                break
            t, rid, _, item, n, fi = heapq.heappop(heap)
            held -= n
            rec = take(item, False)
            if rec is None:
                continue
            if last_id is None or rid <= last_id:  # R16 step 2
                session += 1
            last_key, last_id = (t, rid), rid
            yield session, rec, fi
    stats.sessions = session


SPAN_BLOCK = 4 << 20
"""Bytes read at a time by `_spans` (a key scan keeps no line)."""
BLANK = (0, -1)
"""What `_key` says of a blank line (the reader skips those without counting them)."""


def _spans(f: IO[bytes]) -> Iterator[tuple[int, int, bytes, int]]:
    """Each line of a file as the reader splits them (the last maybe without its `\n`):
    its offset and length, and a block that holds it at a position (no bytes object
    per line: most lines only have their key matched in place)."""
    buf = b""
    pos = base = 0  # base: the file offset of buf[0]
    while chunk := f.read(SPAN_BLOCK):
        base += pos
        buf = buf[pos:] + chunk if pos < len(buf) else chunk
        pos = 0
        find = buf.find
        while (end := find(b"\n", pos)) >= 0:
            end += 1
            yield base + pos, end - pos, buf, pos
            pos = end
    if pos < len(buf):
        yield base + pos, len(buf) - pos, buf, pos


def _key(
    buf: bytes, pos: int, n: int, match: Callable[[bytes, int], re.Match[bytes] | None]
) -> tuple[int, int] | None:
    """`format.lines.line_key` of the line at `pos`; `BLANK` (by identity) for a blank one."""
    m = match(buf, pos)
    if m is not None:
        return matched_key(m)
    line = buf[pos : pos + n]
    if is_blank(line):
        return BLANK
    return key_and_record(line)[0]


def keyed_spans(
    files: Iterable[tuple[int, str]],
    stats: ReadStats,
    advance: Callable[[int], None] | None = None,
) -> Iterator[Keyed]:
    """The lines of the files with their keys, as `Recording` offers them to `in_order`
    (bad lines counted, blank ones skipped); each item is `(offset, size)`.  A key
    scan: lines are matched in place, no bytes object made for most.  `advance` is
    given each line's size (a progress bar)."""
    match = KEY_RE.match
    for fi, path in files:
        with open(path, "rb") as f:
            for start, n, buf, pos in _spans(f):
                if advance is not None:
                    advance(n)
                key = _key(buf, pos, n, match)
                if key is None:
                    stats.bad_lines += 1
                elif key is not BLANK:
                    yield key, (start, n), n, fi


def index_lines(
    files: Iterable[tuple[int, str]],
    stats: ReadStats,
    advance: Callable[[int], None] | None = None,
) -> list[tuple[int, int, int, int, int]]:
    """Exact mode's index of every line, `(t_start_ms, id, file, offset, size)`, for
    `sorted_index` (the reader's and the plan's)."""
    return [
        (key[0], key[1], fi, start, n)
        for key, (start, n), n, fi in keyed_spans(files, stats, advance)
    ]


def sorted_index(index: list[tuple[int, int, int, int, int]]) -> Iterator[Keyed]:
    """An index of every line, `(t_start_ms, id, file, offset, size)`, sorted and
    offered to `in_order` (exact mode): each item is `(file, offset, size)`."""
    index.sort()
    for t, rid, fi, off, n in index:
        yield (t, rid), (fi, off, n), n, fi


def read_all(
    paths: Sequence[str],
    consume: Callable[[Iterator[tuple[int, dict[str, Any]]]], Any],
    *,
    progress: bool | None = None,
    stdin: IO[bytes] | None = None,
    window_lines: int = WINDOW_LINES,
    window_bytes: int = WINDOW_BYTES,
) -> tuple[Any, ReadStats]:
    """Run `consume` over `(session, record)`, restarting it in exact mode if needed
    (`read_sourced` without the file of each record).

    `consume` must start from scratch each time it is called.
    """

    def pairs(records: Iterator[Sourced]) -> Any:
        return consume((session, rec) for session, rec, _ in records)

    return read_sourced(
        paths,
        pairs,
        progress=progress,
        stdin=stdin,
        window_lines=window_lines,
        window_bytes=window_bytes,
    )


def read_sourced(
    paths: Sequence[str],
    consume: Callable[[Iterator[Sourced]], Any],
    *,
    progress: bool | None = None,
    stdin: IO[bytes] | None = None,
    window_lines: int = WINDOW_LINES,
    window_bytes: int = WINDOW_BYTES,
    read: Callable[[bytes | memoryview], Any] = parse_line,
) -> tuple[Any, ReadStats]:
    """Run `consume` over the records, each with the index in `paths` of the file it
    came from, restarting it in exact mode if needed (`consume` must start from
    scratch each time it is called).

    A session can span files (R17 joins them by id), so the file is the
    record's, not the session's: `--rows` names it in its `recording` column.
    `read` is how a line becomes a record (`Recording.read`).
    """
    with Recording(
        paths,
        progress=progress,
        stdin=stdin,
        window_lines=window_lines,
        window_bytes=window_bytes,
        read=read,
    ) as rec:
        try:
            result = consume(rec.stream_sourced())
        except NeedsExactOrder:
            result = consume(rec.exact_sourced())
        return result, rec.stats
