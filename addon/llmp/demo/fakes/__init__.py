"""Fake model servers, for `llmp demo` and the tests: llama.cpp ``llama-server`` (chat,
Anthropic Messages, Responses), Ollama, vLLM, SGLang, and the cloud: Anthropic's API,
OpenAI's API and OpenRouter.

They speak the wire formats of ``shared/spec/wire-formats.md`` (the llmp contract) byte for
byte, from a raw asyncio stream server on 127.0.0.1 in a daemon thread, so a
test controls every byte: chunked framing (one chunk per event), keep-alive,
and deliberate faults chosen per request with the ``x-fake`` header.

    with Upstream("llama") as up:
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="x")
        ...
        entry = up.log[-1]          # what upstream received and sent
        assert entry.body == bytes_the_client_got

``x-fake`` is a comma-separated list of modes, each ``name`` or ``name=value``
(see ``MODES``). ``Upstream(fake=...)`` sets modes for every request; the
header adds to them. An unknown mode is answered with a 400 so typos fail.

The modules, from the bottom up: ``exchange`` (the log), ``modes`` (what
``x-fake`` can ask), ``responder`` (framing and faults), ``raw`` (the HTTP
server and the ``App`` a flavour implements), ``model`` (the fake model and its one-slot
cache), then one module per API: ``llama`` (chat and side endpoints),
``anthropic`` (``/v1/messages``) and ``responses`` (``/v1/responses``) of
llama-server; ``ollama`` (``/api/chat``) and ``ollama_openai``
(``/v1/chat/completions``) of Ollama; ``shared_cache`` (vLLM's and SGLang's
``/v1/chat/completions`` over one shared prefix cache). The cloud: ``anthropic_api``
(Anthropic's own Messages API, over ``anthropic_cache``, its documented prompt cache),
``provider_cache`` (a provider's prompt cache and its decisions), ``openai_prompt`` (how
OpenAI sees a request), ``openai_api`` (OpenAI's ``/v1/responses`` and
``/v1/chat/completions``; their bodies in ``openai_bodies``) and ``openrouter`` (the
gateway). ``dead`` holds the addresses where no server answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import get_args

from llmp.demo.fakes.anthropic import AnthropicMessages
from llmp.demo.fakes.anthropic_api import CONTEXT_WINDOW, AnthropicAPI
from llmp.demo.fakes.anthropic_cache import Decision, Entry, PromptCache
from llmp.demo.fakes.dead import BlackHole, ClosedPort
from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.llama import LLAMA_FINGERPRINT, LLAMA_MODEL_FILE, Llama, llama_dumps
from llmp.demo.fakes.model import (
    PREDICTED_MS_PER_TOKEN,
    PROMPT_MS_PER_TOKEN,
    REASONING_TEXT,
    REPLY_TEXT,
    TOOL_ARG_FRAGMENTS,
    TOOL_ARGS,
    FakeModel,
    Flavor,
    count_tokens,
    message_text,
    prompt_text,
)
from llmp.demo.fakes.modes import (
    GARBAGE_NDJSON,
    GARBAGE_SSE,
    MIDSTREAM_ERROR_MESSAGE,
    MODES,
    PING,
    parse_fake,
)
from llmp.demo.fakes.ollama import OLLAMA_LOAD_NS, OLLAMA_VERSION, Ollama, go_dumps
from llmp.demo.fakes.ollama_openai import OllamaOpenAI
from llmp.demo.fakes.openai_api import OpenAIAPI
from llmp.demo.fakes.openrouter import OpenRouter
from llmp.demo.fakes.provider_cache import CacheDecision, ManualClock, ProviderCache
from llmp.demo.fakes.raw import App, RawServer
from llmp.demo.fakes.responses import OpenAIResponses
from llmp.demo.fakes.shared_cache import PrefixCache, SharedCacheServer

__all__ = [
    "CONTEXT_WINDOW",
    "GARBAGE_NDJSON",
    "GARBAGE_SSE",
    "LLAMA_FINGERPRINT",
    "LLAMA_MODEL_FILE",
    "MIDSTREAM_ERROR_MESSAGE",
    "MODES",
    "OLLAMA_LOAD_NS",
    "OLLAMA_VERSION",
    "PING",
    "PREDICTED_MS_PER_TOKEN",
    "PROMPT_MS_PER_TOKEN",
    "REASONING_TEXT",
    "REPLY_TEXT",
    "TOOL_ARGS",
    "TOOL_ARG_FRAGMENTS",
    "AnthropicAPI",
    "BlackHole",
    "CacheDecision",
    "ClosedPort",
    "Decision",
    "Entry",
    "Exchange",
    "FakeModel",
    "Flavor",
    "ManualClock",
    "OpenAIAPI",
    "OpenRouter",
    "PrefixCache",
    "PromptCache",
    "ProviderCache",
    "SharedCacheServer",
    "Upstream",
    "count_tokens",
    "go_dumps",
    "llama_dumps",
    "message_text",
    "parse_fake",
    "prompt_text",
]


def _app(
    flavor: Flavor,
    model: FakeModel,
    capacity: int,
    cache_report: bool,
    clock: Callable[[], float],
    block: int | None,
) -> App:
    """The flavour's server with all of its APIs, over one model."""
    if flavor == "anthropic-api":
        return AnthropicAPI(model, clock=clock)
    if flavor == "vllm" or flavor == "sglang":
        return SharedCacheServer(
            model, flavor, capacity=capacity, cache_report=cache_report, block=block
        )
    if flavor == "openai-api":
        return OpenAIAPI(model)
    if flavor == "openrouter":
        return OpenRouter(model)
    if flavor == "llama":
        llama = Llama(model)
        llama.add_routes(AnthropicMessages(llama).routes())
        llama.add_routes(OpenAIResponses(llama).routes())
        return llama
    ollama = Ollama(model)
    ollama.add_routes(OllamaOpenAI(ollama).routes())
    return ollama


def _default_n_ctx(flavor: Flavor) -> int:
    return CONTEXT_WINDOW if flavor == "anthropic-api" else 8192


class Upstream(RawServer):
    """A fake llama-server (``flavor="llama"``), Ollama (``"ollama"``), vLLM, SGLang,
    Anthropic's API (``"anthropic-api"``), OpenAI's API (``"openai-api"``) or OpenRouter
    (``"openrouter"``).

    vLLM and SGLang keep one shared prefix cache of ``capacity`` tokens, in blocks
    of ``block`` tokens (by default vLLM's 16 on a GPU, SGLang's 1), and report its
    hits only with ``cache_report`` (their servers' flags).
    Anthropic's API keeps its prompt cache on ``clock`` (``anthropic_api``); its
    ``n_ctx`` defaults to ``CONTEXT_WINDOW``, the local servers' to 8192.

    Runs until ``close()`` (or the end of the ``with`` block). ``log`` is the
    list of ``Exchange`` in arrival order. llama-server serves chat,
    ``/v1/messages`` and ``/v1/responses`` from the same model and slot. The cloud
    fakes keep their own caches: ``OpenAIAPI.of(up)`` and ``OpenRouter.of(up)`` reach
    them (``cache``, ``clock``, …).
    """

    def __init__(
        self,
        flavor: Flavor = "llama",
        *,
        fake: str = "",
        n_ctx: int | None = None,
        model_file: str = LLAMA_MODEL_FILE,
        reply: str | None = None,
        reasoning: str = REASONING_TEXT,
        capacity: int = 1 << 20,
        cache_report: bool = True,
        clock: Callable[[], float] = time.time,
        block: int | None = None,
    ) -> None:
        if flavor not in get_args(Flavor):
            raise ValueError(f"unknown flavor {flavor!r}")
        self.flavor: Flavor = flavor
        self.model = FakeModel(
            flavor,
            n_ctx=n_ctx if n_ctx is not None else _default_n_ctx(flavor),
            reply=REPLY_TEXT[flavor] if reply is None else reply,
            reasoning=reasoning,
            model_file=model_file,
        )
        super().__init__(
            _app(flavor, self.model, capacity, cache_report, clock, block),
            fake=fake,
            name=f"fake-{flavor}",
        )

    @property
    def anthropic_api(self) -> AnthropicAPI:
        """The ``anthropic-api`` flavour's app: its cache, ``evict``, ``entries``."""
        if not isinstance(self.app, AnthropicAPI):
            raise TypeError(f"a {self.flavor!r} upstream has no Anthropic API cache")
        return self.app

    # the model's settings, settable as they were on the one-module Upstream

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    @n_ctx.setter
    def n_ctx(self, value: int) -> None:
        self.model.n_ctx = value

    @property
    def model_file(self) -> str:
        return self.model.model_file

    @model_file.setter
    def model_file(self, value: str) -> None:
        self.model.model_file = value

    @property
    def reply(self) -> str:
        return self.model.reply

    @reply.setter
    def reply(self, value: str) -> None:
        self.model.reply = value

    @property
    def reasoning(self) -> str:
        return self.model.reasoning

    @reasoning.setter
    def reasoning(self, value: str) -> None:
        self.model.reasoning = value

    @property
    def slot_prompt(self) -> str:
        """The simulated prefix cache: the previous chat prompt (one slot)."""
        return self.model.slot_prompt

    @slot_prompt.setter
    def slot_prompt(self, value: str) -> None:
        self.model.slot_prompt = value

    def reset_cache(self) -> None:
        self.model.slot_prompt = ""
