"""Where the live view's lines go when it runs in the builder child.

The child writes them itself, one `write` per line, to the proxy's terminal
(a copy of the proxy's stdout, where mitmproxy's own log goes) or to a log
file (`llmp_live_log`), formatted the way mitmproxy formats its log.  So a
line takes no trip back through the proxy's process, whose event loop has
the traffic to relay (docs/live.md).
"""

from __future__ import annotations

import logging
import os
import time

from llmp.format.lockfile import write_all
from llmp.live.contract import LiveError

__all__ = ["LineSink", "SinkHandler"]


def _stamp(t: float) -> str:
    """`[HH:MM:SS.mmm]`, local time, as mitmproxy's terminal log writes it."""
    return time.strftime("[%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}]"


class LineSink:
    """A file descriptor that takes whole log lines; a failed write stops it quietly."""

    def __init__(self, fd: int, *, owned: bool = False, level: int = logging.INFO) -> None:
        self.fd = fd
        self.owned = owned
        self.level = level
        self.failed = False

    @classmethod
    def open(cls, path: str, level: int = logging.INFO) -> LineSink:
        """A log file, appended to (created 0600); `LiveError` when it cannot be opened."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise LiveError(f"cannot open llmp_live_log {path!r}: {exc.strerror}") from None
        return cls(fd, owned=True, level=level)

    def say(self, level: int, text: str) -> None:
        """Write one line at `level` (dropped below the sink's level)."""
        if level < self.level or self.failed or self.fd < 0:
            return
        try:
            write_all(self.fd, f"{_stamp(time.time())} {text}\n".encode("utf-8", "replace"))
        except OSError:
            self.failed = True  # a closed terminal must not stop the records

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class SinkHandler(logging.Handler):
    """The child's `llmp` log records (its own errors, the live view's notes) to a sink."""

    def __init__(self, sink: LineSink) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink
        self._fmt = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self._fmt.formatException(record.exc_info)
        self.sink.say(record.levelno, text)
