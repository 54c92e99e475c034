"""Building records, and running the live view, in a child process.

Parsing, merging and hashing a 300 KB exchange holds the GIL for
milliseconds, and the live view's analysis takes tens of microseconds per
record; on the writer thread that time is taken from mitmproxy's event loop,
and chunks of other streams wait (measured in `bench/recorder.py`). A child
process does that work instead; the writer thread only pickles the capture,
waits for the line, writes it, and passes on what the child logged.

Protocol, over the child's stdin and stdout. A request is an 8-byte
little-endian length, then a pickle of a tuple whose first item names it:

- `("build", mode, Capture, sizes)`: the record's JSON line (newline
  included).  The response pieces come joined into one, and `sizes` (or
  None) cuts them back.  When a live view runs, the child also feeds it that
  line, read back as `llmp analyze` reads it, before it answers;
- `("live", LiveConfig, body, first_id)`: start the live view, or replace
  the running one; an empty answer, or the `LiveError` text;
- `("live_off",)`: stop the live view (its summary line and `LLMP_SUMMARY`).

Every answer is one frame (8-byte length, bytes).  The child writes its own
log lines (the live view's per-request lines, its errors) itself, to a copy
of the proxy's stdout or to `llmp_live_log` (`llmp.live.sink`): nothing
of the live view passes back through the proxy's process.

`GET /_llmp/summary` and `GET /_llmp/metrics` must not wait for records
being built, so they have a channel of their own: a socket pair, served by a
thread in the child.  The parent sends `ASK_SUMMARY`, or `ASK_METRICS` and
the writer's totals (`METRICS_TOTALS`: written, lost), and reads one frame:
the summary JSON or the Prometheus text, or nothing when no live view runs.

The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process
group, and the parent must drain first) and exits when its stdin closes, so
it never outlives the recorder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from llmp.live.contract import LiveConfig, LiveError
from llmp.recorder.capture import Capture

log = logging.getLogger("llmp")

FRAME = struct.Struct("<Q")
ASK_SUMMARY = b"?"
ASK_METRICS = b"m"
METRICS_TOTALS = struct.Struct("<QQ")
"""After `ASK_METRICS`: the records the writer wrote, and those it lost."""
BUILD = "build"
LIVE = "live"
LIVE_OFF = "live_off"


class BuilderGone(Exception):
    """The child process is not there to answer; build in-thread instead."""


def read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError
    return data


def recv_exact(sock: socket.socket, size: int) -> bytes:
    parts: list[bytes] = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


# -- the parent's end ---------------------------------------------------------


class ChildBuilder:
    """The parent's end: requests from the writer thread only; summaries from any thread."""

    def __init__(self, terminal: int = 1) -> None:
        """`terminal`: the file descriptor the child writes its lines to (the proxy's stdout)."""
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        ours, theirs = socket.socketpair()
        try:
            term = os.dup(terminal)
        except OSError:
            term = -1  # no terminal: the child's lines go nowhere (a log file still works)
        fds = (theirs.fileno(), term) if term >= 0 else (theirs.fileno(),)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmp.recorder.child", str(theirs.fileno()), str(term)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                pass_fds=fds,
            )
        except OSError as exc:
            ours.close()
            raise BuilderGone(str(exc)) from None
        finally:
            theirs.close()
            if term >= 0:
                os.close(term)
        self._summaries: socket.socket | None = ours
        self._summary_lock = threading.Lock()

    def _call(self, request: tuple[Any, ...]) -> bytes:
        """Send one request; return the answer."""
        data = pickle.dumps(request, protocol=5)
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(FRAME.pack(len(data)))
            stdin.write(data)
            stdin.flush()
            (size,) = FRAME.unpack(read_exact(stdout, FRAME.size))
            answer = read_exact(stdout, size)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise BuilderGone(f"record builder process ended ({exc or 'EOF'})") from None
        return answer

    def build(self, cap: Capture, mode: str) -> bytes:
        """Send the capture, return the line; `BuilderGone` if the child died."""
        sizes: list[int] | None = None
        if len(cap.pieces) > 1:
            # One bytes object pickles far faster than many small ones; the
            # sizes let the child cut it back into the pieces their times belong to.
            sizes = [len(p) for p in cap.pieces]
            cap = dataclasses.replace(cap, pieces=[b"".join(cap.pieces)])
        return self._call((BUILD, mode, cap, sizes))

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
        return self._ask(ASK_SUMMARY, timeout)

    def metrics(self, written: int, lost: int, timeout: float = 10.0) -> bytes | None:
        """The live view's Prometheus text with the writer's totals; None as for `summary`."""
        return self._ask(ASK_METRICS + METRICS_TOTALS.pack(written, lost), timeout)

    def _ask(self, question: bytes, timeout: float) -> bytes | None:
        """One question on the summary channel, one frame back (from any thread)."""
        if not self._summary_lock.acquire(timeout=timeout):
            return None
        try:
            sock = self._summaries
            if sock is None:
                return None
            try:
                sock.settimeout(timeout)
                sock.sendall(question)
                (size,) = FRAME.unpack(recv_exact(sock, FRAME.size))
                return recv_exact(sock, size) or None
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
