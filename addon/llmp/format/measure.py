"""Measured values: a number and where it came from.

Internally a measured value is a `(value, source)` tuple (cheap to build and
compare); `as_json` turns it into the spec's `{"value", "source"}` object.
"""

from __future__ import annotations

from typing import Any

SERVER = "server"
TOKENIZER = "tokenizer"
PROXY = "proxy"
ESTIMATE = "estimate"

RANK = {SERVER: 0, TOKENIZER: 1, PROXY: 2, ESTIMATE: 3}

MV = tuple[float, str]
"""A measured value: (value, source)."""


def weakest(*sources: str) -> str:
    """The weakest of the sources: a value built from several carries it."""
    first = sources[0]
    worst = first
    for s in sources[1:]:
        if s is not worst and RANK[s] > RANK[worst]:
            worst = s
    return worst


def estimate(chars: int) -> int:
    """R19: ceil(chars / 4); 0 for empty text, at least 1 otherwise."""
    return (chars + 3) // 4 if chars > 0 else 0


def clean(value: float) -> float | int:
    """Round ms and shares so float noise does not reach the report."""
    if isinstance(value, int):
        return value
    r = round(value, 3)
    return int(r) if r == int(r) and abs(r) < 1 << 53 else r


def as_json(mv: MV | None) -> dict[str, Any] | None:
    """The spec's measured value object, or null (values are rounded where computed)."""
    if mv is None:
        return None
    return {"value": mv[0], "source": mv[1]}


class Sum:
    """A running sum of measured values that keeps the weakest source."""

    __slots__ = ("any", "rank", "value")

    def __init__(self) -> None:
        self.value: float = 0
        self.rank = -1
        self.any = False

    def add(self, mv: MV | None) -> None:
        if mv is None:
            return
        self.value += mv[0]
        r = RANK[mv[1]]
        if r > self.rank:
            self.rank = r
        self.any = True

    def result(self) -> MV | None:
        """The sum, or None when nothing was added (not measured)."""
        if not self.any:
            return None
        return (clean(self.value), _BY_RANK[self.rank])


_BY_RANK = {v: k for k, v in RANK.items()}
