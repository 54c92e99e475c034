"""A test-only mitmdump script: the proxy's clock, moved on by the seconds in `$LLMP_TEST_SKEW`.

A cache's time-to-live is minutes; a test does not wait minutes.  The fake provider keeps
its cache on a clock the test moves (`Skew`, tests/support/openai_session.py), and this
script moves the proxy's clock by the same seconds, so that the recording shows the pause
the fake's cache saw: every time the recorder stamps (`t_start_ms`, the first byte, the
end) comes from `time.time` in the proxy's own process.  Only the clock is replaced; the
proxy, the recorder and the files are real.  It is never part of llmp itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_REAL = time.time
_FILE = Path(os.environ["LLMP_TEST_SKEW"])


def _skewed() -> float:
    try:
        return _REAL() + float(_FILE.read_text() or 0)
    except (OSError, ValueError):
        return _REAL()


time.time = _skewed
