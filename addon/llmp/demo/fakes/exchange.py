"""The fakes' log: one ``Exchange`` per request, as the upstream saw and answered it.

Tests compare what a client (or the recorder) got against this log, so every
payload write is logged, in order, before it reaches the socket.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Self


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The first value of header ``name`` (case-insensitive), or None."""
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def bearer(ex: Exchange) -> str | None:
    """The request's bearer token, or None."""
    scheme, _, token = (ex.request_header("authorization") or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass
class Exchange:
    """One request as the upstream saw it, and the response as it was written.

    ``writes`` holds every payload write to the socket in order, as
    ``(time.monotonic(), bytes)``: the body bytes, de-chunked (each chunk's
    payload), after compression. One event is one write (two with ``split``).
    """

    index: int
    conn: int
    method: str
    path: str
    http_version: str
    request_headers: list[tuple[str, str]]
    request_body: bytes
    modes: dict[str, str]
    t_request: float
    status: int | None = None
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    writes: list[tuple[float, bytes]] = field(default_factory=list)
    plain_parts: list[bytes] = field(default_factory=list)
    t_head: float | None = None
    t_end: float | None = None
    #: pending, complete, error_event (midstream error sent, clean end), died,
    #: reset, hung, no_response, short_body, client_gone, cancelled
    outcome: str = "pending"
    #: a cloud provider fake's cache decision for this request: an
    #: ``anthropic_cache.Decision`` on ``anthropic-api``, a ``provider_cache.CacheDecision``
    #: on ``openai-api`` and ``openrouter``; None elsewhere
    cache: Any = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def body(self) -> bytes:
        """Body bytes as sent (compressed if gzip), without chunk framing."""
        return b"".join(data for _, data in self.writes)

    @property
    def decoded_body(self) -> bytes:
        """Body bytes before content-encoding (equals ``body`` without gzip)."""
        return b"".join(self.plain_parts)

    @property
    def event_times(self) -> list[float]:
        return [t for t, _ in self.writes]

    @property
    def request_json(self) -> Any:
        return json.loads(self.request_body)

    def request_header(self, name: str) -> str | None:
        return header(self.request_headers, name)

    def response_header(self, name: str) -> str | None:
        return header(self.response_headers, name)

    def sse_data(self) -> list[str]:
        """The ``data:`` values of the (decoded) body's SSE events, comments skipped."""
        return [data for _, data in self.sse_events()]

    def sse_events(self) -> list[tuple[str | None, str]]:
        """``(event name or None, data)`` of each SSE event with data, comments skipped.

        The Anthropic and Responses streams name their events (``event:`` lines).
        """
        out: list[tuple[str | None, str]] = []
        for block in self.decoded_body.decode("utf-8", "replace").split("\n\n"):
            lines = block.split("\n")
            data = [ln[5:].removeprefix(" ") for ln in lines if ln.startswith("data:")]
            if data:
                names = [ln[6:].removeprefix(" ") for ln in lines if ln.startswith("event:")]
                out.append((names[-1] if names else None, "\n".join(data)))
        return out

    def ndjson_lines(self) -> list[str]:
        text = self.decoded_body.decode("utf-8", "replace")
        return [ln for ln in text.split("\n") if ln.strip()]

    def wait(self, timeout: float = 5.0) -> Self:
        if not self.done.wait(timeout):
            raise TimeoutError(
                f"upstream exchange {self.index} {self.path} not done: {self.outcome}"
            )
        return self
