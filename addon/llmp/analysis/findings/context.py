"""What costs context in every prompt: a large system prompt, a large tool, a tool never called.

These findings have no lost time by nature, so `--fail-on` names their size instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmp.analysis.findings.base import HIGH, MEDIUM, FindingKind, Label, Tools, ToolStats
from llmp.analysis.words import n_of
from llmp.format.measure import ESTIMATE

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.rows import Row

UNUSED_TOOL = "unused_tool"
LARGE_TOOL_SCHEMA = "large_tool_schema"
LARGE_SYSTEM_PROMPT = "large_system_prompt"


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


class LargeSystemPrompt(FindingKind):
    """Per client: its largest system prompt, and the first turns that sent a large one."""

    name = LARGE_SYSTEM_PROMPT

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.system: dict[int, SystemStats] = {}

    def turn(self, row: Row) -> None:
        tokens, src = row.composition[0]
        st = self.system.get(row.client)
        if st is None:
            st = self.system[row.client] = SystemStats()
        if tokens > st.tokens:
            st.tokens, st.source = int(tokens), src
        if row.turn == 1 and tokens >= self.cfg.large_system_tokens:
            st.rows.append(row.id)
            st.served.add(row.served)

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        threshold = self.cfg.large_system_tokens
        by_label: dict[str, SystemStats] = {}
        for client, st in self.system.items():
            name = label(client)
            if name not in by_label:
                by_label[name] = SystemStats(source=st.source)
            by_label[name].merge(st)
        return [
            {
                "kind": self.name,
                "model": next(iter(st.served)) if len(st.served) == 1 else None,
                "client": name,
                "rows": sorted(st.rows),
                "lost_tokens": None,
                "lost_ms": None,
                "context_tokens": st.tokens,
                "confidence": MEDIUM if st.source == ESTIMATE else HIGH,
                "evidence": {"system_tokens": st.tokens, "threshold": threshold},
            }
            for name, st in by_label.items()
            if st.tokens >= threshold
        ]

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        return (
            f"{f.get('client')}'s system prompt is {_tokens(ev.get('system_tokens'))} (threshold "
            f"{ev.get('threshold')}); every cache miss re-processes it.",
            "Trim it, or move rarely needed instructions into tools or files read on demand.",
        )

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        ev = f.get("evidence") or {}
        return f"{ev.get('system_tokens', 0):,} tokens (threshold {ev.get('threshold', 0):,})"


def _n(count: Any, noun: str) -> str:
    """A count from a finding's evidence with its noun; a damaged count as it is."""
    return n_of(count, noun) if isinstance(count, int) else f"{count} {noun}s"


def _tokens(count: Any) -> str:
    return _n(count, "token")


def tools_by_label(label: Label, tools: Tools) -> dict[tuple[str, str], ToolStats]:
    """Each (client label, tool name)'s stats, merged into fresh ones."""
    out: dict[tuple[str, str], ToolStats] = {}
    for (client, tool), ts in tools.items():
        key = (label(client), tool)
        if key not in out:
            out[key] = ToolStats()
        out[key].merge(ts)
    return out


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


class UnusedTool(FindingKind):
    """A tool offered in many requests and never called: its schema is in every prompt."""

    name = UNUSED_TOOL

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        least = self.cfg.unused_tool_min_offered
        out = []
        for (name, tool), ts in tools_by_label(label, tools).items():
            if ts.called or ts.offered < least:
                continue
            days = 0.0
            if ts.first_t is not None and ts.last_t is not None:
                days = round((ts.last_t - ts.first_t) / 86_400_000, 4)
            evidence = {
                "tool": tool,
                "offered": ts.offered,
                "days": days,
                "sessions": len(ts.sessions),
            }
            conf = HIGH if ts.offered >= 5 * least else MEDIUM
            out.append(_tool_finding(self.name, name, ts, conf, evidence))
        return out

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        return (
            f"{f.get('client')} offered the tool {ev.get('tool')} in "
            f"{_n(ev.get('offered'), 'request')} over {ev.get('days', 0):.1f} days and never "
            f"called it; it costs {_tokens(f.get('context_tokens'))} of every prompt.",
            "Remove it, or offer it only when it is needed.",
        )

    @classmethod
    def gate_detail(cls, f: dict[str, Any]) -> Any:
        return (f.get("evidence") or {}).get("tool")

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        offered = int((f.get("evidence") or {}).get("offered") or 0)
        return f"offered in {n_of(offered, 'request')}, never called"


class LargeToolSchema(FindingKind):
    """A tool whose description and schema alone pass the threshold."""

    name = LARGE_TOOL_SCHEMA

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        threshold = self.cfg.large_tool_tokens
        return [
            _tool_finding(
                self.name,
                name,
                ts,
                MEDIUM if ts.source == ESTIMATE else HIGH,
                {"tool": tool, "schema_tokens": ts.schema_tokens, "threshold": threshold},
            )
            for (name, tool), ts in tools_by_label(label, tools).items()
            if ts.schema_tokens >= threshold
        ]

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        ev = f.get("evidence", {})
        return (
            f"{f.get('client')}'s tool {ev.get('tool')} takes {_tokens(ev.get('schema_tokens'))} "
            f"(threshold {ev.get('threshold')}).",
            "Shorten its description and schema.",
        )

    @classmethod
    def gate_detail(cls, f: dict[str, Any]) -> Any:
        return (f.get("evidence") or {}).get("tool")

    @classmethod
    def gate_size(cls, f: dict[str, Any]) -> str:
        ev = f.get("evidence") or {}
        return f"{ev.get('schema_tokens', 0):,} tokens (threshold {ev.get('threshold', 0):,})"


__all__ = [
    "LARGE_SYSTEM_PROMPT",
    "LARGE_TOOL_SCHEMA",
    "UNUSED_TOOL",
    "LargeSystemPrompt",
    "LargeToolSchema",
    "SystemStats",
    "UnusedTool",
    "tools_by_label",
]
