"""The recording file and the thread that fills it (R14).

`RecordingFile` owns the file: created 0600, locked exclusively so that two
recorders never share it, one `write` per whole line.  `RecordWriter` takes
finished captures from the proxy's event loop and does the expensive work
(building, hashing, serialising, writing) on its own thread, so the client's
bytes never wait for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from llmp.format.lockfile import RecordingError, close_locked, open_locked, write_all
from llmp.live.contract import LiveConfig, LiveError
from llmp.recorder.builder import BuilderGone, ChildBuilder
from llmp.recorder.capture import Capture

if TYPE_CHECKING:
    from llmp.live.view import LiveView

__all__ = [
    "LiveSpec",
    "RecordSink",
    "RecordWriter",
    "RecordingError",
    "RecordingFile",
    "open_locked",
]

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


class RecordSink(Protocol):
    """Where the writer puts lines: one `RecordingFile`, or one a day (`llmp.recorder.rotate`)."""

    @property
    def path(self) -> str: ...
    @property
    def fd(self) -> int: ...
    @property
    def created(self) -> bool: ...
    def write_line(self, line: bytes) -> None: ...
    def discard(self) -> None: ...
    def close(self) -> None: ...


class RecordingFile:
    """An append-only JSON Lines file, held under an exclusive lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.created = not os.path.lexists(path)
        self.fd = open_locked(path, "recording", "choose another file with llmp_file")
        self._end_with_newline()

    def discard(self) -> None:
        """Close it; remove it if this recorder created it and wrote nothing (a failed start)."""
        empty = self.fd >= 0 and os.fstat(self.fd).st_size == 0
        if self.created and empty:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.close()

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
        try:
            write_all(self.fd, line)
        except OSError:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise

    def close(self) -> None:
        """Release the lock and the file."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            close_locked(fd)


_STOP = object()


@dataclasses.dataclass(frozen=True)
class LiveSpec:
    """The live view the recorder asks for: its settings, and the first id it is to see."""

    cfg: LiveConfig
    first_id: int


@dataclasses.dataclass
class _SetLive:
    """A queued request to start, replace or stop the live view, in line with the records."""

    spec: LiveSpec | None
    done: concurrent.futures.Future[None] = dataclasses.field(
        default_factory=concurrent.futures.Future
    )


class RecordWriter:
    """Builds and writes records on a background thread, in submission order.

    The live view sees every record after it is built, in the same order.  It
    runs in the builder child next to the building (`llmp.recorder.builder`), so its
    analysis never takes the proxy's GIL; without a child, here, on the
    writer thread, after the record is written.
    """

    def __init__(
        self, file: RecordSink, mode: str, *, child: bool = True, terminal: int = 1
    ) -> None:
        """`terminal`: where the builder child writes the live view's lines (a file
        descriptor, by default the proxy's stdout), unless `llmp_live_log` names a file."""
        self.file = file
        self.mode = mode
        self.written = 0
        self.lost = 0
        self.failed: str | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._builder: ChildBuilder | None = None
        self._live: LiveSpec | None = None  # what was asked for, wherever it runs
        self._local: LiveView | None = None  # the live view, when it runs in this process
        if child:
            try:
                self._builder = ChildBuilder(terminal)
            except BuilderGone as exc:
                log.warning("llmp: building records in-thread: %s", exc)
        self._thread = threading.Thread(target=self._run, name="llmp-writer", daemon=True)
        self._thread.start()

    def submit(self, cap: Capture) -> None:
        """Hand over a finished exchange; returns at once."""
        self._queue.put(cap)

    def set_live(self, spec: LiveSpec | None, timeout: float = 30.0) -> None:
        """Start, replace or stop the live view after the records submitted so far.

        Waits until it is done; raises `LiveError` (an event file cannot be
        used), and then no live view runs.
        """
        request = _SetLive(spec)
        self._queue.put(request)
        try:
            request.done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise LiveError(
                f"the live view did not start within {timeout:.0f} s (records still being built)"
            ) from None

    def live_summary(self) -> bytes | None:
        """The live view's summary JSON; None when it is off.  Blocks: not for the event loop."""
        local = self._local
        if local is not None:
            return local.summary_json()
        builder = self._builder
        if builder is None or self._live is None:
            return None
        return builder.summary()

    def live_metrics(self) -> tuple[bytes, str] | None:
        """The live view's Prometheus text with this writer's totals, and its Content-Type;
        None when the view is off.

        Blocks, like `live_summary`.  The Content-Type is prometheus_client's,
        imported here (off the event loop) because it changes with its version.
        """
        from llmp.live.metrics import CONTENT_TYPE

        local = self._local
        if local is not None:
            return local.metrics_text(self.written, self.lost), CONTENT_TYPE
        builder = self._builder
        if builder is None or self._live is None:
            return None
        text = builder.metrics(self.written, self.lost)
        return None if text is None else (text, CONTENT_TYPE)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._stop_live()
                return
            if isinstance(item, _SetLive):
                try:
                    self._set_live(item.spec)
                except LiveError as exc:
                    item.done.set_exception(exc)
                except Exception as exc:  # a bug: the records must go on all the same
                    log.exception("llmp: the live view could not start")
                    item.done.set_exception(LiveError(f"the live view could not start: {exc}"))
                else:
                    item.done.set_result(None)
                continue
            self._write(item)

    # -- the live view --------------------------------------------------------

    def _set_live(self, spec: LiveSpec | None) -> None:
        """Replace the live view; after a `LiveError` none runs (mitmproxy rolls back)."""
        cfg = spec.cfg if spec is not None else None
        first_id = spec.first_id if spec is not None else 0
        self._live = None
        if self._builder is not None:
            try:
                self._builder.live(cfg, self.mode, first_id)
            except BuilderGone as exc:
                self._lost_child(exc)
            else:
                self._live = spec
                return
        from llmp.recorder.child import replace_view  # the engine, only when it runs here

        old, self._local = self._local, None
        self._local = replace_view(old, cfg, body=self.mode, first_id=first_id)
        self._live = spec

    def _stop_child_live(self) -> None:
        if self._builder is not None:
            try:
                self._builder.live(None, self.mode, 0)
            except BuilderGone as exc:
                self._lost_child(exc)

    def _stop_live(self) -> None:
        """At shutdown: the live view's last lines and LLMP_SUMMARY, after the last record."""
        if self._live is None:
            return
        self._live = None
        if self._local is not None:
            self._local.close()
            self._local = None
        else:
            self._stop_child_live()

    def _lost_child(self, exc: BuilderGone, next_id: int | None = None) -> None:
        """The child died: build here from now on, with a new live view from `next_id`."""
        log.warning("llmp: %s; building records in-thread from now on", exc)
        self._builder = None
        spec = self._live
        if spec is None:
            return
        first_id = next_id if next_id is not None else spec.first_id
        from llmp.recorder.child import replace_view

        try:
            self._local = replace_view(None, spec.cfg, body=self.mode, first_id=first_id)
            log.warning("llmp: live view restarted in the proxy's process from id %d", first_id)
        except LiveError as exc2:
            log.error("llmp: live view stopped: %s", exc2)
            self._live = None

    # -- records ----------------------------------------------------------------

    def _line(self, cap: Capture) -> bytes:
        """The record's line, from the child process when there is one."""
        if self._builder is not None:
            try:
                line = self._builder.build(cap, self.mode)
            except BuilderGone as exc:
                self._lost_child(exc, next_id=cap.id)
            else:
                if line:
                    return line
        from llmp.recorder.record import build_line  # the child's work, done here

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
        if self._local is not None:
            from llmp.recorder.child import feed

            feed(self._local, line, self.mode)

    def close(self, timeout: float = 30.0) -> None:
        """Write everything submitted so far, stop the live view, then release the file."""
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
