"""The live view's contract: its paths, its event fields and its settings.

Kept free of the analysis so that the proxy's own process can import it
(for `/_llmp/` paths and the settings) without loading the engine, which
runs in the builder child (docs/live.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

WARN_MS = 2000
"""The default warning threshold: lost prefill time, in ms."""
WARN_TOKENS = 2000
"""The default warning threshold: lost tokens."""

VERSION = 1
"""Version of the LLMP_TURN and LLMP_SUMMARY objects and of the summary endpoint."""

RESERVED_PREFIX = "/_llmp/"
"""Paths the addon answers itself: never forwarded upstream, never recorded."""
SUMMARY_PATH = "/_llmp/summary"
METRICS_PATH = "/_llmp/metrics"
"""The Prometheus text of `llmp.live.metrics` (docs/metrics.md), served by the recording proxy."""
TURN_TAG = "LLMP_TURN"
SUMMARY_TAG = "LLMP_SUMMARY"
SESSION = 1  # one proxy process is one session (R16)
LINE_ATTR = "llmp_live_line"
"""Set on the log record of every per-request line (see `llmp.recorder.addon`)."""
MIB = 1024 * 1024

#: The LLMP_TURN fields, in order; also the CSV columns.  Every value is a
#: scalar (or null, meaning not measured), so one list serves both encodings.
#: Additive fields go at the end (readers of v1 read by name).
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
    "draft_n",
    "draft_n_accepted",
    # Additive (R34-R36): the server that answered, and on a provider what it cost.
    "server",
    "cost_usd",
    "lost_usd",
)


class LiveError(Exception):
    """An event file cannot be used; the message says why, in one line."""


@dataclass(frozen=True)
class LiveConfig:
    """What the live view is asked to do (from the recorder's options)."""

    warn_ms: float = WARN_MS
    warn_tokens: int = WARN_TOKENS
    events: str = ""
    events_csv: str = ""
    log_file: str = ""
    """Where the per-request lines go; empty: the proxy's terminal (its stdout)."""
    log_level: int = logging.INFO
    """Lines below this level are not written (mitmproxy's `termlog_verbosity`)."""
    ring: int = 256
    reorder_records: int = 1000
    reorder_bytes: int = 64 * MIB
    max_clients: int = 256
