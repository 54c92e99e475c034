"""Fake model servers: llama.cpp ``llama-server`` and Ollama, for `llmp demo` and the tests.

They speak the wire formats of ``shared/spec/wire-formats.md`` (the llmp contract) byte for
byte, from a raw asyncio stream server on 127.0.0.1 in a daemon thread, so a
test controls every byte: chunked framing (one chunk per event), keep-alive,
and deliberate faults chosen per request with the ``x-fake`` header.

    with Upstream("llama") as up:
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="x")
        ...
        entry = up.log[-1]          # what upstream received and sent
        assert entry.body == bytes_the_client_got

``x-fake`` is a comma-separated list of modes, each ``name`` or ``name=value``
(see ``MODES``). ``Upstream(fake=...)`` sets modes for every request; the
header adds to them. An unknown mode is answered with a 400 so typos fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import json
import math
import random
import re
import select
import socket
import string
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, Self

Flavor = Literal["llama", "ollama"]

LLAMA_MODEL_FILE = "models/fake-q4.gguf"
LLAMA_FINGERPRINT = "b7000-fake0001"
OLLAMA_VERSION = "0.34.0"
REPLY_TEXT: dict[str, str] = {
    "llama": "Hello from fake llama",
    "ollama": "Hello from fake ollama",
}
REASONING_TEXT = "Let me think about it."
TOOL_ARGS: dict[str, Any] = {"city": "Tokyo"}
TOOL_ARG_FRAGMENTS = ['{"city":"Tok', 'yo"}']
MIDSTREAM_ERROR_MESSAGE = "fake upstream: error while generating"
PING = b":\n\n"
GARBAGE_SSE = b"data: not json\n\n"
GARBAGE_NDJSON = b"not json\n"
PROMPT_MS_PER_TOKEN = 0.5
PREDICTED_MS_PER_TOKEN = 18.89
OLLAMA_LOAD_NS = 2_345_678

#: Every ``x-fake`` mode, with what it does. Values are given as ``name=value``.
MODES: dict[str, str] = {
    "midstream_error": "after error_after events, send the server's error event/line; "
    "llama: clean chunked end, no [DONE]; ollama: {'error':…} line, no done line",
    "die_midstream": "after error_after events, close the socket (FIN) without the terminator",
    "reset_midstream": "like die_midstream but with a TCP RST (SO_LINGER 0)",
    "hang_midstream": "after error_after events, send nothing more until hang_s or close()",
    "error_after": "=N events (pings not counted) before a *_midstream fault; default 3",
    "die_before_head": "read the request, close the connection without a response",
    "hang_before_head": "read the request, send nothing until hang_s or close()",
    "hang_after_head": "send the response head, then nothing until hang_s or close()",
    "hang_s": "=SECONDS for the hang_* modes; default 120 (close() ends hangs early)",
    "context_error": "HTTP 400 exceed_context_size_error JSON (llama), even for streams",
    "status": "=N: answer HTTP N with the flavor's error JSON",
    "slow": "sleep 50 ms between writes",
    "delay_ms": "=N: sleep N ms between writes",
    "prefill_ms": "=N: sleep N ms after the head, before the first event",
    "garbage": "a non-JSON event (data: not json / a 'not json' line) as the 3rd data event",
    "short_content_length": "send the whole body at once with Content-Length 100 too big, close",
    "gzip": "gzip the body (sync-flushed per event) if the request accepts gzip",
    "big_response": "many small content deltas (events=N, default 2000)",
    "events": "=N content deltas in place of the reply text",
    "token_chars": "=N: pad each big_response/events delta to N characters",
    "split": "write every event as two chunks, cut in the middle byte",
    "no_ping": "no ':' keep-alive comments (llama)",
    "no_reasoning": "no reasoning/thinking deltas",
    "old_build": "older llama/ollama quirks: arguments:'' repeated in tool fragments, "
    "content null beside tool calls, no cached_tokens, no pings; ollama: no "
    "prompt_eval_cached_count and prompt_eval_count = evaluated part only",
    "cache_miss": "report no cached prompt tokens for this request",
    "close": "answer with Connection: close and close the connection afterwards",
    "no_content_type": "omit the Content-Type response header",
    "content_type": "=VALUE: use this Content-Type instead",
}

_FAULT_ENDINGS = {
    "midstream_error": "error",
    "die_midstream": "die",
    "reset_midstream": "reset",
    "hang_midstream": "hang",
}


def parse_fake(value: str) -> dict[str, str]:
    """``"slow,delay_ms=5"`` -> ``{"slow": "", "delay_ms": "5"}``."""
    modes: dict[str, str] = {}
    for part in value.split(","):
        name, _, arg = part.strip().partition("=")
        if name:
            modes[name.strip().lower()] = arg.strip()
    return modes


# --------------------------------------------------------------------- JSON


def llama_dumps(obj: Any) -> bytes:
    """nlohmann::json dump(): compact, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


_GO_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_GO_ESCAPE_RE = re.compile("[<>&\u2028\u2029]")


def go_dumps(obj: Any) -> bytes:
    """Go's json.Marshal: compact, raw UTF-8, HTML characters escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return _GO_ESCAPE_RE.sub(lambda m: _GO_ESCAPES[m.group(0)], text).encode()


# ------------------------------------------------------------------ prompt


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    else:
        text = ""
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += json.dumps(tool_calls, sort_keys=True, separators=(",", ":"))
    return text


def prompt_text(body: dict[str, Any]) -> str:
    """The fake chat template: a prefix-stable concatenation of the messages."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("<|tools|>" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n")
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role')}|>{message_text(m)}<|end|>\n")
    parts.append("<|assistant|>")
    return "".join(parts)


def count_tokens(text: str) -> int:
    """The fakes' tokenizer: one token per 4 characters, rounded up."""
    return math.ceil(len(text) / 4)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _token_pieces(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


def _token_id(piece: str) -> int:
    h = 0xCBF29CE484222325
    for byte in piece.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % 49152


def _alnum(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


def _go_time(t_ns: int | None = None) -> str:
    """Go's RFC3339Nano in UTC: trailing zeros of the fraction dropped."""
    t_ns = time.time_ns() if t_ns is None else t_ns
    secs, ns = divmod(t_ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    frac = f"{ns:09d}".rstrip("0")
    return f"{base}.{frac}Z" if frac else f"{base}Z"


# --------------------------------------------------------------------- log


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
        return _header(self.request_headers, name)

    def response_header(self, name: str) -> str | None:
        return _header(self.response_headers, name)

    def sse_data(self) -> list[str]:
        """The ``data:`` values of the (decoded) body's SSE events, comments skipped."""
        out: list[str] = []
        for block in self.decoded_body.decode("utf-8", "replace").split("\n\n"):
            lines = [ln[5:].removeprefix(" ") for ln in block.split("\n") if ln.startswith("data:")]
            if lines:
                out.append("\n".join(lines))
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


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


# ------------------------------------------------------------------- HTTP


class _CloseConnection(Exception):
    """Leave the keep-alive loop and close the connection."""


class _Responder:
    """Writes one response: head, then payload writes (chunked or plain)."""

    def __init__(
        self, writer: asyncio.StreamWriter, ex: Exchange, *, gzip_ok: bool, split: bool
    ) -> None:
        self.writer = writer
        self.ex = ex
        self.gz = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip_ok else None
        self.split = split
        self.chunked = False

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

    async def _write(self, payload: bytes) -> None:
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

    def _encode(self, plain: bytes, final: bool) -> bytes:
        if self.gz is None:
            return plain
        data = self.gz.compress(plain)
        return data + self.gz.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)

    async def event(self, plain: bytes) -> None:
        self.ex.plain_parts.append(plain)
        data = self._encode(plain, final=False)
        if self.split and len(data) > 1:
            mid = len(data) // 2
            await self._write(data[:mid])
            await self._write(data[mid:])
        else:
            await self._write(data)

    async def finish(self, outcome: str = "complete") -> None:
        if self.gz is not None:
            await self._write(self.gz.flush(zlib.Z_FINISH))
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
        data = self._encode(body, final=True)
        await self.head(status, headers, chunked=False, content_length=len(data) + overstate)
        self.ex.plain_parts.append(body)
        self.ex.t_end = time.monotonic()
        self.ex.outcome = outcome
        await self._write(data)


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, str, list[tuple[str, str]], bytes] | None:
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
    te = (_header(headers, "transfer-encoding") or "").lower()
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
        length = _header(headers, "content-length")
        if length:
            body = await reader.readexactly(int(length))
    return method, target, version, headers, body


# -------------------------------------------------------------- generation


@dataclass
class _ToolCall:
    id: str
    name: str
    fragments: list[str]


@dataclass
class _Gen:
    """What the fake model 'generates' for one chat request."""

    model: str
    reasoning: list[str]
    content: list[str]
    tool: _ToolCall | None
    finish: str
    prompt_tokens: int
    cache_n: int
    prompt_n: int
    predicted_n: int
    include_usage: bool
    created: int
    rng: random.Random
    reasoning_inline: bool = False

    @property
    def content_text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)


def _max_tokens(body: dict[str, Any]) -> int | None:
    options = body.get("options")
    candidates = [body.get("max_tokens"), body.get("max_completion_tokens"), body.get("n_predict")]
    if isinstance(options, dict):
        candidates.append(options.get("num_predict"))
    for c in candidates:
        if isinstance(c, int) and not isinstance(c, bool) and c >= 0:
            return c
    return None


def _timings(g: _Gen, predicted_n: int | None = None) -> dict[str, Any]:
    pn = g.predicted_n if predicted_n is None else predicted_n
    prompt_ms = round(g.prompt_n * PROMPT_MS_PER_TOKEN, 3)
    predicted_ms = round(pn * PREDICTED_MS_PER_TOKEN, 3)
    return {
        "cache_n": g.cache_n,
        "prompt_n": g.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / g.prompt_n if g.prompt_n else 0.0,
        "prompt_per_second": 1000.0 * g.prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": pn,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / pn if pn else 0.0,
        "predicted_per_second": 1000.0 * pn / predicted_ms if predicted_ms else 0.0,
    }


# ---------------------------------------------------------------- upstream


class Upstream:
    """A fake llama-server (``flavor="llama"``) or Ollama (``"ollama"``).

    Runs until ``close()`` (or the end of the ``with`` block). ``log`` is the
    list of ``Exchange`` in arrival order.
    """

    def __init__(
        self,
        flavor: Flavor = "llama",
        *,
        fake: str = "",
        n_ctx: int = 8192,
        model_file: str = LLAMA_MODEL_FILE,
        reply: str | None = None,
        reasoning: str = REASONING_TEXT,
    ) -> None:
        if flavor not in ("llama", "ollama"):
            raise ValueError(f"unknown flavor {flavor!r}")
        self.flavor: Flavor = flavor
        self.default_modes = parse_fake(fake)
        self.n_ctx = n_ctx
        self.model_file = model_file
        self.reply = REPLY_TEXT[flavor] if reply is None else reply
        self.reasoning = reasoning
        self.log: list[Exchange] = []
        #: the simulated prefix cache: the previous chat prompt (one slot)
        self.slot_prompt = ""
        self._index = 0
        self._conns = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._server: asyncio.Server | None = None
        self._hang_release: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"fake-{flavor}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake upstream did not start")
        if self._error is not None:
            raise RuntimeError("fake upstream failed to start") from self._error
        self.port: int = self._port
        self.url = f"http://127.0.0.1:{self.port}"

    # lifecycle ---------------------------------------------------------

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
        self._hang_release = asyncio.Event()
        self._server = await asyncio.start_server(self._handle_conn, "127.0.0.1", 0, limit=1 << 24)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        assert self._server is not None and self._hang_release is not None
        self._server.close()
        self._hang_release.set()
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

    # helpers for tests --------------------------------------------------

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

    def reset_cache(self) -> None:
        self.slot_prompt = ""

    # connection ----------------------------------------------------------

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
                req = await _read_request(reader)
                if req is None:
                    break
                method, target, version, headers, body = req
                modes = dict(self.default_modes)
                modes.update(parse_fake(_header(headers, "x-fake") or ""))
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
                except _CloseConnection:
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
                conn_hdr = (_header(headers, "connection") or "").lower()
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

    async def _hang(self, ex: Exchange) -> None:
        assert self._hang_release is not None
        ex.outcome = "hung"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._hang_release.wait(), float(ex.modes.get("hang_s") or 120))

    def _abort(self, writer: asyncio.StreamWriter, reset: bool) -> None:
        if reset:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.transport.close()

    async def _respond(self, ex: Exchange, writer: asyncio.StreamWriter) -> None:
        modes = ex.modes
        unknown = sorted(set(modes) - set(MODES))
        gzip_ok = "gzip" in modes and "gzip" in (ex.request_header("accept-encoding") or "")
        resp = _Responder(writer, ex, gzip_ok=gzip_ok, split="split" in modes)
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
            self._abort(writer, reset=False)
            raise _CloseConnection
        if "hang_before_head" in modes:
            await self._hang(ex)
            self._abort(writer, reset=False)
            raise _CloseConnection
        path = ex.path.split("?", 1)[0]
        if "status" in modes:
            await self._error_response(resp, path, int(modes["status"]), "fake upstream error")
            return
        if self.flavor == "llama":
            await self._llama(ex, resp, path, writer)
        else:
            await self._ollama(ex, resp, path, writer)

    # shared response pieces -------------------------------------------------

    def _headers(self, ex: Exchange, content_type: str) -> list[tuple[str, str]]:
        if self.flavor == "llama":
            hdrs = [("Server", "llama.cpp"), ("Access-Control-Allow-Origin", "*")]
        else:
            hdrs = [("Date", email.utils.formatdate(usegmt=True))]
        if "content_type" in ex.modes:
            content_type = ex.modes["content_type"]
        if "no_content_type" not in ex.modes and content_type:
            hdrs.append(("Content-Type", content_type))
        return hdrs

    def _dumps(self, obj: Any) -> bytes:
        return llama_dumps(obj) if self.flavor == "llama" else go_dumps(obj)

    async def _json(self, ex: Exchange, resp: _Responder, status: int, obj: Any) -> None:
        headers = self._headers(ex, "application/json; charset=utf-8")
        if "delay_ms" in ex.modes or "slow" in ex.modes or "prefill_ms" in ex.modes:
            await asyncio.sleep(self._delay(ex) + float(ex.modes.get("prefill_ms") or 0) / 1000)
        await self._body(ex, resp, status, headers, self._dumps(obj))

    async def _body(
        self,
        ex: Exchange,
        resp: _Responder,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> None:
        """A Content-Length body, with the body-level faults."""
        modes = ex.modes
        writer = resp.writer
        if "short_content_length" in modes:
            await resp.full(status, headers, body, overstate=100, outcome="short_body")
            self._abort(writer, reset=False)
            raise _CloseConnection
        if "hang_after_head" in modes:
            await resp.head(status, headers, chunked=False, content_length=len(body))
            await self._hang(ex)
            self._abort(writer, reset=False)
            raise _CloseConnection
        for fault in ("die_midstream", "reset_midstream", "hang_midstream"):
            if fault in modes:
                data = resp._encode(body, final=True)
                await resp.head(status, headers, chunked=False, content_length=len(data))
                ex.plain_parts.append(body)
                await resp._write(data[: len(data) // 2])
                if fault == "hang_midstream":
                    await self._hang(ex)
                else:
                    ex.outcome = "died" if fault == "die_midstream" else "reset"
                self._abort(writer, reset=fault == "reset_midstream")
                raise _CloseConnection
        await resp.full(status, headers, body)

    async def _error_response(self, resp: _Responder, path: str, status: int, msg: str) -> None:
        ex = resp.ex
        if self.flavor == "llama":
            etype = {
                400: "invalid_request_error",
                401: "authentication_error",
                404: "not_found_error",
                501: "not_supported_error",
                503: "unavailable_error",
            }.get(status, "server_error")
            if status == 503:
                msg = "Loading model"
            obj: Any = {"error": {"code": status, "message": msg, "type": etype}}
        elif path.startswith("/v1/"):
            etype = "invalid_request_error" if status < 500 else "api_error"
            obj = {"error": {"message": msg, "type": etype, "param": None, "code": None}}
        else:
            obj = {"error": msg}
        await self._json(ex, resp, status, obj)

    def _delay(self, ex: Exchange) -> float:
        if "delay_ms" in ex.modes:
            return float(ex.modes["delay_ms"] or 0) / 1000
        if "slow" in ex.modes:
            return 0.05
        return 0.0

    async def _stream(
        self,
        ex: Exchange,
        resp: _Responder,
        content_type: str,
        events: list[bytes],
        error_event: bytes,
    ) -> None:
        """Send a chunked stream, one event per chunk, applying the stream modes."""
        modes = ex.modes
        writer = resp.writer
        headers = self._headers(ex, content_type)
        if "garbage" in modes:
            garbage = GARBAGE_NDJSON if content_type == "application/x-ndjson" else GARBAGE_SSE
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
        for fault, how in _FAULT_ENDINGS.items():
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
            await self._body(ex, resp, 200, headers, b"".join(events))
            return
        await resp.head(200, headers, chunked=True)
        if "hang_after_head" in modes:
            await self._hang(ex)
            self._abort(writer, reset=False)
            raise _CloseConnection
        delay = self._delay(ex)
        if "prefill_ms" in modes:
            await asyncio.sleep(float(modes["prefill_ms"] or 0) / 1000)
        for i, ev in enumerate(events):
            if i and delay:
                await asyncio.sleep(delay)
            await resp.event(ev)
        if ending == "end":
            await resp.finish()
        elif ending == "error":
            await resp.finish("error_event")
        else:
            if ending == "hang":
                await self._hang(ex)
            else:
                ex.outcome = "died" if ending == "die" else "reset"
            ex.t_end = time.monotonic()
            self._abort(writer, reset=ending == "reset")
            raise _CloseConnection

    # chat ----------------------------------------------------------------

    def _parse_json_body(self, ex: Exchange) -> dict[str, Any] | None:
        try:
            body = json.loads(ex.request_body)
        except (ValueError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    def _context_error(self, ex: Exchange, body: dict[str, Any]) -> int | None:
        total = count_tokens(prompt_text(body))
        if "context_error" in ex.modes:
            return max(total, self.n_ctx + 808)
        return total if total > self.n_ctx else None

    def _plan(self, ex: Exchange, body: dict[str, Any], api: str) -> _Gen:
        modes = ex.modes
        rng = random.Random(f"{self.flavor}:{ex.index}")
        prompt = prompt_text(body)
        total = max(1, count_tokens(prompt))
        if "cache_miss" in modes:
            cache_n = 0
        else:
            cache_n = min(_common_prefix(self.slot_prompt, prompt) // 4, total - 1)
        self.slot_prompt = prompt
        prompt_n = total - cache_n

        reasoning = _token_pieces(self.reasoning)
        if "no_reasoning" in modes or (api == "ollama" and body.get("think") is False):
            reasoning = []
        n_events = modes.get("events") or ("2000" if "big_response" in modes else "")
        if n_events:
            width = int(modes.get("token_chars") or 0)
            content = [f" w{i}".ljust(width, "x") for i in range(int(n_events))]
        else:
            content = _token_pieces(self.reply)
        inline = False
        if api == "llama" and body.get("reasoning_format") == "none" and reasoning:
            content = ["<think>", *reasoning, "</think>", *content]
            reasoning = []
            inline = True

        tool: _ToolCall | None = None
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        last = messages[-1] if messages else {}
        wants_tool = last.get("role") == "user" and "weather" in message_text(last).lower()
        if tools and wants_tool and not n_events:
            names = [str((t.get("function") or {}).get("name") or "") for t in tools]
            name = next((n for n in names if "weather" in n), names[0] or "get_weather")
            if self.flavor == "llama":
                call_id = _alnum(rng, 32)
            else:
                call_id = "call_" + "".join(
                    rng.choice(string.ascii_lowercase + string.digits) for _ in range(8)
                )
            tool = _ToolCall(call_id, name, list(TOOL_ARG_FRAGMENTS))
            content = []
        finish = "tool_calls" if tool else "stop"
        predicted = len(reasoning) + len(content) + (len(tool.fragments) + 1 if tool else 0)
        cap = _max_tokens(body)
        if cap is not None and cap < predicted:
            keep_r = min(cap, len(reasoning))
            reasoning = reasoning[:keep_r]
            content = content[: cap - keep_r]
            tool = None
            finish = "length"
            predicted = cap
        stream_options = body.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        return _Gen(
            model=str(body.get("model") or ""),
            reasoning=reasoning,
            content=content,
            tool=tool,
            finish=finish,
            prompt_tokens=total,
            cache_n=cache_n,
            prompt_n=prompt_n,
            predicted_n=predicted,
            include_usage=include_usage,
            created=int(time.time()),
            rng=rng,
            reasoning_inline=inline,
        )

    # llama-server ------------------------------------------------------------

    async def _llama(
        self, ex: Exchange, resp: _Responder, path: str, writer: asyncio.StreamWriter
    ) -> None:
        method = ex.method
        if method == "POST" and path in ("/v1/chat/completions", "/chat/completions"):
            body = self._parse_json_body(ex)
            if body is None:
                await self._error_response(resp, path, 400, "Failed to parse the request body")
                return
            too_long = self._context_error(ex, body)
            if too_long is not None:
                message = (
                    f"request ({too_long} tokens) exceeds the available context size "
                    f"({self.n_ctx} tokens), try increasing it"
                )
                error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
                await self._json(ex, resp, 400, {"error": error})
                return
            g = self._plan(ex, body, "llama")
            if body.get("stream") is True:
                await self._stream(
                    ex,
                    resp,
                    "text/event-stream",
                    self._llama_events(ex, g, body),
                    b"data: "
                    + llama_dumps(
                        {
                            "error": {
                                "code": 500,
                                "message": MIDSTREAM_ERROR_MESSAGE,
                                "type": "server_error",
                            }
                        }
                    )
                    + b"\n\n",
                )
            else:
                await self._json(ex, resp, 200, self._llama_full(ex, g))
            return
        if method == "GET" and path == "/health":
            await self._json(ex, resp, 200, {"status": "ok"})
        elif method == "GET" and path == "/props":
            await self._json(ex, resp, 200, self._llama_props())
        elif method == "GET" and path in ("/v1/models", "/models"):
            await self._json(ex, resp, 200, self._llama_models())
        elif method == "GET" and path == "/slots":
            await self._json(ex, resp, 200, self._llama_slots())
        elif method == "POST" and path == "/tokenize":
            body = self._parse_json_body(ex) or {}
            content = body.get("content")
            text = content if isinstance(content, str) else ""
            pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
            tokens: list[Any]
            if body.get("with_pieces"):
                tokens = [{"id": _token_id(p), "piece": p} for p in pieces]
            else:
                tokens = [_token_id(p) for p in pieces]
            await self._json(ex, resp, 200, {"tokens": tokens})
        elif method == "POST" and path == "/apply-template":
            body = self._parse_json_body(ex) or {}
            await self._json(ex, resp, 200, {"prompt": prompt_text(body)})
        else:
            await self._error_response(resp, path, 404, "File Not Found")

    def _llama_chunk(
        self, g: _Gen, ex: Exchange, delta: dict[str, Any], finish: str | None = None
    ) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": g.created,
            "id": self._llama_id(ex),
            "model": self.model_file,
            "system_fingerprint": LLAMA_FINGERPRINT,
            "object": "chat.completion.chunk",
        }

    def _llama_id(self, ex: Exchange) -> str:
        return "chatcmpl-" + _alnum(random.Random(f"id:{self.flavor}:{ex.index}"), 32)

    def _llama_usage(self, g: _Gen, old: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "completion_tokens": g.predicted_n,
            "prompt_tokens": g.prompt_tokens,
            "total_tokens": g.prompt_tokens + g.predicted_n,
        }
        if not old:
            usage["prompt_tokens_details"] = {"cached_tokens": g.cache_n}
        return usage

    def _llama_events(self, ex: Exchange, g: _Gen, body: dict[str, Any]) -> list[bytes]:
        old = "old_build" in ex.modes
        pings = not old and "no_ping" not in ex.modes
        per_token = body.get("timings_per_token") is True
        events: list[bytes] = []
        produced = 0

        def emit(obj: dict[str, Any], timings: bool = False) -> None:
            if timings or per_token:
                obj["timings"] = _timings(g, None if timings else produced)
            events.append(b"data: " + llama_dumps(obj) + b"\n\n")

        role = {"role": "assistant", "content": None}
        if body.get("return_progress") is True:
            for processed in sorted({max(1, g.prompt_n // 2), g.prompt_n}):
                chunk = self._llama_chunk(g, ex, dict(role))
                chunk["prompt_progress"] = {
                    "total": g.prompt_tokens,
                    "cache": g.cache_n,
                    "processed": g.cache_n + processed,
                    "time_ms": round(processed * PROMPT_MS_PER_TOKEN, 3),
                }
                emit(chunk)
        emit(self._llama_chunk(g, ex, dict(role)))
        if pings:
            events.append(PING)
        for piece in g.reasoning:
            produced += 1
            emit(self._llama_chunk(g, ex, {"reasoning_content": piece}))
        for piece in g.content:
            produced += 1
            emit(self._llama_chunk(g, ex, {"content": piece}))
        if g.tool is not None:
            tc = g.tool
            fn: dict[str, Any] = {"name": tc.name}
            if old:
                fn["arguments"] = ""
            produced += 1
            header = {"index": 0, "id": tc.id, "type": "function", "function": fn}
            emit(self._llama_chunk(g, ex, {"tool_calls": [header]}))
            for frag in tc.fragments:
                produced += 1
                ffn: dict[str, Any] = (
                    {"name": tc.name, "arguments": frag} if old else {"arguments": frag}
                )
                emit(self._llama_chunk(g, ex, {"tool_calls": [{"index": 0, "function": ffn}]}))
        if pings:
            events.append(PING)
        emit(self._llama_chunk(g, ex, {}, g.finish), timings=not g.include_usage)
        if g.include_usage:
            usage_chunk = self._llama_chunk(g, ex, {})
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self._llama_usage(g, old)
            emit(usage_chunk, timings=True)
        events.append(b"data: [DONE]\n\n")
        return events

    def _llama_full(self, ex: Exchange, g: _Gen) -> dict[str, Any]:
        old = "old_build" in ex.modes
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["reasoning_content"] = g.reasoning_text
        if g.tool is not None:
            message["content"] = None if old else ""
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": g.tool.name, "arguments": "".join(g.tool.fragments)},
                    "id": g.tool.id,
                }
            ]
        return {
            "choices": [{"finish_reason": g.finish, "index": 0, "message": message}],
            "created": g.created,
            "id": self._llama_id(ex),
            "model": self.model_file,
            "system_fingerprint": LLAMA_FINGERPRINT,
            "object": "chat.completion",
            "usage": self._llama_usage(g, old),
            "timings": _timings(g),
        }

    def _llama_props(self) -> dict[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {"n_predict": -1}},
            "total_slots": 1,
            "model_path": self.model_file,
            "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>"
            "{% endfor %}<|assistant|>",
            "build_info": LLAMA_FINGERPRINT,
        }

    def _llama_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_file,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "llamacpp",
                    "meta": {"n_ctx_train": self.n_ctx, "n_vocab": 49152},
                }
            ],
        }

    def _llama_slots(self) -> list[dict[str, Any]]:
        n = count_tokens(self.slot_prompt)
        return [
            {
                "id": 0,
                "n_ctx": self.n_ctx,
                "is_processing": False,
                "id_task": self._index,
                "n_prompt_tokens": n,
                "n_prompt_tokens_processed": n,
                "n_prompt_tokens_cache": n,
            }
        ]

    # Ollama --------------------------------------------------------------

    async def _ollama(
        self, ex: Exchange, resp: _Responder, path: str, writer: asyncio.StreamWriter
    ) -> None:
        method = ex.method
        if method == "POST" and path in ("/api/chat", "/v1/chat/completions"):
            native = path == "/api/chat"
            body = self._parse_json_body(ex)
            if body is None:
                await self._error_response(resp, path, 400, "invalid JSON in request body")
                return
            if self._context_error(ex, body) is not None:
                await self._error_response(
                    resp, path, 400, "the input length exceeds the context length"
                )
                return
            g = self._plan(ex, body, "ollama" if native else "ollama_v1")
            if native:
                stream = body.get("stream", True) is not False
                if stream:
                    error_line = go_dumps({"error": MIDSTREAM_ERROR_MESSAGE}) + b"\n"
                    events = self._ollama_lines(ex, g)
                    await self._stream(ex, resp, "application/x-ndjson", events, error_line)
                else:
                    await self._json(ex, resp, 200, self._ollama_full(ex, g))
            elif body.get("stream") is True:
                err = {
                    "error": {
                        "message": MIDSTREAM_ERROR_MESSAGE,
                        "type": "api_error",
                        "param": None,
                        "code": None,
                    }
                }
                error_event = b"data: " + go_dumps(err) + b"\n\n"
                events = self._ollama_v1_events(ex, g)
                await self._stream(ex, resp, "text/event-stream", events, error_event)
            else:
                await self._json(ex, resp, 200, self._ollama_v1_full(ex, g))
            return
        if method in ("GET", "HEAD") and path == "/":
            await self._body(
                ex, resp, 200, self._headers(ex, "text/plain; charset=utf-8"), b"Ollama is running"
            )
        elif method == "GET" and path == "/api/version":
            await self._json(ex, resp, 200, {"version": OLLAMA_VERSION})
        elif method == "GET" and path == "/api/tags":
            await self._json(ex, resp, 200, self._ollama_tags())
        elif method == "GET" and path == "/v1/models":
            data = [
                {
                    "id": "qwen3:latest",
                    "object": "model",
                    "created": 1750000000,
                    "owned_by": "library",
                }
            ]
            await self._json(ex, resp, 200, {"object": "list", "data": data})
        else:
            await self._body(ex, resp, 404, self._headers(ex, "text/plain"), b"404 page not found")

    def _ollama_counters(self, ex: Exchange, g: _Gen) -> dict[str, Any]:
        old = "old_build" in ex.modes
        prompt_ns = round(g.prompt_n * PROMPT_MS_PER_TOKEN * 1_000_000)
        eval_ns = round(g.predicted_n * PREDICTED_MS_PER_TOKEN * 1_000_000)
        counters: dict[str, Any] = {
            "total_duration": OLLAMA_LOAD_NS + prompt_ns + eval_ns + 1_000_000,
            "load_duration": OLLAMA_LOAD_NS,
        }
        if old:
            counters["prompt_eval_count"] = g.prompt_n
        else:
            counters["prompt_eval_count"] = g.prompt_tokens
            counters["prompt_eval_cached_count"] = g.cache_n
        counters["prompt_eval_duration"] = prompt_ns
        counters["eval_count"] = g.predicted_n
        counters["eval_duration"] = eval_ns
        return {k: v for k, v in counters.items() if v or k == "prompt_eval_cached_count"}

    def _ollama_tool_calls(self, g: _Gen) -> list[dict[str, Any]]:
        assert g.tool is not None
        return [
            {
                "id": g.tool.id,
                "function": {"index": 0, "name": g.tool.name, "arguments": dict(TOOL_ARGS)},
            }
        ]

    def _ollama_lines(self, ex: Exchange, g: _Gen) -> list[bytes]:
        lines: list[bytes] = []

        def line(message: dict[str, Any]) -> None:
            obj = {"model": g.model, "created_at": _go_time(), "message": message, "done": False}
            lines.append(go_dumps(obj) + b"\n")

        for piece in g.reasoning:
            line({"role": "assistant", "content": "", "thinking": piece})
        for piece in g.content:
            line({"role": "assistant", "content": piece})
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        lines.append(go_dumps(self._ollama_done(ex, g, message)) + b"\n")
        return lines

    def _ollama_full(self, ex: Exchange, g: _Gen) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["thinking"] = g.reasoning_text
        return self._ollama_done(ex, g, message)

    def _ollama_done(self, ex: Exchange, g: _Gen, message: dict[str, Any]) -> dict[str, Any]:
        """The final object (`done: true`): the message, with any tool calls, and the counters."""
        if g.tool is not None:
            message["tool_calls"] = self._ollama_tool_calls(g)
        obj: dict[str, Any] = {
            "model": g.model,
            "created_at": _go_time(),
            "message": message,
            "done_reason": "length" if g.finish == "length" else "stop",
            "done": True,
        }
        obj.update(self._ollama_counters(ex, g))
        return obj

    def _ollama_v1_id(self, ex: Exchange) -> str:
        return f"chatcmpl-{random.Random(f'v1:{ex.index}').randint(1, 999)}"

    def _ollama_v1_chunk(
        self, ex: Exchange, g: _Gen, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "id": self._ollama_v1_id(ex),
            "object": "chat.completion.chunk",
            "created": g.created,
            "model": g.model,
            "system_fingerprint": "fp_ollama",
            "choices": choices,
        }

    def _ollama_v1_usage(self, g: _Gen) -> dict[str, Any]:
        return {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.predicted_n,
            "total_tokens": g.prompt_tokens + g.predicted_n,
        }

    def _ollama_v1_tool_calls(self, g: _Gen) -> list[dict[str, Any]]:
        assert g.tool is not None
        return [
            {
                "id": g.tool.id,
                "index": 0,
                "type": "function",
                "function": {"name": g.tool.name, "arguments": "".join(g.tool.fragments)},
            }
        ]

    def _ollama_v1_events(self, ex: Exchange, g: _Gen) -> list[bytes]:
        events: list[bytes] = []

        def emit(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            events.append(b"data: " + go_dumps(self._ollama_v1_chunk(ex, g, [choice])) + b"\n\n")

        for piece in g.reasoning:
            emit({"role": "assistant", "content": "", "reasoning": piece})
        for piece in g.content:
            emit({"role": "assistant", "content": piece})
        if g.tool is not None:
            emit({"role": "assistant", "content": "", "tool_calls": self._ollama_v1_tool_calls(g)})
        emit({"role": "assistant", "content": ""}, g.finish)
        if g.include_usage:
            chunk = self._ollama_v1_chunk(ex, g, [])
            chunk["usage"] = self._ollama_v1_usage(g)
            events.append(b"data: " + go_dumps(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    def _ollama_v1_full(self, ex: Exchange, g: _Gen) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["reasoning"] = g.reasoning_text
        if g.tool is not None:
            message["tool_calls"] = self._ollama_v1_tool_calls(g)
        return {
            "id": self._ollama_v1_id(ex),
            "object": "chat.completion",
            "created": g.created,
            "model": g.model,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "message": message, "finish_reason": g.finish}],
            "usage": self._ollama_v1_usage(g),
        }

    def _ollama_tags(self) -> dict[str, Any]:
        return {
            "models": [
                {
                    "name": "qwen3:latest",
                    "model": "qwen3:latest",
                    "modified_at": "2026-08-01T10:00:00.123456789Z",
                    "size": 5_200_000_000,
                    "digest": "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41",
                    "details": {
                        "parent_model": "",
                        "format": "gguf",
                        "family": "qwen3",
                        "families": ["qwen3"],
                        "parameter_size": "8.2B",
                        "quantization_level": "Q4_K_M",
                    },
                }
            ]
        }


# --------------------------------------------------------- dead addresses


class ClosedPort:
    """A 127.0.0.1 port with nothing listening: connects are refused.

    The port stays bound (not listening) until ``close()``, so no other
    socket can take it meanwhile.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.host = "127.0.0.1"
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlackHole:
    """A 127.0.0.1 address where a TCP connect never completes.

    A listening socket with backlog 0 that never accepts: its accept queue
    takes one connection, which we make ourselves. After that Linux drops
    every SYN to it (``LISTENOVERFLOWS``), so a connect stays in SYN_SENT and
    retries for about two minutes. ``close()`` releases it (connects then
    fail with "refused").
    """

    def __init__(self, probe_timeout: float = 0.2) -> None:
        self.host = "127.0.0.1"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._fillers: list[socket.socket] = []
        for _ in range(16):
            if not self._connect_one(probe_timeout):
                return
        self.close()
        raise RuntimeError("could not fill the accept queue of the black hole listener")

    def _connect_one(self, timeout: float) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((self.host, self.port))
        _, writable, _ = select.select([], [s], [], timeout)
        if writable and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            self._fillers.append(s)
            return True
        s.close()
        return False

    def close(self) -> None:
        for s in self._fillers:
            s.close()
        self._fillers.clear()
        self._listener.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
