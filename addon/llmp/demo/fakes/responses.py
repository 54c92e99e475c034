"""llama-server's OpenAI Responses API: ``POST /v1/responses``.

What Codex talks to, per ``shared/spec/wire-formats.md`` ("llama-server
/v1/responses"). The request is rendered to chat messages for the one fake
model, so it shares the slot with the chat endpoint. Quirks kept:

- streamed as ``event: <name>\\ndata: <json>\\n\\n`` with no ``[DONE]``, after
  an optional keep-alive comment ``:\\n\\n``; the events carry no
  ``output_index``, ``content_index`` or ``sequence_number`` (the openai
  SDK's ``responses.stream()`` helper fails on them, ``create(stream=True)``
  reads them);
- the items are closed at the end, after all deltas; ``response.completed``
  carries the whole response, and ``timings`` **beside** ``response`` (on that
  last event only); not streamed, there are no ``timings`` at all;
- ``usage.input_tokens`` is the whole prompt, ``input_tokens_details.cached_tokens``
  the reused part; the status is ``completed`` even when ``max_output_tokens``
  cut the output;
- a tool call is a ``function_call`` item without ``id``, its ``call_id``
  ``fc_`` + the chat tool-call id, its arguments streamed as
  ``response.function_call_arguments.delta``; reasoning is a ``reasoning``
  item streamed as ``response.reasoning_text.delta``.

``previous_response_id``: responses are kept (unless ``store`` is false), so
a request may continue one; an unknown id is answered 400 with llama-server's
error JSON. Unverified: the mid-stream error event (``event: error`` with
``{"type": "error", "error": {…}}``). ``old_build``: no
``input_tokens_details`` and no ``timings``.
"""

from __future__ import annotations

import random
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.llama import Llama, llama_error, midstream_error, sse, wants_pings
from llmp.demo.fakes.model import Gen, alnum, timings
from llmp.demo.fakes.modes import PING
from llmp.demo.fakes.raw import Handler
from llmp.demo.fakes.responder import Responder

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(value: Any) -> str:
    """A string, or the text of a list's text parts, joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            p["text"]
            for p in value
            if isinstance(p, dict)
            and p.get("type") in _TEXT_PARTS
            and isinstance(p.get("text"), str)
        )
    return ""


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; items in order.

    A ``function_call`` joins the assistant message before it (or starts one);
    ``function_call_output`` is a tool message; ``reasoning`` is not part of
    the fake's prompt, as a chat template drops past reasoning.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if "role" in item and kind in (None, "message"):
            out.append({"role": item["role"], "content": _text(item.get("content"))})
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            if out and out[-1].get("role") == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    return out


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-shaped request the fake model sees: instructions, history, then ``input``."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    messages += history + input_messages(body.get("input"))
    tools: list[dict[str, Any]] = []
    for t in body.get("tools") or []:
        if isinstance(t, dict) and isinstance(t.get("name"), str):
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            tools.append({"type": "function", "function": fn})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if tools:
        chat["tools"] = tools
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


class _Ids:
    """The ids of one response: the response, its message item, its reasoning item."""

    def __init__(self, ex: Exchange) -> None:
        rng = random.Random(f"resp:{ex.index}")
        self.response = "resp_" + alnum(rng, 32)
        self.message = "msg_" + alnum(rng, 32)
        self.reasoning = "rs_" + alnum(rng, 32)


class OpenAIResponses:
    """The Responses endpoint of a ``Llama`` app, with its stored responses."""

    def __init__(self, app: Llama) -> None:
        self.app = app
        #: response id -> the conversation so far (without instructions), as chat messages
        self.stored: dict[str, list[dict[str, Any]]] = {}

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("POST", "/v1/responses"): self._responses}

    async def _responses(self, resp: Responder) -> None:
        app, ex = self.app, resp.ex
        body = app.parse_json_body(ex)
        if body is None:
            await app.error(resp, "", 400, "Failed to parse the request body")
            return
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in self.stored:
                await app.json(resp, 400, llama_error(400, f"response not found: {previous}"))
                return
            history = self.stored[previous]
        chat = to_chat(body, history)
        if await app.refuse(resp, chat):
            return
        g = app.model.plan(ex, chat, "responses")
        ids = _Ids(ex)
        if body.get("store") is not False:
            self._store(ids.response, history + input_messages(body.get("input")), g)
        if body.get("stream") is True:
            error = {"type": "error", **midstream_error()}
            await app.stream(
                resp, "text/event-stream", self._events(ex, g, ids), sse("error", error)
            )
        else:
            await app.json(resp, 200, self._full(ex, g, ids))

    def _store(self, response_id: str, messages: list[dict[str, Any]], g: Gen) -> None:
        reply: dict[str, Any] = {"role": "assistant", "content": g.content_text}
        if g.tool is not None:
            function = {"name": g.tool.name, "arguments": g.tool.arguments}
            reply["tool_calls"] = [
                {"id": "fc_" + g.tool.id, "type": "function", "function": function}
            ]
        self.stored[response_id] = [*messages, reply]

    # items ---------------------------------------------------------------------

    def _usage(self, ex: Exchange, g: Gen) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "input_tokens": g.prompt_tokens,
            "output_tokens": g.predicted_n,
            "total_tokens": g.prompt_tokens + g.predicted_n,
        }
        if "old_build" not in ex.modes:
            usage["input_tokens_details"] = {"cached_tokens": g.cache_n}
        return usage

    @staticmethod
    def _reasoning_item(g: Gen, ids: _Ids) -> dict[str, Any]:
        return {
            "id": ids.reasoning,
            "summary": [],
            "type": "reasoning",
            "content": [{"text": g.reasoning_text, "type": "reasoning_text"}],
            "encrypted_content": "",
        }

    @staticmethod
    def _text_part(g: Gen) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": g.content_text}

    @staticmethod
    def _call_item(g: Gen, done: bool) -> dict[str, Any]:
        """The ``function_call`` item: added (no arguments yet) or done (keys in that order)."""
        assert g.tool is not None
        call_id = "fc_" + g.tool.id
        if not done:
            return {
                "arguments": "",
                "call_id": call_id,
                "name": g.tool.name,
                "type": "function_call",
                "status": "in_progress",
            }
        return {
            "type": "function_call",
            "status": "completed",
            "arguments": g.tool.arguments,
            "call_id": call_id,
            "name": g.tool.name,
        }

    # streamed ------------------------------------------------------------------

    def _events(self, ex: Exchange, g: Gen, ids: _Ids) -> list[bytes]:
        events: list[bytes] = []

        def emit(kind: str, **data: Any) -> None:
            events.append(sse(kind, {"type": kind, **data}))

        if wants_pings(ex):
            events.append(PING)
        head = {"id": ids.response, "object": "response", "status": "in_progress"}
        emit("response.created", response=head)
        emit("response.in_progress", response=dict(head))
        if g.reasoning:
            item = {**self._reasoning_item(g, ids), "content": [], "status": "in_progress"}
            emit("response.output_item.added", item=item)
            for piece in g.reasoning:
                emit("response.reasoning_text.delta", delta=piece, item_id=ids.reasoning)
        if g.content:
            item = {
                "content": [],
                "id": ids.message,
                "role": "assistant",
                "status": "in_progress",
                "type": "message",
            }
            emit("response.output_item.added", item=item)
            part = {"type": "output_text", "text": ""}
            emit("response.content_part.added", item_id=ids.message, part=part)
            for piece in g.content:
                emit("response.output_text.delta", item_id=ids.message, delta=piece)
        if g.tool is not None:
            emit("response.output_item.added", item=self._call_item(g, done=False))
            for frag in g.tool.fragments:
                emit(
                    "response.function_call_arguments.delta", delta=frag, item_id="fc_" + g.tool.id
                )
        output: list[dict[str, Any]] = []
        if g.reasoning:
            output.append(self._reasoning_item(g, ids))
            emit("response.output_item.done", item=output[-1])
        if g.content:
            emit("response.output_text.done", item_id=ids.message, text=g.content_text)
            emit("response.content_part.done", item_id=ids.message, part=self._text_part(g))
            item = {
                "type": "message",
                "status": "completed",
                "id": ids.message,
                "content": [self._text_part(g)],
                "role": "assistant",
            }
            output.append(item)
            emit("response.output_item.done", item=item)
        if g.tool is not None:
            output.append(self._call_item(g, done=True))
            emit("response.output_item.done", item=output[-1])
        response = {
            "id": ids.response,
            "object": "response",
            "created_at": g.created,
            "status": "completed",
            "model": self.app.model_file,
            "output": output,
            "usage": self._usage(ex, g),
        }
        if "old_build" in ex.modes:
            emit("response.completed", response=response)
        else:
            emit("response.completed", response=response, timings=timings(g))
        return events

    # not streamed ----------------------------------------------------------------

    def _full(self, ex: Exchange, g: Gen, ids: _Ids) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        if g.reasoning:
            output.append({**self._reasoning_item(g, ids), "status": "completed"})
        if g.content:
            output.append(
                {
                    "content": [self._text_part(g)],
                    "id": ids.message,
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            )
        if g.tool is not None:
            output.append(self._call_item(g, done=True))
        return {
            "completed_at": g.created,
            "created_at": g.created,
            "id": ids.response,
            "model": self.app.model_file,
            "object": "response",
            "output": output,
            "status": "completed",
            "usage": self._usage(ex, g),
        }
