"""What the addon collects for one exchange: plain data, no mitmproxy types.

The addon fills a `Capture` with cheap operations only: it keeps references
to what mitmproxy already holds (the header fields, the body, each response
piece) and notes times.  Everything that can wait, down to filtering the
headers and counting the body's bytes, is done by `Capture.settle`, which
`record.build_record` calls off the client's path (in the builder child, or
on the writer's thread without one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llmp.format.canonical import hash_bytes
from llmp.format.schema import NAMING_HEADERS, SERVER_HEADERS, SESSION_HEADERS

TAIL_BYTES = 64
KEPT_HEADERS = ("user-agent", "content-type", "content-length", "transfer-encoding")

HeaderFields = tuple[tuple[bytes, bytes], ...]
"""Header fields as mitmproxy holds them (`Headers.fields`): raw names and values."""


def now_ms() -> int:
    """Unix time in integer milliseconds."""
    return int(time.time() * 1000)


def keep_headers(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """R15: only the four headers, names lower-cased, repeats joined with ', '."""
    kept: dict[str, list[str]] = {}
    for name, value in pairs:
        low = name.lower()
        if low in KEPT_HEADERS:
            kept.setdefault(low, []).append(value)
    return {name: ", ".join(values) for name, values in kept.items()}


def _session_hash(value: str) -> str:
    """R32: `fnv1a:<16 hex>` of the value's bytes as sent."""
    return "fnv1a:" + hash_bytes(value.encode("utf-8", "surrogateescape"))


def keep_request_headers(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """R15 and R32: the four headers, the naming ones verbatim, the session ones hashed.

    An allow-list: a credential (`authorization`, `x-api-key`, a cookie) or any
    header not named here is never written.
    """
    pairs = list(pairs)
    kept = keep_headers(pairs)
    own: dict[str, list[str]] = {}
    for name, value in pairs:
        low = name.lower()
        if low in NAMING_HEADERS or low in SESSION_HEADERS:
            own.setdefault(low, []).append(value)
    for name, values in own.items():
        joined = ", ".join(values)
        kept[name] = _session_hash(joined) if name in SESSION_HEADERS else joined
    return kept


def keep_response_headers(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """R15's four, and `server` verbatim: it names the program whose cache served the turn."""
    pairs = list(pairs)
    kept = keep_headers(pairs)
    own: dict[str, list[str]] = {}
    for name, value in pairs:
        low = name.lower()
        if low in SERVER_HEADERS:
            own.setdefault(low, []).append(value)
    kept.update((name, ", ".join(values)) for name, values in own.items())
    return kept


def _text(raw: bytes) -> str:
    """A header name or value as mitmproxy's `Headers` gives it (`_native`)."""
    return raw.decode("utf-8", "surrogateescape")


def kept_response_fields(fields: HeaderFields) -> dict[str, str]:
    """`keep_response_headers` of raw header fields."""
    return keep_response_headers((_text(name), _text(value)) for name, value in fields)


def kept_request_fields(fields: HeaderFields) -> dict[str, str]:
    """`keep_request_headers` of raw header fields."""
    return keep_request_headers((_text(name), _text(value)) for name, value in fields)


def content_encoding(fields: HeaderFields) -> str | None:
    """`Headers.get("content-encoding")` of raw header fields: repeats joined, or None."""
    values = [_text(value) for name, value in fields if name.lower() == b"content-encoding"]
    return ", ".join(values) if values else None


def _tail(pieces: list[bytes]) -> bytes:
    """The last `TAIL_BYTES` of the pieces, joined."""
    out = b""
    for piece in reversed(pieces):
        out = piece[-(TAIL_BYTES - len(out)) :] + out
        if len(out) >= TAIL_BYTES:
            break
    return out


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
    # Taken as is on the client's path; `settle` turns them into the fields above.
    raw_method: bytes | None = None
    raw_path: bytes | None = None
    request_fields: HeaderFields | None = None
    response_fields: HeaderFields | None = None
    tokenize: str | None = None
    """The upstream's base URL when the record is to carry its token counts
    (`llmp_tokenize`); the builder asks it, never the client's path."""
    upstream: str | None = None
    """The host the request was sent to (R34's `request.upstream`): no port, no path."""
    added: list[str] | None = None
    """What the recorder added to the request on its way upstream (`request.added`:
    the opt-in diagnosis, R37); None when it sent the client's request as it was."""
    cut_at_shutdown: bool = False
    """Still in flight when the proxy shut down (R13's `upstream_reset`, unless the
    stream's end event had already been relayed: R29)."""
    tapped: bool = False
    """A `stream_tap` keeps the pieces: the byte counts, tail and first-byte time
    are `settle`'s to work out (until the limit is reached, see `past_limit`)."""

    def set_error(self, error: str) -> None:
        """R13: keep the first thing that went wrong."""
        if self.error is None:
            self.error = error

    def settle(self) -> None:
        """Work out what the client's path left raw; idempotent.

        Runs where the record is built, never on the proxy's event loop.
        """
        if self.raw_method is not None:
            self.method = _text(self.raw_method).upper()  # as `Request.method`
            self.raw_method = None
        if self.raw_path is not None:
            self.path = _text(self.raw_path)
            self.raw_path = None
        if self.request_fields is not None:
            self.request_headers = kept_request_fields(self.request_fields)
            self.request_encoding = content_encoding(self.request_fields)
            self.request_fields = None
        if self.response_fields is not None:
            self.response_headers = kept_response_fields(self.response_fields)
            self.response_encoding = content_encoding(self.response_fields)
            self.response_fields = None
        self._count_pieces()

    def _count_pieces(self) -> None:
        """What `stream_tap` left to count: the bytes, the tail, the first byte's time."""
        if not self.tapped:
            return
        self.tapped = False
        if self.times and self.t_first_byte_ms is None:
            self.t_first_byte_ms = int(self.times[0] * 1000)
        if not self.truncated:  # every piece relayed was kept (`past_limit` counts the rest)
            self.stored_bytes = self.response_body_bytes = sum(map(len, self.pieces))
            self.tail = _tail(self.pieces)

    def add_piece(self, piece: bytes, limit: int) -> None:
        """Note a response piece on its way to the client, with every count kept up to date.

        For a body mitmproxy buffered (one piece); streamed pieces go through
        `stream_tap`, which leaves the counting to `settle`.  Which piece held
        the first stream event is decided later, off the client's path (R28):
        here each piece only gets its time stamp.
        """
        self._count_pieces()  # a tap ran before (cannot happen with mitmproxy; cheap to allow)
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
            self.times.append(t)
            self.pieces.append(piece)
            self.stored_bytes += size
        else:
            if room > 0:
                self.times.append(t)
                self.pieces.append(piece[:room])
                self.stored_bytes += room
            self.truncated = True

    def past_limit(self, piece: bytes, room: int) -> None:
        """A streamed piece with `room` bytes of the limit left (`stream_tap`'s slow path).

        The first such piece keeps what fits and ends the keeping; from then
        on the counts and the tail are kept here, piece by piece, as
        `add_piece` does.
        """
        size = len(piece)
        if not size:
            return
        t = time.time()
        if not self.truncated:
            relayed = sum(map(len, self.pieces))  # everything so far was kept
            self.tail = _tail(self.pieces)
            self.response_body_bytes = self.stored_bytes = relayed
            if room > 0:
                self.times.append(t)
                self.pieces.append(piece[:room])
                self.stored_bytes += room
            self.truncated = True
        if self.t_first_byte_ms is None:
            self.t_first_byte_ms = int((self.times[0] if self.times else t) * 1000)
        self.response_body_bytes += size
        self.tail = (self.tail + piece[-TAIL_BYTES:])[-TAIL_BYTES:]


def stream_tap(cap: Capture, limit: int) -> Callable[[bytes], bytes]:
    """The per-flow stream callable: notes each piece and returns it unchanged.

    Per piece it only stamps the time and keeps a reference, while the limit
    leaves room (R12, R28); counting, the tail and the first-byte time wait
    for `Capture.settle`.  A closure over local names, because this runs for
    every piece of every stream on the proxy's event loop.
    """
    stamp = cap.times.append
    keep = cap.pieces.append
    clock = time.time
    room = limit
    cap.tapped = True

    def tap(data: bytes) -> bytes:
        nonlocal room
        try:
            size = len(data)
            if size <= room:
                if size:
                    stamp(clock())  # before the piece: a reader never sees a piece without a time
                    keep(data)
                    room -= size
            else:
                cap.past_limit(data, room)
                room = -1  # every later piece takes the slow path (empty ones included)
        except Exception:  # the client gets every byte, whatever happens here (R7)
            pass
        return data

    return tap
