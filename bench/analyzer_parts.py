"""Where the analyzer's time per record goes, by part: the engine fed records read
beforehand, with one part stubbed out, and the bytecodes each function runs.

    .venv/bin/python bench/analyzer_parts.py FILE                  # every part, 3 rounds
    .venv/bin/python bench/analyzer_parts.py FILE --parts findings,spill
    .venv/bin/python bench/analyzer_parts.py FILE --bytecodes      # bytecodes per function
    PYTHONPATH=/tmp/base/addon .venv/bin/python bench/analyzer_parts.py FILE   # another tree

The records (the first `--records` lines of FILE, a digest recording such as
`bench/analyzer.py`'s) are read with the fast path's `read_record` before the
clock starts, so only `Engine.feed` is timed: the exchange prepared, the row made,
and the sinks (totals, findings, the spill) fed.  Each part is timed in a fresh
process with that part replaced by a stub, alternated with the whole: the
difference is an upper bound of what the part costs, and of what any rewrite of
it could save.  A stubbed part changes what follows it (no `between` means no
evictions to find), so the figures are bounds, not a sum.

`--bytecodes` counts the bytecodes each Python function executes per record
(`sys.monitoring`'s INSTRUCTION event, after a warm-up), read and engine
together: the interpreter's unit of work, which does not move with the
machine's load.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType


def _stub_between() -> None:
    from llmp.analysis import engine, loss

    nothing = loss.NOTHING_BETWEEN
    engine.between = lambda *a: nothing


def _stub_findings() -> None:
    from llmp.analysis.findings import Findings

    Findings.add = lambda self, *a: None  # type: ignore[method-assign]


def _stub_overflow() -> None:
    from llmp.analysis.overflow import Overflow

    Overflow.row = lambda self, *a: False  # type: ignore[method-assign]


def _stub_totals() -> None:
    from llmp.analysis.report import Totals

    Totals.add = lambda self, *a: None  # type: ignore[method-assign]


def _stub_offer() -> None:
    from llmp.analysis.report import Totals

    Totals.offer = lambda self, *a: None  # type: ignore[method-assign]


def _stub_spill() -> None:
    from llmp.analysis.report import Spill

    Spill.write = lambda self, *a: None  # type: ignore[method-assign]


STUBS: dict[str, Callable[[], None]] = {
    "between": _stub_between,
    "findings": _stub_findings,
    "overflow": _stub_overflow,
    "totals": _stub_totals,
    "offer": _stub_offer,
    "spill": _stub_spill,
}
"""Each part of the engine's work, and what replaces it by a stub that does nothing."""


def _lines(path: Path, n: int) -> list[bytes]:
    out: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            if len(out) >= n:
                break
            out.append(line)
    return out


def child(path: Path, n: int, part: str) -> None:
    """One timing: µs of `Engine.feed` per record, printed."""
    from llmp.analysis.engine import Engine
    from llmp.analysis.exchange import read_record

    if part != "none":
        STUBS[part]()
    records = [r for r in map(read_record, _lines(path, n)) if r is not None]
    engine = Engine(summaries=False)  # as `llmp analyze --json` makes it
    gc.disable()  # as `analyze` reads
    feed = engine.feed
    start = time.process_time()
    for rec in records:
        feed(1, rec)
    engine.flush()
    print(f"{(time.process_time() - start) / len(records) * 1e6:.3f}")


def bytecodes(path: Path, n: int, warm: int, top: int) -> None:
    """Bytecodes per record of each function, read and engine together."""
    from llmp.analysis.engine import Engine
    from llmp.analysis.exchange import read_record

    lines = _lines(path, warm + n)
    engine = Engine(summaries=False)

    def run(batch: list[bytes]) -> None:
        for line in batch:
            rec = read_record(line)
            if rec is not None:
                engine.feed(1, rec)

    run(lines[:warm])
    counts: collections.Counter[CodeType] = collections.Counter()

    def on_instruction(code: CodeType, offset: int) -> None:
        counts[code] += 1

    mon = sys.monitoring
    tool = mon.PROFILER_ID
    mon.use_tool_id(tool, "analyzer_parts")
    mon.register_callback(tool, mon.events.INSTRUCTION, on_instruction)
    mon.set_events(tool, mon.events.INSTRUCTION)
    run(lines[warm:])
    mon.set_events(tool, 0)
    mon.free_tool_id(tool)
    measured = len(lines) - warm
    print(f"bytecodes per record: {sum(counts.values()) / measured:,.0f} ({measured:,} records)")
    for code, c in counts.most_common(top):
        where = f"{Path(code.co_filename).name}:{code.co_firstlineno}"
        print(f"  {c / measured:8.1f}  {code.co_qualname}  ({where})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path, help="a digest recording")
    ap.add_argument(
        "--records",
        type=int,
        default=8000,
        help="lines timed (default 8000; --bytecodes: at most 2000, after 3000 more)",
    )
    ap.add_argument("--parts", default=",".join(STUBS), help="parts to stub, one at a time")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    ap.add_argument("--bytecodes", action="store_true", help="bytecodes per function")
    ap.add_argument("--top", type=int, default=30, help="functions listed (--bytecodes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.file, args.records, args.child)
        return
    if args.bytecodes:
        bytecodes(args.file, min(2000, args.records), 3000, args.top)
        return
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:  # every name checked before the first run
        if p not in STUBS:
            raise SystemExit(f"unknown part {p!r}: one of {', '.join(STUBS)}")
    parts.insert(0, "none")
    samples: dict[str, list[float]] = {p: [] for p in parts}

    def run(part: str) -> float:
        cmd = [sys.executable, __file__, str(args.file), "--records", str(args.records)]
        out = subprocess.run([*cmd, "--child", part], check=True, capture_output=True, text=True)
        return float(out.stdout)

    for _ in range(args.rounds):
        for p in parts:
            samples[p].append(run(p))
    whole = statistics.median(samples["none"])
    print(f"Engine.feed, µs per record (median of {args.rounds}; all runs in brackets)")
    print(f"  {'whole':11s} {whole:6.2f}  [{', '.join(f'{s:.2f}' for s in samples['none'])}]")
    for p in parts[1:]:
        m = statistics.median(samples[p])
        runs = ", ".join(f"{s:.2f}" for s in samples[p])
        print(f"  no {p:8s} {m:6.2f}  [{runs}]  part <= {whole - m:5.2f} µs")


if __name__ == "__main__":
    main()
