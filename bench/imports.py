"""What `mitmdump -s addon/llmp_addon.py` loads into the proxy's process, beyond mitmproxy.

Each measurement runs a fresh interpreter that first imports what mitmdump
itself has loaded by the time it runs a script (its dump master and the HTTP
flow types), then imports the addon script's module, and reports the
modules that second step added, by top-level package, and the time it took.
Give `--src DIR` to measure another checkout's `addon/` (for example the
commit before a change) in the same run:

    .venv/bin/python bench/imports.py --src /tmp/old-checkout/addon
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys, time
import mitmproxy.tools.dump, mitmproxy.http, mitmproxy.addonmanager  # mitmdump's own
before = set(sys.modules)
t0 = time.perf_counter()
import importlib
importlib.import_module(sys.argv[1])
took = time.perf_counter() - t0
added = sorted(set(sys.modules) - before)
print(json.dumps({"ms": took * 1000, "added": added}))
"""


def measure(src: Path, module: str, runs: int) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(src))
    times: list[float] = []
    added: list[str] = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, module],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out)
        times.append(float(result["ms"]))
        added = list(result["added"])
    by_top: dict[str, int] = {}
    for name in added:
        top = name.split(".")[0] if not name.startswith("llmp.") else ".".join(name.split(".")[:2])
        by_top[top] = by_top.get(top, 0) + 1
    return {"ms": statistics.median(times), "modules": len(added), "by_package": by_top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="another checkout's addon/ folder to compare")
    parser.add_argument(
        "--src-module", default="llmp.addon", help="the addon module in --src (default llmp.addon)"
    )
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    rows = []
    if args.src is not None:
        rows.append(("before (--src)", measure(args.src, args.src_module, args.runs)))
    rows.append(("this checkout", measure(REPO / "addon", "llmp.recorder.addon", args.runs)))
    for label, r in rows:
        print(f"{label}: {r['modules']} modules, {r['ms']:.1f} ms (median of {args.runs})")
        packages = sorted(r["by_package"].items(), key=lambda kv: (-kv[1], kv[0]))  # type: ignore[attr-defined]
        print("  " + ", ".join(f"{name} {n}" for name, n in packages))


if __name__ == "__main__":
    main()
