"""A real agent harness (aider) against the real llama-server, recorded and analysed.

    .venv/bin/python bench/real_harness.py --setup-only      # install aider (cached, idempotent)
    .venv/bin/python bench/real_harness.py --out /tmp/rh     # the scenario, about 2-3 minutes

What it does, all on 127.0.0.1, stopping by itself:

1. **aider** (``aider-chat`` from PyPI) lives in its own venv under
   ``~/.cache/llmp-tools/aider-venv`` (``$LLMP_TOOLS_CACHE`` moves the cache),
   built with a Python aider supports (3.10-3.12). ``$LLMP_AIDER`` names
   another aider executable instead.
2. **llama-server** (``$LLMP_LLAMA_SERVER``, ``$LLMP_LLAMA_MODEL``) with one
   slot and the host-memory prompt cache off (``-np 1 --cache-ram 0``), so
   that a request that takes the slot costs the next one its prefix, and the
   loss shows in ``cache_n``; ``-n 48`` because the tiny model never stops.
3. **mitmdump -s addon/llmp_addon.py --set llmp_body=full** in front of it.
4. aider works a few turns on a tiny git repository (``SCENARIO``), in an
   interactive session fed one line at a time on its standard input, each
   sent when aider shows its prompt again and the server's slot is idle:
   two turns; the file edited by hand and ``/commit``, which makes aider ask
   its weak model for a commit message (non-streamed, same llama-server: a
   side-call that takes the slot); a turn; ``/ask`` (one request under
   another system prompt); a turn; a turn said while llama-server is down
   (the proxy answers 502, the restarting server 503, aider's SDK retries
   until it gets through to an empty cache); then aider is restarted with
   ``--restore-chat-history --max-chat-history-tokens 64``, so that it
   summarises the restored chat with its weak model before two more turns.
5. The recording is enriched with the server's own token counts
   (``llmp analyze --tokenize`` when the CLI has it, else
   ``llmp.format.token_counts.enrich_file``), then ``llmp analyze --json`` runs.
6. **Checks.** An oracle independent of the analyzer renders every recorded
   request with the server's own chat template (``/apply-template``) and
   tokenizer (``/tokenize``): the prefix a turn could have reused is the
   longest common token prefix with the previous turn of the conversation,
   and what was really lost is that prefix minus the server's ``cache_n``.
   Each turn row's verdict must agree: a lost prefix is blamed on what ran
   in between on the server (the weak-model commit call: ``side_call``), a
   turn that reused its prefix has no external loss, and the lost tokens
   match within a tolerance.

Everything lands in ``--out``: the recording (as recorded and enriched), the
report (JSON and readable), the oracle's numbers, the checks, and the logs.
Exit status 0 when every check passed, 1 when one failed, 2 when the
scenario could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(REPO_DIR))  # tests.support: the mitmdump harness

from tests.support.mitm import Mitmdump, read_records  # noqa: E402
from tests.support.real import LlamaServer, llama_paths  # noqa: E402

AIDER_VERSION = "0.86.2"
AIDER_ENV = "LLMP_AIDER"
CACHE_ENV = "LLMP_TOOLS_CACHE"
PYTHON_ENV = "LLMP_AIDER_PYTHON"
SUPPORTED_PYTHONS = ((3, 12), (3, 11), (3, 10))
MAIN_MODEL = "smol"
WEAK_MODEL = "smol-weak"
CTX = 4096
N_PREDICT = 48
TURN_TIMEOUT = 180.0  # one step: a cold prefill of ~1000 tokens is ~10 s on 2 cores
QUIET_S = 1.0  # the slot must stay idle this long before the next step
DEAD_PROXY = "http://127.0.0.1:9"  # anything aider tries beyond 127.0.0.1 fails here, at once

# The oracle's tolerances: a deficit at or below TOL tokens is not a loss
# (the analyzer's own reuse tolerance), and token figures may differ from the
# oracle by TOL plus SHARE of the prefix (template tokens at boundaries, one
# token re-evaluated at the end of a reused prompt).
TOL = 32
SHARE = 0.10


@dataclass(frozen=True)
class Step:
    """One thing the user does: ``say`` a message, ``cmd`` a /command, ``edit`` the file,
    ``restart`` aider with more options, or say something during a server ``outage``."""

    kind: str
    text: str


SCENARIO: tuple[Step, ...] = (
    Step("say", "Add a function greet(name) that returns 'Hello, ' + name."),
    Step("say", "Now add a docstring to greet()."),
    Step("edit", "\n\ndef add(a, b):\n    return a + b\n"),
    Step("cmd", "/commit"),
    Step("say", "Add a function mul(a, b) that returns a * b."),
    Step("cmd", "/ask What does hello.py do?"),
    Step("say", "Thanks. Also rename greet to hello."),
    Step("outage", "Add a main guard."),
    Step("restart", "--restore-chat-history --max-chat-history-tokens 64"),
    Step("say", "Add a function sub(a, b) that returns a - b."),
    Step("say", "Now add type hints to sub."),
)

# Extra aider options of the scenario (none by default).
AIDER_ARGS: tuple[str, ...] = ()

HELLO_PY = """def show_greeting():
    print("Hello, world")


if __name__ == "__main__":
    show_greeting()
"""


class HarnessError(RuntimeError):
    """The scenario could not run (not a failed check)."""


# --------------------------------------------------------------------- aider


def tools_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/llmp-tools").expanduser()


def aider_venv() -> Path:
    return tools_cache() / "aider-venv"


def _aider_works(exe: Path) -> str | None:
    """The version an aider executable reports, or None if it does not run."""
    try:
        out = subprocess.run(
            [str(exe), "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
            check=False,
            env=_minimal_env(Path(os.environ.get("HOME", "/tmp"))),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).decode("utf-8", "replace").strip()
    if out.returncode != 0 or "aider" not in text.lower():
        return None
    return text.splitlines()[-1]


def find_aider() -> Path | None:
    """``$LLMP_AIDER``, else the cached venv's aider, else one on PATH; None if none.

    Only looks: nothing is installed here (see `setup_aider`).
    """
    env = os.environ.get(AIDER_ENV, "").strip()
    if env:
        exe = Path(env).expanduser()
        return exe if exe.is_file() and os.access(exe, os.X_OK) else None
    cached = aider_venv() / "bin" / "aider"
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    found = shutil.which("aider")
    return Path(found) if found else None


def _python_version(exe: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [exe, "-c", "import sys, venv; print(*sys.version_info[:2])"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def find_python() -> str:
    """A Python that aider-chat supports (3.10-3.12, newest first), with venv."""
    env = os.environ.get(PYTHON_ENV, "").strip()
    if env:
        if _python_version(env) in SUPPORTED_PYTHONS:
            return env
        raise HarnessError(f"{PYTHON_ENV}={env} is not Python 3.10-3.12 with venv")
    pyenv = Path(os.environ.get("PYENV_ROOT") or "~/.pyenv").expanduser() / "versions"
    for major, minor in SUPPORTED_PYTHONS:
        candidates: list[str] = []
        found = shutil.which(f"python{major}.{minor}")
        if found:
            candidates.append(found)
        candidates += [str(p) for p in sorted(pyenv.glob(f"{major}.{minor}.*/bin/python3"))]
        candidates.append(f"/usr/bin/python{major}.{minor}")
        for exe in candidates:
            if Path(exe).exists() and _python_version(exe) == (major, minor):
                return exe
    raise HarnessError(
        "no Python 3.10-3.12 found for aider-chat (it does not support newer ones); "
        f"set {PYTHON_ENV}"
    )


def setup_aider(log: TextIO = sys.stderr) -> Path:
    """Install aider-chat into the cached venv, once; return its executable.

    Idempotent: a venv whose aider already reports the pinned version is kept.
    Uses pip with the machine's own configuration (index, find-links).
    """
    venv = aider_venv()
    exe = venv / "bin" / "aider"
    marker = venv / ".llmp-aider-version"
    if exe.exists() and marker.exists() and marker.read_text().strip() == AIDER_VERSION:
        if _aider_works(exe):
            return exe
    python = find_python()
    print(f"setting up aider-chat=={AIDER_VERSION} in {venv} with {python}", file=log, flush=True)
    if not (venv / "bin" / "python").exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True, stdin=subprocess.DEVNULL)
    pip_log = venv.parent / "aider-venv-pip.log"
    with open(pip_log, "wb") as out:
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", f"aider-chat=={AIDER_VERSION}"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=1800,
        )
    if done.returncode != 0 or not _aider_works(exe):
        raise HarnessError(f"installing aider-chat failed; see {pip_log}")
    marker.write_text(AIDER_VERSION + "\n")
    return exe


# --------------------------------------------------------------- the session


def _minimal_env(home: Path) -> dict[str, str]:
    """An environment without the caller's AIDER_*/OPENAI_* settings, offline."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        # litellm: the bundled model list, never the one on GitHub.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # Anything that is not 127.0.0.1 goes to a closed local port and fails at once.
        "HTTP_PROXY": DEAD_PROXY,
        "HTTPS_PROXY": DEAD_PROXY,
        "ALL_PROXY": DEAD_PROXY,
        "http_proxy": DEAD_PROXY,
        "https_proxy": DEAD_PROXY,
        "all_proxy": DEAD_PROXY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "GIT_AUTHOR_NAME": "llmp bench",
        "GIT_AUTHOR_EMAIL": "bench@127.0.0.1",
        "GIT_COMMITTER_NAME": "llmp bench",
        "GIT_COMMITTER_EMAIL": "bench@127.0.0.1",
    }
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env


def make_repo(path: Path) -> Path:
    """A one-file git repository with one commit."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / "hello.py").write_text(HELLO_PY)
    env = _minimal_env(path.parent)
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "hello.py"],
        ["git", "commit", "-q", "-m", "Initial commit"],
    ):
        subprocess.run(cmd, cwd=path, check=True, env=env, stdin=subprocess.DEVNULL)
    return path


def make_home(path: Path) -> Path:
    """A HOME for aider: its model-price cache is present and fresh, so it is never fetched."""
    caches = path / ".aider" / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    # Not empty: aider fetches the list again when the cached one is empty.
    (caches / "model_prices_and_context_window.json").write_text('{"llmp-bench": {}}')
    return path


def aider_command(aider: Path, api_base: str, work: Path, extra: Sequence[str] = ()) -> list[str]:
    return [
        str(aider),
        "--model", f"openai/{MAIN_MODEL}",
        "--weak-model", f"openai/{WEAK_MODEL}",
        "--openai-api-base", api_base,
        "--openai-api-key", "x",
        "--edit-format", "whole",
        "--no-show-model-warnings",
        "--no-check-update",
        "--analytics-disable",
        "--no-show-release-notes",
        "--yes-always",
        "--no-pretty",
        "--no-fancy-input",
        "--no-gitignore",
        "--no-detect-urls",
        "--no-auto-lint",
        "--no-suggest-shell-commands",
        "--encoding", "utf-8",
        "--timeout", str(int(TURN_TIMEOUT)),
        "--chat-history-file", str(work / "aider.chat.history.md"),
        "--input-history-file", str(work / "aider.input.history"),
        *extra,
        "hello.py",
    ]  # fmt: skip


PROMPT_RE = re.compile(r"(?:^|\n)[\w-]*> \Z")


class AiderSession:
    """aider in interactive mode, fed one line at a time on its standard input."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._buf = ""
        self._lock = threading.Lock()
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            text = data.decode("utf-8", "replace")
            with self._lock:
                self._buf += text
                self._log.write(text)
                self._log.flush()

    def wait_prompt(self, timeout: float) -> str:
        """Wait until aider asks for input again; return what it printed meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                # The prompt is a line of its own: "> ", or "ask> " and the like.
                if PROMPT_RE.search(self._buf):
                    out, self._buf = self._buf, ""
                    return out
            if self.proc.poll() is not None:
                raise HarnessError(f"aider exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise HarnessError(f"aider did not ask for input within {timeout:.0f}s")
            time.sleep(0.05)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self._log.write(line + "\n")
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def close(self, timeout: float = 20.0) -> int:
        """End of input (aider exits), then kill its process group if it lingers."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (start_new_session)
            self.proc.wait(10)
        self._reader.join(5)
        self._log.close()
        return self.proc.returncode


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_idle(server_url: str, quiet: float = QUIET_S, timeout: float = TURN_TIMEOUT) -> None:
    """Until the server's slots have been idle for `quiet` seconds (aider's
    background calls, such as a history summary, have ended)."""
    deadline = time.monotonic() + timeout
    idle_since: float | None = None
    while time.monotonic() < deadline:
        try:
            slots = _get_json(server_url + "/slots")
            busy = any(s.get("is_processing") for s in slots)
        except (OSError, ValueError):
            busy = False
        now = time.monotonic()
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= quiet:
            return
        time.sleep(0.1)
    raise HarnessError(f"the server stayed busy for {timeout:.0f}s")


@dataclass
class StepLog:
    step: int
    kind: str
    text: str
    records_before: int
    records_after: int
    seconds: float


def restart_llama(llama: LlamaServer) -> None:
    """Stop the server and start it again on the same port (its cache is gone)."""
    from tests.support import real

    port = llama.port
    llama.stop()
    llama.proc = None
    saved = real.free_port
    real.free_port = lambda: port
    try:
        llama.start()
    finally:
        real.free_port = saved


def _count_errors(recording: Path) -> int:
    return sum(1 for r in read_records(recording, strict=False) if r.get("error"))


def drive_aider(
    aider: Path,
    proxy_url: str,
    llama: LlamaServer,
    work: Path,
    recording: Path,
    steps: Sequence[Step] = SCENARIO,
    log: TextIO = sys.stderr,
    aider_args: Sequence[str] = (),
) -> list[StepLog]:
    """Run the scenario; what each step added to the recording.

    ``restart`` ends the aider process and starts another in the same
    repository with the step's text as extra options (``--restore-chat-history``
    continues the chat from aider's history file, as a user who comes back does).
    ``outage`` stops llama-server, says the step's text (aider retries while
    the proxy answers 502), and starts the server again on the same port.
    """
    server_url = llama.url
    repo = make_repo(work / "repo")
    home = make_home(work / "home")
    env = _minimal_env(home)
    api = proxy_url + "/v1"
    starts = 1

    def start(extra: Sequence[str]) -> AiderSession:
        name = "aider.log" if starts == 1 else f"aider-{starts}.log"
        s = AiderSession(aider_command(aider, api, work, extra), repo, env, work / name)
        s.wait_prompt(120)
        wait_idle(server_url)  # what aider sends at start-up (a history summary)
        return s

    session = start(aider_args)
    done: list[StepLog] = []
    try:
        for i, step in enumerate(steps, 1):
            before = len(read_records(recording, strict=False))
            t0 = time.monotonic()
            if step.kind == "edit":
                with open(repo / "hello.py", "a", encoding="utf-8") as f:
                    f.write(step.text)
            elif step.kind == "restart":
                session.close()
                starts += 1
                session = start([*aider_args, *step.text.split()])
            elif step.kind == "outage":
                errors = _count_errors(recording)
                llama.stop()
                session.send(step.text)
                deadline = time.monotonic() + 60
                while _count_errors(recording) == errors:
                    if time.monotonic() > deadline:
                        raise HarnessError("no failed exchange while the server was down")
                    time.sleep(0.1)
                restart_llama(llama)
                session.wait_prompt(TURN_TIMEOUT)
                wait_idle(server_url)
            else:
                session.send(step.text)
                session.wait_prompt(TURN_TIMEOUT)
                wait_idle(server_url)
            after = len(read_records(recording, strict=False))
            done.append(StepLog(i, step.kind, step.text, before, after, time.monotonic() - t0))
            print(
                f"  step {i}: {step.kind} {step.text.strip()[:50]!r}: "
                f"{after - before} exchange(s), {time.monotonic() - t0:.1f}s",
                file=log,
                flush=True,
            )
    finally:
        session.close()
    return done


# ---------------------------------------------------------------- the oracle


def _reached_server(rec: dict[str, Any]) -> bool:
    """Whether the server saw this request's prompt (so it may have taken the slot)."""
    resp = rec.get("response")
    err = rec.get("error")
    if err in ("upstream_unreachable", "timeout", "body_too_large"):
        return False
    if isinstance(resp, dict) and isinstance(resp.get("status"), int):
        # llama-server refuses a 4xx (a context error) or a 503 (loading) before
        # any slot sees the prompt; checked on the real server.
        return bool(200 <= resp["status"] < 300)
    return err in ("client_disconnected", "upstream_reset")


def _timings(rec: dict[str, Any]) -> dict[str, Any] | None:
    resp = rec.get("response")
    body = resp.get("body") if isinstance(resp, dict) else None
    if not isinstance(body, dict):
        return None
    t = body.get("timings")
    return t if isinstance(t, dict) else None


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Truth:
    """What the server really did with one chat request, from its own counters."""

    id: int
    model: str | None
    prompt_tokens: int | None  # cache_n + prompt_n
    cache_n: int | None
    rendered: int | None  # the oracle's own token count of the rendered prompt
    conv_prev: int | None = None  # previous request of the same conversation (main model)
    slot_prev: int | None = None  # the last request the server processed before this one
    reusable: int | None = None  # LCP with conv_prev: what could have been reused
    slot_lcp: int | None = None  # LCP with slot_prev: what the slot still matched
    lost: int | None = None  # reusable - cache_n when above TOL


def _render(server_url: str, body: dict[str, Any]) -> list[int]:
    req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prompt = _post_json(server_url + "/apply-template", req)["prompt"]
    toks = _post_json(
        server_url + "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
    )["tokens"]
    return [t if isinstance(t, int) else int(t["id"]) for t in toks]


def oracle(server_url: str, records: list[dict[str, Any]]) -> dict[int, Truth]:
    """Per chat request: the server's counters and the reusable prefix, by the server's own
    template and tokenizer. Independent of the analyzer."""
    truths: dict[int, Truth] = {}
    tokens: dict[int, list[int]] = {}
    last_main: int | None = None
    last_slot: int | None = None
    for rec in sorted(records, key=lambda r: (r["t_start_ms"], r["id"])):
        req = rec.get("request") or {}
        body = req.get("body")
        if not (isinstance(body, dict) and "chat/completions" in str(req.get("path"))):
            continue
        if not _reached_server(rec):
            continue
        rid = rec["id"]
        t = _timings(rec)
        cache_n = t.get("cache_n") if t else None
        prompt_n = t.get("prompt_n") if t else None
        prompt = (
            cache_n + prompt_n if isinstance(cache_n, int) and isinstance(prompt_n, int) else None
        )
        tokens[rid] = _render(server_url, body)
        model = body.get("model")
        tr = Truth(rid, model, prompt, cache_n, len(tokens[rid]))
        if model == MAIN_MODEL and rec.get("error") is None:
            tr.conv_prev = last_main
            if last_main is not None:
                tr.reusable = _lcp(tokens[last_main], tokens[rid])
        tr.slot_prev = last_slot
        if last_slot is not None:
            tr.slot_lcp = _lcp(tokens[last_slot], tokens[rid])
        if tr.reusable is not None and cache_n is not None:
            deficit = tr.reusable - cache_n
            tr.lost = deficit if deficit > TOL else 0
        truths[rid] = tr
        if model == MAIN_MODEL and rec.get("error") is None:
            last_main = rid
        last_slot = rid
    return truths


# ----------------------------------------------------------------- the checks


@dataclass
class Check:
    row: int
    what: str
    ok: bool
    detail: str


def _val(mv: Any) -> float | None:
    return float(mv["value"]) if isinstance(mv, dict) and mv.get("value") is not None else None


def expected_cause(truth: Truth, kinds: dict[int, str]) -> str | None:
    """The external cause a lost prefix must get: what took the slot in between.

    ``side_call`` or ``other_conversation`` after a row of that kind;
    ``skipped`` after a request that reached the server but is no row (an
    error: the analyzer cannot tell what it was and must say
    ``undetermined``); ``server`` when nothing ran in between.
    """
    if not truth.lost:
        return None
    if truth.slot_prev is not None and truth.slot_prev != truth.conv_prev:
        kind = kinds.get(truth.slot_prev)
        if kind is None:
            return "skipped"
        return "side_call" if kind == "side_call" else "other_conversation"
    return "server"  # nothing ran in between: one of the server_* kinds


def check_report(
    report: dict[str, Any], truths: dict[int, Truth], records: list[dict[str, Any]]
) -> list[Check]:
    """The analyzer's verdicts against the oracle, row by row."""
    rows = {r["id"]: r for r in report["rows"]}
    bodies = {r["id"]: (r.get("request") or {}).get("body") for r in records if isinstance(r, dict)}
    checks: list[Check] = []

    def add(row: int, what: str, ok: bool, detail: str) -> None:
        checks.append(Check(row, what, ok, detail))

    kinds = {rid: r["kind"] for rid, r in rows.items()}
    for rid, tr in sorted(truths.items()):
        row = rows.get(rid)
        body = bodies.get(rid)
        model = body.get("model") if isinstance(body, dict) else None
        if row is None:
            continue  # an errored exchange: no row, by design
        # Which rows are turns and which are side-calls, as the harness sent them.
        want_kind = "side_call" if model == WEAK_MODEL else "turn"
        add(rid, "kind", row["kind"] == want_kind, f"{row['kind']} (want {want_kind})")
        if row["kind"] != "turn" or want_kind != "turn":
            continue
        # The server's counters, as the analyzer read them.
        pt = _val(row["counts"]["prompt_tokens"])
        rt = _val(row["counts"]["reused_tokens"])
        add(
            rid,
            "counters",
            pt == tr.prompt_tokens and rt == tr.cache_n,
            f"prompt {pt} reused {rt}; server {tr.prompt_tokens} / cache_n {tr.cache_n}",
        )
        if tr.rendered is not None and tr.prompt_tokens is not None:
            add(
                rid,
                "oracle",
                abs(tr.rendered - tr.prompt_tokens) <= 2,
                f"rendered {tr.rendered} tokens, server prompt {tr.prompt_tokens}",
            )
        if tr.conv_prev is None:
            add(rid, "link", row["linked_to"] is None, f"linked_to {row['linked_to']} (first turn)")
            continue
        add(
            rid,
            "link",
            row["linked_to"] == tr.conv_prev and not row["new_conversation"],
            f"linked_to {row['linked_to']} (want {tr.conv_prev})",
        )
        assert tr.reusable is not None
        reusable = tr.reusable
        tol = TOL + SHARE * reusable
        if pt and row["predicted_reuse"] is not None:
            predicted = row["predicted_reuse"] * pt
            add(
                rid,
                "predicted",
                abs(predicted - reusable) <= tol,
                f"predicted prefix {predicted:.0f}, oracle {reusable} (±{tol:.0f})",
            )
        ext = row["lost_external"]
        want = expected_cause(tr, kinds)
        if want is None:
            add(
                rid,
                "no external loss",
                ext is None or ext["tokens"] <= tol,
                f"cache_n {tr.cache_n} of reusable {reusable}; analyzer {ext}",
            )
        else:
            got: str | None = ext["cause"] if ext else None
            if got is None:
                ok = False
            elif want == "skipped":  # the server's loss, but something unknown ran
                ok = got.startswith("server_") and row["cause"] in ("undetermined", "structural")
            elif want == "server":
                ok = got.startswith("server_") and row["cause"] in ("server_reset", "structural")
            else:
                ok = got == want
            add(
                rid,
                "cause",
                ok,
                f"{got}, row {row['cause']} (want {want}; slot held {tr.slot_prev})",
            )
            if want == "side_call":
                add(rid, "row cause", row["cause"] in ("side_call", "structural"), row["cause"])
            if ext is not None:
                assert tr.lost is not None
                add(
                    rid,
                    "lost tokens",
                    abs(ext["tokens"] - tr.lost) <= tol,
                    f"{ext['tokens']} (oracle {tr.lost} = {reusable} - cache_n {tr.cache_n})",
                )
        # A break the client made: the prefix ends before the previous prompt does.
        prev = truths[tr.conv_prev]
        broke = prev.rendered is not None and reusable < prev.rendered - TOL
        add(
            rid,
            "break",
            (row["break_cause"] is not None) == broke,
            f"break_cause {row['break_cause']}; oracle prefix {reusable} of {prev.rendered}",
        )
        lc = row["lost_client"]
        if lc is not None and prev.rendered is not None:
            add(
                rid,
                "client loss bound",
                0 < lc["tokens"] <= prev.rendered - reusable + tol,
                f"{lc['cause']} {lc['tokens']} "
                f"(at most {prev.rendered - reusable} after the break)",
            )
    return checks


# -------------------------------------------------------------------- output


def table(report: dict[str, Any], truths: dict[int, Truth], checks: list[Check]) -> str:
    """The rows next to the oracle, one line each."""
    failed = {c.row for c in checks if not c.ok}
    head = (
        f"{'id':>3} {'model':<9} {'kind':<17} {'link':>4} {'prompt':>6} {'cache_n':>7} "
        f"{'reusable':>8} {'predicted':>9} {'lost ext':>18} {'lost client':>22} {'cause':<13} ok"
    )
    lines = [head, "-" * len(head)]
    for row in report["rows"]:
        rid = row["id"]
        tr = truths.get(rid)
        pt = _val(row["counts"]["prompt_tokens"])
        kind = row["kind"] + (f"/{row['side_call_shape']}" if row["side_call_shape"] else "")
        pr = row["predicted_reuse"]
        pred = f"{pr * pt:.0f}" if pr is not None and pt and row["linked_to"] else "-"
        ext = row["lost_external"]
        lc = row["lost_client"]
        lines.append(
            f"{rid:>3} {str(row['model'])[:9]:<9} {kind:<17} {row['linked_to'] or '-':>4} "
            f"{pt or 0:>6.0f} {tr.cache_n if tr else '-':>7} "
            f"{tr.reusable if tr and tr.reusable is not None else '-':>8} {pred:>9} "
            f"{(ext['cause'] + ' ' + str(ext['tokens'])) if ext else '-':>18} "
            f"{(lc['cause'] + ' ' + str(lc['tokens'])) if lc else '-':>22} "
            f"{row['cause'] or '-':<13} {'FAIL' if rid in failed else 'ok'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ pipeline


def cli_has_tokenize() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "llmp.cli", "analyze", "--help"],
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return re.search(rb"(?m)^\s+--tokenize[ ,=]", out.stdout) is not None


def _llmp(*args: str, env: dict[str, str] | None = None) -> bytes:
    """`llmp ARGS` with this interpreter; its standard output, or HarnessError."""
    done = subprocess.run(
        [sys.executable, "-m", "llmp.cli", *args],
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip()
        raise HarnessError(f"llmp {' '.join(args)} exited with {done.returncode}: {err[-2000:]}")
    return done.stdout


def enrich_and_analyze(recording: Path, server_url: str) -> tuple[dict[str, Any], str]:
    """Token counts from the server, then the report (JSON and readable)."""
    rec = str(recording)
    if cli_has_tokenize():
        out = _llmp("analyze", rec, "--tokenize", server_url, "--json", "--no-progress")
    else:  # until the CLI has --tokenize: the same code, called directly
        from llmp.apis import record_targets
        from llmp.format.token_counts import enrich_file

        enrich_file(recording, server_url, targets=record_targets, progress=False)
        out = _llmp("analyze", rec, "--json", "--no-progress")
    try:
        report = json.loads(out)
    except ValueError as exc:
        raise HarnessError(f"llmp analyze --json printed no JSON: {out[:300]!r}") from exc
    readable = _llmp("analyze", rec, "--no-progress", env={**os.environ, "COLUMNS": "120"})
    return report, readable.decode("utf-8", "replace")


@dataclass
class Result:
    out: Path
    recording: Path
    report: dict[str, Any]
    readable: str
    truths: dict[int, Truth]
    checks: list[Check]
    steps: list[StepLog] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


def _llama(out: Path) -> LlamaServer:
    found = llama_paths()
    if isinstance(found, str):
        raise HarnessError(found)
    return LlamaServer(
        ctx=CTX, cache_ram=0, extra_args=["-n", str(N_PREDICT)], log_path=out / "llama-server.log"
    )


def analyse(out: Path, recording: Path, server_url: str, t0: float) -> Result:
    """Oracle, enrichment, report and checks of a recording, against a running server."""
    shutil.copyfile(recording, out / "recording.raw.jsonl")
    records = read_records(recording)
    truths = oracle(server_url, records)
    report, readable = enrich_and_analyze(recording, server_url)
    checks = check_report(report, truths, records)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.txt").write_text(readable)
    (out / "oracle.json").write_text(json.dumps([asdict(t) for t in truths.values()], indent=1))
    (out / "checks.json").write_text(json.dumps([asdict(c) for c in checks], indent=1))
    return Result(out, recording, report, readable, truths, checks, seconds=time.monotonic() - t0)


def _prepare_out(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    recording = out / "recording.jsonl"
    for stale in (recording, out / "recording.raw.jsonl"):
        stale.unlink(missing_ok=True)
    return recording


def run(
    out: Path,
    aider: Path,
    steps: Sequence[Step] = SCENARIO,
    log: TextIO = sys.stderr,
    aider_args: Sequence[str] = AIDER_ARGS,
) -> Result:
    """The whole scenario: servers up, aider driven, recording enriched, analysed, checked."""
    t0 = time.monotonic()
    recording = _prepare_out(out)
    work = out / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    with _llama(out) as llama:
        print(f"llama-server on {llama.url}: {' '.join(llama.command()[1:])}", file=log, flush=True)
        md = Mitmdump(llama.url, recording, {"llmp_body": "full"}, log_path=out / "mitmdump.log")
        with md:
            print(f"mitmdump on {md.url}, recording to {recording}", file=log, flush=True)
            steps_done = drive_aider(aider, md.url, llama, work, recording, steps, log, aider_args)
            md.stop()
        res = analyse(out, recording, llama.url, t0)
    res.steps = steps_done
    res.seconds = time.monotonic() - t0
    (out / "summary.txt").write_text(summary(res))
    return res


def recheck(out: Path, source: Path, log: TextIO = sys.stderr) -> Result:
    """An earlier recording (aider's, same model names) through the same oracle and checks."""
    t0 = time.monotonic()
    recording = _prepare_out(out)
    shutil.copyfile(source, recording)
    with _llama(out) as llama:
        print(f"llama-server on {llama.url} (oracle and /tokenize only)", file=log, flush=True)
        res = analyse(out, recording, llama.url, t0)
    res.seconds = time.monotonic() - t0
    (out / "summary.txt").write_text(summary(res))
    return res


def summary(res: Result) -> str:
    lines = [table(res.report, res.truths, res.checks), ""]
    failed = [c for c in res.checks if not c.ok]
    lines.append(f"{len(res.checks) - len(failed)} of {len(res.checks)} checks passed")
    for c in failed:
        lines.append(f"  FAIL row {c.row} {c.what}: {c.detail}")
    lines.append(f"total {res.seconds:.0f}s; everything in {res.out}")
    return "\n".join(lines)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise in the main thread when the whole run takes longer than `seconds`."""

    def fire(signum: int, frame: object) -> None:
        raise HarnessError(f"the run took longer than {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("/tmp/llmp-real-harness"))
    p.add_argument(
        "--setup-only", action="store_true", help="install aider into the cache and stop"
    )
    p.add_argument("--timeout", type=float, default=900, help="stop the whole run after this")
    p.add_argument(
        "--recording",
        type=Path,
        help="check an earlier aider recording instead of running aider (a copy is analysed)",
    )
    p.add_argument("--aider-arg", action="append", default=[], help="one more aider option")
    args = p.parse_args(argv)
    try:
        if args.recording is not None:
            with _deadline(args.timeout):
                res = recheck(args.out, args.recording)
            print(res.readable)
            print(summary(res))
            return 0 if res.ok else 1
        if args.setup_only:
            exe = setup_aider()
            print(f"aider: {exe} ({_aider_works(exe)})")
            return 0
        aider = find_aider()
        if aider is None:
            print(
                f"no aider found: set {AIDER_ENV}, or run {sys.argv[0]} --setup-only",
                file=sys.stderr,
            )
            return 2
        with _deadline(args.timeout):
            res = run(args.out, aider, aider_args=[*AIDER_ARGS, *args.aider_arg])
    except HarnessError as exc:
        print(f"real_harness: {exc}", file=sys.stderr)
        return 2
    print(res.readable)
    print(summary(res))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
