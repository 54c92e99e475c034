"""`server_cache_loss`: the server dropped a cache nothing in the traffic evicted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmp.analysis.causes import (
    BY_NAME,
    SERVER,
    SERVER_CAUSES,
    SERVER_EMPTY,
    SERVER_HEAD_ONLY,
    SERVER_NO_ROLLBACK,
    SERVER_ROLLBACK,
)
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
from llmp.analysis.words import advised, each_of, lost_text, n_of, short_model, times

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.loss import Between
    from llmp.analysis.rows import Row

SERVER_CACHE_LOSS = "server_cache_loss"


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
                f"Its {n_of(self.appended, 'appended turn')} reused the whole cache, and after "
                f"{each_of(self.changes, 'change')} it re-read from the start or from a "
                "checkpoint: the model's cache cannot go back (a sliding-window or "
                "hybrid/recurrent model)."
            )
        return out


class ServerCacheLoss(FindingKind):
    """Per served model and server cause (causes.py's `server` group)."""

    name = SERVER_CACHE_LOSS

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.groups: dict[tuple[str, str], LossGroup] = {}
        self.memory: dict[str, Memory] = {}
        self.servers: dict[str, str] = {}
        """The server program behind each served model: whose fix the finding gives."""

    def linked(self, row: Row, btw: Between, cut: bool) -> None:
        if not row.new_conversation:
            self._memory(row, btw)
        if row.server:
            # The latest word on the server: its build may show only later (a vLLM's
            # 128-token blocks are its CPU build), and the fix is the build's.
            self.servers[row.served] = row.server
        ext = row.lost_external
        if ext is None or ext.cause not in SERVER_CAUSES:
            return
        # Every charged token is in one finding (R38), these included: a prompt the server
        # cut lost its cache to the cut (context_overflow names the cut), and a request in
        # between that may have run leaves the cause undetermined; the evidence says so.
        g = group(self.groups, (row.served, ext.cause))
        g.add_loss(row.id, ext, True)
        g.after_cut += cut
        g.after_skipped += btw.skipped

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

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        out = []
        for (served, kind), g in self.groups.items():
            mem = self.memory.get(served) if kind == SERVER_NO_ROLLBACK else None
            f = loss_finding(self.cfg, self.name, served, None, g, _confidence(kind, g, mem))
            if f is not None:
                f["evidence"] = {"kind": kind, "server": self.servers.get(served)}
                if g.after_cut:
                    f["evidence"]["after_cut"] = g.after_cut
                if g.after_skipped:
                    f["evidence"]["after_skipped"] = g.after_skipped
                if mem is not None:
                    f["evidence"]["memory"] = mem.evidence()
                out.append(f)
        return out

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        sub = BY_NAME.get(str(ev.get("kind")))
        if sub is None or sub.group != SERVER:
            sub = BY_NAME[SERVER_ROLLBACK]
        n = len(f.get("rows", []))
        story = sub.story.format(
            model=short_model(f.get("model")), times=times(n), lost=lost_text(f)
        )
        server = ev.get("server")
        return (
            story + _memory_note(ev) + _doubt_note(ev),
            advised(ev, sub.fix_for(server if isinstance(server, str) else None)),
        )

    @classmethod
    def gate_detail(cls, f: dict[str, Any]) -> Any:
        return (f.get("evidence") or {}).get("kind")


def _confidence(kind: str, g: LossGroup, mem: Memory | None) -> str:
    if g.after_cut + g.after_skipped >= len(g.rows):
        return LOW  # every row has another explanation (the cut, or a request that may have run)
    if g.after_cut or g.after_skipped:
        return MEDIUM
    if kind == SERVER_EMPTY:
        return HIGH
    if kind == SERVER_HEAD_ONLY:
        return HIGH if len(g.rows) >= 2 else MEDIUM
    if mem is not None and mem.signature:
        return HIGH
    return MEDIUM


def _doubt_note(ev: dict[str, Any]) -> str:
    """The rows another explanation covers: a prompt the server cut, a request that may
    have run in between."""
    parts = []
    cut, skipped = int(ev.get("after_cut") or 0), int(ev.get("after_skipped") or 0)
    if cut:
        parts.append(
            f"{n_of(cut, 'turn')} followed a prompt the server cut (see the context overflow "
            "finding)"
        )
    if skipped:
        parts.append(f"{n_of(skipped, 'turn')} came after a failed request that may have run")
    return f" Of these, {' and '.join(parts)}." if parts else ""


def _memory_note(ev: dict[str, Any]) -> str:
    """What the traffic shows of the model's memory."""
    memory = ev.get("memory")
    if not isinstance(memory, dict) or not memory.get("text"):
        return ""
    return f" {memory['text']}"


__all__ = ["SERVER_CACHE_LOSS", "Memory", "ServerCacheLoss"]
