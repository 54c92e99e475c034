"""Findings: what the rows add up to, as data (§10 of docs/analysis.md).

Accumulated row by row under internal client keys; merged by final client
label and turned into the spec's finding objects at the end.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmp.analysis import advice
from llmp.analysis.causes import (
    OTHER_CONVERSATION,
    OTHER_MODEL,
    SERVER_CAUSES,
    SERVER_EMPTY,
    SERVER_HEAD_ONLY,
    SERVER_NO_ROLLBACK,
)
from llmp.analysis.classify import SIDE_CALL, STATELESS, TURN
from llmp.analysis.loss import Between
from llmp.analysis.overflow import CONTEXT_OVERFLOW, Overflow, Refusal
from llmp.format.measure import ESTIMATE, MV, Sum, as_json

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.analysis.rows import Loss, Row

SIDE_CALL_ON_MODEL = "side_call_on_conversation_model"
PREFIX_BREAK = "prefix_break"
SERVER_CACHE_LOSS = "server_cache_loss"
OTHER_CONVERSATION_EVICTION = "other_conversation_eviction"
OTHER_MODEL_EVICTION = "other_model_eviction"
UNUSED_TOOL = "unused_tool"
LARGE_TOOL_SCHEMA = "large_tool_schema"
LARGE_SYSTEM_PROMPT = "large_system_prompt"
VOLATILE_HEAD = "volatile_head"

# Every finding kind: the spec's, then the additive ones (docs/analysis.md §10).
KINDS = (
    SIDE_CALL_ON_MODEL,
    PREFIX_BREAK,
    SERVER_CACHE_LOSS,
    OTHER_CONVERSATION_EVICTION,
    OTHER_MODEL_EVICTION,
    UNUSED_TOOL,
    LARGE_TOOL_SCHEMA,
    LARGE_SYSTEM_PROMPT,
    CONTEXT_OVERFLOW,
    VOLATILE_HEAD,
)

HIGH, MEDIUM, LOW = "high", "medium", "low"
_CONF_RANK = {HIGH: 0, MEDIUM: 1, LOW: 2}


@dataclass
class LossGroup:
    """The rows of one loss finding and what they add up to."""

    rows: list[int] = field(default_factory=list)
    tokens: int = 0
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
        if loss is None or loss.ms is None:
            self.untimed.append(row_id)
        else:
            self.ms.add(loss.ms)

    def merge(self, other: LossGroup) -> None:
        self.rows.extend(other.rows)
        self.tokens += other.tokens
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
        self.shrank += other.shrank
        self.requested |= other.requested
        self.conversation_models |= other.conversation_models

    def note_where(self, where: dict[str, Any] | None, tokens: int) -> None:
        """Keep the change of the row that lost the most."""
        if where is not None and tokens > self.where_tokens:
            self.where, self.where_tokens = where, tokens


@dataclass
class Memory:
    """Whether a served model's cache can return to an earlier position, as its turns show.

    The signature of a cache that cannot (a sliding-window or hybrid model on
    llama-server, R31): appended turns reuse everything, while every change drops
    reuse to 0 or to a checkpoint before it.
    """

    appended: int = 0
    appended_lost: int = 0
    changes: int = 0
    rolled_back: int = 0
    """Changes after which the server went back to where the change began."""

    @property
    def signature(self) -> bool:
        return (
            self.appended > 0
            and self.appended_lost == 0
            and self.changes > 0
            and self.rolled_back == 0
        )

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "appended_turns": self.appended,
            "appended_lost": self.appended_lost,
            "changes": self.changes,
            "changes_rolled_back": self.rolled_back,
            "text": None,
        }
        if self.signature:
            out["text"] = (
                f"Its {self.appended} appended turns reused the whole cache, and after each of "
                f"the {self.changes} changes it re-read from the start or from a checkpoint: "
                "the model's cache cannot go back (a sliding-window or hybrid/recurrent model)."
            )
        return out


@dataclass
class ToolStats:
    """One tool offered by one client."""

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


@dataclass
class SystemStats:
    tokens: int = 0
    source: str = ESTIMATE
    rows: list[int] = field(default_factory=list)
    served: set[str] = field(default_factory=set)

    def merge(self, other: SystemStats) -> None:
        if other.tokens > self.tokens:
            self.tokens, self.source = other.tokens, other.source
        self.rows.extend(other.rows)
        self.served |= other.served


class Findings:
    """Collects findings evidence from each row as it is made."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.side: dict[str, LossGroup] = {}
        self.other_conv: dict[str, LossGroup] = {}
        self.other_model: dict[str, LossGroup] = {}
        self.server: dict[tuple[str, str], LossGroup] = {}
        self.breaks: dict[tuple[int, str, str], LossGroup] = {}
        self.links: Counter[tuple[int, str]] = Counter()
        self.system: dict[int, SystemStats] = {}
        self.volatile: dict[tuple[int, str], LossGroup] = {}
        self.memory: dict[str, Memory] = {}
        self.overflow = Overflow(cfg)
        self.refusals: deque[tuple[int, int]] = deque(maxlen=1024)  # (session, record id)

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        """A skipped chat request the server refused (maybe for its context)."""
        self.overflow.refused(session, record_id, refusal)
        # A digest keeps no error body: a 4xx of a chat request may still be the
        # context, and a cut right after it is what a harness does about that.
        self.refusals.append((session, record_id))

    def _refused_between(self, session: int, since: int, until: int) -> bool:
        for s, rid in reversed(self.refusals):
            if s != session or rid < since:
                return False
            if rid < until:
                return True
        return False

    def add(self, row: Row, btw: Between | None, ex: Exchange | None = None) -> None:
        """Take what a row says about findings; `btw` is what ran before it.

        `ex` is the row's request (for Ollama's `num_ctx`); without it the
        context size is simply not known.
        """
        cut = self.overflow.row(row, ex.num_ctx if ex is not None else None)
        if row.kind != TURN:
            return
        self._system(row)
        if row.linked_to is None or btw is None:
            return
        served = row.served
        if row.volatile is not None:
            vg = self.volatile.get((row.client, served))
            if vg is None:
                vg = self.volatile[(row.client, served)] = LossGroup()
            vg.add_loss(row.id, row.volatile, row.loss_measured)
            vg.broken += row.compaction
            if row.conversation is not None:
                vg.conversations.add(row.conversation)
            vg.note_where(row.volatile_where, row.volatile.tokens)
        if not row.new_conversation:
            self._memory(row, btw)
            self.links[(row.client, served)] += 1
            if row.break_cause is not None and not row.compaction:
                g = self.breaks.get((row.client, row.break_cause, served))
                if g is None:
                    g = self.breaks[(row.client, row.break_cause, served)] = LossGroup()
                g.broken += 1
                for c in row.changed or ():
                    g.changed[(c.get("index"), c.get("role"), c.get("within"))] += 1
                if row.changed:
                    tokens = row.lost_client.tokens if row.lost_client is not None else 0
                    g.note_where(row.changed[0], tokens)
                    c0 = row.changed[0]
                    g.shrank += (c0.get("chars_after") or 0) < (c0.get("chars_before") or 0)
                if self._refused_between(row.session, row.linked_to, row.id):
                    g.after_refusal += 1
                if row.lost_client is not None:
                    g.add_loss(row.id, row.lost_client, row.loss_measured)

        if btw.side_calls:
            side = self._group(self.side, served)
            side.turns_after += 1
            side.conversation_models.add(row.model)
        ext = row.lost_external
        kinds = bool(btw.side_calls) + bool(btw.other_conversations) + bool(btw.other_domains)
        if ext is not None:
            cause = ext.cause
            if cause in SERVER_CAUSES:
                # A prompt the server cut lost its cache to the cut, not to
                # the server: context_overflow names it.
                if not btw.skipped and not cut:
                    key = (served, cause)
                    g = self.server.get(key)
                    if g is None:
                        g = self.server[key] = LossGroup()
                    g.add_loss(row.id, ext, True)
                return
            self._eviction(cause, served, row.id, ext, btw, kinds > 1)
        elif row.counts.reused_tokens is None and btw.would_cause is not None:
            self._eviction(btw.would_cause, served, row.id, None, btw, kinds > 1)

    def _memory(self, row: Row, btw: Between) -> None:
        """What a linked turn shows of whether the server's cache can go back (R31)."""
        mem = self.memory.get(row.served)
        if mem is None:
            mem = self.memory[row.served] = Memory()
        if btw.would_cause is not None or row.counts.reused_tokens is None:
            return  # something else may have taken the cache, or nothing was measured
        ext = row.lost_external
        if row.break_cause is None:
            mem.appended += 1
            mem.appended_lost += ext is not None
        elif not row.compaction:
            mem.changes += 1
            mem.rolled_back += ext is None or ext.cause != SERVER_NO_ROLLBACK

    @staticmethod
    def _group(groups: dict[str, LossGroup], key: str) -> LossGroup:
        g = groups.get(key)
        if g is None:
            g = groups[key] = LossGroup()
        return g

    def _eviction(
        self, cause: str, served: str, row_id: int, loss: Loss | None, btw: Between, mixed: bool
    ) -> None:
        # `btw`'s entries of each kind, as `between` sorted them for `served`.
        if cause == SIDE_CALL:
            g = self._group(self.side, served)
            for e in btw.side_entries:
                g.side_calls[e.id] = e.shape
                g.clients.add(e.client)
                g.requested.add(e.model)
        elif cause == OTHER_CONVERSATION:
            g = self._group(self.other_conv, served)
            for e in btw.other_entries:
                if e.kind == STATELESS:
                    g.stateless.add(e.id)
                elif e.conversation is not None:
                    g.conversations.add(e.conversation)
                g.clients.add(e.client)
        elif cause == OTHER_MODEL:
            g = self._group(self.other_model, served)
            for e in btw.domain_entries:
                g.models.add(e.served)
        else:
            return
        g.mixed = g.mixed or mixed
        g.add_loss(row_id, loss, loss is not None)

    def _system(self, row: Row) -> None:
        tokens, src = row.composition[0]
        st = self.system.get(row.client)
        if st is None:
            st = self.system[row.client] = SystemStats()
        if tokens > st.tokens:
            st.tokens, st.source = int(tokens), src
        if row.turn == 1 and tokens >= self.cfg.large_system_tokens:
            st.rows.append(row.id)
            st.served.add(row.served)

    # -- the findings --------------------------------------------------

    def build(
        self,
        label: Callable[[int], str],
        tools: dict[tuple[int, str], ToolStats],
    ) -> list[dict[str, Any]]:
        """Every finding, merged by client label, sorted as §10 says."""
        cfg = self.cfg
        out: list[dict[str, Any]] = []

        def labels(keys: set[int]) -> list[str]:
            return sorted({label(k) for k in keys})

        for served, g in self.side.items():
            if not g.rows:
                continue
            shapes = Counter(s for s in g.side_calls.values() if s is not None)
            f = self._loss_finding(SIDE_CALL_ON_MODEL, served, None, g, self._eviction_conf(g))
            if f is not None:
                f["evidence"] = {
                    "shapes": dict(sorted(shapes.items())),
                    "side_calls": len(g.side_calls),
                    "turns_after_side_calls": g.turns_after,
                    "clients": labels(g.clients),
                }
                others = g.requested - g.conversation_models
                if others:
                    f["evidence"]["advice"] = advice.weak_model_side_calls(
                        g.requested, g.conversation_models
                    )
                out.append(f)
        for served, g in self.other_conv.items():
            f = self._loss_finding(
                OTHER_CONVERSATION_EVICTION, served, None, g, self._eviction_conf(g)
            )
            if f is not None:
                f["evidence"] = {
                    "other_conversations": len(g.conversations) + len(g.stateless),
                    "clients": labels(g.clients),
                }
                out.append(f)
        for served, g in self.other_model.items():
            f = self._loss_finding(OTHER_MODEL_EVICTION, served, None, g, self._eviction_conf(g))
            if f is not None:
                f["evidence"] = {"other_models": sorted(g.models)}
                out.append(f)
        for (served, kind), g in self.server.items():
            mem = self.memory.get(served) if kind == SERVER_NO_ROLLBACK else None
            if kind == SERVER_EMPTY:
                conf = HIGH
            elif kind == SERVER_HEAD_ONLY:
                conf = HIGH if len(g.rows) >= 2 else MEDIUM
            elif mem is not None and mem.signature:
                conf = HIGH
            else:
                conf = MEDIUM
            f = self._loss_finding(SERVER_CACHE_LOSS, served, None, g, conf)
            if f is not None:
                f["evidence"] = {"kind": kind}
                if mem is not None:
                    f["evidence"]["memory"] = mem.evidence()
                out.append(f)

        merged: dict[tuple[str, str, str], LossGroup] = {}
        links: Counter[tuple[str, str]] = Counter()
        for (client, served), n in self.links.items():
            links[(label(client), served)] += n
        # Merged into fresh groups: build() runs again for every header (a
        # live host asks many times) and must not change the accumulators.
        for (client, cause, served), g in self.breaks.items():
            key = (label(client), cause, served)
            if key not in merged:
                merged[key] = LossGroup()
            merged[key].merge(g)
        for (name, cause, served), g in merged.items():
            if not g.rows:
                continue
            if g.measured == 0:
                conf = LOW
            elif g.broken >= 2 and g.unmeasured == 0:
                conf = HIGH
            else:
                conf = MEDIUM
            f = self._loss_finding(PREFIX_BREAK, served, name, g, conf, tokens_always=True)
            if f is not None:
                n_links = links[(name, served)]
                f["evidence"] = {
                    "break_cause": cause,
                    "links": n_links,
                    "broken": g.broken,
                    "share": round(g.broken / n_links, 4) if n_links else None,
                    "changed": _positions(g),
                }
                tip = _break_advice(cause, g, name)
                if tip is not None:
                    f["evidence"]["advice"] = tip
                out.append(f)

        vol: dict[tuple[str, str], LossGroup] = {}
        for (client, served), g in self.volatile.items():
            vkey = (label(client), served)
            if vkey not in vol:
                vol[vkey] = LossGroup()
            vol[vkey].merge(g)
        for (name, served), g in vol.items():
            conf = HIGH if g.measured and not g.unmeasured else MEDIUM if g.measured else LOW
            f = self._loss_finding(VOLATILE_HEAD, served, name, g, conf, tokens_always=True)
            if f is None:
                continue
            where = g.where or {}
            f["evidence"] = {
                "conversations": len(g.rows) - g.broken,
                "compactions": g.broken,
                "changed": {k: where.get(k) for k in ("index", "role", "within")},
            }
            tip = advice.attribution_header(g.where, name) or advice.volatile_block(g.where, name)
            if tip is not None:
                f["evidence"]["advice"] = tip
            out.append(f)

        sys_by_label: dict[str, SystemStats] = {}
        for client, st in self.system.items():
            name = label(client)
            if name not in sys_by_label:
                sys_by_label[name] = SystemStats(source=st.source)
            sys_by_label[name].merge(st)
        for name, st in sys_by_label.items():
            if st.tokens < cfg.large_system_tokens:
                continue
            out.append(
                {
                    "kind": LARGE_SYSTEM_PROMPT,
                    "model": next(iter(st.served)) if len(st.served) == 1 else None,
                    "client": name,
                    "rows": sorted(st.rows),
                    "lost_tokens": None,
                    "lost_ms": None,
                    "context_tokens": st.tokens,
                    "confidence": MEDIUM if st.source == ESTIMATE else HIGH,
                    "evidence": {"system_tokens": st.tokens, "threshold": cfg.large_system_tokens},
                }
            )

        by_tool: dict[tuple[str, str], ToolStats] = {}
        for (client, tool), ts in tools.items():
            tkey = (label(client), tool)
            if tkey in by_tool:
                by_tool[tkey].merge(ts)
            else:
                merged_ts = ToolStats()
                merged_ts.merge(ts)
                by_tool[tkey] = merged_ts
        for (name, tool), ts in by_tool.items():
            if ts.called == 0 and ts.offered >= cfg.unused_tool_min_offered:
                days = 0.0
                if ts.first_t is not None and ts.last_t is not None:
                    days = round((ts.last_t - ts.first_t) / 86_400_000, 4)
                out.append(
                    self._tool_finding(
                        UNUSED_TOOL,
                        name,
                        ts,
                        HIGH if ts.offered >= 5 * cfg.unused_tool_min_offered else MEDIUM,
                        {
                            "tool": tool,
                            "offered": ts.offered,
                            "days": days,
                            "sessions": len(ts.sessions),
                        },
                    )
                )
            if ts.schema_tokens >= cfg.large_tool_tokens:
                out.append(
                    self._tool_finding(
                        LARGE_TOOL_SCHEMA,
                        name,
                        ts,
                        MEDIUM if ts.source == ESTIMATE else HIGH,
                        {
                            "tool": tool,
                            "schema_tokens": ts.schema_tokens,
                            "threshold": cfg.large_tool_tokens,
                        },
                    )
                )
        out.extend(self.overflow.build())
        out.sort(key=sort_key)
        return out

    @staticmethod
    def _eviction_conf(g: LossGroup) -> str:
        if g.measured == 0:
            return LOW
        if g.unmeasured or g.mixed:
            return MEDIUM
        return HIGH

    def _loss_finding(
        self,
        kind: str,
        served: str,
        client: str | None,
        g: LossGroup,
        confidence: str,
        tokens_always: bool = False,
    ) -> dict[str, Any] | None:
        if not g.rows:
            return None
        has_tokens = g.measured > 0 or (tokens_always and g.tokens > 0)
        if has_tokens and g.tokens < self.cfg.min_lost_tokens:
            return None
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
        }

    @staticmethod
    def _tool_finding(
        kind: str, client: str, ts: ToolStats, confidence: str, evidence: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "kind": kind,
            "model": None,
            "client": client,
            "rows": [],
            "lost_tokens": None,
            "lost_ms": None,
            "context_tokens": ts.schema_tokens,
            "confidence": confidence,
            "evidence": evidence,
        }


def _positions(g: LossGroup) -> list[dict[str, Any]]:
    """Where the rows' messages changed, most frequent first (no text: index, role, part)."""
    out = []
    for (index, role, within), n in g.changed.most_common(3):
        out.append({"index": index, "role": role, "within": within, "rows": n})
    if g.where is not None and out and g.where.get("offset") is not None:
        # Full mode: the largest loss's change, at its character, with a little text.
        out[0] = {**out[0], **{k: g.where.get(k) for k in ("offset", "context", "was")}}
    return out


def _break_advice(cause: str, g: LossGroup, label: str) -> dict[str, Any] | None:
    """What the client can do about its prefix break, when its harness is recognised."""
    if g.after_refusal and g.after_refusal * 2 >= g.broken:
        return advice.cut_after_context_error(g.shrank > 0, label)
    if cause == "system_changed":
        return advice.attribution_header(g.where, label) or advice.volatile_block(g.where, label)
    return None


def sort_key(f: dict[str, Any]) -> tuple[int, float, float, str]:
    """Confidence, then lost ms (largest first), then context tokens, then kind."""
    ms = f.get("lost_ms")
    ms_value = float(ms["value"]) if isinstance(ms, dict) else -1.0
    ctx = f.get("context_tokens")
    ctx_value = float(ctx) if isinstance(ctx, (int, float)) else -1.0
    return (_CONF_RANK.get(f.get("confidence", LOW), 3), -ms_value, -ctx_value, f["kind"])


__all__ = ["KINDS", "Findings", "LossGroup", "SystemStats", "ToolStats", "sort_key"]
