"""A fake Ollama: ``/api/chat`` (NDJSON), ``/api/tags``, ``/api/version``, ``/``, ``/v1/models``.

Go's JSON encoder and Ollama's counters (integer nanoseconds, zeros left out)
per ``shared/spec/wire-formats.md``. Its OpenAI-style ``/v1/chat/completions``
is in ``ollama_openai.py``.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.model import (
    PREDICTED_MS_PER_TOKEN,
    PROMPT_MS_PER_TOKEN,
    TOOL_ARGS,
    FakeModel,
    Gen,
)
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE
from llmp.demo.fakes.raw import App
from llmp.demo.fakes.responder import Responder

OLLAMA_VERSION = "0.34.0"
OLLAMA_LOAD_NS = 2_345_678

_GO_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_GO_ESCAPE_RE = re.compile("[<>&\u2028\u2029]")


def go_dumps(obj: Any) -> bytes:
    """Go's json.Marshal: compact, raw UTF-8, HTML characters escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return _GO_ESCAPE_RE.sub(lambda m: _GO_ESCAPES[m.group(0)], text).encode()


def go_time(t_ns: int | None = None) -> str:
    """Go's RFC3339Nano in UTC: trailing zeros of the fraction dropped."""
    t_ns = time.time_ns() if t_ns is None else t_ns
    secs, ns = divmod(t_ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    frac = f"{ns:09d}".rstrip("0")
    return f"{base}.{frac}Z" if frac else f"{base}Z"


_TAGS: dict[str, Any] = {
    "models": [
        {
            "name": "qwen3:latest",
            "model": "qwen3:latest",
            "modified_at": "2026-08-01T10:00:00.123456789Z",
            "size": 5_200_000_000,
            "digest": "500a1f067a9f782620b40bee6f7b0c89e17ae61f686b92c24933e4ca4b2b8b41",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "qwen3",
                "families": ["qwen3"],
                "parameter_size": "8.2B",
                "quantization_level": "Q4_K_M",
            },
        }
    ]
}


class Ollama(App):
    """Ollama serving one model (``model``), named by the request."""

    def __init__(self, model: FakeModel) -> None:
        super().__init__()
        self.model = model
        self.add_routes(
            {
                ("POST", "/api/chat"): self._chat,
                ("GET", "/"): self._root,
                ("HEAD", "/"): self._root,
                ("GET", "/api/version"): self._version,
                ("GET", "/api/tags"): self._tags,
                ("GET", "/v1/models"): self._v1_models,
            }
        )

    # flavour hooks ---------------------------------------------------------

    def base_headers(self) -> list[tuple[str, str]]:
        return [("Date", email.utils.formatdate(usegmt=True))]

    def dumps(self, obj: Any) -> bytes:
        return go_dumps(obj)

    async def error(self, resp: Responder, path: str, status: int, message: str) -> None:
        """``{"error": "…"}`` natively; the OpenAI error shape under ``/v1/``."""
        obj: Any
        if path.startswith("/v1/"):
            etype = "invalid_request_error" if status < 500 else "api_error"
            obj = {"error": {"message": message, "type": etype, "param": None, "code": None}}
        else:
            obj = {"error": message}
        await self.json(resp, status, obj)

    async def not_found(self, resp: Responder, path: str) -> None:
        """Go's default 404: plain text, not JSON."""
        await resp.body(404, self.headers(resp.ex, "text/plain"), b"404 page not found")

    # /api/chat -------------------------------------------------------------

    async def _chat(self, resp: Responder) -> None:
        ex = resp.ex
        path = "/api/chat"
        body = self.parse_json_body(ex)
        if body is None:
            await self.error(resp, path, 400, "invalid JSON in request body")
            return
        if self.model.too_long(ex, body) is not None:
            await self.error(resp, path, 400, "the input length exceeds the context length")
            return
        g = self.model.plan(ex, body, "ollama")
        if body.get("stream", True) is not False:
            error_line = go_dumps({"error": MIDSTREAM_ERROR_MESSAGE}) + b"\n"
            await self.stream(resp, "application/x-ndjson", self._lines(ex, g), error_line)
        else:
            await self.json(resp, 200, self._full(ex, g))

    def _counters(self, ex: Exchange, g: Gen) -> dict[str, Any]:
        old = "old_build" in ex.modes
        prompt_ns = round(g.prompt_n * PROMPT_MS_PER_TOKEN * 1_000_000)
        eval_ns = round(g.predicted_n * PREDICTED_MS_PER_TOKEN * 1_000_000)
        counters: dict[str, Any] = {
            "total_duration": OLLAMA_LOAD_NS + prompt_ns + eval_ns + 1_000_000,
            "load_duration": OLLAMA_LOAD_NS,
        }
        if old:
            counters["prompt_eval_count"] = g.prompt_n
        else:
            counters["prompt_eval_count"] = g.prompt_tokens
            counters["prompt_eval_cached_count"] = g.cache_n
        counters["prompt_eval_duration"] = prompt_ns
        counters["eval_count"] = g.predicted_n
        counters["eval_duration"] = eval_ns
        return {k: v for k, v in counters.items() if v or k == "prompt_eval_cached_count"}

    def _tool_calls(self, g: Gen) -> list[dict[str, Any]]:
        assert g.tool is not None
        return [
            {
                "id": g.tool.id,
                "function": {"index": 0, "name": g.tool.name, "arguments": dict(TOOL_ARGS)},
            }
        ]

    def _lines(self, ex: Exchange, g: Gen) -> list[bytes]:
        lines: list[bytes] = []

        def line(message: dict[str, Any]) -> None:
            obj = {"model": g.model, "created_at": go_time(), "message": message, "done": False}
            lines.append(go_dumps(obj) + b"\n")

        for piece in g.reasoning:
            line({"role": "assistant", "content": "", "thinking": piece})
        for piece in g.content:
            line({"role": "assistant", "content": piece})
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        lines.append(go_dumps(self._done(ex, g, message)) + b"\n")
        return lines

    def _full(self, ex: Exchange, g: Gen) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["thinking"] = g.reasoning_text
        return self._done(ex, g, message)

    def _done(self, ex: Exchange, g: Gen, message: dict[str, Any]) -> dict[str, Any]:
        """The final object (`done: true`): the message, with any tool calls, and the counters."""
        if g.tool is not None:
            message["tool_calls"] = self._tool_calls(g)
        obj: dict[str, Any] = {
            "model": g.model,
            "created_at": go_time(),
            "message": message,
            "done_reason": "length" if g.finish == "length" else "stop",
            "done": True,
        }
        obj.update(self._counters(ex, g))
        return obj

    # side endpoints ------------------------------------------------------------

    async def _root(self, resp: Responder) -> None:
        headers = self.headers(resp.ex, "text/plain; charset=utf-8")
        await resp.body(200, headers, b"Ollama is running")

    async def _version(self, resp: Responder) -> None:
        await self.json(resp, 200, {"version": OLLAMA_VERSION})

    async def _tags(self, resp: Responder) -> None:
        await self.json(resp, 200, _TAGS)

    async def _v1_models(self, resp: Responder) -> None:
        data = [
            {
                "id": "qwen3:latest",
                "object": "model",
                "created": 1750000000,
                "owned_by": "library",
            }
        ]
        await self.json(resp, 200, {"object": "list", "data": data})
