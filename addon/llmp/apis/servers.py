"""What llmp knows about each server program: how to tell it, what its cache does,
and how it says that a prompt did not fit.

The API modules read each server's counters (`openai_counts` takes llama-server's
`timings`, vLLM's and SGLang's `cached_tokens`, DeepSeek's hit and miss counts;
`ollama_counts` Ollama's); what those counters *mean* for a loss depends on the
cache behind them, which is this module's.  The facts and their sources are in
`../shared/spec/wire-formats.md`, "What each server's cache does":

* **llama-server** (and Ollama, which runs it underneath): a few slots, each
  holding one prompt.  A request in between can take the slot a conversation
  used; with several slots and the host-memory prompt cache (the defaults) it
  often does not.  A sliding-window or hybrid model cannot return its cache to
  an earlier position (R31).
* **vLLM and SGLang**: one prefix cache shared by every request, evicted least
  recently used when memory runs short.  A request in between is no eviction
  by itself; a loss there is the cache's capacity.  vLLM counts reuse in whole
  blocks (16 tokens by default), so up to a block short of the prefix is no loss.

A server is told by its counters (llama-server's `timings`), its response's `server`
header (kept since issue 29: `llama.cpp` for llama-server, `uvicorn` for vLLM's and
SGLang's OpenAI servers) and the API it speaks (Ollama's `/api/chat`).  Without any
of them (older recordings), it is llmp's model of a single llama-server slot, as
before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmp.apis import providers

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
    """As the report names it."""
    cache: str
    """`SLOTS` or `SHARED`."""
    block_tokens: int = 1
    """Reuse is counted in whole blocks of this many tokens: a shortfall below one
    block is the cache's granularity, not a loss."""
    headers: tuple[str, ...] = ()
    """Lower-case starts of the `server` response header that name it."""


LLAMA_SERVER = Server("llama-server", SLOTS, headers=("llama.cpp",))
VLLM_OR_SGLANG = Server("vLLM or SGLang", SHARED, block_tokens=16, headers=("uvicorn",))
"""Both answer from uvicorn; vLLM's 16-token blocks bound the granularity of either."""
OLLAMA = Server("Ollama", SLOTS)
"""llama-server underneath; one model loaded per runner by default, so another model's
request drops the cache with the model (`other_model`)."""
UNKNOWN = Server("unknown", SLOTS)
"""No header and no API that says: llmp's model of one llama-server slot."""

ANTHROPIC_API = Server(providers.ANTHROPIC, PROVIDER)
OPENAI_API = Server(providers.OPENAI, PROVIDER)
OPENROUTER_API = Server(providers.OPENROUTER, PROVIDER)
BY_PROVIDER = {s.name: s for s in (ANTHROPIC_API, OPENAI_API, OPENROUTER_API)}
"""The cloud providers as servers, by `apis.providers`' names (R34)."""

SERVERS: tuple[Server, ...] = (LLAMA_SERVER, VLLM_OR_SGLANG, OLLAMA)

_BY_API = {"ollama_chat": OLLAMA}
"""APIs only one server speaks."""


def identify(
    header: str | None,
    api_name: str | None = None,
    timings: bool = False,
    provider: str | None = None,
) -> Server:
    """The server that answered: a cloud provider (R34, told by `apis.providers.provider_of`
    from the upstream host, its headers or its usage), else from its counters, its `server`
    header, the API spoken.

    `timings`: the response carried llama-server's `timings` (its prompt time, which
    neither vLLM nor SGLang sends).  They win over the header: a proxy in front (a
    LiteLLM on uvicorn) answers with its own header but passes llama-server's counters.
    """
    if provider is not None and provider in BY_PROVIDER:
        return BY_PROVIDER[provider]
    if api_name in _BY_API:
        return _BY_API[api_name]
    if timings:
        return LLAMA_SERVER
    if header:
        low = header.strip().lower()
        for server in SERVERS:
            if any(low.startswith(h) for h in server.headers):
                return server
    return UNKNOWN


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
    "CONTEXT_ERROR_MARKERS",
    "CONTEXT_SIZE_PATTERNS",
    "LLAMA_SERVER",
    "OLLAMA",
    "OPENAI_API",
    "OPENROUTER_API",
    "PROMPT_SIZE_PATTERNS",
    "PROVIDER",
    "SERVERS",
    "SHARED",
    "SLOTS",
    "UNKNOWN",
    "VLLM_OR_SGLANG",
    "Server",
    "identify",
]
