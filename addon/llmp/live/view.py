"""The recorder's live view: the analysis engine, fed each record as it is written.

Records reach the builder child when their exchange *ends*, not in id
order, so a small reorder buffer releases them in id order to the very
`Engine` that `llmp analyze` runs: a live verdict is the report's verdict,
not a second copy of the linking and loss logic.

Each row becomes one event (`llmp.live.events`): logged as one line, kept in
a bounded ring for `GET /_llmp/summary`, and appended to the optional event
files (`llmp.live.eventfiles`).  Pure: no mitmproxy import.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from llmp.analysis.classify import SIDE_CALL, TURN
from llmp.analysis.config import Config
from llmp.analysis.engine import Engine
from llmp.analysis.rows import LossByCause, Row
from llmp.format.measure import Sum
from llmp.format.nouns import n_of
from llmp.live.contract import (
    LINE_ATTR,
    MIB,
    SESSION,
    SUMMARY_TAG,
    TURN_TAG,
    VERSION,
    LiveConfig,
    LiveError,
)
from llmp.live.eventfiles import CsvFile, EventFile
from llmp.live.events import over_threshold, request_line, summary_line, turn_event
from llmp.live.metrics import Metrics
from llmp.live.sink import LineSink

log = logging.getLogger("llmp")
_LINE = {LINE_ATTR: True}

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
        # `llmp_live_log`: the lines go to that file, wherever the view runs.
        self._sink = (
            LineSink.open(self.cfg.log_file, self.cfg.log_level) if self.cfg.log_file else None
        )
        self._say = self._sink.say if self._sink is not None else say or _log_line
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
        self.metrics = Metrics(self.engine.clients.label)
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
            if self._sink is not None:
                self._sink.close()
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
                n_of(skipped, "record"),
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
        self.metrics.observe_record(rec)
        if fed is None:
            return None
        row = fed.row
        self.metrics.observe(row)
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

    def metrics_text(self, written: int, failed: int) -> bytes:
        """The body of `GET /_llmp/metrics` (`metrics.CONTENT_TYPE`), with the writer's totals.

        Under the lock: client labels are resolved from the engine as scraped.
        """
        with self._lock:
            self.metrics.recorder(written, failed)
            return self.metrics.render()

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
            for f in (self._events, self._csv, self._sink):
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
        self._say(logging.INFO, summary_line(summary))
        with self._io_lock:
            if self._events is not None:
                self._events.put(SUMMARY_TAG, summary)
                self._events.close()
            if self._csv is not None:
                self._csv.close()
            if self._sink is not None:
                self._sink.close()
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


__all__ = ["LiveView", "Reorder"]
