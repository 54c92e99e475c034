"""Addresses where no server answers: a refused port and a connect that never completes.

The recorder must record both (``upstream_unreachable``, ``timeout``), so the
tests need them on demand, on 127.0.0.1, without depending on the network.
"""

from __future__ import annotations

import select
import socket
from typing import Self


class ClosedPort:
    """A 127.0.0.1 port with nothing listening: connects are refused.

    The port stays bound (not listening) until ``close()``, so no other
    socket can take it meanwhile.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.host = "127.0.0.1"
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlackHole:
    """A 127.0.0.1 address where a TCP connect never completes.

    A listening socket with backlog 0 that never accepts: its accept queue
    takes one connection, which we make ourselves. After that Linux drops
    every SYN to it (``LISTENOVERFLOWS``), so a connect stays in SYN_SENT and
    retries for about two minutes. ``close()`` releases it (connects then
    fail with "refused").
    """

    def __init__(self, probe_timeout: float = 0.2) -> None:
        self.host = "127.0.0.1"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._fillers: list[socket.socket] = []
        for _ in range(16):
            if not self._connect_one(probe_timeout):
                return
        self.close()
        raise RuntimeError("could not fill the accept queue of the black hole listener")

    def _connect_one(self, timeout: float) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((self.host, self.port))
        _, writable, _ = select.select([], [s], [], timeout)
        if writable and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            self._fillers.append(s)
            return True
        s.close()
        return False

    def close(self) -> None:
        for s in self._fillers:
            s.close()
        self._fillers.clear()
        self._listener.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
