"""A fake of Anthropic's own Messages API (``api.anthropic.com``), prompt cache included.

Nothing in the tests reaches Anthropic, so this fake answers as Anthropic
documents: ``POST /v1/messages`` (also ``?beta=true``) and
``POST /v1/messages/count_tokens``, streamed or not, with the prompt cache's
rules kept exactly, so a test can compute every counter by hand and compare
llmp's verdicts with the fake's own truth (``Exchange.cache``, a
``Decision``). Flavour ``anthropic-api`` of ``Upstream``.

Sources: ``shared/spec/wire-formats.md`` ("Cloud prompt caches", from
Anthropic's "Prompt caching" and "Cache diagnostics" pages), the ``anthropic``
SDK's types (``Usage``, ``CacheCreation``, ``Message``, ``Diagnostics``, the
stream events) for every shape, and the API's error messages as users
reported them (quoted below). The numbers (lookback, breakpoints, times to
live, minimum lengths, the diagnosis beta) come from ``llmp.apis.providers``.

**Authentication.** ``x-api-key`` or ``authorization: Bearer …``, any value;
without either, HTTP 401 ``authentication_error``. Errors are Anthropic's
JSON, ``{"type": "error", "error": {"type", "message"}, "request_id"}``, with
the type the status names (400 ``invalid_request_error``, 404
``not_found_error``, 429 ``rate_limit_error``, 529 ``overloaded_error``…).
Every response has ``request-id: req_…``, ``anthropic-organization-id`` (one
fixed uuid), ``anthropic-workspace-id`` (listed in wire-formats.md; one uuid
per API key here) and ``anthropic-ratelimit-{requests,input-tokens,
output-tokens}-{limit,remaining,reset}``. Message ids are ``msg_01…``, tool
use ids ``toolu_01…``; the response's ``model`` is the requested one.

**The prompt** is the ``tools``, then the ``system`` blocks (a string is one
block), then each message's content blocks (a string content is one text
block, so a message sent as blocks and later as a string is the same
prompt). One block is one position of the cached prefix. Its tokens are the
fakes' ``count_tokens`` (a character count over four, rounded up) of its
text (a text block) or of its compact JSON as sent (any other block, each
tool definition), ``cache_control`` removed at every depth. Key order counts:
a block's JSON is taken byte for byte. Thinking blocks of messages before the
last user message with content other than tool results are not in the prompt
(documented: new user content drops earlier thinking, so the messages tier
misses from there).  Claude Code's billing line (a first system block
``x-anthropic-billing-header: …``) is in the prompt but in no entry's key:
the API reads the prefix behind it whatever it says (R35; first-party hit
ratios near 0.99 are reported with a per-request hash in that line).

**Breakpoints.** ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}``
(default 5m) on a tool, a system block or a message's content block. Refused
with HTTP 400 (the API's own words): on a thinking block
(``messages.N.content.M.thinking.cache_control: Extra inputs are not
permitted``), on an empty text (``….text: cache_control cannot be set for
empty text blocks``), more than four (``A maximum of 4 blocks with
cache_control may be provided. Found 5.``), a 1-hour one after a 5-minute
one (``….cache_control.ttl: a ttl='1h' cache_control block must not come
after a ttl='5m' cache_control block. Note that blocks are processed in the
following order: `tools`, `system`, `messages`.``). A top-level
``cache_control`` (automatic caching) puts one on the last block that may
carry one and counts toward the four; on a block that has its own with the
same TTL it adds nothing, with another TTL it is a 400 (the fake's wording).
``cache_control`` nested inside a block (in a tool result's content) is no
breakpoint here.

**Writes happen only at breakpoints**, one entry each, keyed by the exact
prefix through that block, the scope (model and API key) and the settings of
the block's tier. **Reads look back**: from each breakpoint, that position
and earlier ones, one block at a time, at most 20 positions with the
breakpoint; the hit is the furthest position found over all breakpoints. An
entry becomes readable once its response has begun (its head is written),
so a request that arrives before that misses it.

**Time to live**: 5 minutes or 1 hour after an entry's last write or read.
A read refreshes every entry on the prefix it read (the same cached tokens)
with each entry's own TTL. The clock is ``time.time`` unless one is given.

**Tiers.** Tool definitions are the prefix's start, so a change there misses
everything; ``speed`` and the web-search and citations toggles (a
``web_search*`` tool, a document with ``citations.enabled``) are in the keys
of the system and messages tiers; ``tool_choice``, ``thinking`` and the
number of images (those in tool results included) in the messages tier's
only. ``anthropic-beta`` values change nothing.

**Minimum length**: a breakpoint whose prefix is shorter than the model's
minimum (``anthropic_minimum_tokens``) neither reads nor writes; no error.

**Usage** (the body's, or ``message_start.message.usage``): with A the hit,
C the last breakpoint that counts and B the last 1-hour one after A,
``cache_read_input_tokens`` is the tokens through A, 1-hour writes B − A,
5-minute writes C − B, ``cache_creation_input_tokens`` their sum with the
split in ``cache_creation``, and ``input_tokens`` what follows C; the three
add up to the prompt. ``service_tier: "standard"``. ``message_delta.usage``
is cumulative: ``output_tokens`` and the three input counters again, never
the ``cache_creation`` split.

**Diagnostics.** A request with ``"diagnostics": {"previous_message_id": …}``
(the beta value is accepted, not required: documented as no longer needed
once generally available) gets ``diagnostics`` on the message (streamed: on
``message_start.message``): ``null`` on a first turn (id ``null``) or when
nothing diverged, else ``{"cache_miss_reason": {...}}`` (see
``anthropic_cache.diagnose``). As documented, a fingerprint (hashes and token
counts, never text) is kept only for requests that asked, keyed by their
message id, so naming any other id gets ``previous_message_not_found``.
The mode ``diagnosis_pending`` answers ``{"cache_miss_reason": null}``
(not ready); ``diagnosis_depth`` makes a divergence at that block or later
``unavailable``.

**Control.** ``evict(position=None)`` drops entries (the provider's own
eviction); the ``x-fake`` modes ``evict`` / ``evict=POSITION`` do it before
a request looks, ``cache_miss`` makes one request read nothing, and the
generic modes (delays, faults, ``status=N``, ``context_error``) work as on
the other fakes. A prompt longer than ``n_ctx`` (200,000 by default) is
refused as the API does: ``prompt is too long: N tokens > M maximum``.

**The reply** is deterministic: a ``thinking`` block only when the request
enables thinking (signed), then the text, or a ``tool_use`` when tools are
offered and the last user message asks for the weather (as on the other
fakes). Streamed as Anthropic streams: ``message_start``, a ``ping``, each
block's ``content_block_start``/``_delta``/``_stop`` in turn,
``message_delta``, ``message_stop``; an error after the head is
``event: error`` with ``overloaded_error``.

Simplified: one token count per four characters; no per-message or
tool-schema overhead tokens; each API key is its own workspace; entries are
never evicted except on request; ``cache_missed_input_tokens`` is exact
rather than an estimate.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmp.apis.providers import anthropic_minimum_tokens
from llmp.demo.fakes.anthropic import STOP_REASONS, to_chat
from llmp.demo.fakes.anthropic_cache import (
    Decision,
    Entry,
    Fingerprint,
    Prompt,
    PromptCache,
    RequestError,
    diagnose,
    fingerprint,
    parse_prompt,
    usage,
)
from llmp.demo.fakes.exchange import Exchange, bearer
from llmp.demo.fakes.model import TOOL_ARGS, FakeModel, Gen, alnum
from llmp.demo.fakes.raw import App
from llmp.demo.fakes.responder import Responder
from llmp.demo.fakes.shared_cache import compact

CONTEXT_WINDOW = 200_000
"""The fake's default ``n_ctx``: the prompt length it refuses beyond."""
ORGANIZATION_ID = str(uuid.uuid5(uuid.NAMESPACE_URL, "llmp:fake-anthropic:organization"))
JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"
STREAM_ERROR = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
"""What the API sends when a stream fails after its head."""
RATE_LIMITS = {"requests": 4000, "input-tokens": 2_000_000, "output-tokens": 400_000}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str, request_id: str) -> dict[str, Any]:
    """Anthropic's error JSON for ``status``."""
    etype = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": etype, "message": message}, "request_id": request_id}


def sse(name: str, data: dict[str, Any]) -> bytes:
    """One named event, its data compact JSON."""
    return b"event: " + name.encode() + b"\ndata: " + compact(data) + b"\n\n"


def _ident(prefix: str, seed: str) -> str:
    """An Anthropic-style id (``msg_01…``, ``toolu_01…``, ``req_011C…``): ``prefix``, then
    letters and digits fixed by ``seed``, 24 characters after the underscore."""
    return prefix + alnum(random.Random(seed), 24 - len(prefix.partition("_")[2]))


def _thinking_on(body: dict[str, Any]) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


class AnthropicAPI(App):
    """Anthropic's Messages API over one fake model and one prompt cache (``cache``).

    ``clock`` (seconds, ``time.time`` by default) drives the times to live;
    ``diagnosis_depth`` (None: no limit) is the block from which a divergence is too
    deep for the diagnosis. ``fingerprints`` holds what the diagnosis compares.
    """

    def __init__(
        self,
        model: FakeModel,
        *,
        clock: Callable[[], float] = time.time,
        diagnosis_depth: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.clock = clock
        self.cache = PromptCache(clock)
        self.diagnosis_depth = diagnosis_depth
        self.fingerprints: dict[str, Fingerprint] = {}
        self.add_routes(
            {
                ("POST", "/v1/messages"): self._messages,
                ("POST", "/v1/messages/count_tokens"): self._count_tokens,
            }
        )

    # for tests ---------------------------------------------------------------

    def evict(self, position: int | None = None) -> int:
        """Drop every cached entry, or those at block ``position``; how many went."""
        return self.cache.evict(position)

    def entries(self) -> list[Entry]:
        """The entries alive now (copies), by position."""
        return self.cache.entries()

    # flavour hooks -------------------------------------------------------------

    def dumps(self, obj: Any) -> bytes:
        return compact(obj)

    def headers(self, ex: Exchange, content_type: str) -> list[tuple[str, str]]:
        hdrs = super().headers(ex, content_type)
        reset = datetime.datetime.fromtimestamp(self.clock() + 60, datetime.UTC)
        reset_text = reset.replace(microsecond=0).isoformat().replace("+00:00", "Z")
        hdrs += [
            ("request-id", self.request_id(ex)),
            ("anthropic-organization-id", ORGANIZATION_ID),
        ]
        key = self._api_key(ex)
        if key is not None:
            hdrs.append(("anthropic-workspace-id", self._workspace(key)))
        for name, limit in RATE_LIMITS.items():
            hdrs += [
                (f"anthropic-ratelimit-{name}-limit", str(limit)),
                (f"anthropic-ratelimit-{name}-remaining", str(limit - 1)),
                (f"anthropic-ratelimit-{name}-reset", reset_text),
            ]
        return hdrs

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        await self.json(resp, status, error_body(status, message, self.request_id(resp.ex)))

    async def not_found(self, resp: Responder, path: str) -> None:
        await self.error(resp, path, 404, "Not Found")

    # ids and scope ---------------------------------------------------------------

    @staticmethod
    def request_id(ex: Exchange) -> str:
        return _ident("req_011C", f"req:{ex.index}")

    @staticmethod
    def message_id(ex: Exchange) -> str:
        return _ident("msg_01", f"msg:{ex.index}")

    @staticmethod
    def _api_key(ex: Exchange) -> str | None:
        key = ex.request_header("x-api-key")
        if key:
            return key
        return bearer(ex)

    @staticmethod
    def _workspace(key: str) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, "llmp:fake-anthropic:workspace:" + key))

    # endpoints -------------------------------------------------------------------

    async def _prompt(self, resp: Responder) -> tuple[dict[str, Any], str, Prompt] | None:
        """The request's body, scope and prompt; or None, having answered the error."""
        key = self._api_key(resp.ex)
        if key is None:
            await self.error(resp, "", 401, "x-api-key header is required")
            return None
        body = self.parse_json_body(resp.ex)
        if body is None:
            await self.error(resp, "", 400, "The request body is not valid JSON.")
            return None
        if not isinstance(body.get("model"), str):
            await self.error(resp, "", 400, "model: Field required")
            return None
        try:
            prompt = parse_prompt(body)
        except RequestError as e:
            await self.error(resp, "", 400, str(e))
            return None
        return body, hashlib.sha256(key.encode()).hexdigest(), prompt

    async def _count_tokens(self, resp: Responder) -> None:
        """The prompt's size; the cache is not touched."""
        parsed = await self._prompt(resp)
        if parsed is not None:
            await self.json(resp, 200, {"input_tokens": parsed[2].total})

    async def _messages(self, resp: Responder) -> None:
        ex = resp.ex
        parsed = await self._prompt(resp)
        if parsed is None:
            return
        body, scope, prompt = parsed
        if not isinstance(body.get("max_tokens"), int):
            await self.error(resp, "", 400, "max_tokens: Field required")
            return
        asked, previous = self._diagnostics_param(body)
        if asked is None:
            message = "diagnostics.previous_message_id: Input should be a valid string"
            await self.error(resp, "", 400, message)
            return
        n_ctx = self.model.n_ctx
        if "context_error" in ex.modes or prompt.total > n_ctx:
            n = max(prompt.total, n_ctx + 808) if "context_error" in ex.modes else prompt.total
            await self.error(resp, "", 400, f"prompt is too long: {n} tokens > {n_ctx} maximum")
            return
        if "evict" in ex.modes:
            where = ex.modes["evict"]
            if where and not where.isdigit():
                await self.error(resp, "", 400, f"fake upstream: evict={where} is no position")
                return
            self.cache.evict(int(where) if where else None)
        minimum = anthropic_minimum_tokens(prompt.model)
        decision = self.cache.plan(prompt, scope, minimum, read="cache_miss" not in ex.modes)
        ex.cache = decision
        msg_id = self.message_id(ex)
        fp = fingerprint(prompt, scope, decision.cached)
        diagnostics: dict[str, Any] = {}
        if asked:
            diagnostics["diagnostics"] = self._diagnose(ex, previous, fp)

        def begin() -> None:
            """The response begins: its entries and its fingerprint become visible."""
            self.cache.commit(decision, msg_id)
            if asked:
                self.fingerprints[msg_id] = fp

        g = self.model.plan(ex, to_chat(body), "anthropic", think=_thinking_on(body))
        if g.tool is not None:
            g.tool.id = _ident("toolu_01", f"toolu:{ex.index}")
        if body.get("stream") is True:
            events = self._events(ex, g, decision, msg_id, diagnostics)
            begin()
            await self.stream(resp, SSE, events, sse("error", STREAM_ERROR))
        else:
            headers = self.headers(ex, JSON)
            await self.think(resp)
            begin()
            await resp.body(200, headers, self.dumps(self._full(g, decision, msg_id, diagnostics)))

    # diagnostics -----------------------------------------------------------------

    @staticmethod
    def _diagnostics_param(body: dict[str, Any]) -> tuple[bool | None, str | None]:
        """Whether the request asks for a diagnosis, and the previous id it names;
        ``(None, None)`` for a malformed ``diagnostics``."""
        param = body.get("diagnostics")
        if param is None:
            return False, None
        if not isinstance(param, dict):
            return None, None
        previous = param.get("previous_message_id")
        if previous is not None and not isinstance(previous, str):
            return None, None
        return True, previous

    def _diagnose(self, ex: Exchange, previous: str | None, cur: Fingerprint) -> Any:
        if "diagnosis_pending" in ex.modes:
            return {"cache_miss_reason": None}
        if previous is None:
            return None
        return diagnose(self.fingerprints.get(previous), cur, self.diagnosis_depth)

    # bodies ----------------------------------------------------------------------

    @staticmethod
    def _signature(seed: str) -> str:
        """A thinking block's signature: opaque, fixed by ``seed``."""
        return base64.b64encode(hashlib.sha256(seed.encode()).digest() * 3).decode()

    def _message(
        self,
        g: Gen,
        msg_id: str,
        content: list[Any],
        stop: str | None,
        use: dict[str, Any],
        diagnostics: dict[str, Any],
    ) -> dict[str, Any]:
        return {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": g.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": use,
            **diagnostics,
        }

    def _full(
        self, g: Gen, d: Decision, msg_id: str, diagnostics: dict[str, Any]
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if g.reasoning:
            signature = self._signature(msg_id)
            content.append(
                {"type": "thinking", "thinking": g.reasoning_text, "signature": signature}
            )
        if g.content:
            content.append({"type": "text", "text": g.content_text})
        if g.tool is not None:
            content.append(
                {"type": "tool_use", "id": g.tool.id, "name": g.tool.name, "input": TOOL_ARGS}
            )
        stop = STOP_REASONS[g.finish]
        return self._message(g, msg_id, content, stop, usage(d, g.predicted_n), diagnostics)

    def _events(
        self, ex: Exchange, g: Gen, d: Decision, msg_id: str, diagnostics: dict[str, Any]
    ) -> list[bytes]:
        start = self._message(g, msg_id, [], None, usage(d, 1), diagnostics)
        events = [sse("message_start", {"type": "message_start", "message": start})]
        if "no_ping" not in ex.modes:
            events.append(sse("ping", {"type": "ping"}))
        index = 0

        def block(first: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
            nonlocal index
            data = {"type": "content_block_start", "index": index, "content_block": first}
            events.append(sse("content_block_start", data))
            for delta in deltas:
                data = {"type": "content_block_delta", "index": index, "delta": delta}
                events.append(sse("content_block_delta", data))
            events.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
            index += 1

        if g.reasoning:
            deltas = [{"type": "thinking_delta", "thinking": p} for p in g.reasoning]
            deltas.append({"type": "signature_delta", "signature": self._signature(msg_id)})
            block({"type": "thinking", "thinking": "", "signature": ""}, deltas)
        if g.content:
            block(
                {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in g.content]
            )
        if g.tool is not None:
            first = {"type": "tool_use", "id": g.tool.id, "name": g.tool.name, "input": {}}
            fragments = ["", *g.tool.fragments]
            block(first, [{"type": "input_json_delta", "partial_json": f} for f in fragments])
        final = usage(d, g.predicted_n)
        final.pop("cache_creation")
        final.pop("service_tier")
        delta = {"stop_reason": STOP_REASONS[g.finish], "stop_sequence": None}
        events.append(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": final})
        )
        events.append(sse("message_stop", {"type": "message_stop"}))
        return events


__all__ = ["CONTEXT_WINDOW", "ORGANIZATION_ID", "STREAM_ERROR", "AnthropicAPI", "error_body"]
