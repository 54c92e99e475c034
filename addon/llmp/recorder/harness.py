"""Where `llmp run` records a harness it knows when no `--upstream` is given.

Claude Code and Codex talk to their provider with credentials of their own (an API
key, a subscription's OAuth token, a ChatGPT login), and llmp never touches those:
it only chooses how the harness's requests reach the recorder, from what the
harness already says about its provider (its environment, its configuration file).

* **Forward mode** (an HTTPS proxy): the harness keeps its own base URL and talks to
  the provider's host through the recorder, which shows it mitmproxy's certificate
  for that host only (`allow_hosts`; every other host is tunnelled untouched).  The
  harness is told by `HTTPS_PROXY` and trusts the CA through its own variable
  (Claude Code `NODE_EXTRA_CA_CERTS`, Codex `CODEX_CA_CERTIFICATE`).  Claude Code
  against Anthropic's API goes this way: with `ANTHROPIC_BASE_URL` set to anything
  but `api.anthropic.com` it treats the session as a gateway's and sends other
  requests.
* **Reverse mode** (a base URL): where the harness already names an address of the
  user's choosing (`ANTHROPIC_BASE_URL`, a Codex provider's `http://` `base_url`),
  that address is the upstream and the harness is given the recorder's, path kept.

Pure: the environment and a file reader come in, a `Plan` goes out
(`tests/recorder/test_harness.py` covers each login kind).  docs/proxy.md, "`llmp
run` against the providers", says the same for users.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "ANTHROPIC_API",
    "CHATGPT_CODEX",
    "OPENAI_API",
    "Plan",
    "PlanError",
    "allow_pattern",
    "child_env",
    "command_for",
    "plan_for",
]

ANTHROPIC_API = "https://api.anthropic.com"
"""Claude Code's default base URL."""
OPENAI_API = "https://api.openai.com/v1"
"""Codex's built-in provider with an API key."""
CHATGPT_CODEX = "https://chatgpt.com/backend-api/codex"
"""Codex's built-in provider with a ChatGPT login."""
CODEX_OSS_PORTS = {"ollama": 11434, "lmstudio": 1234}
"""Codex's built-in local providers and their default ports (`CODEX_OSS_PORT`)."""
PROXY_VARS = ("HTTPS_PROXY", "https_proxy")
Reader = Callable[[str], str | None]
"""A file's text, or None when it cannot be read."""


class PlanError(Exception):
    """The harness is set up in a way `llmp run` cannot record without `--upstream`."""


@dataclass(frozen=True)
class Plan:
    """How one harness's requests reach the recorder, and where they go from there."""

    harness: str
    """Its name, for the banner: `Claude Code`, `Codex`."""
    upstream: str
    """The provider's base URL, as the harness would use it."""
    login: str
    """What the harness authenticates with, as far as its files say (never a secret)."""
    reverse: bool
    """True: the recorder is a reverse proxy to `root`; False: a forward proxy."""
    allow_hosts: tuple[str, ...] = ()
    """Forward mode: the hosts whose TLS the recorder reads (the rest is tunnelled)."""
    env: str | None = None
    """Reverse mode: the variable that takes the recorder's URL (path kept)."""
    config_key: str | None = None
    """Reverse mode: the Codex config key that takes it (`-c key="…"`)."""
    ca_env: str | None = None
    """Forward mode: the variable that points the harness at the CA to trust."""
    ca_include: tuple[str, ...] = ()
    """CA files the harness already trusted through `ca_env` (kept in the bundle)."""
    refuse_websockets: bool = False
    """Answer a WebSocket upgrade on a chat path with 426, so turns go over HTTP."""

    @property
    def root(self) -> str:
        """The upstream's scheme, host and port: the reverse proxy's target."""
        parts = urlsplit(self.upstream)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def path(self) -> str:
        """The upstream's path, kept after the recorder's address in reverse mode."""
        return urlsplit(self.upstream).path.rstrip("/")

    def describe(self) -> str:
        """One line for `llmp run`'s banner."""
        how = (
            f"as a forward proxy (HTTPS_PROXY, {self.ca_env})"
            if not self.reverse
            else f"through {self.env or f'-c {self.config_key}'}"
        )
        return (
            f"{self.harness} ({self.login}) against {self.upstream}, {how}; "
            "its credentials pass through and are never recorded"
        )


def plan_for(command: Sequence[str], env: Mapping[str, str], read: Reader) -> Plan | None:
    """The plan for the harness `command` runs, or None when it is not one llmp knows.

    Raises `PlanError` when it is one, set up in a way only `--upstream` can record.
    """
    name = os.path.basename(command[0]) if command else ""
    if name == "claude":
        return _claude(env, read)
    if name == "codex":
        return _codex(command, env, read)
    return None


def allow_pattern(host: str) -> str:
    """mitmproxy's `allow_hosts` entry for exactly `host` (it matches `host:port`)."""
    return f"^{re.escape(host)}:\\d+$"


def child_env(
    plan: Plan, env: Mapping[str, str], proxy: str, ca_bundle: str | None
) -> dict[str, str]:
    """The harness's environment: the plan's variables, nothing else changed."""
    out = dict(env)
    out["LLMP_PROXY_URL"] = proxy
    if plan.reverse:
        if plan.env is not None:
            out[plan.env] = proxy + plan.path
    else:
        for name in PROXY_VARS:
            out[name] = proxy
        if plan.ca_env is not None and ca_bundle is not None:
            out[plan.ca_env] = ca_bundle
    return out


def command_for(plan: Plan, command: Sequence[str], proxy: str) -> list[str]:
    """The command to run: Codex given the recorder's address with `-c` where its
    provider's address is a config key (the command's own `-c` for that key taken
    out: a later one would win); otherwise the command as it was."""
    if not (plan.reverse and plan.config_key is not None):
        return list(command)
    value = json.dumps(proxy + plan.path)  # a TOML basic string
    rest: list[str] = []
    args = list(command[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        pair = args[i + 1] if arg in ("-c", "--config") and i + 1 < len(args) else None
        if arg.startswith("--config="):
            pair = arg.removeprefix("--config=")
        if pair is not None and pair.partition("=")[0].strip() == plan.config_key:
            i += 1 if arg.startswith("--config=") else 2
            continue
        rest.append(arg)
        i += 1
    return [command[0], "-c", f"{plan.config_key}={value}", *rest]


# -- Claude Code ----------------------------------------------------------------------

_CLAUDE_PROVIDERS = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _claude(env: Mapping[str, str], read: Reader) -> Plan:
    for flag in _CLAUDE_PROVIDERS:
        if _truthy(env.get(flag)):
            raise PlanError(
                f"Claude Code is set to another provider ({flag}); llmp run records "
                "Anthropic's API on its own: give --upstream"
            )
    login = (
        "API key"
        if env.get("ANTHROPIC_API_KEY")
        else "auth token"
        if env.get("ANTHROPIC_AUTH_TOKEN")
        else "its own login"
    )
    settings_base = _claude_settings_base(env, read)
    if settings_base is not None:
        # Claude Code applies its settings' `env` over the environment: this address wins.
        parts = _url(settings_base, "ANTHROPIC_BASE_URL in Claude Code's settings")
        if parts.scheme != "https":
            raise PlanError(
                f"Claude Code's settings set ANTHROPIC_BASE_URL={settings_base}, which "
                "llmp run cannot point at the recorder: give --upstream and --listen, and "
                "set it to the recorder's address"
            )
        return _claude_forward(settings_base, parts.hostname or "", login, env)
    base = env.get("ANTHROPIC_BASE_URL", "").strip()
    if base:
        _url(base, "ANTHROPIC_BASE_URL")
        return Plan("Claude Code", base.rstrip("/"), login, True, env="ANTHROPIC_BASE_URL")
    return _claude_forward(ANTHROPIC_API, "api.anthropic.com", login, env)


def _claude_forward(base: str, host: str, login: str, env: Mapping[str, str]) -> Plan:
    include = tuple(p for p in (env.get("NODE_EXTRA_CA_CERTS", "").strip(),) if p)
    return Plan(
        "Claude Code",
        base.rstrip("/"),
        login,
        False,
        allow_hosts=(host,),
        ca_env="NODE_EXTRA_CA_CERTS",
        ca_include=include,
    )


def _claude_settings_base(env: Mapping[str, str], read: Reader) -> str | None:
    """`env.ANTHROPIC_BASE_URL` in the user's Claude Code settings, if any."""
    config = env.get("CLAUDE_CONFIG_DIR") or os.path.join(env.get("HOME", "~"), ".claude")
    text = read(os.path.join(config, "settings.json"))
    if not text:
        return None
    try:
        settings = json.loads(text)
    except ValueError:
        return None
    block = settings.get("env") if isinstance(settings, dict) else None
    value = block.get("ANTHROPIC_BASE_URL") if isinstance(block, dict) else None
    return value.strip() if isinstance(value, str) and value.strip() else None


# -- Codex ----------------------------------------------------------------------------


def _codex(command: Sequence[str], env: Mapping[str, str], read: Reader) -> Plan:
    home = env.get("CODEX_HOME") or os.path.join(env.get("HOME", "~"), ".codex")
    config = _toml(read(os.path.join(home, "config.toml")), os.path.join(home, "config.toml"))
    overrides, profile_flag = _codex_flags(command)
    if "--oss" in command:
        raise PlanError("codex --oss: give --upstream with the local server's address")
    profile_name = overrides.get("profile", profile_flag or config.get("profile"))
    profile = (config.get("profiles") or {}).get(profile_name) or {}
    provider_id = str(
        overrides.get("model_provider")
        or profile.get("model_provider")
        or config.get("model_provider")
        or "openai"
    )
    include = tuple(
        p
        for p in (env.get("CODEX_CA_CERTIFICATE", "").strip() or env.get("SSL_CERT_FILE", ""),)
        if p
    )

    def plan(base: str, login: str, key: str | None, hosts: tuple[str, ...] = ()) -> Plan:
        parts = _url(base, f"Codex's provider {provider_id!r} base_url")
        if parts.scheme == "https":
            return Plan(
                "Codex",
                base.rstrip("/"),
                login,
                False,
                allow_hosts=hosts or (parts.hostname or "",),
                ca_env="CODEX_CA_CERTIFICATE",
                ca_include=include,
                refuse_websockets=True,
            )
        if key is None:
            raise PlanError(f"Codex's provider {provider_id!r} has no base_url llmp run can set")
        return Plan("Codex", base.rstrip("/"), login, True, config_key=key, refuse_websockets=True)

    if provider_id == "openai":
        login = _codex_login(env, read(os.path.join(home, "auth.json")))
        base = str(overrides.get("openai_base_url") or config.get("openai_base_url") or "")
        if base:
            return plan(base, login, "openai_base_url")
        if login == "ChatGPT login":
            return plan(CHATGPT_CODEX, login, None)
        if login == "API key":
            return plan(OPENAI_API, login, None)
        # Unknown (a keyring, or no login yet): either host may be the one.
        return plan(OPENAI_API, login, None, ("api.openai.com", "chatgpt.com"))
    if provider_id in CODEX_OSS_PORTS:
        port = env.get("CODEX_OSS_PORT", "").strip() or str(CODEX_OSS_PORTS[provider_id])
        base = env.get("CODEX_OSS_BASE_URL", "").strip() or f"http://localhost:{port}/v1"
        _url(base, "CODEX_OSS_BASE_URL")
        return Plan("Codex", base.rstrip("/"), "none", True, env="CODEX_OSS_BASE_URL")
    entry = (config.get("model_providers") or {}).get(provider_id)
    if not isinstance(entry, dict):
        raise PlanError(
            f"Codex's model_provider {provider_id!r} is not in {home}/config.toml: give --upstream"
        )
    base = str(
        overrides.get(f"model_providers.{provider_id}.base_url") or entry.get("base_url") or ""
    )
    if not base:
        raise PlanError(f"Codex's provider {provider_id!r} has no base_url: give --upstream")
    login = f"${entry['env_key']}" if entry.get("env_key") else "its own login"
    return plan(base, login, f"model_providers.{provider_id}.base_url")


def _codex_login(env: Mapping[str, str], auth_text: str | None) -> str:
    """What Codex signs in with: `API key`, `ChatGPT login`, or `unknown`."""
    if env.get("CODEX_API_KEY", "").strip():
        return "API key"
    try:
        auth = json.loads(auth_text) if auth_text else None
    except ValueError:
        auth = None
    if not isinstance(auth, dict):
        return "unknown"
    mode = str(auth.get("auth_mode") or "").lower()
    if mode == "apikey":
        return "API key"
    if mode.startswith("chatgpt"):
        return "ChatGPT login"
    if auth.get("OPENAI_API_KEY"):
        return "API key"
    if auth.get("tokens"):
        return "ChatGPT login"
    return "unknown"


def _codex_flags(command: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    """Codex's `-c key=value` overrides (values as TOML, else text) and `--profile`."""
    overrides: dict[str, Any] = {}
    profile: str | None = None
    args = list(command[1:])
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg in ("-c", "--config") and nxt is not None:
            pair = nxt
        elif arg.startswith("--config="):
            pair = arg.removeprefix("--config=")
        elif arg in ("-p", "--profile") and nxt is not None:
            profile = nxt
            continue
        elif arg.startswith("--profile="):
            profile = arg.removeprefix("--profile=")
            continue
        else:
            continue
        key, sep, raw = pair.partition("=")
        if not sep:
            continue
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        overrides[key.strip()] = value
    return overrides, profile


def _toml(text: str | None, where: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"cannot read {where}: {exc}") from None


def _url(text: str, what: str) -> Any:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PlanError(f"{what} is not an http(s) URL: {text!r}")
    return parts
