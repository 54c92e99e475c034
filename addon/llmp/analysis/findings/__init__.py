"""Findings: what the rows add up to, as data (§10 of docs/analysis.md).

Each finding kind is one class (`base.FindingKind`): what it collects row by
row under internal client keys, its findings merged by final client label,
its sentence in the readable report and its line in `--fail-on`.
`Findings.kinds` is the one list of them; `KINDS` and `BY_KIND` follow from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from llmp.analysis.classify import TURN
from llmp.analysis.findings.base import FindingKind, Label, LossGroup, Tools, ToolStats, sort_key
from llmp.analysis.findings.breaks import PREFIX_BREAK, PrefixBreak
from llmp.analysis.findings.context import (
    LARGE_SYSTEM_PROMPT,
    LARGE_TOOL_SCHEMA,
    UNUSED_TOOL,
    LargeSystemPrompt,
    LargeToolSchema,
    SystemStats,
    UnusedTool,
)
from llmp.analysis.findings.context_overflow import CONTEXT_OVERFLOW, ContextOverflow
from llmp.analysis.findings.evictions import (
    OTHER_CONVERSATION_EVICTION,
    OTHER_MODEL_EVICTION,
    SIDE_CALL_ON_MODEL,
    OtherConversationEviction,
    OtherModelEviction,
    SideCallOnModel,
)
from llmp.analysis.findings.provider import (
    BELOW_CACHE_MINIMUM,
    BREAKPOINT_TOO_FAR,
    CACHE_EXPIRED,
    NO_CACHE_BREAKPOINT,
    PROVIDER_EVICTED,
    UNREAD_CACHE_WRITES,
    BelowCacheMinimum,
    BreakpointTooFar,
    CacheExpired,
    NoCacheBreakpoint,
    ProviderEvicted,
    UnreadCacheWrites,
)
from llmp.analysis.findings.server import SERVER_CACHE_LOSS, ServerCacheLoss
from llmp.analysis.findings.volatile import VOLATILE_HEAD, VolatileHead

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.analysis.loss import Between
    from llmp.analysis.overflow import Refusal
    from llmp.analysis.rows import Row


class Findings:
    """Collects findings evidence from each row as it is made, one kind at a time."""

    kinds: ClassVar[tuple[type[FindingKind], ...]] = (
        # The spec's, then the additive ones (docs/analysis.md §10); `--fail-on` lists them so.
        SideCallOnModel,
        PrefixBreak,
        ServerCacheLoss,
        OtherConversationEviction,
        OtherModelEviction,
        UnusedTool,
        LargeToolSchema,
        LargeSystemPrompt,
        ContextOverflow,
        VolatileHead,
        # The cloud providers' (R35): their losses, then the money a client could keep.
        CacheExpired,
        BreakpointTooFar,
        ProviderEvicted,
        BelowCacheMinimum,
        NoCacheBreakpoint,
        UnreadCacheWrites,
    )

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.each = tuple(kind(cfg) for kind in self.kinds)
        # Per hook, only the kinds that override it: a row costs what the kinds read.
        self._row = _overriding(self.each, "row")
        self._turn = _overriding(self.each, "turn")
        self._linked = _overriding(self.each, "linked")
        self._refused = _overriding(self.each, "refused")

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        """A skipped chat request the server refused (maybe for its context)."""
        for kind in self._refused:
            kind.refused(session, record_id, refusal)

    def add(self, row: Row, btw: Between | None, ex: Exchange | None = None) -> None:
        """Take what a row says about findings; `btw` is what ran before it.

        `ex` is the row's request (for Ollama's `num_ctx`).
        """
        cut = False
        for kind in self._row:
            cut = kind.row(row, ex) or cut
        if row.kind != TURN:
            return
        for kind in self._turn:
            kind.turn(row)
        if row.linked_to is None or btw is None:
            return
        for kind in self._linked:
            kind.linked(row, btw, cut)

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        """Every finding, merged by client label, sorted as §10 says."""
        out: list[dict[str, Any]] = []
        for kind in self.each:
            found = kind.build(label, tools)
            assert all(f["kind"] == kind.name for f in found), kind.name
            out.extend(found)
        out.sort(key=sort_key)
        return out


def _overriding(kinds: tuple[FindingKind, ...], hook: str) -> tuple[FindingKind, ...]:
    default = getattr(FindingKind, hook)
    return tuple(k for k in kinds if getattr(type(k), hook) is not default)


KINDS: tuple[str, ...] = tuple(kind.name for kind in Findings.kinds)
"""Every finding kind's name, in `Findings.kinds`' order."""

BY_KIND: dict[str, type[FindingKind]] = {kind.name: kind for kind in Findings.kinds}
"""Each kind's class by its name: the readable report's sentence, the gate's line."""

__all__ = [
    "BELOW_CACHE_MINIMUM",
    "BREAKPOINT_TOO_FAR",
    "BY_KIND",
    "CACHE_EXPIRED",
    "CONTEXT_OVERFLOW",
    "KINDS",
    "LARGE_SYSTEM_PROMPT",
    "LARGE_TOOL_SCHEMA",
    "NO_CACHE_BREAKPOINT",
    "OTHER_CONVERSATION_EVICTION",
    "OTHER_MODEL_EVICTION",
    "PREFIX_BREAK",
    "PROVIDER_EVICTED",
    "SERVER_CACHE_LOSS",
    "SIDE_CALL_ON_MODEL",
    "UNREAD_CACHE_WRITES",
    "UNUSED_TOOL",
    "VOLATILE_HEAD",
    "FindingKind",
    "Findings",
    "LossGroup",
    "SystemStats",
    "ToolStats",
    "sort_key",
]
