"""A mitmdump script for tests: the recorder's local day, read from the file `$LLMP_TEST_DAY`.

Loaded before the llmp addon (`-s fake_clock.py -s addon/llmp_addon.py`), it
lets a test move a real proxy past midnight by writing a date into a file.
Only the clock is replaced; the proxy, the recorder and the files are real.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from llmp.recorder import rotate


def _day() -> dt.date:
    return dt.date.fromisoformat(Path(os.environ["LLMP_TEST_DAY"]).read_text().strip())


rotate.local_day = _day
