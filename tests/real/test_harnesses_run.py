"""Three real harnesses, each under nothing but `llmp run`, against the real llama-server.

    llmp run --upstream URL --out FILE --full -- aider … --message "…" calc.py
    llmp run --upstream URL --out FILE --full -- claude -p "…"     (then claude -c -p "…")
    llmp run --upstream URL --listen 127.0.0.1:PORT --out FILE --full -- codex exec …
                                                                   (then codex exec … resume --last)

Each harness runs in a fresh project directory with an isolated HOME, as
/work/harness/NOTES.md ran them, and finds the proxy only through what
`llmp run` sets (`OPENAI_BASE_URL` for aider, `ANTHROPIC_BASE_URL` for Claude
Code) or, for Codex, through its `config.toml`, written beforehand with the
port given to `--listen`. Each `llmp run` records to its own file, so the
report it prints is that session's. For each run the test checks:

* the report is printed: `llmp run`'s stderr holds exactly what
  `llmp analyze FILE` prints afterwards, and the live view's lines went to
  `FILE.live.log`, not to the harness's screen;
* the rows match the recording (`llmp analyze FILE --json`): every chat
  record is a row or is counted in `coverage.skipped`, and every row's
  `reused_tokens` / `evaluated_tokens` are the server's own counters in the
  record: llama-server's `timings` (`cache_n`, `prompt_n`) where the response
  has them, `usage` otherwise, read per API (Anthropic's `input_tokens`
  excludes the cached part, the Responses and chat `input_tokens` /
  `prompt_tokens` include it);
* the exit code is the harness's own, as NOTES.md documents it: aider's
  `--message` mode exits 0; Claude Code `-p` exits 1, saying "exceeded the N
  output token maximum", when its fourth request (three continuations) also
  stopped at max_tokens, and 0 when a reply ended by itself; Codex exits 0
  when every response completed;
* the follow-up run (`claude -c`, `codex … resume --last`) starts with the
  first run's first prompt unchanged and reused all of it, or the report's
  row for it names why not.

Needs ``LLMP_LLAMA_SERVER`` / ``LLMP_LLAMA_MODEL``; aider as
`tests/real/test_harness.py` finds it (``LLMP_AIDER``, the cached venv of
``bench/real_harness.py --setup-only``, or PATH); ``claude`` and ``codex`` in
``$LLMP_HARNESS_BIN`` (where `.ci/run` installs them with npm) or on PATH.
Each test is skipped, with the reason, when its harness is missing. Nothing
is installed here. About 2 minutes in all on a quiet two-core machine, 10
under other test load (prefill: Claude Code's first prompt is about 4,200
tokens, Codex's 4,600).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.harnesses import base_env, harness_bin
from tests.support.real import LlamaServer, free_port, real_server_marks

pytestmark = real_server_marks()

REPO = Path(__file__).resolve().parents[2]
LLMP = str(Path(sys.executable).with_name("llmp"))
CTX = 32768
RUN_TIMEOUT = 900.0  # one `llmp run`; a bound, not an assertion
TOL = 32  # tokens: the analyzer's reuse tolerance (a template token or two at the end)
CLAUDE_MAX_OUTPUT = 16  # small: few tokens to generate; the tiny model usually hits it
CALC_PY = "def add(a, b):\n    return a + b\n"
PROMPT = "What does calc.py do? One sentence."
FOLLOW_UP = "And in one word?"
CHAT_APIS = {
    "/v1/chat/completions": "openai_chat",
    "/v1/messages": "anthropic_messages",
    "/v1/responses": "openai_responses",
}


def _bench() -> ModuleType:
    """bench/real_harness.py, loaded once (tests/real/test_harness.py loads it the same way)."""
    if "real_harness" in sys.modules:
        return sys.modules["real_harness"]
    spec = importlib.util.spec_from_file_location(
        "real_harness", REPO / "bench" / "real_harness.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_harness"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _bench()


# ------------------------------------------------------------------ harnesses


def _project(tmp: Path, name: str) -> Path:
    work = tmp / name
    work.mkdir()
    (work / "calc.py").write_text(CALC_PY)
    return work


def _llama(tmp: Path, name: str, n_predict: int | None) -> LlamaServer:
    """llama-server as tests/support/real.py starts it, with a 32k context as NOTES.md ran it."""
    extra = ["--override-kv", f"llama.context_length=int:{CTX}"]
    if n_predict is not None:
        extra += ["-n", str(n_predict)]
    return LlamaServer(ctx=CTX, extra_args=extra, log_path=tmp / f"{name}.llama-server.log")


# ------------------------------------------------------------------- llmp run


@dataclass
class Run:
    """One `llmp run` and what it left behind."""

    args: list[str]
    recording: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    records: list[dict[str, Any]]
    report: dict[str, Any]
    readable: str

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self.report["rows"])

    def summary(self) -> str:
        cov = self.report["coverage"]
        rows = ", ".join(
            f"#{r['id']} {r['kind']} prompt {_value(r, 'prompt_tokens')} "
            f"reused {_value(r, 'reused_tokens')} evaluated {_value(r, 'evaluated_tokens')}"
            for r in self.rows
        )
        return (
            f"{' '.join(self.args[self.args.index('--') + 1 :])[:100]}: exit {self.returncode}, "
            f"{self.seconds:.0f} s, {len(self.records)} records, {cov['analysed']} rows "
            f"(skipped {cov['skipped']}): {rows}"
        )


def _value(row: dict[str, Any], name: str) -> Any:
    mv = row["counts"][name]
    return None if mv is None else mv["value"]


def _llmp(args: Sequence[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [LLMP, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"llmp {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def llmp_run(
    upstream: str,
    recording: Path,
    command: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    listen: str | None = None,
) -> Run:
    """`llmp run --upstream … --out RECORDING --full [--listen …] -- COMMAND`, then the analysis."""
    args = [LLMP, "run", "--upstream", upstream, "--out", str(recording), "--full"]
    if listen is not None:
        args += ["--listen", listen]
    args += ["--", *command]
    t0 = time.monotonic()
    # Its own process group, as a shell's foreground job: the harness is in it too.
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} still ran after {RUN_TIMEOUT:.0f} s\n{err[-4000:]}")
    seconds = time.monotonic() - t0
    assert recording.is_file(), f"no recording {recording}; stderr:\n{err[-4000:]}"
    records = [json.loads(line) for line in recording.read_text().splitlines() if line.strip()]
    report = json.loads(_llmp(["analyze", str(recording), "--json", "--no-progress"], env))
    readable = _llmp(["analyze", str(recording), "--no-progress"], env)
    run = Run(args, recording, proc.returncode, out, err, seconds, records, report, readable)
    print(run.summary())
    return run


# --------------------------------------------------------------------- checks


def _path(rec: dict[str, Any]) -> str:
    return str(rec["request"]["path"]).split("?", 1)[0]


def _is_chat(rec: dict[str, Any]) -> bool:
    return rec["request"]["method"] == "POST" and _path(rec) in CHAT_APIS


def _body(rec: dict[str, Any]) -> dict[str, Any]:
    body = (rec.get("response") or {}).get("body")
    assert isinstance(body, dict), f"record {rec['id']} has no response body (a --full recording)"
    return body


def _int(obj: Any, key: str) -> int | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def server_counters(rec: dict[str, Any]) -> tuple[int | None, int | None]:
    """(reused, evaluated) as the server reported them in this record's response.

    llama-server's `timings` (`cache_n`, `prompt_n`) where the response has
    them (chat completions; Responses, beside `response`), else `usage`:
    Anthropic's `input_tokens` is the evaluated part and
    `cache_read_input_tokens` the reused one; chat's `prompt_tokens` and the
    Responses `input_tokens` are the whole prompt, `cached_tokens` the reused
    part of it.
    """
    body = _body(rec)
    timings = body.get("timings")
    cache_n, prompt_n = _int(timings, "cache_n"), _int(timings, "prompt_n")
    if cache_n is not None and prompt_n is not None:
        return cache_n, prompt_n
    usage = body.get("usage")
    api = CHAT_APIS[_path(rec)]
    if api == "anthropic_messages":
        inp = _int(usage, "input_tokens")
        created = _int(usage, "cache_creation_input_tokens") or 0
        return _int(usage, "cache_read_input_tokens"), None if inp is None else inp + created
    prompt_key, details_key = (
        ("prompt_tokens", "prompt_tokens_details")
        if api == "openai_chat"
        else ("input_tokens", "input_tokens_details")
    )
    prompt = _int(usage, prompt_key)
    cached = _int(usage.get(details_key) if isinstance(usage, dict) else None, "cached_tokens")
    if prompt is None or cached is None:
        return cached, None
    return cached, prompt - cached


def _replies(run: Run) -> list[dict[str, Any]]:
    """The chat requests the server answered with a 200, once every other attempt is
    shown to be a connection reset that the harness sent again.

    llama-server may reset a kept-alive connection as the proxy reuses it: CI saw
    Claude Code's fourth request (record 5) reset after 4 ms (`upstream_reset`), and Claude Code
    sent the same body again next. That attempt is no reply; any other failure, or a
    reset not resent, fails the check."""
    posts = [r for r in run.records if _is_chat(r)]
    assert posts, run.stderr[-4000:]
    answered = [r for r in posts if r["error"] is None and r["response"]["status"] == 200]
    for r, after in zip(posts, [*posts[1:], None], strict=True):
        if r not in answered:
            resent = after is not None and after["request"]["body"] == r["request"]["body"]
            assert r["error"] == "upstream_reset" and resent, (
                f"record {r['id']}: error {r['error']}, status "
                f"{(r['response'] or {}).get('status')}, resent next: {resent}\n"
                f"{run.stderr[-4000:]}"
            )
    assert answered, run.stderr[-4000:]
    return answered


def check_report_printed(run: Run) -> None:
    """stderr holds the report of this recording, the live lines are in FILE.live.log."""
    n = len(run.rows)
    assert n > 0, f"no chat request was analysed:\n{run.readable}\n{run.stderr[-4000:]}"
    assert f"{n} chat request{'' if n == 1 else 's'} analysed" in run.readable, run.readable
    assert run.readable in run.stderr, (
        f"`llmp run`'s stderr does not hold `llmp analyze {run.recording}`'s report\n"
        f"--- analyze ---\n{run.readable}\n--- llmp run stderr ---\n{run.stderr[-6000:]}"
    )
    assert run.stderr.startswith(f"llmp run: {run.args[run.args.index('--') + 1]} through ")
    assert "llmp analyze" not in run.stdout, "the report went to the harness's stdout"
    live = run.recording.with_name(run.recording.stem + ".live.log")
    assert f"the live view's lines are in {live}" in run.stderr
    text = live.read_text()
    lines = [ln for ln in text.splitlines() if " prompt tokens" in ln and "prefill" in ln]
    assert len(lines) == n, f"{len(lines)} live lines for {n} rows in {live}:\n{text}"
    assert f"llmp: wrote {len(run.records)} records to {run.recording}" in text, text
    for line in lines:  # none of them on the harness's screen or in the report's stream
        stamp_free = line.split("] ", 1)[-1]
        assert stamp_free not in run.stdout and stamp_free not in run.stderr


def check_rows_match_recording(run: Run) -> None:
    """Every chat record is a row or a skip; every row's counters are the server's."""
    cov = run.report["coverage"]
    rows = {r["id"]: r for r in run.rows}
    assert len(rows) == len(run.rows), "one session per recording: ids are unique"
    assert cov["records"] == len(run.records)
    assert cov["analysed"] == len(rows)
    chat = [r for r in run.records if _is_chat(r)]
    assert cov["skipped"]["not_chat"] == len(run.records) - len(chat)
    good = [
        r
        for r in chat
        if r["error"] is None and r["response"] and 200 <= r["response"]["status"] < 300
    ]
    failed = len(chat) - len(good)
    assert sorted(rows) == sorted(r["id"] for r in good), (sorted(rows), [r["id"] for r in chat])
    assert cov["skipped"]["error"] + cov["skipped"]["non_2xx"] == failed, cov
    assert cov["skipped"]["unparsed"] == 0, cov
    for rec in good:
        row = rows[rec["id"]]
        assert row["api"] == CHAT_APIS[_path(rec)], (rec["id"], row["api"])
        reused, evaluated = server_counters(rec)
        assert reused is not None and evaluated is not None, (
            f"record {rec['id']}: the server reported no reuse counters: {_body(rec).get('usage')}"
        )
        for name, want in (("reused_tokens", reused), ("evaluated_tokens", evaluated)):
            got = row["counts"][name]
            assert got == {"value": want, "source": "server"}, (
                f"row {rec['id']} {name} {got}; the server's own counter says {want}"
            )


def _without_cache_control(value: Any) -> Any:
    """`cache_control` moves from block to block between requests (R22): not content.

    A message's string content is one text block (R22, as hashed): Claude Code 2.1.332
    resends a block list of its first run as a string on `-c`."""
    if isinstance(value, dict):
        out = {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
        if "role" in out and isinstance(out.get("content"), str):
            out["content"] = [{"type": "text", "text": out["content"]}]
        return out
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def check_follow_up_reuse(first: Run, follow: Run, messages_key: str) -> None:
    """The follow-up run reused the prompt the first run started with (the server still
    held it: nothing else ran on its one slot), or its row in the report names why not."""
    first_rec = next(r for r in first.records if _is_chat(r))
    follow_rec = next(r for r in follow.records if _is_chat(r))
    a = _without_cache_control(first_rec["request"]["body"])
    b = _without_cache_control(follow_rec["request"]["body"])
    n = len(a[messages_key])
    resent = all(a.get(k) == b.get(k) for k in ("system", "instructions", "tools")) and (
        b[messages_key][:n] == a[messages_key]
    )
    first_row = next(r for r in first.rows if r["id"] == first_rec["id"])
    row = next(r for r in follow.rows if r["id"] == follow_rec["id"])
    prefix = _value(first_row, "prompt_tokens")
    reused = _value(row, "reused_tokens")
    print(
        f"follow-up #{row['id']}: reused {reused} of {_value(row, 'prompt_tokens')} tokens; "
        f"the first run's first prompt, {prefix} tokens, resent unchanged: {resent}"
    )
    assert prefix is not None
    if reused is not None and reused >= prefix - TOL:
        return
    named = row["cause"] or row["break_cause"] or row["lost_external"] or row["lost_client"]
    assert named, (
        f"the follow-up reused {reused} tokens, less than the first run's first prompt "
        f"({prefix}; resent unchanged: {resent}), and its row names no cause: {row}"
    )


def check_follow_up_continues(first: Run, follow: Run, messages_key: str) -> None:
    """The follow-up resent the first run's conversation (it continued it, not a new one)."""
    first_recs = [r for r in first.records if _is_chat(r)]
    follow_rec = next(r for r in follow.records if _is_chat(r))
    a = _without_cache_control(first_recs[0]["request"]["body"])[messages_key]
    b = _without_cache_control(follow_rec["request"]["body"])[messages_key]
    assert len(b) > len(a) and b[: len(a)] == a, (
        f"the follow-up's first request does not start with the first run's {len(a)} "
        f"{messages_key} items and add to them ({len(b)} items)"
    )


# ---------------------------------------------------------------------- aider

AIDER_N_PREDICT = 32  # aider sends no output limit; the tiny model would go on


def test_aider_under_llmp_run(tmp_path: Path) -> None:
    aider = bench.find_aider()
    if aider is None:
        pytest.skip(
            f"no aider: set {bench.AIDER_ENV}, or run "
            ".venv/bin/python bench/real_harness.py --setup-only (.ci/run does)"
        )
    work = _project(tmp_path, "aider-proj")
    env = bench._minimal_env(bench.make_home(tmp_path / "aider-home"))  # offline, as the bench
    env["OPENAI_API_KEY"] = "dummy-key"
    command = [
        str(aider), "--model", "openai/smollm2", "--no-git", "--yes-always",
        "--no-check-update", "--analytics-disable", "--no-show-model-warnings",
        "--no-show-release-notes", "--no-pretty", "--no-fancy-input",
        "--message", PROMPT, "calc.py",
    ]  # fmt: skip
    with _llama(tmp_path, "aider", AIDER_N_PREDICT) as llama:
        run = llmp_run(llama.url, tmp_path / "aider.jsonl", command, work, env)
    check_report_printed(run)
    check_rows_match_recording(run)
    # aider found the proxy through OPENAI_BASE_URL alone (no --openai-api-base).
    assert run.records and all(_path(r) == "/v1/chat/completions" for r in run.records)
    assert run.records[0]["request"]["headers"]["user-agent"].startswith("OpenAI/Python")
    # aider's --message mode exits 0 whatever the reply (NOTES.md: even after a 400).
    assert run.returncode == 0, run.stderr[-4000:]


# ---------------------------------------------------------------- Claude Code

CLAUDE_PACKAGE = "@anthropic-ai/claude-code@2.1.332"


def check_claude_exit(run: Run) -> None:
    """NOTES.md: a reply that stops at max_tokens is continued ("Output token limit hit.
    Resume directly…") up to three times; if the fourth stops there too, Claude Code
    prints "API Error: Claude's response exceeded the N output token maximum" and
    exits 1. A reply that ends by itself ends the run with 0."""
    posts = _replies(run)
    last = _body(posts[-1]).get("stop_reason")
    if last == "max_tokens":
        assert len(posts) == 4, [_body(r).get("stop_reason") for r in posts]
        assert f"exceeded the {CLAUDE_MAX_OUTPUT} output token maximum" in run.stdout, run.stdout
        want = 1
    else:
        assert last == "end_turn", last
        want = 0
    assert run.returncode == want, f"exit {run.returncode}, want {want}\n{run.stderr[-4000:]}"


def test_claude_code_under_llmp_run(tmp_path: Path) -> None:
    home = tmp_path / "claude-home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    work = _project(tmp_path, "claude-proj")
    env = base_env(claude.parent, home)
    env.update(
        ANTHROPIC_AUTH_TOKEN="dummy-token",
        ANTHROPIC_MODEL="smollm2",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(CLAUDE_MAX_OUTPUT),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        API_TIMEOUT_MS="600000",
    )
    with _llama(tmp_path, "claude", None) as llama:  # Claude Code sends max_tokens
        first = llmp_run(
            llama.url, tmp_path / "claude-1.jsonl", ["claude", "-p", PROMPT], work, env
        )
        follow = llmp_run(
            llama.url, tmp_path / "claude-2.jsonl", ["claude", "-c", "-p", FOLLOW_UP], work, env
        )
    for run in (first, follow):
        check_report_printed(run)
        check_rows_match_recording(run)
        # ANTHROPIC_BASE_URL reached it: its messages and nothing else but 2.1.197's
        # `HEAD /` probe, one per process (2.1.332 sends none).
        calls = [(r["request"]["method"], _path(r)) for r in run.records]
        assert set(calls) - {("HEAD", "/")} == {("POST", "/v1/messages")}, calls
        assert calls.count(("HEAD", "/")) <= 1, calls
        check_claude_exit(run)
    check_follow_up_continues(first, follow, "messages")
    check_follow_up_reuse(first, follow, "messages")


# ---------------------------------------------------------------------- Codex

CODEX_PACKAGE = "@openai/codex@0.171.0"
CODEX_N_PREDICT = 256  # Codex sends no output limit
CODEX_CONFIG = """\
model = "smollm2"
model_provider = "llmp"

[model_providers.llmp]
name = "llmp proxy"
base_url = "http://127.0.0.1:{port}/v1"
env_key = "LLMP_DUMMY_KEY"
wire_api = "responses"
stream_idle_timeout_ms = 900000
"""


def _reply_text(body: dict[str, Any]) -> str:
    """The assistant text of a Responses body."""
    parts = []
    for item in body.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
    return "".join(parts)


def check_codex_exit(run: Run) -> None:
    """`codex exec` exits 0 when its turn completed, and prints the last reply on stdout."""
    posts = _replies(run)
    statuses = [_body(r).get("status") for r in posts]
    assert all(s == "completed" for s in statuses), (
        f"not every response completed ({statuses}): NOTES.md documents exit 1 on an error "
        f"and nothing else\n{run.stderr[-4000:]}"
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-4000:]}"
    reply = _reply_text(_body(posts[-1])).strip()
    assert reply and reply in run.stdout, (reply, run.stdout)


def test_codex_under_llmp_run(tmp_path: Path) -> None:
    home = tmp_path / "codex-home"
    codex_home = home / "codexhome"
    codex_home.mkdir(parents=True)
    codex = harness_bin("codex", CODEX_PACKAGE, home)
    work = _project(tmp_path, "codex-proj")
    # The provider's base_url is in a file: the proxy's port is chosen now and given
    # to --listen, the same for both runs.
    port = free_port()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(port=port))
    env = base_env(codex.parent, home)
    env.update(CODEX_HOME=str(codex_home), LLMP_DUMMY_KEY="dummy-key")
    listen = f"127.0.0.1:{port}"
    exec_ = ["codex", "exec", "--skip-git-repo-check"]
    with _llama(tmp_path, "codex", CODEX_N_PREDICT) as llama:
        first = llmp_run(llama.url, tmp_path / "codex-1.jsonl", [*exec_, PROMPT], work, env, listen)
        follow = llmp_run(
            llama.url,
            tmp_path / "codex-2.jsonl",
            [*exec_, "resume", "--last", FOLLOW_UP],
            work,
            env,
            listen,
        )
    for run in (first, follow):
        check_report_printed(run)
        check_rows_match_recording(run)
        assert f"through http://127.0.0.1:{port} -> {llama.url}" in run.stderr.splitlines()[0]
        assert all(_path(r) == "/v1/responses" for r in run.records)
        check_codex_exit(run)
    check_follow_up_continues(first, follow, "input")
    check_follow_up_reuse(first, follow, "input")
