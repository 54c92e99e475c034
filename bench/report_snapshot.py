"""Reports of every scenario recording, written to a folder, to prove a change kept them.

    .venv/bin/python bench/report_snapshot.py recordings DIR     # the scenarios' recordings, once
    .venv/bin/python bench/report_snapshot.py reports DIR OUT    # `llmp analyze` of each, into OUT
    diff -r OUT_BEFORE OUT_AFTER                                 # byte for byte

The recordings are written once, by the code of the day, and every later
checkout analyses those same files: a refactor that must leave the report
unchanged is checked on identical input.  Each recording gets its `--json`
report, its readable report and its HTML page (`--jobs 2` too, for the JSON).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def recordings(out: Path) -> None:
    from tests.support import scenarios as sc

    out.mkdir(parents=True, exist_ok=True)
    makers = dict(sc.SCENARIOS)
    for name, fn in vars(sc).items():  # the Claude Code and Codex traffic, built the same way
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != sc.__name__:
            continue
        ret = inspect.signature(fn).return_annotation
        if ret in ("NewApiTraffic", "Traffic") and not inspect.signature(fn).parameters:
            makers.setdefault(name, fn)
    for name, make in sorted(makers.items()):
        for mode in ("digest", "full"):
            make().write(out / f"{name}-{mode}.jsonl", mode)
    sc.mixed_file(out)


def reports(rec: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    llmp = str(Path(sys.executable).with_name("llmp"))
    env = {**os.environ, "COLUMNS": "120"}  # PYTHONPATH may name another checkout's code
    for path in sorted(rec.glob("*.jsonl")):
        stem = path.stem
        runs = {
            f"{stem}.json": ["--json"],
            f"{stem}.jobs.json": ["--json", "--jobs", "2"],
            f"{stem}.txt": [],
        }
        for name, args in runs.items():
            done = subprocess.run([llmp, "analyze", str(path), *args], capture_output=True, env=env)
            (out / name).write_bytes(done.stdout + b"\n--- exit %d\n" % done.returncode)
        page = str(out / f"{stem}.html")
        subprocess.run([llmp, "analyze", str(path), "--html", page], capture_output=True, env=env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recordings")
    r.add_argument("dir", type=Path)
    q = sub.add_parser("reports")
    q.add_argument("dir", type=Path)
    q.add_argument("out", type=Path)
    a = p.parse_args()
    if a.cmd == "recordings":
        recordings(a.dir)
    else:
        reports(a.dir, a.out)


if __name__ == "__main__":
    main()
