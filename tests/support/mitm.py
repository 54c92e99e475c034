"""Run the real ``mitmdump`` as a subprocess for end-to-end tests.

    with Mitmdump(up.url, tmp_path / "rec.jsonl") as md:
        client = openai.OpenAI(base_url=md.url + "/v1", api_key="x")
        ...
    records = read_records(tmp_path / "rec.jsonl")

Output goes to a log file, never a pipe (a full pipe blocks mitmproxy's event
loop). Start-up waits for ``listening at 127.0.0.1:PORT`` and, unless
``wait_ready=False``, for the addon's ``llmp: recording to`` line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = TESTS_DIR.parent
DEFAULT_SCRIPT = REPO_DIR / "addon" / "llmp_addon.py"
#: The addon option that names the recording file (``--set <RECORD_OPTION>=<path>``).
RECORD_OPTION = "llmp_file"
READY_MARK = "llmp: recording to"
_LISTEN_RE = re.compile(r"listening at (?:\*|\[[^\]]*\]|[0-9.]+):(\d+)")


class MitmdumpError(RuntimeError):
    pass


def mitmdump_binary() -> str:
    """``mitmdump`` next to the running interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / "mitmdump"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mitmdump")
    if found is None:
        raise MitmdumpError("mitmdump not found next to sys.executable nor on PATH")
    return found


class Mitmdump:
    """A ``mitmdump`` subprocess, in reverse mode (default) or regular (forward) mode.

    ``script=None`` runs mitmdump with no addon (then pass ``wait_ready=False``).
    ``record_path`` is passed as ``--set {record_option}=PATH`` when given.
    ``options`` become ``--set k=v``. The process listens on 127.0.0.1 with an
    ephemeral port; ``url`` is ``http://127.0.0.1:PORT`` (the reverse proxy's
    base URL, or the proxy URL for regular mode).
    """

    def __init__(
        self,
        upstream_url: str | None = None,
        record_path: Path | None = None,
        options: Mapping[str, str] | None = None,
        *,
        mode: str = "reverse",
        script: Path | str | None = DEFAULT_SCRIPT,
        wait_ready: bool = True,
        timeout: float = 20.0,
        extra_args: Sequence[str] = (),
        record_option: str = RECORD_OPTION,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if mode not in ("reverse", "regular"):
            raise ValueError(f"mode must be 'reverse' or 'regular', not {mode!r}")
        if mode == "reverse" and not upstream_url:
            raise ValueError("reverse mode needs upstream_url")
        self.upstream_url = upstream_url
        self.record_path = record_path
        self.options = dict(options or {})
        if script is not None:
            # The recorder's own /tokenize calls (llmp_tokenize, on by default) would be
            # exchanges in a fake's log, which most tests count: on where a test asks.
            self.options.setdefault("llmp_tokenize", "false")
        self.mode = mode
        self.script = Path(script) if script is not None else None
        self.wait_ready = wait_ready
        self.timeout = timeout
        self.extra_args = list(extra_args)
        self.record_option = record_option
        self.env = dict(env) if env is not None else None
        self._tmp = tempfile.TemporaryDirectory(prefix="llmp-mitm-")
        self.confdir = Path(self._tmp.name) / "conf"
        self.log_path = log_path or Path(self._tmp.name) / "mitmdump.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self.returncode: int | None = None

    # -- command -----------------------------------------------------------

    def command(self) -> list[str]:
        if self.mode == "reverse":
            mode_arg = f"reverse:{self.upstream_url}"
        else:
            mode_arg = "regular"
        cmd = [
            mitmdump_binary(),
            "--mode",
            mode_arg,
            "--listen-host",
            "127.0.0.1",
            "-p",
            "0",
            "--set",
            f"confdir={self.confdir}",
            "--set",
            "flow_detail=0",
            "--set",
            "termlog_verbosity=info",
        ]
        if self.script is not None:
            cmd += ["-s", str(self.script)]
        if self.record_path is not None:
            cmd += ["--set", f"{self.record_option}={self.record_path}"]
        for key, value in self.options.items():
            cmd += ["--set", f"{key}={value}"]
        return cmd + self.extra_args

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> Self:
        if self.proc is not None:
            raise MitmdumpError("already started")
        self.confdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            text = self._wait_for(lambda t: _LISTEN_RE.search(t) is not None, "listening line")
            match = _LISTEN_RE.search(text)
            assert match is not None
            self._port = int(match.group(1))
            if self.wait_ready:
                self._wait_for(lambda t: READY_MARK in t, f"addon ready line {READY_MARK!r}")
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_for(self, pred: Any, what: str, timeout: float | None = None) -> str:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            text = self.log_text()
            if pred(text):
                return text
            assert self.proc is not None
            rc = self.proc.poll()
            if rc is not None:
                # one last read: the line may have landed just before exiting
                text = self.log_text()
                if pred(text):
                    return text
                self.returncode = rc
                raise MitmdumpError(
                    f"mitmdump exited with {rc} before {what}\n"
                    f"command: {self.command()}\n--- log ---\n{text}"
                )
            if time.monotonic() > deadline:
                raise MitmdumpError(
                    f"timed out waiting for {what}\ncommand: {self.command()}\n--- log ---\n{text}"
                )
            time.sleep(0.02)

    def wait_for_log(self, substring: str, timeout: float = 10.0) -> str:
        """Wait until the log contains ``substring``; return the whole log.

        Raises ``MitmdumpError`` (with the log) on timeout or if mitmdump exits first.
        """
        return self._wait_for(lambda t: substring in t, repr(substring), timeout)

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    @property
    def port(self) -> int:
        if self._port is None:
            raise MitmdumpError("mitmdump is not listening (not started?)")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait for the exit; return the exit code.

        If it does not exit within ``timeout``, it is killed and
        ``MitmdumpError`` is raised.
        """
        if self.proc is None:
            raise MitmdumpError("not started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                self.returncode = self.proc.returncode
                raise MitmdumpError(
                    f"mitmdump did not exit within {timeout}s of signal {sig}; killed\n"
                    f"--- log ---\n{self.log_text()}"
                ) from None
        self.returncode = self.proc.returncode
        return self.returncode

    def terminate(self, timeout: float = 15.0) -> int:
        return self.stop(signal.SIGTERM, timeout)

    def kill(self) -> int:
        if self.proc is None:
            return -1
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.returncode = self.proc.returncode
        return self.returncode

    def close(self) -> None:
        """Stop (SIGINT, then kill) if still running, and remove the temp dir."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self.stop()
                except MitmdumpError:
                    pass
        finally:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: Path, *, strict: bool = True) -> list[dict[str, Any]]:
    """A recording's JSON lines, sorted by ``id``. Blank lines are skipped.

    ``strict`` raises on a line that is not a JSON object; otherwise such
    lines are skipped. A missing file reads as no records.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    records: list[dict[str, Any]] = []
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            if strict:
                raise ValueError(f"{path}:{n}: not JSON: {line[:200]!r}") from e
            continue
        if not isinstance(obj, dict):
            if strict:
                raise ValueError(f"{path}:{n}: not a JSON object: {line[:200]!r}")
            continue
        records.append(obj)
    return sorted(records, key=lambda r: (r.get("id") is None, r.get("id") or 0))


def wait_for_records(path: Path, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Poll until the recording holds at least ``n`` records; return them (sorted)."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(path, strict=False)
        if len(records) >= n:
            return read_records(path)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: {len(records)} of {n} records after {timeout}s")
        time.sleep(0.02)
