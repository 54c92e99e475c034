"""`llmp run` without `--upstream`: the plan for each harness and each login kind."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from llmp.recorder.harness import (
    Plan,
    PlanError,
    allow_pattern,
    child_env,
    command_for,
    plan_for,
)

HOME = "/home/u"
PROXY = "http://127.0.0.1:41195"
CA = "/tmp/llmp-run-x/ca-bundle.pem"


def files(entries: Mapping[str, str]) -> object:
    def read(path: str) -> str | None:
        return entries.get(path)

    return read


def plan(
    command: list[str], env: Mapping[str, str] | None = None, on_disk: Mapping[str, str] = {}
) -> Plan:
    got = plan_for(command, {"HOME": HOME, **(env or {})}, files(on_disk))  # type: ignore[arg-type]
    assert got is not None
    return got


def test_other_commands_have_no_plan() -> None:
    assert plan_for(["aider", "--message", "hi"], {"HOME": HOME}, lambda p: None) is None
    assert plan_for([], {"HOME": HOME}, lambda p: None) is None


# -- Claude Code ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "login"),
    [
        ({"ANTHROPIC_API_KEY": "sk-ant-1"}, "API key"),
        ({}, "its own login"),  # a subscription's OAuth token in ~/.claude
        ({"ANTHROPIC_AUTH_TOKEN": "t"}, "auth token"),
    ],
)
def test_claude_code_records_anthropics_api_as_a_forward_proxy(
    env: dict[str, str], login: str
) -> None:
    p = plan(["/usr/local/bin/claude", "-p", "hi"], env)
    assert (p.upstream, p.reverse, p.login) == ("https://api.anthropic.com", False, login)
    assert p.allow_hosts == ("api.anthropic.com",)
    out = child_env(p, {"HOME": HOME, **env}, PROXY, CA)
    assert out["HTTPS_PROXY"] == out["https_proxy"] == PROXY
    assert out["NODE_EXTRA_CA_CERTS"] == CA
    # It keeps its own base URL (a first-party session) and its own credentials.
    assert "ANTHROPIC_BASE_URL" not in out
    assert {k: out[k] for k in env} == env
    assert command_for(p, ["claude", "-p", "hi"], PROXY) == ["claude", "-p", "hi"]


def test_claude_code_keeps_a_company_ca() -> None:
    p = plan(["claude"], {"NODE_EXTRA_CA_CERTS": "/etc/corp.pem"})
    assert p.ca_include == ("/etc/corp.pem",)


@pytest.mark.parametrize(
    ("base", "root", "proxied"),
    [
        ("https://openrouter.ai/api", "https://openrouter.ai", PROXY + "/api"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080", PROXY),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080", PROXY),
    ],
)
def test_claude_code_base_url_is_the_upstream(base: str, root: str, proxied: str) -> None:
    p = plan(["claude"], {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "k"})
    assert p.reverse and p.root == root
    out = child_env(p, {"ANTHROPIC_BASE_URL": base}, PROXY, None)
    assert out["ANTHROPIC_BASE_URL"] == proxied
    assert "HTTPS_PROXY" not in out and "NODE_EXTRA_CA_CERTS" not in out


def test_claude_code_settings_base_url() -> None:
    settings = f"{HOME}/.claude/settings.json"
    gateway = json.dumps({"env": {"ANTHROPIC_BASE_URL": "https://gw.example.com/anthropic"}})
    p = plan(["claude"], {}, {settings: gateway})
    assert not p.reverse and p.allow_hosts == ("gw.example.com",)
    assert p.upstream == "https://gw.example.com/anthropic"
    local = json.dumps({"env": {"ANTHROPIC_BASE_URL": "http://127.0.0.1:8080"}})
    with pytest.raises(PlanError, match="settings"):
        plan(["claude"], {}, {settings: local})
    # CLAUDE_CONFIG_DIR moves the settings.
    p = plan(["claude"], {"CLAUDE_CONFIG_DIR": "/cfg"}, {"/cfg/settings.json": gateway})
    assert p.allow_hosts == ("gw.example.com",)


def test_claude_code_on_another_provider_needs_upstream() -> None:
    with pytest.raises(PlanError, match="CLAUDE_CODE_USE_BEDROCK"):
        plan(["claude"], {"CLAUDE_CODE_USE_BEDROCK": "1"})
    assert plan(["claude"], {"CLAUDE_CODE_USE_BEDROCK": "0"}).upstream.endswith("anthropic.com")


# -- Codex ----------------------------------------------------------------------------

AUTH = f"{HOME}/.codex/auth.json"
CONFIG = f"{HOME}/.codex/config.toml"


@pytest.mark.parametrize(
    ("env", "auth", "upstream", "hosts", "login"),
    [
        ({"CODEX_API_KEY": "sk-1"}, None, "https://api.openai.com/v1", ("api.openai.com",), "API key"),
        ({}, {"auth_mode": "apikey", "OPENAI_API_KEY": "sk-2"}, "https://api.openai.com/v1", ("api.openai.com",), "API key"),
        ({}, {"OPENAI_API_KEY": "sk-3", "tokens": None}, "https://api.openai.com/v1", ("api.openai.com",), "API key"),
        ({}, {"auth_mode": "chatgpt", "tokens": {"access_token": "a"}}, "https://chatgpt.com/backend-api/codex", ("chatgpt.com",), "ChatGPT login"),
        ({}, {"OPENAI_API_KEY": None, "tokens": {"access_token": "a"}}, "https://chatgpt.com/backend-api/codex", ("chatgpt.com",), "ChatGPT login"),
        ({}, None, "https://api.openai.com/v1", ("api.openai.com", "chatgpt.com"), "unknown"),
    ],
)  # fmt: skip
def test_codex_builtin_openai_by_login(
    env: dict[str, str],
    auth: object,
    upstream: str,
    hosts: tuple[str, ...],
    login: str,
) -> None:
    on_disk = {} if auth is None else {AUTH: json.dumps(auth)}
    p = plan(["codex", "exec", "hi"], env, on_disk)
    assert (p.upstream, p.allow_hosts, p.login, p.reverse) == (upstream, hosts, login, False)
    assert p.refuse_websockets  # its built-in provider prefers a WebSocket
    out = child_env(p, env, PROXY, CA)
    assert out["CODEX_CA_CERTIFICATE"] == CA and out["HTTPS_PROXY"] == PROXY
    assert "OPENAI_BASE_URL" not in out
    assert command_for(p, ["codex", "exec", "hi"], PROXY) == ["codex", "exec", "hi"]


def test_codex_keeps_a_company_ca_from_either_variable() -> None:
    p = plan(["codex"], {"CODEX_API_KEY": "k", "SSL_CERT_FILE": "/etc/ssl.pem"})
    assert p.ca_include == ("/etc/ssl.pem",)
    p = plan(["codex"], {"CODEX_API_KEY": "k", "CODEX_CA_CERTIFICATE": "/etc/codex.pem"})
    assert p.ca_include == ("/etc/codex.pem",)


def test_codex_configured_provider_https_is_forward_http_is_reverse() -> None:
    config = """
model_provider = "openrouter"

[model_providers.openrouter]
name = "OpenRouter"
base_url = "https://openrouter.ai/api/v1"
env_key = "OPENROUTER_API_KEY"

[model_providers.local]
name = "llama"
base_url = "http://127.0.0.1:8080/v1"

[profiles.here]
model_provider = "local"
"""
    p = plan(["codex", "exec", "hi"], {}, {CONFIG: config})
    assert (p.upstream, p.reverse, p.allow_hosts) == (
        "https://openrouter.ai/api/v1",
        False,
        ("openrouter.ai",),
    )
    assert p.login == "$OPENROUTER_API_KEY"
    for command in (
        ["codex", "-c", 'model_provider="local"', "exec", "hi"],
        ["codex", "exec", "--config=model_provider=local", "hi"],
        ["codex", "--profile", "here", "exec", "hi"],
        ["codex", "exec", "-p", "here", "hi"],
    ):
        p = plan(command, {}, {CONFIG: config})
        assert p.reverse and p.root == "http://127.0.0.1:8080", command
        assert p.config_key == "model_providers.local.base_url"
        assert command_for(p, command, PROXY) == [
            "codex",
            "-c",
            f'model_providers.local.base_url="{PROXY}/v1"',
            *command[1:],
        ]
        assert "HTTPS_PROXY" not in child_env(p, {}, PROXY, None)


def test_codex_openai_base_url_and_oss_providers() -> None:
    p = plan(["codex"], {}, {CONFIG: 'openai_base_url = "http://localhost:8000/v1"\n'})
    assert p.reverse and p.config_key == "openai_base_url" and p.root == "http://localhost:8000"
    p = plan(
        ["codex", "-c", 'openai_base_url="https://eu.api.openai.com/v1"'], {"CODEX_API_KEY": "k"}
    )
    assert not p.reverse and p.allow_hosts == ("eu.api.openai.com",)
    p = plan(["codex"], {"CODEX_OSS_PORT": "9999"}, {CONFIG: 'model_provider = "ollama"\n'})
    assert p.reverse and p.env == "CODEX_OSS_BASE_URL" and p.root == "http://localhost:9999"
    assert child_env(p, {}, PROXY, None)["CODEX_OSS_BASE_URL"] == PROXY + "/v1"


@pytest.mark.parametrize(
    ("command", "config", "match"),
    [
        (["codex"], 'model_provider = "nowhere"\n', "not in"),
        (["codex"], "model_provider = = broken\n", "cannot read"),
        (["codex", "--oss", "exec", "hi"], "", "--oss"),
        (["codex"], 'model_provider = "x"\n[model_providers.x]\nname = "x"\n', "no base_url"),
    ],
)
def test_codex_setups_that_need_upstream(command: list[str], config: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan(command, {}, {CONFIG: config})


def test_codex_home_moves_the_files() -> None:
    p = plan(
        ["codex"], {"CODEX_HOME": "/ch"}, {"/ch/auth.json": json.dumps({"auth_mode": "chatgpt"})}
    )
    assert p.login == "ChatGPT login"


def test_allow_pattern_matches_only_that_host() -> None:
    import re

    rx = re.compile(allow_pattern("api.openai.com"))
    assert rx.search("api.openai.com:443")
    assert not rx.search("xapi.openai.com:443") and not rx.search("api.openai.com.evil:443")
    assert not rx.search("api-openai.com:443")


def test_codex_own_override_of_the_address_gives_way_to_the_recorders() -> None:
    command = [
        "codex", "exec", "-c", 'openai_base_url="http://127.0.0.1:8080/v1"', "-c", "model=\"m\"",
        "--config=openai_base_url=http://127.0.0.1:8080/v1", "hi",
    ]  # fmt: skip
    p = plan(command)
    assert p.reverse and p.config_key == "openai_base_url"
    assert command_for(p, command, PROXY) == [
        "codex", "-c", f'openai_base_url="{PROXY}/v1"', "exec", "-c", 'model="m"', "hi",
    ]  # fmt: skip
