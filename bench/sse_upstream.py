"""A fast streaming upstream for the recorder benchmark, run as its own process.

    python bench/sse_upstream.py          # prints "PORT <n>" on stdout, serves until stdin closes

It speaks just enough of llama-server's ``POST /v1/chat/completions`` with
``stream: true`` for the benchmark: chunked ``text/event-stream``, one SSE
event per chunk and per ``write``, in llama-server's shape (a role chunk,
N content deltas, a finish chunk with ``timings``, ``data: [DONE]``). The
request body is read whole and not parsed, so a 300 KB request costs the
upstream nothing but the read.

It is a plain ``asyncio.Protocol`` (no streams layer) in a process of its
own, so it neither shares the benchmark client's GIL nor limits the proxy.

Per request, the ``x-bench`` header sets (comma-separated ``name=value``):

- ``events=N``: content deltas (default 100); the stream has N + 3 events;
- ``delay_ms=D``: sleep D ms before each event after the first, and before
  the terminating chunk (default 0: write as fast as the socket takes it);
- ``tag=T``: log the ``time.monotonic_ns()`` of every event write and of the
  terminating chunk under T. ``GET /_bench/log?tag=T`` returns (and forgets)
  ``{"writes": [...], "end": ns}``.

``CLOCK_MONOTONIC`` is system-wide on Linux, so these times compare directly
with the client's ``time.monotonic_ns()`` in another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

MODEL = "models/bench-q4.gguf"
FINGERPRINT = "b7000-bench001"
_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Server: llama.cpp\r\n"
    b"Access-Control-Allow-Origin: *\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\n"
    b"\r\n"
)
_TERMINATOR = b"0\r\n\r\n"


def _chunk_frame(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _event(delta: str, finish: str = "null", extra: str = "") -> bytes:
    """One llama-server SSE event (``delta`` and ``extra`` are JSON text).

    The id has llama-server's shape: ``chatcmpl-`` and 32 random letters and
    digits (``gen_chatcmplid``), fixed here.
    """
    return (
        b'data: {"choices":[{"finish_reason":%s,"index":0,"delta":%s}],"created":1760000000,'
        b'"id":"chatcmpl-Xq3vR8bT0mK2wL9pZ4sN7cY1fH6dJ5aE","model":"%s",'
        b'"system_fingerprint":"%s","object":"chat.completion.chunk"%s}\n\n'
        % (finish.encode(), delta.encode(), MODEL.encode(), FINGERPRINT.encode(), extra.encode())
    )


_ROLE = _chunk_frame(_event('{"role":"assistant","content":null}'))
_DONE = _chunk_frame(b"data: [DONE]\n\n")


def _content_frame(i: int) -> bytes:
    return _chunk_frame(_event(json.dumps({"content": f" w{i}"}, separators=(",", ":"))))


def _finish_frame(n: int) -> bytes:
    timings = {
        "cache_n": 0,
        "prompt_n": 100,
        "prompt_ms": 50.0,
        "prompt_per_token_ms": 0.5,
        "prompt_per_second": 2000.0,
        "predicted_n": n,
        "predicted_ms": round(n * 18.89, 3),
        "predicted_per_token_ms": 18.89,
        "predicted_per_second": 52.938,
    }
    extra = ',"timings":' + json.dumps(timings, separators=(",", ":"))
    return _chunk_frame(_event("{}", '"stop"', extra))


def parse_spec(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in value.split(","):
        name, _, arg = part.strip().partition("=")
        if name:
            out[name.strip()] = arg.strip()
    return out


class Server:
    def __init__(self) -> None:
        self.logs: dict[str, dict[str, Any]] = {}
        self._content_cache: list[bytes] = []

    def content_frames(self, n: int) -> list[bytes]:
        while len(self._content_cache) < n:
            self._content_cache.append(_content_frame(len(self._content_cache)))
        return self._content_cache[:n]


class UpstreamProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.can_write.set()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length") or 0)
        if len(self.buf) < end + 4 + length:
            return
        del self.buf[: end + 4 + length]
        method, target, _ = head[0].split(" ", 2)
        self.busy = True
        asyncio.get_running_loop().create_task(self._respond(method, target, headers))

    async def _respond(self, method: str, target: str, headers: dict[str, str]) -> None:
        try:
            if method == "GET" and target.startswith("/_bench/log"):
                tag = target.partition("tag=")[2]
                body = json.dumps(self.server.logs.pop(tag, None)).encode()
                self._write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
                )
            elif method == "POST" and target.startswith("/v1/chat/completions"):
                await self._stream(parse_spec(headers.get("x-bench", "")))
            else:
                self._write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        finally:
            self.busy = False
        if not self.closed:
            self._maybe_start()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def _stream(self, spec: dict[str, str]) -> None:
        n = int(spec.get("events") or 100)
        delay = float(spec.get("delay_ms") or 0) / 1000
        tag = spec.get("tag")
        frames = [_ROLE, *self.server.content_frames(n), _finish_frame(n), _DONE]
        times: list[int] | None = [] if tag else None
        clock = time.monotonic_ns
        self._write(_HEAD)
        for i, frame in enumerate(frames):
            if delay and i:
                await asyncio.sleep(delay)
            if not self.can_write.is_set():
                await self.can_write.wait()
            if self.closed:
                return
            if times is not None:
                times.append(clock())
            self._write(frame)
        if delay:
            await asyncio.sleep(delay)
        if not self.can_write.is_set():
            await self.can_write.wait()
        end = clock()
        self._write(_TERMINATOR)
        if tag and times is not None:
            self.server.logs[tag] = {"writes": times, "end": end}


async def serve() -> None:
    server = Server()
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: UpstreamProtocol(server), "127.0.0.1", 0, backlog=128)
    port = srv.sockets[0].getsockname()[1]
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()
    # Serve until the parent closes our stdin (or dies).
    stdin_closed = asyncio.Event()

    def _wait_stdin() -> None:
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(stdin_closed.set)

    loop.run_in_executor(None, _wait_stdin)
    await stdin_closed.wait()
    srv.close()


def main() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
