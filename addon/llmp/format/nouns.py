"""Numbers with nouns: `1 turn`, `3 turns`, `each of 3 new conversations`.

The one helper for every place a count meets a noun (the reports, the live view,
the recorder's and the demo's messages), so a reader never meets "1 turns" or
"each of 1 conversation".  Here, in the lowest layer, because the recorder and the
format's own messages count things too.
"""

from __future__ import annotations

_IRREGULAR = {
    "entry": "entries",
    "body": "bodies",
    "was": "were",
    "is": "are",
    "has": "have",
    "this": "these",
    "it": "they",
    "its": "their",
}
"""Words whose plural is not the word with an `s`."""


def plural(noun: str, count: float, many: str | None = None) -> str:
    """`noun` as `count` wants it: as it is for exactly 1, else its plural.

    A phrase is made plural on its last word (`new conversation` -> `new
    conversations`); a hyphen is kept (`side-call` -> `side-calls`).  A phrase whose
    noun is not its last word says its plural itself (`many`: "requests to another
    model")."""
    if count == 1:
        return noun
    if many is not None:
        return many
    head, sep, last = noun.rpartition(" ")
    return head + sep + _plural_word(last)


def _plural_word(word: str) -> str:
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    if len(word) > 1 and word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def n_of(count: int, noun: str, many: str | None = None) -> str:
    """`1 turn`, `1,204 turns`, `0 turns`."""
    return f"{count:,} {plural(noun, count, many)}"


def each_of(count: int, noun: str, many: str | None = None) -> str:
    """`1 new conversation`, `each of 3 new conversations`: a count that is about to
    have something said of each one."""
    if count < 2:
        return n_of(count, noun, many)
    return f"each of {n_of(count, noun, many)}"


def times(count: int) -> str:
    """`once`, `3 times`."""
    return "once" if count == 1 else f"{count:,} times"


__all__ = ["each_of", "n_of", "plural", "times"]
