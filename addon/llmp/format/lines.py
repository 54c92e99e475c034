"""The one reader of a recording line: a record, or None for a bad line.

Both the analyzer (`llmp.analysis.reader`) and the recorder's live view
(in the builder child) read lines with these functions, so a live verdict
and a report are made from the same record.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from llmp.format import canonical

__all__ = [
    "KEY_RE",
    "is_blank",
    "key_and_record",
    "line_key",
    "matched_key",
    "parse_line",
    "valid_key",
    "with_number_text",
]

KEY_RE = re.compile(rb'\{"v":(\d+),"id":(\d+),"conn":-?\d+,"t_start_ms":(-?\d+)[,}]')
"""How the recorder starts every line: `v`, `id` and `t_start_ms` without a parse.
Anything else takes the slow path (`key_and_record`)."""


def matched_key(m: re.Match[bytes]) -> tuple[int, int] | None:
    """The sort key a `KEY_RE` match gives, or None: a `v` other than 1 is a bad line."""
    v, rid_text, t_text = m.groups()
    return (int(t_text), int(rid_text)) if v == b"1" else None


def is_blank(line: bytes) -> bool:
    """A line of nothing but whitespace: no record, and no bad line either (skipped)."""
    return line[:1] != b"{" and not line.strip()


def line_key(line: bytes) -> tuple[int, int] | None:
    """The sort key `(t_start_ms, id)` of a line, or None for a bad line."""
    return key_and_record(line)[0]


def key_and_record(line: bytes) -> tuple[tuple[int, int] | None, dict[str, Any] | None]:
    """The sort key, and the parsed record when finding the key needed a parse.

    Lines written the recorder's way give their key to a regex; any other
    producer's lines are parsed once here, and the record is kept so that a
    line released at once is not parsed twice.
    """
    m = KEY_RE.match(line)
    if m is not None:
        return matched_key(m), None
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, None
    key = valid_key(rec)
    return key, rec if key is not None else None


def valid_key(rec: Any) -> tuple[int, int] | None:
    if not isinstance(rec, dict):
        return None
    v, rid, t = rec.get("v"), rec.get("id"), rec.get("t_start_ms")
    if type(v) is int and v == 1 and type(rid) is int and type(t) is int:
        return t, rid
    return None


def parse_line(line: bytes | memoryview) -> dict[str, Any] | None:
    """Parse one recording line; None when it is a bad line.

    Lines with a full request body are parsed a second time keeping number
    text (R2), so that digests computed from them hash like the recorder's.
    """
    try:
        rec: dict[str, Any] = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if valid_key(rec) is None:
        return None
    return with_number_text(rec, line)


def with_number_text(rec: dict[str, Any], line: bytes | memoryview) -> dict[str, Any]:
    """The record again with number text kept, when it carries a full body."""
    req = rec.get("request")
    if isinstance(req, dict) and req.get("body") is not None:
        try:
            exact = canonical.loads(line)
        except (ValueError, TypeError, RecursionError):  # NotJSON is a ValueError
            exact = None  # orjson accepted it; keep that rather than drop it
        if isinstance(exact, dict):
            rec = exact
    return rec
