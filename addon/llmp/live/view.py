"""The recorder's live view: the analysis engine, fed each record as it is written.

The writer thread calls `LiveView.on_record` with every record right after
writing it.  Records reach the writer when their exchange *ends*, not in id
order, so a small reorder buffer releases them in id order to the very
`Engine` that `llmp analyze` runs: a live verdict is the report's verdict,
not a second copy of the linking and loss logic.

Each row becomes one event: a flat dict with the LLMP_TURN fields
(`TURN_FIELDS`, the contract in docs/live.md).  The event is logged as one
line, kept in a bounded ring for `GET /_llmp/summary`, and appended to the
optional event files.  Nothing here holds message text: only counts, client
labels, model names and causes.

Pure: no mitmproxy import; `llmp.recorder.addon` wires it in.
"""

from __future__ import annotations

import csv
import heapq
import io
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from llmp.analysis.classify import SIDE_CALL, STATELESS, TURN
from llmp.analysis.config import Config
from llmp.analysis.engine import Engine
from llmp.analysis.loss import STRUCTURAL, UNDETERMINED, Between
from llmp.analysis.render import CAUSE_WORDS, SHAPE_WORDS, duration, join_names, short_model
from llmp.analysis.rows import Loss, LossByCause, Row
from llmp.format.lockfile import RecordingError, close_locked, open_locked, write_all
from llmp.format.measure import MV, Sum, clean, weakest

log = logging.getLogger("llmp")

VERSION = 1
"""Version of the LLMP_TURN and LLMP_SUMMARY objects and of the summary endpoint."""

RESERVED_PREFIX = "/_llmp/"
"""Paths the addon answers itself: never forwarded upstream, never recorded."""
SUMMARY_PATH = "/_llmp/summary"
TURN_TAG = "LLMP_TURN"
SUMMARY_TAG = "LLMP_SUMMARY"
SESSION = 1  # one proxy process is one session (R16)
LINE_ATTR = "llmp_live_line"
"""Set on the log record of every per-request line (see `llmp.recorder.addon`)."""
_LINE = {LINE_ATTR: True}
MIB = 1024 * 1024

#: The LLMP_TURN fields, in order; also the CSV columns.  Every value is a
#: scalar (or null, meaning not measured), so one list serves both encodings.
TURN_FIELDS: tuple[str, ...] = (
    "v",
    "id",
    "t_start_ms",
    "kind",
    "side_call_shape",
    "client",
    "model",
    "served_model",
    "conversation",
    "turn",
    "linked_to",
    "new_conversation",
    "compaction",
    "break_cause",
    "prompt_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "completion_tokens",
    "prefill_ms",
    "decode_ms",
    "load_ms",
    "counts_source",
    "reuse",
    "predicted_reuse",
    "loss_measured",
    "cause",
    "lost_tokens",
    "lost_ms",
    "lost_client_cause",
    "lost_client_tokens",
    "lost_client_ms",
    "lost_external_cause",
    "lost_external_tokens",
    "lost_external_ms",
    "side_calls_between",
    "other_conversations_between",
    "other_models_between",
    "cause_text",
    "warn",
)


class LiveError(Exception):
    """An event file cannot be used; the message says why, in one line."""


@dataclass(frozen=True)
class LiveConfig:
    """What the live view is asked to do (from the recorder's options)."""

    warn_ms: float = 2000
    warn_tokens: int = 2000
    events: str = ""
    events_csv: str = ""
    ring: int = 256
    reorder_records: int = 1000
    reorder_bytes: int = 64 * MIB
    max_clients: int = 256


# -- reordering --------------------------------------------------------------


def _weight(rec: dict[str, Any]) -> int:
    """Bytes of the bodies a waiting record holds (full mode); digests count as nothing."""
    w = 0
    for part in (rec.get("request"), rec.get("response")):
        if isinstance(part, dict) and (
            part.get("body") is not None or part.get("body_text") is not None
        ):
            n = part.get("body_bytes")
            if type(n) is int:
                w += n
    return w


class Reorder:
    """Releases records in id order.

    Ids are given when a request arrives and every exchange yields exactly
    one record, so waiting for a missing id is safe.  The wait is still
    bounded (a record lost to a crash must not stall the view forever): with
    more than `max_records` records, or `max_bytes` of full bodies, waiting,
    the smallest waiting id is released and the missing ids before it are
    given up.  A record that arrives after its id was given up is left out:
    feeding it late would put it after rows it preceded.
    """

    def __init__(
        self, first_id: int = 1, max_records: int = 1000, max_bytes: int = 64 * MIB
    ) -> None:
        self.next_id = first_id
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.bytes = 0
        self.gave_up = 0  # missing ids skipped
        self.late = 0  # records left out: their id was already passed
        self._ids: list[int] = []
        self._waiting: dict[int, tuple[dict[str, Any], int]] = {}

    @property
    def waiting(self) -> int:
        return len(self._ids)

    def push(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one record; the records now ready, in id order."""
        rid = rec.get("id")
        if rid == self.next_id and not self._ids and type(rid) is int:
            self.next_id += 1  # the usual case: nothing waits, and this is the next id
            return [rec]
        if type(rid) is not int or rid < self.next_id or rid in self._waiting:
            self.late += 1
            return []
        w = _weight(rec)
        self._waiting[rid] = (rec, w)
        heapq.heappush(self._ids, rid)
        self.bytes += w
        out: list[dict[str, Any]] = []
        self._release(out)
        while self._ids and (len(self._ids) > self.max_records or self.bytes > self.max_bytes):
            self._skip_to(self._ids[0])
            self._release(out)
        return out

    def flush(self) -> list[dict[str, Any]]:
        """Everything still waiting, in id order (at shutdown)."""
        out: list[dict[str, Any]] = []
        while self._ids:
            self._skip_to(self._ids[0])
            self._release(out)
        return out

    def _skip_to(self, rid: int) -> None:
        self.gave_up += rid - self.next_id
        self.next_id = rid

    def _release(self, out: list[dict[str, Any]]) -> None:
        ids = self._ids
        while ids and ids[0] == self.next_id:
            rid = heapq.heappop(ids)
            rec, w = self._waiting.pop(rid)
            self.bytes -= w
            out.append(rec)
            self.next_id += 1


# -- one row, as an event and a line ------------------------------------------


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ordered_losses(row: Row) -> tuple[Loss | None, Loss | None]:
    """The loss that gave the row its cause, then the other one."""
    if row.cause == STRUCTURAL or row.lost_external is None:
        return row.lost_client, row.lost_external
    return row.lost_external, row.lost_client


def between_text(row: Row, btw: Between | None, label: Callable[[int], str]) -> str | None:
    """What ran between a turn and the turn it links to, e.g.
    "2 side-calls from aider/0.86 ran in between"; None when nothing did."""
    if btw is None or not btw.entries:
        return None
    by_id = {e.id: e for e in btw.entries}
    parts: list[str] = []
    side = [by_id[i] for i in row.side_calls_between if i in by_id]
    if side:
        who = join_names(_unique(label(e.client) for e in side))
        parts.append(f"{_count(len(side), 'side-call')} from {who}")
    other = [by_id[i] for i in row.other_conversations_between if i in by_id]
    if other:
        who = join_names(_unique(label(e.client) for e in other))
        parts.append(f"{_count(len(other), 'request')} of other conversations from {who}")
    models = [by_id[i] for i in row.other_domains_between if i in by_id]
    if models:
        names = join_names(_unique(short_model(e.served) for e in models))
        parts.append(f"{_count(len(models), 'request')} to {names}")
    if not parts:
        return None
    return f"{join_names(parts)} ran in between"


def cause_text(row: Row, btw: Between | None, label: Callable[[int], str]) -> str | None:
    """The cause of a turn's loss in the readable report's words, and what ran in between."""
    first, second = _ordered_losses(row)
    if first is None:
        first, second = second, None
    if first is None:
        return None
    text = CAUSE_WORDS.get(first.cause, first.cause)
    if second is not None:
        text += f", and {CAUSE_WORDS.get(second.cause, second.cause)}"
    if row.cause == UNDETERMINED:
        text += " (or a failed chat request in between evicted it)"
    ran = between_text(row, btw, label)
    if ran is not None:
        text += f"; {ran}"
    return text


def _int(mv: MV | None) -> int | None:
    return None if mv is None else int(mv[0])


def _val(mv: MV | None) -> float | None:
    return None if mv is None else mv[0]


def _loss_ms(loss: Loss | None) -> float | None:
    return None if loss is None or loss.ms is None else loss.ms[0]


def turn_event(row: Row, btw: Between | None, label: Callable[[int], str]) -> dict[str, Any]:
    """The LLMP_TURN object of a row (without `warn`, which the thresholds decide)."""
    c = row.counts
    losses = [x for x in (row.lost_client, row.lost_external) if x is not None]
    lost_tokens: int | None
    lost_ms: float | None
    if row.kind != TURN:
        lost_tokens = lost_ms = None  # side-calls and stateless rows are compared with nothing
    elif losses:
        lost_tokens = sum(x.tokens for x in losses)
        timed = [x.ms[0] for x in losses if x.ms is not None]
        lost_ms = clean(sum(timed)) if len(timed) == len(losses) else None
    elif row.loss_measured:
        lost_tokens, lost_ms = 0, 0
    else:
        lost_tokens = lost_ms = None
    prompt, reused, evaluated, prefill = (
        c.prompt_tokens,
        c.reused_tokens,
        c.evaluated_tokens,
        c.prefill_ms,
    )
    sources = [mv[1] for mv in (prompt, reused, evaluated, prefill) if mv is not None]
    lc, le = row.lost_client, row.lost_external
    return {
        "v": VERSION,
        "id": row.id,
        "t_start_ms": row.t_start_ms,
        "kind": row.kind,
        "side_call_shape": row.side_call_shape,
        "client": label(row.client),
        "model": row.model,
        "served_model": row.served,
        "conversation": row.conversation,
        "turn": row.turn,
        "linked_to": row.linked_to,
        "new_conversation": row.new_conversation,
        "compaction": row.compaction,
        "break_cause": row.break_cause,
        "prompt_tokens": None if prompt is None else int(prompt[0]),
        "reused_tokens": None if reused is None else int(reused[0]),
        "evaluated_tokens": None if evaluated is None else int(evaluated[0]),
        "completion_tokens": _int(c.completion_tokens),
        "prefill_ms": None if prefill is None else prefill[0],
        "decode_ms": _val(c.decode_ms),
        "load_ms": _val(c.load_ms),
        "counts_source": weakest(*sources) if sources else None,
        "reuse": row.observed_reuse,
        "predicted_reuse": row.predicted_reuse,
        "loss_measured": row.loss_measured,
        "cause": row.cause,
        "lost_tokens": lost_tokens,
        "lost_ms": lost_ms,
        "lost_client_cause": None if lc is None else lc.cause,
        "lost_client_tokens": None if lc is None else lc.tokens,
        "lost_client_ms": _loss_ms(lc),
        "lost_external_cause": None if le is None else le.cause,
        "lost_external_tokens": None if le is None else le.tokens,
        "lost_external_ms": _loss_ms(le),
        "side_calls_between": len(row.side_calls_between),
        "other_conversations_between": len(row.other_conversations_between),
        "other_models_between": len(row.other_domains_between),
        "cause_text": cause_text(row, btw, label) if losses else None,
        "warn": False,
    }


def over_threshold(ev: dict[str, Any], warn_ms: float, warn_tokens: int) -> bool:
    """A turn lost more than either threshold (tokens, or ms when timed)."""
    tokens = ev.get("lost_tokens")
    if ev.get("kind") != TURN or not tokens:
        return False
    ms = ev.get("lost_ms")
    return bool(tokens > warn_tokens or (ms is not None and ms > warn_ms))


def request_line(ev: dict[str, Any]) -> str:
    """The log line of one event, e.g.
    `llmp: aider/0.86 conv 2 turn 5: 12,304 prompt tokens, 97% reused, prefill 310 ms`."""
    kind = ev["kind"]
    who = ev["client"]
    if kind == TURN:
        head = f"{who} conv {ev['conversation']} turn {ev['turn']}"
    elif kind == SIDE_CALL:
        shape = ev.get("side_call_shape")
        head = f"{who} side-call" + (f", {SHAPE_WORDS.get(shape, shape)}" if shape else "")
    else:
        head = f"{who} {STATELESS} request"
    prompt = ev["prompt_tokens"]
    facts = [f"{prompt:,} prompt tokens" if prompt is not None else "prompt tokens not reported"]
    if kind == TURN:
        reuse = ev["reuse"]
        facts.append(f"{reuse:.0%} reused" if reuse is not None else "reuse not reported")
    facts.append(f"prefill {duration(ev['prefill_ms'])}")
    line = f"{head}: {', '.join(facts)}"
    lost = ev.get("lost_tokens")
    if lost:
        line += f"; lost {lost:,} tokens ({duration(ev['lost_ms'])}): {ev['cause_text']}"
    return ("llmp: warning: " if ev.get("warn") else "llmp: ") + line


# -- event files ---------------------------------------------------------------


class _LineFile:
    """An append-only file of whole lines: created 0600, locked, one write per line.

    A failed write stops this file (logged once); recording goes on.
    """

    def __init__(self, path: str, option: str) -> None:
        self.path = path
        self.option = option
        self.failed = False
        try:
            self.fd = open_locked(path, option, "choose another file")
        except RecordingError as exc:
            raise LiveError(str(exc)) from None
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":
            self.write(b"\n")  # close a partial line left by something else

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        if self.fd < 0 or self.failed:
            return
        try:
            write_all(self.fd, data)
        except OSError as exc:
            self.failed = True
            log.error(
                "llmp: stopped writing %s to %s: %s; recording goes on",
                self.option,
                self.path,
                exc.strerror or exc,
            )

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            close_locked(fd)


class EventFile(_LineFile):
    """`LLMP_TURN {json}` per analysed request, `LLMP_SUMMARY {json}` at shutdown."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "llmp_events")

    def put(self, tag: str, obj: dict[str, Any]) -> None:
        self.write(tag.encode() + b" " + orjson.dumps(obj) + b"\n")


def csv_cell(value: Any) -> Any:
    """Empty for null, `true`/`false` for booleans: the JSON reading of each value."""
    if value is None:
        return ""
    if value is True:
        return "true"
    if value is False:
        return "false"
    return value


class CsvFile(_LineFile):
    """The LLMP_TURN fields as CSV, with a header row; read by column name."""

    HEADER = (",".join(TURN_FIELDS) + "\n").encode()

    def __init__(self, path: str) -> None:
        super().__init__(path, "llmp_events_csv")
        if self.size() == 0:
            self.write(self.HEADER)
            return
        with open(path, "rb") as fh:
            first = fh.readline()
        if first != self.HEADER:
            self.close()
            raise LiveError(
                f"llmp_events_csv {path!r} already holds other columns; choose another file"
            )

    def put(self, ev: dict[str, Any]) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(csv_cell(ev.get(f)) for f in TURN_FIELDS)
        self.write(buf.getvalue().encode())


# -- aggregates --------------------------------------------------------------


@dataclass
class _Agg:
    """Sums over rows, as the report sums them (`time`, `coverage`)."""

    requests: int = 0
    turns: int = 0
    side_calls: int = 0
    stateless: int = 0
    conversations: int = 0
    turns_with_timing: int = 0
    prompt_tokens: int | None = None
    reuse_prompt: int = 0  # prompt and reused tokens of turns that reported both
    reuse_reused: int = 0
    prefill: Sum = field(default_factory=Sum)
    lost_tokens: int = 0
    lost_ms: Sum = field(default_factory=Sum)
    warnings: int = 0

    def add(self, row: Row, ev: dict[str, Any]) -> None:
        self.requests += 1
        if row.kind == TURN:
            self.turns += 1
            self.conversations += row.turn == 1
            self.turns_with_timing += row.counts.prefill_ms is not None
            if ev["prompt_tokens"] is not None and ev["reused_tokens"] is not None:
                self.reuse_prompt += ev["prompt_tokens"]
                self.reuse_reused += ev["reused_tokens"]
        elif row.kind == SIDE_CALL:
            self.side_calls += 1
        else:
            self.stateless += 1
        if ev["prompt_tokens"] is not None:
            self.prompt_tokens = (self.prompt_tokens or 0) + ev["prompt_tokens"]
        self.prefill.add(row.counts.prefill_ms)
        for loss in (row.lost_client, row.lost_external):
            if loss is not None:
                self.lost_tokens += loss.tokens
                self.lost_ms.add(loss.ms)
        self.warnings += bool(ev["warn"])

    def as_json(self) -> dict[str, Any]:
        prefill = self.prefill.result()
        lost = self.lost_ms.result()
        lost_ms: float | None = None
        if self.turns_with_timing:  # as the report: timed, and nothing lost, is 0
            lost_ms = lost[0] if lost is not None else 0
        return {
            "requests": self.requests,
            "turns": self.turns,
            "side_calls": self.side_calls,
            "stateless": self.stateless,
            "conversations": self.conversations,
            "prompt_tokens": self.prompt_tokens,
            "reuse": round(self.reuse_reused / self.reuse_prompt, 4) if self.reuse_prompt else None,
            "prefill_ms": None if prefill is None else prefill[0],
            "lost_tokens": self.lost_tokens,
            "lost_ms": lost_ms,
            "warnings": self.warnings,
        }


# -- the live view -----------------------------------------------------------


class LiveView:
    """The engine run incrementally on the recorder's records.

    `on_record` runs on one thread (the builder child's, or the writer's);
    `summary_json` on another.  One lock guards the engine and the
    aggregates; file and log output happen outside it, so a slow terminal
    never holds up a summary request.  `say` gets each per-request line with
    its level; by default it is logged, marked with `LINE_ATTR`.
    """

    def __init__(
        self,
        cfg: LiveConfig | None = None,
        *,
        body: str = "digest",
        first_id: int = 1,
        analysis: Config | None = None,
        clock: Callable[[], float] = time.time,
        say: Callable[[int, str], None] | None = None,
    ) -> None:
        self.cfg = cfg or LiveConfig()
        self.body = body
        self._clock = clock
        self._say = say or _log_line
        self.started_ms = self._now()
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._closed = False
        # Rows only: no totals, findings or summaries to grow while a proxy runs for days.
        self.engine = Engine(analysis, spill=False, summaries=False, report=False)
        self.reorder = Reorder(first_id, self.cfg.reorder_records, self.cfg.reorder_bytes)
        self.ring: deque[dict[str, Any]] = deque(maxlen=max(1, self.cfg.ring))
        self.records = 0
        self.errors = 0
        self.totals = _Agg()
        self.losses = LossByCause()
        self.clients: dict[int, _Agg] = {}
        self._events: EventFile | None = None
        self._csv: CsvFile | None = None
        try:
            if self.cfg.events:
                self._events = EventFile(self.cfg.events)
            if self.cfg.events_csv:
                self._csv = CsvFile(self.cfg.events_csv)
        except LiveError:
            if self._events is not None:
                self._events.close()
            raise

    def _now(self) -> int:
        return int(self._clock() * 1000)

    # -- input (writer thread) ----------------------------------------------

    def on_record(self, rec: dict[str, Any]) -> None:
        """One written record.  Never raises: the recording must not notice the live view."""
        try:
            self._on_record(rec)
        except Exception:
            self._failed(rec)

    def _failed(self, rec: dict[str, Any]) -> None:
        self.errors += 1
        if self.errors <= 3:
            log.exception("llmp: live view failed on record %s; recording goes on", rec.get("id"))

    def _on_record(self, rec: dict[str, Any]) -> None:
        events: list[dict[str, Any]] = []
        with self._lock:
            if self._closed:
                return
            before = self.reorder.gave_up
            released = self.reorder.push(rec)
            skipped = self.reorder.gave_up - before
            if len(released) == 1:  # the usual case: analyse it under the same lock
                ev = self._feed(released[0])
                released = []
                if ev is not None:
                    events.append(ev)
        for r in released:
            # One record per lock: a burst (the bound overflowing) never holds
            # a summary request, and so the event loop, for long.
            with self._lock:
                if self._closed:
                    break
                ev = self._feed(r)
            if ev is not None:
                events.append(ev)
        if skipped:
            log.info(
                "llmp: live view: gave up waiting for %s after %d later ones; "
                "going on without (llmp analyze places every record)",
                _count(skipped, "record"),
                len(released),
            )
        for ev in events:
            self._emit(ev)

    def _feed(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """Analyse one record in id order; its event, or None when it is no row."""
        try:
            return self._analyse(rec)
        except Exception:  # one bad record must not cost the records released with it
            self._failed(rec)
            return None

    def _analyse(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        fed = self.engine.feed(SESSION, rec)
        self.records += 1
        if fed is None:
            return None
        row = fed.row
        ev = turn_event(row, fed.between, self.engine.clients.label)
        ev["warn"] = over_threshold(ev, self.cfg.warn_ms, self.cfg.warn_tokens)
        self.totals.add(row, ev)
        client = self.clients.get(row.client)
        if client is None and len(self.clients) < self.cfg.max_clients:
            client = self.clients[row.client] = _Agg()
        if client is not None:
            client.add(row, ev)
        self.losses.add(row)
        self.ring.append(ev)
        return ev

    def _emit(self, ev: dict[str, Any]) -> None:
        self._say(logging.WARNING if ev["warn"] else logging.INFO, request_line(ev))
        with self._io_lock:
            if self._events is not None:
                self._events.put(TURN_TAG, ev)
            if self._csv is not None:
                self._csv.put(ev)

    # -- output --------------------------------------------------------------

    def summary(self, recent: bool = True) -> dict[str, Any]:
        """The summary v1 (docs/live.md); `recent` adds the ring of recent events."""
        with self._lock:
            return self._summary(recent)

    def summary_json(self) -> bytes:
        """The body of `GET /_llmp/summary`."""
        return orjson.dumps(self.summary(recent=True))

    def _summary(self, recent: bool) -> dict[str, Any]:
        label = self.engine.clients.label
        clients: dict[str, dict[str, Any]] = {}
        merged: dict[str, _Agg] = {}
        for key, agg in self.clients.items():
            name = label(key)
            m = merged.get(name)
            if m is None:
                merged[name] = m = _Agg()
            _merge(m, agg)
        for name, agg in merged.items():
            clients[name] = {"client": name, **agg.as_json()}
        out: dict[str, Any] = {
            "v": VERSION,
            "started_ms": self.started_ms,
            "now_ms": self._now(),
            "body": self.body,
            "warn_ms": self.cfg.warn_ms,
            "warn_tokens": self.cfg.warn_tokens,
            "records": self.records,
            **self.totals.as_json(),
            "by_cause": {
                cause: {"tokens": c.tokens, "ms": _sum_value(c.ms), "rows": c.rows}
                for cause, c in self.losses.by_cause()
            },
            "clients": list(clients.values()),
            "reorder": {
                "waiting": self.reorder.waiting,
                "gave_up": self.reorder.gave_up,
                "late": self.reorder.late,
            },
            "errors": self.errors,
        }
        if recent:
            out["ring"] = self.ring.maxlen
            out["recent"] = list(self.ring)
        return out

    def abandon(self) -> None:
        """Close the event files without a summary: the recorder never started."""
        with self._lock:
            self._closed = True
        with self._io_lock:
            for f in (self._events, self._csv):
                if f is not None:
                    f.close()

    def close(self) -> dict[str, Any] | None:
        """Shutdown: release what still waits, write LLMP_SUMMARY, close the files.

        Call after the writer thread has drained.  Returns the summary.
        """
        events: list[dict[str, Any]] = []
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            for r in self.reorder.flush():
                ev = self._feed(r)
                if ev is not None:
                    events.append(ev)
            summary = self._summary(recent=False)
        for ev in events:
            self._emit(ev)
        log.info("%s", summary_line(summary))
        with self._io_lock:
            if self._events is not None:
                self._events.put(SUMMARY_TAG, summary)
                self._events.close()
            if self._csv is not None:
                self._csv.close()
        return summary


def _log_line(level: int, line: str) -> None:
    """A per-request line, marked as one (`LINE_ATTR`)."""
    log.log(level, "%s", line, extra=_LINE)


def _merge(into: _Agg, agg: _Agg) -> None:
    """Two client keys with one label (a label is only final at the end)."""
    for name in (
        "requests",
        "turns",
        "side_calls",
        "stateless",
        "conversations",
        "turns_with_timing",
        "reuse_prompt",
        "reuse_reused",
        "lost_tokens",
        "warnings",
    ):
        setattr(into, name, getattr(into, name) + getattr(agg, name))
    if agg.prompt_tokens is not None:
        into.prompt_tokens = (into.prompt_tokens or 0) + agg.prompt_tokens
    for mine, theirs in ((into.prefill, agg.prefill), (into.lost_ms, agg.lost_ms)):
        result = theirs.result()
        if result is not None:
            mine.add((theirs.value, result[1]))


def _sum_value(s: Sum) -> float | None:
    r = s.result()
    return None if r is None else r[0]


def summary_line(s: dict[str, Any]) -> str:
    """The one line the live view logs at shutdown."""
    if not s["requests"]:
        return "llmp: live view: no chat request was analysed"
    lost = s["lost_tokens"]
    text = (
        f"llmp: live view: {_count(s['turns'], 'turn')} in "
        f"{_count(s['conversations'], 'conversation')}, {_count(s['side_calls'], 'side-call')}; "
        f"prefill {duration(s['prefill_ms'])}"
    )
    if lost:
        text += f", of which {duration(s['lost_ms'])} ({lost:,} tokens) lost"
    return text + f"; {_count(s['warnings'], 'warning')}"


__all__ = [
    "RESERVED_PREFIX",
    "SUMMARY_PATH",
    "SUMMARY_TAG",
    "TURN_FIELDS",
    "TURN_TAG",
    "VERSION",
    "CsvFile",
    "EventFile",
    "LiveConfig",
    "LiveError",
    "LiveView",
    "Reorder",
    "between_text",
    "cause_text",
    "csv_cell",
    "over_threshold",
    "request_line",
    "summary_line",
    "turn_event",
]
