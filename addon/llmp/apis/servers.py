"""What llmp knows about each server program: how to tell it, what its cache does,
how it counts tokens, and how it says that a prompt did not fit.

The API modules read each server's counters (`openai_counts` takes llama-server's
`timings`, vLLM's and SGLang's `cached_tokens`, DeepSeek's hit and miss counts;
`ollama_counts` Ollama's); what those counters *mean* for a loss depends on the
cache behind them, which is this module's.  The facts and their sources are in
`../shared/spec/wire-formats.md`, "What each server's cache does", and for vLLM
in docs/analysis.md's server table (measured on the real vLLM 0.32 CPU build):

* **llama-server** (and Ollama, which runs it underneath): a few slots, each
  holding one prompt.  A request in between can take the slot a conversation
  used; with several slots and the host-memory prompt cache (the defaults) it
  often does not.  A sliding-window or hybrid model cannot return its cache to
  an earlier position (R31).
* **vLLM and SGLang**: one prefix cache shared by every request, evicted least
  recently used when memory runs short.  A request in between is no eviction
  by itself; a loss there is the cache's capacity.  vLLM caches and counts
  reuse in whole blocks (16 tokens on a GPU, 128 on the CPU build), so up to a
  block short of the prefix is no loss, and a prompt shorter than one block
  leaves nothing cached.  SGLang's radix tree reuses token by token.

A server is told by its counters (llama-server's `timings`), by what only its
body carries (vLLM's `system_fingerprint` `vllm-…` and `created_cache_tokens`;
SGLang's usage-level `reasoning_tokens`, behind uvicorn), by its response's
`server` header (kept since issue 29: `llama.cpp` for llama-server, `uvicorn` for
vLLM's and SGLang's OpenAI servers) and by the API it speaks (Ollama's
`/api/chat`).  Without any of them (older recordings), it is llmp's model of a
single llama-server slot, as before.

A server's block is learned from its traffic (`ReuseSteps`), since the kind alone
does not say it (vLLM's differs by build, backend and flag); until there is enough
of it, the kind's default stands.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Any

from llmp.apis import providers
from llmp.format.tokenize_shapes import CONTENT, PROMPT

SLOTS = "slots"
"""Each slot holds one prompt; a request in between may take it (llama-server, Ollama)."""
SHARED = "shared"
"""One prefix cache for all requests, evicted by memory pressure (vLLM, SGLang)."""
PROVIDER = "provider"
"""A cloud provider's prompt cache: every prefix written is kept until its time-to-live
ends, whatever runs in between; its rules are `apis.providers`' (R35)."""


@dataclass(frozen=True, slots=True)
class Server:
    """One server program, as far as its cache decides a loss's cause."""

    name: str
    """As the report names it; also the key of a cause's per-server fix (`causes.py`)."""
    cache: str
    """`SLOTS` or `SHARED`."""
    block_tokens: int = 1
    """Reuse is counted in whole blocks of this many tokens: a shortfall below one
    block is the cache's granularity, not a loss.  The kind's default; `ReuseSteps`
    learns the server's own."""
    headers: tuple[str, ...] = ()
    """Lower-case starts of the `server` response header that name it."""
    tokenize: str | None = None
    """The shape of its `/tokenize` request (`CONTENT`, `PROMPT`), or None: it has none
    that llmp knows, so record-time counting never asks it (R35)."""
    exact: bool = False
    """Its cache is token-exact whatever the traffic shows (llama-server, Ollama): no
    block is learned, since a checkpoint's regular positions would pass for one."""

    def with_block(self, block: int) -> Server:
        """The same server with the block its traffic showed."""
        return self if block == self.block_tokens else _with_block(self, block)


@cache
def _with_block(server: Server, block: int) -> Server:
    return replace(server, block_tokens=block)


LLAMA_SERVER = Server("llama-server", SLOTS, headers=("llama.cpp",), tokenize=CONTENT, exact=True)
VLLM = Server("vLLM", SHARED, block_tokens=16, tokenize=PROMPT)
"""vLLM on a GPU: 16-token blocks by default (`--block-size`)."""
VLLM_CPU = Server("vLLM (CPU)", SHARED, block_tokens=128, tokenize=PROMPT)
"""vLLM's CPU build: 128-token blocks; its KV cache is host memory, sized by
`VLLM_CPU_KVCACHE_SPACE` or `--kv-cache-memory-bytes` (docs/analysis.md)."""
SGLANG = Server("SGLang", SHARED, block_tokens=1, tokenize=PROMPT)
"""A radix tree of pages, one token each by default (`--page-size`)."""
VLLM_OR_SGLANG = Server("vLLM or SGLang", SHARED, block_tokens=16, headers=("uvicorn",))
"""Both answer from uvicorn, and so may any other Python server: no `/tokenize` is
assumed; vLLM's 16-token blocks bound the granularity of either until the traffic
says more."""
OLLAMA = Server("Ollama", SLOTS, exact=True)
"""llama-server underneath; one model loaded per runner by default, so another model's
request drops the cache with the model (`other_model`)."""
UNKNOWN = Server("unknown", SLOTS)
"""No header and no API that says: llmp's model of one llama-server slot."""

ANTHROPIC_API = Server(providers.ANTHROPIC, PROVIDER)
OPENAI_API = Server(providers.OPENAI, PROVIDER)
OPENROUTER_API = Server(providers.OPENROUTER, PROVIDER)
BY_PROVIDER = {s.name: s for s in (ANTHROPIC_API, OPENAI_API, OPENROUTER_API)}
"""The cloud providers as servers, by `apis.providers`' names (R34)."""

SERVERS: tuple[Server, ...] = (LLAMA_SERVER, VLLM, VLLM_CPU, SGLANG, VLLM_OR_SGLANG, OLLAMA)

_BY_API = {"ollama_chat": OLLAMA}
"""APIs only one server speaks."""
_BY_HEADER = (LLAMA_SERVER, VLLM_OR_SGLANG)
"""The servers a `server` header names."""
CPU_BLOCK = VLLM_CPU.block_tokens
"""vLLM's CPU build caches in blocks of 128 tokens, its GPU builds in 16 (or a size
the backend needs): a vLLM whose traffic shows 128-token blocks is the CPU build."""


def identify(
    header: str | None,
    api_name: str | None = None,
    timings: bool = False,
    top: Any = None,
    provider: str | None = None,
) -> Server:
    """The server that answered: a cloud provider (R34, told by `apis.providers.provider_of`
    from the upstream host, its headers or its usage), else from its counters, its body,
    its `server` header, the API spoken.

    `timings`: the response carried llama-server's `timings` (its prompt time, which
    neither vLLM nor SGLang sends).  They win over the header: a proxy in front (a
    LiteLLM on uvicorn) answers with its own header but passes llama-server's counters.
    `top`: the response body's top level (a dict; its `choices` need not be there),
    for what only vLLM's or SGLang's body carries.
    """
    if provider is not None and provider in BY_PROVIDER:
        return BY_PROVIDER[provider]
    if api_name in _BY_API:
        return _BY_API[api_name]
    if timings:
        return LLAMA_SERVER
    low = header.strip().lower() if header else ""
    if isinstance(top, dict):
        told = _by_body(top, low.startswith("uvicorn"))
        if told is not None:
            return told
    if low:
        for server in _BY_HEADER:
            if any(low.startswith(h) for h in server.headers):
                return server
    return UNKNOWN


def _by_body(top: dict[str, Any], uvicorn: bool) -> Server | None:
    """vLLM by its `system_fingerprint` (`vllm-<version>-…`, on by default) or its
    `created_cache_tokens`; SGLang, behind uvicorn, by the `reasoning_tokens` its usage
    carries at the top (vLLM's and OpenAI's sit in `completion_tokens_details`)."""
    fp = top.get("system_fingerprint")
    if isinstance(fp, str) and fp.startswith("vllm-"):
        return VLLM_CPU if "+cpu" in fp else VLLM
    usage = top.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and "created_cache_tokens" in details:
        return VLLM
    if uvicorn and "reasoning_tokens" in usage:
        return SGLANG
    return None


def with_learned_block(server: Server, block: int | None) -> Server:
    """`server` with the block its traffic showed (`ReuseSteps.block`); a vLLM (or a
    uvicorn server that may be one) whose blocks are the CPU build's is that build."""
    if block is None or server.exact:
        return server
    if block == CPU_BLOCK and server.name in (VLLM.name, VLLM_OR_SGLANG.name):
        return VLLM_CPU
    return server.with_block(block)


# -- a server's block, from its traffic -------------------------------------------

MIN_STEPS = 3
"""Nonzero reuse counts, not all equal, before their common step is trusted as the
server's block: one or two counts (or only equal ones) may share a larger step by
chance."""


@dataclass(slots=True)
class ReuseSteps:
    """What a server's counts show of its block.

    A block-granular cache (vLLM) reuses and writes whole blocks, so every reuse
    count, and every reuse plus write count, is a multiple of the block: their
    greatest common step is the block or a multiple of it.  vLLM also says what each
    request wrote (`created_cache_tokens`): what it left out of the cache of its own
    prompt, the tail below one block, shows the block is longer than that.
    """

    step: int = 0
    """The greatest common divisor of the nonzero counts seen (0: none yet)."""
    seen: int = 0
    first: int = 0
    varied: bool = False
    """Two different counts were seen."""
    tail: int = -1
    """The longest end of a prompt a response left out of the cache (-1: no response
    said what it wrote): the block is longer than this."""

    def add(self, prompt: int | None, reused: int | None, written: int | None) -> None:
        """One response's counts (the server's own; None where it did not say)."""
        if reused is None:
            return
        if reused > 0:
            self._count(reused)
        if written is None:
            return
        held = reused + written
        if held > 0:
            self._count(held)
        if prompt is not None and prompt >= held and prompt - held > self.tail:
            self.tail = prompt - held

    def _count(self, n: int) -> None:
        if self.seen == 0:
            self.first = n
        elif n != self.first:
            self.varied = True
        self.seen += 1
        self.step = math.gcd(self.step, n)

    @property
    def trusted(self) -> bool:
        """Enough counts for their step to be the server's."""
        return self.seen >= MIN_STEPS and self.varied

    def block(self, default: int) -> int:
        """The server's block: from its counts where they say enough, else `default`
        (the kind's) as far as the counts allow it."""
        step = self.step
        if step == 0:
            return default
        # The smallest block every count is whole in and no response's uncached tail
        # reaches; without a tail, the counts' own step.
        least = _least_divisor_above(step, self.tail) if self.tail >= 0 else step
        if self.trusted:
            return least
        # Too little to trust: the kind's default where the counts agree with it, never
        # a block a response's uncached tail rules out.
        kind = default if step % default == 0 else math.gcd(step, default)
        return max(kind, least) if self.tail >= 0 else kind


USUAL_BLOCKS = (VLLM.block_tokens, CPU_BLOCK)
"""vLLM's blocks on a GPU and on the CPU: where the counts allow one, it is the one."""


@lru_cache(maxsize=1024)
def _least_divisor_above(n: int, floor: int) -> int:
    """The smallest block that divides `n` and is longer than `floor`: one of vLLM's
    usual sizes where one fits, else a power of two (the sizes its backends use), else
    any divisor (`n` itself when none is).  A response's tail only rules sizes out, so
    a usual size the counts allow beats a smaller power of two no tail has reached."""
    for usual in USUAL_BLOCKS:
        if usual > floor and n % usual == 0:
            return usual
    power = n & -n  # the largest power of two dividing n
    if power > floor:
        least = power
        while least // 2 > floor:
            least //= 2
        return least
    best = n
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if floor < d < best:
                    best = d
        i += 1
    return best


# -- how each server says a prompt did not fit -----------------------------------------

CONTEXT_ERROR_MARKERS = (
    "exceed_context_size_error",  # llama-server's error type
    "exceeds the available context size",  # llama-server's message
    "context_length_exceeded",  # OpenAI's error code
    "maximum context length",  # vLLM, OpenAI; SGLang with the completion's tokens
    "longer than the model's context length",  # SGLang
    "exceeds the context length",  # Ollama (embeddings, newer chat builds)
    "context length exceeded",
)
"""Lower-case substrings of an error body that say the prompt did not fit."""

CONTEXT_SIZE_PATTERNS = (
    re.compile(r"context size \((\d+) tokens\)"),  # llama-server
    re.compile(r"maximum context length is (\d+)"),  # vLLM, OpenAI
    re.compile(r"model's context length \((\d+) tokens\)"),  # SGLang, the input alone
    re.compile(r"maximum context length of (\d+) tokens"),  # SGLang, with the completion
)
"""Where an error body gives the server's context size (lower-cased text)."""

PROMPT_SIZE_PATTERNS = (
    re.compile(r"request \((\d+) tokens\)"),  # llama-server
    re.compile(r"you requested (\d+) tokens"),  # OpenAI
    re.compile(r"request has (\d+) input tokens"),  # vLLM
    re.compile(r"the input \((\d+) tokens\)"),  # SGLang, the input alone
    re.compile(r"(\d+) tokens from the input messages"),  # SGLang, with the completion
)
"""Where an error body gives the prompt's size (lower-cased text)."""

__all__ = [
    "ANTHROPIC_API",
    "BY_PROVIDER",
    "CONTENT",
    "CONTEXT_ERROR_MARKERS",
    "CONTEXT_SIZE_PATTERNS",
    "CPU_BLOCK",
    "LLAMA_SERVER",
    "MIN_STEPS",
    "OLLAMA",
    "OPENAI_API",
    "OPENROUTER_API",
    "PROMPT",
    "PROMPT_SIZE_PATTERNS",
    "PROVIDER",
    "SERVERS",
    "SGLANG",
    "SHARED",
    "SLOTS",
    "UNKNOWN",
    "VLLM",
    "VLLM_CPU",
    "VLLM_OR_SGLANG",
    "ReuseSteps",
    "Server",
    "identify",
    "with_learned_block",
]
