"""The live view's event files: `LLMP_TURN` lines and their CSV.

Each is append-only, created 0600 and locked like the recording (R14), one
write per line; a failed write stops that file only, never the recording.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from typing import Any

import orjson

from llmp.format.lockfile import RecordingError, close_locked, open_locked, write_all
from llmp.live.contract import TURN_FIELDS, LiveError

log = logging.getLogger("llmp")


class _LineFile:
    """An append-only file of whole lines: created 0600, locked, one write per line.

    A failed write stops this file (logged once); recording goes on.
    """

    def __init__(self, path: str, option: str) -> None:
        self.path = path
        self.option = option
        self.failed = False
        try:
            self.fd = open_locked(path, option, "choose another file")
        except RecordingError as exc:
            raise LiveError(str(exc)) from None
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":
            self.write(b"\n")  # close a partial line left by something else

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        if self.fd < 0 or self.failed:
            return
        try:
            write_all(self.fd, data)
        except OSError as exc:
            self.failed = True
            log.error(
                "llmp: stopped writing %s to %s: %s; recording goes on",
                self.option,
                self.path,
                exc.strerror or exc,
            )

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            close_locked(fd)


class EventFile(_LineFile):
    """`LLMP_TURN {json}` per analysed request, `LLMP_SUMMARY {json}` at shutdown."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "llmp_events")

    def put(self, tag: str, obj: dict[str, Any]) -> None:
        self.write(tag.encode() + b" " + orjson.dumps(obj) + b"\n")


def csv_cell(value: Any) -> Any:
    """Empty for null, `true`/`false` for booleans: the JSON reading of each value."""
    if value is None:
        return ""
    if value is True:
        return "true"
    if value is False:
        return "false"
    return value


class CsvFile(_LineFile):
    """The LLMP_TURN fields as CSV, with a header row; read by column name."""

    HEADER = (",".join(TURN_FIELDS) + "\n").encode()

    def __init__(self, path: str) -> None:
        super().__init__(path, "llmp_events_csv")
        if self.size() == 0:
            self.write(self.HEADER)
            return
        with open(path, "rb") as fh:
            first = fh.readline()
        if first != self.HEADER:
            self.close()
            raise LiveError(
                f"llmp_events_csv {path!r} already holds other columns; choose another file"
            )

    def put(self, ev: dict[str, Any]) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(csv_cell(ev.get(f)) for f in TURN_FIELDS)
        self.write(buf.getvalue().encode())
