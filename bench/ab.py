"""A paired A/B of `llmp analyze --json`: two checkouts, alternated, CPU seconds each.

    .venv/bin/python bench/ab.py RECORDING N main=/path/to/main/addon new=/path/to/wt/addon

Each round runs every checkout once on the same recording, in alternating order (so
a machine that slows down during the session slows both), and takes the child's own
user + system CPU time, not wall time.  The first checkout is the baseline; the others
are printed beside it as a change of the mean and the median.  The figures of
docs/performance.md's "Fast-path twins" came from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys


def cpu_seconds(addon: str, recording: str) -> float:
    """One `llmp analyze --json` with `addon` first on the path: its CPU seconds."""
    env = {**os.environ, "PYTHONPATH": addon}
    with open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmp", "analyze", "--json", recording],
            stdout=devnull,
            env=env,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"llmp analyze failed under {addon} (status {status})")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording")
    parser.add_argument("rounds", type=int)
    parser.add_argument("trees", nargs="+", metavar="NAME=ADDON_DIR")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    names = list(trees)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(cpu_seconds(trees[name], args.recording))
        print(i + 1, "  ".join(f"{n} {times[n][-1]:.2f}" for n in names), flush=True)
    for name in names:
        t = times[name]
        print(f"{name}: mean {statistics.mean(t):.3f} median {statistics.median(t):.3f} s CPU")
    base = times[names[0]]
    for name in names[1:]:
        t = times[name]
        mean = 100 * (statistics.mean(t) / statistics.mean(base) - 1)
        median = 100 * (statistics.median(t) / statistics.median(base) - 1)
        print(f"{name} vs {names[0]}: mean {mean:+.1f} %, median {median:+.1f} %")


if __name__ == "__main__":
    main()
