"""A cheap HTTP/1.1 client for the recorder benchmark: raw asyncio, chunked SSE.

One ``Connection`` is one keep-alive TCP connection to 127.0.0.1. It sends a
prepared request and parses the response as it arrives: status line, headers,
then the chunked body, de-chunked with ``bytes.find`` and slices, counting SSE
events (``\\n\\n`` in the de-chunked bytes). When asked, it notes the
``time.monotonic_ns()`` at which each event ended and at which the
terminating chunk arrived, taken at the top of ``data_received``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field


class ProtocolError(Exception):
    pass


@dataclass
class Counters:
    """Shared by the connections of one measurement: events and finished responses."""

    events: int = 0
    responses: int = 0


@dataclass
class Response:
    status: int = 0
    events: int = 0
    event_times: list[int] = field(default_factory=list)
    t_end: int = 0


def build_request(port: int, body: bytes, bench: str) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"User-Agent: llmp-bench/1\r\n"
        f"Accept: text/event-stream\r\n"
        f"Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-bench: {bench}\r\n"
        f"\r\n"
    )
    return head.encode("latin-1") + body


_HEAD, _SIZE, _DATA, _DATA_CRLF, _TRAILER = range(5)


class Connection(asyncio.Protocol):
    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.remaining = 0
        self.last_nl = False
        self.resp = Response()
        self.want_times = False
        self.done: asyncio.Future[Response] | None = None
        self.lost: BaseException | None = None

    @classmethod
    async def open(cls, port: int, counters: Counters) -> Connection:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: cls(counters), "127.0.0.1", port)
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed")
        if self.done is not None and not self.done.done():
            self.done.set_exception(self.lost)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def request(self, raw: bytes, *, times: bool = False) -> Response:
        """Send one request and wait for the whole response."""
        if self.lost is not None:
            raise ConnectionError("connection lost") from self.lost
        assert self.transport is not None
        self.resp = Response()
        self.want_times = times
        self.state = _HEAD
        self.last_nl = False
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.done

    def data_received(self, data: bytes) -> None:
        t = time.monotonic_ns()
        buf = self.buf
        buf += data
        pos = 0
        resp = self.resp
        while True:
            state = self.state
            if state == _DATA:
                take = min(len(buf) - pos, self.remaining)
                if take <= 0:
                    break
                seg = bytes(buf[pos : pos + take])
                n = seg.count(b"\n\n")
                if self.last_nl and seg[0] == 10:
                    n += 1
                self.last_nl = seg[-1] == 10
                if n:
                    resp.events += n
                    self.counters.events += n
                    if self.want_times:
                        resp.event_times.extend([t] * n)
                pos += take
                self.remaining -= take
                if not self.remaining:
                    self.state = _DATA_CRLF
            elif state == _SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(bytes(buf[pos:i]).split(b";", 1)[0], 16)
                pos = i + 2
                if size:
                    self.remaining = size
                    self.state = _DATA
                else:
                    self.state = _TRAILER
            elif state == _DATA_CRLF:
                if len(buf) - pos < 2:
                    break
                pos += 2
                self.state = _SIZE
            elif state == _TRAILER:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                empty = i == pos
                pos = i + 2
                if empty:
                    resp.t_end = t
                    self.counters.responses += 1
                    self.state = _HEAD
                    if self.done is not None and not self.done.done():
                        self.done.set_result(resp)
                    break
            else:  # _HEAD
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                head = bytes(buf[pos:i]).decode("latin-1").lower()
                pos = i + 4
                try:
                    resp.status = int(head.split(" ", 2)[1])
                except (IndexError, ValueError):
                    raise ProtocolError(f"bad status line: {head[:80]!r}") from None
                if "transfer-encoding: chunked" not in head:
                    raise ProtocolError(f"response is not chunked: {head[:300]!r}")
                self.state = _SIZE
        if pos:
            del buf[:pos]
