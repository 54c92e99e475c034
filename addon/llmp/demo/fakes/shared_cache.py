"""vLLM and SGLang: ``/v1/chat/completions`` over one prefix cache shared by every request.

Unlike llama-server there are no slots: every request's prompt stays in one
cache until memory runs short, and then the least recently used prompts go
first.  vLLM reuses whole blocks (16 tokens), and never the last token of a
prompt; SGLang's radix tree reuses token by token.  ``capacity`` (tokens of
KV memory) lets a test make memory short.  ``cache_report`` is the server's
flag that adds ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details`` for vLLM, ``--enable-cache-report`` for
SGLang); without it the counter is missing.

Wire differences, from each server's OpenAI layer: both answer from uvicorn
(``server: uvicorn``) in compact JSON; vLLM streams reasoning as
``delta.reasoning``, SGLang as ``delta.reasoning_content`` and keeps
``matched_stop`` and ``usage: null`` in every chunk; vLLM's ids are
``chatcmpl-<32 hex>``, SGLang's bare 32 hex.  Both put the usage chunk last
(``choices: []``) only with ``stream_options.include_usage``.  As the real vLLM
0.32 does, vLLM sends ``system_fingerprint: "vllm-<version>-<hash>"`` (in the
body, and in the usage chunk) and, beside ``cached_tokens``, what the request
wrote into the cache (``created_cache_tokens``: the prompt's whole blocks not
already cached); SGLang's usage carries ``reasoning_tokens`` at its top level.

``/tokenize`` in each server's own shape: ``{"prompt", "add_special_tokens"}``
(SGLang also at ``/v1/tokenize``), answered ``{"count", "max_model_len",
"tokens", …}``; llama-server's ``{"content"}`` is refused with HTTP 400, as
their request validation does.  ``block`` sets vLLM's block (128 is the CPU
build's).
"""

from __future__ import annotations

import email.utils
import json
import uuid
from collections import OrderedDict
from typing import Any, Literal

from llmp.demo.fakes.model import (
    FakeModel,
    Gen,
    common_prefix,
    count_tokens,
    prompt_text,
    token_id,
)
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE
from llmp.demo.fakes.raw import App, Handler
from llmp.demo.fakes.responder import Responder

SharedKind = Literal["vllm", "sglang"]
PATH = "/v1/chat/completions"
BLOCK = {"vllm": 16, "sglang": 1}
"""Tokens per cache block by default: what reuse is counted in."""
VLLM_FINGERPRINT = "vllm-0.32.0-6cbdfb74"
"""vLLM's `system_fingerprint` (its default `--fingerprint-mode full`)."""


def compact(obj: Any) -> bytes:
    """Pydantic's JSON as both servers send it: compact, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class PrefixCache:
    """One cache for all requests, evicted least recently used when over ``capacity``."""

    def __init__(self, block: int, capacity: int) -> None:
        self.block = block
        self.capacity = capacity
        self.prompts: OrderedDict[str, int] = OrderedDict()
        """Each cached prompt and its tokens, least recently used first."""
        self.held = 0
        """Tokens of the last prompt looked up that the cache holds after it: its
        whole blocks (vLLM's `created_cache_tokens` is this less the hit)."""

    def used(self) -> int:
        """Tokens held: a prompt's prefix shared with an earlier-held one is held once."""
        held: list[str] = []
        total = 0
        for prompt, n in self.prompts.items():
            shared = max((common_prefix(p, prompt) // 4 for p in held), default=0)
            total += n - min(shared, n)
            held.append(prompt)
        return total

    def lookup(self, prompt: str) -> int:
        """Tokens reused for ``prompt`` (whole blocks, never the last token); then cache it."""
        total = max(1, count_tokens(prompt))
        best = 0
        for cached in self.prompts:
            best = max(best, common_prefix(cached, prompt) // 4)
        hit = min(best, total - 1) // self.block * self.block
        self.held = total // self.block * self.block
        for cached in [p for p in self.prompts if prompt.startswith(p)]:
            del self.prompts[cached]  # the new prompt extends it: the same blocks
        self.prompts[prompt] = total
        self.prompts.move_to_end(prompt)
        while len(self.prompts) > 1 and self.used() > self.capacity:
            self.prompts.popitem(last=False)
        return hit


class SharedCacheServer(App):
    """A vLLM or SGLang OpenAI server for one model (``kind``)."""

    def __init__(
        self,
        model: FakeModel,
        kind: SharedKind,
        *,
        capacity: int,
        cache_report: bool,
        block: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.kind: SharedKind = kind
        self.cache = PrefixCache(block or BLOCK[kind], capacity)
        self.cache_report = cache_report
        self.fingerprint: str | None = VLLM_FINGERPRINT if kind == "vllm" else None
        """vLLM's `system_fingerprint`; None as with `--fingerprint-mode none`."""
        routes: dict[tuple[str, str], Handler] = {
            ("POST", PATH): self._chat,
            ("GET", "/v1/models"): self._models,
            ("POST", "/tokenize"): self._tokenize,
        }
        if kind == "sglang":
            routes[("POST", "/v1/tokenize")] = self._tokenize
        self.add_routes(routes)

    # flavour hooks ---------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return [("date", email.utils.formatdate(usegmt=True)), ("server", "uvicorn")]

    def dumps(self, obj: Any) -> bytes:
        return compact(obj)

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        etype = "BadRequestError" if status < 500 else "InternalServerError"
        if status == 404:
            etype = "NotFoundError"
        obj: dict[str, Any] = {"message": message, "type": etype, "param": None, "code": status}
        # vLLM wraps its ErrorResponse in "error"; SGLang sends it bare, with "object".
        body = {"error": obj} if self.kind == "vllm" else {"object": "error", **obj}
        await self.json(resp, status, body)

    # endpoints ---------------------------------------------------------------

    async def _models(self, resp: Responder) -> None:
        card = {"id": self.model.model_file, "object": "model", "owned_by": self.kind}
        await self.json(resp, 200, {"object": "list", "data": [card]})

    async def _tokenize(self, resp: Responder) -> None:
        """Each server's `/tokenize`: a prompt in, its tokens and their count out."""
        body = self.parse_json_body(resp.ex) or {}
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not isinstance(body.get("messages"), list):
            if self.kind == "vllm":  # pydantic's errors, as vLLM words them
                message = (
                    "2 validation errors:\n  {'type': 'missing', 'loc': 'body.prompt', "
                    "'msg': 'Field required'}\n  {'type': 'missing', 'loc': 'body.messages', "
                    "'msg': 'Field required'}"
                )
                err = {"message": message, "type": "Bad Request", "param": "body.prompt"}
                await self.json(resp, 400, {"error": {**err, "code": 400}})
            else:
                message = "Exactly one of 'prompt' or 'messages' must be provided."
                await self.error(resp, "/tokenize", 400, message)
            return
        text = prompt if isinstance(prompt, str) else prompt_text(body)
        ids = [token_id(text[i : i + 4]) for i in range(0, len(text), 4)]
        if body.get("add_special_tokens", True):
            ids.insert(0, 1)  # a BOS, as the default asks
        reply: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.model.n_ctx,
            "tokens": ids,
        }
        if self.kind == "vllm":
            reply["token_strs"] = None
        await self.json(resp, 200, reply)

    def _too_long_message(self, n: int) -> str:
        if self.kind == "vllm":
            return (
                f"This model's maximum context length is {self.model.n_ctx} tokens. "
                f"However, your request has {n} input tokens. "
                "Please reduce the length of the input messages."
            )
        return (
            f"The input ({n} tokens) is longer than the model's context length "
            f"({self.model.n_ctx} tokens)."
        )

    async def _chat(self, resp: Responder) -> None:
        ex = resp.ex
        body = self.parse_json_body(ex)
        if body is None:
            await self.error(resp, PATH, 400, "invalid JSON in request body")
            return
        n = self.model.too_long(ex, body)
        if n is not None:
            await self.error(resp, PATH, 400, self._too_long_message(n))
            return
        g = self.model.plan(ex, body, "openai")
        hit = 0 if "cache_miss" in ex.modes else self.cache.lookup(prompt_text(body))
        g.cache_n, g.prompt_n = hit, g.prompt_tokens - hit
        if "cache_miss" not in ex.modes:
            g.cache_written = max(0, self.cache.held - hit)
        if g.tool is not None:
            g.tool.id = f"chatcmpl-tool-{uuid.UUID(int=g.rng.getrandbits(128)).hex}"
        cid = uuid.UUID(int=g.rng.getrandbits(128)).hex
        cid = f"chatcmpl-{cid}" if self.kind == "vllm" else cid
        if body.get("stream") is True:
            err = {"error": {"message": MIDSTREAM_ERROR_MESSAGE, "type": "InternalServerError"}}
            error_event = b"data: " + compact(err) + b"\n\n"
            await self.stream(resp, "text/event-stream", self._events(cid, g), error_event)
        else:
            await self.json(resp, 200, self._full(cid, g))

    # bodies --------------------------------------------------------------------

    def _usage(self, g: Gen) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": g.prompt_tokens,
            "total_tokens": g.prompt_tokens + g.predicted_n,
            "completion_tokens": g.predicted_n,
        }
        if self.cache_report:
            details: dict[str, Any] = {"cached_tokens": g.cache_n}
            if self.kind == "vllm":
                details["created_cache_tokens"] = g.cache_written
            usage["prompt_tokens_details"] = details
        elif self.kind == "sglang":
            usage["prompt_tokens_details"] = None
        if self.kind == "sglang":
            usage["reasoning_tokens"] = 0
        return usage

    def _tool_calls(self, g: Gen, *, streamed: bool) -> list[dict[str, Any]]:
        assert g.tool is not None
        call: dict[str, Any] = {
            "id": g.tool.id,
            "type": "function",
            "function": {"name": g.tool.name, "arguments": g.tool.arguments},
        }
        return [{"index": 0, **call}] if streamed else [call]

    def _reasoning_key(self) -> str:
        return "reasoning" if self.kind == "vllm" else "reasoning_content"

    def _events(self, cid: str, g: Gen) -> list[bytes]:
        events: list[bytes] = []

        def emit(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": g.created,
                "model": g.model,
                "choices": choices,
            }
            if usage is not None or self.kind == "sglang":
                chunk["usage"] = usage
            if usage is not None and self.kind == "vllm":
                chunk["system_fingerprint"] = self.fingerprint
            events.append(b"data: " + compact(chunk) + b"\n\n")

        def delta(d: dict[str, Any], finish: str | None = None) -> None:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": d,
                "logprobs": None,
                "finish_reason": finish,
            }
            if self.kind == "sglang":
                choice["matched_stop"] = None
            emit([choice])

        delta({"role": "assistant", "content": ""})
        for piece in g.reasoning:
            delta({self._reasoning_key(): piece})
        for piece in g.content:
            delta({"content": piece})
        if g.tool is not None:
            delta({"tool_calls": self._tool_calls(g, streamed=True)})
        delta({"content": ""}, g.finish)
        if g.include_usage:
            emit([], self._usage(g))
        events.append(b"data: [DONE]\n\n")
        return events

    def _full(self, cid: str, g: Gen) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text or None}
        if g.reasoning:
            message[self._reasoning_key()] = g.reasoning_text
        message["tool_calls"] = self._tool_calls(g, streamed=False) if g.tool else []
        body: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion",
            "created": g.created,
            "model": g.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": g.finish}
            ],
        }
        if self.kind == "vllm":
            body["service_tier"] = None
            body["system_fingerprint"] = self.fingerprint
        body["usage"] = self._usage(g)
        if self.kind == "vllm":
            body.update(prompt_logprobs=None, prompt_token_ids=None, kv_transfer_params=None)
        else:
            body["metadata"] = {"weight_version": "default"}
        return body
