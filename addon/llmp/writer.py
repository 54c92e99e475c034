"""The recording file and the thread that fills it (R14).

`RecordingFile` owns the file: created 0600, locked exclusively so that two
recorders never share it, one `write` per whole line.  `RecordWriter` takes
finished captures from the proxy's event loop and does the expensive work
(building, hashing, serialising, writing) on its own thread, so the client's
bytes never wait for it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import orjson

from llmp import canonical
from llmp.builder import BuilderGone, ChildBuilder, build_line
from llmp.capture import Capture
from llmp.record import build_record

log = logging.getLogger("llmp")


RECORD_START = b'{"v":1,"id":'


def _last_line_start(fh: Any, size: int, block: int = 1 << 16) -> int:
    """Offset just after the last newline of a file (0 when it has none), read backwards."""
    end = size
    while end > 0:
        begin = max(0, end - block)
        fh.seek(begin)
        chunk = fh.read(end - begin)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return begin + cut + 1
        end = begin
    return 0


class RecordingError(Exception):
    """The recording file cannot be used; the message says why, in one line."""


def open_locked(path: str, what: str, hint: str) -> int:
    """Open `path` to append (a new file is 0600) and lock it exclusively.

    Two writers on one file would interleave and collide (R14), so a file
    another process holds is refused; `RecordingError` says why in one line.
    """
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise RecordingError(f"cannot open {what} {path!r}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RecordingError(f"{what} {path!r} is in use by another recorder; {hint}") from None
        raise RecordingError(f"cannot lock {what} {path!r}: {exc.strerror}") from None
    return fd


class RecordingFile:
    """An append-only JSON Lines file, held under an exclusive lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_locked(path, "recording", "choose another file with llmp_file")
        self._end_with_newline()

    def _end_with_newline(self) -> None:
        """Make sure our first line starts on a line of its own.

        A recorder killed (SIGKILL) in the middle of a large `write()` can leave
        part of a record: that is cut back to the last whole line, since the
        rest of it is lost anyway and would stay a bad line mid-file. A partial
        line of unknown origin is kept, and closed with a newline.
        """
        size = os.fstat(self.fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as fh:
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            start = _last_line_start(fh, size)
            fh.seek(start)
            head = fh.read(len(RECORD_START))
        if head == RECORD_START:
            os.ftruncate(self.fd, start)
            log.warning(
                "llmp: %s ended with %d bytes of a record cut short by a killed recorder; "
                "removed them",
                self.path,
                size - start,
            )
        else:
            os.write(self.fd, b"\n")

    def write_line(self, line: bytes) -> None:
        """Append one whole line; on failure, cut the file back so no partial line stays."""
        start = os.fstat(self.fd).st_size
        view = memoryview(line)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise

    def close(self) -> None:
        """Release the lock and the file."""
        if self.fd >= 0:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = -1


def fallback_record(cap: Capture, mode: str) -> dict[str, Any]:
    """A record without bodies, for when building the real one failed: never lose an exchange."""
    stripped = dataclasses.replace(cap, request_body=None, pieces=[], stored_bytes=0)
    return build_record(stripped, mode)


_STOP = object()


class RecordWriter:
    """Builds and writes records on a background thread, in submission order."""

    def __init__(
        self,
        file: RecordingFile,
        mode: str,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        *,
        child: bool = True,
    ) -> None:
        self.file = file
        self.mode = mode
        self.on_record = on_record
        self.written = 0
        self.lost = 0
        self.failed: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._builder: ChildBuilder | None = None
        if child:
            try:
                self._builder = ChildBuilder()
            except BuilderGone as exc:
                log.warning("llmp: building records in-thread: %s", exc)
        self._thread = threading.Thread(target=self._run, name="llmp-writer", daemon=True)
        self._thread.start()

    def submit(self, cap: Capture) -> None:
        """Hand over a finished exchange; returns at once."""
        self._queue.put(cap)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._write(item)

    def _line(self, cap: Capture) -> bytes:
        """The record's line, from the child process when there is one."""
        if self._builder is not None:
            try:
                return self._builder.build(cap, self.mode)
            except BuilderGone as exc:
                log.warning("llmp: %s; building records in-thread from now on", exc)
                self._builder = None
        return build_line(cap, self.mode)

    def _write(self, cap: Capture) -> None:
        if self.failed is not None:
            self.lost += 1
            return
        line = self._line(cap)
        try:
            self.file.write_line(line)
        except OSError as exc:
            self.failed = exc.strerror or str(exc)
            self.lost += 1
            log.error(
                "llmp: STOPPED RECORDING to %s: %s. Traffic still passes through; "
                "exchanges from id %s on are not recorded.",
                self.file.path,
                self.failed,
                cap.id,
            )
            return
        self.written += 1
        if self.on_record is not None:
            try:
                # The live view reads the record as a reader would: number text
                # kept where bodies are (R2), the fast parse otherwise.
                full = self.mode == "full"
                self.on_record(canonical.loads(line) if full else orjson.loads(line))
            except Exception:
                log.exception("llmp: live view failed on record %s", cap.id)

    def close(self, timeout: float = 30.0) -> None:
        """Write everything submitted so far, then release the file."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._builder is not None and not self._thread.is_alive():
            self._builder.close()
        if self._thread.is_alive():
            log.error(
                "llmp: writer did not finish within %.0f s; some records may be missing", timeout
            )
        else:
            self.file.close()
