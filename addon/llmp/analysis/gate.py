"""`llmp analyze --fail-on KIND[,KIND...] [--min-lost-ms N]`: a gate for CI (docs/ci-gate.md).

The gate reads the findings the report already holds, so what fails the
build is exactly what `--json` prints.  A finding offends when its kind is
listed and either

* it has a `lost_ms` whose value is at least N, or
* it has no `lost_ms` at all: the context findings (`large_system_prompt`,
  `large_tool_schema`, `unused_tool`, `context_overflow`) have no time by
  nature, and a loss finding that could not be timed cannot be shown to be
  under N.  Such a finding offends whenever it is present.

With N = 0 (the default) every listed finding offends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmp.analysis.findings import KINDS


def parse_kinds(values: Iterable[str]) -> tuple[list[str], list[str]]:
    """The kinds named by `--fail-on` values (each comma-separated), and the unknown ones."""
    kinds: list[str] = []
    unknown: list[str] = []
    for value in values:
        for part in value.split(","):
            kind = part.strip()
            if not kind:
                continue
            target = kinds if kind in KINDS else unknown
            if kind not in target:
                target.append(kind)
    return kinds, unknown


def lost_ms(f: dict[str, Any]) -> float | None:
    ms = f.get("lost_ms")
    return float(ms["value"]) if isinstance(ms, dict) else None


def offending(
    findings: Iterable[dict[str, Any]], kinds: Iterable[str], min_lost_ms: float = 0.0
) -> list[dict[str, Any]]:
    """The findings that fail the gate, in report order."""
    wanted = set(kinds)
    out = []
    for f in findings:
        if f.get("kind") not in wanted:
            continue
        ms = lost_ms(f)
        if ms is None or ms >= min_lost_ms:
            out.append(f)
    return out


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def reason(f: dict[str, Any]) -> str:
    """One line naming a finding that failed the gate."""
    # Here, not at the top: rendering imports rich, which `--json` never needs.
    from llmp.analysis.render import duration, short_model

    kind = f["kind"]
    ev = f.get("evidence") or {}
    detail = {
        "prefix_break": ev.get("break_cause"),
        "server_cache_loss": ev.get("kind"),
        "unused_tool": ev.get("tool"),
        "large_tool_schema": ev.get("tool"),
    }.get(kind)
    who = f.get("client") or short_model(f.get("model"))
    n = len(f.get("rows") or [])
    if kind == "large_system_prompt":
        size = f"{ev.get('system_tokens', 0):,} tokens (threshold {ev.get('threshold', 0):,})"
    elif kind == "large_tool_schema":
        size = f"{ev.get('schema_tokens', 0):,} tokens (threshold {ev.get('threshold', 0):,})"
    elif kind == "unused_tool":
        size = f"offered in {_n(int(ev.get('offered') or 0), 'request')}, never called"
    elif kind == "context_overflow":
        parts = []
        if ev.get("truncated"):
            parts.append(f"{ev['truncated']:,} cut silently")
        if ev.get("refused"):
            parts.append(f"{ev['refused']:,} refused")
        size = f"{_n(int(ev.get('turns') or 0), 'turn')} over the context ({', '.join(parts)})"
        n_ctx = ev.get("n_ctx")
        if isinstance(n_ctx, int):
            name = "num_ctx" if ev.get("n_ctx_source") == "request" else "n_ctx"
            size += f", {name} {n_ctx:,}"
    else:
        ms = lost_ms(f)
        tokens = f.get("lost_tokens")
        if ms is not None:
            size = f"{_n(n, 'turn')}, {duration(ms)} lost"
        elif tokens is not None:
            size = f"{_n(n, 'turn')}, {tokens:,} tokens re-processed (not timed)"
        else:
            size = f"{_n(n, 'turn')}, loss not measured"
    head = f"{kind} ({detail})" if detail else kind
    return f"llmp: FAIL {head} {who}: {size}"


__all__ = ["lost_ms", "offending", "parse_kinds", "reason"]
