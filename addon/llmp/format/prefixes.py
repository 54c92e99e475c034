"""Where inside a long message it changed, without its text: the prefix hashes.

A message digest's head and tail hashes (R5) say whether a change lies in the
first or the last 256 characters, not where in between.  For a long message the
digest also keeps `prefixes`: the hashes of its text's first s, 2s, 3s ...
characters.  Two versions of a message agree on every prefix before the first
character that differs and on none after it, so the first prefix that differs
places the change within s characters; that is R31's P inside the message.

Why prefixes at fixed places rather than content-defined chunks: only where the
change *begins* is asked (the server re-reads everything after it anyway), and
every prefix before that point is the same text in both versions, wherever an
insertion moved the rest.  Fixed places let the step grow with the message, so
a message keeps at most `MOST - 1` hashes whatever its size, and two versions of
different steps still share every place of the larger step.

The rule, which any reader can apply from `chars` alone:

* a text of more than `LONG_CHARS` characters (Unicode scalar values) has them,
  a shorter one has none (`null`);
* the step s is `FIRST_STEP` doubled until the text is at most `MOST` steps long;
* for each p = s, 2s, ... below the text's length, the first `HEX` hex digits of
  R3's FNV-1a 64 of the UTF-8 of its first p characters, all in one string (a reader
  takes the digits a place from the string's length: another producer may keep more).
"""

from __future__ import annotations

from llmp.format.canonical import fnv1a64_prefix

__all__ = ["FIRST_STEP", "HEX", "LONG_CHARS", "MOST", "prefix_hashes", "step_of", "unchanged"]

LONG_CHARS = 512
"""A message longer than this (in characters) gets prefix hashes: the head and tail
windows (256 each) cover a shorter one."""
FIRST_STEP = 64
"""The finest step, in characters: P within 64 characters (some 15 to 20 tokens)."""
MOST = 64
"""A message is at most this many steps long: at most 63 hashes, whatever its size."""
HEX = 4
"""Hex digits kept of each hash (its high 16 bits).  Only the first place that differs is
looked for, so an equal-looking differing prefix (once in 65,536) moves P by one step;
the record pays 4 hex digits a place instead of R3's 16."""
_SHIFT = 64 - 4 * HEX
_FORMAT = f"0{HEX}x"


def step_of(chars: int) -> int:
    """The step between the prefixes of a text of `chars` characters."""
    step = FIRST_STEP
    while chars > MOST * step:
        step *= 2
    return step


def prefix_hashes(text: str) -> str | None:
    """The `prefixes` of a message's text (R5's text); None for a short one.

    Linear in the text: one pass to encode, and one FNV over each prefix (at most 63,
    each read in place).  A text seen before is looked up instead: the analyzer takes
    the digest of every message of a full recording again on every turn that resends
    it, and hashing the prefixes again made that 7 times slower.  The lookup hashes the
    text with Python's own string hash, several times faster than one FNV pass.
    """
    chars = len(text)
    if chars <= LONG_CHARS:
        return None
    key = (hash(text), chars)
    seen = _SEEN
    hashes = seen.pop(key, None)
    if hashes is None:
        hashes = _prefix_hashes(text)
        if len(seen) >= SEEN:
            del seen[next(iter(seen))]  # the least recently used
    seen[key] = hashes
    return hashes


SEEN = 4096
"""Texts whose prefix hashes are remembered (some 600 bytes each), per process."""
_SEEN: dict[tuple[int, int], str] = {}


def _prefix_hashes(text: str) -> str:
    chars = len(text)
    step = step_of(chars)
    data = text.encode("utf-8", "surrogatepass")
    ends: list[int] | range
    if len(data) == chars:  # ASCII: a character is a byte
        ends = range(step, chars, step)
    else:
        ends = []
        at = 0
        for p in range(0, chars - step, step):
            at += len(text[p : p + step].encode("utf-8", "surrogatepass"))
            ends.append(at)
    return "".join([format(fnv1a64_prefix(data, end) >> _SHIFT, _FORMAT) for end in ends])


def _valid(chars: object, prefixes: object) -> tuple[int, int, str] | None:
    """The step, the hex digits a place and the hashes of a digest's values, or None when
    they do not fit the rule (absent, a short message, another producer's shape).

    The digits a place are the string's length over the places `chars` gives: a
    producer may keep more of each hash than `HEX`, and two widths still compare (by
    the digits both kept, the high bits of the same hash).
    """
    if type(chars) is not int or type(prefixes) is not str or chars <= LONG_CHARS:
        return None
    step = step_of(chars)
    width, extra = divmod(len(prefixes), (chars - 1) // step)
    if extra or not 1 <= width <= 16:
        return None
    return step, width, prefixes


def unchanged(
    chars: object, prefixes: object, old_chars: object, old_prefixes: object
) -> tuple[int, int] | None:
    """What two versions of a message's prefixes tell about where they first differ.

    `(kept, step)`: the text's first `kept` characters are the same in both; when `step`
    is not 0, the prefix one step further differs, so the change begins within
    `[kept, kept + step)`.  A `step` of 0: every shared place agreed, and the change
    begins at or after `kept`.  None when either version has no usable prefixes.
    """
    new = _valid(chars, prefixes)
    old = _valid(old_chars, old_prefixes)
    if new is None or old is None:
        return None
    (step, width, hashes), (old_step, old_width, old_hashes) = new, old
    digits = min(width, old_width)
    common = max(step, old_step)  # both steps are powers of two times FIRST_STEP
    every, old_every = common // step, common // old_step
    shared = min(len(hashes) // width // every, len(old_hashes) // old_width // old_every)
    for k in range(shared):
        a = ((k + 1) * every - 1) * width
        b = ((k + 1) * old_every - 1) * old_width
        if hashes[a : a + digits] != old_hashes[b : b + digits]:
            return k * common, common
    return shared * common, 0
