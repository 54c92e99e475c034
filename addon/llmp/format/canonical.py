"""Canonical JSON and FNV-1a 64, byte-compatible with serde_json (R1-R3).

Parsing keeps the source text of every number that serde_json would keep
(floats, and integers outside 64 bits), so that a body re-read from a full
recording hashes exactly as it did on the wire (R2).  Serialising goes
through orjson with sorted keys; kept number text is emitted verbatim as an
``orjson.Fragment``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import orjson

try:  # C implementation: ~100x faster than the pure-Python loop below.
    from fnv_c import fnv1a_64 as _fnv1a_64_c
except Exception:  # pragma: no cover - exercised only where fnv-c is missing
    _fnv1a_64_c = None
try:  # the C function itself, without fnv_c's Python wrapper: a record hashes hundreds of texts
    from fnv_c.ext._fnv import lib as _fnv_lib

    _fnv1a_64_raw: Any = _fnv_lib.fnv1a_64
except Exception:  # pragma: no cover - fnv-c missing, or laid out differently
    _fnv1a_64_raw = None

__all__ = [
    "EMPTY_HASH",
    "NotJSON",
    "RawFloat",
    "RawInt",
    "dumps",
    "fnv1a64",
    "hash_bytes",
    "hash_text",
    "hash_value",
    "loads",
    "loads_stdlib",
    "record_dumps",
    "short_ints_only",
]

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF
MAX_DEPTH = 127  # serde_json's recursion limit: 128 nested containers fail.
_I64_MIN = -(1 << 63)
_U64_MAX = (1 << 64) - 1


class NotJSON(ValueError):
    """Text that serde_json would reject; it is recorded as ``body_text``."""


class RawFloat(float):
    """A JSON number with a fraction or exponent, remembering its source text."""

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> RawFloat:
        obj = float.__new__(cls, text)
        obj.text = text
        return obj

    def __repr__(self) -> str:
        return f"RawFloat({self.text!r})"


class RawInt(int):
    """An integer outside the 64-bit range, kept as its source text."""

    text: str

    def __new__(cls, text: str) -> RawInt:
        obj = int.__new__(cls, text)
        obj.text = text
        return obj

    def __repr__(self) -> str:
        return f"RawInt({self.text!r})"


def _parse_int(text: str) -> int | float:
    # serde_json writes 64-bit integers in plain decimal (so "-0" becomes "0")
    # and keeps the text of anything larger.
    if len(text) < 19:
        return int(text)
    if len(text) > 4000:  # past Python's int-from-text limit: keep the text only
        return RawFloat(text)
    value = int(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    return RawInt(text)


def _reject_constant(name: str) -> Any:
    raise NotJSON(f"{name} is not JSON")


def _check(value: Any, depth: int, surrogates: bool) -> None:
    """Reject what Python's json accepts but serde_json does not."""
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise NotJSON("recursion limit exceeded")
        for key, item in value.items():
            if surrogates and _has_surrogate(key):
                raise NotJSON("lone surrogate in string")
            if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                _check(item, depth + 1, surrogates)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise NotJSON("recursion limit exceeded")
        for item in value:
            if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                _check(item, depth + 1, surrogates)
    elif isinstance(value, str) and surrogates and _has_surrogate(value):
        raise NotJSON("lone surrogate in string")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_FAST: Any = None  # msgspec.json.Decoder, made at first use


def loads(
    data: bytes | bytearray | memoryview | str, *, short_ints: bool = False, depth: int = 0
) -> Any:
    """Parse JSON the way serde_json (arbitrary_precision) does, keeping number text.

    Raises ``NotJSON`` for anything serde_json rejects: invalid UTF-8, lone
    surrogate escapes, NaN/Infinity, trailing commas, nesting deeper than 127.

    msgspec parses: 5-8x faster than the stdlib with a Python hook for every
    number.  It rejects all of that itself but deep nesting, and gives a
    plain `int` for an integer outside 64 bits, so one walk over the
    containers (`_settle`) does both.  Whatever msgspec refuses goes to
    `loads_stdlib`, which decides: the two agree on everything else
    (`tests/format/test_canonical_fast.py`).

    `short_ints`: the caller knows the text has no run of 19 digits
    (`short_ints_only`), so no integer outside 64 bits; the walk, which costs more
    than msgspec's parse of a stream event, is then left out unless there
    are enough brackets to nest too deep.

    `depth`: the text is a value cut out of that many containers (a message
    of a request body: 2), so it may nest that much less; the result is
    what the whole text's parse holds at that place.
    """
    global _FAST
    if _FAST is None:
        _FAST = msgspec.json.Decoder(float_hook=RawFloat)
    try:
        value = _FAST.decode(data)
    except Exception:  # malformed, invalid UTF-8, a lone surrogate, a huge integer
        return loads_stdlib(data, depth=depth)
    if short_ints:
        if isinstance(data, memoryview):
            data = bytes(data)
        if isinstance(data, str):
            deep = data.count("[") + data.count("{") > MAX_DEPTH - depth
        else:
            deep = data.count(b"[") + data.count(b"{") > MAX_DEPTH - depth
        if not deep:
            return value
    try:
        t = type(value)
        if t is dict or t is list:
            _settle(value, depth)
        elif t is int and not _I64_MIN <= value <= _U64_MAX:
            return _parse_int(str(value))
    except NotJSON:
        raise
    except ValueError:  # an integer too long for `str`: the stdlib keeps its text
        return loads_stdlib(data, depth=depth)
    return value


def _settle(value: dict[str, Any] | list[Any], depth: int) -> None:
    """Reject nesting past `MAX_DEPTH`; turn integers outside 64 bits into `RawInt`.

    A JSON integer has one spelling (no sign but `-`, no leading zero), so its
    `str` is its source text, which `_parse_int` keeps as the stdlib path does.
    """
    if depth >= MAX_DEPTH:
        raise NotJSON("recursion limit exceeded")
    items = value.items() if type(value) is dict else enumerate(value)
    for key, item in items:
        t = type(item)
        if t is str:
            continue
        if t is dict or t is list:
            _settle(item, depth + 1)
        elif t is int and (item > _U64_MAX or item < _I64_MIN):
            value[key] = _parse_int(str(item))  # type: ignore[index]


_LONG_DIGITS = re.compile(r"[0-9]{19}")
_LONG_DIGITS_B = re.compile(rb"[0-9]{19}")
"""The shortest integer outside 64 bits, -9223372036854775809, has 19 digits."""


def short_ints_only(text: str | bytes) -> bool:
    """Whether `text` holds no run of 19 ASCII digits, so no integer outside 64 bits.

    Then `loads(text, short_ints=True)` may skip its walk: a stream's events
    are checked one by one (a C pass over a few hundred bytes), where the
    walk over every event cost more than msgspec's parse of it.
    """
    if isinstance(text, str):
        return _LONG_DIGITS.search(text) is None
    return _LONG_DIGITS_B.search(text) is None


def loads_stdlib(data: bytes | bytearray | memoryview | str, *, depth: int = 0) -> Any:
    """`loads` with the stdlib's parser only: the reference the fast path must match."""
    if isinstance(data, str):
        text = data
        if _has_surrogate(text):  # bytes can't carry one; a str can
            raise NotJSON("lone surrogate in text")
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NotJSON(f"invalid UTF-8: {exc}") from None
    try:
        value = json.loads(
            text,
            parse_float=RawFloat,
            parse_int=_parse_int,
            parse_constant=_reject_constant,
        )
    except NotJSON:
        raise
    except (ValueError, RecursionError) as exc:
        raise NotJSON(str(exc)) from None
    # Only walk the tree when it could matter: surrogate escapes are the only
    # way to smuggle a lone surrogate past a strict UTF-8 decode, and depth
    # can only exceed the limit with that many opening brackets.
    surrogates = "\\ud" in text or "\\uD" in text
    deep = text.count("[") + text.count("{") > MAX_DEPTH - depth
    if surrogates or deep:
        _check(value, depth, surrogates)
    return value


def _fragment(obj: Any) -> Any:
    if isinstance(obj, (RawFloat, RawInt)):
        return orjson.Fragment(obj.text)
    if isinstance(obj, float):  # a float built in code, not parsed: Python's repr
        return orjson.Fragment(repr(obj))
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, (list, tuple)):
        return list(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


_CANON_OPTS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS
_RECORD_OPTS = orjson.OPT_PASSTHROUGH_SUBCLASS


def dumps(value: Any) -> bytes:
    """Canonical JSON: compact, keys sorted by UTF-8 bytes, number text kept."""
    return orjson.dumps(value, default=_fragment, option=_CANON_OPTS)


def record_dumps(value: Any) -> bytes:
    """Compact JSON for a recording line, in insertion order, number text kept."""
    return orjson.dumps(value, default=_fragment, option=_RECORD_OPTS)


def _fnv1a64_py(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64 of ``data`` as an integer (R3)."""
    if _fnv1a_64_c is not None:
        return int(_fnv1a_64_c(data))
    return _fnv1a64_py(data)


def hash_bytes(data: bytes) -> str:
    """FNV-1a 64 as 16 lowercase hex digits."""
    if _fnv1a_64_raw is not None:
        return format(_fnv1a_64_raw(data, len(data)), "016x")
    return format(fnv1a64(data), "016x")


def hash_text(text: str) -> str:
    """Hash of a string's UTF-8 bytes (surrogates, if any, replaced)."""
    data = text.encode("utf-8", "surrogatepass")
    if _fnv1a_64_raw is not None:
        return format(_fnv1a_64_raw(data, len(data)), "016x")
    return format(fnv1a64(data), "016x")


def hash_value(value: Any) -> str:
    """Hash of a JSON value's canonical form."""
    return hash_bytes(dumps(value))


EMPTY_HASH = hash_bytes(b"")
