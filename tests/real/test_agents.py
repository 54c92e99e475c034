"""Many agents through one proxy (issue 30), on the real llama-server.

The real openai SDK talks through the real mitmdump with the llmp addon to
the real llama-server, `-np 1 --cache-ram 0`: one slot, so each agent's
request evicts the other's cache.  The agents take turns, as two agents on
one slot do; the analyzer is checked on the recording: conversations, links,
the causes of the losses against the server's own counters, client names,
and what the file holds of the identity headers (R32, R33).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmp.analysis import analyze
from llmp.analysis.config import Config
from llmp.format.canonical import hash_bytes
from tests.support.harnesses import base_env, harness_bin
from tests.support.mitm import Mitmdump, read_records
from tests.support.proxy import LlmpProxy
from tests.support.real import LlamaServer, real_server_marks

pytestmark = real_server_marks()

SECRET = "sk-real-secret-77aa"
SYSTEM = (
    "You are a careful assistant for a small software team. Answer in two short "
    "sentences, in plain words, without lists. "
) * 6
FIRST = "We start work on the repository now. Say what you will look at first."


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama-agents")
    with LlamaServer(ctx=4096, log_path=tmp / "llama-server.log") as server:
        yield server


class Agent:
    """One scripted agent: a system prompt, its history, the real SDK."""

    def __init__(self, client: openai.OpenAI, system: str) -> None:
        self.client = client
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]

    def ask(self, question: str, **extra: Any) -> str:
        self.messages.append({"role": "user", "content": question})
        return self.send(**extra)

    def send(self, **extra: Any) -> str:
        resp = self.client.chat.completions.create(
            model="smol",
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=48,
            temperature=0,
            seed=1,
            **extra,
        )
        text = resp.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": text})
        return str(text)


def _client(url: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=SECRET, max_retries=0, default_headers=headers or {}
    )


def _report(path: Path, fast: bool = True) -> dict[str, Any]:
    # Every loss makes a finding: the runs are short, their losses small.
    result = analyze([str(path)], Config(min_lost_tokens=1), fast=fast)
    try:
        return result.report()
    finally:
        result.close()


def _record(llama: LlamaServer, path: Path, mode: str = "digest") -> Mitmdump:
    return Mitmdump(llama.url, path, {"llmp_body": mode})


def _two_runs(url: str, sessions: tuple[str, str] | None) -> None:
    """Two runs of one agent: the same system prompt and first request, then each
    its own questions, taking turns on the one slot."""
    headers = [{"x-session-id": s} for s in sessions] if sessions else [{}, {}]
    a = Agent(_client(url, headers[0]), SYSTEM)
    b = Agent(_client(url, headers[1]), SYSTEM)
    a.ask(FIRST)
    b.ask(FIRST)
    topics_a = ["the build scripts", "the test runner", "the release notes"]
    topics_b = ["the database schema", "the login page", "the error logs"]
    for ta, tb in zip(topics_a, topics_b, strict=True):
        a.ask(f"Now tell me what you would check in {ta}, and why it matters to us.")
        b.ask(f"Now tell me what you would check in {tb}, and why it matters to us.")


def _check_two_runs(report: dict[str, Any], exact: bool) -> None:
    rows = {r["id"]: r for r in report["rows"]}
    assert len(rows) == 8 and all(r["kind"] == "turn" for r in rows.values())
    assert report["coverage"]["conversations"] == 2
    a_ids, b_ids = ([1, 3, 5, 7], [2, 4, 6, 8]) if exact else ([3, 5, 7], [4, 6, 8])
    for ids in (a_ids, b_ids):
        assert len({rows[i]["conversation"] for i in ids}) == 1
        for prev, cur in itertools.pairwise(ids):
            assert rows[cur]["linked_to"] == prev
    assert rows[a_ids[0]]["conversation"] != rows[b_ids[0]]["conversation"]
    # The server re-read what the other run evicted: the other conversation's doing.
    lost = [r for r in rows.values() if r["lost_external"] is not None]
    assert lost and all(r["cause"] == "other_conversation" for r in lost)
    assert all(r["lost_client"] is None and r["break_cause"] is None for r in rows.values())
    assert "history_rewritten" not in report["time"]["by_cause"]
    fixes = [f for f in report["findings"] if f["kind"] == "other_conversation_eviction"]
    assert len(fixes) == 1 and fixes[0]["rows"] == sorted(r["id"] for r in lost)


def _advice(path: Path) -> str:
    """The readable report's words."""
    out = subprocess.run(
        [sys.executable, "-m", "llmp", "analyze", "--min-lost-tokens", "1", str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", "PATH": ""},
    )
    return " ".join(out.stdout.split())


def test_two_runs_told_apart_by_their_session_header(llama: LlamaServer, tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    with _record(llama, path) as proxy:
        _two_runs(proxy.url, ("run-one-4f1c", "run-two-9e2d"))
    records = read_records(path)
    data = path.read_text()
    assert "run-one-4f1c" not in data and SECRET not in data
    assert records[0]["request"]["headers"]["x-session-id"] == "fnv1a:" + hash_bytes(
        b"run-one-4f1c"
    )
    for fast in (True, False):
        _check_two_runs(_report(path, fast), exact=True)
    assert "Give each agent its own slot (llama-server -np N" in _advice(path)


def test_two_runs_without_headers_told_apart_by_their_questions(
    llama: LlamaServer, tmp_path: Path
) -> None:
    path = tmp_path / "plain.jsonl"
    with _record(llama, path, "full") as proxy:
        _two_runs(proxy.url, None)
    _check_two_runs(_report(path), exact=False)


def test_two_agents_behind_one_user_agent(llama: LlamaServer, tmp_path: Path) -> None:
    """Neither agent's first turn is a side-call, though the second one has every
    mark of one (no tools, another system prompt, nothing answered yet)."""
    path = tmp_path / "two.jsonl"
    with _record(llama, path) as proxy:
        poet = Agent(_client(proxy.url), "You write short poems about the weather. " * 8)
        clerk = Agent(_client(proxy.url), "You turn notes into one formal sentence. " * 8)
        for i in range(3):
            poet.ask(f"A poem about rain on day {i}, please.")
            clerk.ask(f"Note {i}: the meeting moved to room {i + 4}.")
    report = _report(path)
    rows = {r["id"]: r for r in report["rows"]}
    assert report["coverage"]["conversations"] == 2
    assert [r["kind"] for r in report["rows"]] == ["turn"] * 6
    assert (rows[1]["turn"], rows[2]["turn"]) == (1, 1)
    assert [rows[i]["linked_to"] for i in (3, 4, 5, 6)] == [1, 2, 3, 4]
    assert "side_call" not in report["time"]["by_cause"]


def test_a_retry_links_to_its_original(llama: LlamaServer, tmp_path: Path) -> None:
    """The SDK marks a request it sends again with `x-stainless-retry-count`; here the
    client sends the retry header itself, as the SDK's retry loop does."""
    path = tmp_path / "retry.jsonl"
    with _record(llama, path) as proxy:
        a = Agent(_client(proxy.url), SYSTEM)
        b = Agent(_client(proxy.url), SYSTEM)
        a.ask(FIRST)  # 1
        b.ask(FIRST)  # 2: the same messages, another run
        a.ask("What would you check in the build scripts?")  # 3
        a.messages.pop()
        a.send(extra_headers={"x-stainless-retry-count": "1"})  # 4: 3 again
    records = read_records(path)
    assert records[3]["request"]["headers"]["x-stainless-retry-count"] == "1"
    assert records[2]["request"]["headers"]["x-stainless-retry-count"] == "0"
    rows = {r["id"]: r for r in _report(path)["rows"]}
    assert (rows[4]["kind"], rows[4]["linked_to"]) == ("turn", 3)
    assert rows[4]["conversation"] == rows[3]["conversation"]
    assert rows[4]["counts"]["reused_tokens"]["value"] > 0  # the server agrees: its cache


def test_x_title_labels_a_generic_user_agent(llama: LlamaServer, tmp_path: Path) -> None:
    path = tmp_path / "title.jsonl"
    with _record(llama, path) as proxy:
        body = {
            "model": "smol",
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "Say hello to the team."}],
        }
        with httpx.Client(timeout=60) as http:
            headers = {"x-title": "Kilo Code", "http-referer": "https://kilocode.ai"}
            r = http.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={**headers, "authorization": f"Bearer {SECRET}"},
            )
            assert r.status_code == 200
        Agent(_client(proxy.url, {"x-title": "Nightly Bot"}), SYSTEM).ask("Hello.")
    assert SECRET not in path.read_text()
    report = _report(path)
    ua = httpx.Client().headers["user-agent"]
    clients = {c["client"]: c["user_agent"] for c in report["clients"]}
    assert clients.pop(f"Kilo Code ({ua})") == ua
    ((name, sdk),) = clients.items()
    assert sdk.startswith("OpenAI/Python ") and name == f"Nightly Bot ({sdk})"
    assert [r["client"] for r in report["rows"]] == [f"Kilo Code ({ua})", name]


CLAUDE_PACKAGE = "@anthropic-ai/claude-code@2.1.332"
CALC_PY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


def test_two_claude_code_sessions_at_once_through_llmp_proxy(tmp_path: Path) -> None:
    """Two `claude -p` runs in one repository at the same time, through `llmp proxy`:
    one user-agent, one system prompt and tool set; their session header tells them
    apart."""
    home = tmp_path / "home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    work = tmp_path / "proj"
    work.mkdir()
    (work / "calc.py").write_text(CALC_PY)
    out = tmp_path / "claude.jsonl"
    ctx = 32768
    extra = ["--override-kv", f"llama.context_length=int:{ctx}"]
    with LlamaServer(ctx=ctx, extra_args=extra, log_path=tmp_path / "llama.log") as llama:
        proxy = LlmpProxy(
            ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(out)],
            tmp_path / "run",
            tmp_path / "conf",
        )
        with proxy:
            env = base_env(claude.parent, home)
            env.update(
                ANTHROPIC_BASE_URL=proxy.url,
                ANTHROPIC_AUTH_TOKEN=SECRET,
                ANTHROPIC_MODEL="smollm2",
                CLAUDE_CODE_MAX_OUTPUT_TOKENS="16",
                CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                API_TIMEOUT_MS="900000",
            )
            runs = [
                subprocess.Popen(
                    [str(claude), "-p", prompt],
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for prompt in ("What does add do? One sentence.", "What does sub do? One word.")
            ]
            for run in runs:
                run.wait(timeout=1500)  # its exit code is the model's doing (max tokens)
            assert proxy.stop() == 0
    data = out.read_text()
    assert SECRET not in data
    records = read_records(out)
    chat = [r for r in records if r["request"]["path"].split("?")[0] == "/v1/messages"]
    sessions = {r["request"]["headers"].get("x-claude-code-session-id") for r in chat}
    assert len(sessions) == 2 and all(s and s.startswith("fnv1a:") for s in sessions)
    report = _report(out)
    assert report["coverage"]["conversations"] == 2
    by_id = {r["id"]: r for r in report["rows"]}
    session_of = {r["id"]: r["request"]["headers"]["x-claude-code-session-id"] for r in chat}
    convs: dict[str, set[int]] = {}
    for rid, row in by_id.items():
        if row["kind"] == "turn":
            convs.setdefault(session_of[rid], set()).add(row["conversation"])
    assert sorted(len(c) for c in convs.values()) == [1, 1] and len(convs) == 2
    assert len(set.union(*convs.values())) == 2  # one conversation each, not the same
    assert all(c["client"].startswith("claude-cli/") for c in report["clients"])
