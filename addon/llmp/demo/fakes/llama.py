"""A fake llama.cpp ``llama-server``: its chat endpoint and its side endpoints, with its quirks.

``/v1/chat/completions`` (and the ``/chat/completions`` alias), ``/tokenize``,
``/apply-template``, ``/props``, ``/slots``, ``/health`` and ``/v1/models``, per
``shared/spec/wire-formats.md``. The Anthropic and Responses endpoints of the
same server live in ``anthropic.py`` and ``responses.py`` and are added to
this app with ``add_routes``: one model, one slot, whichever API asks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.model import (
    PROMPT_MS_PER_TOKEN,
    FakeModel,
    Gen,
    alnum,
    count_tokens,
    prompt_text,
    timings,
    token_id,
)
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE, PING
from llmp.demo.fakes.raw import App
from llmp.demo.fakes.responder import Responder

LLAMA_MODEL_FILE = "models/fake-q4.gguf"
LLAMA_FINGERPRINT = "b7000-fake0001"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def llama_dumps(obj: Any) -> bytes:
    """nlohmann::json dump(): compact, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def llama_error(status: int, message: str) -> dict[str, Any]:
    """llama-server's error body, the same on every endpoint."""
    etype = _ERROR_TYPES.get(status, "server_error")
    if status == 503:
        message = "Loading model"
    return {"error": {"code": status, "message": message, "type": etype}}


def midstream_error() -> dict[str, Any]:
    """The error object llama-server sends after a stream has started."""
    return {"error": {"code": 500, "message": MIDSTREAM_ERROR_MESSAGE, "type": "server_error"}}


def sse(name: str, data: dict[str, Any]) -> bytes:
    """A named event, as llama-server frames its Anthropic and Responses streams."""
    return b"event: " + name.encode() + b"\ndata: " + llama_dumps(data) + b"\n\n"


def wants_pings(ex: Exchange) -> bool:
    """Keep-alive comments: newer builds only, and not with ``no_ping``."""
    return "old_build" not in ex.modes and "no_ping" not in ex.modes


class Llama(App):
    """llama-server: one model file, one slot (``model``), answering any model name."""

    def __init__(self, model: FakeModel) -> None:
        super().__init__()
        self.model = model
        self.tokenize_stall = 0.0
        """Seconds `/tokenize` waits before it answers: a tokenizer that hangs (a test
        sets it; a recorder asking it must not hold a record up for long)."""
        self.add_routes(
            {
                ("POST", "/v1/chat/completions"): self._chat,
                ("POST", "/chat/completions"): self._chat,
                ("GET", "/health"): self._health,
                ("GET", "/props"): self._props,
                ("GET", "/v1/models"): self._models,
                ("GET", "/models"): self._models,
                ("GET", "/slots"): self._slots,
                ("POST", "/tokenize"): self._tokenize,
                ("POST", "/apply-template"): self._apply_template,
            }
        )

    @property
    def model_file(self) -> str:
        return self.model.model_file

    # flavour hooks ---------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return [("Server", "llama.cpp"), ("Access-Control-Allow-Origin", "*")]

    def dumps(self, obj: Any) -> bytes:
        return llama_dumps(obj)

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        await self.json(resp, status, llama_error(status, message))

    # shared with the other APIs of the server ------------------------------------

    async def refuse(self, resp: Responder, chat_body: dict[str, Any]) -> bool:
        """Answer the context-size error when the prompt does not fit; True if it did."""
        too_long = self.model.too_long(resp.ex, chat_body)
        if too_long is None:
            return False
        message = (
            f"request ({too_long} tokens) exceeds the available context size "
            f"({self.model.n_ctx} tokens), try increasing it"
        )
        error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
        await self.json(resp, 400, {"error": error})
        return True

    def cmpl_id(self, ex: Exchange) -> str:
        """The request's ``chatcmpl-…`` id (also the Anthropic message id)."""
        return "chatcmpl-" + alnum(random.Random(f"id:{self.model.flavor}:{ex.index}"), 32)

    # chat ----------------------------------------------------------------------------

    async def _chat(self, resp: Responder) -> None:
        ex = resp.ex
        body = self.parse_json_body(ex)
        if body is None:
            await self.error(resp, "", 400, "Failed to parse the request body")
            return
        if await self.refuse(resp, body):
            return
        g = self.model.plan(ex, body, "llama")
        if body.get("stream") is True:
            error_event = b"data: " + llama_dumps(midstream_error()) + b"\n\n"
            events = self._events(ex, g, body)
            await self.stream(resp, "text/event-stream", events, error_event)
        else:
            await self.json(resp, 200, self._full(ex, g))

    def _chunk(
        self, g: Gen, ex: Exchange, delta: dict[str, Any], finish: str | None = None
    ) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": g.created,
            "id": self.cmpl_id(ex),
            "model": self.model_file,
            "system_fingerprint": LLAMA_FINGERPRINT,
            "object": "chat.completion.chunk",
        }

    def _usage(self, g: Gen, old: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "completion_tokens": g.predicted_n,
            "prompt_tokens": g.prompt_tokens,
            "total_tokens": g.prompt_tokens + g.predicted_n,
        }
        if not old:
            usage["prompt_tokens_details"] = {"cached_tokens": g.cache_n}
        return usage

    def _events(self, ex: Exchange, g: Gen, body: dict[str, Any]) -> list[bytes]:
        old = "old_build" in ex.modes
        pings = wants_pings(ex)
        per_token = body.get("timings_per_token") is True
        events: list[bytes] = []
        produced = 0

        def emit(obj: dict[str, Any], final: bool = False) -> None:
            if final or per_token:
                obj["timings"] = timings(g, None if final else produced)
            events.append(b"data: " + llama_dumps(obj) + b"\n\n")

        role = {"role": "assistant", "content": None}
        if body.get("return_progress") is True:
            for processed in sorted({max(1, g.prompt_n // 2), g.prompt_n}):
                chunk = self._chunk(g, ex, dict(role))
                chunk["prompt_progress"] = {
                    "total": g.prompt_tokens,
                    "cache": g.cache_n,
                    "processed": g.cache_n + processed,
                    "time_ms": round(processed * PROMPT_MS_PER_TOKEN, 3),
                }
                emit(chunk)
        emit(self._chunk(g, ex, dict(role)))
        if pings:
            events.append(PING)
        for piece in g.reasoning:
            produced += 1
            emit(self._chunk(g, ex, {"reasoning_content": piece}))
        for piece in g.content:
            produced += 1
            emit(self._chunk(g, ex, {"content": piece}))
        if g.tool is not None:
            tc = g.tool
            fn: dict[str, Any] = {"name": tc.name}
            if old:
                fn["arguments"] = ""
            produced += 1
            header = {"index": 0, "id": tc.id, "type": "function", "function": fn}
            emit(self._chunk(g, ex, {"tool_calls": [header]}))
            for frag in tc.fragments:
                produced += 1
                ffn: dict[str, Any] = (
                    {"name": tc.name, "arguments": frag} if old else {"arguments": frag}
                )
                emit(self._chunk(g, ex, {"tool_calls": [{"index": 0, "function": ffn}]}))
        if pings:
            events.append(PING)
        emit(self._chunk(g, ex, {}, g.finish), final=not g.include_usage)
        if g.include_usage:
            usage_chunk = self._chunk(g, ex, {})
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self._usage(g, old)
            emit(usage_chunk, final=True)
        events.append(b"data: [DONE]\n\n")
        return events

    def _full(self, ex: Exchange, g: Gen) -> dict[str, Any]:
        old = "old_build" in ex.modes
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["reasoning_content"] = g.reasoning_text
        if g.tool is not None:
            message["content"] = None if old else ""
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": g.tool.name, "arguments": g.tool.arguments},
                    "id": g.tool.id,
                }
            ]
        return {
            "choices": [{"finish_reason": g.finish, "index": 0, "message": message}],
            "created": g.created,
            "id": self.cmpl_id(ex),
            "model": self.model_file,
            "system_fingerprint": LLAMA_FINGERPRINT,
            "object": "chat.completion",
            "usage": self._usage(g, old),
            "timings": timings(g),
        }

    # side endpoints ------------------------------------------------------------------

    async def _health(self, resp: Responder) -> None:
        await self.json(resp, 200, {"status": "ok"})

    async def _props(self, resp: Responder) -> None:
        props = {
            "default_generation_settings": {"n_ctx": self.model.n_ctx, "params": {"n_predict": -1}},
            "total_slots": 1,
            "model_path": self.model_file,
            "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>"
            "{% endfor %}<|assistant|>",
            "build_info": LLAMA_FINGERPRINT,
        }
        await self.json(resp, 200, props)

    async def _models(self, resp: Responder) -> None:
        model = {
            "id": self.model_file,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {"n_ctx_train": self.model.n_ctx, "n_vocab": 49152},
        }
        await self.json(resp, 200, {"object": "list", "data": [model]})

    async def _slots(self, resp: Responder) -> None:
        n = count_tokens(self.model.slot_prompt)
        slot = {
            "id": 0,
            "n_ctx": self.model.n_ctx,
            "is_processing": False,
            # the id of the latest task: the requests seen so far, this one included
            "id_task": resp.ex.index + 1,
            "n_prompt_tokens": n,
            "n_prompt_tokens_processed": n,
            "n_prompt_tokens_cache": n,
        }
        await self.json(resp, 200, [slot])

    async def _tokenize(self, resp: Responder) -> None:
        if self.tokenize_stall:
            await asyncio.sleep(self.tokenize_stall)
        body = self.parse_json_body(resp.ex) or {}
        content = body.get("content")
        text = content if isinstance(content, str) else ""
        pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
        tokens: list[Any]
        if body.get("with_pieces"):
            tokens = [{"id": token_id(p), "piece": p} for p in pieces]
        else:
            tokens = [token_id(p) for p in pieces]
        await self.json(resp, 200, {"tokens": tokens})

    async def _apply_template(self, resp: Responder) -> None:
        body = self.parse_json_body(resp.ex) or {}
        await self.json(resp, 200, {"prompt": prompt_text(body)})
