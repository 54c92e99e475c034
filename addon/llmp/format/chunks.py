"""Where inside a long message it changed, without its text: content-defined chunks.

A message digest's head and tail hashes (R5) say whether a change lies in the
first or the last 256 characters, not where in between.  For a long message the
digest also keeps `chunks`: its text cut into pieces at places the text itself
chooses, each kept as where it ends and a short hash of it.  Two versions of a
message share every chunk before the first changed character, and, once the cut
places agree again after the change, every chunk after it: an insertion or a
deletion moves only the cuts around it, because a cut depends on the few dozen
characters before it, not on its distance from the start.  So the first chunk that
differs places where the change begins (R31's P inside the message) within one
chunk, and the chunks that match again from the end say where it stops: the
changed span, where an edited message's new content lies (a block rewritten in
the middle of a pasted file, not only what the message grew by).

Fixed places (a hash of the first s, 2s, 3s ... characters) would place the
start as well, but every place after an insertion differs, so they say nothing
about where the change ends.

The rule, which any reader can apply to a text:

* a text of more than `LONG_CHARS` characters (Unicode scalar values) has chunks,
  a shorter one none (`null`): its head and tail hashes cover it;
* the size T is `FIRST_SIZE` doubled until the text is at most `MOST` T long;
  the chunks are about T long, so a text has some 64 of them at most (and never
  more than 2 a T, 128 in all, however the cuts fall: a chunk is at least T / 2
  long); a text longer than `NEAR` of `MOST` T also keeps the chunks of size
  2 T, the size a slightly longer version of it chooses (`levels`);
* chunks of size T: the gear hash h of the text's code points (`GEAR`, one step
  per character over the whole text: h = 2 h + GEAR[code point mod 256], mod
  2**64) decides; a chunk ends after a character when it is at least T / 2
  characters long and h's top log2(T / 2) bits are 0 (one place in T / 2), or
  when it is 4 T long; the last one at the text's end, joined to the one
  before it when it would be shorter than T / 2 (a hash of a few characters
  would tell them: every chunk is at least 32 long).  The top bits, not the
  low ones: bit k of h depends on the last k + 1 characters only, so low bits
  would let a handful of characters decide the cuts of a repetitive text
  (source code), while the top ones mix the last 64.  A chunk at least T / 2
  long keeps them near T (the length of the chunk a change falls in, which is
  what P's and the span's error are, averaged 1.3 T on the harness captures;
  1.9 T with T / 4 and one place in T);
* each chunk is kept as its end (in characters from the text's start) and the
  last `HEX` hex digits of R3's FNV-1a 64 of its UTF-8 (a reader takes the
  digits a chunk from the string's length: another producer may keep more).
  The last digits, not the first: FNV-1a's low 16 bits are a hash of every
  byte on their own (xor, then a multiplication by an odd number, both
  one-to-one on them), so two chunks that differ in a single byte never share
  them, while a change in a chunk's last byte hardly reaches its top bits;
  `{"size": T, "ends": [e1, e2, ...], "hashes": "h1h2..."}`, one object a size,
  the finest first.

Two versions compare at a size both kept (`locate`); a version that kept none in
common with the other (its length moved by more than an eighth across a power of
two, or one of them is short or from an older recording) leaves the head and tail
rule to decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from llmp.format.canonical import fnv1a64
from llmp.format.schema import ChunkLevel

__all__ = [
    "FIRST_SIZE",
    "GEAR",
    "HEX",
    "LONG_CHARS",
    "MOST",
    "NEAR",
    "Located",
    "chunk_ends",
    "chunks_of",
    "levels",
    "locate",
    "size_of",
]

LONG_CHARS = 512
"""A message longer than this (in characters) gets chunks: the head and tail windows
(256 each) cover a shorter one."""
FIRST_SIZE = 64
"""The finest size: P within some 64 characters (15 to 20 tokens) in a message of 4,096."""
MOST = 64
"""A text is at most this many sizes long: some 64 chunks at most, whatever its length."""
NEAR = 7 / 8
"""A text longer than this share of `MOST` sizes also keeps the next size's chunks, so a
version that grew past the power of two (by up to an eighth) still compares with it."""
HEX = 4
"""Hex digits kept of each chunk's hash (its low 16 bits).  A changed chunk that happens
to look equal (once in 65,536, and never one changed in a single byte) moves P by a
chunk; the record pays 4 hex digits a chunk instead of R3's 16."""
_MASK = (1 << 64) - 1
_LOW = (1 << 4 * HEX) - 1
_FORMAT = f"0{HEX}x"
_WINDOW = 64
"""The characters a gear hash of 64 bits depends on."""


def _splitmix64(i: int) -> int:
    """The i-th output (from 1) of SplitMix64 seeded with 0: well mixed, and any reader
    can compute it."""
    z = (i * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


GEAR = tuple(_splitmix64(i + 1) for i in range(256))
"""The gear table: one random 64-bit value a code point's low byte."""


def size_of(chars: int) -> int:
    """The chunk size T of a text of `chars` characters."""
    size = FIRST_SIZE
    while chars > MOST * size:
        size *= 2
    return size


def levels(chars: int) -> tuple[int, ...]:
    """The sizes a text of `chars` characters keeps chunks at, the finest first (none
    for a short text)."""
    if chars <= LONG_CHARS:
        return ()
    size = size_of(chars)
    return (size, 2 * size) if chars > NEAR * MOST * size else (size,)


def chunk_ends(text: str, size: int) -> list[int]:
    """Where the chunks of size `size` of a text end, in characters (the rule above).

    Linear in the text, one gear step a character, except the first T / 2 - 64 of each
    chunk, which cannot end it and which the hash forgets (it depends on the last 64
    characters only, so it is started 64 characters before the first place that may
    end a chunk: the same value as one rolled from the text's start).
    """
    low = text.encode("ascii") if text.isascii() else _low_bytes(text)
    n = len(low)
    shortest, longest = size // 2, 4 * size
    below = 1 << (64 - (size.bit_length() - 2))  # h < below: its top log2(size / 2) bits are 0
    gear, mask = GEAR, _MASK
    ends: list[int] = []
    start = 0
    while start < n:
        first = start + shortest  # the shortest chunk's end
        last = min(start + longest, n)  # the longest one's, or the text's end
        end = last
        if first < last:
            h = 0
            for c in low[max(0, first - _WINDOW) : first - 1]:
                h = ((h << 1) + gear[c]) & mask
            at = first
            for c in low[first - 1 : last]:  # the character before `at`
                h = ((h << 1) + gear[c]) & mask
                if h < below:
                    end = at
                    break
                at += 1
        ends.append(end)
        start = end
    if len(ends) > 1 and ends[-1] - ends[-2] < shortest:
        del ends[-2]  # a short rest joins the chunk before it
    return ends


def _low_bytes(text: str) -> bytes:
    """Each character's code point mod 256 (a lone surrogate counts as its code point)."""
    return text.encode("utf-32-le", "surrogatepass")[0::4]


def _hashes(text: str, ends: list[int]) -> str:
    data = text.encode("utf-8", "surrogatepass")
    ascii_ = len(data) == len(text)
    out = []
    start = 0
    for end in ends:
        piece = data[start:end] if ascii_ else text[start:end].encode("utf-8", "surrogatepass")
        out.append(format(fnv1a64(piece) & _LOW, _FORMAT))
        start = end
    return "".join(out)


def chunks_of(text: str) -> list[ChunkLevel] | None:
    """The `chunks` of a message's text (R5's text); None for a short one.

    A text seen before is looked up instead: the analyzer takes the digest of every
    message of a full recording again on every turn that resends it, and cutting it
    again made that several times slower.  The lookup hashes the text with Python's
    own string hash, far faster than a gear pass.  The value is shared, as the digest
    cache shares whole digests: whoever gets it must not change it.
    """
    chars = len(text)
    if chars <= LONG_CHARS:
        return None
    key = (hash(text), chars)
    seen = _SEEN
    found = seen.pop(key, None)
    if found is None:
        found = [_level(text, size) for size in levels(chars)]
        if len(seen) >= SEEN:
            del seen[next(iter(seen))]  # the least recently used
    seen[key] = found
    return found


def _level(text: str, size: int) -> ChunkLevel:
    ends = chunk_ends(text, size)
    return {"size": size, "ends": ends, "hashes": _hashes(text, ends)}


SEEN = 4096
"""Texts whose chunks are remembered (some 2 KB each at most), per process."""
_SEEN: dict[tuple[int, int], list[ChunkLevel]] = {}


class Located(NamedTuple):
    """Where two versions of a message differ, as their chunks show it (characters).

    The first `kept` characters are the same in both, and the change begins within
    `[kept, kept + slack]`.  After it, the versions are the same again from `kept +
    new` (now) and `kept + old` (before): `new` characters of the message are the
    changed span now, where `old` were before.  `new - old` is what it grew by.  The
    span's first and last chunks now are `first` and `last` characters long, and
    before `old_first` and `old_last` (the same chunk when the span is one; 0 when it
    is empty): the edit begins somewhere in the first and ends somewhere in the last.
    """

    kept: int
    slack: int
    new: int
    old: int
    first: int = 0
    last: int = 0
    old_first: int = 0
    old_last: int = 0


Level = tuple[tuple[int, ...], str, int]
"""A size's chunk ends, their hashes, and the hex digits a hash."""


def locate(chars: object, chunks: object, old_chars: object, old_chunks: object) -> Located | None:
    """Where a message (`chars`, `chunks`) differs from its earlier version.

    They compare at the finest size both kept.  The chunks before the first that
    differs (in its end or its hash) are the same text, so the change begins in that
    chunk, which ends at the same place or later in both: within the shorter of the
    two (the longer, when one is its text's last chunk, which may have taken in the
    short rest the other cut off).  Walking back from the end, the chunks of equal
    length and hash are the same text after the change.  None when either version
    has no usable chunks, they kept no size in common, or no chunk differs (the text
    is the same: what changed is not in it, and the head and tail rule decides).
    """
    new = _levels(chars, chunks)
    old = _levels(old_chars, old_chunks)
    if not new or not old:
        return None
    size = min((s for s in new if s in old), default=None)
    if size is None:
        return None
    assert isinstance(chars, int) and isinstance(old_chars, int)  # _levels checked them
    (ends, hashes, width), (old_ends, old_hashes, old_width) = new[size], old[size]
    digits = min(width, old_width)

    def same(a: int, b: int) -> bool:
        x, y = (a + 1) * width, (b + 1) * old_width  # the last digits: the low bits
        return hashes[x - digits : x] == old_hashes[y - digits : y]

    n, m = len(ends), len(old_ends)
    k = 0
    while k < n and k < m and ends[k] == old_ends[k] and same(k, k):
        k += 1
    if k == n and k == m:
        return None
    kept = ends[k - 1] if k else 0
    if k == n or k == m:  # one is the other's start: the change begins where it ends
        slack = 0
    elif k == n - 1 or k == m - 1:  # a last chunk may have taken in a short rest
        slack = max(ends[k], old_ends[k]) - kept
    else:
        slack = min(ends[k], old_ends[k]) - kept
    s = 0  # chunks equal from the end, none of them among the first k
    while s < min(n, m) - k:
        a, b = n - 1 - s, m - 1 - s
        if ends[a] - _start(ends, a) != old_ends[b] - _start(old_ends, b) or not same(a, b):
            break
        s += 1
    span = _start(ends, n - s) - kept, _start(old_ends, m - s) - kept
    return Located(kept, slack, *span, *_ends_of(ends, k, n - s), *_ends_of(old_ends, k, m - s))


def _ends_of(ends: Sequence[int], k: int, stop: int) -> tuple[int, int]:
    """The lengths of the first and the last of chunks [k, stop) (0, 0 for none)."""
    if stop <= k:
        return 0, 0
    return ends[k] - _start(ends, k), ends[stop - 1] - _start(ends, stop - 1)


def _start(ends: Sequence[int], i: int) -> int:
    return ends[i - 1] if i else 0


def _levels(chars: object, chunks: object) -> dict[int, Level] | None:
    """A digest's `chunks` by size, or None when they do not fit the rule's shape
    (absent, null, another producer's shape, ends that do not reach `chars`).

    Each size is an object (`dict` from the plain reader, a struct with the same
    attributes from the fast one).  The hex digits a chunk are the string's length over
    the chunks: a producer may keep more of each hash than `HEX`, and two widths still
    compare (by the digits both kept, the low bits of the same hash).
    """
    if type(chars) is not int or chars <= 0 or not isinstance(chunks, (list, tuple)):
        return None
    out: dict[int, Level] = {}
    for level in chunks:
        if isinstance(level, dict):
            size, ends, hashes = level.get("size"), level.get("ends"), level.get("hashes")
        else:
            size = getattr(level, "size", None)
            ends, hashes = getattr(level, "ends", None), getattr(level, "hashes", None)
        if type(size) is not int or type(hashes) is not str or not isinstance(ends, (list, tuple)):
            return None
        if not ends or ends[-1] != chars:
            return None
        at = 0
        for e in ends:
            if type(e) is not int or e <= at:
                return None
            at = e
        width, extra = divmod(len(hashes), len(ends))
        if extra or not 1 <= width <= 16:
            return None
        out[size] = (tuple(ends), hashes, width)
    return out or None
