"""A conversation on OpenAI's API as a harness sends it, through the real `openai` SDK: the
Responses API or Chat Completions, the whole history each turn (`store: false`, as Codex
sends it), instructions and tools first, one `prompt_cache_key` per conversation.

The fake OpenAI API (`llmp.demo.fakes.openai_api`) answers with the documented cache rules;
its log keeps each request's `CacheDecision` (`decisions`), the truth a report is checked
against.  `Skew` moves the fake's clock and the proxy's together, so a time-to-live is
crossed without waiting for it.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from llmp.demo.fakes import CacheDecision
from tests.support.provider_session import text, tool_defs
from tests.support.upstreams import Upstream

RESPONSES = "responses"
CHAT = "chat"
APIS = (RESPONSES, CHAT)
PATHS = ("/v1/responses", "/v1/chat/completions", "/api/v1/chat/completions")

# What each setting of R35 is called on each API (Chat's names, where it has them).
SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "reasoning.effort": {
        RESPONSES: {"reasoning": {"effort": "high"}},
        CHAT: {"reasoning_effort": "high"},
    },
    "text.verbosity": {
        RESPONSES: {"text": {"verbosity": "low"}},
        CHAT: {"verbosity": "low"},
    },
    "text.format": {
        RESPONSES: {"text": {"format": {"type": "json_object"}}},
        CHAT: {"response_format": {"type": "json_object"}},
    },
    "parallel_tool_calls": {
        RESPONSES: {"parallel_tool_calls": False},
        CHAT: {"parallel_tool_calls": False},
    },
    "service_tier": {
        RESPONSES: {"service_tier": "priority"},
        CHAT: {"service_tier": "priority"},
    },
}


@dataclass(frozen=True, slots=True)
class Price:
    """Per million tokens, US dollars."""

    input: float
    cached: float
    output: float
    write: float = 0.0

    def cost(self, uncached: int, read: int, written: int, output: int) -> float:
        """OpenAI's arithmetic: each input token at exactly one of the three rates."""
        return (
            uncached * self.input + read * self.cached + written * self.write + output * self.output
        ) / 1e6


# OpenAI's published prices for gpt-5 (standard, and the flex and priority tiers: half and
# twice the standard); before GPT-5.6 there is no write fee, a write is plain input.
GPT_5 = {
    "default": Price(1.25, 0.125, 10.0, 1.25),
    "flex": Price(0.625, 0.0625, 5.0, 0.625),
    "priority": Price(2.50, 0.25, 20.0, 2.50),
}
# GPT-5.6's input and output prices (not in the spec: the price list's), with the cache
# rates by the documented multiples (wire-formats.md): reads 0.1x, writes 1.25x.
GPT_56_INPUT, GPT_56_OUTPUT = 4.0, 20.0
GPT_56 = Price(GPT_56_INPUT, GPT_56_INPUT * 0.1, GPT_56_OUTPUT, GPT_56_INPUT * 1.25)


class Skew:
    """One clock for the fake's cache and the proxy's recorder: real time plus an offset
    the test moves.  The proxy reads the offset from `path` (tests/support/skewed_clock.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0.0
        self._write()

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds
        self._write()

    def _write(self) -> None:
        """Whole or not at all: the proxy reads the file at every tick of its clock."""
        part = self.path.with_suffix(".part")
        part.write_text(repr(self.offset))
        os.replace(part, self.path)


def decisions(fake: Upstream) -> list[CacheDecision]:
    """The fake's own cache decision of each chat request, in the order they came."""
    out = [e.cache for e in fake.log if e.path.split("?")[0] in PATHS]
    return [d for d in out if isinstance(d, CacheDecision)]


@dataclass(slots=True)
class Usage:
    """A turn's usage as the SDK gave it, in one shape for both APIs."""

    prompt: int
    read: int
    written: int
    output: int
    tier: str | None
    response_id: str | None


def _responses_usage(r: Any) -> Usage:
    u = r.usage
    details = u.input_tokens_details
    return Usage(
        u.input_tokens,
        details.cached_tokens,
        getattr(details, "cache_write_tokens", 0) or 0,
        u.output_tokens,
        r.service_tier,
        r.id,
    )


def _chat_usage(u: Any, tier: str | None, ident: str | None) -> Usage:
    details = u.prompt_tokens_details
    written = (getattr(details, "cache_write_tokens", None) or 0) if details else 0
    return Usage(
        u.prompt_tokens,
        details.cached_tokens if details else 0,
        written,
        u.completion_tokens,
        tier,
        ident,
    )


class GptSession:
    """One conversation: instructions, tools, the history resent whole every turn."""

    def __init__(
        self,
        client: openai.OpenAI,
        api: str,
        *,
        model: str = "gpt-5",
        key: str | None = "conv-1",
        instructions_tokens: int = 1500,
        tools: int = 3,
        seed: str = "s",
        stream: bool = False,
        include_usage: bool = True,
    ) -> None:
        self.client = client
        self.api = api
        self.model = model
        self.key = key
        self.instructions = text(instructions_tokens, f"instructions {seed}")
        self.tools = tool_defs(tools, seed, "parameters")
        self.history: list[dict[str, Any]] = []
        self.stream = stream
        self.include_usage = include_usage
        self.extra: dict[str, Any] = {}
        self.gateway: dict[str, Any] = {}
        """Fields the SDK does not name (OpenRouter's `session_id`, `cache_control`)."""

    def body(self, user: str) -> dict[str, Any]:
        history = [*copy.deepcopy(self.history), {"role": "user", "content": user}]
        body: dict[str, Any] = {"model": self.model}
        if self.api == RESPONSES:
            body["instructions"] = self.instructions
            if self.tools:
                body["tools"] = [{"type": "function", **t} for t in self.tools]
            body["input"] = history
            body["store"] = False
            body["max_output_tokens"] = 64
        else:
            body["messages"] = [{"role": "system", "content": self.instructions}, *history]
            if self.tools:
                body["tools"] = [{"type": "function", "function": t} for t in self.tools]
            body["max_completion_tokens"] = 64
        if self.key is not None:
            body["prompt_cache_key"] = self.key
        return {**body, **copy.deepcopy(self.extra)}

    def turn(self, user: str, fake: str = "") -> Usage | None:
        """One request, its reply added to the history; its usage (None: none reported)."""
        body = self.body(user)
        options: dict[str, Any] = {"extra_headers": {"x-fake": fake} if fake else None}
        if self.gateway:
            options["extra_body"] = self.gateway
        usage, reply = self._send(body, options)
        self.history = [
            *(body["input"] if self.api == RESPONSES else body["messages"][1:]),
            {"role": "assistant", "content": reply or "ok"},
        ]
        return usage

    def _send(self, body: dict[str, Any], options: dict[str, Any]) -> tuple[Usage | None, str]:
        if self.api == RESPONSES:
            if not self.stream:
                r = self.client.responses.create(**body, **options)
                return _responses_usage(r), r.output_text
            done = None
            for ev in self.client.responses.create(**body, stream=True, **options):
                if ev.type == "response.completed":
                    done = ev.response
            assert done is not None
            return _responses_usage(done), done.output_text
        if not self.stream:
            c = self.client.chat.completions.create(**body, **options)
            reply = c.choices[0].message.content or ""
            return _chat_usage(c.usage, c.service_tier, c.id), reply
        if self.include_usage:
            options["stream_options"] = {"include_usage": True}
        parts: list[str] = []
        usage, tier, ident = None, None, None
        for chunk in self.client.chat.completions.create(**body, stream=True, **options):
            tier, ident = chunk.service_tier or tier, chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        return (_chat_usage(usage, tier, ident) if usage is not None else None), "".join(parts)


__all__ = [
    "APIS",
    "CHAT",
    "GPT_5",
    "GPT_56",
    "RESPONSES",
    "SETTINGS",
    "GptSession",
    "Price",
    "Skew",
    "Usage",
    "decisions",
]
