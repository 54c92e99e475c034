"""Incremental WHATWG event-stream (SSE) parser.

Network pieces can split an event, a line, a CRLF pair or even a UTF-8
character at any byte, so the parser keeps just enough state to give the same
events for every split of the same bytes.  It only extracts the ``data`` of
each event: llmp needs nothing else (``event``, ``id``, ``retry`` and unknown
fields are parsed and ignored).

Work is done per piece and per line with ``str`` methods, never per byte, so a
32 MiB stream costs one decode, one split and one small step per line.
"""

from __future__ import annotations

import codecs

__all__ = ["SSEParser"]

_BOM = "\ufeff"


class SSEParser:
    """Turn an event stream, fed in arbitrary pieces, into event data strings.

    ``feed`` returns the data of every event a piece completes (the ``data``
    field values joined with ``"\\n"``); events whose data is empty are not
    dispatched, as WHATWG does for an empty data buffer and as R8 counts them.
    """

    __slots__ = ("_closed", "_data", "_decoder", "_partial", "_skip_lf", "_started", "pending")

    def __init__(self) -> None:
        # "replace": invalid UTF-8 must never stop a capture (WHATWG decodes the
        # same way).  The incremental decoder holds back a split character.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False  # has the first character been seen (BOM check)?
        self._skip_lf = False  # the last piece ended with CR: an LF next belongs to it
        self._partial: list[str] = []  # the current line so far, without terminator
        self._data: list[str] = []  # data values of the event being built
        self._closed = False
        #: After ``close()``: the data of the unterminated event (``""`` if none).
        self.pending = ""

    def feed(self, data: bytes | bytearray | memoryview) -> list[str]:
        """Parse one piece; return the data of the events it completes."""
        if self._closed or not data:
            return []
        return self._feed_text(self._decoder.decode(data))

    def _feed_text(self, text: str) -> list[str]:
        if not text:
            return []
        if not self._started:
            self._started = True
            if text[0] == _BOM:
                text = text[1:]
        if self._skip_lf:
            # A CR ended the previous piece and was already taken as a line end;
            # an LF right after it is the second half of the same CRLF.
            self._skip_lf = False
            if text[:1] == "\n":
                text = text[1:]
        if "\r" in text:
            # A trailing CR ends its line now; only a following LF is in doubt.
            self._skip_lf = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        elif "\n" not in text:
            if text:
                self._partial.append(text)
            return []
        lines = text.split("\n")
        if self._partial:
            self._partial.append(lines[0])
            lines[0] = "".join(self._partial)
            self._partial = []
        rest = lines.pop()
        if rest:
            self._partial.append(rest)

        out: list[str] = []
        data = self._data
        for line in lines:
            if not line:
                # Blank line: dispatch.  Empty data dispatches nothing.
                if data:
                    joined = "\n".join(data)
                    data.clear()
                    if joined:
                        out.append(joined)
                continue
            if line.startswith("data:"):  # fast path for the only field we keep
                value = line[5:]
                data.append(value[1:] if value[:1] == " " else value)
                continue
            self._field(line)
        return out

    def _field(self, line: str) -> None:
        """Process a non-blank line that is not the ``data:`` fast path."""
        if line[0] == ":":  # comment, e.g. llama-server's ":" keep-alive ping
            return
        colon = line.find(":")
        if colon < 0:  # a line with no colon is a field with an empty value
            field, value = line, ""
        else:
            field, value = line[:colon], line[colon + 1 :]
            if value[:1] == " ":
                value = value[1:]
        if field == "data":
            self._data.append(value)
        # event, id, retry and unknown fields do not affect the data.

    def close(self) -> bool:
        """End the stream; True if an unterminated event with non-empty data was pending.

        That event is not dispatched (WHATWG), but a recorder should notice it,
        so its data is left in ``pending``.  An unterminated last line counts as
        part of it: a stream cut right after ``data: {...}`` lost its event.
        Later calls return False.
        """
        if self._closed:
            return False
        self._feed_text(self._decoder.decode(b"", True))  # a cut character -> U+FFFD
        self._closed = True
        if self._partial:
            line = "".join(self._partial)
            self._partial = []
            if line:
                self._field(line)
        self.pending = "\n".join(self._data)
        self._data = []
        return self.pending != ""
