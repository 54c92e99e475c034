"""`volatile_head`: a system prompt that differs only in its head, re-read by new conversations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmp.analysis.advice import attribution_header, volatile_block
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
from llmp.analysis.words import advised, join_names, lost_text, n_of, short_model, where_text

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.loss import Between
    from llmp.analysis.rows import Row

VOLATILE_HEAD = "volatile_head"


class VolatileHead(FindingKind):
    """Per client and served model: the turns charged for a volatile head (R38: the row's
    `lost_client`, with `volatile_where` set)."""

    name = VOLATILE_HEAD

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[tuple[int, str], LossGroup] = {}

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        loss = row.lost_client
        if loss is None or row.volatile_where is None:
            return
        g = group(self.groups, (row.client, row.served))
        g.add_loss(row.id, loss, row.loss_measured)
        g.broken += row.compaction
        if row.conversation is not None:
            g.conversations.add(row.conversation)
        g.note_where(row.volatile_where, loss.tokens)

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        out = []
        for (name, served), g in merged_by_label(self.groups, label).items():
            conf = HIGH if g.measured and not g.unmeasured else MEDIUM if g.measured else LOW
            f = loss_finding(self.cfg, self.name, served, name, g, conf)
            if f is None:
                continue
            where = g.where or {}
            f["evidence"] = {
                "conversations": len(g.rows) - g.broken,
                "compactions": g.broken,
                "changed": {k: where.get(k) for k in ("index", "role", "within")},
            }
            tip = attribution_header(g.where, name) or volatile_block(g.where, name)
            if tip is not None:
                f["evidence"]["advice"] = tip
            out.append(f)
        return out

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        n_conv, n_comp = ev.get("conversations", 0), ev.get("compactions", 0)
        hit = join_names(
            [
                n_of(k, noun)
                for k, noun in ((n_conv, "new conversation"), (n_comp, "compaction"))
                if k
            ]
        )
        each = "each of " if n_conv + n_comp > 1 else ""
        where = where_text([ev.get("changed")] if ev.get("changed") else [])
        return (
            f"{f.get('client')}'s system prompt differed only in its head{where}, and {each}"
            f"{hit} on {short_model(f.get('model'))} read the whole prompt again: "
            f"{lost_text(f)}.",
            advised(
                ev,
                "Keep the start of the system prompt identical across conversations: put "
                "anything that changes (a version, a date, a session id) after the stable part.",
            ),
        )


__all__ = ["VOLATILE_HEAD", "VolatileHead"]
