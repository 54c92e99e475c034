"""`llmp analyze --fail-on KIND[,KIND...] [--min-lost-ms N]`: a gate for CI (docs/ci-gate.md).

The gate reads the findings the report already holds, so what fails the
build is exactly what `--json` prints.  A finding offends when its kind is
listed and either

* it has a `lost_ms` whose value is at least N, or
* it has no `lost_ms` at all: the context findings (`large_system_prompt`,
  `large_tool_schema`, `unused_tool`, `context_overflow`) have no time by
  nature, and a loss finding that could not be timed cannot be shown to be
  under N.  Such a finding offends whenever it is present.

With N = 0 (the default) every listed finding offends, but a minor one: a loss
finding under `--min-lost-tokens` is in the report (R38: every charged token is in
a finding) and never fails the gate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmp.analysis.findings import BY_KIND, KINDS, FindingKind
from llmp.analysis.words import short_model


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
        if f.get("kind") not in wanted or f.get("minor"):
            continue
        ms = lost_ms(f)
        if ms is None or ms >= min_lost_ms:
            out.append(f)
    return out


def reason(f: dict[str, Any]) -> str:
    """One line naming a finding that failed the gate: its kind's detail and size."""
    kind = f["kind"]
    cls = BY_KIND.get(kind, FindingKind)
    detail = cls.gate_detail(f)
    who = f.get("client") or short_model(f.get("model"))
    head = f"{kind} ({detail})" if detail else kind
    return f"llmp: FAIL {head} {who}: {cls.gate_size(f)}"


__all__ = ["lost_ms", "offending", "parse_kinds", "reason"]
