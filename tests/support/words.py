"""Slips where a count meets a noun ("1 turns", "each of 1 conversation", "3 turn"),
found in any text a report renders."""

from __future__ import annotations

import re

NOUNS = (
    "turn",
    "conversation",
    "new conversation",
    "request",
    "chat request",
    "record",
    "session",
    "side-call",
    "token",
    "prompt token",
    "message",
    "row",
    "tool",
    "line",
    "change",
    "compaction",
    "finding",
    "warning",
    "entry",
    "write",
    "miss",
)
"""Nouns that are not also adjectives here ("prompt tokens", "model requests")."""

_PLURAL = {"entry": "entries", "miss": "misses"}


def _plural(noun: str) -> str:
    head, sep, last = noun.rpartition(" ")
    return head + sep + _PLURAL.get(last, last + "s")


def slips(text: str) -> list[str]:
    """Every place in `text` where a number and its noun disagree."""
    flat = re.sub(r"\s+", " ", text)
    found: list[str] = []
    for noun in NOUNS:
        many = _plural(noun)
        # "1 turns": one of a plural (not "1.5 turns", not "of 1 turns" in "1 of 1 turns").
        for m in re.finditer(rf"(?<![\d.,])1 {re.escape(many)}\b", flat):
            found.append(flat[max(0, m.start() - 30) : m.end() + 10])
        # "3 turn" / "0 turn": many of a singular (not "3 turn-…", not "turn 3").
        for m in re.finditer(
            rf"(?<![\d.,#])(0|[2-9]|\d[\d,]*\d) {re.escape(noun)}\b(?![-s])", flat
        ):
            found.append(flat[max(0, m.start() - 30) : m.end() + 10])
    for m in re.finditer(r"\beach of (1|one)\b", flat):
        found.append(flat[max(0, m.start() - 30) : m.end() + 20])
    return found


__all__ = ["slips"]
