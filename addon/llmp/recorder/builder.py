"""Building records, and running the live view, in a child process.

Parsing, merging and hashing a 300 KB exchange holds the GIL for
milliseconds, and the live view's analysis takes tens of microseconds per
record; on the writer thread that time is taken from mitmproxy's event loop,
and chunks of other streams wait (measured in `bench/recorder.py`). A child
process does that work instead; the writer thread only pickles the capture,
waits for the line, writes it, and passes on what the child logged.

Protocol, over the child's stdin and stdout. A request is an 8-byte
little-endian length, then a pickle of a tuple whose first item names it:

- `("build", mode, Capture)`: the record's JSON line (newline included). When
  a live view runs, the child also feeds it that line, read back as
  `llmp analyze` reads it, before it answers;
- `("live", LiveConfig, body, first_id)`: start the live view, or replace
  the running one; an empty answer, or the `LiveError` text;
- `("live_off",)`: stop the live view (its summary line and `LLMP_SUMMARY`).

Every answer is two frames (8-byte length, bytes): the data, then the log
records the child made meanwhile as JSON `[[levelno, text, is_live_line],
...]` (empty when there were none), which the parent logs as its own.

`GET /_llmp/summary` must not wait for records being built, so summaries
have a channel of their own: a socket pair, served by a thread in the child.
The parent sends one byte and reads one frame: the summary JSON, or nothing
when no live view runs.

The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process
group, and the parent must drain first) and exits when its stdin closes, so
it never outlives the recorder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson

from llmp.format import canonical
from llmp.format.lines import parse_line
from llmp.live.view import LINE_ATTR, LiveConfig, LiveError, LiveView
from llmp.recorder.capture import Capture
from llmp.recorder.record import build_record

log = logging.getLogger("llmp")

_LEN = struct.Struct("<Q")
BUILD = "build"
LIVE = "live"
LIVE_OFF = "live_off"
_LIVE_LINE = {LINE_ATTR: True}
_CHILD = "llmp.recorder.builder (child)"


class BuilderGone(Exception):
    """The child process is not there to answer; build in-thread instead."""


def fallback_record(cap: Capture, mode: str) -> dict[str, Any]:
    """A record without bodies, for when building the real one failed: never lose an exchange."""
    stripped = dataclasses.replace(cap, request_body=None, pieces=[], stored_bytes=0)
    return build_record(stripped, mode)


def build_line(cap: Capture, mode: str) -> bytes:
    """The record's JSON line; without bodies when building the real one failed."""
    try:
        return canonical.record_dumps(build_record(cap, mode)) + b"\n"
    except Exception:
        log.exception("llmp: could not build record %s; writing it without bodies", cap.id)
        return canonical.record_dumps(fallback_record(cap, mode)) + b"\n"


def feed(view: LiveView, line: bytes, mode: str) -> None:
    """Give the live view one written record; a failure is logged, never raised."""
    try:
        rec = parse_line(line)
        if rec is not None:
            view.on_record(rec)
    except Exception:
        log.exception("llmp: live view failed on a record; recording goes on")


def replace_view(
    old: LiveView | None,
    cfg: LiveConfig | None,
    *,
    body: str,
    first_id: int,
    say: Callable[[int, str], None] | None = None,
) -> LiveView | None:
    """The live view `cfg` asks for (None: none), in place of `old`, which is closed.

    The old one closes first: the two may share an event file, which only one
    can hold.  So a `LiveError` leaves no live view running.
    """
    if old is not None:
        old.close()
    return None if cfg is None else LiveView(cfg, body=body, first_id=first_id, say=say)


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError
    return data


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts: list[bytes] = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def relay(payload: bytes) -> None:
    """Log, in this process, the log records the child sent."""
    if not payload:
        return
    try:
        entries = orjson.loads(payload)
    except orjson.JSONDecodeError:
        log.error("llmp: the record builder sent logs that are not JSON; left out")
        return
    for level, text, is_line in entries:
        if log.isEnabledFor(level):
            # Made directly: the caller's frame (findCaller) is not this process's anyway.
            extra = _LIVE_LINE if is_line else None
            log.handle(log.makeRecord(log.name, level, _CHILD, 0, text, (), None, extra=extra))


# -- the parent's end ---------------------------------------------------------


class ChildBuilder:
    """The parent's end: requests from the writer thread only; summaries from any thread."""

    def __init__(self) -> None:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmp.recorder.builder", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            raise BuilderGone(str(exc)) from None
        finally:
            theirs.close()
        self._summaries: socket.socket | None = ours
        self._summary_lock = threading.Lock()
        self.on_logs: Callable[[bytes], None] = relay
        """Gets what the child logged with each answer; by default it is logged here at once."""

    def _call(self, request: tuple[Any, ...]) -> bytes:
        """Send one request; log what the child logged; return the data."""
        data = pickle.dumps(request, protocol=5)
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(_LEN.pack(len(data)))
            stdin.write(data)
            stdin.flush()
            (size,) = _LEN.unpack(_read_exact(stdout, _LEN.size))
            answer = _read_exact(stdout, size)
            (size,) = _LEN.unpack(_read_exact(stdout, _LEN.size))
            logs = _read_exact(stdout, size)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise BuilderGone(f"record builder process ended ({exc or 'EOF'})") from None
        if logs:
            self.on_logs(logs)
        return answer

    def build(self, cap: Capture, mode: str) -> bytes:
        """Send the capture, return the line; `BuilderGone` if the child died."""
        if len(cap.pieces) > 1:
            cap.pieces = [b"".join(cap.pieces)]
        return self._call((BUILD, mode, cap))

    def live(self, cfg: LiveConfig | None, body: str, first_id: int) -> None:
        """Start, replace (`cfg`) or stop (None) the child's live view; `LiveError` if it can't."""
        if cfg is None:
            self._call((LIVE_OFF,))
            return
        error = self._call((LIVE, cfg, body, first_id))
        if error:
            raise LiveError(error.decode())

    def summary(self, timeout: float = 10.0) -> bytes | None:
        """The live view's summary JSON; None when none runs or the child can't answer."""
        if not self._summary_lock.acquire(timeout=timeout):
            return None
        try:
            sock = self._summaries
            if sock is None:
                return None
            try:
                sock.settimeout(timeout)
                sock.sendall(b"?")
                (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
                return _recv_exact(sock, size) or None
            except (OSError, EOFError) as exc:
                # A late answer would be read as the next one's: this channel is done.
                log.warning("llmp: the live view's summary channel failed (%s)", exc or "EOF")
                sock.close()
                self._summaries = None
                return None
        finally:
            self._summary_lock.release()

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin and wait; kill it if it does not go."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._summary_lock:
            if self._summaries is not None:
                self._summaries.close()
                self._summaries = None


# -- the child ----------------------------------------------------------------


class _Held(logging.Handler):
    """In the child: the llmp logger's records, held until the next answer carries them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.entries: list[tuple[int, str, bool]] = []
        self._fmt = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self._fmt.formatException(record.exc_info)
        self.entries.append((record.levelno, text, bool(getattr(record, LINE_ATTR, False))))

    def say(self, level: int, line: str) -> None:
        """The live view's per-request line, without a trip through `logging`."""
        with self.lock:  # type: ignore[union-attr]
            self.entries.append((level, line, True))

    def take(self) -> bytes:
        if not self.entries:
            return b""
        with self.lock:  # type: ignore[union-attr]
            entries, self.entries = self.entries, []
        return orjson.dumps(entries)


class _Child:
    """The child's state: the live view, if one runs."""

    def __init__(self, held: _Held) -> None:
        self.view: LiveView | None = None
        self.held = held

    def handle(self, request: tuple[Any, ...]) -> bytes:
        op = request[0]
        if op == BUILD:
            _, mode, cap = request
            line = build_line(cap, mode)
            view = self.view
            if view is not None:
                view.body = mode
                feed(view, line, mode)
            return line
        if op == LIVE:
            _, cfg, body, first_id = request
            old, self.view = self.view, None
            try:
                self.view = replace_view(old, cfg, body=body, first_id=first_id, say=self.held.say)
            except LiveError as exc:
                return str(exc).encode()
            return b""
        if op == LIVE_OFF:
            old, self.view = self.view, None
            replace_view(old, None, body="", first_id=0)
            return b""
        raise ValueError(f"unknown request {op!r}")

    def serve_summaries(self, sock: socket.socket) -> None:
        """The summary channel: a byte in, the summary out, until the parent closes it."""
        with sock:
            while True:
                try:
                    if not sock.recv(1):
                        return
                    view = self.view
                    data = view.summary_json() if view is not None else b""
                    sock.sendall(_LEN.pack(len(data)) + data)
                except OSError:
                    return


def main(argv: list[str]) -> None:
    """The child: answer requests until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(5)  # the proxy's own process comes first
    except OSError:
        pass
    held = _Held()
    log.addHandler(held)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    child = _Child(held)
    if argv:
        sock = socket.socket(fileno=int(argv[0]))
        threading.Thread(target=child.serve_summaries, args=(sock,), daemon=True).start()
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            (size,) = _LEN.unpack(_read_exact(fin, _LEN.size))
            request = pickle.loads(_read_exact(fin, size))
        except EOFError:
            break
        try:
            answer = child.handle(request)
        except Exception:
            log.exception("llmp: record builder failed on a request")
            answer = b""
        logs = held.take()
        fout.write(_LEN.pack(len(answer)))
        fout.write(answer)
        fout.write(_LEN.pack(len(logs)))
        fout.write(logs)
        fout.flush()
    if child.view is not None:  # the parent stops the view first; this is a safety net
        child.view.close()


if __name__ == "__main__":
    main(sys.argv[1:])
