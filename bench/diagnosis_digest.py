"""What the recorder's opt-in diagnosis (`llmp_diagnose`, R37) spends on the client's
request path to digest a request, with and without the chunks it does not read.

    .venv/bin/python bench/diagnosis_digest.py

A request of 100 long messages (about 330 KB) is digested cold, as the first turn of a
conversation is: each run in a fresh process, since `format.chunks` memoises the texts
it has chunked.  The baseline is the digest the record keeps (with chunks); the figure
is the same digest under `apis.base.hashes_only`, which `Diagnosis.request` uses.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

RUNS = 5

_ONE = """
import json, random, sys, time
from llmp.apis.anthropic_messages import AnthropicMessages
from llmp.apis.base import hashes_only
random.seed(1)
words = "the of parse module return value error line file test cache token".split()
msgs = [
    {"role": "user" if i % 2 == 0 else "assistant",
     "content": " ".join(random.choice(words) for _ in range(600))}
    for i in range(100)
]
body = json.dumps({"model": "claude-x", "max_tokens": 10, "messages": msgs}).encode()
api = AnthropicMessages()
t = time.perf_counter()
if sys.argv[1] == "hashes":
    with hashes_only():
        api.request_digest_bytes(body)
else:
    api.request_digest_bytes(body)
print(json.dumps({"ms": (time.perf_counter() - t) * 1000, "bytes": len(body)}))
"""


def run(mode: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", _ONE, mode], check=True, capture_output=True, text=True
    ).stdout
    got = json.loads(out)
    return float(got["ms"]), int(got["bytes"])


def main() -> None:
    figures: dict[str, list[float]] = {"chunks": [], "hashes": []}
    size = 0
    for _ in range(RUNS):
        for mode in random.sample(list(figures), 2):  # neither always first
            ms, size = run(mode)
            figures[mode].append(ms)
    print(f"a cold request of {size:,} bytes, best of {RUNS} fresh processes:")
    base = min(figures["chunks"])
    now = min(figures["hashes"])
    print(f"  baseline, with chunks:        {base:7.1f} ms")
    print(f"  hashes_only (the diagnosis):  {now:7.1f} ms  ({now / base:.0%} of the baseline)")


if __name__ == "__main__":
    main()
