"""The content-defined chunks of a long message (format.chunks): where inside it a later
version changed, and where that change ends, held against the texts themselves."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.format.canonical import hash_text
from llmp.format.chunks import (
    FIRST_SIZE,
    HEX,
    LONG_CHARS,
    MOST,
    NEAR,
    Located,
    chunk_ends,
    chunks_of,
    levels,
    locate,
    size_of,
)
from llmp.format.fastread import FastChunks

ALPHABETS = (
    "abcdefghij \n",  # ASCII: a character is a byte
    "ab",  # repetitive: many shifted texts look alike
    "aé€😀\n",  # one to four bytes a character
    "x\ud800y",  # a lone surrogate, hashed as `hash_text` hashes it
)
WINDOW = 64
"""The characters a cut depends on (the gear hash's 64 bits)."""


def _text(seed: int, n: int, alphabet: str) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _pieces(text: str, ends: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *ends][:-1], ends, strict=True))


def _wide(text: str) -> list[dict[str, Any]] | None:
    """The same chunks with R3's whole 16 hex digits a chunk (another producer may keep
    them): two different chunks never look equal, so `locate`'s claims are exact."""
    found = chunks_of(text)
    if found is None:
        return None
    return [
        {
            "size": level["size"],
            "ends": level["ends"],
            "hashes": "".join(hash_text(text[s:e]) for s, e in _pieces(text, level["ends"])),
        }
        for level in found
    ]


@st.composite
def edits(draw: st.DrawFn) -> tuple[str, str, int, int, int]:
    """A text, the same text with one insertion, deletion or replacement at `at`, and the
    edit's place: `at`, how much it cut and how much it added."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    n = draw(st.one_of(st.integers(0, 1500), st.integers(3000, 9000)))
    old = _text(draw(st.integers(0, 2**32)), n, alphabet)
    at = draw(st.integers(0, n))
    cut = draw(st.integers(0, min(n - at, 600)))
    added = _text(draw(st.integers(0, 2**32)), draw(st.integers(0, 600)), alphabet)
    return old, old[:at] + added + old[at + cut :], at, cut, len(added)


def test_the_rule_on_its_edges() -> None:
    assert chunks_of("x" * LONG_CHARS) is None  # the head and tail cover it
    assert levels(LONG_CHARS) == () and levels(LONG_CHARS + 1) == (FIRST_SIZE,)
    assert size_of(MOST * FIRST_SIZE) == FIRST_SIZE
    assert size_of(MOST * FIRST_SIZE + 1) == 2 * FIRST_SIZE
    edge = int(NEAR * MOST * FIRST_SIZE)  # 3,584: from here on, the next size too
    assert levels(edge) == (FIRST_SIZE,)
    assert levels(edge + 1) == levels(MOST * FIRST_SIZE) == (FIRST_SIZE, 2 * FIRST_SIZE)
    assert levels(MOST * FIRST_SIZE + 1) == (2 * FIRST_SIZE,)
    for n in (LONG_CHARS + 1, 4096, 4097, 300_000, 1_000_003):
        text = _text(n, n, ALPHABETS[0])
        found = chunks_of(text)
        assert found is not None and [level["size"] for level in found] == list(levels(n))
        for level in found:
            size, ends = level["size"], level["ends"]
            assert ends[-1] == n and len(level["hashes"]) == HEX * len(ends)
            assert len(ends) <= 2 * n / size + 1 <= 2 * MOST + 1  # each at least size / 2
        assert len(found[0]["ends"]) <= 1.25 * MOST  # about MOST on such a text


@given(st.sampled_from(ALPHABETS), st.integers(0, 2**32), st.integers(LONG_CHARS + 1, 9000))
@settings(max_examples=60, deadline=None)
def test_each_hash_is_the_hash_of_its_chunk(alphabet: str, seed: int, n: int) -> None:
    """Any reader can check them: R3's hash of the chunk's text, its last HEX digits; each
    chunk at least half its size and at most four times it (the last one, a short rest
    joined to it, four and a half)."""
    text = _text(seed, n, alphabet)
    found = chunks_of(text)
    assert found is not None
    for level in found:
        size, ends, hashes = level["size"], level["ends"], level["hashes"]
        pieces = _pieces(text, ends)
        assert [hashes[k * HEX : (k + 1) * HEX] for k in range(len(ends))] == [
            hash_text(text[s:e])[-HEX:] for s, e in pieces
        ]
        assert all(size // 2 <= e - s <= 4 * size for s, e in pieces[:-1])
        assert size // 2 <= pieces[-1][1] - pieces[-1][0] < 4 * size + size // 2


@given(edits())
@settings(max_examples=300, deadline=None)
def test_an_edit_changes_only_the_chunks_around_it(
    pair: tuple[str, str, int, int, int],
) -> None:
    """Every chunk that ends before the first changed character is in both versions, and
    once both cut at the same place (64 characters past the edit, where the hash has
    forgotten it) every later chunk is too, shifted by what the edit added."""
    old, new, at, cut, added = pair
    d = _first_difference(new, old)
    shift = added - cut
    for size in {FIRST_SIZE, *levels(len(old)), *levels(len(new))}:
        a, b = chunk_ends(old, size), chunk_ends(new, size)
        pa = {(s, e, old[s:e]) for s, e in _pieces(old, a)}
        pb = {(s, e, new[s:e]) for s, e in _pieces(new, b)}
        # Before: the text's last chunk ends where the text does, not where it would
        # cut, and it takes in a rest shorter than half a size.
        near_end = min(len(old), len(new)) - size // 2
        assert {p for p in pa if p[1] <= d and p[1] <= near_end} <= pb
        assert {p for p in pb if p[1] <= d and p[1] <= near_end} <= pa
        # After: from a common cut past the edit on, the same chunks.
        common = [x for x in b if x >= at + added + WINDOW and x - shift in set(a)]
        if common:
            x = common[0]
            after_new = [(s - x, e - x, t) for s, e, t in pb if s >= x]
            after_old = [(s - x + shift, e - x + shift, t) for s, e, t in pa if s >= x - shift]
            assert sorted(after_new) == sorted(after_old)


@given(edits())
@settings(max_examples=400, deadline=None)
def test_an_edit_is_placed_within_one_chunk_and_its_span_covers_it(
    pair: tuple[str, str, int, int, int],
) -> None:
    """`locate` keeps only characters that are the same, the change begins within the
    chunk it names, and after the changed span the two versions are the same text."""
    old, new, _, _, _ = pair
    got = locate(len(new), _wide(new), len(old), _wide(old))
    if min(len(old), len(new)) <= LONG_CHARS or new == old:
        assert got is None
        return
    if not set(levels(len(new))) & set(levels(len(old))):
        assert got is None  # the fallback: no size in common
        return
    assert got is not None
    kept, slack, grown, shrunk = got.kept, got.slack, got.new, got.old
    d = _first_difference(new, old)
    size = min(set(levels(len(new))) & set(levels(len(old))))
    assert kept <= d <= kept + slack and slack < 4 * size + size // 2
    assert grown - shrunk == len(new) - len(old)
    # Each side's first and last chunks: half a size or more, the same one or two.
    for span, first, last in ((grown, got.first, got.last), (shrunk, got.old_first, got.old_last)):
        if not span:
            assert first == last == 0
        else:
            assert size // 2 <= min(first, last) and (first == last == span or first + last <= span)
    assert new[:kept] == old[:kept]
    assert new[kept + grown :] == old[kept + shrunk :]
    # The short hashes say the same, unless a changed chunk's 16 bits happen to match.
    short = locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert short == got or _collides(new, old, size)


def _collides(new: str, old: str, size: int) -> bool:
    """Some chunk of `new` and a different one of `old` have the same HEX digits."""
    a = {hash_text(new[s:e])[-HEX:]: new[s:e] for s, e in _pieces(new, chunk_ends(new, size))}
    b = {hash_text(old[s:e])[-HEX:]: old[s:e] for s, e in _pieces(old, chunk_ends(old, size))}
    return any(a[h] != b[h] for h in a.keys() & b.keys())


def pasted_file(lines: int = 160) -> list[str]:
    return [f"    value_{i} = compute({i}, scale={i % 7})  # step {i}" for i in range(lines)]


def test_an_insertion_in_the_middle_of_a_pasted_file() -> None:
    """The issue's case: a file pasted into a message, a line inserted in its middle.
    The change is placed within a chunk, and only a chunk or two around it differ."""
    lines = pasted_file()
    old = "Here is the file:\n" + "\n".join(lines)
    line = "    print('checkpoint')"
    new = "Here is the file:\n" + "\n".join([*lines[:80], line, *lines[80:]])
    d = _first_difference(new, old)
    got = locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert got is not None
    size = size_of(len(new))
    assert got.kept <= d <= got.kept + got.slack and d > 3000  # far past the head hash
    assert got.new - got.old == len(new) - len(old) == len(line) + 1
    assert got.new <= len(line) + 1 + 3 * size  # the chunk it fell in, and maybe the next


def test_a_replacement_of_the_same_length_is_a_span_not_a_growth() -> None:
    """A word rewritten with as many characters: the message grew by nothing, yet the
    chunks name the span that changed, a chunk or two around the word.  Twenty lines
    rewritten: the span less half its first and half its last chunk is nearer the block
    than the whole span."""
    lines = pasted_file()
    old = "Here is the file:\n" + "\n".join(lines)
    one = list(lines)
    one[90] = one[90].replace("compute", "recount")
    new = "Here is the file:\n" + "\n".join(one)
    assert len(new) == len(old)
    got = locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert got is not None and got.new == got.old
    d = _first_difference(new, old)
    assert got.kept <= d < d + len("recount") <= got.kept + got.new
    size = size_of(len(new))
    assert got.new <= 4 * size  # not the rest of the file
    block = [line.replace("compute", "recount").replace("value", "total") for line in lines]
    new = "Here is the file:\n" + "\n".join([*lines[:60], *block[60:80], *lines[80:]])
    rewritten = sum(len(line) + 1 for line in lines[60:80])
    got = locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert got is not None and got.new == got.old
    middle = got.new - (got.first + got.last) / 2  # what the charge counts as new
    assert abs(middle - rewritten) <= 2 * size and abs(middle - rewritten) < got.new - rewritten


def test_across_a_power_of_two_the_next_size_compares() -> None:
    """A message just under 4,096 characters also keeps the chunks of 128, which a
    version grown past 4,096 chooses: they compare there.  A version grown by more than
    an eighth shares no size, and the head and tail rule decides."""
    old = "Here is the file:\n" + "\n".join(pasted_file(80))
    assert NEAR * MOST * FIRST_SIZE < len(old) <= MOST * FIRST_SIZE
    lines = old.split("\n")
    new = "\n".join([*lines[:40], *pasted_file(8), *lines[40:]])
    assert len(new) > MOST * FIRST_SIZE
    got = locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert got is not None
    d = _first_difference(new, old)
    assert got.kept <= d <= got.kept + got.slack <= got.kept + 4 * 2 * FIRST_SIZE
    assert got.new - got.old == len(new) - len(old)
    # And the other way: the longer version shrank back.
    back = locate(len(old), chunks_of(old), len(new), chunks_of(new))
    assert back is not None and back.kept == got.kept
    short = "\n".join(lines[:50])  # 2,900 characters: one size, 64
    assert levels(len(short)) == (FIRST_SIZE,)
    assert locate(len(new), chunks_of(new), len(short), chunks_of(short)) is None


def test_anything_else_is_no_chunks() -> None:
    """Absent (an older recording), short, or not of the rule's shape: the old rule stands."""
    text = _text(5, 2000, ALPHABETS[0])
    good = chunks_of(text)
    assert good is not None
    level = good[0]
    other = [{**level, "hashes": "f" * len(level["hashes"])}]
    ends = level["ends"]
    whole = Located(0, ends[0], 2000, 2000, ends[0], 2000 - ends[-2], ends[0], 2000 - ends[-2])
    assert locate(2000, other, 2000, good) == whole
    assert locate(2000, good, 2000, good) is None  # no chunk differs: not in the text
    assert locate(2000, None, 2000, good) is None
    assert locate(2000, [{**level, "hashes": level["hashes"][:-1]}], 2000, other) is None
    assert locate(2000, [{**level, "ends": level["ends"][:-1]}], 2000, other) is None
    assert locate(3000, good, 2000, other) is None  # its ends do not reach 3,000
    assert locate(2000, [{**level, "ends": [5, *level["ends"]]}], 2000, other) is None
    assert locate(2000, [{**level, "size": "64"}], 2000, other) is None
    assert locate(True, good, 2000, other) is None
    assert locate(2000, "chunks", 2000, other) is None


def test_a_producer_may_keep_more_digits_a_chunk() -> None:
    """The digits a chunk are the string's length over the chunks: R3's whole 16 hex
    digits compare with llmp's 4 by the digits both kept."""
    old = _text(3, 5000, ALPHABETS[0])
    new = old[:2600] + "!" + old[2601:]
    got = locate(len(new), chunks_of(new), len(old), _wide(old))
    assert got is not None and got == locate(len(new), chunks_of(new), len(old), chunks_of(old))
    assert got.kept <= 2600 <= got.kept + got.slack
    too_wide = [{**lv, "hashes": "0" * len(lv["ends"]) + lv["hashes"]} for lv in _wide(old) or []]
    assert locate(len(new), chunks_of(new), len(old), too_wide) is None  # 17 a chunk


def test_the_fast_readers_structs_read_alike() -> None:
    """The fast path decodes each size into a `FastChunks`; `locate` reads it as the
    plain path's object."""
    old = _text(9, 3000, ALPHABETS[0])
    new = old[:1500] + "inserted" + old[1500:]
    plain = chunks_of(new)
    assert plain is not None
    fast = tuple(FastChunks(lv["size"], tuple(lv["ends"]), lv["hashes"]) for lv in plain)
    assert locate(len(new), fast, len(old), chunks_of(old)) == locate(
        len(new), plain, len(old), chunks_of(old)
    )


def test_a_text_seen_before_is_looked_up() -> None:
    """The analyzer digests every message of a full recording on every turn: the second
    time, the same (shared) value, not a second pass."""
    text = _text(11, 5000, ALPHABETS[2])
    first = chunks_of(text)
    assert first is not None and chunks_of(text) is first
    assert chunks_of(text[:-1] + "!") != first  # its last byte: the low bits see it
