"""`prefix_break`: the client changed the start of its own prompt between two turns."""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from llmp.analysis.advice import attribution_header, cut_after_context_error, volatile_block
from llmp.analysis.causes import BY_NAME, CLIENT
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
from llmp.analysis.words import advised, lost_text, n_of, short_model, where_text

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.loss import Between
    from llmp.analysis.overflow import Refusal
    from llmp.analysis.rows import Row

PREFIX_BREAK = "prefix_break"


class PrefixBreak(FindingKind):
    """Per client, break cause and served model; the share is of the client's linked turns."""

    name = PREFIX_BREAK

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[tuple[int, tuple[str, str]], LossGroup] = {}
        """(client, (cause, served)): the breaks."""
        self.links: Counter[tuple[int, str]] = Counter()
        self.refusals: deque[tuple[int, int]] = deque(maxlen=1024)  # (session, record id)
        self.servers: dict[str, str] = {}
        """The server program behind each served model: whose settings advice names."""

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
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

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        if row.new_conversation:
            return
        self.links[(row.client, row.served)] += 1
        if row.server:
            self.servers[row.served] = row.server
        if row.break_cause is None or row.compaction:
            return
        g = group(self.groups, (row.client, (row.break_cause, row.served)))
        g.broken += 1
        for c in row.changed or ():
            g.changed[(c.get("index"), c.get("role"), c.get("within"))] += 1
        if row.changed:
            tokens = row.lost_client.tokens if row.lost_client is not None else 0
            g.note_where(row.changed[0], tokens)
            c0 = row.changed[0]
            g.shrank += (c0.get("chars_after") or 0) < (c0.get("chars_before") or 0)
        assert row.linked_to is not None  # a linked turn
        if self._refused_between(row.session, row.linked_to, row.id):
            g.after_refusal += 1
        if row.lost_client is not None:
            g.add_loss(row.id, row.lost_client, row.loss_measured)

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        links: Counter[tuple[str, str]] = Counter()
        for (client, served), n in self.links.items():
            links[(label(client), served)] += n
        out = []
        for (name, (cause, served)), g in merged_by_label(self.groups, label).items():
            if not g.rows:
                continue
            f = loss_finding(self.cfg, self.name, served, name, g, _confidence(g))
            if f is None:
                continue
            n_links = links[(name, served)]
            f["evidence"] = {
                "break_cause": cause,
                "links": n_links,
                "broken": g.broken,
                "share": round(g.broken / n_links, 4) if n_links else None,
                "changed": _positions(g),
            }
            tip = _break_advice(cause, g, name, self.servers.get(served))
            if tip is not None:
                f["evidence"]["advice"] = tip
            out.append(f)
        return out

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        cause = BY_NAME.get(str(ev.get("break_cause")))
        known = cause is not None and cause.group == CLIENT
        what = cause.did if cause is not None and known else "broke its prompt prefix"
        fix = cause.fix if cause is not None and known else "Keep the start of the prompt stable."
        share = ev.get("share")
        pct = f" ({share:.0%})" if isinstance(share, (int, float)) else ""
        where = where_text(ev.get("changed"))
        return (
            f"{f.get('client')} {what} in {ev.get('broken')} of {_turns(ev.get('links'))}{pct} "
            f"on {short_model(f.get('model'))}{where}: {lost_text(f)}.",
            advised(ev, fix),
        )

    @classmethod
    def gate_detail(cls, f: dict[str, Any]) -> Any:
        return (f.get("evidence") or {}).get("break_cause")


def _turns(links: Any) -> str:
    return n_of(links, "turn") if isinstance(links, int) else f"{links} turns"


def _confidence(g: LossGroup) -> str:
    if g.measured == 0:
        return LOW
    if g.broken >= 2 and g.unmeasured == 0:
        return HIGH
    return MEDIUM


def _positions(g: LossGroup) -> list[dict[str, Any]]:
    """Where the rows' messages changed, most frequent first (no text: index, role, part)."""
    out = []
    for (index, role, within), n in g.changed.most_common(3):
        out.append({"index": index, "role": role, "within": within, "rows": n})
    if g.where is not None and out and g.where.get("offset") is not None:
        # Full mode: the largest loss's change, at its character, with a little text.
        out[0] = {**out[0], **{k: g.where.get(k) for k in ("offset", "context", "was")}}
    return out


def _break_advice(
    cause: str, g: LossGroup, label: str, server: str | None
) -> dict[str, Any] | None:
    """What the client can do about its prefix break, when its harness is recognised."""
    if g.after_refusal and g.after_refusal * 2 >= g.broken:
        return cut_after_context_error(g.shrank > 0, label, server)
    if cause == "system_changed":
        return attribution_header(g.where, label) or volatile_block(g.where, label)
    return None


__all__ = ["PREFIX_BREAK", "PrefixBreak"]
