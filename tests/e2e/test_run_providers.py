"""`llmp run -- claude …` and `llmp run -- codex …` without `--upstream`, with the real
harnesses (npm: `@anthropic-ai/claude-code`, `@openai/codex`; skipped, saying why,
without them) in front of the fake llama-server's `/v1/messages` and `/v1/responses`.

No network reaches the providers, so:

* the reverse plans run through `llmp run` itself, with the harness's own address
  setting pointed at the fake (Claude Code's `ANTHROPIC_BASE_URL`, a Codex provider's
  `base_url` in a temporary `CODEX_HOME`);
* the forward plans (Claude Code against `api.anthropic.com`, Codex against
  `api.openai.com`) give the harness exactly the environment `llmp run` gives it
  (`harness.child_env` of `harness.plan_for`), in front of mitmdump as the same
  forward proxy (`allow_hosts` of the plan, the recorder, and for the last hop a
  test-only redirect to the fake: tests/support/redirect_addon.py).

Each checks what was recorded against what the fake received: the provider's host in
`request.upstream`, the harness's credentials passed through and never written.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmp.apis.providers import facts
from llmp.recorder import harness
from tests.support.harnesses import base_env, harness_bin
from tests.support.mitm import Mitmdump, read_records
from tests.support.provider_truth import response_ids
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

LLMP = str(Path(sys.executable).with_name("llmp"))
REDIRECT = Path(__file__).resolve().parents[1] / "support" / "redirect_addon.py"
CLAUDE_PACKAGE = "@anthropic-ai/claude-code@2.1.332"
CODEX_PACKAGE = "@openai/codex@0.171.0"
ANTHROPIC_KEY = "sk-ant-api03-e2e-secret-Zq7"
OPENAI_KEY = "sk-proj-e2e-secret-Xw4"
CHATGPT_SECRET = "chatgpt-e2e-secret-Jd8"
TIMEOUT = 300


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("llama", n_ctx=131072) as up:  # a harness's first prompt is 8-12k tokens
        yield up


def claude_env(home: Path, bin_dir: Path) -> dict[str, str]:
    env = base_env(bin_dir, home)
    env.update(
        ANTHROPIC_API_KEY=ANTHROPIC_KEY,
        ANTHROPIC_MODEL="claude-sonnet-5",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="16",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    return env


def project(tmp: Path) -> Path:
    work = tmp / "proj"
    work.mkdir()
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return work


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def no_secrets(path: Path, *secrets: str) -> None:
    text = path.read_text()
    for s in secrets:
        assert s not in text, f"{s[:12]}… was written to {path}"
    for rec in read_records(path):
        for part in (rec["request"], rec["response"] or {}):
            assert not {"authorization", "x-api-key"} & set(part.get("headers") or {})


def chat_records(path: Path, api_path: str) -> list[dict[str, Any]]:
    return [
        r
        for r in read_records(path)
        if r["request"]["method"] == "POST" and r["request"]["path"].split("?")[0] == api_path
    ]


def forward_mitmdump(
    plan: harness.Plan, fake: Upstream, rec: Path, options: dict[str, str]
) -> Mitmdump:
    """mitmdump as `llmp run`'s forward proxy for `plan`, its hosts sent on to `fake`."""
    where = f"127.0.0.1:{fake.port}"
    env = {**os.environ, "LLMP_TEST_REDIRECT": ",".join(f"{h}={where}" for h in plan.allow_hosts)}
    opts = {
        "llmp_live": "false",
        "allow_hosts": harness.allow_pattern(plan.allow_hosts[0]),
        "llmp_refuse_websockets": str(plan.refuse_websockets).lower(),
        **options,
    }
    return Mitmdump(None, rec, opts, mode="regular", extra_args=["-s", str(REDIRECT)], env=env)


# -- Claude Code ----------------------------------------------------------------------


def test_claude_code_forward_to_anthropic_keeps_its_login_and_its_own_diagnosis(
    fake: Upstream, tmp_path: Path
) -> None:
    """Claude Code 2.1.332, first-party, asks for the diagnosis itself (`diagnostics` and
    the beta value): with `--diagnose` on, the recorder leaves its requests as they are."""
    home = tmp_path / "home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    env = claude_env(home, claude.parent)
    plan = harness.plan_for(["claude"], env, lambda p: None)
    assert plan is not None and not plan.reverse and plan.allow_hosts == ("api.anthropic.com",)
    rec = tmp_path / "rec.jsonl"
    with forward_mitmdump(plan, fake, rec, {"llmp_diagnose": "true", "llmp_body": "full"}) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        child = harness.child_env(plan, env, md.url, ca)
        done = run(["claude", "-p", "What does calc.py do?"], child, project(tmp_path))
    got = [e for e in fake.log if e.path.split("?")[0] == "/v1/messages"]
    assert got, f"no request reached the fake\n{done.stdout}\n{done.stderr}"
    records = chat_records(rec, "/v1/messages")
    assert len(records) == len(got)
    beta = facts()["anthropic"]["diagnosis_beta"]
    for r, e in zip(records, got, strict=True):
        assert r["request"]["upstream"] == "api.anthropic.com"
        assert r["request"]["headers"]["user-agent"].startswith("claude-cli/")
        # Its own key reached the "provider"; its own ask went as it sent it.
        assert e.request_header("x-api-key") == ANTHROPIC_KEY
        assert r["request"]["added"] is None
        assert e.request_json == r["request"]["body"]
        assert "diagnostics" in e.request_json
        assert (e.request_header("anthropic-beta") or "").split(",").count(beta) == 1
    assert got[0].request_json["diagnostics"] == {"previous_message_id": None}
    no_secrets(rec, ANTHROPIC_KEY)


def test_claude_code_base_url_under_llmp_run(fake: Upstream, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    env = claude_env(home, claude.parent)
    env["ANTHROPIC_BASE_URL"] = fake.url  # the user's own setting: the upstream
    rec = tmp_path / "rec.jsonl"
    done = run(
        [LLMP, "run", "--out", str(rec), "--full", "--", "claude", "-p", "What does calc.py do?"],
        env,
        project(tmp_path),
    )
    first, second = done.stderr.splitlines()[:2]
    assert first.startswith("llmp run: claude through http://127.0.0.1:")
    assert f"-> {fake.url}, recording to {rec}" in first
    assert second.startswith("llmp run: Claude Code (API key) against " + fake.url)
    records = chat_records(rec, "/v1/messages")
    assert records, done.stderr[-3000:]
    assert {r["request"]["upstream"] for r in records} == {"127.0.0.1"}
    assert all(r["request"]["added"] is None for r in records)
    # (The recorder's own /tokenize calls go to this local server too.)
    received = [e for e in fake.log if e.path.split("?")[0] == "/v1/messages"]
    assert [json.loads(e.request_body) for e in received] == [r["request"]["body"] for r in records]
    assert all(e.request_header("x-api-key") == ANTHROPIC_KEY for e in received)
    no_secrets(rec, ANTHROPIC_KEY)


# -- Codex ----------------------------------------------------------------------------

LOCAL_PROVIDER = """\
model = "gpt-5.5"
model_provider = "local"

[model_providers.local]
name = "a local server"
base_url = "{url}/v1"
env_key = "LOCAL_KEY"
wire_api = "responses"
"""


def codex_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """The real codex's bare environment, with a fresh CODEX_HOME; skipped without it."""
    home = tmp / "home"
    codex_home = home / "codex"
    codex_home.mkdir(parents=True)
    codex = harness_bin("codex", CODEX_PACKAGE, home)
    env = base_env(codex.parent, home)
    env["CODEX_HOME"] = str(codex_home)
    return env, codex_home


def test_codex_configured_provider_under_llmp_run(fake: Upstream, tmp_path: Path) -> None:
    env, codex_home = codex_env(tmp_path)
    (codex_home / "config.toml").write_text(LOCAL_PROVIDER.format(url=fake.url))
    env["LOCAL_KEY"] = OPENAI_KEY
    rec = tmp_path / "rec.jsonl"
    command = ["codex", "exec", "--skip-git-repo-check", "What does calc.py do?"]
    done = run([LLMP, "run", "--out", str(rec), "--", *command], env, project(tmp_path))
    assert f"-> {fake.url}/v1, recording to" in done.stderr.splitlines()[0], done.stderr
    assert "-c model_providers.local.base_url" in done.stderr.splitlines()[1]
    records = chat_records(rec, "/v1/responses")
    assert records, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert {r["request"]["upstream"] for r in records} == {"127.0.0.1"}
    # (The recorder's own /tokenize calls go to this local server too.)
    posts = [e for e in fake.log if e.method == "POST" and e.path == "/v1/responses"]
    assert len(posts) == len(records)
    assert all(e.request_header("authorization") == f"Bearer {OPENAI_KEY}" for e in posts)
    assert done.returncode == 0, done.stderr[-3000:]
    no_secrets(rec, OPENAI_KEY)


def test_codex_forward_to_openai_over_http_and_diagnosed(fake: Upstream, tmp_path: Path) -> None:
    """Codex with an API key: forward to api.openai.com, its WebSocket refused so its turns
    come over HTTP; with `--diagnose`, its resumed turn is compared with the first."""
    env, _ = codex_env(tmp_path)
    env["CODEX_API_KEY"] = OPENAI_KEY
    exec_ = ["codex", "exec", "--skip-git-repo-check", "-m", "gpt-5.6"]
    plan = harness.plan_for(exec_, env, lambda p: None)
    assert plan is not None and not plan.reverse and plan.refuse_websockets
    assert plan.allow_hosts == ("api.openai.com",)
    rec = tmp_path / "rec.jsonl"
    work = project(tmp_path)
    with forward_mitmdump(plan, fake, rec, {"llmp_diagnose": "true", "llmp_body": "full"}) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        child = harness.child_env(plan, env, md.url, ca)
        runs = [
            run(harness.command_for(plan, [*exec_, *tail], md.url), child, work)
            for tail in (["What does calc.py do?"], ["resume", "--last", "And in one word?"])
        ]
    for done in runs:
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    # Its WebSocket was refused by the recorder, never forwarded: every turn came over HTTP.
    assert not [e for e in fake.log if e.method == "GET" and e.path == "/v1/responses"]
    posts = [e for e in fake.log if e.method == "POST" and e.path == "/v1/responses"]
    records = chat_records(rec, "/v1/responses")
    assert len(posts) == len(records) >= 2
    assert {r["request"]["upstream"] for r in records} == {"api.openai.com"}
    assert all(e.request_header("authorization") == f"Bearer {OPENAI_KEY}" for e in posts)
    ids = response_ids(fake)
    asked = [(e.request_json.get("prompt_cache_options") or {}) for e in posts]
    assert "comparison_response_id" not in asked[0]  # a conversation's first turn
    assert asked[-1]["comparison_response_id"] == ids[-2]  # the resumed turn: the one before
    assert records[0]["request"]["added"] is None
    assert records[-1]["request"]["added"] == ["prompt_cache_options.comparison_response_id"]
    own = records[-1]["request"]["body"].get("prompt_cache_options") or {}
    assert "comparison_response_id" not in own  # the record is of Codex's own request
    no_secrets(rec, OPENAI_KEY)


# -- llmp run's own forward proxy, offline ------------------------------------------


def offline(host: str) -> None:
    """Skip unless `host` cannot be resolved here: these runs must never reach a provider."""
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return
    pytest.skip(f"{host} resolves here: this test would send a request to the real provider")


def test_llmp_run_claude_default_is_a_forward_proxy_to_anthropic(tmp_path: Path) -> None:
    """`llmp run -- claude` alone: Claude Code trusts the recorder's CA and sends its
    requests for api.anthropic.com through it (which cannot reach it here: the record
    says `upstream_unreachable`), its key never written."""
    offline("api.anthropic.com")
    home = tmp_path / "home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    env = {**claude_env(home, claude.parent), "CLAUDE_CODE_MAX_RETRIES": "0"}
    rec = tmp_path / "rec.jsonl"
    done = run([LLMP, "run", "--out", str(rec), "--", "claude", "-p", "hi"], env, project(tmp_path))
    lines = done.stderr.splitlines()
    assert "-> https://api.anthropic.com, recording to" in lines[0], done.stderr
    assert "as a forward proxy (HTTPS_PROXY, NODE_EXTRA_CA_CERTS)" in lines[1]
    records = chat_records(rec, "/v1/messages")
    assert records, done.stderr[-3000:]
    for r in records:
        assert r["request"]["upstream"] == "api.anthropic.com"
        assert r["request"]["headers"]["user-agent"].startswith("claude-cli/")
        assert r["error"] == "upstream_unreachable"
    assert {r["request"]["upstream"] for r in read_records(rec)} == {"api.anthropic.com"}
    assert done.returncode != 0
    no_secrets(rec, ANTHROPIC_KEY)


def test_llmp_run_codex_default_is_a_forward_proxy_to_openai(tmp_path: Path) -> None:
    """`llmp run -- codex exec …` with an API key: Codex trusts the recorder's CA, its
    WebSocket is refused and its turn sent over HTTP to api.openai.com (unreachable
    here), its key never written."""
    offline("api.openai.com")
    env, _ = codex_env(tmp_path)
    env["CODEX_API_KEY"] = OPENAI_KEY
    rec = tmp_path / "rec.jsonl"
    command = ["codex", "exec", "--skip-git-repo-check", "-m", "gpt-5.5", "hi"]
    done = run([LLMP, "run", "--out", str(rec), "--", *command], env, project(tmp_path))
    lines = done.stderr.splitlines()
    assert "-> https://api.openai.com/v1, recording to" in lines[0], done.stderr
    assert "Codex (API key)" in lines[1] and "CODEX_CA_CERTIFICATE" in lines[1]
    records = read_records(rec)
    assert records and all(r["request"]["method"] == "POST" for r in records)  # no WebSocket
    assert chat_records(rec, "/v1/responses") == records
    assert {(r["request"]["upstream"], r["error"]) for r in records} == {
        ("api.openai.com", "upstream_unreachable")
    }
    no_secrets(rec, OPENAI_KEY)


def chatgpt_auth(now: float) -> dict[str, Any]:
    """A ChatGPT login as `codex login` leaves it in `auth.json`: tokens (unsigned JWTs
    here, which Codex reads without checking), no API key, refreshed just now."""

    def jwt(claims: dict[str, Any]) -> str:
        def part(d: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()

        return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.{CHATGPT_SECRET}"

    auth = {"chatgpt_plan_type": "plus", "chatgpt_account_id": "acct-e2e"}
    claims = {"exp": int(now) + 86400, "iat": int(now), "https://api.openai.com/auth": auth}
    return {
        "auth_mode": "chatgpt",
        "OPENAI_API_KEY": None,
        "tokens": {
            "id_token": jwt({**claims, "email": "e2e@example.com"}),
            "access_token": jwt(claims),
            "refresh_token": f"rt-{CHATGPT_SECRET}",
            "account_id": "acct-e2e",
        },
        "last_refresh": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
    }


def test_llmp_run_codex_chatgpt_login_is_a_forward_proxy_to_chatgpt(tmp_path: Path) -> None:
    """`llmp run -- codex exec …` with a ChatGPT login (`auth.json` with tokens): a forward
    proxy to chatgpt.com (unreachable here, so Codex 0.171.0 stops at its workspace check
    and sends no turn); its tokens pass through, are never written, and `auth.json` is
    left as it was."""
    offline("chatgpt.com")
    env, codex_home = codex_env(tmp_path)
    auth = codex_home / "auth.json"
    auth.write_text(json.dumps(chatgpt_auth(time.time())))
    before = auth.read_bytes()
    rec = tmp_path / "rec.jsonl"
    command = ["codex", "exec", "--skip-git-repo-check", "-m", "gpt-5.5", "hi"]
    done = run([LLMP, "run", "--out", str(rec), "--", *command], env, project(tmp_path))
    lines = done.stderr.splitlines()
    assert "-> https://chatgpt.com/backend-api/codex, recording to" in lines[0], done.stderr
    assert lines[1].startswith(
        "llmp run: Codex (ChatGPT login) against https://chatgpt.com/backend-api/codex, as a "
        "forward proxy (HTTPS_PROXY, CODEX_CA_CERTIFICATE)"
    )
    records = read_records(rec)
    assert records, done.stderr[-3000:]
    assert {(r["request"]["upstream"], r["error"]) for r in records} == {
        ("chatgpt.com", "upstream_unreachable")
    }
    assert all(r["request"]["path"].startswith("/backend-api/") for r in records)
    assert done.returncode != 0
    assert auth.read_bytes() == before
    no_secrets(rec, CHATGPT_SECRET)


# -- the WebSocket refusal, alone ------------------------------------------------------


@pytest.mark.parametrize("refuse", [True, False])
def test_websocket_upgrade_to_a_chat_path(fake: Upstream, tmp_path: Path, refuse: bool) -> None:
    import httpx

    rec = tmp_path / "rec.jsonl"
    upgrade = {
        "connection": "Upgrade",
        "upgrade": "websocket",
        "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    options = {"llmp_refuse_websockets": str(refuse).lower(), "llmp_live": "false"}
    with Mitmdump(fake.url, rec, options) as md:
        r = httpx.get(md.url + "/v1/responses", headers=upgrade, timeout=10)
        other = httpx.get(md.url + "/v1/models", headers=upgrade, timeout=10)
    gets = [e.path for e in fake.log if e.method == "GET"]
    if refuse:
        assert r.status_code == 426
        assert gets == ["/v1/models"]  # only chat paths are refused
    else:
        assert r.status_code != 426 and gets == ["/v1/responses", "/v1/models"]
    assert other.status_code != 426
