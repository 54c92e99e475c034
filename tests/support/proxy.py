"""`llmp proxy ARGS` run as a subprocess, for the tests that need the real console script."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

LLMP = Path(sys.executable).parent / "llmp"


_BASE_RE = re.compile(r"OPENAI_BASE_URL=(http://\S+)/v1")


_PROXY_RE = re.compile(r"HTTPS_PROXY=(http://\S+)")


class ProxyError(RuntimeError):
    pass


class LlmpProxy:
    """`llmp proxy ARGS` as a subprocess; stdout and stderr go to files."""

    def __init__(self, args: Sequence[str], workdir: Path, confdir: Path) -> None:
        self.args = [*args, "--confdir", str(confdir)]
        self.workdir = workdir
        self.stdout_path = workdir / "proxy.out"
        self.stderr_path = workdir / "proxy.err"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def command(self) -> list[str]:
        return [str(LLMP), "proxy", *self.args]

    def start(self, timeout: float = 20.0) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            text = self.stdout()
            m = _BASE_RE.search(text) or _PROXY_RE.search(text)
            if m and "Stop with Ctrl-C." in text:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise ProxyError(
                    f"llmp proxy did not start (rc={self.proc.returncode})\n"
                    f"{self.command()}\n--- stdout ---\n{text}\n--- stderr ---\n{self.stderr()}"
                )
            time.sleep(0.02)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stdout(self) -> str:
        return self.stdout_path.read_text("utf-8", "replace") if self.stdout_path.exists() else ""

    def stderr(self) -> str:
        return self.stderr_path.read_text("utf-8", "replace") if self.stderr_path.exists() else ""

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise ProxyError(f"no exit within {timeout}s of {sig}\n{self.stdout()}") from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
