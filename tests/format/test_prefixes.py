"""The prefix hashes of a long message (format.prefixes): where inside it a later version
changed, held against the texts themselves."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.format.canonical import hash_text
from llmp.format.prefixes import (
    FIRST_STEP,
    HEX,
    LONG_CHARS,
    MOST,
    prefix_hashes,
    step_of,
    unchanged,
)

ALPHABETS = (
    "abcdefghij \n",  # ASCII: a character is a byte
    "ab",  # repetitive: many shifted texts look alike
    "aé€😀\n",  # one to four bytes a character
    "x\ud800y",  # a lone surrogate, hashed as `hash_text` hashes it
)


def _text(seed: int, n: int, alphabet: str) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@st.composite
def edits(draw: st.DrawFn) -> tuple[str, str]:
    """A text and the same text with one insertion, deletion or replacement."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    n = draw(st.one_of(st.integers(0, 1200), st.integers(3000, 9000)))
    old = _text(draw(st.integers(0, 2**32)), n, alphabet)
    at = draw(st.integers(0, n))
    cut = draw(st.integers(0, min(n - at, 600)))
    added = _text(draw(st.integers(0, 2**32)), draw(st.integers(0, 600)), alphabet)
    return old, old[:at] + added + old[at + cut :]


def test_the_rule_on_its_edges() -> None:
    assert prefix_hashes("x" * LONG_CHARS) is None  # the head and tail cover it
    assert len(prefix_hashes("x" * (LONG_CHARS + 1)) or "") == HEX * 8  # 64, 128 … 512
    assert step_of(MOST * FIRST_STEP) == FIRST_STEP
    assert step_of(MOST * FIRST_STEP + 1) == 2 * FIRST_STEP
    for n in (LONG_CHARS + 1, 4096, 4097, 300_000, 1_000_003):
        hashes = prefix_hashes("y" * n)
        assert hashes is not None
        assert len(hashes) == HEX * ((n - 1) // step_of(n)) <= HEX * (MOST - 1)


@given(st.sampled_from(ALPHABETS), st.integers(0, 2**32), st.integers(LONG_CHARS + 1, 9000))
@settings(max_examples=60, deadline=None)
def test_each_hash_is_the_hash_of_the_texts_first_characters(
    alphabet: str, seed: int, n: int
) -> None:
    """Any reader can check them: R3's hash of the first p characters, cut to HEX digits."""
    text = _text(seed, n, alphabet)
    hashes = prefix_hashes(text)
    assert hashes is not None
    step = step_of(n)
    places = range(step, n, step)
    assert [hashes[k * HEX : (k + 1) * HEX] for k in range(len(places))] == [
        hash_text(text[:p])[:HEX] for p in places
    ]


@given(edits())
@settings(max_examples=400, deadline=None)
def test_an_edit_is_placed_within_one_step(pair: tuple[str, str]) -> None:
    """The kept part never reaches past the first changed character, and falls short of
    it by less than a step (of the coarser of the two versions) when a prefix differs;
    when none does, no shared place is left after it."""
    old, new = pair
    got = unchanged(len(new), prefix_hashes(new), len(old), prefix_hashes(old))
    if min(len(old), len(new)) <= LONG_CHARS:
        assert got is None
        return
    assert got is not None
    kept, found = got
    d = _first_difference(new, old)
    step = max(step_of(len(new)), step_of(len(old)))
    assert found in (0, step)
    if kept > d:  # only when the cut hashes of the first place past the change agree
        p = (d // step + 1) * step
        assert hash_text(new[:p])[:HEX] == hash_text(old[:p])[:HEX], (kept, d)
    if found:
        assert d < kept + step
    else:
        assert kept + step >= min(len(old), len(new))
    if new == old:
        assert got == (kept, 0)


def test_an_insertion_in_the_middle_of_a_pasted_file() -> None:
    """The issue's case: a file pasted into a message, a line inserted in its middle."""
    lines = [f"    value_{i} = compute({i}, scale={i % 7})  # step {i}" for i in range(160)]
    old = "Here is the file:\n" + "\n".join(lines)
    new = "Here is the file:\n" + "\n".join([*lines[:80], "    print('checkpoint')", *lines[80:]])
    d = _first_difference(new, old)
    kept, step = unchanged(len(new), prefix_hashes(new), len(old), prefix_hashes(old)) or (0, 0)
    assert step == step_of(len(new)) and kept <= d < kept + step
    assert d > 3000  # far past the 256 characters the head hash covers


def test_anything_else_is_no_prefixes() -> None:
    """Absent (an older recording), short, or not of the rule's size: the old rule stands."""
    text = "z" * 2000
    good = prefix_hashes(text)
    assert good is not None
    assert unchanged(2000, good, 2000, good) == ((1999 // 64) * 64, 0)
    assert unchanged(2000, None, 2000, good) is None
    assert unchanged(2000, good[:-1], 2000, good) is None
    assert unchanged(2000, good, 3000, good) is None  # 3000 characters have 46 places
    assert unchanged(400, "", 400, "") is None
    assert unchanged(True, good, 2000, good) is None


def test_a_producer_may_keep_more_digits_a_place() -> None:
    """The digits a place are the string's length over the places: R3's whole 16 hex
    digits compare with llmp's 4 by the digits both kept."""
    old = _text(3, 5000, ALPHABETS[0])
    new = old[:2600] + "!" + old[2601:]
    step = step_of(len(old))
    whole = "".join(hash_text(old[:p]) for p in range(step, len(old), step))
    assert unchanged(len(new), prefix_hashes(new), len(old), whole) == (2560, 128)
    assert unchanged(len(old), whole, len(old), prefix_hashes(old)) == (4992, 0)
    assert unchanged(len(old), whole + "0" * 39, len(old), whole) is None  # 17 a place


def test_the_bytes_hashed_stay_linear_in_the_text() -> None:
    """Each place hashes its prefix again: at most MOST / 2 times the text, whatever its
    size (the time is measured in docs/recording.md, not here)."""
    for n in (LONG_CHARS + 1, 600, 4096, 4097, 300_000):
        step = step_of(n)
        assert sum(range(step, n, step)) <= MOST / 2 * n
