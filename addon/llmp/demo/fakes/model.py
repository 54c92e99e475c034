"""The fake model behind every API: its chat template, tokenizer, one-slot cache and output.

Every API a fake serves renders its request to chat-shaped messages first, as
llama-server does, so the same conversation gives the same prompt (and reuses
the same cached prefix) whichever API carried it.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import time
from dataclasses import dataclass
from typing import Any, Literal

from llmp.demo.fakes.exchange import Exchange

Flavor = Literal["llama", "ollama", "vllm", "sglang", "anthropic-api", "openai-api", "openrouter"]

REPLY_TEXT: dict[str, str] = {
    "llama": "Hello from fake llama",
    "ollama": "Hello from fake ollama",
    "vllm": "Hello from fake vllm",
    "sglang": "Hello from fake sglang",
    "anthropic-api": "Hello from fake anthropic",
    "openai-api": "Hello from fake openai",
    "openrouter": "Hello from fake openrouter",
}
REASONING_TEXT = "Let me think about it."
TOOL_ARGS: dict[str, Any] = {"city": "Tokyo"}
TOOL_ARG_FRAGMENTS = ['{"city":"Tok', 'yo"}']
PROMPT_MS_PER_TOKEN = 0.5
PREDICTED_MS_PER_TOKEN = 18.89


# ------------------------------------------------------------------ prompt


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text in the fake template: its text parts, then its tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    else:
        text = ""
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += json.dumps(tool_calls, sort_keys=True, separators=(",", ":"))
    return text


def prompt_text(body: dict[str, Any]) -> str:
    """The fake chat template: a prefix-stable concatenation of the messages."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("<|tools|>" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n")
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role')}|>{message_text(m)}<|end|>\n")
    parts.append("<|assistant|>")
    return "".join(parts)


def count_tokens(text: str) -> int:
    """The fakes' tokenizer: one token per 4 characters, rounded up."""
    return math.ceil(len(text) / 4)


def common_prefix(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start (binary search over slices)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_pieces(text: str) -> list[str]:
    """How the fake streams a text: one piece (token) per word, with its leading space."""
    return re.findall(r"\s*\S+|\s+", text)


def token_id(piece: str) -> int:
    h = 0xCBF29CE484222325
    for byte in piece.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % 49152


def alnum(rng: random.Random, n: int) -> str:
    """llama-server's random ids: ``n`` ASCII letters and digits."""
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


# -------------------------------------------------------------- generation


@dataclass
class ToolCall:
    id: str
    name: str
    fragments: list[str]

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


@dataclass
class Gen:
    """What the fake model 'generates' for one chat request."""

    model: str
    reasoning: list[str]
    content: list[str]
    tool: ToolCall | None
    finish: str
    prompt_tokens: int
    cache_n: int
    prompt_n: int
    predicted_n: int
    include_usage: bool
    created: int
    rng: random.Random
    reasoning_inline: bool = False
    draft_accept: float | None = None
    """The ``draft`` mode: the share of drafted tokens a draft model got accepted."""
    cache_written: int = 0
    """Tokens of the prompt the request wrote into a shared cache (vLLM's
    ``created_cache_tokens``)."""

    @property
    def content_text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)


def max_tokens(body: dict[str, Any]) -> int | None:
    options = body.get("options")
    candidates = [body.get("max_tokens"), body.get("max_completion_tokens"), body.get("n_predict")]
    if isinstance(options, dict):
        candidates.append(options.get("num_predict"))
    for c in candidates:
        if isinstance(c, int) and not isinstance(c, bool) and c >= 0:
            return c
    return None


def draft_counts(predicted_n: int, accept: float) -> tuple[int, int]:
    """``draft_n`` and ``draft_n_accepted`` of the ``draft`` mode: two drafted per token."""
    drafted = 2 * predicted_n
    return drafted, min(drafted, round(drafted * accept))


def timings(g: Gen, predicted_n: int | None = None) -> dict[str, Any]:
    """llama-server's ``timings`` object for ``g`` (``predicted_n`` so far, if given)."""
    pn = g.predicted_n if predicted_n is None else predicted_n
    prompt_ms = round(g.prompt_n * PROMPT_MS_PER_TOKEN, 3)
    predicted_ms = round(pn * PREDICTED_MS_PER_TOKEN, 3)
    out: dict[str, Any] = {
        "cache_n": g.cache_n,
        "prompt_n": g.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / g.prompt_n if g.prompt_n else 0.0,
        "prompt_per_second": 1000.0 * g.prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": pn,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / pn if pn else 0.0,
        "predicted_per_second": 1000.0 * pn / predicted_ms if predicted_ms else 0.0,
    }
    if g.draft_accept is not None and pn > 0:
        # llama-server adds these, last, only when a draft model proposed tokens.
        out["draft_n"], out["draft_n_accepted"] = draft_counts(pn, g.draft_accept)
    return out


class FakeModel:
    """One loaded model with one cache slot: the previous prompt.

    ``plan`` takes a chat-shaped body (``messages``, ``tools``, ``max_tokens``…):
    every API converts its request to that shape first.
    """

    def __init__(
        self, flavor: Flavor, *, n_ctx: int, reply: str, reasoning: str, model_file: str
    ) -> None:
        self.flavor: Flavor = flavor
        self.n_ctx = n_ctx
        #: what llama-server reports as the model, whatever the request named
        self.model_file = model_file
        self.reply = reply
        self.reasoning = reasoning
        #: the simulated prefix cache: the previous chat prompt (one slot)
        self.slot_prompt = ""

    def too_long(self, ex: Exchange, body: dict[str, Any]) -> int | None:
        """The prompt's token count when it does not fit the context (or ``context_error``)."""
        total = count_tokens(prompt_text(body))
        if "context_error" in ex.modes:
            return max(total, self.n_ctx + 808)
        return total if total > self.n_ctx else None

    def plan(self, ex: Exchange, body: dict[str, Any], api: str, *, think: bool = True) -> Gen:
        """Decide the output for one request, and move the slot to its prompt.

        ``think=False``: no reasoning (a request that did not turn thinking on)."""
        modes = ex.modes
        rng = random.Random(f"{self.flavor}:{ex.index}")
        prompt = prompt_text(body)
        total = max(1, count_tokens(prompt))
        if "cache_miss" in modes:
            cache_n = 0
        else:
            cache_n = min(common_prefix(self.slot_prompt, prompt) // 4, total - 1)
        self.slot_prompt = prompt
        prompt_n = total - cache_n

        reasoning = token_pieces(self.reasoning)
        if not think or "no_reasoning" in modes or (api == "ollama" and body.get("think") is False):
            reasoning = []
        n_events = modes.get("events") or ("2000" if "big_response" in modes else "")
        if n_events:
            width = int(modes.get("token_chars") or 0)
            content = [f" w{i}".ljust(width, "x") for i in range(int(n_events))]
        else:
            content = token_pieces(self.reply)
        inline = False
        if api == "llama" and body.get("reasoning_format") == "none" and reasoning:
            content = ["<think>", *reasoning, "</think>", *content]
            reasoning = []
            inline = True

        tool: ToolCall | None = None
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        last = messages[-1] if messages else {}
        wants_tool = last.get("role") == "user" and "weather" in message_text(last).lower()
        if tools and wants_tool and not n_events:
            names = [str((t.get("function") or {}).get("name") or "") for t in tools]
            name = next((n for n in names if "weather" in n), names[0] or "get_weather")
            if self.flavor == "llama":
                call_id = alnum(rng, 32)
            else:
                call_id = "call_" + "".join(
                    rng.choice(string.ascii_lowercase + string.digits) for _ in range(8)
                )
            tool = ToolCall(call_id, name, list(TOOL_ARG_FRAGMENTS))
            content = []
        finish = "tool_calls" if tool else "stop"
        predicted = len(reasoning) + len(content) + (len(tool.fragments) + 1 if tool else 0)
        cap = max_tokens(body)
        if cap is not None and cap < predicted:
            keep_r = min(cap, len(reasoning))
            reasoning = reasoning[:keep_r]
            content = content[: cap - keep_r]
            tool = None
            finish = "length"
            predicted = cap
        stream_options = body.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        return Gen(
            model=str(body.get("model") or ""),
            reasoning=reasoning,
            content=content,
            tool=tool,
            finish=finish,
            prompt_tokens=total,
            cache_n=cache_n,
            prompt_n=prompt_n,
            predicted_n=predicted,
            include_usage=include_usage,
            created=int(time.time()),
            rng=rng,
            reasoning_inline=inline,
            draft_accept=(float(modes.get("draft") or 75) / 100 if "draft" in modes else None),
        )
