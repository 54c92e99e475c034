"""Replay a real harness capture through the real mitmdump with the llmp addon.

A capture (``/work/harness/captures/*.jsonl``, or the scrambled
``tests/fixtures/harness/*.jsonl.gz``; format at the top of
``/work/harness/NOTES.md``) holds, per exchange, what a real harness sent and
the real llama-server's response pieces as mitmproxy's stream callable saw
them. Replaying it takes three real parts and no fake logic:

* **the replay upstream** (``ReplayUpstream``), a small asyncio HTTP/1.1
  server that answers each request with the captured status line, headers
  and pieces, one chunk per piece (the same piece boundaries), with the
  captured gaps between pieces scaled by ``time_scale`` and capped;
* **the real mitmdump** with ``addon/llmp_addon.py`` in front of it
  (``tests.support.mitm.Mitmdump``);
* **a replay client** (``drive``) that opens one TCP connection per captured
  client connection, sends each captured request (method, path, headers,
  body, byte for byte; a dropped auth header comes back with a dummy value)
  and reads the response the way the harness did: to the end, or, where the
  capture ends in mitmproxy's ``Client disconnected.``, exactly as far as the
  harness got before it hung up (Codex: the piece holding
  ``response.completed``; a killed harness: mid-stream).

Requests are matched to captured responses by what they are (method, path,
body; identical requests in capture order), so a concurrent request on
another connection finds its own answer; ``check_replay`` then checks that
each captured connection reached the upstream as one connection of its own.
The order is the capture's, without relying on the clock:

* request *k* is sent only once request *k-1* has reached the upstream, so
  the proxy numbers them as the capture did;
* and once every exchange that had ended before *k* started in the capture
  is over (its response read, or the client gone);
* an exchange that a later request on another connection overlapped in the
  capture (Claude Code's and opencode's title calls) keeps its last piece
  back until that request has arrived, so they overlap in the replay too;
* for an exchange the harness hung up on, the upstream sends every captured
  piece and then holds the chunked terminator until the client has gone,
  which is the race the real server lost.

``server_counters`` reads the server's own cache counters out of the
captured response bytes (independently of llmp's parsers): llama-server's
``timings.cache_n`` / ``prompt_n`` where present, else the API's usage.

    python -m tests.support.replay /work/harness/captures/*.jsonl   # every check, both modes
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import io
import json
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmp.demo.fakes.exchange import header
from llmp.demo.fakes.raw import LoopServer, read_request
from tests.support import adds_up
from tests.support.mitm import Mitmdump, read_records, wait_for_records

#: mitmproxy's flow error when the client went away (what the harness did).
CLIENT_DISCONNECTED = "Client disconnected."
#: The value a dropped credential header is sent with; it must never be recorded.
DUMMY_SECRET = "Bearer llmp-replay-dummy-secret"
END_EVENTS = (b"data: [DONE]", b"message_stop", b"response.completed")


# -- the capture ---------------------------------------------------------------


@dataclass
class Captured:
    """One captured exchange: the request as the harness sent it, the response as it came."""

    seq: int
    conn: int
    method: str
    path: str
    http_version: str
    request_headers: list[tuple[str, str]]
    dropped_headers: list[str]
    request_body: bytes
    status: int | None
    reason: str
    response_headers: list[tuple[str, str]]
    pieces: list[tuple[float, bytes]]
    t_start: float
    t_request_end: float | None
    t_resp_headers: float | None
    t_end: float | None
    error: str | None
    line: dict[str, Any] = field(repr=False)

    @property
    def body(self) -> bytes:
        """The response body as the client got it (de-chunked, still content-encoded)."""
        return b"".join(data for _, data in self.pieces)

    @property
    def chunked(self) -> bool:
        return "chunked" in (header(self.response_headers, "transfer-encoding") or "").lower()

    @property
    def hung_up(self) -> bool:
        """The harness went away before the end of the response body."""
        return self.error == CLIENT_DISCONNECTED

    @property
    def stream_complete(self) -> bool:
        """The body holds the API's end event (``[DONE]``, ``message_stop``, ``response.completed``)."""
        tail = self.body[-4096:]
        return any(mark in tail for mark in END_EVENTS)

    @property
    def path_only(self) -> str:
        return self.path.split("?", 1)[0]

    def key(self) -> tuple[str, str, str]:
        return request_key(self.method, self.path, self.request_body)

    def request_json(self) -> Any:
        try:
            return json.loads(self.request_body)
        except ValueError:
            return None


def request_key(method: str, path: str, body: bytes) -> tuple[str, str, str]:
    return method, path, hashlib.sha256(body).hexdigest()


def _body_bytes(body: dict[str, str] | None) -> bytes:
    if not body:
        return b""
    if "text" in body:
        return body["text"].encode("utf-8")
    return base64.b64decode(body["b64"])


def open_text(path: Path) -> io.TextIOBase:
    """A capture file, gzip-compressed (``.gz``) or not."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return io.TextIOWrapper(open(path, "rb"), encoding="utf-8")


def read_lines(path: Path) -> list[dict[str, Any]]:
    with open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def exchange_from_line(line: dict[str, Any]) -> Captured:
    pieces = [(float(t), base64.b64decode(b64)) for t, b64 in line.get("response_pieces") or []]
    if not pieces and line.get("response_body_buffered"):
        pieces = [(line.get("t_end") or 0.0, base64.b64decode(line["response_body_buffered"]))]
    return Captured(
        seq=int(line["seq"]),
        conn=int(line["conn"]),
        method=line["method"],
        path=line["path"],
        http_version=line.get("http_version") or "HTTP/1.1",
        request_headers=[(k, v) for k, v in line["request_headers"]],
        dropped_headers=list(line.get("dropped_headers") or []),
        request_body=_body_bytes(line.get("request_body")),
        status=line.get("status"),
        reason=line.get("reason") or "",
        response_headers=[(k, v) for k, v in line.get("response_headers") or []],
        pieces=pieces,
        t_start=float(line["t_start"]),
        t_request_end=line.get("t_request_end"),
        t_resp_headers=line.get("t_resp_headers"),
        t_end=line.get("t_end"),
        error=line.get("error"),
        line=line,
    )


def load_capture(path: Path) -> list[Captured]:
    """The capture's exchanges in ``seq`` order (the order the proxy saw the requests)."""
    exchanges = [exchange_from_line(ln) for ln in read_lines(path) if ln.get("kind") == "exchange"]
    exchanges.sort(key=lambda e: e.seq)
    return exchanges


def capture_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl"):
        name = name.removesuffix(suffix)
    return name


# -- the server's own counters ------------------------------------------------------


@dataclass(frozen=True)
class ServerCounters:
    """What the server said it reused and evaluated, and where it said it."""

    reused: int
    evaluated: int
    source: str


def _sse_data(body: bytes) -> Iterator[Any]:
    """The JSON ``data:`` values of an event stream (comments and ``[DONE]`` skipped)."""
    text = body.decode("utf-8", "replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        data = [ln[5:].removeprefix(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if not data or data == ["[DONE]"]:
            continue
        with contextlib.suppress(ValueError):
            yield json.loads("\n".join(data))


def sse_event_count(ex: Captured) -> int | None:
    """Events with data in an event-stream response, ``[DONE]`` not counted (R8); None
    when the response is no event stream."""
    ctype = (header(ex.response_headers, "content-type") or "").lower()
    if "event-stream" not in ctype:
        return None
    text = ex.body.decode("utf-8", "replace").replace("\r\n", "\n")
    n = 0
    for block in text.split("\n\n")[:-1]:  # the text after the last blank line is no event
        data = [ln for ln in block.split("\n") if ln.startswith("data:")]
        if data and data != ["data: [DONE]"]:
            n += 1
    return n


def response_objects(ex: Captured) -> list[Any]:
    """The response as JSON objects: each stream event, or the one body."""
    ctype = (header(ex.response_headers, "content-type") or "").lower()
    if "event-stream" in ctype:
        return list(_sse_data(ex.body))
    try:
        return [json.loads(ex.body)]
    except ValueError:
        return []


def server_counters(ex: Captured) -> ServerCounters | None:
    """The server's reuse counters for one exchange, or None when it reported none.

    llama-server's ``timings`` (``cache_n`` reused, ``prompt_n`` evaluated)
    where present; else, on ``/v1/messages``, ``cache_read_input_tokens`` and
    ``input_tokens`` (which excludes the cached part); on ``/v1/responses``,
    ``input_tokens_details.cached_tokens`` and ``input_tokens`` minus it; on
    chat, ``prompt_tokens_details.cached_tokens`` and ``prompt_tokens`` minus it.
    """
    if ex.status is None or not 200 <= ex.status < 300:
        return None
    objs = [o for o in response_objects(ex) if isinstance(o, dict)]
    timings = [o["timings"] for o in objs if isinstance(o.get("timings"), dict)]
    if timings and "cache_n" in timings[-1] and "prompt_n" in timings[-1]:
        return ServerCounters(int(timings[-1]["cache_n"]), int(timings[-1]["prompt_n"]), "timings")
    path = ex.path_only
    usage: dict[str, Any] = {}
    for o in objs:
        for candidate in (
            o.get("usage"),
            (o.get("message") or {}).get("usage") if isinstance(o.get("message"), dict) else None,
            (o.get("response") or {}).get("usage") if isinstance(o.get("response"), dict) else None,
        ):
            if isinstance(candidate, dict):
                usage.update(candidate)
    if path.endswith("/v1/messages"):
        if "input_tokens" not in usage:
            return None
        reused = int(usage.get("cache_read_input_tokens") or 0)
        evaluated = int(usage["input_tokens"]) + int(usage.get("cache_creation_input_tokens") or 0)
        return ServerCounters(reused, evaluated, "usage")
    if path.endswith("/v1/responses"):
        details = usage.get("input_tokens_details") or {}
        if "input_tokens" not in usage or "cached_tokens" not in details:
            return None
        cached = int(details["cached_tokens"])
        return ServerCounters(cached, int(usage["input_tokens"]) - cached, "usage")
    details = usage.get("prompt_tokens_details") or {}
    if "prompt_tokens" in usage and "cached_tokens" in details:
        cached = int(details["cached_tokens"])
        return ServerCounters(cached, int(usage["prompt_tokens"]) - cached, "usage")
    return None


# -- the replay upstream ------------------------------------------------------------


def overlaps(exchanges: Sequence[Captured]) -> dict[int, list[int]]:
    """For each exchange, the later ones on other connections that started before it ended."""
    out: dict[int, list[int]] = {}
    for j in exchanges:
        end = j.t_end if j.t_end is not None else j.t_start
        later = [k.seq for k in exchanges if k.seq > j.seq and k.conn != j.conn and k.t_start < end]
        if later:
            out[j.seq] = later
    return out


@dataclass
class Served:
    """What the replay upstream did with one request."""

    seq: int | None
    upstream_conn: int
    method: str
    path: str
    #: complete, client_gone (held the end until the client went), held_out
    #: (the client never went: the end was sent after ``hold_s``), unmatched, broken
    outcome: str = "pending"


class ReplayUpstream(LoopServer):
    """Answers every captured request with its captured response, in a daemon thread.

    ``time_scale`` multiplies every captured gap (request end → response
    head, piece → piece), each capped at ``max_gap`` seconds; 0 sends at once.
    ``received`` holds one ``threading.Event`` per ``seq``, set when that
    request has arrived.
    """

    def __init__(
        self,
        exchanges: Sequence[Captured],
        *,
        time_scale: float = 0.0,
        max_gap: float = 0.02,
        hold_s: float = 20.0,
    ) -> None:
        self.exchanges = list(exchanges)
        self.time_scale = time_scale
        self.max_gap = max_gap
        self.hold_s = hold_s
        self._queues: dict[tuple[str, str, str], deque[Captured]] = {}
        for ex in self.exchanges:
            self._queues.setdefault(ex.key(), deque()).append(ex)
        self.received: dict[int, threading.Event] = {ex.seq: threading.Event() for ex in exchanges}
        self.overlaps = overlaps(self.exchanges)
        self.served: list[Served] = []
        self._conns = 0
        super().__init__("replay-upstream")

    # serving ----------------------------------------------------------------

    async def _wait_for_overlaps(self, ex: Captured) -> None:
        """Hold the end of ``ex`` until the requests that overlapped it have arrived."""
        deadline = time.monotonic() + self.hold_s
        for seq in self.overlaps.get(ex.seq, []):
            while not self.received[seq].is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)

    def _delay(self, gap: float | None) -> float:
        if not self.time_scale or gap is None or gap <= 0:
            return 0.0
        return min(gap * self.time_scale, self.max_gap)

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
                method, target, _version, _headers, body = req
                queue = self._queues.get(request_key(method, target, body))
                ex = queue.popleft() if queue else None
                served = Served(ex.seq if ex else None, conn, method, target)
                self.served.append(served)
                if ex is None:
                    served.outcome = "unmatched"
                    msg = f"replay: no captured exchange for {method} {target}".encode()
                    writer.write(
                        b"HTTP/1.1 599 Unmatched\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(msg), msg)
                    )
                    await writer.drain()
                    continue
                self.received[ex.seq].set()
                keep = await self._respond(ex, served, reader, writer)
                if not keep:
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)

    async def _respond(
        self,
        ex: Captured,
        served: Served,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Write the captured response; False when the connection must close after it."""
        if ex.status is None:  # the server never answered: close without a head
            served.outcome = "complete"
            return False
        t_ready = ex.t_request_end or ex.t_start
        await asyncio.sleep(self._delay((ex.t_resp_headers or t_ready) - t_ready))
        head = f"HTTP/1.1 {ex.status} {ex.reason}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in ex.response_headers
        )
        writer.write(head.encode("latin-1") + b"\r\n")
        await writer.drain()
        if ex.method != "HEAD":
            last = ex.t_resp_headers
            for n, (t, data) in enumerate(ex.pieces, 1):
                await asyncio.sleep(self._delay(None if last is None else t - last))
                last = t
                if n == len(ex.pieces):
                    await self._wait_for_overlaps(ex)
                if not data:
                    continue
                writer.write(b"%x\r\n%b\r\n" % (len(data), data) if ex.chunked else data)
                await writer.drain()
            if ex.hung_up:
                # the real server had not ended the body when the harness left
                try:
                    gone = await asyncio.wait_for(reader.read(1), self.hold_s) == b""
                except TimeoutError:
                    gone = False
                if gone:
                    served.outcome = "client_gone"
                    return False
                served.outcome = "held_out"
            if ex.chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        served.outcome = served.outcome if served.outcome != "pending" else "complete"
        conn_hdr = (header(ex.response_headers, "connection") or "").lower()
        return conn_hdr != "close"


# -- the replay client ----------------------------------------------------------------


@dataclass
class ClientResult:
    """What the replay client got for one request."""

    seq: int
    status: int | None = None
    body: bytes = b""
    #: it read the whole response (the terminator or the full Content-Length)
    complete: bool = False
    #: it hung up on purpose, as the harness did
    hung_up: bool = False
    error: str | None = None
    #: time.monotonic() when the request was sent and when the client was done with it
    t_sent: float = 0.0
    t_done: float = 0.0


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[str, str]]]:
    line = await reader.readline()
    if not line:
        raise ConnectionError("connection closed before the response head")
    status = int(line.split(b" ", 2)[1])
    headers: list[tuple[str, str]] = []
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return status, headers


async def _read_body(
    reader: asyncio.StreamReader,
    method: str,
    status: int,
    headers: list[tuple[str, str]],
    stop_after: int | None,
) -> tuple[bytes, bool]:
    """The body, and whether it ended properly; stop once ``stop_after`` bytes are in."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return b"", True
    got = bytearray()
    te = (header(headers, "transfer-encoding") or "").lower()
    if "chunked" in te:
        while True:
            if stop_after is not None and len(got) >= stop_after:
                return bytes(got), False
            size_line = await reader.readline()
            if not size_line:
                return bytes(got), False
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(got), True
            got += await reader.readexactly(size)
            await reader.readline()
    length = header(headers, "content-length")
    if length is not None:
        want = int(length) if stop_after is None else min(int(length), stop_after)
        got += await reader.readexactly(want)
        return bytes(got), want == int(length) and stop_after is None
    while chunk := await reader.read(65536):
        got += chunk
        if stop_after is not None and len(got) >= stop_after:
            return bytes(got), False
    return bytes(got), True


def request_bytes(ex: Captured) -> bytes:
    """The request as the harness sent it; dropped credentials come back as a dummy."""
    lines = [f"{ex.method} {ex.path} {ex.http_version}"]
    lines += [f"{k}: {v}" for k, v in ex.request_headers]
    lines += [f"{name}: {DUMMY_SECRET}" for name in ex.dropped_headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + ex.request_body


async def drive(
    url: str,
    exchanges: Sequence[Captured],
    upstream: ReplayUpstream,
    *,
    time_scale: float = 0.0,
    max_gap: float = 0.05,
    timeout: float = 60.0,
) -> dict[int, ClientResult]:
    """Send every captured request through ``url`` as the harness did; the results by seq."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    order = [ex.seq for ex in exchanges]
    prev_seq = {seq: order[i - 1] if i else None for i, seq in enumerate(order)}
    offsets: dict[int, float] = {}
    at = 0.0
    for i, ex in enumerate(exchanges):
        if i:
            gap = ex.t_start - exchanges[i - 1].t_start
            at += min(max(gap, 0.0) * time_scale, max_gap) if time_scale else 0.0
        offsets[ex.seq] = at
    by_conn: dict[int, list[Captured]] = {}
    for ex in exchanges:
        by_conn.setdefault(ex.conn, []).append(ex)
    results: dict[int, ClientResult] = {}
    t0 = time.monotonic()

    done = {ex.seq: asyncio.Event() for ex in exchanges}
    # what had ended before a request started in the capture ends first in the replay too
    after = {
        k.seq: [
            j.seq
            for j in exchanges
            if j.seq < k.seq and (j.t_end if j.t_end is not None else j.t_start) <= k.t_start
        ]
        for k in exchanges
    }

    async def wait_turn(ex: Captured) -> None:
        for seq in after[ex.seq]:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done[seq].wait(), timeout)
        before = prev_seq[ex.seq]
        if before is not None:
            ev = upstream.received[before]
            deadline = time.monotonic() + timeout
            while not ev.is_set() and time.monotonic() < deadline:
                if results.get(before) and results[before].error:  # never reached upstream
                    break
                await asyncio.sleep(0.001)
        delay = t0 + offsets[ex.seq] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def one_conn(exs: list[Captured]) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            for ex in exs:
                await wait_turn(ex)
                res = ClientResult(ex.seq)
                results[ex.seq] = res
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
                assert reader is not None
                res.t_sent = time.monotonic()
                try:
                    writer.write(request_bytes(ex))
                    await writer.drain()
                    status, headers = await asyncio.wait_for(_read_head(reader), timeout)
                    res.status = status
                    stop_after = len(ex.body) if ex.hung_up else None
                    res.body, res.complete = await asyncio.wait_for(
                        _read_body(reader, ex.method, status, headers, stop_after), timeout
                    )
                except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                    res.error = f"{type(e).__name__}: {e}"
                    ex_close = True
                else:
                    ex_close = ex.hung_up or (
                        (header(headers, "connection") or "").lower() == "close"
                    )
                    res.hung_up = ex.hung_up
                if ex_close:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
                    reader = writer = None
                res.t_done = time.monotonic()
                done[ex.seq].set()
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    await asyncio.gather(*(one_conn(exs) for exs in by_conn.values()))
    return results


# -- one replay through the real mitmdump ---------------------------------------------------


@dataclass
class Replay:
    """One capture replayed in one body mode."""

    name: str
    mode: str
    exchanges: list[Captured]
    records: list[dict[str, Any]]
    client: dict[int, ClientResult]
    served: list[Served]
    recording: Path
    mitm_log: str

    def record_for(self, seq: int) -> dict[str, Any] | None:
        for rec in self.records:
            if rec["id"] == seq:
                return rec
        return None


def replay(
    exchanges: Sequence[Captured],
    out_dir: Path,
    *,
    mode: str,
    name: str = "capture",
    time_scale: float = 0.0,
    max_gap: float = 0.02,
    hold_s: float = 20.0,
) -> Replay:
    """Replay ``exchanges`` through the real mitmdump in body ``mode``; the records it wrote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rec_path = out_dir / f"{name}.{mode}.jsonl"
    rec_path.unlink(missing_ok=True)
    log_path = out_dir / f"{name}.{mode}.mitm.log"
    with ReplayUpstream(exchanges, time_scale=time_scale, max_gap=max_gap, hold_s=hold_s) as up:
        md = Mitmdump(up.url, rec_path, {"llmp_body": mode}, log_path=log_path)
        with md:
            results = asyncio.run(drive(md.url, exchanges, up, time_scale=time_scale))
            with contextlib.suppress(TimeoutError):
                wait_for_records(rec_path, len(exchanges), timeout=hold_s + 10)
            md.stop()
            log = md.log_text()
        served = list(up.served)
    return Replay(
        name, mode, list(exchanges), read_records(rec_path), results, served, rec_path, log
    )


def analyze_json(paths: Iterable[Path], *extra: str) -> dict[str, Any]:
    """``llmp analyze --json`` (``llmp.cli.main``, in-process) on the recordings."""
    from llmp.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["analyze", *map(str, paths), "--json", *extra])
    if code != 0:
        raise RuntimeError(f"llmp analyze exited {code}")
    report: dict[str, Any] = json.loads(buf.getvalue())
    return report


# -- the checks -------------------------------------------------------------------------------

#: Row fields that must agree between the full and the digest recording of the same traffic.
ROW_VERDICT = (
    "kind",
    "side_call_shape",
    "conversation",
    "turn",
    "linked_to",
    "new_conversation",
    "prefix_tokens",
    "break_cause",
    "compaction",
    "cause",
)


def _value(mv: Any) -> Any:
    return mv["value"] if isinstance(mv, dict) else None


def row_verdict(row: dict[str, Any]) -> dict[str, Any]:
    """What a row says about the traffic, without the clock's figures."""
    out = {k: row.get(k) for k in ROW_VERDICT}
    for k in ("reused_tokens", "evaluated_tokens", "prompt_tokens", "completion_tokens"):
        out[k] = _value(row["counts"].get(k))
    for k in ("lost_client", "lost_external"):
        loss = row.get(k)
        out[k] = None if loss is None else (loss["cause"], loss["tokens"])
    return out


def finding_verdict(f: dict[str, Any]) -> tuple[Any, ...]:
    ev = f.get("evidence") or {}
    advice = ev.get("advice") or {}
    return (
        f["kind"],
        tuple(f["rows"]),
        f.get("lost_tokens"),
        f.get("confidence"),
        advice.get("harness") if isinstance(advice, dict) else None,
    )


def check_replay(rep: Replay) -> list[str]:
    """What is wrong with one replay's records: lost exchanges, wrong errors, lost bytes."""
    problems: list[str] = []
    by_id = {rec["id"]: rec for rec in rep.records}
    if len(rep.records) != len(rep.exchanges):
        problems.append(f"{len(rep.records)} records for {len(rep.exchanges)} exchanges")
    for s in rep.served:
        if s.outcome not in ("complete", "client_gone"):
            problems.append(f"upstream: {s.method} {s.path} (seq {s.seq}) {s.outcome}")
    for ex in rep.exchanges:
        res = rep.client.get(ex.seq)
        if res is None or res.error:
            problems.append(f"#{ex.seq}: client {res.error if res else 'never sent'}")
            continue
        if res.status != ex.status:
            problems.append(f"#{ex.seq}: client got status {res.status}, captured {ex.status}")
        want = b"" if ex.method == "HEAD" else ex.body
        if res.body != want:
            problems.append(f"#{ex.seq}: client got {len(res.body)} body bytes of {len(want)}")
        rec = by_id.get(ex.seq)
        if rec is None:
            problems.append(f"#{ex.seq}: no record")
            continue
        req = rec["request"]
        if (req["method"], req["path"], req["body_bytes"]) != (
            ex.method,
            ex.path,
            len(ex.request_body),
        ):
            problems.append(f"#{ex.seq}: record {req['method']} {req['path']} is another request")
        resp = rec["response"]
        if (resp or {}).get("status") != ex.status:
            problems.append(f"#{ex.seq}: record status {(resp or {}).get('status')}")
        if ex.hung_up and not ex.stream_complete:
            want_error: str | None = "client_disconnected"
        else:
            want_error = None
        if rec["error"] != want_error:
            problems.append(f"#{ex.seq}: record error {rec['error']!r}, expected {want_error!r}")
        if resp is not None and ex.method != "HEAD" and resp["body_bytes"] != len(ex.body):
            problems.append(f"#{ex.seq}: record body_bytes {resp['body_bytes']} of {len(ex.body)}")
        events = sse_event_count(ex)
        if resp is not None and events is not None:
            if (resp["stream"], resp["chunks"], resp["bad_chunks"]) != ("sse", events, 0):
                problems.append(
                    f"#{ex.seq}: record stream {resp['stream']} chunks {resp['chunks']} "
                    f"bad {resp['bad_chunks']}, the capture has {events} events"
                )
            first_byte, first_event = rec["t_first_byte_ms"], rec["t_first_event_ms"]
            if events and (first_event is None or first_byte is None or first_event < first_byte):
                problems.append(f"#{ex.seq}: first byte {first_byte}, first event {first_event}")
    # the overlaps the capture shows happened in the replay too
    for j, later in overlaps(rep.exchanges).items():
        for k in later:
            a, b = rep.client.get(j), rep.client.get(k)
            if a is not None and b is not None and not b.t_sent < a.t_done:
                problems.append(f"#{k} was sent after #{j} ended; in the capture they overlapped")
    # the harness's connections, as the proxy kept them: one upstream connection per
    # client connection (while it stays open), never one shared by two
    upstream = {s.seq: s.upstream_conn for s in rep.served if s.seq is not None}
    by_client: dict[int, set[int]] = {}
    for ex in rep.exchanges:
        if ex.seq in upstream:
            by_client.setdefault(ex.conn, set()).add(upstream[ex.seq])
    reopened = {ex.conn for ex in rep.exchanges if ex.hung_up or ex.status is None}
    for conn, ups in by_client.items():
        if len(ups) > 1 and conn not in reopened:
            problems.append(f"client connection {conn} reached the upstream on {sorted(ups)}")
    shared = [u for ups in by_client.values() for u in ups]
    if len(shared) != len(set(shared)):
        problems.append("two client connections shared an upstream connection")
    if DUMMY_SECRET.split()[-1] in rep.recording.read_text("utf-8", "replace"):
        problems.append("the dummy credential was recorded")
    return problems


def check_digests(full: Replay, digest: Replay) -> list[str]:
    """Digest-mode records hash as the digests llmp computes from the full bodies."""
    from llmp.apis import api_for

    problems: list[str] = []
    fulls = {r["id"]: r for r in full.records}
    for rec in digest.records:
        frec = fulls.get(rec["id"])
        req = rec["request"]
        api = api_for(req["method"], req["path"])
        if frec is None or api is None:
            continue
        body = frec["request"]["body"]
        if isinstance(body, dict) and api.request_digest(body) != req["digest"]:
            problems.append(f"#{rec['id']}: the request digest differs from the full body's")
        fresp, resp = frec["response"], rec["response"]
        if (
            fresp is not None
            and resp is not None
            and 200 <= resp["status"] < 300
            and isinstance(fresp.get("body"), dict)
            and api.response_digest(fresp["body"]) != resp["digest"]
        ):
            problems.append(f"#{rec['id']}: the response digest differs from the full body's")
    return problems


def check_report(exchanges: Sequence[Captured], report: dict[str, Any]) -> list[str]:
    """The report against the capture: one row or one skip per exchange, the server's counters."""
    problems: list[str] = []
    cov = report["coverage"]
    if cov["records"] != len(exchanges):
        problems.append(f"coverage.records {cov['records']} for {len(exchanges)} exchanges")
    chat = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
    paths: dict[str, int] = {}
    for ex in exchanges:
        if not (ex.method == "POST" and ex.path_only.endswith(chat)):
            paths[ex.path_only] = paths.get(ex.path_only, 0) + 1
    if cov["paths"] != paths:
        problems.append(f"coverage.paths {cov['paths']}, expected {paths}")
    rows = {row["id"]: row for row in report["rows"]}
    for ex in exchanges:
        counters = server_counters(ex)
        row = rows.get(ex.seq)
        is_row = (
            ex.path_only.endswith(chat)
            and ex.method == "POST"
            and ex.status is not None
            and 200 <= ex.status < 300
            and not (ex.hung_up and not ex.stream_complete)
        )
        if is_row != (row is not None):
            problems.append(f"#{ex.seq}: {'no row' if is_row else 'a row'} for {ex.path}")
        if row is None or counters is None:
            continue
        got = (_value(row["counts"]["reused_tokens"]), _value(row["counts"]["evaluated_tokens"]))
        if got != (counters.reused, counters.evaluated):
            problems.append(
                f"#{ex.seq}: reused/evaluated {got}, server {counters.reused}/{counters.evaluated}"
            )
    problems += [f"R38: {p}" for p in adds_up.problems(report)]
    return problems


def compare_reports(full: dict[str, Any], digest: dict[str, Any]) -> list[str]:
    """The full and the digest recording of the same traffic give the same verdicts."""
    problems: list[str] = []
    frows = {r["id"]: row_verdict(r) for r in full["rows"]}
    drows = {r["id"]: row_verdict(r) for r in digest["rows"]}
    for rid in sorted(set(frows) | set(drows)):
        if frows.get(rid) != drows.get(rid):
            problems.append(f"row {rid}: full {frows.get(rid)} / digest {drows.get(rid)}")
    # A digest keeps no error body, so a refusal for context is known there from its
    # status and size alone (docs/analysis.md §10a): compare the cut rows only.
    ff = sorted(map(finding_verdict, _not_refusals(full["findings"])))
    df = sorted(map(finding_verdict, _not_refusals(digest["findings"])))
    if ff != df:
        problems.append(f"findings: full {ff} / digest {df}")
    return problems


def _not_refusals(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**f, "confidence": None} if f["kind"] == "context_overflow" else f
        for f in findings
        if f["kind"] != "context_overflow" or f["rows"]
    ]


# -- the command line ---------------------------------------------------------------------------


def summarize(exchanges: Sequence[Captured], report: dict[str, Any]) -> str:
    """One line per exchange: the server's counters and llmp's verdict."""
    rows = {row["id"]: row for row in report["rows"]}
    out = []
    for ex in exchanges:
        c = server_counters(ex)
        row = rows.get(ex.seq)
        srv = f"{c.reused:>5}/{c.evaluated:<5}" if c else " " * 11
        if row is None:
            verdict = "skipped"
        else:
            v = row_verdict(row)
            verdict = " ".join(
                f"{k}={v[k]}"
                for k in (
                    "kind",
                    "side_call_shape",
                    "conversation",
                    "turn",
                    "linked_to",
                    "new_conversation",
                    "break_cause",
                    "compaction",
                    "cause",
                    "lost_client",
                    "lost_external",
                )
                if v[k] not in (None, False)
            )
        out.append(f"  #{ex.seq:<3} c{ex.conn:<2} {ex.method:4} {ex.status} {srv} {verdict}")
    for f in report["findings"]:
        ev = dict(f.get("evidence") or {})
        advice = ev.pop("advice", None)
        ev.pop("changed", None)
        out.append(
            f"  finding {f['kind']} rows={f['rows']} lost={f.get('lost_tokens')} "
            f"conf={f['confidence']} ev={json.dumps(ev)[:240]}"
            + (f" advice={advice.get('harness')}" if isinstance(advice, dict) else "")
        )
    cov = report["coverage"]
    out.append(
        f"  coverage paths={cov['paths']} skipped={cov['skipped']} "
        f"context_exceeded={cov.get('context_exceeded')} by_cause={report['time']['by_cause']}"
    )
    return "\n".join(out)


def run_capture(path: Path, out_dir: Path, *, time_scale: float = 0.001) -> tuple[str, bool]:
    """Replay one capture in both modes, analyse, check; the summary and whether it passed."""
    name = capture_name(path)
    exchanges = load_capture(path)
    reps = {
        mode: replay(exchanges, out_dir, mode=mode, name=name, time_scale=time_scale)
        for mode in ("full", "digest")
    }
    reports = {mode: analyze_json([rep.recording]) for mode, rep in reps.items()}
    problems: list[str] = []
    for mode, rep in reps.items():
        problems += [f"[{mode}] {p}" for p in check_replay(rep)]
        problems += [f"[{mode}] {p}" for p in check_report(exchanges, reports[mode])]
    problems += [f"[digest] {p}" for p in check_digests(reps["full"], reps["digest"])]
    problems += [f"[full/digest] {p}" for p in compare_reports(reports["full"], reports["digest"])]
    (out_dir / f"{name}.full.report.json").write_text(json.dumps(reports["full"], indent=1))
    (out_dir / f"{name}.digest.report.json").write_text(json.dumps(reports["digest"], indent=1))
    lines = [f"{name}: {len(exchanges)} exchanges", summarize(exchanges, reports["full"])]
    lines += [f"  PROBLEM {p}" for p in problems] or ["  all checks pass"]
    return "\n".join(lines), not problems


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("captures", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="keep the recordings and reports here")
    p.add_argument("--time-scale", type=float, default=0.001)
    args = p.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="llmp-replay-") as tmp:
        out = args.out or Path(tmp)
        for path in args.captures:
            text, passed = run_capture(path, out, time_scale=args.time_scale)
            print(text, flush=True)
            ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
