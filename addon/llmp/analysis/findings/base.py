"""What every finding kind is: one class that collects, builds, says and gates its finding.

`FindingKind` is the interface (`Findings` in `__init__.py` holds the tuple of
them); `LossGroup` is what the kinds of a loss collect, and `loss_finding`
turns one into the spec's finding object (§10 of docs/analysis.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from llmp.analysis.words import duration, n_of, usd
from llmp.format.measure import ESTIMATE, MV, Sum, as_json

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.analysis.loss import Between
    from llmp.analysis.overflow import Refusal
    from llmp.analysis.rows import Loss, Row

HIGH, MEDIUM, LOW = "high", "medium", "low"
_CONF_RANK = {HIGH: 0, MEDIUM: 1, LOW: 2}

Label = Callable[[int], str]
"""An internal client key's final label: findings are merged by it when built."""


class FindingKind(ABC):
    """One finding kind: what it collects from the rows, its findings, its sentence, its gate line.

    The engine feeds every kind through `Findings` (only the hooks a kind
    overrides are called, so a kind pays for what it reads); the readable
    report and `--fail-on` read the finding dicts through the class methods,
    so the words never disagree with the numbers.
    """

    name: ClassVar[str]
    """The finding's `kind`, and the `--fail-on` name."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    # -- collecting, row by row (override what the kind reads) ----------

    def row(self, row: Row, ex: Exchange | None) -> bool:
        """Every row, first; True when the server cut the row's prompt."""
        return False

    def turn(self, row: Row) -> None:
        """Every conversation turn."""
        return None

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        """Every turn linked to an earlier one; `btw` is what ran between, `cut` the row's."""
        return None

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        """A skipped chat request the server refused (maybe for its context)."""
        return None

    # -- the report -------------------------------------------------------

    @abstractmethod
    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        """This kind's findings, merged by client label; must not change what was collected.

        A live host builds the header many times while the rows keep coming.
        """

    @classmethod
    @abstractmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        """One finding as the readable report says it: (what happened, what would fix it)."""

    @classmethod
    def gate_detail(cls, f: dict[str, Any]) -> Any:
        """What `--fail-on`'s line names after the kind, in parentheses (nothing by default)."""
        return None

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        """How large the finding is, in `--fail-on`'s line: a loss's turns and time by default."""
        n = len(f.get("rows") or [])
        ms = f.get("lost_ms")
        tokens = f.get("lost_tokens")
        if isinstance(ms, dict):
            return f"{n_of(n, 'turn')}, {duration(float(ms['value']))} lost"
        if tokens is not None:
            return f"{n_of(n, 'turn')}, {tokens:,} tokens re-processed (not timed)"
        return f"{n_of(n, 'turn')}, loss not measured"


@dataclass
class ToolStats:
    """One tool offered by one client (the totals count them; the tool findings read them)."""

    schema_tokens: int = 0
    source: str = ESTIMATE
    offered: int = 0
    called: int = 0
    first_t: int | None = None
    last_t: int | None = None
    sessions: set[int] = field(default_factory=set)

    def merge(self, other: ToolStats) -> None:
        if other.schema_tokens >= self.schema_tokens:
            self.schema_tokens, self.source = other.schema_tokens, other.source
        self.offered += other.offered
        self.called += other.called
        for t in (other.first_t, other.last_t):
            if t is not None:
                self.first_t = t if self.first_t is None else min(self.first_t, t)
                self.last_t = t if self.last_t is None else max(self.last_t, t)
        self.sessions |= other.sessions


Tools = dict[tuple[int, str], ToolStats]
"""Each (client key, tool name)'s offers and calls."""


@dataclass
class LossGroup:
    """The rows of one loss finding and what they add up to."""

    rows: list[int] = field(default_factory=list)
    tokens: int = 0
    usd: float | None = None
    """R36: the dollars of its priced losses (a provider's), None when none was priced."""
    charged: int = 0
    """Rows that brought a charged loss (a `Loss`): their tokens are the finding's."""
    measured: int = 0
    unmeasured: int = 0
    ms: Sum = field(default_factory=Sum)
    untimed: list[int] = field(default_factory=list)
    mixed: bool = False
    # evidence
    side_calls: dict[int, str | None] = field(default_factory=dict)
    clients: set[int] = field(default_factory=set)
    conversations: set[int] = field(default_factory=set)
    stateless: set[int] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    turns_after: int = 0
    links: int = 0
    broken: int = 0
    served: set[str] = field(default_factory=set)
    changed: Counter[tuple[Any, Any, Any]] = field(default_factory=Counter)
    """(message index, role, within) of the changes, over the rows."""
    where: dict[str, Any] | None = None
    """The largest loss's first change, in full (offset and context in full mode)."""
    where_tokens: int = -1
    after_refusal: int = 0
    after_cut: int = 0
    """Server losses of turns whose prompt the server cut."""
    after_skipped: int = 0
    """Server losses of turns after a failed request that may have run."""
    shrank: int = 0
    requested: set[str] = field(default_factory=set)
    """Model names the side-calls asked for (their server may serve another)."""
    conversation_models: set[str] = field(default_factory=set)

    def add_loss(self, row_id: int, loss: Loss | None, measured: bool) -> None:
        """A row of this finding; `measured` says whether its loss was."""
        self.rows.append(row_id)
        if measured:
            self.measured += 1
        else:
            self.unmeasured += 1
        if loss is not None:
            self.tokens += loss.tokens
            self.charged += 1
            if loss.usd is not None:
                self.usd = loss.usd if self.usd is None else self.usd + loss.usd
        if loss is None or loss.ms is None:
            self.untimed.append(row_id)
        else:
            self.ms.add(loss.ms)

    def merge(self, other: LossGroup) -> None:
        self.rows.extend(other.rows)
        self.tokens += other.tokens
        if other.usd is not None:
            self.usd = other.usd if self.usd is None else self.usd + other.usd
        self.charged += other.charged
        self.measured += other.measured
        self.unmeasured += other.unmeasured
        self.ms.add(other.ms.result())
        self.untimed.extend(other.untimed)
        self.mixed = self.mixed or other.mixed
        self.side_calls.update(other.side_calls)
        self.clients |= other.clients
        self.conversations |= other.conversations
        self.stateless |= other.stateless
        self.models |= other.models
        self.turns_after += other.turns_after
        self.links += other.links
        self.broken += other.broken
        self.served |= other.served
        self.changed.update(other.changed)
        if other.where is not None and other.where_tokens > self.where_tokens:
            self.where, self.where_tokens = other.where, other.where_tokens
        self.after_refusal += other.after_refusal
        self.after_cut += other.after_cut
        self.after_skipped += other.after_skipped
        self.shrank += other.shrank
        self.requested |= other.requested
        self.conversation_models |= other.conversation_models

    def note_where(self, where: dict[str, Any] | None, tokens: int) -> None:
        """Keep the change of the row that lost the most."""
        if where is not None and tokens > self.where_tokens:
            self.where, self.where_tokens = where, tokens


def group[K](groups: dict[K, LossGroup], key: K) -> LossGroup:
    """`groups[key]`, made empty the first time."""
    g = groups.get(key)
    if g is None:
        g = groups[key] = LossGroup()
    return g


def merged_by_label[K](
    groups: dict[tuple[int, K], LossGroup], label: Label
) -> dict[tuple[str, K], LossGroup]:
    """Groups kept per client key, merged by the key's label into fresh groups.

    Fresh: `build` runs again for every header and must not change the accumulators.
    """
    out: dict[tuple[str, K], LossGroup] = {}
    for (client, rest), g in groups.items():
        key = (label(client), rest)
        if key not in out:
            out[key] = LossGroup()
        out[key].merge(g)
    return out


def loss_finding(
    cfg: Config,
    kind: str,
    served: str,
    client: str | None,
    g: LossGroup,
    confidence: str,
) -> dict[str, Any] | None:
    """The finding of a loss group, or None when it has no rows.

    Its `lost_tokens` and `lost_ms` are its rows' charged losses summed, so the
    findings add up to the loss table (R38): a group that charged nothing (rows seen
    without reuse counters) has `lost_tokens: null`.  A finding smaller than
    `min_lost_tokens` is kept, marked `minor`: the readable report sums the minor
    ones in a line and `--fail-on` passes them, but no charged token goes missing.
    """
    if not g.rows:
        return None
    has_tokens = g.charged > 0
    ms: MV | None = g.ms.result()
    return {
        "kind": kind,
        "model": served,
        "client": client,
        "rows": sorted(g.rows),
        "lost_tokens": g.tokens if has_tokens else None,
        "lost_ms": as_json(ms),
        "context_tokens": None,
        "confidence": confidence,
        "evidence": {},
        "untimed_rows": sorted(g.untimed),
        "minor": has_tokens and g.tokens < cfg.min_lost_tokens,
        "lost_usd": None if g.usd is None else usd(g.usd),
    }


def sort_key(f: dict[str, Any]) -> tuple[int, float, float, str]:
    """Confidence, then lost ms (largest first), then context tokens, then kind."""
    ms = f.get("lost_ms")
    ms_value = float(ms["value"]) if isinstance(ms, dict) else -1.0
    ctx = f.get("context_tokens")
    ctx_value = float(ctx) if isinstance(ctx, (int, float)) else -1.0
    return (_CONF_RANK.get(f.get("confidence", LOW), 3), -ms_value, -ctx_value, f["kind"])


__all__ = [
    "HIGH",
    "LOW",
    "MEDIUM",
    "FindingKind",
    "Label",
    "LossGroup",
    "ToolStats",
    "Tools",
    "group",
    "loss_finding",
    "merged_by_label",
    "sort_key",
]
