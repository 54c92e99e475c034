"""Incremental NDJSON line splitter (Ollama's ``application/x-ndjson`` streams).

Lines are split on ``\\n`` only, at the byte level: ``\\n`` never occurs inside
a UTF-8 multi-byte character, so a split character needs no special care, and
decoding is left to the JSON parser, which rejects invalid UTF-8 itself.
"""

from __future__ import annotations

__all__ = ["NDJSONParser"]

_BOM = b"\xef\xbb\xbf"
# Blank means JSON whitespace only: a line holding e.g. a form feed is not
# blank, and is counted as a (bad) chunk rather than silently skipped.
_JSON_WS = b" \t\r\n"


class NDJSONParser:
    """Split a byte stream, fed in arbitrary pieces, into its non-blank lines.

    A line loses one trailing ``\\r`` (CRLF senders); whitespace-only lines are
    skipped; one UTF-8 BOM at the very start of the stream is dropped.
    """

    __slots__ = ("_closed", "_first", "_partial")

    def __init__(self) -> None:
        self._partial: list[bytes] = []  # the current line so far, without "\n"
        self._first = True  # the next line is the stream's first (BOM check)
        self._closed = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Parse one piece; return the non-blank lines it completes."""
        if self._closed or not data:
            return []
        if not isinstance(data, bytes):
            data = bytes(data)
        if b"\n" not in data:
            self._partial.append(data)
            return []
        lines = data.split(b"\n")
        if self._partial:
            self._partial.append(lines[0])
            lines[0] = b"".join(self._partial)
            self._partial = []
        rest = lines.pop()
        if rest:
            self._partial.append(rest)
        if self._first:
            self._first = False
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        out: list[bytes] = []
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if line.strip(_JSON_WS):
                out.append(line)
        return out

    def close(self) -> list[bytes]:
        """End the stream; return the unterminated last line if it is not blank."""
        if self._closed:
            return []
        self._closed = True
        line = b"".join(self._partial)
        self._partial = []
        if self._first and line.startswith(_BOM):
            line = line[3:]
        if line[-1:] == b"\r":
            line = line[:-1]
        return [line] if line.strip(_JSON_WS) else []
