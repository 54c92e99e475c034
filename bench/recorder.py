"""Benchmark: what the recorder costs a stream, next to direct and plain mitmdump.

    .venv/bin/python bench/recorder.py            # about 13 minutes on 2 cores
    .venv/bin/python bench/recorder.py --quick    # about 4 minutes, a smoke run

Four paths carry the same traffic from one upstream to one client:

- ``direct``: client -> upstream;
- ``plain``: client -> ``mitmdump`` (no addon; ``stream_large_bodies=1`` so that
  it streams SSE at all: without a stream setting mitmproxy holds an SSE
  response until it ends, mitmproxy issue #4469) -> upstream;
- ``digest`` / ``full``: client -> ``mitmdump -s addon/llmp_addon.py`` with
  ``llmp_body=digest`` / ``full`` -> upstream.

The upstream (``bench/sse_upstream.py``) and each ``mitmdump`` run in processes
of their own; the client (``bench/sse_client.py``, raw asyncio) runs in this
one. All three proxies stay up for the whole run, and every figure is taken
in rounds that visit the paths in a rotating order, so drift (thermal, other
load) spreads over all of them. Everything listens on 127.0.0.1 only.

What is measured (see ``docs/performance.md`` for the reading):

- throughput: events/s over long streams and requests/s over short ones, with
  1 and 8 connections each looping requests back to back, counted over a
  fixed window after a warm-up; the median over the rounds.  The ``chat``
  cells are agent-like exchanges: a 300-event stream for a 300 KB request;
- the proxy's CPU per event and per exchange: all of it (threads and the
  builder child), and the proxy's own process alone (what takes turns with
  mitmproxy's event loop for the GIL and, on a busy machine, for a core);
- per-chunk delay: a stream spaced ``delay_ms`` apart, one at a time; for every
  event after the first, client receive time minus the upstream's write time
  (both ``CLOCK_MONOTONIC``, which Linux shares between processes). The
  *added* delay of a path is its quantile minus the same quantile of the
  reference path (direct, or plain mitmdump for the targets);
- end-of-stream delay: a chat request of about 300 KB, a short spaced stream;
  client time of the terminating chunk minus the upstream's time just before
  it wrote that chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(REPO_DIR))  # tests.support: the mitmdump harness

from sse_client import Connection, Counters, build_request  # noqa: E402
from tests.support.mitm import Mitmdump  # noqa: E402

# ----------------------------------------------------------------- parameters


@dataclass
class Params:
    rounds: int = 3
    warmup_s: float = 0.4
    window_s: float = 2.0
    long_events: int = 500  # content deltas per "long" stream (events/s)
    short_events: int = 8  # content deltas per "short" stream (requests/s)
    chat_events: int = 297  # content deltas per "chat" stream (300 events), 300 KB requests
    chat_rounds: int = 3  # rounds of the chat cells in the throughput table
    chat_pairs: int = 8  # adjacent recorder / plain window pairs per chat cell (the targets)
    concurrency: tuple[int, ...] = (1, 8)
    spaced_events: int = 100  # content deltas per spaced stream
    spaced_streams: int = 3  # spaced streams per path and round
    spaced_delay_ms: float = 5.0
    busy_gap_ms: float = 20.0  # between the 300 KB background exchanges
    eos_requests: int = 15  # per path and round
    live_pairs: int = 6  # live view on/off window pairs per throughput cell, at least...
    live_pairs_max: int = 12  # ...and at most, until the ratios' standard error is small:
    live_se: float = 0.015
    eos_events: int = 20
    eos_delay_ms: float = 2.0
    big_body_bytes: int = 300_000
    seed: int = 1

    def describe(self) -> list[str]:
        c = "/".join(map(str, self.concurrency))
        return [
            f"rounds {self.rounds}, paths visited in a rotating order each round",
            f"throughput: {c} connection(s) looping requests; warm-up {self.warmup_s:g} s, "
            f"window {self.window_s:g} s; median of the rounds",
            f"  events/s: long streams, {self.long_events} content deltas "
            f"({self.long_events + 3} SSE events) per response, ~1.5 KB request",
            f"  requests/s: short streams, {self.short_events} content deltas "
            f"({self.short_events + 3} events) per response, ~1.5 KB request",
            f"  chat: events/s, {self.chat_events + 3}-event streams for "
            f"{self.big_body_bytes // 1000} KB chat requests; {self.chat_rounds} rounds",
            f"chat targets: {self.chat_pairs} pairs of adjacent windows per cell and recorder "
            "(digest mode), the recorder then plain mitmdump, or plain then the recorder "
            "(alternating); the median of the pairs' ratios",
            f"per-chunk delay: 1 stream at a time, {self.spaced_events + 3} events "
            f"{self.spaced_delay_ms:g} ms apart, {self.spaced_streams} streams per path and "
            "round, the paths taking turns stream by stream (the first event of each stream, "
            "which follows the response head, left out)",
            "per-chunk delay, busy: the same stream while another connection sends "
            f"{self.big_body_bytes // 1000} KB chat requests ({self.eos_events + 3}-event "
            f"replies at full speed) {self.busy_gap_ms:g} ms apart",
            f"end of stream: {self.big_body_bytes // 1000} KB chat request, "
            f"{self.eos_events + 3} events {self.eos_delay_ms:g} ms apart, "
            f"{self.eos_requests} requests per path and round, the paths taking turns",
            f"live view cost: {self.live_pairs} to {self.live_pairs_max} pairs of windows per "
            "throughput cell (more while the standard error of the pairs' ratios is above "
            f"{self.live_se:.1%}), the recorder with its live view on, then off (or off, then "
            "on: alternating); the median of the pairs' ratios",
        ]


QUICK = Params(
    rounds=1,
    warmup_s=0.3,
    window_s=1.0,
    long_events=300,
    chat_rounds=2,
    spaced_streams=2,
    eos_requests=12,
    live_pairs=4,
    chat_pairs=4,
    live_pairs_max=8,
)

# ---------------------------------------------------------------- request bodies

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an which "
    "function return value file path error test build module class import def self "
    "config option stream token cache prompt request response server client proxy "
    "record digest message tool call result output input line byte chunk event"
).split()


def _text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:size]


def chat_body(size: int, seed: int) -> bytes:
    """An agent-like streamed chat request of about ``size`` bytes of JSON."""
    rng = random.Random(seed)
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _text(rng, 200),
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["path"],
                },
            },
        }
        for name in ("read_file", "run_shell", "search")
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _text(rng, min(4000, size // 4))},
        {"role": "user", "content": _text(rng, 300)},
    ]
    body: dict[str, Any] = {
        "model": "bench",
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": tools,
        "messages": messages,
    }
    turn = 0
    while len(json.dumps(body)) < size:
        call_id = f"call_{turn:04d}"
        messages.append(
            {
                "role": "assistant",
                "content": _text(rng, 200),
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path":"src/x.py"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, 4000)})
        turn += 1
    messages.append({"role": "user", "content": _text(rng, 300)})
    return json.dumps(body, separators=(",", ":")).encode()


SMALL_BODY = json.dumps(
    {
        "model": "bench",
        "stream": True,
        "messages": [
            {"role": "system", "content": _text(random.Random(0), 1000)},
            {"role": "user", "content": _text(random.Random(1), 300)},
        ],
    },
    separators=(",", ":"),
).encode()

# ------------------------------------------------------------------------ paths


@dataclass
class PathInfo:
    name: str
    label: str
    port: int
    proxy: Mitmdump | None = None
    recording: Path | None = None
    requests: int = 0  # completed through this path (to check the recording)
    seen_bytes: int = 0  # how far `settle` has read the recording
    seen_lines: int = 0


class UpstreamProcess:
    """``bench/sse_upstream.py`` in a process of its own; stops when its stdin closes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "sse_upstream.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"upstream did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def fetch_log(self, tag: str) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", f"/_bench/log?tag={tag}")
            data = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        if not isinstance(data, dict):
            raise RuntimeError(f"upstream has no log for {tag}")
        return data

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Variant:
    """A recorder to put on a path of its own: the addon in ``addon_dir``, in ``mode``."""

    name: str
    addon_dir: Path | None
    mode: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``NAME=DIR`` or ``NAME=DIR:MODE``: mode ``digest`` (default), ``full``, or
        ``none`` for an addon that records nothing (a baseline)."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise argparse.ArgumentTypeError(f"expected NAME=DIR[:MODE], got {text!r}")
        path, _, mode = rest.partition(":")
        if mode not in ("", "digest", "full", "none"):
            raise argparse.ArgumentTypeError(f"mode must be digest, full or none, not {mode!r}")
        return cls(name, Path(path), mode or "digest")


def _recorder_env(addon_dir: Path | None) -> tuple[Path, dict[str, str]]:
    env = dict(os.environ)
    if addon_dir is None:
        return REPO_DIR / "addon" / "llmp_addon.py", env
    # a modified recorder: DIR/llmp_addon.py, with DIR/llmp/ imported first
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(addon_dir), env.get("PYTHONPATH")]))
    return addon_dir / "llmp_addon.py", env


def start_paths(
    upstream: UpstreamProcess, tmp: Path, addon_dir: Path | None, variants: Sequence[Variant]
) -> dict[str, PathInfo]:
    """Start the mitmdumps side by side (their start-ups overlap)."""
    specs = [
        *(Variant(m, addon_dir, m) for m in ("digest", "full")),
        # the same recorder with its live view off: what the live view costs
        Variant("nolive", addon_dir, "digest", (("llmp_live", "false"),)),
        *variants,
    ]
    proxies: dict[str, tuple[str, Mitmdump]] = {
        "plain": (
            "mitmdump (no addon)",
            Mitmdump(
                upstream.url, script=None, wait_ready=False, options={"stream_large_bodies": "1"}
            ),
        )
    }
    for v in specs:
        script, env = _recorder_env(v.addon_dir)
        md = Mitmdump(
            upstream.url,
            tmp / f"{v.name}.jsonl",
            {"llmp_body": v.mode, **dict(v.options)},
            script=script,
            env=env,
        )
        label = f"mitmdump + recorder, {v.mode}"
        if v.name == "nolive":
            label = "mitmdump + recorder, digest, live view off"
        elif v.name != v.mode:
            label = f"{v.name} ({v.mode})"
        proxies[v.name] = (label, md)
    with concurrent.futures.ThreadPoolExecutor(len(proxies)) as pool:
        futures = {name: pool.submit(md.start) for name, (_, md) in proxies.items()}
        errors = []
        for name, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:
                errors.append(f"{name}: {exc}")
    if errors:
        for _, md in proxies.values():
            md.close()
        raise RuntimeError("mitmdump did not start:\n" + "\n".join(errors))
    by_name = {v.name: v for v in specs}
    paths = {"direct": PathInfo("direct", "direct", upstream.port)}
    for name, (label, md) in proxies.items():
        records = name != "plain" and not (name in by_name and by_name[name].mode == "none")
        recording = tmp / f"{name}.jsonl" if records else None
        paths[name] = PathInfo(name, label, md.port, md, recording)
    return paths


def recorders(paths: dict[str, PathInfo]) -> list[str]:
    return [n for n, info in paths.items() if info.recording is not None]


def proxied(paths: dict[str, PathInfo]) -> list[str]:
    return [n for n, info in paths.items() if info.proxy is not None]


# ------------------------------------------------------------------ measurements


def _lines(info: PathInfo) -> int:
    """Lines in the path's recording so far (read incrementally)."""
    assert info.recording is not None
    try:
        with open(info.recording, "rb") as fh:
            fh.seek(info.seen_bytes)
            for block in iter(lambda: fh.read(1 << 20), b""):
                info.seen_bytes += len(block)
                info.seen_lines += block.count(b"\n")
    except FileNotFoundError:
        pass
    return info.seen_lines


async def settle(paths: dict[str, PathInfo], timeout: float = 120.0) -> float:
    """Wait until every recorder wrote a record per request: its writer thread is idle.

    A recorder still writing the backlog of one measurement would take CPU from
    the next, which may be another path's. Returns the seconds waited.
    """
    t0 = time.monotonic()
    for info in paths.values():
        if info.recording is None:
            continue
        while _lines(info) < info.requests:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{info.name}: recorder still behind after {timeout:g} s")
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    return time.monotonic() - t0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
    except (OSError, ValueError):
        pass
    return kids


def cpu_ns(pid: int, children: bool = True) -> int:
    """CPU time of all threads of a process (and of its live descendants), in ns.

    From ``/proc/PID/task/*/schedstat``, so a recorder that hands work to a
    helper process is charged for it too.
    """
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    if children:
        total += sum(cpu_ns(kid) for kid in _children(pid))
    return total


def system_busy_ns() -> int:
    """CPU time the whole machine spent busy since boot, in ns (``/proc/stat``)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (
        (user + nice + system + irq + softirq + steal) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    )


class LoadMeter:
    """How much CPU processes other than ours used during the run."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.t0 = time.monotonic()
        self.busy0 = system_busy_ns()
        self.ours0 = sum(cpu_ns(pid) for pid in self.pids)

    def others(self) -> float:
        """Other processes' CPU, as a fraction of all cores over the run so far."""
        wall = time.monotonic() - self.t0
        busy = system_busy_ns() - self.busy0
        ours = sum(cpu_ns(pid) for pid in self.pids) - self.ours0
        return max(0.0, (busy - ours) / 1e9 / (wall * (os.cpu_count() or 1)))


def wait_quiet(limit_s: float, progress: Callable[[str], None]) -> float:
    """Wait (up to ``limit_s``) for 3 s in which the machine is < 5 % busy; return that load."""
    deadline = time.monotonic() + limit_s
    cores = os.cpu_count() or 1
    while True:
        b0, t0 = system_busy_ns(), time.monotonic()
        time.sleep(3)
        busy = (system_busy_ns() - b0) / 1e9 / ((time.monotonic() - t0) * cores)
        if busy < 0.05 or time.monotonic() > deadline:
            progress(f"machine {busy:.0%} busy before the run")
            return busy


@dataclass
class Cell:
    events_s: float
    requests_s: float
    #: the proxy's CPU (all threads, the writer's backlog included) per event and per request
    cpu_us_event: float | None
    cpu_us_request: float | None
    #: the same, the proxy's own process only (its threads; no builder child)
    own_us_event: float | None
    own_us_request: float | None
    #: how long the recorder took to write its backlog after the window closed
    backlog_s: float


async def throughput(
    paths: dict[str, PathInfo],
    name: str,
    conc: int,
    events: int,
    p: Params,
    body: bytes = SMALL_BODY,
) -> Cell:
    """Rates over the window, with ``conc`` connections looping requests back to back."""
    path = paths[name]
    counters = Counters()
    raw = build_request(path.port, body, f"events={events}")
    conns = [await Connection.open(path.port, counters) for _ in range(conc)]
    pid = path.proxy.pid if path.proxy is not None else None
    stop = False

    async def worker(conn: Connection) -> int:
        done = 0
        while not stop:
            resp = await conn.request(raw)
            if resp.status != 200 or resp.events != events + 3:
                raise RuntimeError(f"{path.name}: status {resp.status}, {resp.events} events")
            done += 1
        return done

    tasks = [asyncio.create_task(worker(c)) for c in conns]
    try:
        async with asyncio.timeout(p.warmup_s + p.window_s + 60):
            await asyncio.sleep(p.warmup_s)
            c0 = cpu_ns(pid) if pid else 0
            o0 = cpu_ns(pid, children=False) if pid else 0
            e0, r0, t0 = counters.events, counters.responses, time.monotonic()
            await asyncio.sleep(p.window_s)
            e1, r1, t1 = counters.events, counters.responses, time.monotonic()
            stop = True
            path.requests += sum(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for c in conns:
            c.close()
    # The recorder may still be writing records of the window: that work is
    # part of the price of these requests, and must not fall on the next run.
    backlog = await settle(paths)
    cpu_event = cpu_request = own_event = own_request = None
    if pid:
        cpu = (cpu_ns(pid) - c0) / 1000
        own = (cpu_ns(pid, children=False) - o0) / 1000
        n_events = max(1, counters.events - e0)
        n_requests = max(1, counters.responses - r0)
        cpu_event, cpu_request = cpu / n_events, cpu / n_requests
        own_event, own_request = own / n_events, own / n_requests
    return Cell(
        (e1 - e0) / (t1 - t0),
        (r1 - r0) / (t1 - t0),
        cpu_event,
        cpu_request,
        own_event,
        own_request,
        backlog,
    )


async def spaced(
    path: PathInfo, upstream: UpstreamProcess, tag: str, body: bytes, spec: str, n: int
) -> list[tuple[list[int], list[int], int, int]]:
    """``n`` tagged requests, one by one: (upstream writes, client times, ends)."""
    conn = await Connection.open(path.port, Counters())
    out: list[tuple[list[int], list[int], int, int]] = []
    try:
        for i in range(n):
            t = f"{tag}-{i}"
            raw = build_request(path.port, body, f"{spec},tag={t}")
            async with asyncio.timeout(60):
                resp = await conn.request(raw, times=True)
            path.requests += 1
            log = upstream.fetch_log(t)
            writes: list[int] = log["writes"]
            if resp.status != 200 or len(resp.event_times) != len(writes):
                raise RuntimeError(
                    f"{path.name}: status {resp.status}, "
                    f"{len(resp.event_times)} events received, {len(writes)} written"
                )
            out.append((writes, resp.event_times, int(log["end"]), resp.t_end))
    finally:
        conn.close()
    return out


async def background(path: PathInfo, body: bytes, p: Params, stop: asyncio.Event) -> int:
    """300 KB exchanges on another connection, ``busy_gap_ms`` apart, until ``stop``."""
    conn = await Connection.open(path.port, Counters())
    raw = build_request(path.port, body, f"events={p.eos_events}")
    n = 0
    try:
        while not stop.is_set():
            async with asyncio.timeout(60):
                resp = await conn.request(raw)
            if resp.status != 200:
                raise RuntimeError(f"{path.name}: background status {resp.status}")
            path.requests += 1
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), p.busy_gap_ms / 1000)
    finally:
        conn.close()
    return n


# ------------------------------------------------------------------------ stats


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in 0..1) of a non-empty sequence."""
    s = sorted(values)
    if not s:
        return float("nan")
    x = q * (len(s) - 1)
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def standard_error(values: Sequence[float]) -> float:
    """Of the mean: the spread of the values over the root of their number."""
    n = len(values)
    if n < 2:
        return float("inf")
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


@dataclass
class Results:
    # throughput[path]["ev@1"] = list over rounds
    throughput: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    chunk_ms: dict[str, list[float]] = field(default_factory=dict)
    chunk_busy_ms: dict[str, list[float]] = field(default_factory=dict)
    busy_exchanges: dict[str, int] = field(default_factory=dict)
    eos_ms: dict[str, list[float]] = field(default_factory=dict)
    backlog_s: dict[str, float] = field(default_factory=dict)
    # cpu_us[path][cell] = proxy CPU µs per event (ev, chat cells) or per request (req cells)
    cpu_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # own_us[path][cell] = the same, the proxy's own process only (no builder child)
    own_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # exch_us[path][cell] = the proxy's own process, µs per exchange, every cell
    exch_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # live_ratio[cell] = per pair, the throughput with the live view on / off
    live_ratio: dict[str, list[float]] = field(default_factory=dict)
    # chat_pairs[path][cell] = per pair (events/s ratio, own CPU plain/path, all CPU plain/path)
    chat_pairs: dict[str, dict[str, list[tuple[float, float, float]]]] = field(default_factory=dict)


def _cell(kind: str, conc: int) -> str:
    return f"{kind}@{conc}"


KINDS = ("ev", "req", "chat")
"""Throughput cells: events/s (long streams), requests/s (short), events/s (chat)."""


def _head(kind: str, conc: int) -> str:
    what = {"ev": "events/s", "req": "req/s", "chat": "chat ev/s"}[kind]
    return f"{what} @{conc}"


def _per_event(cell: str) -> bool:
    """Whether the cell is judged on events (else on requests)."""
    return not cell.startswith("req")


# ------------------------------------------------------------------------- run


def rotated(names: Sequence[str], r: int) -> list[str]:
    k = r % len(names)
    return [*names[k:], *names[:k]]


async def run(
    paths: dict[str, PathInfo],
    upstream: UpstreamProcess,
    p: Params,
    progress: Callable[[str], None],
) -> Results:
    res = Results()
    for name in paths:
        res.throughput[name] = {}
        res.chunk_ms[name] = []
        res.chunk_busy_ms[name] = []
        res.eos_ms[name] = []
        res.cpu_us[name] = {}
        res.own_us[name] = {}
        res.exch_us[name] = {}
    big = chat_body(p.big_body_bytes, p.seed)
    loads = (
        ("ev", p.long_events, SMALL_BODY, p.rounds),
        ("req", p.short_events, SMALL_BODY, p.rounds),
        ("chat", p.chat_events, big, p.chat_rounds),
    )
    for kind, events, body, rounds in loads:
        for conc in p.concurrency:
            cell = _cell(kind, conc)
            for r in range(rounds):
                for name in rotated(list(paths), r):
                    c = await throughput(paths, name, conc, events, p, body)
                    ev = _per_event(cell)
                    res.throughput[name].setdefault(cell, []).append(
                        c.events_s if ev else c.requests_s
                    )
                    cpu = c.cpu_us_event if ev else c.cpu_us_request
                    own = c.own_us_event if ev else c.own_us_request
                    if cpu is not None and own is not None and c.own_us_request is not None:
                        res.cpu_us[name].setdefault(cell, []).append(cpu)
                        res.own_us[name].setdefault(cell, []).append(own)
                        res.exch_us[name].setdefault(cell, []).append(c.own_us_request)
                    res.backlog_s[name] = max(res.backlog_s.get(name, 0.0), c.backlog_s)
            progress(f"throughput {cell} done")
    # Latency: short runs, the paths taking turns run by run, so that whatever
    # else the machine does falls on all of them alike.
    spec = f"events={p.spaced_events},delay_ms={p.spaced_delay_ms:g}"
    turns = p.rounds * p.spaced_streams
    for t in range(turns):
        for name in rotated(list(paths), t):
            await settle(paths)
            for writes, got, _, _ in await spaced(
                paths[name], upstream, f"chunk-{name}-{t}", SMALL_BODY, spec, 1
            ):
                pairs = zip(writes[1:], got[1:], strict=True)
                res.chunk_ms[name] += [(b - a) / 1e6 for a, b in pairs]
    progress("per-chunk delay done")
    for t in range(turns):
        for name in rotated(list(paths), t):
            await settle(paths)
            stop = asyncio.Event()
            bg = asyncio.create_task(background(paths[name], big, p, stop))
            try:
                measured = await spaced(
                    paths[name], upstream, f"busy-{name}-{t}", SMALL_BODY, spec, 1
                )
            finally:
                stop.set()
                res.busy_exchanges[name] = res.busy_exchanges.get(name, 0) + await bg
            for writes, got, _, _ in measured:
                pairs = zip(writes[1:], got[1:], strict=True)
                res.chunk_busy_ms[name] += [(b - a) / 1e6 for a, b in pairs]
    progress("per-chunk delay alongside 300 KB exchanges done")
    eos_spec = f"events={p.eos_events},delay_ms={p.eos_delay_ms:g}"
    for t in range(p.rounds * p.eos_requests):
        for name in rotated(list(paths), t):
            await settle(paths)
            for _, _, end, got_end in await spaced(
                paths[name], upstream, f"eos-{name}-{t}", big, eos_spec, 1
            ):
                res.eos_ms[name].append((got_end - end) / 1e6)
    progress("end-of-stream delay done")
    await chat_pairs(paths, p, res, big, progress)
    if "nolive" in paths and "digest" in paths:
        await live_pairs(paths, p, res, progress)
    return res


def paired(paths: dict[str, PathInfo]) -> list[str]:
    """The recorders judged on the chat load in pairs: digest, and the digest variants."""
    return [n for n in recorders(paths) if n not in ("full", "nolive")]


async def chat_pairs(
    paths: dict[str, PathInfo],
    p: Params,
    res: Results,
    body: bytes,
    progress: Callable[[str], None],
) -> None:
    """The recorder against plain mitmdump on the chat load, in adjacent windows.

    The throughput table's medians compare windows taken a minute apart,
    and on a shared 2-core machine the rates drift by tens of percent over
    that; two adjacent windows share the machine's state, so the ratio within
    a pair holds up far better (as for the live view's price).
    """
    for conc in p.concurrency:
        cell = _cell("chat", conc)
        for name in paired(paths):
            pairs = res.chat_pairs.setdefault(name, {}).setdefault(cell, [])
            for i in range(p.chat_pairs):
                order = [name, "plain"] if i % 2 == 0 else ["plain", name]
                got = {n: await throughput(paths, n, conc, p.chat_events, p, body) for n in order}
                rec, plain = got[name], got["plain"]
                assert rec.own_us_request and plain.own_us_request
                assert rec.cpu_us_request and plain.cpu_us_request
                pairs.append(
                    (
                        rec.events_s / plain.events_s,
                        plain.own_us_request / rec.own_us_request,
                        plain.cpu_us_request / rec.cpu_us_request,
                    )
                )
        progress(f"chat pairs {cell} done")


async def live_pairs(
    paths: dict[str, PathInfo], p: Params, res: Results, progress: Callable[[str], None]
) -> None:
    """The live view's price: throughput on/off, in adjacent windows, pair by pair.

    Two windows side by side share the machine's state (drift, other load),
    so the ratio within a pair is steadier than a ratio of medians taken over
    the whole run; the median over the pairs then drops the odd one out.
    """
    for kind, events in (("ev", p.long_events), ("req", p.short_events)):
        for conc in p.concurrency:
            cell = _cell(kind, conc)
            ratios = res.live_ratio.setdefault(cell, [])
            while len(ratios) < p.live_pairs_max:
                order = ["digest", "nolive"] if len(ratios) % 2 == 0 else ["nolive", "digest"]
                rate: dict[str, float] = {}
                for name in order:
                    c = await throughput(paths, name, conc, events, p)
                    rate[name] = c.events_s if kind == "ev" else c.requests_s
                ratios.append(rate["digest"] / rate["nolive"])
                # Stop on an even count, so that each order (on first, off first) counts alike.
                enough = len(ratios) >= p.live_pairs and len(ratios) % 2 == 0
                if enough and standard_error(ratios) <= p.live_se:
                    break
            progress(f"live view pairs {cell} done ({len(ratios)} pairs)")


# ---------------------------------------------------------------------- report


def machine() -> list[str]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return [
        f"cores: {os.cpu_count()} ({usable} usable){', ' + model if model else ''}",
        f"os: {platform.platform()}",
        f"python: {platform.python_version()} ({platform.python_implementation()})",
        f"mitmproxy: {importlib.metadata.version('mitmproxy')}",
    ]


def report(paths: dict[str, PathInfo], res: Results, p: Params) -> list[str]:
    lines: list[str] = []
    cells = [_cell(k, c) for k in KINDS for c in p.concurrency]
    heads = [_head(k, c) for k in KINDS for c in p.concurrency]
    tp = {n: {c: median(v) for c, v in res.throughput[n].items()} for n in paths}
    judged = [n for n in proxied(paths) if n != "plain"]  # compared with plain mitmdump
    w = max(map(len, judged))

    def row(label: str, cols: Sequence[str], w: int = 13) -> str:
        return f"{label:<30}" + "".join(f"{c:>{w}}" for c in cols)

    lines.append("Throughput (median of rounds)")
    lines.append(row("path", heads))
    for n, info in paths.items():
        lines.append(row(info.label, [f"{tp[n][c]:,.0f}" for c in cells]))
    lines.append(row("  ratio to plain mitmdump", []))
    for n in proxied(paths):
        lines.append(row(f"  {n}", [f"{tp[n][c] / tp['plain'][c]:.3f}" for c in cells]))
    spread = {
        n: max((max(v) - min(v)) / median(v) for v in res.throughput[n].values() if median(v) > 0)
        for n in paths
    }
    if p.rounds > 1:
        lines.append(
            "  spread between rounds, worst cell (max-min)/median: "
            + ", ".join(f"{n} {spread[n]:.1%}" for n in paths)
        )
    lines.append("")
    lines.append(
        "Proxy CPU per event (events/s cells) and per request (req/s cells), in µs: all its "
        "threads and child processes, the recorder's work on its backlog included"
    )
    lines.append(row("path", heads))
    cpu = {n: {c: median(v) for c, v in res.cpu_us[n].items()} for n in proxied(paths)}
    for n in proxied(paths):
        lines.append(row(paths[n].label, [f"{cpu[n][c]:.1f}" for c in cells]))
    lines.append(row("  plain / path (CPU-bound ratio)", []))
    for n in judged:
        lines.append(row(f"  {n}", [f"{cpu['plain'][c] / cpu[n][c]:.3f}" for c in cells]))
    lines.append("")
    lines.append(
        "The proxy's own process only (its threads: the event loop and the writer; not the "
        "builder child), in µs per event / per request as above"
    )
    lines.append(row("path", heads))
    own = {n: {c: median(v) for c, v in res.own_us[n].items()} for n in proxied(paths)}
    exch = {n: {c: median(v) for c, v in res.exch_us[n].items()} for n in proxied(paths)}
    for n in proxied(paths):
        lines.append(row(paths[n].label, [f"{own[n][c]:.1f}" for c in cells]))
    lines.append(row("  per exchange, µs", []))
    for n in proxied(paths):
        lines.append(row(f"  {n}", [f"{exch[n][c]:,.0f}" for c in cells]))
    lines.append(row("  plain / path", []))
    for n in judged:
        lines.append(row(f"  {n}", [f"{own['plain'][c] / own[n][c]:.3f}" for c in cells]))
    lines.append(
        "  writer backlog when the window closed, worst cell: "
        + ", ".join(f"{n} {res.backlog_s.get(n, 0.0):.2f} s" for n in recorders(paths))
    )
    lines.append("")

    series = {
        "chunk": ("per chunk, one stream at a time", res.chunk_ms),
        "busy": ("per chunk, while 300 KB exchanges end alongside", res.chunk_busy_ms),
        "eos": ("end of stream, 300 KB request", res.eos_ms),
    }
    q = {
        key: {n: (quantile(data[n], 0.5), quantile(data[n], 0.99)) for n in paths}
        for key, (_, data) in series.items()
    }
    lines.append(
        "Delays in ms. per chunk: upstream write -> client receive, each event; "
        "end of stream: upstream's last write -> client sees the end."
    )
    lines.append(
        "+x ref = quantile x of the path minus quantile x of the reference path "
        "(direct, or plain mitmdump)"
    )
    lines.append(row("", ["p50", "p99", "+p50 dir", "+p99 dir", "+p50 plain", "+p99 plain"], 11))
    for key, (title, data) in series.items():
        lines.append(f"{title} ({len(data['direct'])} samples per path)")
        d, pl = q[key]["direct"], q[key]["plain"]
        for n, info in paths.items():
            v50, v99 = q[key][n]
            cols = [f"{v50:.3f}", f"{v99:.3f}"]
            cols += ["", ""] if n == "direct" else [f"{v50 - d[0]:+.3f}", f"{v99 - d[1]:+.3f}"]
            cols += [f"{v50 - pl[0]:+.3f}", f"{v99 - pl[1]:+.3f}"] if n in judged else []
            lines.append(row("  " + info.label, cols, 11))
    lines.append(
        "  background 300 KB exchanges during the busy runs: "
        + ", ".join(f"{n} {res.busy_exchanges.get(n, 0)}" for n in paths)
    )
    lines.append("")

    lines.append("Targets, against plain mitmdump")
    for n in judged:
        ratios = [tp[n][c] / tp["plain"][c] for c in cells]
        worst = min(ratios)
        lines.append(
            f"  {n:<{w}} throughput >= 0.95 of plain: worst cell {worst:.3f} "
            f"({cells[ratios.index(worst)]})  {'MET' if worst >= 0.95 else 'MISSED'}"
        )
        for cell, pairs in res.chat_pairs.get(n, {}).items():
            rate = median([r for r, _, _ in pairs])
            cost = median([c for _, c, _ in pairs])
            lines.append(
                f"  {n:<{w}} {cell}, paired windows: events/s {rate:.3f} and the proxy's own "
                f"CPU per exchange {cost:.3f} of plain's, both >= 0.95  "
                f"{'MET' if min(rate, cost) >= 0.95 else 'MISSED'}"
            )
        for key, what in (("chunk", "one stream"), ("busy", "with 300 KB exchanges")):
            add = q[key][n][1] - q[key]["plain"][1]
            lines.append(
                f"  {n:<{w}} p99 added per-chunk delay <= 0.5 ms, {what}: {add:+.3f} ms  "
                f"{'MET' if add <= 0.5 else 'MISSED'}"
            )
        e50 = q["eos"][n][0] - q["eos"]["plain"][0]
        e99 = q["eos"][n][1] - q["eos"]["plain"][1]
        lines.append(
            f"  {n:<{w}} end-of-stream delay <= 1 ms over plain: p50 {e50:+.3f} ms, "
            f"p99 {e99:+.3f} ms  {'MET' if e99 <= 1.0 else 'MISSED'} (judged on p99)"
        )
    if res.chat_pairs:
        lines.append("")
        lines.append(
            "Chat load (300-event streams for 300 KB requests), the recorder against plain "
            "mitmdump in adjacent windows: the median of the pairs' ratios (standard error)"
        )
        lines.append(
            row("recorder, cell", ["events/s", "own CPU", "all CPU"], 18)
            + "   (CPU: plain's per exchange / the recorder's; own: the proxy's process, "
            "all: with the builder child)"
        )
        for n, cells_ in res.chat_pairs.items():
            for cell, pairs in cells_.items():
                cols = []
                for k in range(3):
                    xs = [pair[k] for pair in pairs]
                    cols.append(f"{median(xs):.3f} ({standard_error(xs):.1%})")
                lines.append(row(f"  {n} {cell}", cols, 18))
            for cell, pairs in cells_.items():
                lines.append(
                    f"  {n} {cell} pairs, events/s: " + " ".join(f"{r:.3f}" for r, _, _ in pairs)
                )
    if res.live_ratio:
        lines.append("")
        lines.append(
            "Live view: throughput with it on / off, digest, in adjacent windows "
            f"({p.live_pairs} to {p.live_pairs_max} pairs per cell)"
        )
        costs: dict[str, float] = {}
        for cell in cells:
            ratios = res.live_ratio.get(cell, [])
            if not ratios:
                continue
            costs[cell] = 1 - median(ratios)
            lines.append(
                f"  {cell:<7} pairs {' '.join(f'{r:.3f}' for r in ratios)}  "
                f"median {median(ratios):.3f}  cost {costs[cell]:+.1%} "
                f"(standard error {standard_error(ratios):.1%})"
            )
        worst_cell = max(costs, key=lambda c: costs[c])
        worst = costs[worst_cell]
        lines.append(
            f"  live view costs < 5% of the recorder's throughput (digest, live on vs off, "
            f"median of pairs): worst cell {worst:.1%} ({worst_cell})  "
            f"{'MET' if worst < 0.05 else 'MISSED'}"
        )
        if p.live_pairs_max < 12:
            lines.append(
                "  (a smoke run, with fewer pairs and shorter windows: judge the figure on a "
                "full run)"
            )
    return lines


def check_recordings(paths: dict[str, PathInfo]) -> list[str]:
    """After the proxies stopped: one record per request, and no errors."""
    lines = []
    for n in recorders(paths):
        info = paths[n]
        assert info.recording is not None
        records = [json.loads(line) for line in info.recording.read_bytes().splitlines() if line]
        errors = sum(1 for r in records if r.get("error"))
        ok = len(records) == info.requests and not errors
        lines.append(
            f"  {n}: {len(records)} records for {info.requests} requests, {errors} with an error"
            f"{'' if ok else '  <-- MISMATCH'}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~4 minute smoke run")
    ap.add_argument("--rounds", type=int, help="rounds over the paths (default 3, quick 1)")
    ap.add_argument("--window", type=float, help="throughput window in seconds")
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument(
        "--variant",
        type=Variant.parse,
        action="append",
        default=[],
        metavar="NAME=DIR[:MODE]",
        help="add a path: the recorder from DIR (DIR/llmp_addon.py, DIR/llmp/), "
        "in MODE (digest); may be repeated",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to SECONDS for the machine to be idle (< 5%% busy for 3 s)",
    )
    ap.add_argument(
        "--addon-dir",
        type=Path,
        help="benchmark the recorder in DIR (DIR/llmp_addon.py, DIR/llmp/) instead of addon/",
    )
    args = ap.parse_args(argv)
    p = QUICK if args.quick else Params()
    if args.rounds:
        p.rounds = args.rounds
    if args.window:
        p.window_s = args.window

    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    print("llmp recorder benchmark")
    for line in machine():
        print("  " + line)
    print("parameters")
    for line in p.describe():
        print("  " + line)
    if args.addon_dir:
        print(f"  recorder from {args.addon_dir}")
    for v in args.variant:
        print(f"  variant {v.name}: {v.addon_dir}/llmp_addon.py, {v.mode}")
    print(flush=True)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet, progress)

    with tempfile.TemporaryDirectory(prefix="llmp-bench-") as tmpdir:
        tmp = Path(tmpdir)
        upstream = UpstreamProcess()
        paths: dict[str, PathInfo] = {}
        try:
            paths = start_paths(upstream, tmp, args.addon_dir, args.variant)
            progress(f"upstream and {len(paths) - 1} mitmdumps up")
            load = LoadMeter([os.getpid()])  # with its children: upstream, mitmdumps
            res = asyncio.run(run(paths, upstream, p, progress))
            others = load.others()
        finally:
            for info in paths.values():
                if info.proxy is not None:
                    info.proxy.close()
            upstream.close()
        lines = report(paths, res, p)
        lines.append("")
        lines.append(
            f"Other processes used {others:.1%} of the machine's CPU during the run"
            + (
                "  <-- NOT QUIET: the figures above are disturbed; run again on an idle machine"
                if others > 0.05
                else ""
            )
        )
        lines += ["", "Recordings (checked after the proxies stopped)", *check_recordings(paths)]
    print("\n".join(lines))
    print(f"\n(run took {time.monotonic() - started:.0f} s)")
    if args.json:
        data = {
            "machine": machine(),
            "params": asdict(p),
            "throughput": res.throughput,
            "chunk_ms": res.chunk_ms,
            "chunk_busy_ms": res.chunk_busy_ms,
            "busy_exchanges": res.busy_exchanges,
            "eos_ms": res.eos_ms,
            "cpu_us": res.cpu_us,
            "own_us": res.own_us,
            "exch_us": res.exch_us,
            "backlog_s": res.backlog_s,
            "chat_pairs": res.chat_pairs,
            "other_load": others,
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
