"""The fake OpenAI API's bodies: the Responses object and its events, the chat
completion and its chunks, the usage shapes and the ids, as OpenAI sends them.

The rules they follow are ``openai_api``'s docstring; this module only shapes what
the app decided (a ``CacheDecision``, a generation ``Gen``) into OpenAI's wire format.
"""

from __future__ import annotations

import base64
import hashlib
import random
from typing import Any

from llmp.apis.providers import openai_explicit
from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.model import Gen, alnum
from llmp.demo.fakes.openai_prompt import CachePlan, Settings, explicit_ttls
from llmp.demo.fakes.provider_cache import CacheDecision
from llmp.demo.fakes.shared_cache import compact

SYSTEM_FINGERPRINT = "fp_fake0openai"


def obfuscation(rng: random.Random, delta: str) -> str:
    """Stream obfuscation: random characters that pad a delta's length."""
    return alnum(rng, max(1, 16 - len(delta) % 16))


def user_item(item: dict[str, Any], n: int, ids: Ids) -> dict[str, Any]:
    """A user message as a full item (string content as one ``input_text`` part): the
    same text, so the same prompt, when a client sends it back."""
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    item_id = f"msg_{hashlib.sha256(f'{ids.response}:{n}'.encode()).hexdigest()[:48]}"
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": content,
    }


def ttl_details(d: CacheDecision) -> dict[str, int]:
    """``cache_write_tokens_details``: the written tokens by time-to-live."""
    return {f"ttl_{name}_tokens": d.written_by_ttl.get(name, 0) for name in explicit_ttls()}


class Ids:
    """One response's ids, from the request's index (deterministic)."""

    def __init__(self, ex: Exchange) -> None:
        rng = random.Random(f"openai:{ex.index}")
        self.rng = rng
        self.response = f"resp_{rng.getrandbits(192):048x}"
        self.message = f"msg_{rng.getrandbits(192):048x}"
        self.reasoning = f"rs_{rng.getrandbits(192):048x}"
        self.function = f"fc_{rng.getrandbits(192):048x}"
        self.call = "call_" + alnum(rng, 24)
        self.chat = "chatcmpl-" + alnum(rng, 29)
        self.request = f"req_{rng.getrandbits(128):032x}"


def chat_usage(d: CacheDecision, g: Gen, explicit: bool) -> dict[str, Any]:
    """Chat Completions' ``usage``; ``cache_write_tokens`` from GPT-5.6 on."""
    details: dict[str, Any] = {"cached_tokens": d.read, "audio_tokens": 0}
    if explicit:
        details["cache_write_tokens"] = d.written
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": g.predicted_n,
        "total_tokens": d.prompt_tokens + g.predicted_n,
        "prompt_tokens_details": details,
        "completion_tokens_details": {
            "reasoning_tokens": len(g.reasoning),
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def responses_usage(
    d: CacheDecision, output_tokens: int, reasoning_tokens: int, explicit: bool
) -> dict[str, Any]:
    """The Responses API's ``usage``; ``cache_write_tokens_details`` from GPT-5.6 on."""
    details: dict[str, Any] = {"cached_tokens": d.read, "cache_write_tokens": d.written}
    if explicit:
        details["cache_write_tokens_details"] = ttl_details(d)
    return {
        "input_tokens": d.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": d.prompt_tokens + output_tokens,
    }


class ResponseBuilder:
    """The Responses object and its event stream for one request."""

    def __init__(
        self,
        body: dict[str, Any],
        plan: CachePlan,
        settings: Settings,
        d: CacheDecision,
        g: Gen,
        ids: Ids,
    ) -> None:
        self.body, self.plan, self.settings, self.d, self.g, self.ids = (
            body,
            plan,
            settings,
            d,
            g,
            ids,
        )
        reasoning = body.get("reasoning")
        self.reasoning: dict[str, Any] = reasoning if isinstance(reasoning, dict) else {}
        include = body.get("include")
        self.encrypted = isinstance(include, list) and "reasoning.encrypted_content" in include
        self.summary = self.reasoning.get("summary") is not None
        opts = body.get("stream_options")
        self.obfuscate = not (isinstance(opts, dict) and opts.get("include_obfuscation") is False)
        self.incomplete = g.finish == "length"

    # items -----------------------------------------------------------------------

    def _reasoning_item(self, done: bool) -> dict[str, Any]:
        item: dict[str, Any] = {"id": self.ids.reasoning, "type": "reasoning", "summary": []}
        if done and self.summary:
            item["summary"] = [{"type": "summary_text", "text": self.g.reasoning_text}]
        if done and self.encrypted:
            digest = hashlib.sha256((self.ids.response + self.g.reasoning_text).encode()).digest()
            item["encrypted_content"] = "gAAAAA" + base64.b64encode(digest * 3).decode()
        return item

    def _text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def _message_item(self, done: bool) -> dict[str, Any]:
        status = ("incomplete" if self.incomplete else "completed") if done else "in_progress"
        content = [self._text_part(self.g.content_text)] if done else []
        return {
            "id": self.ids.message,
            "type": "message",
            "status": status,
            "content": content,
            "role": "assistant",
        }

    def _call_item(self, done: bool) -> dict[str, Any]:
        assert self.g.tool is not None
        return {
            "id": self.ids.function,
            "type": "function_call",
            "status": "completed" if done else "in_progress",
            "arguments": self.g.tool.arguments if done else "",
            "call_id": self.g.tool.id,
            "name": self.g.tool.name,
        }

    def output(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.g.reasoning:
            out.append(self._reasoning_item(done=True))
        if self.g.content:
            out.append(self._message_item(done=True))
        if self.g.tool is not None:
            out.append(self._call_item(done=True))
        return out

    # the response ----------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        g = self.g
        explicit = openai_explicit(self.settings.model)
        return responses_usage(self.d, g.predicted_n, len(g.reasoning), explicit)

    def response(self, final: bool) -> dict[str, Any]:
        """The response object: in progress (``final`` false) or finished."""
        b, g = self.body, self.g
        text = b.get("text") if isinstance(b.get("text"), dict) else {}
        assert isinstance(text, dict)
        status = "in_progress"
        if final:
            status = "incomplete" if self.incomplete else "completed"
        return {
            "id": self.ids.response,
            "object": "response",
            "created_at": g.created,
            "status": status,
            "background": False,
            "billing": {"payer": "developer"},
            "completed_at": g.created if final and not self.incomplete else None,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if final and self.incomplete else None
            ),
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": b.get("max_tool_calls"),
            "model": self.settings.model,
            "output": self.output() if final else [],
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": b.get("previous_response_id"),
            "prompt_cache_diagnostics": self.d.diagnosis if final else None,
            "prompt_cache_key": b.get("prompt_cache_key"),
            "prompt_cache_options": self.plan.options,
            "prompt_cache_retention": self.plan.retention,
            "reasoning": {
                "effort": self.settings.reasoning_effort,
                "summary": self.reasoning.get("summary"),
            },
            "safety_identifier": b.get("safety_identifier"),
            "service_tier": self.settings.service_tier,
            "store": b.get("store") is not False,
            "temperature": b.get("temperature", 1.0),
            "text": {
                "format": text.get("format") or {"type": "text"},
                "verbosity": self.settings.verbosity,
            },
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs", 0),
            "top_p": b.get("top_p", 1.0),
            "truncation": b.get("truncation", "disabled"),
            "usage": self.usage() if final else None,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }

    # the stream -----------------------------------------------------------------

    def events(self) -> list[bytes]:
        g, ids = self.g, self.ids
        events: list[bytes] = []
        rng = random.Random(ids.response)

        def emit(kind: str, **data: Any) -> None:
            obj = {"type": kind, "sequence_number": len(events), **data}
            events.append(b"event: " + kind.encode() + b"\ndata: " + compact(obj) + b"\n\n")

        def obf(delta: str) -> dict[str, str]:
            return {"obfuscation": obfuscation(rng, delta)} if self.obfuscate else {}

        emit("response.created", response=self.response(final=False))
        emit("response.in_progress", response=self.response(final=False))
        index = 0
        if g.reasoning:
            at = {"output_index": index}
            emit("response.output_item.added", **at, item=self._reasoning_item(done=False))
            if self.summary:
                part = {"type": "summary_text", "text": ""}
                where = {"item_id": ids.reasoning, **at, "summary_index": 0}
                emit("response.reasoning_summary_part.added", **where, part=part)
                for piece in g.reasoning:
                    emit(
                        "response.reasoning_summary_text.delta", **where, delta=piece, **obf(piece)
                    )
                text = g.reasoning_text
                emit("response.reasoning_summary_text.done", **where, text=text)
                done_part = {"type": "summary_text", "text": text}
                emit("response.reasoning_summary_part.done", **where, part=done_part)
            emit("response.output_item.done", **at, item=self._reasoning_item(done=True))
            index += 1
        if g.content:
            at = {"output_index": index}
            where = {"item_id": ids.message, **at, "content_index": 0}
            emit("response.output_item.added", **at, item=self._message_item(done=False))
            emit("response.content_part.added", **where, part=self._text_part(""))
            for piece in g.content:
                emit("response.output_text.delta", **where, delta=piece, logprobs=[], **obf(piece))
            text = g.content_text
            emit("response.output_text.done", **where, text=text, logprobs=[])
            emit("response.content_part.done", **where, part=self._text_part(text))
            emit("response.output_item.done", **at, item=self._message_item(done=True))
            index += 1
        if g.tool is not None:
            at = {"output_index": index}
            where = {"item_id": ids.function, **at}
            emit("response.output_item.added", **at, item=self._call_item(done=False))
            for frag in g.tool.fragments:
                emit("response.function_call_arguments.delta", **where, delta=frag, **obf(frag))
            emit("response.function_call_arguments.done", **where, arguments=g.tool.arguments)
            emit("response.output_item.done", **at, item=self._call_item(done=True))
        last = "response.incomplete" if self.incomplete else "response.completed"
        emit(last, response=self.response(final=True))
        return events


class ChatBuilder:
    """The chat completion and its chunks for one request."""

    def __init__(
        self, body: dict[str, Any], settings: Settings, d: CacheDecision, g: Gen, ids: Ids
    ) -> None:
        self.body, self.settings, self.d, self.g, self.ids = body, settings, d, g, ids
        opts = body.get("stream_options")
        self.include_usage = g.include_usage
        self.obfuscate = not (isinstance(opts, dict) and opts.get("include_obfuscation") is False)

    def usage(self) -> dict[str, Any]:
        return chat_usage(self.d, self.g, openai_explicit(self.settings.model))

    def _tool_call(self) -> dict[str, Any]:
        assert self.g.tool is not None
        fn = {"name": self.g.tool.name, "arguments": self.g.tool.arguments}
        return {"id": self.g.tool.id, "type": "function", "function": fn}

    def completion(self) -> dict[str, Any]:
        g = self.g
        message: dict[str, Any] = {
            "role": "assistant",
            "content": g.content_text or None,
            "refusal": None,
            "annotations": [],
        }
        if g.tool is not None:
            message["tool_calls"] = [self._tool_call()]
        return {
            "id": self.ids.chat,
            "object": "chat.completion",
            "created": g.created,
            "model": self.settings.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": g.finish}
            ],
            "usage": self.usage(),
            "service_tier": self.settings.service_tier,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def events(self) -> list[bytes]:
        g = self.g
        rng = random.Random(self.ids.chat)
        events: list[bytes] = []

        def emit(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk: dict[str, Any] = {
                "id": self.ids.chat,
                "object": "chat.completion.chunk",
                "created": g.created,
                "model": self.settings.model,
                "service_tier": self.settings.service_tier,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
            }
            if self.include_usage:
                chunk["usage"] = usage
            if self.obfuscate:
                delta = choices[0]["delta"] if choices else {}
                chunk["obfuscation"] = obfuscation(rng, compact(delta).decode())
            events.append(b"data: " + compact(chunk) + b"\n\n")

        def delta(d: dict[str, Any], finish: str | None = None) -> None:
            emit([{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}])

        delta({"role": "assistant", "content": "", "refusal": None})
        for piece in g.content:
            delta({"content": piece})
        if g.tool is not None:
            head = {**self._tool_call(), "index": 0}
            head["function"] = {"name": g.tool.name, "arguments": ""}
            delta({"tool_calls": [head]})
            for frag in g.tool.fragments:
                delta({"tool_calls": [{"index": 0, "function": {"arguments": frag}}]})
        delta({}, g.finish)
        if self.include_usage:
            emit([], self.usage())
        events.append(b"data: [DONE]\n\n")
        return events
