"""A fake of OpenAI's API: ``POST /v1/responses`` and ``POST /v1/chat/completions``
(streamed and not) with OpenAI's documented prompt-cache rules, and ``GET /v1/models``.

Sources: ``shared/spec/wire-formats.md`` ("Cloud prompt caches", "OpenAI"), rulings
R34–R37, and openai-python 3.63's types (``ResponseUsage``, ``CompletionUsage``,
``PromptCacheOptions``, ``PromptCacheBreakpoint``, ``PromptCacheDiagnostics``).  The
numbers are data in ``llmp/apis/provider_caches.toml``, read through
``llmp.apis.providers``; the prompt the cache sees is ``openai_prompt``'s rendering
(tokens: ceil(chars/4) per segment); the cache is ``provider_cache.ProviderCache``.

**Auth and headers.** Every endpoint wants ``authorization: Bearer <key>`` (any
non-empty key, or exactly ``api_key`` when set); else 401 with OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``).  Every response carries
``x-request-id`` (``req_…``), ``openai-processing-ms``, ``openai-organization``,
``openai-project``, ``openai-version``, the ``x-ratelimit-*`` headers, and Cloudflare's
``server``, ``cf-ray`` and a ``__cf_bm`` ``set-cookie`` (what the recorder must keep out).
Non-streamed bodies are pretty-printed JSON, as OpenAI sends them; events are compact.

**What changes the prefix.** The model, the tools (and ``parallel_tool_calls``), the
text format (Chat: ``response_format``), the reasoning effort and the verbosity form the
entry's namespace; ``service_tier`` (``auto`` runs at ``default``, ``fast`` at
``priority``) routes to other machines, so it is in the namespace too; changing any of
them misses from the first token.  ``prompt_cache_key`` is kept beside the namespace: a
changed key never reads the old key's entries (a simplification: on the real service a
changed key usually lands on a cold machine).  A ``compaction`` item is part of the
prompt like any other.  ``tool_choice`` is not part of the prefix here.

**Before GPT-5.6** (``providers.openai_explicit(model)`` false): automatic caching of
the whole prompt, no markers, no write fee.  A request is routed by a hash of its
namespace, its first ``routing_prefix_tokens`` (256) tokens and its key to one of
``machines`` (4) machines, each with its own entries; it reads the longest prefix it
shares with an entry there, reported as ``cached_tokens`` in whole 128-token steps from
1,024 (nothing below 1,024, and prompts under 1,024 tokens are not kept).  Above
``overflow_per_minute`` (15) requests in a trailing minute for one route, each further
request goes to another machine, reads nothing and keeps nothing (real overflow machines
would warm up; the fake keeps the rule simple).  ``prompt_cache_retention``:
``in_memory`` keeps an entry 5 minutes after its last use (the real one: 5–10 minutes,
at most an hour), ``24h`` a day; unset is ``default_retention`` (``in_memory``; the real
default depends on the organisation's data retention).  ``prompt_cache_options``,
breakpoints and ``comparison_response_id`` are ignored (the response has
``prompt_cache_options: null`` and no diagnosis).

**GPT-5.6 and later.** ``prompt_cache_options: {"mode", "ttl", "comparison_response_id"}``
(``mode`` ``implicit`` by default, ``ttl`` ``30m`` or ``12h``, else 400).  Breakpoints
are ``"prompt_cache_breakpoint": {"mode": "explicit", "ttl"?}`` on a content part (an
``input_text``/``output_text`` part in Responses, a ``text`` part in Chat, per the
SDK's ``PromptCacheBreakpoint``); one ends the prefix after that part, its ``ttl``
defaults to the request's.  ``explicit`` mode writes only at the latest 4 breakpoints
(more are not an error; the earlier ones are not written) and a request without any
does not use the cache at all.  ``implicit`` mode (the SDK: "one implicit breakpoint and
up to the latest three explicit") writes at the end of the prompt and at the latest 3
breakpoints.  A write needs at least 1,024 tokens before its position.  A request reads
the longest live entry that is a prefix of its prompt (any position, no lookback limit;
the real service considers the latest 80 breakpoints); ``cached_tokens`` is exact; the
tokens from there to the furthest new entry are ``cache_write_tokens`` (priced 1.25×),
the rest uncached: each input token is counted once.  An entry lives its ttl after its
last write or read.  There are no machines and no overflow in this generation.

**Usage.** Responses: ``usage.input_tokens`` (cached and written included),
``input_tokens_details: {cached_tokens, cache_write_tokens}`` always (the SDK requires
both), plus ``cache_write_tokens_details: {ttl_30m_tokens, ttl_12h_tokens}`` from
GPT-5.6; ``output_tokens_details.reasoning_tokens``.  Chat: ``usage.prompt_tokens``
(cached included), ``prompt_tokens_details: {cached_tokens, audio_tokens}`` and, from
GPT-5.6, ``cache_write_tokens`` there too (the SDK's ``PromptTokensDetails``);
streamed only with ``stream_options.include_usage``, in one last chunk with empty
``choices`` (then every chunk has ``usage: null``).

**Echo.** The Responses object echoes, as OpenAI's does, ``instructions``, ``tools``,
``text``, ``reasoning``, ``metadata``, ``tool_choice``, ``store``, ``prompt_cache_key``,
``prompt_cache_retention`` (the one applied), ``prompt_cache_options`` (the applied
mode and ttl, and the comparison id), ``prompt_cache_diagnostics`` and ``service_tier``
(the tier it ran at).  Chat echoes ``service_tier`` and ``system_fingerprint`` (its
SDK type has no cache fields).

**Streams.** Responses: named events with ``sequence_number``, ``output_index``,
``content_index`` and ``item_id`` as OpenAI sends them (the SDK's ``responses.stream()``
helper reads them): ``response.created``, ``response.in_progress``, a ``reasoning`` item
(its summary streamed when ``reasoning.summary`` is set; ``encrypted_content`` when
``include`` asks), the message or ``function_call`` item, then ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it) with the usage and the
diagnosis; deltas carry ``obfuscation`` unless ``stream_options.include_obfuscation`` is
false.  No keep-alive comments, no ``[DONE]``.  Chat: ``data:`` chunks and ``[DONE]``;
reasoning is counted, never shown.  ``reasoning.effort`` (Chat ``reasoning_effort``)
``none`` gives no reasoning.

**Diagnostics** (Responses, GPT-5.6+). ``comparison_response_id`` asks for
``prompt_cache_diagnostics`` (streamed: in ``response.completed``), a comparison of this
request with that response's request, kept by id for every response (``store: false``
too: whether OpenAI keeps those is not documented).  In order: the id unknown →
``comparison_response_not_found`` (HTTP 200); forced ``unavailable`` (the
``diagnosis_unavailable`` mode or ``unavailable_next()``); a setting differs →
``cache_miss`` with ``model_changed``, ``prompt_cache_key_changed``,
``service_tier_changed``, ``tools_changed`` (``parallel_tool_calls`` too),
``text_format_changed``, ``reasoning_effort_changed`` or ``verbosity_changed``, and
``cache_missed_tokens`` the whole prompt; the comparison left nothing reusable →
``unavailable``; the prompt holds the comparison's reusable prefix → ``cache_hit`` (even
if that entry has expired since: a comparison, not a lookup); else ``cache_miss`` with
``context_compacted`` (a ``compaction`` item at or after the divergence) or
``input_changed``, ``cache_missed_tokens`` the tokens from the divergence on.
``comparison_reusable_tokens`` is the prefix the comparison response read, wrote or kept
alive.  A diagnosis never changes what is cached.

**Controls.** ``x-fake`` modes: ``overflow`` (this request overflows), ``cache_miss``
(reads nothing, still writes), ``diagnosis_unavailable``, ``context_error``, and the
shared faults.  Methods on ``cache`` (``ProviderCache``): ``evict()``,
``set_machines()``, ``force_overflow()``, ``entries()``; on the app:
``unavailable_next()``, ``clock`` (real time by default; a ``ManualClock`` in tests).
Each request's ``Exchange.cache`` is its ``CacheDecision``: machine, overflow, tokens
read, written and kept, the diagnosis, and why a longer prefix was lost.

**Compaction.** ``POST /v1/responses/compact`` (the SDK's ``responses.compact``, what
Codex's remote compaction calls) answers ``object: "response.compaction"`` whose
``output`` is the conversation's user messages and one ``compaction`` item
(``encrypted_content`` derived from the prompt), with the usage of reading the prompt
through the cache (its namespace has no tools, so it rarely reads the conversation's
entries) and ``COMPACTION_TOKENS`` of output.  Sending that output back as ``input``
puts a ``compaction`` segment in the prompt.

Other simplifications: ``previous_response_id`` continues a stored response (400
``previous_response_not_found`` otherwise); the model named is the model echoed (no
dated snapshot); ``prompt_cache_options.prewarm`` is not served; a context window of
``context_window`` tokens (400,000); ``in_memory`` is accepted for every model (the SDK
says GPT-5.5 and later support only ``24h``), so a test can drive the 5-minute rule on
any model before GPT-5.6.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

from llmp.apis.providers import openai_explicit
from llmp.demo.fakes.exchange import Exchange, bearer
from llmp.demo.fakes.model import (
    PREDICTED_MS_PER_TOKEN,
    PROMPT_MS_PER_TOKEN,
    FakeModel,
    Gen,
    alnum,
)
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE
from llmp.demo.fakes.openai_bodies import (
    ChatBuilder,
    Ids,
    ResponseBuilder,
    compact,
    responses_usage,
    user_item,
)
from llmp.demo.fakes.openai_prompt import (
    BadRequest,
    CachePlan,
    Record,
    Settings,
    cache_plan,
    chat_prompt,
    chat_settings,
    diagnose,
    input_items,
    responses_prompt,
    responses_settings,
)
from llmp.demo.fakes.provider_cache import CacheDecision, Clock, ProviderCache
from llmp.demo.fakes.raw import App
from llmp.demo.fakes.responder import Responder
from llmp.demo.fakes.responses import to_chat

OPENAI_VERSION = "2020-10-01"
CONTEXT_WINDOW = 400_000
COMPACTION_TOKENS = 64
"""What a compaction pass reports as its output (the summary it encrypted)."""
MODELS = ("gpt-4o", "gpt-4.1", "gpt-5", "gpt-5-codex", "gpt-5.5", "gpt-5.6", "gpt-5.6-codex")
MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password "
    "field (with blank username) if you're accessing the API from your browser and are "
    "prompted for a username and password. You can obtain an API key from "
    "https://platform.openai.com/account/api-keys."
)


def pretty(obj: Any) -> bytes:
    """A non-streamed body as OpenAI sends it: indented JSON."""
    return json.dumps(obj, indent=2, ensure_ascii=False).encode()


def openai_error(
    message: str, etype: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def mask(key: str) -> str:
    """How OpenAI quotes a wrong key back: its head and its last four characters."""
    return key[:3] + "*" * max(0, len(key) - 7) + key[-4:] if len(key) > 7 else "*" * len(key)


def processing_ms(d: CacheDecision, output_tokens: int) -> int:
    """The fake's server time: uncached and written tokens at the fakes' prefill rate, read
    tokens at a tenth of it, output at the fakes' decode rate."""
    prefill = (d.uncached + d.written) * PROMPT_MS_PER_TOKEN
    return round(
        prefill + d.read * PROMPT_MS_PER_TOKEN / 10 + output_tokens * PREDICTED_MS_PER_TOKEN
    )


class OpenAIAPI(App):
    """OpenAI's API over one ``ProviderCache``; see the module docstring for the rules."""

    def __init__(
        self,
        model: FakeModel,
        *,
        machines: int = 4,
        clock: Clock = time.time,
        api_key: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.cache = ProviderCache(machines=machines, clock=clock)
        self.api_key = api_key
        self.organization = "user-fakeorg0000000000000000"
        self.project = "proj_fakeproject000000000000"
        self.context_window = CONTEXT_WINDOW
        self.default_retention = "in_memory"
        #: every response's request, by id, for diagnoses
        self.records: dict[str, Record] = {}
        #: responses stored (``store`` not false): their conversation as input items
        self.stored: dict[str, list[dict[str, Any]]] = {}
        self._unavailable = 0
        self.add_routes(
            {
                ("POST", "/v1/responses"): self._responses,
                ("POST", "/v1/responses/compact"): self._compact,
                ("POST", "/v1/chat/completions"): self._chat,
                ("GET", "/v1/models"): self._models,
            }
        )

    @property
    def clock(self) -> Clock:
        return self.cache.clock

    @clock.setter
    def clock(self, value: Clock) -> None:
        self.cache.clock = value

    def unavailable_next(self, n: int = 1) -> None:
        """The next ``n`` diagnoses answer ``{"type": "unavailable"}``."""
        self._unavailable += n

    # flavour hooks --------------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return [
            ("date", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime())),
            ("server", "cloudflare"),
            ("openai-version", OPENAI_VERSION),
            ("openai-organization", self.organization),
            ("openai-project", self.project),
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-limit-tokens", "30000000"),
            ("x-ratelimit-remaining-requests", "9999"),
            ("x-ratelimit-remaining-tokens", "29999000"),
            ("x-ratelimit-reset-requests", "6ms"),
            ("x-ratelimit-reset-tokens", "2ms"),
            ("strict-transport-security", "max-age=31536000; includeSubDomains; preload"),
            ("x-content-type-options", "nosniff"),
        ]

    def headers(self, ex: Exchange, content_type: str) -> list[tuple[str, str]]:
        if content_type.startswith("application/json"):
            content_type = "application/json"
        hdrs = super().headers(ex, content_type)
        ids = Ids(ex)
        d = ex.cache if isinstance(ex.cache, CacheDecision) else None
        hdrs += [
            ("x-request-id", ids.request),
            ("openai-processing-ms", str(d.processing_ms if d is not None else 3)),
            (
                "set-cookie",
                f"__cf_bm={alnum(ids.rng, 43)}; path=/; expires=Thu, 01 Jan 2037 00:00:00 GMT; "
                "domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
            ),
            ("cf-ray", f"{ids.rng.getrandbits(64):016x}-SJC"),
        ]
        return hdrs

    def dumps(self, obj: Any) -> bytes:
        return pretty(obj)

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        if status == 429:
            body = openai_error(message, "requests", None, "rate_limit_exceeded")
        elif status >= 500:
            body = openai_error(message, "server_error")
        else:
            body = openai_error(message)
        await self.json(resp, status, body)

    async def not_found(self, resp: Responder, path: str) -> None:
        await self.json(resp, 404, openai_error(f"Invalid URL ({resp.ex.method} {path})"))

    # shared steps ------------------------------------------------------------------

    async def authorized(self, resp: Responder) -> bool:
        """Answer 401 unless the request has the bearer key; True when it has."""
        token = bearer(resp.ex)
        if token is None:
            await self.json(resp, 401, openai_error(MISSING_KEY))
            return False
        if self.api_key is not None and token != self.api_key:
            message = (
                f"Incorrect API key provided: {mask(token)}. You can find your API key at "
                "https://platform.openai.com/account/api-keys."
            )
            await self.json(resp, 401, openai_error(message, code="invalid_api_key"))
            return False
        return True

    async def request_body(self, resp: Responder) -> dict[str, Any] | None:
        """The JSON body with a ``model``, or None after answering 400."""
        body = self.parse_json_body(resp.ex)
        if body is None:
            message = (
                "We could not parse the JSON body of your request. (HINT: This likely means "
                "you aren't using your HTTP library correctly. The OpenAI API expects a JSON "
                "payload, but what was sent was not valid JSON.)"
            )
            await self.json(resp, 400, openai_error(message))
            return None
        if not isinstance(body.get("model"), str) or not body["model"]:
            await self.json(
                resp, 400, openai_error("Missing required parameter: 'model'.", param="model")
            )
            return None
        return body

    async def bad(self, resp: Responder, e: BadRequest) -> None:
        await self.json(resp, 400, openai_error(e.message, param=e.param, code=e.code))

    def decide(
        self, ex: Exchange, plan: CachePlan, prompt: Any, settings: Settings
    ) -> CacheDecision:
        return self.cache.decide(
            prompt,
            settings.model,
            settings.namespace,
            settings.key,
            plan.policy,
            overflow="overflow" in ex.modes,
            cold="cache_miss" in ex.modes,
        )

    def generate(self, ex: Exchange, chat: dict[str, Any], effort: str, ids: Ids) -> Gen:
        """The fake model's output; OpenAI's call ids; no reasoning at effort ``none``."""
        g = self.model.plan(ex, chat, "openai")
        if effort == "none" and g.reasoning:
            g.predicted_n -= len(g.reasoning)
            g.reasoning = []
        if g.tool is not None:
            g.tool.id = ids.call
        return g

    def diagnosis_unavailable(self, ex: Exchange) -> bool:
        if "diagnosis_unavailable" in ex.modes:
            return True
        if self._unavailable > 0:
            self._unavailable -= 1
            return True
        return False

    # /v1/responses -------------------------------------------------------------------

    async def _responses(self, resp: Responder) -> None:
        ex = resp.ex
        if not await self.authorized(resp):
            return
        body = await self.request_body(resp)
        if body is None:
            return
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in self.stored:
                message = f"Previous response with id '{previous}' not found."
                error = openai_error(
                    message, param="previous_response_id", code="previous_response_not_found"
                )
                await self.json(resp, 400, error)
                return
            history = self.stored[previous]
        try:
            plan = cache_plan(body["model"], body, self.default_retention)
            prompt = responses_prompt(body, history, plan.marker)
        except BadRequest as e:
            await self.bad(resp, e)
            return
        if prompt.tokens > self.context_window or "context_error" in ex.modes:
            message = (
                "Your input exceeds the context window of this model. "
                "Please adjust your input and try again."
            )
            error = openai_error(message, param="input", code="context_length_exceeded")
            await self.json(resp, 400, error)
            return
        settings = responses_settings(body)
        d = self.decide(ex, plan, prompt, settings)
        ids = Ids(ex)
        items = [*history, *input_items(body.get("input"))]
        g = self.generate(ex, to_chat({**body, "input": items}, []), settings.reasoning_effort, ids)
        comparison = (plan.options or {}).get("comparison_response_id")
        record = Record(settings, prompt, d.reusable)
        if comparison is not None:
            old = self.records.get(str(comparison))
            d.diagnosis = diagnose(record, old, self.diagnosis_unavailable(ex))
        self.records[ids.response] = record
        r = ResponseBuilder(body, plan, settings, d, g, ids)
        if body.get("store") is not False:
            self.stored[ids.response] = [*items, *r.output()]
        d.processing_ms = processing_ms(d, g.predicted_n)
        ex.cache = d
        if body.get("stream") is True:
            n = int(ex.modes.get("error_after") or 3)
            error = {
                "type": "error",
                "sequence_number": n,
                "error": {
                    "type": "server_error",
                    "code": "server_error",
                    "message": MIDSTREAM_ERROR_MESSAGE,
                    "param": None,
                },
            }
            err = b"event: error\ndata: " + compact(error) + b"\n\n"
            await self.stream(resp, "text/event-stream; charset=utf-8", r.events(), err)
        else:
            await self.json(resp, 200, r.response(final=True))

    # /v1/responses/compact ------------------------------------------------------------

    async def _compact(self, resp: Responder) -> None:
        """The conversation's user messages, then one ``compaction`` item; the pass reads
        the prompt through the cache like any request."""
        ex = resp.ex
        if not await self.authorized(resp):
            return
        body = await self.request_body(resp)
        if body is None:
            return
        history = self.stored.get(str(body.get("previous_response_id")), [])
        try:
            plan = cache_plan(body["model"], body, self.default_retention)
            prompt = responses_prompt(body, history, plan.marker)
        except BadRequest as e:
            await self.bad(resp, e)
            return
        settings = responses_settings(body)
        d = self.decide(ex, plan, prompt, settings)
        ids = Ids(ex)
        items = [*history, *input_items(body.get("input"))]
        users = [
            user_item(i, n, ids)
            for n, i in enumerate(items)
            if i.get("role") == "user" and i.get("type") in (None, "message")
        ]
        digest = hashlib.sha256(prompt.text.encode()).digest()
        compaction = {
            "id": f"cmp_{ids.rng.getrandbits(192):048x}",
            "type": "compaction",
            "encrypted_content": "gAAAAA" + base64.b64encode(digest * 4).decode(),
        }
        output_tokens = COMPACTION_TOKENS
        d.processing_ms = processing_ms(d, output_tokens)
        ex.cache = d
        usage = responses_usage(d, output_tokens, 0, openai_explicit(settings.model))
        out = {
            "id": ids.response,
            "object": "response.compaction",
            "created_at": int(self.clock()),
            "output": [*users, compaction],
            "usage": usage,
            "service_tier": settings.service_tier,
        }
        await self.json(resp, 200, out)

    # /v1/chat/completions --------------------------------------------------------------

    async def _chat(self, resp: Responder) -> None:
        ex = resp.ex
        if not await self.authorized(resp):
            return
        body = await self.request_body(resp)
        if body is None:
            return
        try:
            plan = cache_plan(body["model"], body, self.default_retention)
            prompt = chat_prompt(body, plan.marker)
        except BadRequest as e:
            await self.bad(resp, e)
            return
        if prompt.tokens > self.context_window or "context_error" in ex.modes:
            message = (
                f"This model's maximum context length is {self.context_window} tokens. "
                f"However, your messages resulted in {prompt.tokens} tokens. "
                "Please reduce the length of the messages."
            )
            error = openai_error(message, param="messages", code="context_length_exceeded")
            await self.json(resp, 400, error)
            return
        settings = chat_settings(body)
        d = self.decide(ex, plan, prompt, settings)
        ids = Ids(ex)
        g = self.generate(ex, body, settings.reasoning_effort, ids)
        d.processing_ms = processing_ms(d, g.predicted_n)
        ex.cache = d
        c = ChatBuilder(body, settings, d, g, ids)
        if body.get("stream") is True:
            error = openai_error(MIDSTREAM_ERROR_MESSAGE, "server_error")
            err = b"data: " + compact(error) + b"\n\n"
            await self.stream(resp, "text/event-stream; charset=utf-8", c.events(), err)
        else:
            await self.json(resp, 200, c.completion())

    # /v1/models --------------------------------------------------------------------------

    async def _models(self, resp: Responder) -> None:
        if not await self.authorized(resp):
            return
        data = [
            {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "system"}
            for m in MODELS
        ]
        await self.json(resp, 200, {"object": "list", "data": data})
