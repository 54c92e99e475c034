"""Ollama's native chat API: `POST /api/chat`, streamed as NDJSON (R6, R10).

Its messages have the OpenAI shape (with `tool_name` for a tool's name), so
the request digest is `OpenAIChat`'s; the stream, the reply and the counters
(nanosecond durations, and `prompt_eval_count`'s two meanings) are its own.
"""

from __future__ import annotations

from typing import Any

from llmp.apis.base import (
    CountHints,
    Counts,
    Marks,
    last_non_null,
    nonneg_int,
    nonneg_number,
)
from llmp.apis.openai_chat import OpenAIChat
from llmp.format.measure import ESTIMATE, MV, SERVER, weakest
from llmp.format.schema import CacheDigest

__all__ = ["NDJSONMerger", "OllamaChat", "ollama_counts"]


class OllamaChat(OpenAIChat):
    """`POST /api/chat`: streams by default."""

    name = "ollama_chat"
    stream = "ndjson"
    stream_default = True
    stream_usage_asked = False  # its last line always carries the counts

    def matches(self, method: str, path: str) -> bool:
        return path == "/api/chat"

    def cache_digest(
        self, body: dict[str, Any], marks: list[Marks], tool_breaks: list[tuple[int, Any]]
    ) -> CacheDigest | None:
        """No provider's cache behind `/api/chat`: R35's `cache` is null."""
        return None

    def merger(self) -> NDJSONMerger:  # type: ignore[override]
        return NDJSONMerger()

    def counts(self, usage: dict[str, Any], hints: CountHints) -> Counts:
        return ollama_counts(usage, hints)

    def context_limit(self, body: Any) -> int | None:
        """`options.num_ctx` of a full request body (digests do not keep options)."""
        if not isinstance(body, dict):
            return None
        options = body.get("options")
        n = options.get("num_ctx") if isinstance(options, dict) else None
        return n if type(n) is int and n > 0 else None


def _srv(value: float | None) -> MV | None:
    return None if value is None else (value, SERVER)


def ollama_counts(top: dict[str, Any], hints: CountHints) -> Counts:
    """Ollama's /api/chat: ns durations, and prompt_eval_count's two meanings.

    `known_old` says an earlier response of the same model in this session
    already proved the old meaning (a count far below the prompt).
    """
    estimated_prompt, evaluated_share, known_old = (
        hints.estimated_prompt,
        hints.evaluated_share,
        hints.known_old,
    )
    c = Counts()
    done = top.get("done") is True

    def count(key: str) -> int | None:
        value = nonneg_int(top.get(key))
        if value is None and done and top.get(key) is None:
            return 0  # the final object leaves a counter out when it is 0
        return value

    def ms(key: str) -> MV | None:
        raw = top.get(key)
        value = nonneg_number(raw)
        if value is None:
            return (0.0, SERVER) if done and raw is None else None
        return (value / 1e6, SERVER)

    c.prefill_ms = ms("prompt_eval_duration")
    c.decode_ms = ms("eval_duration")
    c.load_ms = ms("load_duration")
    c.completion_tokens = _srv(count("eval_count"))

    pec = nonneg_int(top.get("prompt_eval_count"))
    cached = nonneg_int(top.get("prompt_eval_cached_count"))
    est, est_src = estimated_prompt
    if cached is not None:
        if pec is None:
            pec = 0
        c.meaning = "cached"
        if pec >= cached:  # 0.34 on: the count is the whole prompt
            c.prompt_tokens = _srv(pec)
            c.reused_tokens = _srv(cached)
            c.evaluated_tokens = _srv(pec - cached)
        else:  # the count can only be the evaluated part
            c.prompt_tokens = _srv(pec + cached)
            c.reused_tokens = _srv(cached)
            c.evaluated_tokens = _srv(pec)
    elif pec is None:
        if done and top.get("prompt_eval_count") is None:
            # Only old builds leave it out, and only when all of it was cached.
            src = weakest(est_src, ESTIMATE)
            c.meaning = "old"
            c.evaluated_tokens = (0, SERVER)
            c.prompt_tokens = (est, src)
            c.reused_tokens = (est, src)
    elif est > 0 and (known_old or pec < evaluated_share * est):
        # Old meaning: only the evaluated part was counted.
        src = weakest(est_src, ESTIMATE)
        c.meaning = "old"
        c.evaluated_tokens = (pec, SERVER)
        c.prompt_tokens = (max(est, pec), src)
        c.reused_tokens = (max(0, est - pec), src)
    else:
        c.meaning = "whole"
        c.prompt_tokens = _srv(pec)
    return c


# -- the stream merge (R10) --------------------------------------------------------


class NDJSONMerger:
    """R10: merge Ollama ``/api/chat`` lines into the non-streamed response.

    - Start from the last ``done: true`` line, or from the last line when there
      is none (a mid-stream error or a reset).
    - ``message``: ``content`` and ``thinking`` are concatenated over all lines
      (``thinking`` only when some line had it); ``tool_calls`` is every call
      seen, in order, only when there were any; other message keys (``role``,
      ...) last-non-null.  Present whenever some line had a ``message`` object.
    - The last non-null ``error`` sent is kept, even when the base is the done
      line.
    - ``/api/generate`` streams are merged the same way: top-level ``response``
      and ``thinking`` strings are concatenated.
    """

    __slots__ = (
        "_content",
        "_content_seen",
        "_done",
        "_error",
        "_last",
        "_msg",
        "_msg_seen",
        "_thinking",
        "_thinking_seen",
        "_tools",
        "_top_text",
        "ended",
    )

    def __init__(self) -> None:
        self.ended = False  # a `"done": true` line came (R29)
        self._done: dict[str, Any] | None = None
        self._last: dict[str, Any] | None = None
        self._msg: dict[Any, Any] = {}  # first-seen key order, last non-null value
        self._msg_seen = False
        self._content: list[str] = []
        self._content_seen = False
        self._thinking: list[str] = []
        self._thinking_seen = False
        self._tools: list[Any] = []
        self._error: Any = None
        self._top_text: dict[str, list[str]] = {}  # /api/generate "response", "thinking"

    def add(self, obj: dict[str, Any]) -> None:
        """Fold one parsed line into the merge; non-objects are ignored."""
        if not isinstance(obj, dict):
            return
        self._last = obj
        if obj.get("done") is True:
            self._done = obj
            self.ended = True
        error = obj.get("error")
        if error is not None:
            self._error = error
        for key in ("response", "thinking"):
            part = obj.get(key)
            if isinstance(part, str):
                self._top_text.setdefault(key, []).append(part)
        msg = obj.get("message")
        if not isinstance(msg, dict):
            return
        self._msg_seen = True
        for key, value in msg.items():
            last_non_null(self._msg, key, value)
        content = msg.get("content")
        if isinstance(content, str):
            self._content.append(content)
            self._content_seen = True
        thinking = msg.get("thinking")
        if isinstance(thinking, str):
            self._thinking.append(thinking)
            self._thinking_seen = True
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            self._tools.extend(calls)

    def result(self) -> dict[str, Any] | None:
        """The merged response, or None if no line was added."""
        base = self._done if self._done is not None else self._last
        if base is None:
            return None
        out: dict[Any, Any] = dict(base)
        for key, parts in self._top_text.items():
            out[key] = "".join(parts)
        if self._msg_seen:
            msg: dict[Any, Any] = {}
            for key, value in self._msg.items():
                if key == "content":
                    msg[key] = "".join(self._content) if self._content_seen else value
                elif key == "thinking":
                    if self._thinking_seen:
                        msg[key] = "".join(self._thinking)
                elif key == "tool_calls":
                    if self._tools:
                        msg[key] = list(self._tools)
                else:
                    msg[key] = value
            out["message"] = msg
        if self._error is not None:
            out["error"] = self._error
        return out
