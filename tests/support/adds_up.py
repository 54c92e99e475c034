"""R38: what a report says adds up, checked on the report itself.

`problems(report)` lists every way a report v1 fails R38: the findings' losses,
the rows', `time.by_cause` and `time.lost_*` must be the same tokens, milliseconds
and (on a provider) dollars.  `readable_problems(text, report)` checks the readable
report against the same report: the numbers a person reads add up too.
"""

from __future__ import annotations

import re
from typing import Any

CENT = 0.005
"""Dollars agree to the cent: sums of per-row figures may differ in the last digits."""


def _value(mv: Any) -> float:
    return float(mv["value"]) if isinstance(mv, dict) else 0.0


def _row_losses(report: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for r in report["rows"]:
        for key in ("lost_client", "lost_external"):
            loss = r.get(key)
            if loss is not None:
                out.append((r["id"], loss))
    return out


def problems(report: dict[str, Any]) -> list[str]:
    """Every way `report` fails R38 (an empty list when it adds up)."""
    out: list[str] = []
    t = report["time"]
    losses = _row_losses(report)
    rows_tokens = sum(loss["tokens"] for _, loss in losses)
    rows_ms = sum(_value(loss["ms"]) for _, loss in losses)
    cause_tokens = sum(c["tokens"] for c in t["by_cause"].values())
    cause_ms = sum(_value(c["ms"]) for c in t["by_cause"].values())
    cause_rows = sum(c["rows"] for c in t["by_cause"].values())
    loss_findings = [f for f in report["findings"] if f.get("lost_tokens") is not None]
    found_tokens = sum(f["lost_tokens"] for f in loss_findings)
    found_ms = sum(_value(f.get("lost_ms")) for f in loss_findings)

    def same(what: str, *figures: float, tol: float = 0.0) -> None:
        if max(figures) - min(figures) > tol:
            out.append(f"{what} differ: {figures}")

    same(
        "lost tokens (total, rows, causes, findings)",
        t["lost_tokens"],
        rows_tokens,
        cause_tokens,
        found_tokens,
    )
    same(
        "lost ms (total, rows, causes, findings)",
        _value(t["lost_ms"]),
        rows_ms,
        cause_ms,
        found_ms,
        tol=1e-6,
    )
    same("loss count (rows, causes)", len(losses), cause_rows)
    for cause, c in t["by_cause"].items():
        mine = [loss for _, loss in losses if loss["cause"] == cause]
        same(f"{cause} tokens (causes, rows)", c["tokens"], sum(m["tokens"] for m in mine))
        same(
            f"{cause} ms (causes, rows)",
            _value(c["ms"]),
            sum(_value(m["ms"]) for m in mine),
            tol=1e-6,
        )
    for f in report["findings"]:
        if f.get("lost_tokens") is None and f.get("lost_ms") is not None:
            out.append(f"{f['kind']} has lost_ms without lost_tokens")
    # Each finding's rows hold its loss: the tokens it names come from its rows' losses.
    by_row: dict[int, int] = {}
    for rid, loss in losses:
        by_row[rid] = by_row.get(rid, 0) + loss["tokens"]
    for f in loss_findings:
        held = sum(by_row.get(r, 0) for r in f["rows"])
        if f["lost_tokens"] > held:
            out.append(f"{f['kind']} names {f['lost_tokens']} tokens; its rows hold {held}")
    # Dollars, where a provider priced them (R36).
    cost = report.get("cost")
    if isinstance(cost, dict) and cost.get("lost_usd") is not None:
        rows_usd = sum(loss.get("usd") or 0.0 for _, loss in losses)
        cause_usd = sum(c.get("usd") or 0.0 for c in t["by_cause"].values())
        found_usd = sum(f.get("lost_usd") or 0.0 for f in loss_findings)
        same(
            "lost usd (total, rows, causes, findings)",
            cost["lost_usd"],
            rows_usd,
            cause_usd,
            found_usd,
            tol=CENT,
        )
    return out


_INT = r"(\d[\d,]*)"


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def readable_problems(text: str, report: dict[str, Any]) -> list[str]:
    """Where the readable report's loss figures disagree with the report's total."""
    out: list[str] = []
    total = report["time"]["lost_tokens"]
    before, _, after = text.partition("\nFindings\n")
    flat = re.sub(r"\s+", " ", before)  # rich wraps long lines at the console's width
    if "went to re-processing" in flat:
        m = re.search(_INT + r" tokens?\) went to re-processing", flat)
        if m is None or _int(m.group(1)) != total:
            out.append(f"headline tokens {m and m.group(1)} != {total}")
    if not after:
        return out
    # The findings end where the first client's table begins.
    section = re.sub(r"\s+", " ", after.split("┏", 1)[0])
    said = 0
    for m in re.finditer(r"lost \(" + _INT + r" tokens?\)", section):
        said += _int(m.group(1))
    for m in re.finditer(_INT + r" tokens? re-processed \(not timed\)", section):
        said += _int(m.group(1))
    for m in re.finditer(r", " + _INT + r" tokens?(?:, [^,]*?)? lost in all", section):
        said += _int(m.group(1))
    if said != total:
        out.append(f"the findings say {said} tokens lost, the report {total}")
    return out


__all__ = ["problems", "readable_problems"]
