"""`llmp run -- COMMAND`: the recorder around one child, its terminal kept, then the report."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmp.recorder.run import child_env, exit_code, live_log_for
from tests.support.upstreams import Upstream

LLMP = str(Path(sys.executable).with_name("llmp"))

CHAT = textwrap.dedent(
    """
    import os, sys, openai
    c = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="x")
    msgs = [{"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": "hi"}]
    for i in range(int(sys.argv[1])):
        r = c.chat.completions.create(model="m", messages=msgs, stream=True,
                                      stream_options={"include_usage": True})
        text = "".join((ch.choices[0].delta.content or "") for ch in r if ch.choices)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"more {i}"}]
    print("chat done", flush=True)
    """
)

INTERACTIVE = textwrap.dedent(
    """
    import os, signal, sys, openai
    def stop(signum, frame):
        print("child got SIGINT", flush=True)
        sys.exit(130)
    signal.signal(signal.SIGINT, stop)
    print("ready>", flush=True)
    line = sys.stdin.readline().strip()
    c = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="x")
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": line}])
    print(f"got {line}", flush=True)
    signal.pause()
    """
)


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LLMP, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_child_env_points_every_base_url_at_the_proxy() -> None:
    env = {
        "OPENAI_API_BASE": "http://127.0.0.1:8080/v1",
        "MY_SERVER": "http://127.0.0.1:8080/",
        "OTHER": "http://127.0.0.1:9090",
        "PATH": "/usr/bin",
    }
    out = child_env(env, "http://127.0.0.1:8080", "http://127.0.0.1:5555")
    assert out["OPENAI_API_BASE"] == "http://127.0.0.1:5555/v1"
    assert out["MY_SERVER"] == "http://127.0.0.1:5555/"
    assert out["OTHER"] == "http://127.0.0.1:9090" and out["PATH"] == "/usr/bin"
    assert out["OPENAI_BASE_URL"] == "http://127.0.0.1:5555/v1"
    assert out["ANTHROPIC_BASE_URL"] == out["OLLAMA_HOST"] == "http://127.0.0.1:5555"
    assert env["MY_SERVER"] == "http://127.0.0.1:8080/"  # the parent's is untouched


def test_child_env_keeps_the_path_of_a_base_url_that_named_the_upstream() -> None:
    """A harness pointed at OpenRouter (`OPENAI_BASE_URL=https://openrouter.ai/api/v1`,
    `ANTHROPIC_BASE_URL=https://openrouter.ai/api`) under `--upstream https://openrouter.ai`
    keeps OpenRouter's `/api` path, behind the proxy's address."""
    env = {
        "OPENAI_BASE_URL": "https://openrouter.ai/api/v1",
        "ANTHROPIC_BASE_URL": "https://openrouter.ai/api",
        "OLLAMA_HOST": "http://127.0.0.1:11434",
    }
    out = child_env(env, "https://openrouter.ai", "http://127.0.0.1:5555")
    assert out["OPENAI_BASE_URL"] == "http://127.0.0.1:5555/api/v1"
    assert out["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5555/api"
    assert out["OLLAMA_HOST"] == "http://127.0.0.1:5555"  # another server: the proxy's


def test_small_pieces() -> None:
    assert live_log_for("/a/run.jsonl") == "/a/run.live.log"
    assert live_log_for("/a/run") == "/a/run.live.log"
    assert exit_code(3) == 3 and exit_code(-signal.SIGINT) == 130


def test_records_explains_and_exits_with_the_childs_code(tmp_path: Path, llama: Upstream) -> None:
    script = tmp_path / "chat.py"
    script.write_text(CHAT + "raise SystemExit(7)\n")
    html = tmp_path / "page.html"
    done = run(
        ["--upstream", llama.url, "--out", "rec.jsonl", "--html", str(html), "--",
         sys.executable, str(script), "3"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 7, done.stderr
    # The child's terminal is its own: its output, and nothing of the live view, on stdout.
    assert done.stdout == "chat done\n"
    assert "llmp run: " in done.stderr and "llmp analyze" in done.stderr
    assert "3 chat requests analysed: 3 turns in 1 conversation" in done.stderr
    # The live view's lines went to the log file beside the recording.
    live = (tmp_path / "rec.live.log").read_text()
    assert live.count(" conv 1 turn ") == 3 and "llmp: live view: 3 turns" in live
    assert "the live view's lines are in" in done.stderr
    # The report's rows are the recording's.
    records = [json.loads(line) for line in (tmp_path / "rec.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3]
    assert all(r["request"]["path"] == "/v1/chat/completions" for r in records)
    analysed = subprocess.run(
        [LLMP, "analyze", str(tmp_path / "rec.jsonl"), "--json"], capture_output=True, text=True
    )
    rows = json.loads(analysed.stdout)["rows"]
    assert [r["id"] for r in rows] == [1, 2, 3] and [r["turn"] for r in rows] == [1, 2, 3]
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_a_command_that_cannot_start(tmp_path: Path, llama: Upstream) -> None:
    done = run(["--upstream", llama.url, "--out", "rec.jsonl", "--", "no-such-harness-x"], tmp_path)
    assert done.returncode == 127
    assert done.stderr.strip().splitlines() == [
        "llmp run: cannot start no-such-harness-x: command not found"
    ]
    assert not (tmp_path / "rec.jsonl").exists()
    assert not (tmp_path / "rec.live.log").exists()


def test_a_file_that_is_not_executable(tmp_path: Path, llama: Upstream) -> None:
    """Found on PATH, but exec fails: still one line, and no empty recording."""
    bad = tmp_path / "not-a-program"
    bad.write_text("just text\n")
    bad.chmod(0o644)
    done = run(["--upstream", llama.url, "--out", "rec.jsonl", "--", str(bad)], tmp_path)
    assert done.returncode == 127
    assert "llmp run: cannot start" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "rec.jsonl").exists()


def _read_until(fd: int, needle: bytes, timeout: float = 60) -> bytes:
    out = b""
    end = time.monotonic() + timeout
    while needle not in out:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not seen in {out!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the pty closed: everyone is gone
                break
            if not chunk:
                break
            out += chunk
    return out


def test_input_and_ctrl_c_reach_the_child(tmp_path: Path, llama: Upstream) -> None:
    """On a terminal: the child reads what is typed, and Ctrl-C reaches it first."""
    script = tmp_path / "interactive.py"
    script.write_text(INTERACTIVE)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [LLMP, "run", "--upstream", llama.url, "--out", "rec.jsonl", "--",
         sys.executable, str(script)],
        cwd=tmp_path, stdin=slave, stdout=slave, stderr=slave,
        start_new_session=True,  # its own process group, as a shell's foreground job
    )  # fmt: skip
    os.close(slave)
    try:
        seen = _read_until(master, b"ready>")
        os.write(master, b"hello there\n")
        seen += _read_until(master, b"got hello there")
        # Ctrl-C: the terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        while True:
            ready, _, _ = select.select([master], [], [], 1)
            if not ready:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = re.sub(
        r"\x1b\[[0-9;]*[A-Za-z]", "", seen.decode(errors="replace")
    )  # a terminal's colours
    text = " ".join(text.split())
    assert "child got SIGINT" in text
    assert code == 130  # the child's own exit code
    assert "llmp analyze" in text and "1 chat request analysed" in text  # still reported
    rec = [json.loads(x) for x in (tmp_path / "rec.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["error"] is None


def test_the_report_is_of_this_session_only(tmp_path: Path, llama: Upstream) -> None:
    """A recording appended to by several runs: each run reports its own session."""
    script = tmp_path / "chat.py"
    script.write_text(CHAT)
    args = ["--upstream", llama.url, "--out", "day.jsonl", "--", sys.executable, str(script)]
    first = run([*args, "2"], tmp_path)
    second = run([*args, "1"], tmp_path)
    assert first.returncode == second.returncode == 0
    assert "2 chat requests analysed" in first.stderr
    assert "1 chat request analysed" in second.stderr  # not 3: the file holds both
    lines = (tmp_path / "day.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [1, 2, 1]


# -- without --upstream: claude and codex only, and only where a plan exists -----------


@pytest.mark.parametrize(
    ("name", "extra", "reason"),
    [
        ("aider", {}, "--upstream is required"),
        ("claude", {"HTTPS_PROXY": "http://corp:3128"}, "HTTPS_PROXY is already set"),
        ("claude", {"CLAUDE_CODE_USE_VERTEX": "1"}, "CLAUDE_CODE_USE_VERTEX"),
        ("codex", {"https_proxy": "http://corp:3128"}, "https_proxy is already set"),
    ],
)
def test_no_upstream_refused_in_one_line(
    tmp_path: Path, name: str, extra: dict[str, str], reason: str
) -> None:
    """Refused before anything starts (the program never runs, no file is made)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / name
    program.write_text("#!/bin/sh\necho ran > ran.txt\n")
    program.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "CODEX_API_KEY": "k",
        **extra,
    }
    done = subprocess.run(
        [LLMP, "run", "--out", "rec.jsonl", "--", name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmp run: ") and reason in lines[0], lines
    assert not (tmp_path / "ran.txt").exists() and not (tmp_path / "rec.jsonl").exists()
