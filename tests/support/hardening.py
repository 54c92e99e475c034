"""Helpers shared by the hardening tests (load, faults, fuzz, privacy).

Everything here talks to 127.0.0.1 only: the real ``mitmdump`` (see ``mitm.py``),
the fake upstreams (``llmp.demo.fakes``), raw sockets for clients that
misbehave on purpose, and a raw upstream that writes exactly the bytes a test
gives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import statistics
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import pytest

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


# ------------------------------------------------------------------ the file


def whole_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a recording, asserting that each one is a whole JSON object.

    The file must be empty or end with a newline, and hold no blank lines:
    llmp writes one whole line per record and nothing else.
    """
    data = path.read_bytes() if path.exists() else b""
    if not data:
        return []
    assert data.endswith(b"\n"), f"{path}: last line is partial: {data[-200:]!r}"
    records: list[dict[str, Any]] = []
    for n, line in enumerate(data[:-1].split(b"\n"), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"{path}:{n}: not a whole JSON line: {line[:300]!r}") from None
        assert isinstance(obj, dict), f"{path}:{n}: not an object: {line[:300]!r}"
        assert obj.get("v") == 1 and isinstance(obj.get("id"), int), f"{path}:{n}: {line[:300]!r}"
        records.append(obj)
    return records


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def records_now(path: Path) -> list[dict[str, Any]]:
    """The whole lines written so far (a line being written is skipped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                out.append(obj)
    return out


def wait_record(
    path: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 15.0, n: int = 1
) -> list[dict[str, Any]]:
    """Wait until ``n`` records match ``pred``; return the matching records."""

    def found() -> list[dict[str, Any]] | None:
        hits = [r for r in records_now(path) if pred(r)]
        return hits if len(hits) >= n else None

    result: list[dict[str, Any]] = wait_for(found, timeout, f"{n} matching record(s) in {path}")
    return result


def tagged(tag: str) -> Callable[[dict[str, Any]], bool]:
    """A predicate: the record's request path carries ``?t=<tag>``."""
    suffix = f"t={tag}"

    def pred(rec: dict[str, Any]) -> bool:
        path = rec.get("request", {}).get("path", "")
        return isinstance(path, str) and path.endswith(suffix)

    return pred


# -------------------------------------------------------------------- memory


def rss_kib(pid: int) -> int:
    """Resident set size of a process in KiB (``VmRSS`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds on a thread."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic() - t0, rss_kib(self.pid)))
            self._stop.wait(self.interval)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def thirds(self) -> tuple[list[int], list[int], list[int]]:
        values = [kb for _, kb in self.samples]
        n = len(values) // 3
        return values[:n], values[n : len(values) - n], values[len(values) - n :]

    def summary(self) -> dict[str, float]:
        """Medians of the first and last third, the peak, and the growth between them."""
        first, _, last = self.thirds()
        values = [kb for _, kb in self.samples]
        m1 = statistics.median(first)
        m3 = statistics.median(last)
        return {
            "samples": len(values),
            "start_mib": values[0] / 1024,
            "first_third_median_mib": m1 / 1024,
            "last_third_median_mib": m3 / 1024,
            "peak_mib": max(values) / 1024,
            "growth_mib": (m3 - m1) / 1024,
            "growth_pct": 100.0 * (m3 - m1) / m1,
        }


# ------------------------------------------------------------ client replies


@dataclass
class Reply:
    """What a client assembled from one chat response (or what a record holds)."""

    content: str = ""
    reasoning: str = ""
    tools: list[tuple[Any, Any, str]] = field(default_factory=list)  # (id, name, arguments)
    rid: str | None = None  # llama/OpenAI chunk id; None for Ollama /api/chat
    finish: str | None = None
    counters: dict[str, Any] = field(default_factory=dict)


def sse_events(body: bytes) -> list[str]:
    """Data of the SSE events in a (decoded, complete) body; comments and [DONE] skipped."""
    out: list[str] = []
    text = body.decode("utf-8", "replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        lines = [ln[5:].removeprefix(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if lines and "\n".join(lines) != "[DONE]":
            out.append("\n".join(lines))
    return out


def reply_from_sse(body: bytes) -> Reply:
    """Assemble an OpenAI-style stream the way a client does."""
    reply = Reply()
    tools: dict[int, list[Any]] = {}
    for data in sse_events(body):
        obj = json.loads(data)
        reply.rid = obj.get("id", reply.rid)
        if obj.get("usage"):
            reply.counters["usage"] = obj["usage"]
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            reply.content += delta.get("content") or ""
            reply.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                slot = tools.setdefault(tc.get("index", 0), [None, None, ""])
                fn = tc.get("function") or {}
                slot[0] = slot[0] or tc.get("id")
                slot[1] = slot[1] or fn.get("name")
                slot[2] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                reply.finish = choice["finish_reason"]
    reply.tools = [(a, b, c) for _, (a, b, c) in sorted(tools.items())]
    return reply


def reply_from_ndjson(body: bytes) -> Reply:
    """Assemble an Ollama /api/chat stream the way a client does."""
    reply = Reply()
    for line in body.split(b"\n"):
        if not line.strip():
            continue
        obj = json.loads(line)
        msg = obj.get("message") or {}
        reply.content += msg.get("content") or ""
        reply.reasoning += msg.get("thinking") or ""
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            args = fn.get("arguments")
            reply.tools.append((tc.get("id"), fn.get("name"), json.dumps(args, sort_keys=True)))
        if obj.get("done"):
            reply.finish = obj.get("done_reason")
            reply.counters = {
                k: obj.get(k) for k in ("prompt_eval_count", "eval_count", "eval_duration")
            }
    return reply


def reply_from_record(rec: dict[str, Any]) -> Reply:
    """The merged response body of a full-mode record, as a ``Reply``."""
    resp = rec["response"]
    body = resp["body"]
    assert isinstance(body, dict), f"record {rec['id']} has no merged body: {resp}"
    reply = Reply()
    if resp["stream"] == "ndjson":
        msg = body.get("message") or {}
        reply.content = msg.get("content") or ""
        reply.reasoning = msg.get("thinking") or ""
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            reply.tools.append(
                (tc.get("id"), fn.get("name"), json.dumps(fn.get("arguments"), sort_keys=True))
            )
        if body.get("done"):
            reply.finish = body.get("done_reason")
            reply.counters = {
                k: body.get(k) for k in ("prompt_eval_count", "eval_count", "eval_duration")
            }
        return reply
    choice = body["choices"][0]
    msg = choice["message"]
    reply.rid = body.get("id")
    reply.content = msg.get("content") or ""
    reply.reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    reply.tools = [
        (tc.get("id"), tc["function"].get("name"), tc["function"].get("arguments") or "")
        for tc in msg.get("tool_calls") or []
    ]
    reply.finish = choice.get("finish_reason")
    if body.get("usage"):
        reply.counters["usage"] = body["usage"]
    return reply


def gunzip(data: bytes) -> bytes:
    """Decode a (possibly truncated) gzip stream as far as it goes."""
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        return dec.decompress(data) + dec.flush()
    except zlib.error:
        return b""


# --------------------------------------------------------------- raw sockets


def raw_request(
    method: str,
    target: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> bytes:
    """An HTTP/1.1 request, byte for byte (``target`` may be absolute-form for a proxy)."""
    hdrs = {"Host": host, "Content-Length": str(len(body))}
    hdrs.update(headers or {})
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode("latin-1") + b"\r\n" + body


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def abort(sock: socket.socket, reset: bool) -> None:
    """Close a socket, with a TCP RST when ``reset`` (SO_LINGER 0)."""
    if reset:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def recv_all(sock: socket.socket, limit: int | None = None) -> bytes:
    """Read until EOF (or ``limit`` bytes); a reset counts as EOF."""
    parts: list[bytes] = []
    got = 0
    while limit is None or got < limit:
        try:
            data = sock.recv(65536 if limit is None else min(65536, limit - got))
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-cased) and de-chunked body of a raw HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        return status, headers, rest
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return status, headers, bytes(body)


# ------------------------------------------------------------- raw upstream

#: A handler gets (method, target, request body) and returns the response writes and
#: how to end: "keep" (keep-alive), "close" (FIN) or "reset" (RST).
Handler = Callable[[str, str, bytes], tuple[list[bytes], str]]


class RawUpstream:
    """A 127.0.0.1 HTTP/1.1 server that writes exactly the bytes a handler returns."""

    def __init__(
        self, handler: Handler, delay: float = 0.0, tls: ssl.SSLContext | None = None
    ) -> None:
        self.handler = handler
        self.delay = delay
        self.tls = tls  # a server context: each connection speaks HTTPS
        self.requests: list[tuple[str, str, bytes]] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._closed = False
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="raw-upstream", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                self.requests.append((method, target, body))
                writes, ending = self.handler(method, target, body)
                for i, piece in enumerate(writes):
                    if i and self.delay:
                        time.sleep(self.delay)
                    conn.sendall(piece)
                if ending != "keep":
                    abort(conn, reset=ending == "reset")
                    return
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunked(pieces: list[bytes], end: bool = True) -> list[bytes]:
    """Each piece as one HTTP chunk, then the last-chunk when ``end``."""
    out = [b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if p]
    if end:
        out.append(b"0\r\n\r\n")
    return out


def response_head(
    status: int = 200,
    content_type: str | None = "text/event-stream",
    *,
    length: int | None = None,
    extra: dict[str, str] | None = None,
) -> bytes:
    """A response head: chunked unless ``length`` is given."""
    hdrs: dict[str, str] = {}
    if content_type:
        hdrs["Content-Type"] = content_type
    if length is None:
        hdrs["Transfer-Encoding"] = "chunked"
    else:
        hdrs["Content-Length"] = str(length)
    hdrs.update(extra or {})
    head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode("latin-1") + b"\r\n"


# ---------------------------------------------------------------- filesystem


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "256k", readonly: bool = False) -> Iterator[Path]:
    """A small tmpfs at ``path`` (needs root); skips the test when it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
                time.sleep(0.1)
            else:
                break


def load_seconds(default: float) -> float:
    """``LLMP_LOAD_SECONDS`` when set (a longer soak), else ``default``."""
    raw = os.environ.get("LLMP_LOAD_SECONDS", "").strip()
    return float(raw) if raw else default
