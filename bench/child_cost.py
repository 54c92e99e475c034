"""What the builder child spends per chat exchange, by part, in instructions.

    .venv/bin/python bench/child_cost.py                  # callgrind, every part
    .venv/bin/python bench/child_cost.py --parts stream   # one part
    .venv/bin/python bench/child_cost.py --growing        # a growing conversation
    .venv/bin/python bench/child_cost.py --addon-dir /tmp/base/addon   # another tree
    .venv/bin/python bench/child_cost.py --profile        # cProfile of the whole, no valgrind

The exchanges are the bench's chat load (`bench/recorder.py`): the 300 KB
request of `chat_body`, and the 300 events `bench/sse_upstream.py` sends
for it, one piece per event, as the stream tap keeps them.  Each part runs
under `valgrind --tool=callgrind` twice, for 0 and for N exchanges after
one warm-up exchange, in fresh interpreters; the difference over N is the
part's instructions per exchange, so start-up and first-use costs are not
counted, and the machine's load does not move the figures.

The parts:

- whole: the child's work for one build request: the capture cut out of
  its buffers (`read_capture`), `build_line`, the live view fed the line;
- build: `build_line`, digest mode; full: the same in full mode;
- request_loads: `canonical.loads` of the request body;
- request_digest: the API's `request_digest` of the parsed body;
- request_bytes: what digest mode does with the request body's bytes
  (`request_digest_bytes`: the digests of messages seen before looked up);
- stream: the response stream as `record.py` parses it (`StreamCapture`:
  SSE, per-event JSON, the merge) and its response digest;
- live: the live view fed the record's line.

`--cold`: every request is another conversation, so no message was seen
before: what the first request of a conversation costs.

`--growing`: exchange k's request is the conversation after k more turns
(an assistant message with a tool call, and its result, added each time),
as an agent resends its whole history.  The bench sends the same body
every time, which is what a cache of per-message digests likes best; this
shows what real traffic gets.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
PARTS = (
    "whole",
    "build",
    "full",
    "request_loads",
    "request_digest",
    "request_bytes",
    "stream",
    "live",
)
BODY_BYTES = 300_000
EVENTS = 297  # content deltas; the stream has 300 events (`Params.chat_events`)


# ------------------------------------------------------------------ the exchanges


def _payload(frame: bytes) -> bytes:
    """The data of one HTTP chunk frame, as mitmproxy hands it to the stream tap."""
    _size, _, rest = frame.partition(b"\r\n")
    return rest[:-2]


def stream_pieces(events: int) -> list[bytes]:
    """The pieces of one chat stream: role, `events` content deltas, finish, `[DONE]`."""
    sys.path.insert(0, str(BENCH_DIR))
    import sse_upstream as up

    frames = [up._ROLE, *(up._content_frame(i) for i in range(events))]
    frames += [up._finish_frame(events), up._DONE]
    return [_payload(f) for f in frames]


def request_bodies(count: int, growing: bool, seed: int = 7, cold: bool = False) -> list[bytes]:
    """`count` request bodies: the bench's one, a conversation growing by a turn
    each, or (`cold`) bodies that share no message."""
    sys.path.insert(0, str(BENCH_DIR))
    from recorder import chat_body

    if cold:
        return [chat_body(BODY_BYTES, seed + 1000 + k) for k in range(count)]
    body = chat_body(BODY_BYTES, seed)
    if not growing:
        return [body] * count
    doc = json.loads(body)
    messages = doc["messages"]
    # The conversation ends on a tool result; 2 messages (a turn) are added per exchange.
    end = len(messages) - 1  # without the last user message
    start = end - 2 * (count - 1)
    out = []
    for k in range(count):
        doc["messages"] = messages[: start + 2 * k]
        out.append(json.dumps(doc, separators=(",", ":")).encode())
    return out


# ------------------------------------------------------------------------ worker


def _capture(body: bytes, pieces: list[bytes], n: int) -> Any:
    from llmp.recorder.capture import Capture

    cap = Capture(
        id=n,
        conn=1,
        t_start_ms=1_760_000_000_000 + n,
        raw_method=b"POST",
        raw_path=b"/v1/chat/completions",
        request_fields=(
            (b"Host", b"127.0.0.1:8080"),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
            (b"x-bench", b"events=297"),
        ),
    )
    cap.request_complete = True
    cap.request_body_bytes = len(body)
    cap.request_body = body
    cap.status = 200
    cap.response_fields = (
        (b"Server", b"llama.cpp"),
        (b"Content-Type", b"text/event-stream"),
        (b"Transfer-Encoding", b"chunked"),
    )
    cap.tapped = True
    cap.pieces = list(pieces)
    cap.times = [1_760_000_000.0 + i * 0.001 for i in range(len(pieces))]
    cap.t_end_ms = 1_760_000_001_000 + n
    return cap


def _runner(part: str, bodies: list[bytes], pieces: list[bytes]) -> Any:
    """A function of the exchange's number that does `part` once."""
    from llmp.apis import api_for
    from llmp.format import canonical
    from llmp.recorder.builder import capture_request
    from llmp.recorder.record import build_line
    from llmp.recorder.stream import StreamCapture

    api = api_for("POST", "/v1/chat/completions")
    assert api is not None
    if part in ("whole", "live"):
        from llmp.live.contract import LiveConfig
        from llmp.live.view import LiveView
        from llmp.recorder.builder import read_capture
        from llmp.recorder.child import feed

        view = LiveView(LiveConfig(), body="digest", first_id=0, say=lambda level, line: None)
        if part == "live":
            lines = [build_line(_capture(b, pieces, i), "digest") for i, b in enumerate(bodies)]
            return lambda i: feed(view, lines[i], "digest")
        requests = []
        for i, b in enumerate(bodies):
            head, buffers, _size = capture_request(_capture(b, pieces, i), "digest")
            requests.append((pickle.loads(head), memoryview(b"".join(buffers))))

        def whole(i: int) -> None:
            cap, mode = read_capture(*requests[i])
            feed(view, build_line(cap, mode), mode)

        return whole
    if part in ("build", "full"):
        mode = "digest" if part == "build" else "full"
        caps = [_capture(b, pieces, i) for i, b in enumerate(bodies)]
        return lambda i: build_line(caps[i], mode)
    if part == "request_loads":
        return lambda i: canonical.loads(bodies[i])
    if part == "request_digest":
        parsed = [canonical.loads(b) for b in bodies]
        return lambda i: api.request_digest(parsed[i])
    if part == "request_bytes":
        if not hasattr(api, "request_digest_bytes"):  # a tree from before it
            return lambda i: api.request_digest(canonical.loads(bodies[i]))
        return lambda i: api.request_digest_bytes(bodies[i])
    if part == "stream":
        rest = b"".join(pieces[1:])

        def stream(i: int) -> None:
            s = StreamCapture("sse", len(rest) + len(pieces[0]) + 1, api)
            s.feed(pieces[0])  # the first event, then the rest in one piece (`record.py`)
            s.feed(rest)
            s.close()
            api.response_digest(s.merged() or {})

        return stream
    raise SystemExit(f"unknown part {part!r}")


def worker(data_file: str, part: str, count: int) -> None:
    with open(data_file, "rb") as f:
        bodies, pieces = pickle.load(f)
    run = _runner(part, bodies, pieces)
    run(0)  # warm-up: first-use costs (decoders made, caches filled) are not counted
    for i in range(1, count + 1):
        run(i)


# ------------------------------------------------------------------------ driver


def _instructions(cmd: list[str], env: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        m = re.search(r"Collected : (\d+)", proc.stderr)
        if m is None:
            raise SystemExit(f"no instruction count in valgrind's output:\n{proc.stderr[-2000:]}")
        return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS)
    )
    ap.add_argument("-n", type=int, default=5, help="exchanges counted (after one warm-up)")
    ap.add_argument(
        "--growing", action="store_true", help="a conversation growing by a turn each exchange"
    )
    ap.add_argument(
        "--cold", action="store_true", help="every request another conversation (no message seen)"
    )
    ap.add_argument(
        "--addon-dir", default=str(REPO_DIR / "addon"), help="the tree whose llmp is measured"
    )
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the whole part instead (no valgrind)"
    )
    ap.add_argument("--worker", nargs=3, metavar=("DATA", "PART", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, os.environ["CHILD_COST_ADDON"])
        data, part, n = args.worker
        worker(data, part, int(n))
        return
    addon = str(Path(args.addon_dir).resolve())
    env = dict(os.environ, CHILD_COST_ADDON=addon)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", os.path.join(addon, "llmp")], check=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "exchanges.pickle")
        with open(data, "wb") as f:
            bodies = request_bodies(args.n + 1, args.growing, cold=args.cold)
            pickle.dump((bodies, stream_pieces(EVENTS)), f)
        me = [sys.executable, os.path.abspath(__file__), "--worker", data]
        if args.profile:
            import cProfile
            import pstats

            sys.path.insert(0, addon)
            with open(data, "rb") as f:
                bodies, pieces = pickle.load(f)
            run = _runner("whole", bodies, pieces)
            run(0)
            prof = cProfile.Profile()
            prof.enable()
            for i in range(1, args.n + 1):
                run(i)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return
        what = (
            "a new conversation every time"
            if args.cold
            else "a growing conversation"
            if args.growing
            else "the bench's body every time"
        )
        print(f"llmp from {addon}; {args.n} exchanges after a warm-up; {what}")
        print(f"{'part':<16} {'M instructions per exchange':>28}")
        for part in args.parts.split(","):
            base = _instructions([*me, part, "0"], env)
            more = _instructions([*me, part, str(args.n)], env)
            print(f"{part:<16} {(more - base) / args.n / 1e6:>28.2f}", flush=True)


if __name__ == "__main__":
    main()
