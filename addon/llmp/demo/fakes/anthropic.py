"""llama-server's Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

What Claude Code talks to, per ``shared/spec/wire-formats.md`` ("llama-server
/v1/messages"). The request is rendered to chat messages for the one fake
model, so it shares the slot with the chat endpoint. Quirks kept:

- streamed as ``event: <name>\\ndata: <json>\\n\\n``, after an optional
  keep-alive comment ``:\\n\\n`` (during the prefill), with no ``[DONE]``;
- the id is the chat id (``chatcmpl-…``) and the model is the model file;
- ``usage.input_tokens`` is the evaluated part only, beside
  ``cache_read_input_tokens``; no ``timings``, streamed or not;
- every content block is closed at the end, after all deltas (a thinking
  block stays open while the text streams), the thinking block with an empty
  ``signature_delta`` first; a ``tool_use`` block starts without ``input``;
- errors before the stream are the chat endpoint's JSON (HTTP 400
  ``exceed_context_size_error``).

Unverified: the mid-stream error event (``event: error`` with
``{"type": "error", "error": {…}}``, llama-server's error object inside).
``old_build`` gives an older build's usage: ``input_tokens`` is the whole
prompt and there is no ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.llama import Llama, midstream_error, sse, wants_pings
from llmp.demo.fakes.model import TOOL_ARGS, Gen, count_tokens, prompt_text
from llmp.demo.fakes.modes import PING
from llmp.demo.fakes.raw import Handler
from llmp.demo.fakes.responder import Responder

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def _text(value: Any) -> str:
    """A string, or the ``text`` of the text blocks of a list, joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            b["text"]
            for b in value
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return ""


def _message(role: Any, content: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its tool results, then its text and tool calls."""
    if not isinstance(content, list):
        return [{"role": role, "content": _text(content)}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            arguments = json.dumps(
                block.get("input", {}), ensure_ascii=False, separators=(",", ":")
            )
            function = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result":
            result = _text(block.get("content"))
            out.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
            )
        # thinking, images and documents are not part of the fake's prompt
    if text or calls or not out:
        message: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-shaped request the fake model sees; ``cache_control`` does not reach it.

    ``system`` gives one system message per text block (a string counts as
    one block), then each entry of ``messages`` with its role as sent.
    """
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        for block in system:
            messages.append({"role": "system", "content": _text([block])})
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            messages.extend(_message(m.get("role"), m.get("content")))
    tools: list[dict[str, Any]] = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            fn = {k: t[k] for k in ("name", "description") if k in t}
            if "input_schema" in t:
                fn["parameters"] = t["input_schema"]
            tools.append({"type": "function", "function": fn})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if tools:
        chat["tools"] = tools
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    return chat


class AnthropicMessages:
    """The Anthropic endpoints of a ``Llama`` app."""

    def __init__(self, app: Llama) -> None:
        self.app = app

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/messages"): self._messages,
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
        }

    async def _parse(self, resp: Responder) -> dict[str, Any] | None:
        body = self.app.parse_json_body(resp.ex)
        if body is None:
            await self.app.error(resp, "", 400, "Failed to parse the request body")
        return body

    async def _count_tokens(self, resp: Responder) -> None:
        """The prompt's size, without generating (and without touching the slot)."""
        body = await self._parse(resp)
        if body is not None:
            total = count_tokens(prompt_text(to_chat(body)))
            await self.app.json(resp, 200, {"input_tokens": total})

    async def _messages(self, resp: Responder) -> None:
        app, ex = self.app, resp.ex
        body = await self._parse(resp)
        if body is None:
            return
        chat = to_chat(body)
        if await app.refuse(resp, chat):
            return
        g = app.model.plan(ex, chat, "anthropic")
        if body.get("stream") is True:
            error = {"type": "error", **midstream_error()}
            await app.stream(resp, "text/event-stream", self._events(ex, g), sse("error", error))
        else:
            await app.json(resp, 200, self._full(ex, g))

    def _usage(self, ex: Exchange, g: Gen, output_tokens: int) -> dict[str, Any]:
        if "old_build" in ex.modes:
            return {"input_tokens": g.prompt_tokens, "output_tokens": output_tokens}
        return {
            "cache_read_input_tokens": g.cache_n,
            "input_tokens": g.prompt_n,
            "output_tokens": output_tokens,
        }

    def _message(self, ex: Exchange, g: Gen, content: list[Any], stop: str | None) -> Any:
        return {
            "id": self.app.cmpl_id(ex),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.app.model_file,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": self._usage(ex, g, 0 if stop is None else g.predicted_n),
        }

    def _events(self, ex: Exchange, g: Gen) -> list[bytes]:
        events: list[bytes] = []
        if wants_pings(ex):
            events.append(PING)
        message = self._message(ex, g, [], None)
        events.append(sse("message_start", {"type": "message_start", "message": message}))
        index = 0
        opened: list[int] = []

        def block(start: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
            nonlocal index
            data = {"type": "content_block_start", "index": index, "content_block": start}
            events.append(sse("content_block_start", data))
            for delta in deltas:
                data = {"type": "content_block_delta", "index": index, "delta": delta}
                events.append(sse("content_block_delta", data))
            opened.append(index)
            index += 1

        if g.reasoning:
            deltas = [{"type": "thinking_delta", "thinking": p} for p in g.reasoning]
            block({"type": "thinking", "thinking": ""}, deltas)
        if g.content:
            block(
                {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in g.content]
            )
        if g.tool is not None:
            start = {"type": "tool_use", "id": g.tool.id, "name": g.tool.name}
            deltas = [{"type": "input_json_delta", "partial_json": f} for f in g.tool.fragments]
            block(start, deltas)
        for i in opened:
            if i == 0 and g.reasoning:
                signature = {"type": "signature_delta", "signature": ""}
                data = {"type": "content_block_delta", "index": 0, "delta": signature}
                events.append(sse("content_block_delta", data))
            events.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        stop = {"stop_reason": STOP_REASONS[g.finish], "stop_sequence": None}
        usage = {"output_tokens": g.predicted_n}
        events.append(
            sse("message_delta", {"type": "message_delta", "delta": stop, "usage": usage})
        )
        events.append(sse("message_stop", {"type": "message_stop"}))
        return events

    def _full(self, ex: Exchange, g: Gen) -> Any:
        content: list[dict[str, Any]] = []
        if g.reasoning:
            content.append({"type": "thinking", "thinking": g.reasoning_text, "signature": ""})
        if g.content:
            content.append({"type": "text", "text": g.content_text})
        if g.tool is not None:
            tool = {"type": "tool_use", "id": g.tool.id, "name": g.tool.name, "input": TOOL_ARGS}
            content.append(tool)
        return self._message(ex, g, content, STOP_REASONS[g.finish])
