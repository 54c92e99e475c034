"""What the addon collects for one exchange: plain data, no mitmproxy types.

The addon fills a `Capture` with cheap operations only (appending a piece,
noting a time). Everything expensive happens later in `record.build_record`,
on the writer's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

TAIL_BYTES = 64
KEPT_HEADERS = ("user-agent", "content-type", "content-length", "transfer-encoding")


def now_ms() -> int:
    """Unix time in integer milliseconds."""
    return int(time.time() * 1000)


def keep_headers(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """R15: only the four headers, names lower-cased, repeats joined with ', '."""
    kept: dict[str, list[str]] = {}
    for name, value in pairs:
        low = name.lower()
        if low in KEPT_HEADERS:
            kept.setdefault(low, []).append(value)
    return {name: ", ".join(values) for name, values in kept.items()}


@dataclass
class Capture:
    """One exchange as seen by the proxy, before it becomes a record."""

    id: int
    conn: int
    t_start_ms: int
    method: str = "GET"
    path: str = "/"
    request_headers: dict[str, str] = field(default_factory=dict)
    request_encoding: str | None = None
    request_body: bytes | None = None
    request_body_bytes: int = 0
    request_complete: bool = False  # the whole request body arrived
    # Response: `status is None` means no response head arrived.
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response_encoding: str | None = None
    pieces: list[bytes] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """When each kept piece arrived (Unix seconds), for `t_first_event_ms` (R28)."""
    response_body_bytes: int = 0
    stored_bytes: int = 0
    truncated: bool = False
    tail: bytes = b""  # the last bytes relayed, kept even past the limit
    t_first_byte_ms: int | None = None
    t_end_ms: int | None = None
    error: str | None = None

    def set_error(self, error: str) -> None:
        """R13: keep the first thing that went wrong."""
        if self.error is None:
            self.error = error

    def add_piece(self, piece: bytes, limit: int) -> None:
        """Note a response piece on its way to the client: O(1), never copies.

        Which piece held the first stream event is decided later, off the
        client's path (R28): here each piece only gets its time stamp.
        """
        size = len(piece)
        if not size:
            return
        t = time.time()
        if self.t_first_byte_ms is None:
            self.t_first_byte_ms = int(t * 1000)
        self.response_body_bytes += size
        self.tail = (self.tail + piece[-TAIL_BYTES:])[-TAIL_BYTES:]
        if self.truncated:
            return
        room = limit - self.stored_bytes
        if size <= room:
            self.pieces.append(piece)
            self.times.append(t)
            self.stored_bytes += size
        else:
            if room > 0:
                self.pieces.append(piece[:room])
                self.times.append(t)
                self.stored_bytes += room
            self.truncated = True
