"""The raw HTTP/1.1 server under every fake.

It is a small asyncio stream server on 127.0.0.1 in a daemon thread, so a
test controls every byte: chunked framing (one chunk per event), keep-alive,
and deliberate faults chosen per request with the ``x-fake`` header (see
``MODES``). Nothing here knows an API: an ``App`` (one per server flavour)
routes each request and builds the bodies; a ``Responder`` writes them and
applies the faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self

from llmp.demo.fakes.exchange import Exchange, header
from llmp.demo.fakes.modes import GARBAGE_NDJSON, GARBAGE_SSE, MODES, parse_fake
from llmp.demo.fakes.responder import CloseConnection, Responder

Handler = Callable[[Responder], Awaitable[None]]


class App:
    """One server flavour: its routes, headers, JSON encoder and error bodies.

    Subclasses fill ``routes`` (``(method, path)`` -> handler) and override
    the flavour hooks; the raw server calls ``route`` and ``error``.
    """

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}

    @classmethod
    def of(cls, server: RawServer) -> Self:
        """The app of a running fake (``OpenAIAPI.of(upstream)``)."""
        if not isinstance(server.app, cls):
            raise TypeError(f"{server!r} does not serve {cls.__name__}")
        return server.app

    def add_routes(self, routes: dict[tuple[str, str], Handler]) -> None:
        """Serve more endpoints (another API of the same server)."""
        self.routes.update(routes)

    # flavour hooks -------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return []

    def dumps(self, obj: Any) -> bytes:
        return json.dumps(obj).encode()

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        """Answer ``status`` with the flavour's error body (also the ``status=N`` mode)."""
        raise NotImplementedError

    async def not_found(self, resp: Responder, path: str) -> None:
        await self.error(resp, path, 404, "File Not Found")

    # shared pieces -------------------------------------------------------

    async def route(self, resp: Responder, path: str) -> None:
        handler = self.routes.get((resp.ex.method, path))
        if handler is None:
            await self.not_found(resp, path)
        else:
            await handler(resp)

    def headers(self, ex: Exchange, content_type: str) -> list[tuple[str, str]]:
        """The flavour's headers, with the content-type modes applied."""
        hdrs = self.base_headers()
        if "content_type" in ex.modes:
            content_type = ex.modes["content_type"]
        if "no_content_type" not in ex.modes and content_type:
            hdrs.append(("Content-Type", content_type))
        name, _, value = (ex.modes.get("header") or "").partition(":")
        if name.strip():
            hdrs.append((name.strip(), value.strip()))
        return hdrs

    async def json(self, resp: Responder, status: int, obj: Any) -> None:
        """A JSON body, after the delay modes (a server thinks before it answers)."""
        headers = self.headers(resp.ex, "application/json; charset=utf-8")
        await self.think(resp)
        await resp.body(status, headers, self.dumps(obj))

    @staticmethod
    async def think(resp: Responder) -> None:
        """The delay modes' wait before a JSON body's head (``delay_ms``, ``slow``,
        ``prefill_ms``): a server thinks before it answers."""
        modes = resp.ex.modes
        if "delay_ms" in modes or "slow" in modes or "prefill_ms" in modes:
            await asyncio.sleep(resp.delay() + float(modes.get("prefill_ms") or 0) / 1000)

    async def stream(
        self, resp: Responder, content_type: str, events: list[bytes], error_event: bytes
    ) -> None:
        garbage = GARBAGE_NDJSON if content_type == "application/x-ndjson" else GARBAGE_SSE
        await resp.stream(self.headers(resp.ex, content_type), events, error_event, garbage)

    @staticmethod
    def parse_json_body(ex: Exchange) -> dict[str, Any] | None:
        try:
            body = json.loads(ex.request_body)
        except (ValueError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None


async def read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, str, list[tuple[str, str]], bytes] | None:
    """One HTTP/1.1 request (Content-Length or chunked body); None at EOF."""
    line = await reader.readline()
    while line in (b"\r\n", b"\n"):
        line = await reader.readline()
    if not line:
        return None
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    te = (header(headers, "transfer-encoding") or "").lower()
    body = b""
    if "chunked" in te:
        parts: list[bytes] = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readline()
        body = b"".join(parts)
    else:
        length = header(headers, "content-length")
        if length:
            body = await reader.readexactly(int(length))
    return method, target, version, headers, body


class LoopServer:
    """A server on 127.0.0.1 with its own event loop in a daemon thread.

    The constructor returns once it listens (``port``, ``url``); ``close()``
    (or the end of the ``with`` block) cancels the connections still open and
    stops the loop. A subclass sets its own state *before* calling
    ``__init__`` (connections may come at once), answers in ``_handle_conn``
    (adding its task to ``_tasks`` while it runs), and may make loop-bound
    state in ``_starting`` and release waiters in ``_closing``.
    """

    def __init__(self, name: str) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._server: asyncio.Server | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{name} did not start")
        if self._error is not None:
            raise RuntimeError(f"{name} failed to start") from self._error
        self.port: int = self._port
        self.url = f"http://127.0.0.1:{self.port}"

    async def _handle_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raise NotImplementedError

    async def _starting(self) -> None:
        """On the loop, before it listens."""

    def _closing(self) -> None:
        """On the loop, at close, before the connections are cancelled."""

    # lifecycle -------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # reported to the constructor
            self._error = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _start(self) -> None:
        await self._starting()
        self._server = await asyncio.start_server(self._handle_conn, "127.0.0.1", 0, limit=1 << 24)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        self._closing()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        with contextlib.suppress(Exception):
            fut.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawServer(LoopServer):
    """Serves an ``App`` until ``close()`` (or the end of the ``with`` block).

    ``log`` is the list of ``Exchange`` in arrival order. ``fake`` sets modes
    for every request; the ``x-fake`` header adds to them.
    """

    def __init__(self, app: App, *, fake: str = "", name: str = "fake-upstream") -> None:
        self.app = app
        self.default_modes = parse_fake(fake)
        self.log: list[Exchange] = []
        self._index = 0
        self._conns = 0
        self._hang_release: asyncio.Event | None = None
        super().__init__(name)

    async def _starting(self) -> None:
        self._hang_release = asyncio.Event()

    def _closing(self) -> None:
        assert self._hang_release is not None
        self._hang_release.set()

    # helpers for tests ------------------------------------------------------

    @property
    def last(self) -> Exchange:
        return self.log[-1]

    def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[Exchange]:
        """Wait until ``n`` requests arrived and their responses ended; return them."""
        deadline = time.monotonic() + timeout
        while len(self.log) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"upstream saw {len(self.log)} of {n} requests")
            time.sleep(0.005)
        for ex in self.log[:n]:
            ex.wait(max(0.0, deadline - time.monotonic()))
        return self.log[:n]

    # connection --------------------------------------------------------------

    async def _handle_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._conns += 1
        conn = self._conns
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    break
                method, target, version, headers, body = req
                modes = dict(self.default_modes)
                modes.update(parse_fake(header(headers, "x-fake") or ""))
                ex = Exchange(
                    index=self._index,
                    conn=conn,
                    method=method,
                    path=target,
                    http_version=version,
                    request_headers=headers,
                    request_body=body,
                    modes=modes,
                    t_request=time.monotonic(),
                )
                self._index += 1
                self.log.append(ex)
                try:
                    await self._respond(ex, writer)
                except CloseConnection:
                    break
                except asyncio.CancelledError:
                    ex.outcome = "cancelled"
                    raise
                except (ConnectionError, OSError):
                    ex.outcome = "client_gone"
                    break
                finally:
                    if ex.outcome == "pending":
                        ex.outcome = "complete" if ex.t_end else "no_response"
                    ex.done.set()
                conn_hdr = (header(headers, "connection") or "").lower()
                if "close" in modes or conn_hdr == "close" or version == "HTTP/1.0":
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)

    async def _respond(self, ex: Exchange, writer: asyncio.StreamWriter) -> None:
        modes = ex.modes
        unknown = sorted(set(modes) - set(MODES))
        gzip_ok = "gzip" in modes and "gzip" in (ex.request_header("accept-encoding") or "")
        assert self._hang_release is not None
        resp = Responder(
            writer, ex, gzip_ok=gzip_ok, split="split" in modes, hang_release=self._hang_release
        )
        if unknown:
            resp.gz = None
            await resp.full(
                400,
                [("Content-Type", "text/plain")],
                f"fake upstream: unknown x-fake mode(s) {unknown}; known: {sorted(MODES)}".encode(),
            )
            return
        if "die_before_head" in modes:
            ex.outcome = "no_response"
            resp.abort(reset=False)
            raise CloseConnection
        if "hang_before_head" in modes:
            await resp.hang()
            resp.abort(reset=False)
            raise CloseConnection
        path = ex.path.split("?", 1)[0]
        if "status" in modes:
            await self.app.error(resp, path, int(modes["status"]), "fake upstream error")
            return
        await self.app.route(resp, path)
