"""Harnesses pointed at OpenRouter, recorded as docs/proxy.md says (`llmp run`, "OpenRouter"),
against the fake OpenRouter (`Upstream("openrouter")`) at `https://openrouter.ai`.

No network reaches OpenRouter: the recorder runs as `llmp run` runs it (reverse to
`--upstream https://openrouter.ai` with the child's environment of `run.child_env`, or a
forward proxy for the plan of `harness.plan_for`), with the test-only redirect of the last
hop (tests/support/redirect_addon.py).

* A harness whose base URL is OpenRouter's (`OPENAI_BASE_URL=https://openrouter.ai/api/v1`,
  the openai SDK's variable, which aider and most OpenAI-compatible clients read) under
  `llmp run --upstream https://openrouter.ai`: its `/api` path is kept behind the proxy's
  address, every turn recorded as OpenRouter's, its cache counts the gateway's.
* Codex with OpenRouter as its `model_provider`: `llmp run -- codex` is a forward proxy to
  `openrouter.ai`.  Codex 0.171.0 speaks only the Responses API (`wire_api = "chat"` is
  refused), so it posts to `/api/v1/responses`; the fake OpenRouter serves Chat Completions
  only and answers 404, so what is checked is the way there: the host, the path, the key
  passed through and never written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmp.demo.fakes.provider_cache import CacheDecision
from llmp.recorder import harness
from llmp.recorder.run import child_env
from tests.e2e.test_run_providers import (
    LLMP,
    REDIRECT,
    chat_records,
    codex_env,
    forward_mitmdump,
    no_secrets,
    project,
    run,
)
from tests.support.adds_up import problems
from tests.support.mitm import Mitmdump, read_records
from tests.support.provider_session import report
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

OPENROUTER = "https://openrouter.ai"
OPENROUTER_KEY = "sk-or-v1-e2e-secret-Qp3"
CHAT = textwrap.dedent(
    """
    import os, openai
    c = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], max_retries=0)
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 200},
            {"role": "user", "content": "What does calc.py do?"}]
    for follow in ("And in one word?", "And in two?"):
        r = c.chat.completions.create(model="openai/gpt-5.5", messages=msgs, stream=True,
                                      extra_body={"session_id": "task-7"})
        text = "".join((ch.choices[0].delta.content or "") for ch in r if ch.choices)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": follow}]
    print("chat done", flush=True)
    """
)


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("openrouter") as up:
        yield up


def test_llmp_run_upstream_openrouter_keeps_the_api_path(fake: Upstream, tmp_path: Path) -> None:
    script = tmp_path / "chat.py"
    script.write_text(CHAT)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "OPENAI_BASE_URL": f"{OPENROUTER}/api/v1",
        "OPENAI_API_KEY": OPENROUTER_KEY,
    }
    rec = tmp_path / "rec.jsonl"
    redirect = {**os.environ, "LLMP_TEST_REDIRECT": f"openrouter.ai=127.0.0.1:{fake.port}"}
    # As `llmp run --upstream https://openrouter.ai` runs it: record-time counting on (its
    # default), and never asked of a gateway (R35).
    options = {"llmp_live": "false", "llmp_tokenize": "true"}
    with Mitmdump(OPENROUTER, rec, options, extra_args=["-s", str(REDIRECT)], env=redirect) as md:
        child = child_env(env, OPENROUTER, md.url)
        assert child["OPENAI_BASE_URL"] == f"{md.url}/api/v1"
        done = subprocess.run(
            [sys.executable, str(script)],
            env=child,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        rep = report(rec, 2)
    got = [e for e in fake.log if e.path == "/api/v1/chat/completions"]
    assert [e.path for e in fake.log] == [e.path for e in got] and len(got) == 2  # no /tokenize
    assert all(e.request_header("authorization") == f"Bearer {OPENROUTER_KEY}" for e in got)
    records = chat_records(rec, "/api/v1/chat/completions")
    assert [r["request"]["upstream"] for r in records] == ["openrouter.ai"] * 2
    rows = rep["rows"]
    assert [r["server"] for r in rows] == ["openrouter"] * 2
    assert rows[1]["linked_to"] == 1
    truth = [e.cache for e in got]
    assert all(isinstance(d, CacheDecision) for d in truth)
    for row, d in zip(rows, truth, strict=True):
        assert isinstance(d, CacheDecision)
        assert row["cache_read_tokens"] == d.read
        assert row["lost_client"] is None and row["lost_external"] is None
    assert truth[1].read > 0 and truth[0].backend == truth[1].backend  # one backend, warm
    assert rep["cost"] is not None and rep["cost"]["unpriced_models"] == []
    assert all(r["cost_usd"] > 0 for r in rows)
    assert problems(rep) == []
    no_secrets(rec, OPENROUTER_KEY)


def test_llmp_run_upstream_takes_openrouter_without_its_path(tmp_path: Path) -> None:
    done = subprocess.run(
        [LLMP, "run", "--upstream", f"{OPENROUTER}/api", "--", "true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert f"use {OPENROUTER}, not '{OPENROUTER}/api'" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing recorded, nothing run


CODEX_OPENROUTER = """\
model = "openai/gpt-5.5"
model_provider = "openrouter"

[model_providers.openrouter]
name = "OpenRouter"
base_url = "https://openrouter.ai/api/v1"
env_key = "OPENROUTER_API_KEY"
"""


def test_codex_with_openrouter_is_a_forward_proxy_to_openrouter(
    fake: Upstream, tmp_path: Path
) -> None:
    env, codex_home = codex_env(tmp_path)
    config = codex_home / "config.toml"
    config.write_text(CODEX_OPENROUTER)
    env["OPENROUTER_API_KEY"] = OPENROUTER_KEY
    command = ["codex", "exec", "--skip-git-repo-check", "What does calc.py do?"]
    plan = harness.plan_for(
        command, env, lambda p: config.read_text() if p == str(config) else None
    )
    assert plan is not None and not plan.reverse
    assert (plan.upstream, plan.allow_hosts) == (f"{OPENROUTER}/api/v1", ("openrouter.ai",))
    assert plan.describe().startswith("Codex ($OPENROUTER_API_KEY) against https://openrouter.ai")
    rec = tmp_path / "rec.jsonl"
    with forward_mitmdump(plan, fake, rec, {}) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        child = harness.child_env(plan, env, md.url, ca)
        done = run(harness.command_for(plan, command, md.url), child, project(tmp_path))
    posts = [e for e in fake.log if e.method == "POST"]
    assert posts, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert {e.path for e in posts} == {"/api/v1/responses"}
    assert all(e.request_header("authorization") == f"Bearer {OPENROUTER_KEY}" for e in posts)
    records = read_records(rec)
    assert len(records) == len(posts)
    assert {(r["request"]["upstream"], r["request"]["path"]) for r in records} == {
        ("openrouter.ai", "/api/v1/responses")
    }
    assert config.read_text() == CODEX_OPENROUTER  # its configuration untouched
    no_secrets(rec, OPENROUTER_KEY)
