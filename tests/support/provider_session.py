"""A cloud provider session recorded as a user records one: the real SDK, through the real
mitmdump as a forward proxy (`llmp run`'s way for Claude Code and Codex), to the provider's
own host, answered by the fake that keeps its cache rules (tests/support/redirect_addon.py
moves only the last hop).  The recorder sees `api.anthropic.com` or `api.openai.com`; the
fake's log keeps its own truth of every request's cache decision.
"""

from __future__ import annotations

import contextlib
import copy
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai

from llmp.analysis import analyze
from llmp.analysis.config import Config
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.upstreams import Upstream

REDIRECT = Path(__file__).resolve().parent / "redirect_addon.py"
SKEWED_CLOCK = Path(__file__).resolve().parent / "skewed_clock.py"
HOSTS = ("api.anthropic.com", "api.openai.com", "openrouter.ai")
CC: Any = {"type": "ephemeral"}
CC_1H: Any = {"type": "ephemeral", "ttl": "1h"}
CLAUDE_UA = "claude-cli/2.1.332 (external, cli)"

# Documented prices per million tokens (wire-formats.md "Cloud prompt caches"): the
# provider's arithmetic the rows' cost is checked against, independently of genai-prices.
SONNET_45 = {"input": 3.0, "output": 15.0}
WRITE_5M, WRITE_1H, READ = 1.25, 2.0, 0.1


@contextlib.contextmanager
def recorder(
    fake: Upstream,
    rec: Path,
    *,
    diagnose: bool = False,
    body: str = "digest",
    skew: Path | None = None,
) -> Iterator[Mitmdump]:
    """mitmdump as a forward proxy with the recorder; the providers' hosts go to `fake`.
    With `skew`, the proxy's clock runs ahead by the seconds that file holds
    (tests/support/skewed_clock.py)."""
    where = f"127.0.0.1:{fake.port}"
    env = {**os.environ, "LLMP_TEST_REDIRECT": ",".join(f"{h}={where}" for h in HOSTS)}
    args = ["-s", str(REDIRECT)]
    if skew is not None:
        env["LLMP_TEST_SKEW"] = str(skew)
        args += ["-s", str(SKEWED_CLOCK)]
    options = {"llmp_diagnose": str(diagnose).lower(), "llmp_body": body, "llmp_live": "false"}
    with Mitmdump(None, rec, options, mode="regular", extra_args=args, env=env) as md:
        yield md


def _http(md: Mitmdump) -> dict[str, Any]:
    ca = ssl.create_default_context(cafile=str(md.confdir / "mitmproxy-ca-cert.pem"))
    return {"proxy": md.url, "verify": ca}


def claude_client(md: Mitmdump, ua: str = CLAUDE_UA) -> anthropic.Anthropic:
    """The real SDK, to its default host through the proxy, as Claude Code would send."""
    http = anthropic.DefaultHttpxClient(**_http(md))
    return anthropic.Anthropic(
        api_key="sk-ant-test-secret",
        http_client=http,
        default_headers={"user-agent": ua},
        max_retries=0,
    )


def openai_client(
    md: Mitmdump,
    ua: str | None = None,
    *,
    sent: list[bytes] | None = None,
    base_url: str | None = None,
) -> openai.OpenAI:
    """The real SDK, to its default host (or `base_url`) through the proxy; `sent` gets
    each request body as the SDK's HTTP client sent it."""
    hooks = {"request": [lambda r: sent.append(r.read())]} if sent is not None else {}
    http = openai.DefaultHttpxClient(**_http(md), event_hooks=hooks)
    headers = {"user-agent": ua} if ua else None
    return openai.OpenAI(
        api_key="sk-test-secret",
        http_client=http,
        default_headers=headers,
        max_retries=0,
        base_url=base_url,
    )


def report(rec: Path, n: int, cfg: Config | None = None) -> dict[str, Any]:
    """The report v1 of the recording, once it holds `n` records."""
    wait_for_records(rec, n)
    result = analyze([str(rec)], cfg)
    try:
        return result.report()
    finally:
        result.close()


def text(n: int, tag: str) -> str:
    """About `n` tokens of text (4 characters a token), told apart by `tag`."""
    return (f"{tag}: " + "the quick brown fox jumps over the lazy dog. " * (n // 11 + 1))[: 4 * n]


def tool_defs(n: int, seed: str, schema: str) -> list[dict[str, Any]]:
    """`n` tools of about 60 tokens each, told apart by `seed`; `schema` names the
    parameters' key (Anthropic's `input_schema`, OpenAI's `parameters`)."""
    return [
        {
            "name": f"tool_{i}",
            "description": text(60, f"tool {i} {seed}"),
            schema: {"type": "object", "properties": {"x": {"type": "string"}}},
        }
        for i in range(n)
    ]


class ClaudeSession:
    """A conversation shaped as Claude Code sends it: a billing line, two system blocks with
    breakpoints, tools, and one breakpoint on the last block that moves every turn."""

    def __init__(
        self,
        client: anthropic.Anthropic,
        *,
        model: str = "claude-sonnet-4-5",
        system_tokens: int = 1500,
        tools: int = 3,
        ttl: Any = CC,
        seed: str = "s",
    ) -> None:
        self.client = client
        self.model = model
        self.ttl = ttl
        self.billing = "x-anthropic-billing-header: cc_version=2.1.332.7c2; cc_entrypoint=cli;"
        self.ident = "You are Claude Code, Anthropic's official CLI for Claude."
        self.instructions = text(system_tokens, f"instructions {seed}")
        self.tools = tool_defs(tools, seed, "input_schema")
        self.messages: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}

    def system(self) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": self.billing},
            {"type": "text", "text": self.ident, "cache_control": self.ttl},
            {"type": "text", "text": self.instructions, "cache_control": self.ttl},
        ]

    def body(self, user: str | list[dict[str, Any]]) -> dict[str, Any]:
        content = [{"type": "text", "text": user}] if isinstance(user, str) else user
        messages = copy.deepcopy([*self.messages, {"role": "user", "content": content}])
        for m in messages:  # the breakpoint moves: only the last block carries one
            for b in m["content"] if isinstance(m["content"], list) else []:
                b.pop("cache_control", None)
        messages[-1]["content"][-1]["cache_control"] = self.ttl
        return {
            "model": self.model,
            "max_tokens": 64,
            "system": self.system(),
            "tools": self.tools,
            "messages": messages,
            **self.extra,
        }

    def turn(self, user: str | list[dict[str, Any]], fake: str = "") -> Any:
        """One request and its reply added to the history; the SDK's message."""
        body = self.body(user)
        headers = {"x-fake": fake} if fake else None
        msg = self.client.messages.create(**body, extra_headers=headers)
        reply = [{"type": "text", "text": b.text} for b in msg.content if b.type == "text"]
        self.messages = [
            *copy.deepcopy(body["messages"]),
            {"role": "assistant", "content": reply or [{"type": "text", "text": "ok"}]},
        ]
        for m in self.messages:
            for b in m["content"]:
                b.pop("cache_control", None)
        return msg


def anthropic_cost(usage: Any, prices: dict[str, float]) -> float:
    """What a Messages usage costs by Anthropic's documented arithmetic (per million)."""
    split = usage.cache_creation
    five = split.ephemeral_5m_input_tokens if split else usage.cache_creation_input_tokens
    hour = split.ephemeral_1h_input_tokens if split else 0
    p = prices["input"]
    return (
        usage.input_tokens * p
        + usage.cache_read_input_tokens * p * READ
        + five * p * WRITE_5M
        + hour * p * WRITE_1H
        + usage.output_tokens * prices["output"]
    ) / 1e6


__all__ = [
    "CC",
    "CC_1H",
    "CLAUDE_UA",
    "SONNET_45",
    "ClaudeSession",
    "anthropic_cost",
    "claude_client",
    "openai_client",
    "recorder",
    "report",
    "text",
    "tool_defs",
]
