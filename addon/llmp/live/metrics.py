"""Prometheus metrics of the live view's rows and the recorder's counts (docs/metrics.md).

A team that runs one proxy for weeks watches it in Grafana; this module turns
what the live view already computes into the Prometheus text format, with
`prometheus_client` on a registry of its own (never the process's global
one, never written by hand).  Pure: no mitmproxy.  The live view holds one
`Metrics` and feeds it every row (`llmp.live.view.LiveView.metrics`); the
recording proxy answers `GET /_llmp/metrics` with its `render()`.

Label values are bounded, so a long-running proxy cannot grow the scrape
without limit: the first `max_clients` client keys and `max_models` served
models keep their names, later ones are counted under `other`.  Client
labels are resolved when scraped, so a label that gains ` #n` later (a
second harness with the same user-agent, docs/live.md) is shown as the
report shows it.  No label ever holds message text: only the API name, the
client label (a user-agent, or the program name a generic one came with),
the served model's name and the loss cause.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmp.analysis.classify import TURN
from llmp.analysis.rows import Row

OTHER = "other"
"""The label value of clients and models past the bound."""
MAX_LABELS = 20
MAX_LABEL_CHARS = 128
"""A label value longer than this is cut (a user-agent can be long; a series name should not)."""
PREFILL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: a warm turn takes tens of ms, a cold 100k-token prompt minutes."""
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of `render()`'s bytes: the text format, as prometheus_client names it."""

_OTHER_KEY = -1


def _cut(value: str) -> str:
    return value if len(value) <= MAX_LABEL_CHARS else value[: MAX_LABEL_CHARS - 1] + "…"


@dataclass(slots=True)
class _RowSums:
    requests: int = 0
    turns: int = 0
    prefill_s: float = 0.0


@dataclass(slots=True)
class _LossSums:
    tokens: int = 0
    seconds: float = 0.0


class Metrics:
    """Counters of analysed rows and of the recorder, rendered for Prometheus.

    `label` gives a client key's label (the live view's
    `engine.clients.label`); it is called when scraped, under this object's
    lock, so call `render` where the engine is not being fed at the same
    time (the live view's lock).  `observe` takes each analysed row,
    `observe_record` each record the live view is fed, `recorder` the
    writer's totals.
    """

    def __init__(
        self,
        label: Callable[[int], str],
        *,
        max_clients: int = MAX_LABELS,
        max_models: int = MAX_LABELS,
        buckets: tuple[float, ...] = PREFILL_BUCKETS,
    ) -> None:
        self._label = label
        self.max_clients = max(0, max_clients)
        self.max_models = max(0, max_models)
        self._lock = threading.Lock()
        self._clients: set[int] = set()
        self._models: dict[str, str] = {}
        self._rows: dict[tuple[str, int, str], _RowSums] = {}
        self._losses: dict[tuple[str, int, str], _LossSums] = {}
        self._speculative: dict[str, list[int]] = {}
        self.records_written = 0
        self.records_failed = 0
        self.bad_chunks = 0
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._prefill = Histogram(
            "llmp_turn_prefill_seconds",
            "Prefill time of one chat turn, as the server (or the proxy's clock) measured it.",
            ["model"],
            registry=self.registry,
            buckets=buckets,
        )

    # -- input ---------------------------------------------------------------

    def _client(self, key: int) -> int:
        if key in self._clients:
            return key
        if len(self._clients) < self.max_clients:
            self._clients.add(key)
            return key
        return _OTHER_KEY

    def _model(self, name: str) -> str:
        label = self._models.get(name)
        if label is None:
            if len(self._models) >= self.max_models:
                return OTHER
            label = self._models[name] = _cut(name or "unknown")
        return label

    def observe(self, row: Row) -> None:
        """One analysed row: its request, turn, prefill, losses and drafted tokens."""
        prefill = row.counts.prefill_ms
        with self._lock:
            client = self._client(row.client)
            model = self._model(row.served)
            key = (row.api, client, model)
            sums = self._rows.get(key)
            if sums is None:
                sums = self._rows[key] = _RowSums()
            sums.requests += 1
            if prefill is not None:
                sums.prefill_s += prefill[0] / 1000
            if row.kind == TURN:
                sums.turns += 1
            for loss in (row.lost_client, row.lost_external):
                if loss is None:
                    continue
                lk = (loss.cause, client, model)
                ls = self._losses.get(lk)
                if ls is None:
                    ls = self._losses[lk] = _LossSums()
                ls.tokens += loss.tokens
                if loss.ms is not None:
                    ls.seconds += loss.ms[0] / 1000
            if row.draft_n is not None:
                spec = self._speculative.get(model)
                if spec is None:
                    spec = self._speculative[model] = [0, 0]
                spec[0] += row.draft_n
                spec[1] += row.draft_n_accepted or 0
        if row.kind == TURN and prefill is not None:
            self._prefill.labels(model=model).observe(prefill[0] / 1000)

    def observe_record(self, rec: dict[str, Any]) -> None:
        """One record as the live view is fed it: its stream's unparseable chunks."""
        resp = rec.get("response")
        bad = resp.get("bad_chunks") if isinstance(resp, dict) else None
        if type(bad) is int and bad > 0:
            with self._lock:
                self.bad_chunks += bad

    def recorder(self, written: int, failed: int) -> None:
        """The writer's totals: records written, and records that could not be written.

        Totals, not increments (the writer keeps them); a counter never goes
        down, so a smaller total (a restarted writer) is ignored."""
        with self._lock:
            self.records_written = max(self.records_written, written)
            self.records_failed = max(self.records_failed, failed)

    # -- output --------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format (`CONTENT_TYPE`), for `GET /_llmp/metrics`."""
        return generate_latest(self.registry)

    def _client_label(self, key: int) -> str:
        return OTHER if key == _OTHER_KEY else _cut(self._label(key))

    def collect(self) -> Iterator[Metric]:
        """The row and recorder metrics (the histogram is the registry's own)."""
        with self._lock:
            requests = CounterMetricFamily(
                "llmp_requests",
                "Chat requests analysed (rows of the report), by API, client and served model.",
                labels=["api", "client", "model"],
            )
            turns = CounterMetricFamily(
                "llmp_turns",
                "Chat turns analysed (rows of kind turn), by API, client and served model.",
                labels=["api", "client", "model"],
            )
            prefill = CounterMetricFamily(
                "llmp_prefill_seconds",
                "Prefill time of the analysed requests, where measured.",
                labels=["api", "client", "model"],
            )
            rows: dict[tuple[str, str, str], _RowSums] = {}
            for (api, key, model), s in self._rows.items():
                k = (api, self._client_label(key), model)
                m = rows.get(k)
                if m is None:
                    m = rows[k] = _RowSums()
                m.requests += s.requests
                m.turns += s.turns
                m.prefill_s += s.prefill_s
            for k, m in sorted(rows.items()):
                requests.add_metric(list(k), m.requests)
                turns.add_metric(list(k), m.turns)
                prefill.add_metric(list(k), m.prefill_s)

            lost_s = CounterMetricFamily(
                "llmp_lost_prefill_seconds",
                "Prefill time spent re-processing tokens the server could have reused, by cause.",
                labels=["cause", "client", "model"],
            )
            lost_tokens = CounterMetricFamily(
                "llmp_lost_tokens",
                "Tokens re-processed that the server could have reused, by cause.",
                labels=["cause", "client", "model"],
            )
            losses: dict[tuple[str, str, str], _LossSums] = {}
            for (cause, key, model), ls in self._losses.items():
                k = (cause, self._client_label(key), model)
                lm = losses.get(k)
                if lm is None:
                    lm = losses[k] = _LossSums()
                lm.tokens += ls.tokens
                lm.seconds += ls.seconds
            for k, lm in sorted(losses.items()):
                lost_s.add_metric(list(k), lm.seconds)
                lost_tokens.add_metric(list(k), lm.tokens)

            drafted = CounterMetricFamily(
                "llmp_speculative_draft_tokens",
                "Tokens a draft model proposed (llama-server timings.draft_n), by served model.",
                labels=["model"],
            )
            accepted = CounterMetricFamily(
                "llmp_speculative_accepted_tokens",
                "Drafted tokens the served model kept (timings.draft_n_accepted).",
                labels=["model"],
            )
            acceptance = GaugeMetricFamily(
                "llmp_speculative_acceptance",
                "Accepted / drafted tokens since the proxy started, by served model.",
                labels=["model"],
            )
            for model, (d, a) in sorted(self._speculative.items()):
                drafted.add_metric([model], d)
                accepted.add_metric([model], a)
                if d:
                    acceptance.add_metric([model], a / d)

            recorder = [
                CounterMetricFamily(
                    "llmp_records_written",
                    "Records written to the recording file.",
                    value=self.records_written,
                ),
                CounterMetricFamily(
                    "llmp_records_failed",
                    "Exchanges that could not be written (the recording stopped).",
                    value=self.records_failed,
                ),
                CounterMetricFamily(
                    "llmp_bad_chunks",
                    "Stream events that did not parse and were skipped (response.bad_chunks).",
                    value=self.bad_chunks,
                ),
            ]
        yield from (requests, turns, prefill, lost_s, lost_tokens)
        yield from (drafted, accepted, acceptance)
        yield from recorder


class _Collector:
    """Hands `Metrics.collect` to the registry (which calls it on every scrape)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()

    def describe(self) -> list[Metric]:
        return []  # names are fixed and unique on this registry: nothing to check


__all__ = ["CONTENT_TYPE", "MAX_LABELS", "OTHER", "PREFILL_BUCKETS", "Metrics"]
