"""Ollama's OpenAI-style ``/v1/chat/completions``: its own dialect of the chat stream.

Unlike llama-server: reasoning in ``delta.reasoning``, each tool call whole in
one chunk, ids ``chatcmpl-<n>``, ``system_fingerprint: "fp_ollama"``, usage only
with ``include_usage`` and without a cached count, no ``timings``.
"""

from __future__ import annotations

import random
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.model import Gen
from llmp.demo.fakes.modes import MIDSTREAM_ERROR_MESSAGE
from llmp.demo.fakes.ollama import Ollama, go_dumps
from llmp.demo.fakes.raw import Handler
from llmp.demo.fakes.responder import Responder

PATH = "/v1/chat/completions"


class OllamaOpenAI:
    """The ``/v1/chat/completions`` endpoint of an ``Ollama`` app."""

    def __init__(self, app: Ollama) -> None:
        self.app = app

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("POST", PATH): self._chat}

    async def _chat(self, resp: Responder) -> None:
        app, ex = self.app, resp.ex
        body = app.parse_json_body(ex)
        if body is None:
            await app.error(resp, PATH, 400, "invalid JSON in request body")
            return
        if app.model.too_long(ex, body) is not None:
            await app.error(resp, PATH, 400, "the input length exceeds the context length")
            return
        g = app.model.plan(ex, body, "ollama_v1")
        if body.get("stream") is True:
            err = {
                "error": {
                    "message": MIDSTREAM_ERROR_MESSAGE,
                    "type": "api_error",
                    "param": None,
                    "code": None,
                }
            }
            error_event = b"data: " + go_dumps(err) + b"\n\n"
            await app.stream(resp, "text/event-stream", self._events(ex, g), error_event)
        else:
            await app.json(resp, 200, self._full(ex, g))

    def _id(self, ex: Exchange) -> str:
        return f"chatcmpl-{random.Random(f'v1:{ex.index}').randint(1, 999)}"

    def _chunk(self, ex: Exchange, g: Gen, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id(ex),
            "object": "chat.completion.chunk",
            "created": g.created,
            "model": g.model,
            "system_fingerprint": "fp_ollama",
            "choices": choices,
        }

    def _usage(self, g: Gen) -> dict[str, Any]:
        return {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.predicted_n,
            "total_tokens": g.prompt_tokens + g.predicted_n,
        }

    def _tool_calls(self, g: Gen) -> list[dict[str, Any]]:
        assert g.tool is not None
        return [
            {
                "id": g.tool.id,
                "index": 0,
                "type": "function",
                "function": {"name": g.tool.name, "arguments": g.tool.arguments},
            }
        ]

    def _events(self, ex: Exchange, g: Gen) -> list[bytes]:
        events: list[bytes] = []

        def emit(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            events.append(b"data: " + go_dumps(self._chunk(ex, g, [choice])) + b"\n\n")

        for piece in g.reasoning:
            emit({"role": "assistant", "content": "", "reasoning": piece})
        for piece in g.content:
            emit({"role": "assistant", "content": piece})
        if g.tool is not None:
            emit({"role": "assistant", "content": "", "tool_calls": self._tool_calls(g)})
        emit({"role": "assistant", "content": ""}, g.finish)
        if g.include_usage:
            chunk = self._chunk(ex, g, [])
            chunk["usage"] = self._usage(g)
            events.append(b"data: " + go_dumps(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    def _full(self, ex: Exchange, g: Gen) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.reasoning:
            message["reasoning"] = g.reasoning_text
        if g.tool is not None:
            message["tool_calls"] = self._tool_calls(g)
        return {
            "id": self._id(ex),
            "object": "chat.completion",
            "created": g.created,
            "model": g.model,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "message": message, "finish_reason": g.finish}],
            "usage": self._usage(g),
        }
