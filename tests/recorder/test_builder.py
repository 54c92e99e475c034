"""What the proxy hands the builder child: the stream tap, `Capture.settle`, the pipe framing.

The proxy's process keeps references only (pieces, their times, raw header
fields, the bodies mitmproxy holds) and writes them to the child as they lie;
everything else happens where the record is built.  These tests check that
the record comes out the same as if the proxy had done the work itself.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http

from llmp.recorder import builder as wire
from llmp.recorder import capture as capture_mod
from llmp.recorder.capture import Capture, keep_headers, stream_tap
from llmp.recorder.record import build_line

SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}],"model":"m.gguf"}\n\n'


@pytest.fixture
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """`time.time` as the capture sees it: a new, later value on every call."""
    ticks = itertools.count(1)
    monkeypatch.setattr(capture_mod.time, "time", lambda: 1_700_000_000 + next(ticks) / 7)


def _counts(cap: Capture) -> dict[str, Any]:
    return {
        "pieces": cap.pieces,
        "n_times": len(cap.times),
        "response_body_bytes": cap.response_body_bytes,
        "stored_bytes": cap.stored_bytes,
        "truncated": cap.truncated,
        "tail": cap.tail,
        "t_first_byte_ms": cap.t_first_byte_ms,
    }


def _pieces(rng: random.Random) -> list[bytes]:
    data = SSE_EVENT * rng.randint(0, 40) + b"data: [DONE]\n\n"
    out, i = [], 0
    while i < len(data):
        n = rng.choice([0, 1, 2, 13, 64, 65, 300, 1000])
        out.append(data[i : i + n])
        i += n
    return [*out, b""]  # mitmproxy ends a clean stream with an empty piece


@pytest.mark.parametrize("seed", range(60))
def test_stream_tap_counts_like_add_piece(seed: int) -> None:
    """The tap leaves the counting to `settle`; the result is what `add_piece` gives."""
    rng = random.Random(seed)
    pieces = _pieces(rng)
    total = sum(map(len, pieces))
    limit = rng.choice([1, 2, 63, 64, 100, max(1, total // 2), total, total + 1, 1 << 25])
    eager = Capture(id=1, conn=1, t_start_ms=0)
    lazy = Capture(id=1, conn=1, t_start_ms=0)
    tap = stream_tap(lazy, limit)
    for piece in pieces:
        eager.add_piece(piece, limit)
        assert tap(piece) is piece  # R7: the very bytes, unchanged
    lazy.settle()
    assert lazy.t_first_byte_ms is not None or not total
    # The times differ by when each ran; which pieces got one does not.
    assert _counts(lazy) | {"t_first_byte_ms": None} == _counts(eager) | {"t_first_byte_ms": None}
    if lazy.times:
        assert lazy.t_first_byte_ms == int(lazy.times[0] * 1000)


def test_stream_tap_first_byte_and_times(ticking_clock: None) -> None:
    cap = Capture(id=1, conn=1, t_start_ms=0)
    tap = stream_tap(cap, 10)
    tap(b"")
    tap(b"abcd")
    tap(b"efghijkl")  # crosses the limit: 6 bytes kept, with this piece's time
    tap(b"mn")
    tap(b"")
    cap.settle()
    assert cap.pieces == [b"abcd", b"efghij"] and len(cap.times) == 2
    assert cap.times[0] < cap.times[1]
    assert cap.t_first_byte_ms == int(cap.times[0] * 1000)
    assert cap.truncated and cap.stored_bytes == 10 and cap.response_body_bytes == 14
    assert cap.tail == b"abcdefghijklmn"


def test_stream_tap_swallows_its_own_errors() -> None:
    cap = Capture(id=1, conn=1, t_start_ms=0)
    tap = stream_tap(cap, 100)
    odd: Any = object()  # no len(): the tap must still hand it back
    assert tap(odd) is odd
    assert tap(b"ok") == b"ok" and cap.pieces == [b"ok"]


def test_settle_filters_raw_headers_as_mitmproxy_would() -> None:
    fields = (
        (b"Host", b"x"),
        (b"User-Agent", b"a"),
        (b"user-agent", b"b \xc3\xa9"),
        (b"Authorization", b"Bearer secret"),
        (b"Content-Type", b"application/json"),
        (b"Content-Encoding", b"gzip"),
        (b"content-encoding", b"br"),
        (b"Cookie", b"c=1"),
        (b"Transfer-Encoding", b"chunked"),
        (b"X-Odd", b"\xff\xfe"),
    )
    headers = http.Headers(fields)
    cap = Capture(
        id=1,
        conn=1,
        t_start_ms=0,
        raw_method=b"post",
        raw_path=b"/v1/chat/completions?q=\xc3\xa9&r=\xff",
        request_fields=fields,
        status=200,
        response_fields=fields[:1],
    )
    cap.settle()
    assert cap.request_headers == keep_headers(list(headers.items(multi=True)))
    assert cap.request_encoding == headers.get("content-encoding") == "gzip, br"
    assert cap.response_headers == {} and cap.response_encoding is None
    req = http.Request.make("post", "http://x/")
    req.data.path = b"/v1/chat/completions?q=\xc3\xa9&r=\xff"
    assert (cap.method, cap.path) == (req.method, req.path)
    assert cap.request_fields is None and cap.raw_method is None  # once only
    before = dict(cap.__dict__)
    cap.settle()
    assert cap.__dict__ == before


def _tapped_capture(
    body: bytes | None, n_pieces: int, seed: int = 0, event: bytes = SSE_EVENT
) -> Capture:
    rng = random.Random(seed)
    cap = Capture(
        id=7,
        conn=2,
        t_start_ms=1_700_000_000_000,
        raw_method=b"POST",
        raw_path=b"/v1/chat/completions",
        request_fields=((b"Content-Type", b"application/json"), (b"User-Agent", b"t")),
        request_body=body,
        request_body_bytes=len(body or b""),
        request_complete=True,
        status=200,
        response_fields=((b"Content-Type", b"text/event-stream"),),
        t_end_ms=1_700_000_000_900,
    )
    tap = stream_tap(cap, 1 << 25)
    for i in range(n_pieces):
        piece = event if i % 3 else event[: rng.randint(1, 30)]
        tap(piece)
    return cap


TRANSPORTS = ["pipe", "shared", "spans"]


def _round_trip(
    request: tuple[bytes, list[bytes], int], transport: str
) -> tuple[tuple[Any, ...], memoryview]:
    """Send a request as the parent does, through a pipe (from a thread: it may not fit in
    it), with the buffers after the head (`pipe`), in a shared body file (`shared`) or left
    where they lie (`spans`: read from this process's memory); read it back as the child
    does."""
    head, buffers, size = request
    shared = transport == "shared"
    r, w = os.pipe()
    fd = os.memfd_create("llmp-test") if shared else -1
    try:
        if shared:
            os.ftruncate(fd, size)
            wire.pwrite_buffers(fd, buffers)
        if transport == "spans":
            out = wire.request_spans(head, buffers)
        else:
            out = wire.request_buffers(head, buffers, size, shared)
        writer = threading.Thread(target=wire.write_buffers, args=(w, out))
        writer.start()
        got = wire.read_request(r, wire.SharedView(fd) if shared else None, peer=os.getpid())
        writer.join()
        assert got[1] is not None
    finally:
        os.close(r)
        os.close(w)
        if shared:
            os.close(fd)
    return got[0], got[1]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("body", "n_pieces"),
    [
        (b'{"model":"m","messages":[]}', 5),
        (None, 3),
        (b"", 0),
        (os.urandom(3 << 20), wire.IOV_MAX * 2 + 7),  # large: several writes, IOV_MAX batches
    ],
)
def test_build_request_round_trip(body: bytes | None, n_pieces: int, transport: str) -> None:
    """Piece boundaries, their times and the bodies come back exactly (R28)."""
    cap = _tapped_capture(body, n_pieces)
    request = wire.capture_request(cap, "full")
    _, buffers, size = request
    assert any(b is cap.request_body for b in buffers) or body is None  # sent as it lies
    if len(cap.pieces) > 1:  # a stream's small pieces: one buffer, the kernel's cost is per buffer
        assert len(buffers) == (body is not None) + 1
    assert size == len(body or b"") + sum(map(len, cap.pieces))
    head, data = _round_trip(request, transport)
    got, mode = wire.read_capture(head, data)
    del data
    assert mode == "full"
    assert got.request_body == cap.request_body
    assert got.pieces == cap.pieces and got.times == cap.times
    assert {k: v for k, v in got.__dict__.items()} == cap.__dict__
    assert cap.tapped and cap.request_fields is not None  # the proxy's copy stays as it was


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_build_request_round_trip_large_pieces(transport: str) -> None:
    """Pieces sent as they lie, more of them than one system call takes (IOV_MAX)."""
    cap = _tapped_capture(b"{}", wire.IOV_MAX * 2 + 7, event=b"x" * (2 * wire.JOIN_BELOW))
    request = wire.capture_request(cap, "full")
    assert len(request[1]) == len(cap.pieces) + 1
    head, data = _round_trip(request, transport)
    got, _ = wire.read_capture(head, data)
    del data
    assert got.pieces == cap.pieces and got.times == cap.times


def test_build_request_keeps_large_pieces_as_they_lie() -> None:
    """Pieces of `JOIN_BELOW` bytes and more are not copied: the kernel takes them as they are."""
    cap = _tapped_capture(None, 0)
    big = [os.urandom(wire.JOIN_BELOW), os.urandom(wire.JOIN_BELOW + 1)]
    for piece in big:
        cap.times.append(1.0)
        cap.pieces.append(piece)
    _, buffers, size = wire.capture_request(cap, "full")
    assert len(buffers) == 2 and all(b is p for b, p in zip(buffers, big, strict=True))
    assert size == sum(map(len, big))


def test_build_request_takes_pieces_and_times_together() -> None:
    """At shutdown the loop may be mid-tap: a time without its piece yet is left out."""
    cap = _tapped_capture(b"{}", 4)
    cap.times.append(1.0)
    head, data = _round_trip(wire.capture_request(cap, "digest"), "pipe")
    got, _ = wire.read_capture(head, data)
    assert len(got.times) == len(got.pieces) == 4


def test_shared_view_grows_with_the_file() -> None:
    fd = os.memfd_create("llmp-test")
    try:
        view = wire.SharedView(fd)
        for size in (10, 5, 3 << 20, 7):
            data = os.urandom(size)
            os.ftruncate(fd, max(size, 1 << 20))
            wire.pwrite_buffers(fd, [data[:3], data[3:]])
            got = view.view(size)
            assert bytes(got) == data
            got.release()
    finally:
        os.close(fd)


def test_write_buffers_goes_on_after_short_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev
    rng = random.Random(3)

    def short(fd: int, buffers: list[bytes]) -> int:  # a partial write, each time
        total = sum(map(len, buffers))
        keep = rng.randint(1, max(1, total)) if total else 0
        out = bytearray()
        for b in buffers:
            out += b
        return real(fd, [bytes(out[:keep])])

    monkeypatch.setattr(wire.os, "writev", short)
    buffers = [os.urandom(rng.randint(0, 5000)) for _ in range(50)]
    r, w = os.pipe()
    try:
        t = threading.Thread(target=wire.write_buffers, args=(w, buffers))
        t.start()
        got = wire.read_exact(r, sum(map(len, buffers)))
        t.join()
    finally:
        os.close(r)
        os.close(w)
    assert bytes(got) == b"".join(buffers)


@pytest.mark.parametrize("size", [0, 10, (1 << 16) - 8, 1 << 16, 3 << 20])
def test_read_frame(size: int) -> None:
    payload = os.urandom(size)
    r, w = os.pipe()
    try:
        t = threading.Thread(target=wire.write_buffers, args=(w, [wire.FRAME.pack(size), payload]))
        t.start()
        got = wire.read_frame(r)
        t.join()
    finally:
        os.close(r)
        os.close(w)
    assert got == payload and type(got) is bytes


def test_read_frame_refuses_bytes_past_the_frame() -> None:
    """One answer per request: anything after it means the two ends disagree."""
    r, w = os.pipe()
    os.write(w, wire.FRAME.pack(3) + b"abc" + b"more")
    try:
        with pytest.raises(ValueError):
            wire.read_frame(r)
    finally:
        os.close(r)
        os.close(w)


def test_read_frame_at_the_end() -> None:
    r, w = os.pipe()
    os.write(w, wire.FRAME.pack(10) + b"abc")
    os.close(w)
    try:
        with pytest.raises(EOFError):
            wire.read_frame(r)
    finally:
        os.close(r)


@pytest.mark.parametrize("spans", [True, False], ids=["spans", "shared"])
def test_child_builds_the_same_line_as_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spans: bool
) -> None:
    """The child's line, from the framed capture, is byte for byte the in-thread one,
    whether it reads the bodies from the proxy's memory or from the shared file."""
    if not spans:
        monkeypatch.setattr(wire.peer_memory, "supported", lambda: False)
    terminal = os.open(tmp_path / "terminal.log", os.O_WRONLY | os.O_CREAT, 0o600)
    child = wire.ChildBuilder(terminal)
    os.close(terminal)
    try:
        for i, (body, n) in enumerate([(b'{"model":"m","stream":true}', 40), (None, 0)]):
            for mode in ("digest", "full"):
                cap = _tapped_capture(body, n, seed=i)
                expected = build_line(copy.deepcopy(cap), mode)
                assert child.build(cap, mode) == expected and expected.endswith(b"\n")
        big = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 400_000 + b'"}]}'
        cap = _tapped_capture(big, 2000)
        expected = build_line(copy.deepcopy(cap), "full")
        assert len(expected) > 400_000 and child.build(cap, "full") == expected
        huge = _tapped_capture(b'{"x":"' + b"y" * (wire.SHARED_KEEP + 5) + b'"}', 10)
        expected = build_line(copy.deepcopy(huge), "digest")
        assert child.build(huge, "digest") == expected
        # Linux lets a child read its parent's memory (no Yama, or Yama told by `allow_reader`).
        assert child._spans is spans
        if not spans:
            assert os.fstat(child._shared).st_size == wire.SHARED_KEEP  # given back
        cap = _tapped_capture(b"{}", 3)
        assert child.build(cap, "digest") == build_line(copy.deepcopy(cap), "digest")
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_child_starts_whatever_lies_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in the proxy's working directory that shadows a module of the standard
    library (an `inspect.py` of the user's) does not reach the child's path."""
    (tmp_path / "inspect.py").write_text('raise SystemExit("shadowed")\n')
    (tmp_path / "json.py").write_text('raise SystemExit("shadowed")\n')
    monkeypatch.chdir(tmp_path)
    child = wire.ChildBuilder(-1)
    try:
        cap = _tapped_capture(b'{"model":"m","stream":true}', 4)
        assert child.build(cap, "digest") == build_line(copy.deepcopy(cap), "digest")
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_child_that_cannot_read_the_proxy_gets_the_shared_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe fails (here: it points at an unmapped address): the bodies are copied."""
    real = wire.peer_memory.address_of
    monkeypatch.setattr(wire.peer_memory, "address_of", lambda data: 1)
    child = wire.ChildBuilder(-1)
    try:
        cap = _tapped_capture(b'{"model":"m"}', 20)
        expected = build_line(copy.deepcopy(cap), "digest")
        assert child.build(cap, "digest") == expected
        assert child._spans is False
        monkeypatch.setattr(wire.peer_memory, "address_of", real)
        assert child.build(_tapped_capture(b"{}", 2), "digest").endswith(b"\n")
        assert child._spans is False  # decided once
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_child_answers_nothing_for_a_body_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a good probe, a span the child cannot read costs that record's child build only
    (the writer then builds it in-thread); the child goes on."""
    child = wire.ChildBuilder(-1)
    try:
        assert child.build(_tapped_capture(b"{}", 2), "digest")
        assert child._spans is True
        real = wire.peer_memory.address_of
        monkeypatch.setattr(wire.peer_memory, "address_of", lambda data: 1)
        assert child.build(_tapped_capture(b'{"model":"m"}', 5), "digest") == b""
        monkeypatch.setattr(wire.peer_memory, "address_of", real)
        cap = _tapped_capture(b'{"model":"m"}', 5)
        assert child.build(cap, "digest") == build_line(copy.deepcopy(cap), "digest")
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_child_without_a_shared_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no memfd (nor reading the proxy's memory), the bodies go by the pipe,
    after the head."""
    monkeypatch.setattr(wire, "_shared_file", lambda: -1)
    monkeypatch.setattr(wire.peer_memory, "supported", lambda: False)
    child = wire.ChildBuilder(-1)
    try:
        cap = _tapped_capture(os.urandom(2 << 20).hex().encode(), 50)
        assert child.build(cap, "digest") == build_line(copy.deepcopy(cap), "digest")
    finally:
        child.close()
    assert child.proc.returncode == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_child_runs_only_when_nobody_else_wants_the_cpu(tmp_path: Path) -> None:
    """The child's builder yields at once to anyone who wakes up; its summary thread does not,
    so a scrape is answered on a saturated machine."""
    child = wire.ChildBuilder(-1)
    try:
        child.build(_tapped_capture(b"{}", 2), "digest")  # it has started and answered
        pid = child.proc.pid
        policies = {
            int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")
        }
        assert policies.pop(pid) == os.SCHED_IDLE  # the main loop: builds the records
        assert list(policies.values()) == [os.SCHED_OTHER]  # the summary thread, alone
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        (summary,) = policies
        assert os.getpriority(os.PRIO_PROCESS, summary) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        child.close()
