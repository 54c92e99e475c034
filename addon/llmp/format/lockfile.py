"""Opening a file for one writer only: the recording and the live view's event files.

Two writers appending to one file would interleave and collide (R14), so each
file is held under an exclusive `flock` for as long as it is written.
"""

from __future__ import annotations

import errno
import fcntl
import os


class RecordingError(Exception):
    """The recording file cannot be used; the message says why, in one line."""


def open_locked(path: str, what: str, hint: str) -> int:
    """Open `path` to append (a new file is 0600) and lock it exclusively.

    Two writers on one file would interleave and collide (R14), so a file
    another process holds is refused; `RecordingError` says why in one line.
    """
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise RecordingError(f"cannot open {what} {path!r}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RecordingError(f"{what} {path!r} is in use by another recorder; {hint}") from None
        raise RecordingError(f"cannot lock {what} {path!r}: {exc.strerror}") from None
    return fd


def write_all(fd: int, data: bytes) -> None:
    """Write every byte (`os.write` may take only part of a large buffer); OSError as is."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def close_locked(fd: int) -> None:
    """Release the lock `open_locked` took, then the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
