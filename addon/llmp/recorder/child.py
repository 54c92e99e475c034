"""The builder child: builds each record, and runs the live view on it.

Started by `llmp.recorder.builder.ChildBuilder` as `python -m
llmp.recorder.child SUMMARY_FD TERMINAL_FD SHARED_FD`; the protocol is described
there.  Everything heavy (parsing, merging, hashing, the analysis engine)
is imported here, in the child, and never in the proxy's own process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from llmp.format.lines import parse_line
from llmp.live.contract import LiveConfig, LiveError
from llmp.live.sink import LineSink, SinkHandler
from llmp.live.view import LiveView
from llmp.recorder.builder import (
    ASK_METRICS,
    BUILD,
    FRAME,
    LIVE,
    LIVE_OFF,
    METRICS_TOTALS,
    PROBE,
    PROBE_OK,
    SharedView,
    read_capture,
    read_request,
    recv_exact,
    write_buffers,
)
from llmp.recorder.record import build_line
from llmp.recorder.tokens import RecordTokens

log = logging.getLogger("llmp")

NICE = 19
"""The child's niceness: the lowest priority there is, where `SCHED_IDLE` is not."""


def lower_priority() -> None:
    """Let the proxy's event loop, the client and the model server always come first.

    Building a record takes milliseconds of CPU per exchange (the parse,
    merge and hash of 300 KB and 300 events: about as much CPU as mitmproxy
    spends relaying them).  At nice 5 that time was taken from them whenever
    the machine had no idle core: on 2 cores, 8 saturated streams lost a
    quarter of their events/s.  Nice 19 still let the child finish its slice
    when one of them woke up on its core, so they waited for it; Linux's
    `SCHED_IDLE` has them preempt it at once (`docs/performance.md`).  The
    child runs in the time the others leave; when they leave none for long,
    records (and the live view's lines) wait, queued in order, and are
    written once there is.  Linux sets both per thread: the summary thread,
    started before, keeps the normal priority, so `/_llmp/summary` and
    `/_llmp/metrics` are answered on a saturated machine too (they wait only
    while a record is being fed to the live view, under its lock).
    """
    try:
        os.nice(NICE)
    except OSError:
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: nice 19 it is
        pass


def feed(view: LiveView, line: bytes, mode: str) -> None:
    """Give the live view one written record; a failure is logged, never raised."""
    try:
        rec = parse_line(line)
        if rec is not None:
            view.on_record(rec)
    except Exception:
        log.exception("llmp: live view failed on a record; recording goes on")


def replace_view(
    old: LiveView | None,
    cfg: LiveConfig | None,
    *,
    body: str,
    first_id: int,
    say: Callable[[int, str], None] | None = None,
) -> LiveView | None:
    """The live view `cfg` asks for (None: none), in place of `old`, which is closed.

    The old one closes first: the two may share an event file, which only one
    can hold.  So a `LiveError` leaves no live view running.
    """
    if old is not None:
        old.close()
    return None if cfg is None else LiveView(cfg, body=body, first_id=first_id, say=say)


class _Child:
    """The child's state: the live view, if one runs, and the proxy's terminal."""

    def __init__(self, terminal: LineSink) -> None:
        self.view: LiveView | None = None
        self.counter = RecordTokens()  # the records' token counts (`llmp_tokenize`)
        self.terminal = terminal
        self.handler = SinkHandler(terminal)

    def handle(self, request: tuple[Any, ...], data: memoryview | None) -> bytes:
        """The answer to one request (`data`: its raw buffers; None if they could not be read)."""
        op = request[0]
        if op == PROBE:
            return PROBE_OK if data is not None and data == request[1] else b""
        if op == BUILD:
            if data is None:
                raise OSError("could not read the exchange's bodies from the proxy")
            cap, mode = read_capture(request, data)
            line = build_line(cap, mode, self.counter)
            view = self.view
            if view is not None:
                view.body = mode
                feed(view, line, mode)
            return line
        if op == LIVE:
            _, cfg, body, first_id = request
            try:
                self._live(cfg, body, first_id)
            except LiveError as exc:
                return str(exc).encode()
            return b""
        if op == LIVE_OFF:
            self._live(None, "", 0)
            return b""
        raise ValueError(f"unknown request {op!r}")

    def _live(self, cfg: LiveConfig | None, body: str, first_id: int) -> None:
        """Replace the live view; after a `LiveError` none runs."""
        old, self.view = self.view, None
        if cfg is not None:
            self.terminal.level = cfg.log_level
        self.view = replace_view(old, cfg, body=body, first_id=first_id, say=self.terminal.say)

    def serve_summaries(self, sock: socket.socket) -> None:
        """The summary channel: a question in, the summary or the metrics out, until it closes."""
        with sock:
            while True:
                try:
                    question = sock.recv(1)
                    if not question:
                        return
                    totals = (
                        METRICS_TOTALS.unpack(recv_exact(sock, METRICS_TOTALS.size))
                        if question == ASK_METRICS
                        else None
                    )
                    view = self.view
                    if view is None:
                        data = b""
                    elif totals is not None:
                        data = view.metrics_text(*totals)
                    else:
                        data = view.summary_json()
                    sock.sendall(FRAME.pack(len(data)) + data)
                except (OSError, EOFError):
                    return


def main(argv: list[str]) -> None:
    """The child: answer requests until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    terminal = LineSink(int(argv[1]) if len(argv) > 1 else -1)
    child = _Child(terminal)
    log.addHandler(child.handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if argv:
        sock = socket.socket(fileno=int(argv[0]))
        threading.Thread(target=child.serve_summaries, args=(sock,), daemon=True).start()
    lower_priority()  # this thread's only: the summary thread answers at normal priority
    shared = SharedView(int(argv[2])) if len(argv) > 2 and int(argv[2]) >= 0 else None
    fin, fout = sys.stdin.fileno(), sys.stdout.fileno()
    while True:
        try:
            request, data = read_request(fin, shared)
        except EOFError:
            break
        try:
            answer = child.handle(request, data)
        except Exception:
            log.exception("llmp: record builder failed on a request")
            answer = b""
        del data  # the request's buffers, a body's size or more: not kept until the next one
        write_buffers(fout, [FRAME.pack(len(answer)), answer])
    child._live(None, "", 0)  # the parent stops the view first; this is a safety net


if __name__ == "__main__":
    main(sys.argv[1:])
