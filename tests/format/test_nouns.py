"""Numbers with nouns (format/nouns.py), and the slip finder the report tests use."""

from __future__ import annotations

import pytest

from llmp.format.nouns import each_of, n_of, plural, times
from tests.support.words import slips


@pytest.mark.parametrize(
    ("count", "noun", "text"),
    [
        (0, "turn", "0 turns"),
        (1, "turn", "1 turn"),
        (2, "turn", "2 turns"),
        (1204, "turn", "1,204 turns"),
        (1, "new conversation", "1 new conversation"),
        (3, "new conversation", "3 new conversations"),
        (2, "side-call", "2 side-calls"),
        (2, "entry", "2 entries"),
        (2, "miss", "2 misses"),
        (2, "day", "2 days"),
        (2, "box", "2 boxes"),
    ],
)
def test_n_of(count: int, noun: str, text: str) -> None:
    assert n_of(count, noun) == text


def test_a_phrase_says_its_own_plural() -> None:
    noun, many = "request to another model", "requests to other models"
    assert n_of(1, noun, many) == "1 request to another model"
    assert n_of(4, noun, many) == "4 requests to other models"
    assert plural("token", 1.0) == "token" and plural("token", 1.5) == "tokens"


def test_each_of_only_for_several() -> None:
    assert each_of(1, "new conversation") == "1 new conversation"
    assert each_of(3, "new conversation") == "each of 3 new conversations"
    assert each_of(0, "change") == "0 changes"
    assert times(1) == "once" and times(3) == "3 times"


def test_the_slip_finder_finds_slips_and_nothing_else() -> None:
    assert slips("and each of 1 new conversation read it") != []
    assert slips("it lost 1 turns of 3") != []
    assert slips("3 turn were lost") != []
    assert slips("ran 2 side-call") != []
    assert (
        slips(
            "1 turn, 3 turns, turn 3 of 1,204 turns, 2.5 tokens, each of 3 conversations, "
            "1 new conversation, #4 turn"
        )
        == []
    )
