"""The cache evicted by what ran between two turns: a side-call, another conversation or model."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from llmp.analysis.advice import weak_model_side_calls
from llmp.analysis.causes import BY_NAME, OTHER_CONVERSATION, OTHER_MODEL
from llmp.analysis.classify import SIDE_CALL, STATELESS
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
)
from llmp.analysis.words import (
    SHAPE_WORDS,
    advised,
    join_names,
    lost_text,
    n_of,
    short_model,
    times,
)

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.loss import Between
    from llmp.analysis.rows import Row

SIDE_CALL_ON_MODEL = "side_call_on_conversation_model"
OTHER_CONVERSATION_EVICTION = "other_conversation_eviction"
OTHER_MODEL_EVICTION = "other_model_eviction"


class Eviction(FindingKind):
    """A loss the row's external cause (or, unmeasured, the likely one) names, per served model."""

    cause: ClassVar[str]
    """The loss cause (causes.py) this kind collects."""

    likely: ClassVar[bool] = True
    """Several slots or a host-memory cache make this eviction likely, not certain."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[str, LossGroup] = {}
        self.kept: Counter[str] = Counter()
        """Per served model, linked turns that lost nothing although a request that could
        take the cache ran in between: the server holds more than one prompt."""

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        ext = row.lost_external
        if ext is None and row.loss_measured and btw.would_cause is not None:
            self.kept[row.served] += 1
        if ext is not None:
            cause, loss = ext.cause, ext
        elif row.counts.reused_tokens is None and btw.would_cause is not None:
            cause, loss = btw.would_cause, None
        else:
            return
        if cause != self.cause:
            return
        g = group(self.groups, row.served)
        self.collect(g, btw)
        kinds = bool(btw.side_calls) + bool(btw.other_conversations) + bool(btw.other_domains)
        g.mixed = g.mixed or kinds > 1
        g.add_loss(row.id, loss, loss is not None)

    def collect(self, g: LossGroup, btw: Between) -> None:
        """The evidence of one evicting stretch (`btw`'s entries, as `between` sorted them)."""

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        out = []
        for served, g in self.groups.items():
            kept = self.kept[served] if self.likely else 0
            conf = confidence(g)
            if kept and conf == HIGH:
                conf = MEDIUM
            f = loss_finding(self.cfg, self.name, served, None, g, conf)
            if f is not None:
                f["evidence"] = self.evidence(g, label)
                if kept:
                    f["evidence"]["kept_across"] = kept
                out.append(f)
        return out

    def evidence(self, g: LossGroup, label: Label) -> dict[str, Any]:
        """The finding's `evidence`."""
        return {}


def confidence(g: LossGroup) -> str:
    """High when every row was measured and nothing else ran in between too."""
    if g.measured == 0:
        return LOW
    if g.unmeasured or g.mixed:
        return MEDIUM
    return HIGH


def evicted(f: dict[str, Any]) -> str:
    """The verb: "likely evicted" where the same server kept other turns' caches
    across such requests (several slots, or llama-server's host-memory cache)."""
    return "likely evicted" if f.get("evidence", {}).get("kept_across") else "evicted"


def _labels(keys: set[int], label: Label) -> list[str]:
    return sorted({label(k) for k in keys})


class SideCallOnModel(Eviction):
    """A harness's side-calls (titles, summaries) ran on the conversation's model and slot."""

    name = SIDE_CALL_ON_MODEL
    cause = SIDE_CALL

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        if btw.side_calls:
            side = group(self.groups, row.served)
            side.turns_after += 1
            side.conversation_models.add(row.model)
        super().linked(row, btw, cut)

    def collect(self, g: LossGroup, btw: Between) -> None:
        for e in btw.side_entries:
            g.side_calls[e.id] = e.shape
            g.clients.add(e.client)
            g.requested.add(e.model)

    def evidence(self, g: LossGroup, label: Label) -> dict[str, Any]:
        shapes = Counter(s for s in g.side_calls.values() if s is not None)
        ev: dict[str, Any] = {
            "shapes": dict(sorted(shapes.items())),
            "side_calls": len(g.side_calls),
            "turns_after_side_calls": g.turns_after,
            "clients": _labels(g.clients, label),
        }
        if g.requested - g.conversation_models:
            ev["advice"] = weak_model_side_calls(g.requested, g.conversation_models)
        return ev

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        shapes = ", ".join(SHAPE_WORDS.get(s, s) for s in ev.get("shapes", {})) or "side"
        return (
            f"{join_names(ev.get('clients', []))}'s {shapes} side-calls ran on "
            f"{short_model(f.get('model'))}, the model serving the conversation, and "
            f"{evicted(f)} the cache {times(n)}: {lost_text(f)}.",
            advised(ev, BY_NAME[SIDE_CALL].fix),
        )


class OtherConversationEviction(Eviction):
    """Another conversation (or a stateless request) ran on the model between two turns."""

    name = OTHER_CONVERSATION_EVICTION
    cause = OTHER_CONVERSATION

    def collect(self, g: LossGroup, btw: Between) -> None:
        for e in btw.other_entries:
            if e.kind == STATELESS:
                g.stateless.add(e.id)
            elif e.conversation is not None:
                g.conversations.add(e.conversation)
            g.clients.add(e.client)

    def evidence(self, g: LossGroup, label: Label) -> dict[str, Any]:
        return {
            "other_conversations": len(g.conversations) + len(g.stateless),
            "clients": _labels(g.clients, label),
        }

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        k = ev.get("other_conversations", 0)
        who = join_names(ev.get("clients", []))
        return (
            f"{n_of(k, 'other conversation')} ({who}) ran "
            f"on {short_model(f.get('model'))} between turns and {evicted(f)} the cache "
            f"{times(n)}: {lost_text(f)}.",
            BY_NAME[OTHER_CONVERSATION].fix,
        )


class OtherModelEviction(Eviction):
    """Requests to other models ran on the same server between two turns."""

    name = OTHER_MODEL_EVICTION
    cause = OTHER_MODEL
    likely = False  # another model's load unloads this one's cache whatever the slots

    def collect(self, g: LossGroup, btw: Between) -> None:
        for e in btw.domain_entries:
            g.models.add(e.served)

    def evidence(self, g: LossGroup, label: Label) -> dict[str, Any]:
        return {"other_models": sorted(g.models)}

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n = len(f.get("rows", []))
        others = join_names([short_model(m) for m in ev.get("other_models", [])])
        return (
            f"Requests to {others} ran between turns on {short_model(f.get('model'))}, and "
            f"its cache was gone {times(n)}: {lost_text(f)}.",
            BY_NAME[OTHER_MODEL].fix,
        )


__all__ = [
    "OTHER_CONVERSATION_EVICTION",
    "OTHER_MODEL_EVICTION",
    "SIDE_CALL_ON_MODEL",
    "Eviction",
    "OtherConversationEviction",
    "OtherModelEviction",
    "SideCallOnModel",
]
