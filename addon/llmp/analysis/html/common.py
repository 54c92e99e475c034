"""What every part of the page shares: the cause colours, limits and small formatters."""

from __future__ import annotations

import datetime as dt
import html
import math
from typing import Any

from llmp.analysis.causes import BY_NAME, COLOURS
from llmp.analysis.changes import broke
from llmp.analysis.words import n_of

CAUSES: dict[str, str] = COLOURS
"""Each cause's colour (`causes.CAUSES` holds them)."""
_UNKNOWN_CAUSE = "other"
_UNKNOWN_COLOUR = "#9A9A9A"

MAX_BARS = 400
"""Bars per conversation chart; longer conversations are drawn in buckets of turns."""
MAX_CHARTS = 60
"""Conversations drawn; the rest are listed in a table."""
DIFF_CONTEXT = 3
"""Unchanged messages shown on each side of a change; longer runs are folded."""


# -- small helpers -----------------------------------------------------------


def _e(value: Any) -> str:
    """Escape anything for HTML text or a quoted attribute."""
    return html.escape(str(value), quote=True)


def _mv(value: Any) -> float | None:
    """The number of a measured value, or None."""
    if isinstance(value, dict):
        v = value.get("value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _obj(d: dict[str, Any], key: str) -> dict[str, Any]:
    """`d[key]` when it is an object, else an empty one."""
    v = d.get(key)
    return v if isinstance(v, dict) else {}


def _obj_or_none(d: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = d.get(key)
    return v if isinstance(v, dict) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return None


def _cause_key(cause: Any) -> str:
    return cause if isinstance(cause, str) and cause in CAUSES else _UNKNOWN_CAUSE


def _cause_words(cause: Any) -> str:
    if isinstance(cause, str):
        known = BY_NAME.get(cause)
        return known.words if known is not None else cause.replace("_", " ")
    return "unknown cause"


def _num(n: float | int | None) -> str:
    if n is None:
        return "–"
    return f"{round(n):,}"


def _tokens(n: Any) -> str:
    """`1 token`, `1,204 tokens`, `– tokens` when not known."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "– tokens"
    return n_of(round(n), "token")


def _when(ms: Any) -> str:
    if not isinstance(ms, int) or isinstance(ms, bool):
        return "–"
    try:
        return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):
        return "–"


def _short(h: Any) -> str:
    return str(h)[:8] if isinstance(h, str) and h else "–"


def _nice(x: float) -> float:
    """A round number at or above x, for an axis maximum."""
    if x <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if x <= m * exp:
            return m * exp
    return 10 * exp


def _fmt_axis(v: float) -> str:
    if v >= 1_000_000:
        return f"{v / 1_000_000:g}M"
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = report.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _losses(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        loss for key in ("lost_client", "lost_external") if isinstance(loss := row.get(key), dict)
    ]


def _lost_tokens(row: dict[str, Any]) -> int:
    return sum(_int(loss.get("tokens")) or 0 for loss in _losses(row))


def _lost_ms(row: dict[str, Any]) -> float | None:
    values = [_mv(loss.get("ms")) for loss in _losses(row)]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def is_break(row: dict[str, Any]) -> bool:
    """A report row that the "what changed" section explains (`changes.broke`)."""
    lost = bool(_losses(row))
    return broke(row.get("kind"), _int(row.get("linked_to")), row.get("break_cause"), lost)


def _anchor(session: Any, row_id: Any) -> str:
    return f"change-s{_int(session) or 0}-{_int(row_id) or 0}"
