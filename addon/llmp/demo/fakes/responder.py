"""Writing one response: HTTP/1.1 framing, gzip, and the faults of ``MODES``.

One event is one chunk (two with ``split``), every write is logged in the
``Exchange`` before it reaches the socket, and a fault ends the response the
way a failing server would: a lying Content-Length, a FIN, an RST or silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
import struct
import time
import zlib

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.modes import FAULT_ENDINGS, PING


class CloseConnection(Exception):
    """Leave the keep-alive loop and close the connection."""


class Responder:
    """Writes one response: head, then payload writes (chunked or plain), with the faults."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        ex: Exchange,
        *,
        gzip_ok: bool,
        split: bool,
        hang_release: asyncio.Event,
    ) -> None:
        self.writer = writer
        self.ex = ex
        self.gz = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip_ok else None
        self.split = split
        self.chunked = False
        self._hang_release = hang_release

    # framing -------------------------------------------------------------

    async def head(
        self,
        status: int,
        headers: list[tuple[str, str]],
        *,
        chunked: bool,
        content_length: int | None = None,
    ) -> None:
        hdrs = list(headers)
        if self.gz is not None:
            hdrs.append(("Content-Encoding", "gzip"))
        if chunked:
            hdrs.append(("Transfer-Encoding", "chunked"))
        elif content_length is not None:
            hdrs.append(("Content-Length", str(content_length)))
        if "close" in self.ex.modes:
            hdrs.append(("Connection", "close"))
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        raw = f"HTTP/1.1 {status} {phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs)
        self.chunked = chunked
        self.ex.status = status
        self.ex.response_headers = hdrs
        self.ex.t_head = time.monotonic()
        self.writer.write(raw.encode("latin-1") + b"\r\n")
        await self.writer.drain()

    async def write(self, payload: bytes) -> None:
        if not payload:
            return
        # logged before the bytes can reach the client, so a client that has
        # them always finds them in the log
        self.ex.writes.append((time.monotonic(), payload))
        if self.chunked:
            self.writer.write(b"%x\r\n%b\r\n" % (len(payload), payload))
        else:
            self.writer.write(payload)
        await self.writer.drain()

    def encode(self, plain: bytes, final: bool) -> bytes:
        if self.gz is None:
            return plain
        data = self.gz.compress(plain)
        return data + self.gz.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)

    async def event(self, plain: bytes) -> None:
        self.ex.plain_parts.append(plain)
        data = self.encode(plain, final=False)
        if self.split and len(data) > 1:
            mid = len(data) // 2
            await self.write(data[:mid])
            await self.write(data[mid:])
        else:
            await self.write(data)

    async def finish(self, outcome: str = "complete") -> None:
        if self.gz is not None:
            await self.write(self.gz.flush(zlib.Z_FINISH))
        self.ex.t_end = time.monotonic()
        self.ex.outcome = outcome
        if self.chunked:
            self.writer.write(b"0\r\n\r\n")
            await self.writer.drain()

    async def full(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        overstate: int = 0,
        outcome: str = "complete",
    ) -> None:
        """A Content-Length response. ``overstate`` > 0 lies about the length."""
        data = self.encode(body, final=True)
        await self.head(status, headers, chunked=False, content_length=len(data) + overstate)
        self.ex.plain_parts.append(body)
        self.ex.t_end = time.monotonic()
        self.ex.outcome = outcome
        await self.write(data)

    # faults --------------------------------------------------------------

    async def hang(self) -> None:
        """Send nothing until ``hang_s`` passes or the server closes."""
        self.ex.outcome = "hung"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._hang_release.wait(), float(self.ex.modes.get("hang_s") or 120)
            )

    def abort(self, reset: bool) -> None:
        """Close the connection: a FIN, or an RST when ``reset``."""
        if reset:
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.writer.transport.abort()
        else:
            self.writer.transport.close()

    def delay(self) -> float:
        """Seconds to sleep between writes (``delay_ms``, ``slow``)."""
        modes = self.ex.modes
        if "delay_ms" in modes:
            return float(modes["delay_ms"] or 0) / 1000
        if "slow" in modes:
            return 0.05
        return 0.0

    async def body(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """A Content-Length body, with the body-level faults."""
        modes = self.ex.modes
        if "short_content_length" in modes:
            await self.full(status, headers, body, overstate=100, outcome="short_body")
            self.abort(reset=False)
            raise CloseConnection
        if "hang_after_head" in modes:
            await self.head(status, headers, chunked=False, content_length=len(body))
            await self.hang()
            self.abort(reset=False)
            raise CloseConnection
        for fault in ("die_midstream", "reset_midstream", "hang_midstream"):
            if fault in modes:
                data = self.encode(body, final=True)
                await self.head(status, headers, chunked=False, content_length=len(data))
                self.ex.plain_parts.append(body)
                await self.write(data[: len(data) // 2])
                if fault == "hang_midstream":
                    await self.hang()
                else:
                    self.ex.outcome = "died" if fault == "die_midstream" else "reset"
                self.abort(reset=fault == "reset_midstream")
                raise CloseConnection
        await self.full(status, headers, body)

    async def stream(
        self,
        headers: list[tuple[str, str]],
        events: list[bytes],
        error_event: bytes,
        garbage: bytes,
    ) -> None:
        """Send a chunked stream, one event per chunk, applying the stream modes.

        ``error_event`` is what the server sends on an error after the head;
        ``garbage`` is its shape of a non-JSON event.
        """
        modes = self.ex.modes
        if "garbage" in modes:
            data_seen = 0
            at = len(events)
            for i, ev in enumerate(events):
                if ev != PING:
                    data_seen += 1
                    if data_seen == 2:
                        at = i + 1
                        break
            events.insert(at, garbage)
        ending = "end"
        for fault, how in FAULT_ENDINGS.items():
            if fault in modes:
                ending = how
                limit = int(modes.get("error_after") or 3)
                kept: list[bytes] = []
                n = 0
                for ev in events:
                    if n >= limit:
                        break
                    kept.append(ev)
                    if ev != PING:
                        n += 1
                events = kept
                if how == "error":
                    events.append(error_event)
                break
        if "short_content_length" in modes:
            await self.body(200, headers, b"".join(events))
            return
        await self.head(200, headers, chunked=True)
        if "hang_after_head" in modes:
            await self.hang()
            self.abort(reset=False)
            raise CloseConnection
        delay = self.delay()
        if "prefill_ms" in modes:
            await asyncio.sleep(float(modes["prefill_ms"] or 0) / 1000)
        for i, ev in enumerate(events):
            if i and delay:
                await asyncio.sleep(delay)
            await self.event(ev)
        if ending == "end":
            await self.finish()
        elif ending == "error":
            await self.finish("error_event")
        else:
            if ending == "hang":
                await self.hang()
            else:
                self.ex.outcome = "died" if ending == "die" else "reset"
            self.ex.t_end = time.monotonic()
            self.abort(reset=ending == "reset")
            raise CloseConnection
