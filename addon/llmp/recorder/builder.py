"""Building records, and running the live view, in a child process.

Parsing, merging and hashing a 300 KB exchange holds the GIL for
milliseconds, and the live view's analysis takes tens of microseconds per
record; on the writer thread that time is taken from mitmproxy's event loop,
and chunks of other streams wait (measured in `bench/recorder.py`). A child
process does that work instead.  The writer thread only hands over what the
proxy already holds, waits for the line, writes it, and passes on what the
child logged.

Protocol, over the child's stdin and stdout.  A request is a prefix
(`REQUEST`: the length of what follows it on the pipe, the length of its
head, how many bytes it left in the shared body file, and how many spans of
the proxy's memory hold its buffers), a head, then the spans (`SPAN`:
address and length each) or raw buffers.  The head is a pickle of a tuple
whose first item names the request:

- `("build", mode, state, body_size, sizes)`: the record's JSON line
  (newline included).  `state` is the capture's fields without its bodies;
  the buffers are the request body (`body_size` bytes, when `body_size` is
  not None), then the response pieces, `sizes` giving each one's length.
  The request body is the bytes object mitmproxy holds, so the proxy's
  process never pickles it; a stream's small pieces are joined first
  (`capture_request`).  Where the kernel lets the child read the proxy's
  memory (`llmp.recorder.peer_memory`), only the buffers' addresses go on
  the pipe and the child copies the bytes itself: the proxy's process does
  not touch them again.  Otherwise they are copied with `os.pwritev` into
  the shared body file (a `memfd` the child maps; its pages are reused from
  one exchange to the next) or, without one, with `os.writev` on the pipe
  after the head.  The child cuts them back into a `Capture`
  (`read_capture`), and answers only once it has, so the buffers are free
  again by the time the answer arrives.  When a live view runs, the child also
  feeds it that line, read back as `llmp analyze` reads it, before it
  answers;
- `("live", LiveConfig, body, first_id)`: start the live view, or replace
  the running one; an empty answer, or the `LiveError` text;
- `("live_off",)`: stop the live view (its summary line and `LLMP_SUMMARY`);
- `("probe", expected)`: one span holding `expected`; the answer is `PROBE_OK`
  when the child could read it, and the proxy sends spans from then on.

Every answer is one frame (`FRAME`: an 8-byte length, then the bytes).  The
child writes its own log lines (the live view's per-request lines, its
errors) itself, to a copy of the proxy's stdout or to `llmp_live_log`
(`llmp.live.sink`): nothing of the live view passes back through the proxy's
process.

`GET /_llmp/summary` and `GET /_llmp/metrics` must not wait for records
being built, so they have a channel of their own: a socket pair, served by a
thread in the child.  The parent sends `ASK_SUMMARY`, or `ASK_METRICS` and
the writer's totals (`METRICS_TOTALS`: written, lost), and reads one frame:
the summary JSON or the Prometheus text, or nothing when no live view runs.

The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process
group, and the parent must drain first) and exits when its stdin closes, so
it never outlives the recorder.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmp.live.contract import LiveConfig, LiveError
from llmp.recorder import peer_memory
from llmp.recorder.capture import Capture

log = logging.getLogger("llmp")

REQUEST = struct.Struct("<QIQI")
SPAN = struct.Struct("<QQ")
FRAME = struct.Struct("<Q")
ASK_SUMMARY = b"?"
ASK_METRICS = b"m"
METRICS_TOTALS = struct.Struct("<QQ")
"""After `ASK_METRICS`: the records the writer wrote, and those it lost."""
BUILD = "build"
LIVE = "live"
LIVE_OFF = "live_off"
PROBE = "probe"
PROBE_OK = b"read"
FRAME_READ = 1 << 16  # the first read of an answer
PIPE_BYTES = 1 << 20
"""The pipes' capacity, asked of Linux: an answer, or a body without the
shared file, goes over in one write."""
JOIN_BELOW = 4096
"""Response pieces averaging fewer bytes are joined before they are sent (`capture_request`)."""
SHARED_KEEP = 4 << 20
"""The shared body file shrinks back to this after a larger exchange."""
try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 1024


class BuilderGone(Exception):
    """The child process is not there to answer; build in-thread instead."""


def write_buffers(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """Write the buffers in order, from where they lie: `os.writev`, `IOV_MAX` at a time.

    No joining copy; a short write (a signal, a full pipe) goes on from where it stopped.
    """
    pending = list(buffers)
    start = 0
    while start < len(pending):
        start = _advance(pending, start, os.writev(fd, pending[start : start + IOV_MAX]))


def _advance(pending: list[bytes | memoryview], start: int, written: int) -> int:
    """After a vectored write of `written` bytes from `pending[start:]`: the next buffer to
    write, the one cut short replaced by what is left of it."""
    while written:
        size = len(pending[start])
        if written < size:
            pending[start] = memoryview(pending[start])[written:]
            break
        written -= size
        start += 1
    while start < len(pending) and not len(pending[start]):
        start += 1  # empty buffers are written by being passed over
    return start


def pwrite_buffers(fd: int, buffers: Sequence[bytes | memoryview], offset: int = 0) -> None:
    """`write_buffers` into a file at `offset`, with `os.pwritev` (the GIL is released)."""
    pending = list(buffers)
    start = 0
    while start < len(pending):
        batch = pending[start : start + IOV_MAX]
        written = os.pwritev(fd, batch, offset)
        if not written and any(batch):
            raise OSError("no progress writing the shared body file")
        offset += written
        start = _advance(pending, start, written)


def read_into(fd: int, view: memoryview) -> None:
    """Fill `view` from `fd`; EOFError if it ends first."""
    got, size = 0, len(view)
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            raise EOFError
        got += n


def read_exact(fd: int, size: int) -> bytearray:
    """`size` bytes from `fd`; EOFError if it ends first."""
    data = bytearray(size)
    read_into(fd, memoryview(data))
    return data


def read_frame(fd: int) -> bytes:
    """One answer frame's bytes.

    One read takes a digest-mode line whole (the child wrote the frame in one
    write): each system call is a turn the writer thread then waits for the
    GIL, while the event loop holds it.
    """
    chunk = os.read(fd, FRAME_READ)
    while len(chunk) < FRAME.size:
        more = os.read(fd, FRAME_READ)
        if not more:
            raise EOFError
        chunk += more
    (size,) = FRAME.unpack_from(chunk)
    end = FRAME.size + size
    if len(chunk) > end:
        raise ValueError("more bytes than the frame holds")
    parts = [chunk[FRAME.size :]]
    got = len(chunk) - FRAME.size
    while got < size:
        more = os.read(fd, size - got)
        if not more:
            raise EOFError
        parts.append(more)
        got += len(more)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def request_head(head: tuple[Any, ...]) -> bytes:
    """The pickled head of a request."""
    return pickle.dumps(head, protocol=5)


def request_buffers(
    head: bytes, buffers: Sequence[bytes] = (), size: int = 0, shared: bool = False
) -> list[bytes]:
    """A request as the buffers to write on the pipe.

    `buffers` (`size` bytes in all) follow the head on the pipe, or, when
    `shared`, are already in the shared body file, from its start.
    """
    if shared:
        return [REQUEST.pack(len(head), len(head), size, 0), head]
    return [REQUEST.pack(len(head) + size, len(head), 0, 0), head, *buffers]


def request_spans(head: bytes, buffers: Sequence[bytes]) -> list[bytes]:
    """A request whose buffers the child reads from this process's memory, as the
    buffers to write on the pipe: the head, then where each buffer lies.

    The buffers must stay alive until the child has answered.
    """
    spans = b"".join(SPAN.pack(peer_memory.address_of(b), len(b)) for b in buffers)
    return [REQUEST.pack(len(head) + len(spans), len(head), 0, len(buffers)), head, spans]


def capture_request(cap: Capture, mode: str) -> tuple[bytes, list[bytes], int]:
    """The build request for `cap`: its fields pickled; its bodies, and their size.

    The request body goes by reference.  The response pieces of a stream
    are small (an SSE event each): one join of them costs less than handing
    the kernel hundreds of buffers, so they are joined when they average
    under `JOIN_BELOW` bytes.  The pieces are taken once, with their times:
    at shutdown the event loop may still be adding to them (a time is always
    added before its piece).
    """
    pieces = cap.pieces[:]
    state = cap.__dict__.copy()
    body = state["request_body"]
    state["request_body"] = None
    state["pieces"] = None
    state["times"] = cap.times[: len(pieces)]
    sizes = [len(p) for p in pieces]
    size = sum(sizes)
    if len(pieces) > 1 and size < JOIN_BELOW * len(pieces):
        pieces = [b"".join(pieces)]
    if body is None:
        return request_head((BUILD, mode, state, None, sizes)), pieces, size
    pieces.insert(0, body)
    return request_head((BUILD, mode, state, len(body), sizes)), pieces, size + len(body)


class SharedView:
    """The child's mapping of the shared body file, made larger when a request needs it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: Any = None  # mmap.mmap; imported in the child only
        self._size = 0

    def view(self, size: int) -> memoryview:
        """The file's first `size` bytes (the caller releases the view before the next call)."""
        if size > self._size:
            import mmap

            if self._map is not None:
                self._map.close()
            self._size = max(size, os.fstat(self.fd).st_size)
            self._map = mmap.mmap(self.fd, self._size, prot=mmap.PROT_READ)
        return memoryview(self._map)[:size]


def read_request(
    fd: int, shared: SharedView | None = None, peer: int | None = None
) -> tuple[tuple[Any, ...], memoryview | None]:
    """The next request: its head, and a view of its buffers; EOFError at the end.

    Buffers in spans are read from process `peer` (by default the parent);
    when that fails, the view is None (the request cannot be answered).
    """
    prefix = read_exact(fd, REQUEST.size)
    total, head_size, shared_size, n_spans = REQUEST.unpack(prefix)
    payload = memoryview(read_exact(fd, total))
    head = pickle.loads(payload[:head_size])
    if n_spans:
        spans = [SPAN.unpack_from(payload, head_size + i * SPAN.size) for i in range(n_spans)]
        try:
            data = peer_memory.read_spans(os.getppid() if peer is None else peer, spans)
        except OSError:
            return head, None
        return head, memoryview(data)
    if shared_size:
        if shared is None:
            raise ValueError("a request in a shared body file this child has not got")
        return head, shared.view(shared_size)
    return head, payload[head_size:]


def read_capture(head: tuple[Any, ...], data: memoryview) -> tuple[Capture, str]:
    """The capture of a build request, its bodies cut back out of `data`; and the mode."""
    _, mode, state, body_size, sizes = head
    cap = Capture.__new__(Capture)
    cap.__dict__.update(state)
    at = 0
    if body_size is not None:
        cap.request_body = bytes(data[:body_size])
        at = body_size
    pieces: list[bytes] = []
    for size in sizes:
        pieces.append(bytes(data[at : at + size]))
        at += size
    cap.pieces = pieces
    return cap, mode


def _grow_pipe(fd: int) -> None:
    """Ask for `PIPE_BYTES` of pipe (Linux); without it, the writes take more turns."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):
        pass


def _shared_file() -> int:
    """A new shared body file (Linux `memfd`), or -1: the bodies then go by the pipe."""
    try:
        return os.memfd_create("llmp-bodies", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return -1


def recv_exact(sock: socket.socket, size: int) -> bytes:
    parts: list[bytes] = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


# -- the parent's end ---------------------------------------------------------


class ChildBuilder:
    """The parent's end: requests from the writer thread only; summaries from any thread."""

    def __init__(self, terminal: int = 1) -> None:
        """`terminal`: the file descriptor the child writes its lines to (the proxy's stdout)."""
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        ours, theirs = socket.socketpair()
        try:
            term = os.dup(terminal)
        except OSError:
            term = -1  # no terminal: the child's lines go nowhere (a log file still works)
        self._shared = _shared_file()
        self._shared_size = 0
        fds = tuple(fd for fd in (theirs.fileno(), term, self._shared) if fd >= 0)
        argv = [str(theirs.fileno()), str(term), str(self._shared)]
        try:
            self.proc = subprocess.Popen(
                # -P: the proxy's working directory is not put on the child's path, so a
                # file there (an `inspect.py`) cannot shadow the standard library.
                [sys.executable, "-P", "-m", "llmp.recorder.child", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # raw pipes: the writer thread writes and reads them itself
                env=env,
                pass_fds=fds,
            )
        except OSError as exc:
            ours.close()
            self._close_shared()
            raise BuilderGone(str(exc)) from None
        finally:
            theirs.close()
            if term >= 0:
                os.close(term)
        # Whether the child reads the bodies from this process (None: not tried yet).
        self._spans: bool | None = None if peer_memory.supported() else False
        if self._spans is None:
            peer_memory.allow_reader(self.proc.pid)
        self._summaries: socket.socket | None = ours
        self._summary_lock = threading.Lock()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._to_child = self.proc.stdin.fileno()
        self._from_child = self.proc.stdout.fileno()
        _grow_pipe(self._to_child)
        _grow_pipe(self._from_child)

    def _call(self, head: bytes, buffers: Sequence[bytes] = (), size: int = 0) -> bytes:
        """Send one request (a pickled head, then raw buffers of `size` bytes); return the answer.

        Every write and read releases the GIL: the kernel copies the bodies
        while the event loop runs.
        """
        try:
            if buffers and self._spans is None:
                self._spans = self._probe()
            if buffers and self._spans and all(type(b) is bytes for b in buffers):
                out = request_spans(head, buffers)  # `buffers` lives until the answer
            else:
                shared = bool(buffers) and self._share(buffers, size)
                out = request_buffers(head, buffers, size, shared)
            write_buffers(self._to_child, out)
            answer = read_frame(self._from_child)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise BuilderGone(f"record builder process ended ({exc or 'EOF'})") from None
        if self._shared_size > SHARED_KEEP:  # a large exchange: give the memory back
            try:
                self._resize_shared(SHARED_KEEP)
            except OSError:
                pass
        return answer

    def _probe(self) -> bool:
        """Whether the child can read this process's memory: it reads a known buffer."""
        expected = os.urandom(16)
        head = request_head((PROBE, expected))
        write_buffers(self._to_child, request_spans(head, [expected]))
        ok = read_frame(self._from_child) == PROBE_OK
        if not ok:
            log.debug("llmp: the builder child cannot read the proxy's memory; bodies are copied")
        return ok

    def _share(self, buffers: Sequence[bytes], size: int) -> bool:
        """Put the buffers in the shared body file; False if there is none, or it is full."""
        if self._shared < 0:
            return False
        try:
            if size > self._shared_size:
                self._resize_shared(max(size, SHARED_KEEP))
            pwrite_buffers(self._shared, buffers)
        except OSError as exc:  # e.g. no memory for it: the pipe still works
            log.debug("llmp: bodies through the pipe (%s)", exc)
            return False
        return True

    def _resize_shared(self, size: int) -> None:
        os.ftruncate(self._shared, size)
        self._shared_size = size

    def _close_shared(self) -> None:
        if self._shared >= 0:
            os.close(self._shared)
            self._shared = -1

    def build(self, cap: Capture, mode: str) -> bytes:
        """Send the capture, return the line; `BuilderGone` if the child died."""
        return self._call(*capture_request(cap, mode))

    def live(self, cfg: LiveConfig | None, body: str, first_id: int) -> None:
        """Start, replace (`cfg`) or stop (None) the child's live view; `LiveError` if it can't."""
        if cfg is None:
            self._call(request_head((LIVE_OFF,)))
            return
        error = self._call(request_head((LIVE, cfg, body, first_id)))
        if error:
            raise LiveError(error.decode())

    def summary(self, timeout: float = 10.0) -> bytes | None:
        """The live view's summary JSON; None when none runs or the child can't answer."""
        return self._ask(ASK_SUMMARY, timeout)

    def metrics(self, written: int, lost: int, timeout: float = 10.0) -> bytes | None:
        """The live view's Prometheus text with the writer's totals; None as for `summary`."""
        return self._ask(ASK_METRICS + METRICS_TOTALS.pack(written, lost), timeout)

    def _ask(self, question: bytes, timeout: float) -> bytes | None:
        """One question on the summary channel, one frame back (from any thread)."""
        if not self._summary_lock.acquire(timeout=timeout):
            return None
        try:
            sock = self._summaries
            if sock is None:
                return None
            try:
                sock.settimeout(timeout)
                sock.sendall(question)
                (size,) = FRAME.unpack(recv_exact(sock, FRAME.size))
                return recv_exact(sock, size) or None
            except (OSError, EOFError) as exc:
                # A late answer would be read as the next one's: this channel is done.
                log.warning("llmp: the live view's summary channel failed (%s)", exc or "EOF")
                sock.close()
                self._summaries = None
                return None
        finally:
            self._summary_lock.release()

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin and wait; kill it if it does not go."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._summary_lock:
            if self._summaries is not None:
                self._summaries.close()
                self._summaries = None
        self._close_shared()
