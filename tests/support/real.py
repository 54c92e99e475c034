"""Run the real llama.cpp ``llama-server`` for tests.

    with LlamaServer(ctx=512, log_path=tmp_path / "llama.log") as llama:
        client = openai.OpenAI(base_url=llama.url + "/v1", api_key="x")

The binary and the model come from ``LLMP_LLAMA_SERVER`` and
``LLMP_LLAMA_MODEL``; ``require_llama()`` skips the calling test (with the
reason) when either is unset or missing. The server binds 127.0.0.1 on a free
port, logs to a file (never a pipe, which could fill and block it), and is
ready when ``GET /health`` answers 200.

The default flags make the server's prompt cache observable and repeatable:
one slot (``-np 1``), no host-memory prompt cache (``--cache-ram 0``) so a
slot's cache is lost when another prompt takes the slot, ``--offline``, and
``--no-warmup`` (faster start).
Flags the build does not list in ``--help`` are left out.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import pytest

SERVER_ENV = "LLMP_LLAMA_SERVER"
MODEL_ENV = "LLMP_LLAMA_MODEL"
SWA_MODEL_ENV = "LLMP_LLAMA_MODEL_SWA"
"""Gemma 3 270M: a sliding-window (SWA) cache, which llama-server cannot roll back to an
earlier position unless it runs with ``--swa-full``."""
READY_TIMEOUT = 180.0


class LlamaServerError(RuntimeError):
    pass


def llama_paths() -> tuple[Path, Path] | str:
    """The server binary and model from the environment, or why they can't be used."""
    server = os.environ.get(SERVER_ENV, "").strip()
    model = os.environ.get(MODEL_ENV, "").strip()
    if not server or not model:
        return f"set {SERVER_ENV} and {MODEL_ENV} to run against the real llama-server"
    if not os.access(server, os.X_OK):
        return f"{SERVER_ENV}={server} is not an executable file"
    if not Path(model).is_file():
        return f"{MODEL_ENV}={model} is not a file"
    return Path(server), Path(model)


def real_server_marks() -> list[pytest.MarkDecorator]:
    """A module's `pytestmark` for end-to-end tests against the real llama-server:
    skipped, with the reason, when it is not there."""
    found = llama_paths()
    return [
        pytest.mark.real_server,
        pytest.mark.e2e,
        pytest.mark.skipif(isinstance(found, str), reason=str(found)),
    ]


def swa_model() -> Path | str:
    """The SWA model from ``LLMP_LLAMA_MODEL_SWA``, or why it can't be used."""
    model = os.environ.get(SWA_MODEL_ENV, "").strip()
    if not model:
        return f"set {SWA_MODEL_ENV} to run against a sliding-window model"
    if not Path(model).is_file():
        return f"{SWA_MODEL_ENV}={model} is not a file"
    return Path(model)


def require_llama() -> tuple[Path, Path]:
    """The server binary and model, or skip the test with the reason."""
    found = llama_paths()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@functools.cache
def server_help(server: str) -> str:
    """The build's ``--help`` text (to find which flags it knows)."""
    try:
        out = subprocess.run(
            [server, "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout + out.stderr).decode("utf-8", "replace")


def supports(server: str, flag: str) -> bool:
    """Whether ``--help`` lists ``flag`` (as a whole word)."""
    text = server_help(server)
    return any(word.strip(",") == flag for line in text.splitlines() for word in line.split())


class ServerProcess:
    """A server subprocess on 127.0.0.1 and a free port that logs to a file (never a
    pipe, which could fill and block it) and is ready when ``GET /health`` answers 200.

    One home for starting, waiting and reading the log: a subclass gives its command,
    its name and error for messages, and, where it needs them, its environment and
    working folder."""

    name = "server"
    error: type[RuntimeError] = RuntimeError
    poll_every = 0.1
    """Seconds between health checks while it starts."""
    log_path: Path
    timeout: float
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """None: the tests' own environment."""
        return None

    def workdir(self) -> Path | None:
        """None: the tests' own working folder."""
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def _health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (OSError, ValueError):
            return None

    def _failed(self, why: str) -> RuntimeError:
        return self.error(
            f"{self.name} {why}\ncommand: {self.command()}\n--- log ---\n{self.log_text()[-4000:]}"
        )

    def start(self) -> Self:
        if self.proc is not None:
            raise self.error("already started")
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.workdir(),
                start_new_session=True,  # its own process group: stopped with it
            )
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    why = f"exited with {self.proc.returncode} before it was ready"
                    raise self._failed(why)
                if self._health() == 200:
                    return self
                if time.monotonic() > deadline:
                    raise self._failed(f"not healthy after {self.timeout:.0f}s")
                time.sleep(self.poll_every)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 15.0) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LlamaServer(ServerProcess):
    """A ``llama-server`` subprocess on 127.0.0.1 and a free port.

    ``ctx`` is the context size (``-c``); ``parallel`` the slots (``-np``).
    ``cache_ram=0`` turns off the host-memory prompt cache (when the build has
    ``--cache-ram``). ``extra_args`` are appended as given.
    """

    name = "llama-server"
    error = LlamaServerError

    def __init__(
        self,
        *,
        ctx: int = 512,
        parallel: int | None = 1,
        threads: int = 2,
        cache_ram: int | None = 0,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        timeout: float = READY_TIMEOUT,
        model: Path | None = None,
    ) -> None:
        found = llama_paths()
        if isinstance(found, str):
            raise LlamaServerError(found)
        self.server, self.model = found
        if model is not None:  # another model than LLMP_LLAMA_MODEL (e.g. the SWA one)
            self.model = model
        self.ctx = ctx
        self.parallel = parallel
        self.threads = threads
        self.cache_ram = cache_ram
        self.extra_args = list(extra_args)
        self.timeout = timeout
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmp-llama-")
            log_path = Path(self._tmp.name) / "llama-server.log"
        self.log_path = log_path

    def command(self) -> list[str]:
        server = str(self.server)
        cmd = [
            server,
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-c",
            str(self.ctx),
            "-t",
            str(self.threads),
        ]
        if self.parallel is not None:  # None: the server's own default (auto, 4 slots)
            cmd += ["-np", str(self.parallel)]
        if self.cache_ram is not None and supports(server, "--cache-ram"):
            cmd += ["--cache-ram", str(self.cache_ram)]
        for flag in ("--offline", "--no-warmup"):
            if supports(server, flag):
                cmd.append(flag)
        return cmd + self.extra_args

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __exit__(self, *exc: object) -> None:
        self.close()
