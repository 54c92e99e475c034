"""The per-request row of the report, and how it is written.

A row is final when it is made; only its client label is not (a second tool
family may appear later), so it is serialised with a marker where the label
goes: its client key and what `--rows` adds to the report's fields, between
two NUL bytes.  The labels are put in when the report is written
(`join_block`: a split and a join per block of rows, a dict lookup per row).
JSON text never holds a raw control character, so the markers cannot clash
with a row's own bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from llmp.apis.base import FIELDS as COUNT_FIELDS
from llmp.apis.base import Counts
from llmp.format.measure import MV, Sum, as_json

COMPOSITION = ("system", "tools", "history", "new_content")

# `"api":…,"model":…` as JSON, per distinct pair: most rows share a handful.
_HEADS: dict[tuple[str, str], bytes] = {}


_AGGREGATE = {"report": False}
"""`Row` fields' metadata: not in the report, what the aggregates need besides it."""


@dataclass(slots=True)
class Loss:
    """`lost_client` / `lost_external`: a cause, tokens, and ms when timed."""

    cause: str
    tokens: int
    ms: MV | None

    def as_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "tokens": self.tokens, "ms": as_json(self.ms)}


@dataclass(slots=True)
class Row:
    """One analysed request; every number outside `rows` is summed from these.

    Built by keywords, so a field added or moved costs no caller a recount; only
    `parallel`'s pickling passes them all in order, taken from `fields(Row)`."""

    id: int
    api: str
    model: str
    client: int
    t_start_ms: int
    kind: str
    side_call_shape: str | None
    session: int
    conversation: int | None
    turn: int | None
    counts: Counts
    composition: tuple[MV, MV, MV, MV]
    linked_to: int | None = None
    new_conversation: bool = False
    prefix_tokens: int | None = None
    break_cause: str | None = None
    compaction: bool = False
    predicted_reuse: float | None = None
    observed_reuse: float | None = None
    cause: str | None = None
    lost_client: Loss | None = None
    lost_external: Loss | None = None
    side_calls_between: list[int] = field(default_factory=list)
    other_conversations_between: list[int] = field(default_factory=list)
    other_domains_between: list[int] = field(default_factory=list)
    loss_measured: bool = False
    changed: list[dict[str, Any]] | None = None
    """Additive: where each changed message changed (docs/analysis.md §7)."""
    # Not in the report (`_AGGREGATE`): what the aggregates need besides the row fields.
    served: str = field(default="", metadata=_AGGREGATE)
    server: str = field(default="", metadata=_AGGREGATE)
    """The server program that answered (`apis.servers.Server.name`): whose fix a
    finding gives."""
    volatile: Loss | None = field(default=None, metadata=_AGGREGATE)
    """A volatile head's cost (the `volatile_head` finding)."""
    volatile_where: dict[str, Any] | None = field(default=None, metadata=_AGGREGATE)
    recording: int = field(default=0, metadata=_AGGREGATE)
    """The file the record came from: its index in the paths read (R17)."""
    draft_n: int | None = field(default=None, metadata=_AGGREGATE)
    """llama-server's `timings.draft_n`: tokens a draft model proposed (speculative decoding)."""
    draft_n_accepted: int | None = field(default=None, metadata=_AGGREGATE)
    """`timings.draft_n_accepted`: the proposed tokens the served model kept."""

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "api": self.api, "model": self.model}

    def tail(self) -> dict[str, Any]:
        c = self.counts
        comp = self.composition
        # Runs for every row: a copy of the template (all its keys, in order, null)
        # and the values set in place cost less than a 23-key literal, which grows
        # its table as it goes; Loss.as_json and measure.as_json are inlined.
        d = _TAIL.copy()
        d["t_start_ms"] = self.t_start_ms
        d["kind"] = self.kind
        d["side_call_shape"] = self.side_call_shape
        d["session"] = self.session
        d["conversation"] = self.conversation
        d["turn"] = self.turn
        d["counts"] = {
            "prompt_tokens": None
            if (v := c.prompt_tokens) is None
            else {"value": v[0], "source": v[1]},
            "completion_tokens": None
            if (v := c.completion_tokens) is None
            else {"value": v[0], "source": v[1]},
            "reused_tokens": None
            if (v := c.reused_tokens) is None
            else {"value": v[0], "source": v[1]},
            "evaluated_tokens": None
            if (v := c.evaluated_tokens) is None
            else {"value": v[0], "source": v[1]},
            "prefill_ms": None if (v := c.prefill_ms) is None else {"value": v[0], "source": v[1]},
            "decode_ms": None if (v := c.decode_ms) is None else {"value": v[0], "source": v[1]},
            "load_ms": None if (v := c.load_ms) is None else {"value": v[0], "source": v[1]},
        }
        d["composition"] = {
            "system": {"value": comp[0][0], "source": comp[0][1]},
            "tools": {"value": comp[1][0], "source": comp[1][1]},
            "history": {"value": comp[2][0], "source": comp[2][1]},
            "new_content": {"value": comp[3][0], "source": comp[3][1]},
        }
        if self.linked_to is not None:
            d["linked_to"] = self.linked_to
        d["new_conversation"] = self.new_conversation
        if self.prefix_tokens is not None:
            d["prefix_tokens"] = self.prefix_tokens
        if self.break_cause is not None:
            d["break_cause"] = self.break_cause
        d["compaction"] = self.compaction
        if self.predicted_reuse is not None:
            d["predicted_reuse"] = self.predicted_reuse
        if self.observed_reuse is not None:
            d["observed_reuse"] = self.observed_reuse
        if self.cause is not None:
            d["cause"] = self.cause
        if (lc := self.lost_client) is not None:
            d["lost_client"] = {
                "cause": lc.cause,
                "tokens": lc.tokens,
                "ms": None if (m := lc.ms) is None else {"value": m[0], "source": m[1]},
            }
        if (le := self.lost_external) is not None:
            d["lost_external"] = {
                "cause": le.cause,
                "tokens": le.tokens,
                "ms": None if (m := le.ms) is None else {"value": m[0], "source": m[1]},
            }
        d["side_calls_between"] = self.side_calls_between
        d["other_conversations_between"] = self.other_conversations_between
        d["other_domains_between"] = self.other_domains_between
        d["loss_measured"] = self.loss_measured
        if self.changed is not None:
            d["changed"] = self.changed
        return d

    def spill_line(self) -> bytes:
        """`{"id":…,"api":…,"model":…,"client":\\0<marker>\\0,<the rest>}\\n`.

        The marker is `<client key>,<recording>,<draft_n>,<draft_n_accepted>`: the key
        of the label that goes there, and what `--rows` adds to the report's fields
        (`spill_extra`)."""
        key = (self.api, self.model)
        mid = _HEADS.get(key)
        if mid is None:
            if len(_HEADS) > 4096:
                _HEADS.clear()
            mid = _HEADS[key] = orjson.dumps({"api": self.api, "model": self.model})[1:-1]
        dn, da = self.draft_n, self.draft_n_accepted
        return b'{"id":%d,%s,"client":\0%d,%d,%s,%s\0,%s\n' % (
            self.id,
            mid,
            self.client,
            self.recording,
            b"" if dn is None else b"%d" % dn,
            b"" if da is None else b"%d" % da,
            orjson.dumps(self.tail())[1:],
        )

    def as_json(self, label: str) -> dict[str, Any]:
        """The row as the report writes it (for tests and the live view)."""
        out = self.head()
        out["client"] = label
        out.update(self.tail())
        return out


REPORT_FIELDS = tuple(f.name for f in fields(Row) if f.metadata.get("report", True))
"""A row's fields in the report, in its order: `Row`'s, the one place it is written."""

_TAIL: dict[str, Any] = dict.fromkeys(REPORT_FIELDS[REPORT_FIELDS.index("client") + 1 :])
"""A row's fields after `client`, each null: `Row.tail` copies it and sets the values."""


@dataclass(slots=True)
class CauseTotal:
    """What one cause cost, summed over rows."""

    tokens: int = 0
    ms: Sum = field(default_factory=Sum)
    rows: int = 0


class LossByCause:
    """The losses of rows summed in total and per cause.

    The one sum behind the report's `time.lost_*` and `time.by_cause`, and
    behind the live view's summary, so the two always agree.
    """

    __slots__ = ("causes", "ms", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.ms = Sum()
        self.causes: dict[str, CauseTotal] = {}

    def add(self, row: Row) -> None:
        """Sum a row's client and external losses."""
        for loss in (row.lost_client, row.lost_external):
            if loss is None:
                continue
            self.tokens += loss.tokens
            self.ms.add(loss.ms)
            total = self.causes.get(loss.cause)
            if total is None:
                total = self.causes[loss.cause] = CauseTotal()
            total.tokens += loss.tokens
            total.ms.add(loss.ms)
            total.rows += 1

    def by_cause(self) -> list[tuple[str, CauseTotal]]:
        """The causes in name order."""
        return sorted(self.causes.items())


def c_writer_fits(mod: Any) -> bool:
    """Whether a build of `_rowjson.c` writes the fields `Row` defines, in the same order.

    The C writer names its fields itself, so a build older than this file would
    write the old schema without an error; it is used only when the names it says
    it writes are this file's (`REPORT_FIELDS`, `Counts`' and `Loss`'s fields)."""
    row = {f.name for f in fields(Row)}
    return (
        tuple(getattr(mod, "WRITES", ())) == REPORT_FIELDS
        and tuple(getattr(mod, "MARKER", ())) == _MARKER
        and set(_MARKER) <= row
        and tuple(getattr(mod, "COUNTS", ())) == COUNT_FIELDS
        and tuple(getattr(mod, "LOSS", ())) == tuple(f.name for f in fields(Loss))
    )


_MARKER = ("client", "recording", "draft_n", "draft_n_accepted")
"""What goes between the two NULs of a spill line (`Row.spill_line`)."""


def writer(mod: Any) -> Callable[[Row], bytes]:
    """`spill_line` over the C module `mod`: `Row.spill_line` if none is built or it misfits."""
    if mod is None or not c_writer_fits(mod):
        return Row.spill_line
    c_line = mod.spill_line

    def spill_line_c(row: Row) -> bytes:
        line = c_line(row)
        return line if line is not None else row.spill_line()

    return spill_line_c


try:
    from llmp.analysis import _rowjson
except ImportError:  # built without a C compiler: the Python writer, the same bytes
    _rowjson = None  # type: ignore[assignment]

spill_line = writer(_rowjson)
"""`Row.spill_line()`'s bytes: from the C writer (`_rowjson.c`, about half the time of
building and dumping the row's dicts) where it was built and fits `Row`, else from
`Row.spill_line`.  The C writer gives the Python writer every row it cannot write
itself, so the two always agree (tests/analysis/test_rowjson.py)."""


def join_spilled(line: bytes, labels: list[bytes]) -> bytes:
    """A spilled row with its client label put back (`labels`: JSON strings by key)."""
    head, marker, tail = line.rstrip(b"\n").split(b"\0")
    return head + labels[int(marker.partition(b",")[0])] + tail


class Labels(dict[bytes, bytes]):
    """Spill markers to the JSON of their client's label (`join_block`): most rows of
    a recording share a handful of markers."""

    def __init__(self, labels: list[bytes]) -> None:
        super().__init__()
        self.labels = labels

    def __missing__(self, marker: bytes) -> bytes:
        label = self[marker] = self.labels[int(marker.partition(b",")[0])]
        return label


def join_block(block: bytes, labels: Labels) -> bytes:
    """Whole spilled lines as the report writes them: each row with its client label,
    the rows separated by commas (none after the block's last row)."""
    parts = block.replace(b"\n", b",").split(b"\0")
    parts[1::2] = map(labels.__getitem__, parts[1::2])
    parts[-1] = parts[-1][:-1]  # the last row's tail, not the whole block, copied
    return b"".join(parts)


def spill_extra(line: bytes) -> tuple[int, int | None, int | None]:
    """A spilled row's recording index, `draft_n` and `draft_n_accepted` (not in the report)."""
    _, rec, dn, da = line.split(b"\0", 2)[1].split(b",")
    return int(rec), int(dn) if dn else None, int(da) if da else None


__all__ = [
    "COMPOSITION",
    "REPORT_FIELDS",
    "CauseTotal",
    "Labels",
    "Loss",
    "LossByCause",
    "Row",
    "join_block",
    "join_spilled",
    "spill_extra",
    "spill_line",
]
