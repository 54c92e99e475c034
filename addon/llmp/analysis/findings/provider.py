"""The cloud providers' findings (R35): the losses their cache rules decide, and the money a
client could keep.

Three are losses, each sized from its rows (R38): `cache_expired` and `provider_evicted`
(the rows' `lost_external`), `breakpoint_too_far` (their `lost_client`).  Three are not
losses and never say "lost": `below_cache_minimum` (nothing could be cached),
`no_cache_breakpoint` (an Anthropic conversation that asked for no caching) and
`unread_cache_writes` (writes, billed above the input price, that no later request read).
Each of those says what the client could keep, in `evidence.usd`, and has `lost_tokens`
and `lost_ms` null.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from llmp.analysis.advice import CLAUDE_CODE, harness_of
from llmp.analysis.causes import BREAKPOINT_TOO_FAR, BY_NAME, CACHE_EXPIRED, PROVIDER_EVICTED
from llmp.analysis.findings.base import (
    HIGH,
    LOW,
    MEDIUM,
    FindingKind,
    Label,
    LossGroup,
    Tools,
    group,
    loss_finding,
    merged_by_label,
)
from llmp.analysis.words import (
    advised,
    duration,
    lost_text,
    money,
    n_of,
    short_model,
    times,
    usd,
)
from llmp.apis import providers

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.analysis.loss import Between
    from llmp.analysis.rows import Row

BELOW_CACHE_MINIMUM = "below_cache_minimum"
NO_CACHE_BREAKPOINT = "no_cache_breakpoint"
UNREAD_CACHE_WRITES = "unread_cache_writes"

HOUR = 3600
FIVE_MINUTES = 300


def _tokens(n: Any) -> str:
    return n_of(n, "token") if isinstance(n, int) else "an unknown number of tokens"


# -- the losses ----------------------------------------------------------------------------


@dataclass
class _Gaps:
    """What the rows of a provider loss say beside their tokens."""

    gaps: list[float] = field(default_factory=list)
    lives: set[int] = field(default_factory=set)
    families: set[str] = field(default_factory=set)
    lookback: list[int] = field(default_factory=list)
    overflow: int = 0
    """Rows where more than `overflow_per_minute` requests shared the prefix and key."""
    per_minute: int = 0
    """The most requests seen in a minute on one prompt start and key, at such a row."""
    read_per_minute: int = 0
    """How many of those requests read the cache."""


class ProviderLoss(FindingKind):
    """A provider cause's loss, per client and served model (R35)."""

    cause: ClassVar[str]

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[tuple[int, str], LossGroup] = {}
        self.gaps: dict[tuple[int, str], _Gaps] = {}

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        loss = row.lost_external if row.lost_external is not None else row.lost_client
        if loss is None or loss.cause != self.cause:
            return
        key = (row.client, row.served)
        group(self.groups, key).add_loss(row.id, loss, True)  # the provider's own counts
        g = self.gaps.get(key)
        if g is None:
            g = self.gaps[key] = _Gaps()
        miss, prov = row.miss, row.prov
        if miss is not None:
            g.gaps.append(miss.gap_s)
            g.lives.add(miss.lives_s)
            if miss.lookback is not None:
                g.lookback.append(miss.lookback)
        if prov is not None:
            g.families.add(prov.family)
        self.collect(row, g)

    def collect(self, row: Row, g: _Gaps) -> None:
        """More of a row's evidence (the kind's own)."""

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        gaps: dict[tuple[str, str], _Gaps] = {}
        for (client, served), each in self.gaps.items():
            m = gaps.setdefault((label(client), served), _Gaps())
            m.gaps += each.gaps
            m.lives |= each.lives
            m.families |= each.families
            m.lookback += each.lookback
            m.overflow += each.overflow
            if each.per_minute > m.per_minute:
                m.per_minute, m.read_per_minute = each.per_minute, each.read_per_minute
        out = []
        for (name, served), g in merged_by_label(self.groups, label).items():
            f = loss_finding(self.cfg, self.name, served, name, g, HIGH)
            if f is None:
                continue
            ev = gaps.get((name, served), _Gaps())
            f["evidence"] = self.evidence(ev)
            tip = self.advice(ev, name)
            if tip is not None:
                f["evidence"]["advice"] = tip
            out.append(f)
        return out

    def evidence(self, g: _Gaps) -> dict[str, Any]:
        return {
            "gap_s": {"min": round(min(g.gaps), 1), "max": round(max(g.gaps), 1)}
            if g.gaps
            else None,
            "ttl_s": sorted(g.lives),
            "provider": sorted(g.families)[0] if len(g.families) == 1 else None,
        }

    def advice(self, g: _Gaps, label: str) -> dict[str, Any] | None:
        return None

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        return cls.story(f, ev), advised(ev, BY_NAME[cls.cause].fix)

    @classmethod
    def story(cls, f: dict[str, Any], ev: dict[str, Any]) -> str:
        raise NotImplementedError


def _gap_text(ev: dict[str, Any]) -> str:
    gap = ev.get("gap_s")
    if not isinstance(gap, dict):
        return ""
    lo, hi = gap.get("min"), gap.get("max")
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)):
        return ""
    if abs(hi - lo) < 1:
        return f" after {duration(hi * 1000)} idle"
    return f" after {duration(lo * 1000)} to {duration(hi * 1000)} idle"


class CacheExpired(ProviderLoss):
    """Turns whose cached prefix outlived its time-to-live before they came (R35)."""

    name = CACHE_EXPIRED
    cause = CACHE_EXPIRED

    def advice(self, g: _Gaps, label: str) -> dict[str, Any] | None:
        within_hour = bool(g.gaps) and max(g.gaps) <= HOUR and min(g.gaps) > FIVE_MINUTES
        if providers.ANTHROPIC in g.families and within_hour and FIVE_MINUTES in g.lives:
            who = harness_of(label)
            if who == CLAUDE_CODE:
                text = (
                    "Claude Code asks for 5-minute entries with an API key: set "
                    "ENABLE_PROMPT_CACHING_1H=1 (in the env block of ~/.claude/settings.json, "
                    "or exported) for 1-hour entries, which outlive these gaps; a 1-hour write "
                    "costs 2x the input price instead of 1.25x."
                )
                why = "every gap was between 5 minutes and an hour"
                return {"harness": who, "text": text, "confidence": HIGH, "because": why}
            text = (
                'Mark the breakpoints with "ttl": "1h": the gaps were between 5 minutes and an '
                "hour, which a 1-hour entry outlives (a 1-hour write costs 2x the input price)."
            )
            return {"harness": who, "text": text, "confidence": MEDIUM, "because": "gap sizes"}
        if providers.OPENAI in g.families:
            text = (
                'Ask for a longer retention: prompt_cache_retention "24h" (before GPT-5.6), or '
                "prompt_cache_options.ttl (GPT-5.6 and later), where the gaps are longer than "
                "the default."
            )
            return {
                "harness": harness_of(label),
                "text": text,
                "confidence": MEDIUM,
                "because": "the gaps outlived the retention the responses reported",
            }
        return None

    @classmethod
    def story(cls, f: dict[str, Any], ev: dict[str, Any]) -> str:
        n = len(f.get("rows", []))
        ttl = ev.get("ttl_s") or []
        lives = " or ".join(duration(t * 1000) for t in ttl) if ttl else "its time-to-live"
        return (
            f"{f.get('client')}'s cache on {short_model(f.get('model'))} expired "
            f"{times(n)}{_gap_text(ev)} (it lives {lives}): {lost_text(f)}."
        )


class BreakpointTooFar(ProviderLoss):
    """Turns whose breakpoints all lay beyond the lookback from the last entry (R35)."""

    name = BREAKPOINT_TOO_FAR
    cause = BREAKPOINT_TOO_FAR

    def evidence(self, g: _Gaps) -> dict[str, Any]:
        ev = super().evidence(g)
        ev["lookback_blocks"] = providers.anthropic_lookback_blocks()
        ev["distance"] = max(g.lookback) if g.lookback else None
        return ev

    @classmethod
    def story(cls, f: dict[str, Any], ev: dict[str, Any]) -> str:
        n = len(f.get("rows", []))
        far = ev.get("distance")
        dist = f" ({far} blocks on" if isinstance(far, int) else " ("
        return (
            f"{f.get('client')}'s nearest breakpoint lay beyond the {ev.get('lookback_blocks')}"
            f"-block lookback from the last cache entry{dist}, on "
            f"{short_model(f.get('model'))}) {times(n)}: {lost_text(f)}."
        )


class ProviderEvicted(ProviderLoss):
    """Turns that found their prefix gone although it was the same and alive (R35)."""

    name = PROVIDER_EVICTED
    cause = PROVIDER_EVICTED

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.recent: dict[tuple[str, str | None, str | None], deque[tuple[int, bool]]] = {}
        """By (model, key, prompt start): each request's time and whether it read the cache."""

    def row(self, row: Row, ex: Exchange | None) -> bool:
        prov = row.prov
        if prov is not None and prov.family == providers.OPENAI and not prov.explicit:
            key = (row.served, prov.key, prov.route)
            times_ = self.recent.get(key)
            if times_ is None:
                if len(self.recent) > 4096:
                    self.recent.clear()
                times_ = self.recent[key] = deque(maxlen=256)
            read = prov.usage is not None and prov.usage.read > 0
            times_.append((row.t_start_ms, read))
        return False

    def collect(self, row: Row, g: _Gaps) -> None:
        prov = row.prov
        if prov is None or prov.family != providers.OPENAI:
            return
        times_ = self.recent.get((row.served, prov.key, prov.route))
        if times_ is None:
            return
        now = row.t_start_ms
        minute = [read for t, read in times_ if now - 60_000 < t <= now]
        if len(minute) > providers.openai_overflow_per_minute():
            g.overflow += 1
            if len(minute) > g.per_minute:
                g.per_minute, g.read_per_minute = len(minute), sum(minute)

    def evidence(self, g: _Gaps) -> dict[str, Any]:
        ev = super().evidence(g)
        ev["overflow"] = g.overflow
        if g.overflow:
            # The busiest minute seen, and how many of its requests read the cache: the
            # hit rate OpenAI's overflow capped.
            ev["per_minute"] = g.per_minute
            ev["read_per_minute"] = g.read_per_minute
            ev["overflow_per_minute"] = providers.openai_overflow_per_minute()
        return ev

    def advice(self, g: _Gaps, label: str) -> dict[str, Any] | None:
        if not g.overflow:
            return None
        limit = providers.openai_overflow_per_minute()
        text = (
            f"Up to {g.per_minute} requests a minute shared one prompt start and "
            f"prompt_cache_key; OpenAI serves about {limit} a minute from the machine that "
            "holds the prefix and sends the rest to others, which miss: give each "
            "conversation its own prompt_cache_key (a stable one per conversation, not one "
            "for a whole account), so that no key carries that many requests."
        )
        because = f"{n_of(g.overflow, 'turn')} came above {limit} requests a minute"
        return {"harness": harness_of(label), "text": text, "confidence": HIGH, "because": because}

    @classmethod
    def story(cls, f: dict[str, Any], ev: dict[str, Any]) -> str:
        n = len(f.get("rows", []))
        over = int(ev.get("overflow") or 0)
        peak, read = ev.get("per_minute"), ev.get("read_per_minute")
        limit = ev.get("overflow_per_minute")
        note = ""
        if over and isinstance(peak, int) and isinstance(read, int) and isinstance(limit, int):
            note = (
                f"; {n_of(over, 'turn')} of them came when {peak} requests in a minute shared "
                f"one prompt start and key, and {read} of those read the cache: OpenAI serves "
                f"about {limit} a minute from the machine that holds a prefix and sends the "
                "rest to others (its overflow)"
            )
        return (
            f"{short_model(f.get('model'))} did not read {f.get('client')}'s cached prefix "
            f"{times(n)} although it was the same and still alive{note}: {lost_text(f)}."
        )


# -- money the client could keep -----------------------------------------------------------


@dataclass
class _Money:
    rows: list[int] = field(default_factory=list)
    usd: float = 0.0
    priced: bool = False
    tokens: int = 0
    largest: int = 0
    minimum: int = 0
    expired: int = 0
    unread_at_end: int = 0


class MoneyKind(FindingKind):
    """A finding about money the client could keep: no `lost_*`, `evidence.usd`."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[tuple[int, str], _Money] = {}

    def _group(self, row: Row) -> _Money:
        key = (row.client, row.served)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Money()
        return g

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        merged: dict[tuple[str, str], _Money] = {}
        for (client, served), g in self.groups.items():
            if not g.rows:
                continue
            m = merged.setdefault((label(client), served), _Money())
            m.rows += g.rows
            m.usd += g.usd
            m.priced = m.priced or g.priced
            m.tokens += g.tokens
            m.largest = max(m.largest, g.largest)
            m.minimum = max(m.minimum, g.minimum)
            m.expired += g.expired
            m.unread_at_end += g.unread_at_end
        return [
            {
                "kind": self.name,
                "model": served,
                "client": name,
                "rows": sorted(g.rows),
                "lost_tokens": None,
                "lost_ms": None,
                "context_tokens": None,
                "confidence": self.confidence(g),
                "evidence": {**self.evidence(g), "usd": usd(g.usd) if g.priced else None},
                "untimed_rows": [],
            }
            for (name, served), g in merged.items()
        ]

    def confidence(self, g: _Money) -> str:
        return HIGH

    def evidence(self, g: _Money) -> dict[str, Any]:
        return {"tokens": g.tokens}

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        ev = f.get("evidence") or {}
        return f"{n_of(len(f.get('rows') or []), 'request')}, {money(ev.get('usd'))} to keep"


class BelowCacheMinimum(MoneyKind):
    """Turns whose prompt was shorter than the model's minimum cacheable length: the prefix
    they repeat was billed at the full input price every time."""

    name = BELOW_CACHE_MINIMUM

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        prov, rates = row.prov, row.rates
        if prov is None or prov.usage is None or row.new_conversation:
            return
        u = prov.usage
        if u.read or u.write or u.prompt >= prov.minimum:
            return
        if prov.family == providers.ANTHROPIC and not prov.explicit:
            return  # no breakpoint at all: `no_cache_breakpoint`
        g = self._group(row)
        g.rows.append(row.id)
        repeated = min(u.prompt, row.prefix_tokens or 0)
        g.tokens += repeated
        g.largest = max(g.largest, u.prompt)
        g.minimum = prov.minimum
        if rates is not None:
            g.priced = True
            g.usd += repeated * (rates.input - rates.cache_read)

    def evidence(self, g: _Money) -> dict[str, Any]:
        return {"minimum_tokens": g.minimum, "largest_prompt": g.largest, "tokens": g.tokens}

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        minimum, largest = ev.get("minimum_tokens"), ev.get("largest_prompt")
        were = "was" if n == 1 else "were"
        return (
            f"{n_of(n, 'request')} of {f.get('client')} on {short_model(f.get('model'))} {were} "
            f"shorter than its minimum cacheable length ({_tokens(minimum)}; the largest was "
            f"{_tokens(largest)}), so nothing was cached and the prefix repeated was billed in "
            f"full: up to {money(ev.get('usd'))} to keep.",
            "Nothing is cached below the minimum; such short prompts cost little, but a "
            "harness that sends many of them (subagents, side tasks) can keep a shared prefix "
            "over the minimum, or batch them.",
        )


class NoCacheBreakpoint(MoneyKind):
    """An Anthropic conversation that marked no breakpoint: its repeated prefix was billed
    at the full input price on every turn."""

    name = NO_CACHE_BREAKPOINT

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        prov, rates = row.prov, row.rates
        if prov is None or prov.usage is None or prov.family != providers.ANTHROPIC:
            return
        if prov.explicit or row.new_conversation:
            return
        u = prov.usage
        repeated = min(u.prompt, row.prefix_tokens or 0)
        if repeated < prov.minimum:
            return  # too short to cache anyway: `below_cache_minimum` would say so
        g = self._group(row)
        g.rows.append(row.id)
        g.tokens += repeated
        if rates is not None:
            g.priced = True
            # Read from the cache instead of sent again, less the one write that caches it.
            g.usd += repeated * (rates.input - rates.cache_read)

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        return (
            f"{f.get('client')} sent no cache_control on {short_model(f.get('model'))}: "
            f"{n_of(n, 'turn')} paid the full input price for {ev.get('tokens', 0):,} tokens "
            f"of prefix they repeated, up to {money(ev.get('usd'))} that reading them from the "
            "cache would have kept.",
            'Add a top-level "cache_control": {"type": "ephemeral"} (automatic caching), or a '
            "breakpoint on the last block of each request.",
        )


@dataclass(slots=True)
class _Pending:
    """One request's cache writes, waiting for a later request to read them."""

    row: int
    client: int
    served: str
    start: int
    tokens: int
    five: int
    hour: int
    t_ms: int
    lives_s: int
    premium: tuple[float, float] | None
    """Dollars per token above the input price: (5-minute, 1-hour)."""


class UnreadCacheWrites(MoneyKind):
    """Cache writes no later request read: billed at 1.25x or 2x the input price for
    nothing.  A write is read when the next turn of its conversation reads past where it
    began; it is unread when that turn came too late (it expired), read less, or when no
    request followed before the recording ended (the finding says which)."""

    name = UNREAD_CACHE_WRITES

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.pending: dict[tuple[int, int], _Pending] = {}
        """By (session, conversation); a side-call's by (session, -row id)."""
        self.last_t = 0

    def row(self, row: Row, ex: Exchange | None) -> bool:
        self.last_t = max(self.last_t, row.t_start_ms)
        prov, u, rates = row.prov, row.prov.usage if row.prov is not None else None, row.rates
        if prov is None or u is None:
            return False
        key = (row.session, row.conversation if row.conversation is not None else -row.id)
        before = self.pending.pop(key, None)
        if before is not None and row.linked_to == before.row:
            self._settle(before, u.read, row.t_start_ms)
        elif before is not None:
            self.pending[key] = before  # another conversation's turn: still waiting
        if u.write > 0:
            premium = None
            if rates is not None:
                premium = (rates.cache_write_5m - rates.input, rates.cache_write_1h - rates.input)
            self.pending[key] = _Pending(
                row.id,
                row.client,
                row.served,
                u.read,
                u.write,
                u.write_5m,
                u.write_1h,
                row.t_start_ms,
                prov.lives_s,
                premium,
            )
        return False

    def _settle(self, p: _Pending, read: int, t_ms: int, at_end: bool = False) -> None:
        unread = p.tokens - max(0, min(p.tokens, read - p.start))
        if unread <= 0:
            return
        g = self.groups.get((p.client, p.served))
        if g is None:
            g = self.groups[(p.client, p.served)] = _Money()
        g.rows.append(p.row)
        g.tokens += unread
        expired = (t_ms - p.t_ms) / 1000 > p.lives_s
        if at_end and not expired:
            g.unread_at_end += 1
        elif expired:
            g.expired += 1
        if p.premium is not None:
            g.priced = True
            hour = min(unread, p.hour)  # the 1-hour writes come first in the prompt
            g.usd += hour * p.premium[1] + (unread - hour) * p.premium[0]

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        # The writes still waiting were not read before the recording ended; built on a copy,
        # since a live host builds the header again and again.
        saved = {
            k: _Money(
                list(g.rows),
                g.usd,
                g.priced,
                g.tokens,
                g.largest,
                g.minimum,
                g.expired,
                g.unread_at_end,
            )
            for k, g in self.groups.items()
        }
        for p in self.pending.values():
            self._settle(p, p.start, self.last_t, at_end=True)
        out = super().build(label, tools)
        self.groups = saved
        return out

    def confidence(self, g: _Money) -> str:
        """High for writes that expired unread; low where every one was merely still
        unread when the recording ended (a later request might have read it)."""
        if g.unread_at_end >= len(g.rows):
            return LOW
        return MEDIUM if g.unread_at_end else HIGH

    def evidence(self, g: _Money) -> dict[str, Any]:
        return {"tokens": g.tokens, "expired": g.expired, "unread_at_end": g.unread_at_end}

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        end = int(ev.get("unread_at_end") or 0)
        expired = int(ev.get("expired") or 0)
        parts = []
        if expired:
            parts.append(f"{n_of(expired, 'write')} expired before a request read it")
        if end:
            parts.append(
                f"{n_of(end, 'write')} was still unread when the recording ended"
                if end == 1
                else f"{n_of(end, 'write')} were still unread when the recording ended"
            )
        why = f" ({'; '.join(parts)})" if parts else ""
        return (
            f"{n_of(n, 'request')} of {f.get('client')} on {short_model(f.get('model'))} wrote "
            f"{ev.get('tokens', 0):,} tokens to the cache that no later request read{why}: "
            f"{money(ev.get('usd'))} paid above the input price for them.",
            "Write only where a later request will read: put breakpoints where the next turn "
            "resumes, and ask for 1-hour entries only where the gaps need them.",
        )


__all__ = [
    "BELOW_CACHE_MINIMUM",
    "BREAKPOINT_TOO_FAR",
    "CACHE_EXPIRED",
    "NO_CACHE_BREAKPOINT",
    "PROVIDER_EVICTED",
    "UNREAD_CACHE_WRITES",
    "BelowCacheMinimum",
    "BreakpointTooFar",
    "CacheExpired",
    "NoCacheBreakpoint",
    "ProviderEvicted",
    "UnreadCacheWrites",
]
