"""`llmp analyze`: where the prefill time went (see docs/analysis.md).

`analyze(paths)` reads recordings and returns the finished `Analysis`;
`Engine` is the incremental core, fed one record at a time.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import IO, Any

from llmp.analysis.changes import Changes
from llmp.analysis.config import Config
from llmp.analysis.engine import Engine
from llmp.analysis.exchange import read_record
from llmp.analysis.reader import Sourced, read_sourced
from llmp.analysis.result import PLAIN_ENV, Analysis, fast_default
from llmp.format.lines import parse_line

__all__ = ["PLAIN_ENV", "Analysis", "Config", "Engine", "analyze", "fast_default"]


def analyze(
    paths: Sequence[str],
    cfg: Config | None = None,
    *,
    progress: bool | None = None,
    stdin: IO[bytes] | None = None,
    window_lines: int | None = None,
    rows: bool = True,
    summaries: bool | None = None,
    keep: bool = False,
    changes: int | None = None,
    fast: bool | None = None,
    jobs: int = 1,
) -> Analysis:
    """Read the recordings and analyse every record.

    `rows=False` keeps no rows but a summary per conversation: what the
    readable report needs. `rows=True` keeps the rows for the report v1.
    `summaries=True` keeps the summaries as well (default: `not rows`).
    `keep=True` holds the rows in memory too (for the HTML page), and
    `changes=N` collects the "what changed" diffs of the N largest breaks.
    `fast=False` reads every line the plain way (default: `fast_default()`); the
    report is the same either way.  `jobs=N` analyses sessions in up to N processes
    (`parallel`), the same report again; `changes` needs one process.
    """
    if jobs > 1 and changes is None:
        # Imported here: the process pool's modules cost every one-process run.
        from llmp.analysis.parallel import analyze_parallel

        def alone(files: list[str]) -> Analysis:
            return analyze(
                files,
                cfg,
                progress=progress,
                window_lines=window_lines,
                rows=rows,
                summaries=summaries,
                keep=keep,
                fast=fast,
            )

        return analyze_parallel(
            paths,
            cfg,
            jobs,
            stdin=stdin,
            window_lines=window_lines,
            rows=rows,
            summaries=summaries,
            keep=keep,
            fast=fast_default() if fast is None else fast,
            alone=alone,
        )
    if jobs > 1:
        from llmp.analysis.parallel import one_process

        one_process('--html follows every record for its "what changed"')
    collected: list[Changes | None] = [None]

    def consume(records: Iterator[Sourced]) -> Engine:
        want = not rows if summaries is None else summaries
        engine = Engine(cfg, spill=rows, summaries=want, keep=keep)
        watch = collected[0] = Changes(changes) if changes is not None else None
        try:
            for session, rec, source in records:
                engine.recording = source
                fed = engine.feed(session, rec)
                if watch is not None and fed is not None:
                    watch(session, fed)
            engine.flush()
        except BaseException:
            engine.close()
            raise
        return engine

    extra: dict[str, Any] = {}
    if window_lines is not None:
        extra["window_lines"] = window_lines
    # Every parsed record is a burst of short-lived containers that
    # reference counting frees; the cycle collector only slows that down
    # (a fifth of the run with the default thresholds), and neither the
    # parsed records nor the engine's state form cycles.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        read = read_record if (fast_default() if fast is None else fast) else parse_line
        engine, stats = read_sourced(
            paths, consume, progress=progress, stdin=stdin, read=read, **extra
        )
    finally:
        if was_enabled:
            gc.enable()
    return Analysis(engine, stats, collected[0], list(paths))
