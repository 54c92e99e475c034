"""Reading the proxy's bytes objects from the builder child, without a copy in the proxy.

The proxy already holds every body it hands over (mitmproxy's request body,
the stream's pieces).  Copying them into a shared file costs the proxy's
process a pass over each byte; with Linux's `process_vm_readv` the child
copies them straight out of the proxy's memory instead, and the proxy only
sends where they lie.  The kernel allows it between processes of the same
user, unless Yama's `ptrace_scope` says otherwise: then the proxy names the
child as its allowed reader (`allow_reader`).  Where none of this works (not
Linux, a stricter Yama, a seccomp filter), the caller keeps the shared file;
it finds out by trying once (`llmp.recorder.builder`'s probe).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence

__all__ = ["address_of", "allow_reader", "read_spans", "supported"]

_PR_SET_PTRACER = 0x59616D61  # prctl's "Yama": let one process read this one
_IOV_MAX = 1024  # process_vm_readv's limit per call, on each side


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.process_vm_readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        lib.process_vm_readv.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _libc()


def supported() -> bool:
    """Whether this platform has `process_vm_readv` at all."""
    return _LIBC is not None


def address_of(data: bytes) -> int:
    """Where a bytes object's bytes lie in this process (valid while `data` lives).

    A `c_char_p` made from a bytes object points into that object's own
    buffer; ctypes does not copy it.
    """
    if type(data) is not bytes:
        raise TypeError("only a bytes object has a fixed buffer to point at")
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    if address is None:
        raise ValueError("no address")
    return address


def allow_reader(pid: int) -> None:
    """Let process `pid` read this one's memory where Yama restricts it; harmless elsewhere."""
    if _LIBC is None:
        return
    try:
        _LIBC.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def read_spans(pid: int, spans: Sequence[tuple[int, int]]) -> bytearray:
    """The bytes at `spans` ((address, length) pairs) of process `pid`, joined.

    OSError if the kernel refuses or a span is not mapped there.
    """
    if _LIBC is None:
        raise OSError("process_vm_readv is not available here")
    total = sum(size for _, size in spans)
    out = bytearray(total)
    if not total:
        return out
    local = (ctypes.c_char * total).from_buffer(out)
    base = ctypes.addressof(local)
    at = 0
    todo = [(addr, size) for addr, size in spans if size]
    while todo:
        batch = todo[:_IOV_MAX]
        want = sum(size for _, size in batch)
        remote = (_IOVec * len(batch))(*[_IOVec(addr, size) for addr, size in batch])
        mine = _IOVec(base + at, want)
        got = _LIBC.process_vm_readv(pid, ctypes.byref(mine), 1, remote, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError("process_vm_readv read nothing")
        at += got
        todo = _skip(todo, got)
    del local  # the bytearray may be resized only once no ctypes view holds it
    return out


def _skip(spans: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """`spans` without their first `done` bytes (a read may stop between or inside spans)."""
    for i, (addr, size) in enumerate(spans):
        if done < size:
            return [(addr + done, size - done), *spans[i + 1 :]]
        done -= size
    return []
