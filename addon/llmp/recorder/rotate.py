"""A recording that starts a new file each local day (`llmp_rotate=daily`).

A proxy that runs for weeks writes one file per day, so a day's traffic can
be analysed, moved or deleted on its own.  The switch happens in the writer
thread, right before the first record written after local midnight: a record
goes to the file of the day it is *written* (when its exchange ended), so an
exchange in flight across midnight lands, whole, in the new file, and no
line is split or lost.  Ids go on increasing across the files: read
together, they are one session (R16); read alone, each is a valid recording.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from collections.abc import Callable

from llmp.format.lockfile import RecordingError
from llmp.recorder.writer import RecordingFile

log = logging.getLogger("llmp")

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

__all__ = ["DailyFile", "local_day", "path_for"]


def local_day() -> dt.date:
    """The local date now: the day a record written now belongs to."""
    return dt.date.today()


def path_for(template: str, day: dt.date) -> str:
    """The day's file: the date in the name replaced by `day`, or added before `.jsonl`.

    `llmp-2026-12-01.jsonl` → `llmp-2026-12-02.jsonl`; `team.jsonl` →
    `team-2026-12-02.jsonl`; `rec` → `rec-2026-12-02`.
    """
    folder, name = os.path.split(template)
    stamp = day.isoformat()
    if _DATE.search(name):
        name = _DATE.sub(stamp, name, count=1)
    elif name.endswith(".jsonl"):
        name = f"{name[: -len('.jsonl')]}-{stamp}.jsonl"
    else:
        name = f"{name}-{stamp}"
    return os.path.join(folder, name)


class DailyFile:
    """A `RecordingFile` per local day, with the same interface the writer uses."""

    def __init__(self, template: str, today: Callable[[], dt.date] | None = None) -> None:
        self.template = template
        self._clock = today
        self.day = self._today()
        self.current = RecordingFile(path_for(template, self.day))

    def _today(self) -> dt.date:
        # `local_day` looked up when called, so a test's mitmdump script can set the clock.
        return self._clock() if self._clock is not None else local_day()

    @property
    def path(self) -> str:
        return self.current.path

    @property
    def fd(self) -> int:
        return self.current.fd

    @property
    def created(self) -> bool:
        return self.current.created

    def write_line(self, line: bytes) -> None:
        """Append one whole line to the day's file, switching files first after midnight."""
        day = self._today()
        if day != self.day:
            self._switch(day)
        self.current.write_line(line)

    def _switch(self, day: dt.date) -> None:
        path = path_for(self.template, day)
        try:
            new = RecordingFile(path)  # opened and locked before the old one is let go
        except RecordingError as exc:
            log.error(
                "llmp: cannot start the recording of %s (%s); going on in %s",
                day.isoformat(),
                exc,
                self.current.path,
            )
            self.day = day  # one message per day, not one per record
            return
        old, self.current, self.day = self.current, new, day
        old.close()
        log.info("llmp: recording to %s from now on (a new day)", path)

    def discard(self) -> None:
        self.current.discard()

    def close(self) -> None:
        self.current.close()
