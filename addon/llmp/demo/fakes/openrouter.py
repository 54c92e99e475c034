"""A fake OpenRouter: ``POST /api/v1/chat/completions`` (and ``/v1/chat/completions``)
in front of several backends, each with its own prompt cache.

Sources: ``shared/spec/wire-formats.md`` ("Gateways"), OpenRouter's API reference as
documented in 2026.  Kept modest:

- **Auth**: ``authorization: Bearer …`` or 401 ``{"error": {"message": "No auth
  credentials found", "code": 401}}``.
- **Backends**: ``backends`` (2) providers serve every model; each has its own
  ``ProviderCache`` (``caches[i]``), named by the model's family (``OpenAI``, ``Azure``;
  ``Anthropic``, ``Amazon Bedrock``; else ``Provider 1``, …).  A conversation is routed
  to one backend while it is busy: ``session_id`` in the body or the ``x-session-id``
  header names it, and it stays on its backend until it has been idle
  ``sticky_seconds`` (``provider_caches.toml``, 600), then moves to the next backend
  (a cold cache).  A request without a session goes to the backends in turn (the fake's
  simplification of "no sticky routing": its cache is then not reliably reused).
- **Cache rules**: ``openai/…`` and other models follow OpenAI's (``openai_api``, both
  generations, the same rendering); ``anthropic/…`` models follow Anthropic's
  breakpoints as OpenRouter passes ``cache_control`` through: writes only at content
  parts with ``cache_control: {"type": "ephemeral", "ttl"?}`` (``5m`` default, or
  ``1h``) or, with a top-level ``cache_control``, at the last part; at most 4 (a fifth
  is the provider's 400, passed on); the model's minimum length
  (``providers.anthropic_minimum_tokens``); reads of the longest live entry that is a
  prefix, with no 20-block lookback limit (the Anthropic fake models that).
- **Usage** (always: OpenRouter's usage accounting is automatic), in the last chunk
  with empty ``choices`` before ``[DONE]`` when streamed: ``prompt_tokens`` (all),
  ``prompt_tokens_details: {cached_tokens, cache_write_tokens, audio_tokens}``,
  ``completion_tokens_details.reasoning_tokens``, ``cost`` and ``cache_discount``
  (the money the cache saved: reads at ``1 − read multiplier`` of the input price,
  minus writes at ``write multiplier − 1``: negative when Anthropic writes outweigh
  reads).  The fake prices every model at ``input_usd_per_mtok`` and
  ``output_usd_per_mtok`` (settable), with the provider's multipliers from
  ``provider_caches.toml`` (OpenAI's 0.1 read multiplier for every OpenAI model: a
  simplification; no write fee before GPT-5.6).
- **Stream**: ``: OPENROUTER PROCESSING`` comments first, then OpenAI-style chunks with
  ``provider`` and ``native_finish_reason``, reasoning as ``delta.reasoning`` (the
  message's ``reasoning`` when not streamed), ``[DONE]``.  Ids ``gen-<time>-<20>``.
- The log: ``Exchange.cache`` is the backend's ``CacheDecision`` with ``backend`` set.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

from llmp.apis.providers import (
    ANTHROPIC,
    OPENAI,
    OPENROUTER,
    anthropic_minimum_tokens,
    facts,
    openai_cache,
)
from llmp.demo.fakes.exchange import Exchange, bearer
from llmp.demo.fakes.model import FakeModel, Gen, alnum
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE
from llmp.demo.fakes.openai_api import processing_ms
from llmp.demo.fakes.openai_bodies import compact
from llmp.demo.fakes.openai_prompt import (
    BadRequest,
    Settings,
    cache_plan,
    chat_prompt,
    chat_settings,
)
from llmp.demo.fakes.provider_cache import (
    CacheDecision,
    Clock,
    Policy,
    Prompt,
    ProviderCache,
    Segment,
)
from llmp.demo.fakes.raw import App
from llmp.demo.fakes.responder import Responder

PROCESSING = b": OPENROUTER PROCESSING\n\n"
BACKEND_NAMES = {
    "openai": ("OpenAI", "Azure"),
    "anthropic": ("Anthropic", "Amazon Bedrock", "Google"),
}


def backend_name(model: str, i: int) -> str:
    names = BACKEND_NAMES.get(model.partition("/")[0], ())
    return names[i] if i < len(names) else f"Provider {i + 1}"


def anthropic_marker(part: dict[str, Any]) -> str | None:
    """``cache_control: {"type": "ephemeral", "ttl"?}`` on a content part."""
    cc = part.get("cache_control")
    if not isinstance(cc, dict):
        return None
    ttl = cc.get("ttl") or facts()[ANTHROPIC]["default_ttl"]
    if ttl not in facts()[ANTHROPIC]["ttl_seconds"]:
        raise BadRequest(f"cache_control.ttl: Input should be '5m' or '1h', got {ttl!r}")
    return str(ttl)


def anthropic_prompt(body: dict[str, Any]) -> Prompt:
    """The chat rendering with ``cache_control`` breakpoints; a top-level one marks the end."""
    prompt = chat_prompt(body, anthropic_marker)
    top = body.get("cache_control")
    if isinstance(top, dict) and prompt.segments:
        ttl = anthropic_marker({"cache_control": top})
        segs = list(prompt.segments)
        segs[-1] = Segment(segs[-1].text, segs[-1].kind, ttl)
        prompt = Prompt(segs)
    n = len(prompt.marks())
    limit = int(facts()[ANTHROPIC]["max_breakpoints"])
    if n > limit:
        raise BadRequest(
            f"A maximum of {limit} blocks with cache_control may be provided. Found {n}."
        )
    return prompt


@dataclass(frozen=True, slots=True)
class Pricing:
    """The multipliers of the input price for one request's reads and writes."""

    read: float
    write: dict[str, float]


def pricing(model: str) -> Pricing:
    if model.startswith("anthropic/"):
        a = facts()[ANTHROPIC]
        return Pricing(
            float(a["read_multiplier"]), {k: float(v) for k, v in a["write_multiplier"].items()}
        )
    e = facts()[OPENAI]["explicit"]
    write = openai_cache(model).write_multiplier
    return Pricing(float(e["read_multiplier"]), {ttl: write for ttl in e["ttl_seconds"]})


class OpenRouter(App):
    """OpenRouter's chat endpoint over ``backends`` caches; see the module docstring."""

    def __init__(
        self,
        model: FakeModel,
        *,
        backends: int = 2,
        machines: int = 4,
        clock: Clock = time.time,
        api_key: str | None = None,
    ) -> None:
        super().__init__()
        if backends < 1:
            raise ValueError("backends must be at least 1")
        self.model = model
        self.caches = [ProviderCache(machines=machines, clock=clock) for _ in range(backends)]
        self._clock = clock
        self.api_key = api_key
        self.sticky_seconds: float = float(facts()[OPENROUTER]["sticky_seconds"])
        self.input_usd_per_mtok = 1.0
        self.output_usd_per_mtok = 4.0
        self.default_retention = "in_memory"
        #: session -> (backend, last request time)
        self.sessions: dict[str, tuple[int, float]] = {}
        self._turn = 0
        for path in ("/api/v1/chat/completions", "/v1/chat/completions"):
            self.add_routes({("POST", path): self._chat})

    @property
    def clock(self) -> Clock:
        return self._clock

    @clock.setter
    def clock(self, value: Clock) -> None:
        self._clock = value
        for c in self.caches:
            c.clock = value

    # flavour hooks -------------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return [
            ("date", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())),
            ("server", "cloudflare"),
            ("access-control-allow-origin", "*"),
            ("vary", "Accept-Encoding"),
        ]

    def dumps(self, obj: Any) -> bytes:
        return compact(obj)

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        await self.json(resp, status, {"error": {"message": message, "code": status}})

    async def not_found(self, resp: Responder, path: str) -> None:
        await self.error(resp, path, 404, "Not Found")

    # routing -------------------------------------------------------------------

    def backend(self, ex: Exchange, body: dict[str, Any]) -> int:
        """The backend for this request: its session's while it is fresh, else the next."""
        session = body.get("session_id") or ex.request_header("x-session-id")
        now = self._clock()
        n = len(self.caches)
        if not isinstance(session, str) or not session:
            self._turn += 1
            return (self._turn - 1) % n
        known = self.sessions.get(session)
        if known is None:
            self._turn += 1
            i = (self._turn - 1) % n
        elif now - known[1] > self.sticky_seconds:
            i = (known[0] + 1) % n
        else:
            i = known[0]
        self.sessions[session] = (i, now)
        return i

    # the endpoint ---------------------------------------------------------------

    def _plan(self, body: dict[str, Any]) -> tuple[Policy, Prompt]:
        model = str(body["model"])
        if model.startswith("anthropic/"):
            a = facts()[ANTHROPIC]
            policy = Policy(
                False,
                # OpenRouter writes versions with dots (claude-opus-4.5), Anthropic with dashes
                anthropic_minimum_tokens(model.partition("/")[2].replace(".", "-")),
                1,
                str(a["default_ttl"]),
                a["ttl_seconds"],
                max_marked=int(a["max_breakpoints"]),
            )
            return policy, anthropic_prompt(body)
        plan = cache_plan(model, body, self.default_retention)
        return plan.policy, chat_prompt(body, plan.marker)

    async def _chat(self, resp: Responder) -> None:
        ex = resp.ex
        if bearer(ex) is None or (self.api_key is not None and bearer(ex) != self.api_key):
            await self.error(resp, "", 401, "No auth credentials found")
            return
        body = self.parse_json_body(ex)
        if body is None or not isinstance(body.get("model"), str):
            await self.error(resp, "", 400, "Invalid JSON body or missing model")
            return
        try:
            policy, prompt = self._plan(body)
        except BadRequest as e:
            meta = {"raw": e.message, "provider_name": backend_name(body["model"], 0)}
            error = {"message": "Provider returned error", "code": 400, "metadata": meta}
            await self.json(resp, 400, {"error": error})
            return
        settings = chat_settings(body)
        i = self.backend(ex, body)
        d = self.caches[i].decide(
            prompt,
            settings.model,
            settings.namespace,
            settings.key,
            policy,
            overflow="overflow" in ex.modes,
            cold="cache_miss" in ex.modes,
        )
        d.backend = backend_name(settings.model, i)
        rng = random.Random(f"openrouter:{ex.index}")
        g = self.model.plan(ex, body, "openai")
        if g.tool is not None:
            g.tool.id = "call_" + alnum(rng, 24)
        d.processing_ms = processing_ms(d, g.predicted_n)
        ex.cache = d
        gen_id = f"gen-{g.created}-{alnum(rng, 20)}"
        c = _Completion(self, body, settings, d, g, gen_id)
        if body.get("stream") is True:
            error = {"error": {"code": 502, "message": MIDSTREAM_ERROR_MESSAGE}}
            err = b"data: " + compact(error) + b"\n\n"
            await self.stream(resp, "text/event-stream", c.events(), err)
        else:
            await self.json(resp, 200, c.completion())

    # money ----------------------------------------------------------------------

    def money(self, model: str, d: CacheDecision, output_tokens: int) -> tuple[float, float]:
        """``(cost, cache_discount)`` in US dollars for one request."""
        p = pricing(model)
        per = self.input_usd_per_mtok / 1e6
        written = sum(n * p.write.get(ttl, 1.0) for ttl, n in d.written_by_ttl.items())
        cost = (d.uncached + d.read * p.read + written) * per
        cost += output_tokens * self.output_usd_per_mtok / 1e6
        discount = d.read * (1 - p.read) * per
        discount -= (
            sum(n * (p.write.get(ttl, 1.0) - 1) for ttl, n in d.written_by_ttl.items()) * per
        )
        return round(cost, 12), round(discount, 12)


class _Completion:
    """One answer, in OpenRouter's shapes."""

    def __init__(
        self,
        app: OpenRouter,
        body: dict[str, Any],
        settings: Settings,
        d: CacheDecision,
        g: Gen,
        gen_id: str,
    ) -> None:
        self.app, self.body, self.settings, self.d, self.g, self.id = (
            app,
            body,
            settings,
            d,
            g,
            gen_id,
        )

    def usage(self) -> dict[str, Any]:
        d, g = self.d, self.g
        cost, discount = self.app.money(self.settings.model, d, g.predicted_n)
        return {
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": g.predicted_n,
            "total_tokens": d.prompt_tokens + g.predicted_n,
            "cost": cost,
            "is_byok": False,
            "prompt_tokens_details": {
                "cached_tokens": d.read,
                "cache_write_tokens": d.written,
                "audio_tokens": 0,
            },
            "cost_details": {"upstream_inference_cost": None},
            "completion_tokens_details": {"reasoning_tokens": len(g.reasoning), "image_tokens": 0},
            "cache_discount": discount,
        }

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "provider": self.d.backend,
            "model": self.settings.model,
        }

    def _tool_call(self, streamed: bool) -> dict[str, Any]:
        assert self.g.tool is not None
        call: dict[str, Any] = {
            "id": self.g.tool.id,
            "type": "function",
            "function": {"name": self.g.tool.name, "arguments": self.g.tool.arguments},
        }
        return {"index": 0, **call} if streamed else call

    def completion(self) -> dict[str, Any]:
        g = self.g
        message: dict[str, Any] = {
            "role": "assistant",
            "content": g.content_text,
            "refusal": None,
            "reasoning": g.reasoning_text or None,
        }
        if g.tool is not None:
            message["tool_calls"] = [self._tool_call(streamed=False)]
        return {
            **self._head(),
            "object": "chat.completion",
            "created": g.created,
            "choices": [
                {
                    "logprobs": None,
                    "finish_reason": g.finish,
                    "native_finish_reason": g.finish,
                    "index": 0,
                    "message": message,
                }
            ],
            "system_fingerprint": None,
            "usage": self.usage(),
        }

    def events(self) -> list[bytes]:
        g = self.g
        events: list[bytes] = [PROCESSING, PROCESSING]

        def emit(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk: dict[str, Any] = {
                **self._head(),
                "object": "chat.completion.chunk",
                "created": g.created,
                "choices": choices,
            }
            if usage is not None:
                chunk["usage"] = usage
            events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

        def delta(d: dict[str, Any], finish: str | None = None) -> None:
            choice = {
                "index": 0,
                "delta": {"role": "assistant", **d},
                "finish_reason": finish,
                "native_finish_reason": finish,
                "logprobs": None,
            }
            emit([choice])

        for piece in g.reasoning:
            delta({"content": "", "reasoning": piece})
        for piece in g.content:
            delta({"content": piece})
        if g.tool is not None:
            delta({"content": None, "tool_calls": [self._tool_call(streamed=True)]})
        delta({"content": ""}, g.finish)
        emit([], self.usage())
        events.append(b"data: [DONE]\n\n")
        return events
