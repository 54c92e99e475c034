"""Building records in a child process, so the proxy's interpreter keeps its GIL.

Parsing, merging and hashing a 300 KB exchange holds the GIL for milliseconds;
on the writer thread that time is taken from mitmproxy's event loop, and
chunks of other streams wait (measured in `bench/recorder.py`). A child
process does that work instead; the writer thread only pickles the capture,
waits for the line, and writes it.

Protocol, over the child's stdin and stdout: an 8-byte little-endian length,
then a pickle of `(mode, Capture)`; the answer is an 8-byte length and the
record's JSON line (newline included). The child ignores SIGINT and SIGTERM
(a Ctrl-C reaches the whole process group, and the parent must drain first)
and exits when its stdin closes, so it never outlives the recorder.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import IO

from llmp import canonical
from llmp.capture import Capture
from llmp.record import build_record

_LEN = struct.Struct("<Q")


class BuilderGone(Exception):
    """The child process is not there to answer; build in-thread instead."""


def build_line(cap: Capture, mode: str) -> bytes:
    """The record's JSON line; without bodies when building the real one failed."""
    try:
        return canonical.record_dumps(build_record(cap, mode)) + b"\n"
    except Exception:
        from llmp.writer import fallback_record

        logging.getLogger("llmp").exception(
            "llmp: could not build record %s; writing it without bodies", cap.id
        )

        return canonical.record_dumps(fallback_record(cap, mode)) + b"\n"


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError
    return data


class ChildBuilder:
    """The parent's end: one request at a time, from the writer thread only."""

    def __init__(self) -> None:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmp.builder"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            raise BuilderGone(str(exc)) from None

    def build(self, cap: Capture, mode: str) -> bytes:
        """Send the capture, return the line; `BuilderGone` if the child died."""
        if len(cap.pieces) > 1:
            cap.pieces = [b"".join(cap.pieces)]
        data = pickle.dumps((mode, cap), protocol=5)
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(_LEN.pack(len(data)))
            stdin.write(data)
            stdin.flush()
            (size,) = _LEN.unpack(_read_exact(stdout, _LEN.size))
            return _read_exact(stdout, size)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise BuilderGone(f"record builder process ended ({exc or 'EOF'})") from None

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


def main() -> None:
    """The child: answer requests until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(5)  # the proxy's own process comes first
    except OSError:
        pass
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            (size,) = _LEN.unpack(_read_exact(fin, _LEN.size))
            mode, cap = pickle.loads(_read_exact(fin, size))
        except EOFError:
            return
        line = build_line(cap, mode)
        fout.write(_LEN.pack(len(line)))
        fout.write(line)
        fout.flush()


if __name__ == "__main__":
    main()
