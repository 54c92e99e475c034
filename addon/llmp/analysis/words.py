"""How the reports say numbers, names and places: the words the findings and the views share.

Here, not in render.py, so that a finding kind can write its own sentence
without importing rich (which `--json` never needs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from llmp.format.nouns import each_of, n_of, plural, times

SHAPE_WORDS = {
    "oneshot": "one-off (title, commit message)",
    "summarise": "summary",
    "structured": "structured-output",
}

WITHIN_WORDS = {
    "first_256": "in its first 256 characters",
    "last_256": "in its last 256 characters",
    "between": "between its first and last 256 characters",
}


def duration(ms: float | None) -> str:
    """A duration as a person says it."""
    if ms is None:
        return "not timed"
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def usd(value: float) -> float:
    """Dollars as the report writes them: to a millionth, so that sums stay exact to the
    cent however many rows they add up."""
    return round(value, 6)


def money(usd: float | None) -> str:
    """`$1.37`, `$0.004`: dollars as a person reads them (cents from a dime up, else the
    first digits that are not zero)."""
    if usd is None:
        return "an unknown amount"
    if usd >= 0.1 or usd == 0:
        return f"${usd:,.2f}"
    if usd >= 0.001:
        return f"${usd:.3f}"
    if usd < 1e-6:
        return "under $0.000001"
    places = 1 - math.floor(math.log10(usd))  # two digits that are not zero, no exponent
    return f"${usd:.{places}f}"


def value_of(mv: Any) -> float | None:
    """A report measure's value (`{"value": …, "source": …}`), or None."""
    return float(mv["value"]) if isinstance(mv, dict) else None


def lost_text(f: dict[str, Any]) -> str:
    """What a loss finding cost: dollars on a provider, time when timed, else tokens, else
    why not."""
    ms = value_of(f.get("lost_ms"))
    tokens = f.get("lost_tokens")
    usd = f.get("lost_usd")
    if isinstance(usd, (int, float)) and tokens is not None:
        timed = f" and {duration(ms)}" if ms is not None else ""
        return f"{money(usd)}{timed} lost ({n_of(tokens, 'token')})"
    if ms is not None:
        text = f"{duration(ms)} lost"
        if tokens is not None:
            text += f" ({n_of(tokens, 'token')})"
        return text
    if tokens is not None:
        return f"{n_of(tokens, 'token')} re-processed (not timed)"
    return "loss not measured (the server reports no cache counters)"


def join_names(items: Sequence[str]) -> str:
    """Names as a sentence lists them: "a", "a and b", "a, b and c"."""
    items = list(items)
    if not items:
        return "a client"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def where_text(changed: Any) -> str:
    """` (system block 1, in its first 256 characters)`: where the change was, no text."""
    if not isinstance(changed, list) or not changed or not isinstance(changed[0], dict):
        return ""
    c = changed[0]
    role, index = c.get("role"), c.get("index")
    what = f"{role} message {index}" if isinstance(index, int) else f"{role} message"
    if role in ("system", "developer") and isinstance(index, int):
        what = f"{role} block {index}" if index else f"first {role} block"
    parts = [what, WITHIN_WORDS.get(str(c.get("within")), "")]
    if isinstance(c.get("offset"), int):
        parts.append(f"at character {c['offset']:,}")
    return " (" + ", ".join(p for p in parts if p) + ")"


def advised(ev: dict[str, Any], fallback: str) -> str:
    """The harness's own fix when the finding recognised it, else the general one."""
    tip = ev.get("advice")
    if not isinstance(tip, dict) or not tip.get("text"):
        return fallback
    who = f"{tip['harness']}: " if tip.get("harness") else ""
    sure = (
        f" ({tip.get('confidence')} confidence: {tip.get('because')})" if tip.get("because") else ""
    )
    return f"{who}{tip['text']}{sure}"


def short_model(name: str | None) -> str:
    """A model file path as its file name; a model name as it is."""
    if not name:
        return "the model"
    return name.rsplit("/", 1)[-1] if "/" in name and name.endswith((".gguf", ".bin")) else name


__all__ = [
    "SHAPE_WORDS",
    "WITHIN_WORDS",
    "advised",
    "duration",
    "each_of",
    "join_names",
    "lost_text",
    "money",
    "n_of",
    "plural",
    "short_model",
    "times",
    "value_of",
    "where_text",
]
