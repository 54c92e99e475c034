"""What the content-defined chunks of long messages cost: record size, and time per message.

    .venv/bin/python bench/chunk_cost.py            # every capture, and the timing
    .venv/bin/python bench/chunk_cost.py --no-time  # the sizes only

Each capture of real harness traffic in ``tests/fixtures/harness/`` is replayed through
the real ``mitmdump`` with the llmp addon in digest mode (``tests.support.replay``), and
the recording is measured: its bytes, and the bytes its messages' ``"chunks"`` fields
take (key, value and comma; ``null`` for a short message), which is what the recording
would be smaller by without them; and how many long messages kept a second size (the
next one, near a power of two).  Then ``chunks_of`` is timed on texts of 513
characters, 4 KB and 300 KB, ASCII and not (best of several runs: the machine is
shared).  The figures are in docs/recording.md, "Where inside a long message it
changed".
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(REPO_DIR))  # tests.support: the capture replay

from tests.support.replay import capture_name, load_capture, replay  # noqa: E402

from llmp.format.canonical import record_dumps  # noqa: E402
from llmp.format.chunks import LONG_CHARS, chunks_of  # noqa: E402

CAPTURES = REPO_DIR / "tests" / "fixtures" / "harness"


def sizes(out: Path) -> None:
    total_bytes = total_field = total_long = total_two = total_msgs = total_chunks = 0
    print(
        f"{'capture':18} {'records':>7} {'bytes':>10} {'chunks':>9} {'share':>6} "
        f"{'long':>5} {'two':>4} {'per long':>8}"
    )
    for path in sorted(CAPTURES.glob("*.jsonl.gz")):
        name = capture_name(path)
        rep = replay(load_capture(path), out / name, mode="digest", name=name)
        line_bytes = len(rep.recording.read_bytes())
        field = long = two = msgs = count = 0
        for rec in rep.records:
            digest = (rec.get("request") or {}).get("digest") or {}
            for m in digest.get("messages") or []:
                msgs += 1
                if "chunks" in m:
                    field += len(b',"chunks":' + record_dumps(m["chunks"]))
                    if m["chunks"] is not None:
                        long += 1
                        two += len(m["chunks"]) > 1
                        count += sum(len(level["ends"]) for level in m["chunks"])
        share = field / line_bytes if line_bytes else 0.0
        per = f"{count / long:8.1f}" if long else f"{'':8}"
        print(
            f"{name:18} {len(rep.records):7} {line_bytes:10,} {field:9,} {share:6.1%} "
            f"{long:5} {two:4} {per}"
        )
        total_bytes += line_bytes
        total_field += field
        total_long += long
        total_two += two
        total_msgs += msgs
        total_chunks += count
    print(
        f"{'all':18} {'':7} {total_bytes:10,} {total_field:9,} "
        f"{total_field / total_bytes:6.1%} {total_long:5} {total_two:4} "
        f"{total_chunks / max(1, total_long):8.1f}   of {total_msgs} message digests"
    )


def timing() -> None:
    rng = random.Random(7)
    for alphabet, label in (("abcdefghij \n", "ASCII"), ("aé€ bc\n", "non-ASCII")):
        for n in (LONG_CHARS + 1, 4096, 300_000):
            text = "".join(rng.choice(alphabet) for _ in range(n))
            runs = 5 if n > 100_000 else 200
            best = min(_time(f"{k:06d}" + text[6:]) for k in range(runs))
            print(f"{label:9} {n:8,} characters: {best * 1e3:7.3f} ms")


def _time(text: str) -> float:
    """The first sight of a text (each run's text is another: none is remembered)."""
    t0 = time.perf_counter()
    chunks_of(text)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-time", action="store_true", help="only the record sizes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmp-chunk-cost-") as tmp:
        sizes(Path(tmp))
    if not args.no_time:
        timing()


if __name__ == "__main__":
    main()
