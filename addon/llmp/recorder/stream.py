"""One streamed response body: parsed, counted and merged within the limit.

The recording stores a streamed body as one object with the shape of the
non-streamed response (R9, R10, R23, R26), so the analyzer reads both alike.
`StreamCapture` ties the framing's parser (SSE or NDJSON), the API's merger,
the chunk counters (R8) and the recording limit (R12) together.

Everything here is pure (no mitmproxy) and defensive: events come from the
network, so any field can have any type, and a surprise must cost at most
that field, never the capture.
"""

from __future__ import annotations

from typing import Any

from llmp.apis import ChatApi, Merger, merger_for
from llmp.apis.ndjson import NDJSONParser
from llmp.apis.sse import SSEParser
from llmp.format import canonical

__all__ = ["StreamCapture", "sniff_stream"]

# ------------------------------------------------------------------------- sniff

_SSE_TYPES = frozenset({"text/event-stream"})
# x-ndjson is what Ollama sends; the other two names are used by a few
# JSON-lines servers.  application/json-seq is left out: its records start
# with an RS byte, which this line splitter would count as bad chunks.
_NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "text/plain"})
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
_WS = b" \t\r\n"


def sniff_stream(content_type: str | None, head: bytes) -> str | None:
    """R8: ``"sse"``, ``"ndjson"`` or None (not streamed) for a response.

    The content type decides (parameters and case ignored).  Only when it is
    missing or generic (``application/octet-stream``, ``text/plain``) are the
    first body bytes sniffed: an SSE field or comment first means SSE; a first
    line that is a JSON object followed by another non-blank line means NDJSON
    (``head`` must be long enough to hold the first line and the start of the
    next).  ``application/json`` and anything else is not a stream.
    """
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime in _SSE_TYPES:
        return "sse"
    if mime in _NDJSON_TYPES:
        return "ndjson"
    if mime not in _GENERIC_TYPES:
        return None
    head = bytes(head)
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:]
    head = head.lstrip(_WS)
    if head.startswith(_SSE_STARTS):
        return "sse"
    if not head.startswith(b"{"):
        return None
    first, nl, rest = head.partition(b"\n")
    if not nl or not rest.strip(_WS):
        return None
    try:
        obj = canonical.loads(first)
    except canonical.NotJSON:
        return None
    return "ndjson" if isinstance(obj, dict) else None


# ------------------------------------------------------------------------ capture


class StreamCapture:
    """Parse, count and merge one streamed response body, within the limit.

    ``feed`` never raises: the capture runs beside the client's bytes (R7) and
    a bug in a parser or merger must not lose it.  Only the first ``limit``
    bytes are parsed (R12); the merge keeps the events complete within them.

    Counters (R8): ``chunks`` is the SSE events with non-empty data, without
    the ``[DONE]`` sentinel, or the non-blank NDJSON lines; ``bad_chunks`` the
    ones that are not a JSON object.  An SSE event left unterminated at the end
    of the stream counts in both (so ``bad_chunks <= chunks`` always holds),
    unless the body was truncated (the limit cut it, not the server) or its
    data is ``[DONE]`` (then it only sets ``done_seen``).
    """

    __slots__ = (
        "_closed",
        "_merger",
        "_parsed",
        "_parser",
        "_run",
        "bad_chunks",
        "body_bytes",
        "chunks",
        "done_seen",
        "events",
        "internal_errors",
        "kind",
        "limit",
        "truncated",
    )

    def __init__(self, kind: str, limit: int, api: ChatApi | None = None) -> None:
        if kind == "sse":
            self._parser: SSEParser | NDJSONParser = SSEParser()
        elif kind == "ndjson":
            self._parser = NDJSONParser()
        else:
            raise ValueError(f"unknown stream kind: {kind!r}")
        self._merger: Merger = merger_for(api, kind)
        # A merger that can fold events from their text alone, when they repeat the
        # last one but for a string it appends (`SSEMerger.add_same_run`); SSE only.
        self._run: Any = getattr(self._merger, "add_same_run", None) if kind == "sse" else None
        self.kind = kind
        self.limit = max(0, int(limit))
        self.chunks = 0
        self.bad_chunks = 0
        self.body_bytes = 0
        self.truncated = False
        self.done_seen = False
        #: Events dispatched (SSE events with data, `[DONE]` too) or non-blank lines (NDJSON).
        self.events = 0
        #: Exceptions swallowed by feed/close: always 0 unless llmp has a bug.
        self.internal_errors = 0
        self._parsed = 0
        self._closed = False

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """Account for one piece of the body and parse what fits in the limit."""
        try:
            if not isinstance(piece, bytes):
                piece = bytes(piece)
            size = len(piece)
            self.body_bytes += size
            if self._closed or not size:
                return
            room = self.limit - self._parsed
            if size > room:
                self.truncated = True
                if room <= 0:
                    return
                piece = piece[:room]
            self._parsed += len(piece)
            items = self._parser.feed(piece)
        except Exception:
            self.internal_errors += 1
            return
        run = self._run
        if run is None:
            for item in items:
                self._item(item)
            return
        at, count = 0, len(items)
        while at < count:
            try:
                folded = run(items, at) - at  # the events folded from their text, in one loop
            except Exception:
                self.internal_errors += 1
                folded = 0
            self.events += folded
            self.chunks += folded
            at += folded
            if at < count:
                self._item(items[at])
                at += 1

    def _item(self, item: str | bytes) -> None:
        self.events += 1
        try:
            if isinstance(item, str) and item.strip() == "[DONE]":
                self.done_seen = True
                return
            self.chunks += 1
            try:
                obj = canonical.loads(item, short_ints=canonical.short_ints_only(item))
            except canonical.NotJSON:
                obj = None
            if not isinstance(obj, dict):
                self.bad_chunks += 1
                return
            merger = self._merger
            merger.add(obj)
            if merger.ended:  # the API's own end event (R29)
                self.done_seen = True
            elif self._run is not None:  # the template the next events are folded by
                merger.learn(obj, item)  # type: ignore[attr-defined]
        except Exception:
            self.internal_errors += 1

    def close(self) -> None:
        """End the body: flush the parser and count what it held back."""
        if self._closed:
            return
        self._closed = True
        try:
            parser = self._parser
            if isinstance(parser, SSEParser):
                pending = parser.close()
                if pending and not self.truncated:
                    if parser.pending.strip() == "[DONE]":
                        self.done_seen = True
                    else:
                        self.chunks += 1
                        self.bad_chunks += 1
            else:
                lines = parser.close()
                if not self.truncated:  # a line cut by the limit is not the server's
                    for line in lines:
                        self._item(line)
        except Exception:
            self.internal_errors += 1

    def merged(self) -> dict[str, Any] | None:
        """The merged body (None if no JSON object event was parsed)."""
        try:
            return self._merger.result()
        except Exception:
            self.internal_errors += 1
            return None
