"""Merge a streamed chat response into the shape of the non-streamed one.

The recording stores a streamed body as one object that looks like the
response the server would have sent with ``"stream": false`` (R9 for SSE,
R10 for Ollama's NDJSON), so the analyzer reads both the same way.
``StreamCapture`` ties a parser, a merger, the chunk counters and the
recording limit (R12) together.

Everything here is pure (no mitmproxy) and defensive: events come from the
network, so any field can have any type, and a surprise must cost at most
that field, never the capture.
"""

from __future__ import annotations

from typing import Any, Final

from llmp.apis.ndjson import NDJSONParser
from llmp.apis.sse import SSEParser
from llmp.format import canonical

__all__ = ["NDJSONMerger", "SSEMerger", "StreamCapture", "sniff_stream"]


class _Missing:
    """Marker for "this key was never sent" (distinct from a sent ``null``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


_MISSING: Final = _Missing()

# Keys of a delta that are merged specially; the rest are last-non-null.
_REASONING_KEYS = ("reasoning_content", "reasoning")
_DELTA_SPECIAL = frozenset({"role", "content", "tool_calls", *_REASONING_KEYS})
_CHOICE_SPECIAL = frozenset({"index", "delta", "message", "finish_reason", "text", "logprobs"})
_TOOL_SPECIAL = frozenset({"index", "id", "type", "function"})
_FUNCTION_SPECIAL = frozenset({"name", "arguments"})


def _index(value: Any, pos: int) -> int:
    """An ``index`` field, or ``pos`` (position in its list) when it is not an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return pos


def _first_non_empty(cur: Any, new: Any) -> Any:
    """The first value that is neither null nor ``""``; else the first one sent."""
    if cur is _MISSING:
        return new
    if new is None or (isinstance(new, str) and not new):
        return cur
    if cur is None or (isinstance(cur, str) and not cur):
        return new
    return cur


def _last_non_null(store: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` unless it is null and something was already kept."""
    if value is not None or key not in store:
        store[key] = value


# --------------------------------------------------------------------------- SSE


class _ToolCall:
    """One tool call being assembled from its fragments (merged by ``index``)."""

    __slots__ = ("args", "args_other", "extra", "fn_extra", "id", "name", "type")

    def __init__(self) -> None:
        self.id: Any = _MISSING
        self.type: Any = _MISSING
        self.name: Any = _MISSING
        self.args: list[str] = []
        self.args_other: Any = _MISSING  # non-string arguments, if a server sends objects
        self.extra: dict[Any, Any] = {}
        self.fn_extra: dict[Any, Any] = {}

    def add(self, frag: dict[Any, Any]) -> None:
        if "id" in frag:
            self.id = _first_non_empty(self.id, frag["id"])
        if "type" in frag:
            self.type = _first_non_empty(self.type, frag["type"])
        for key, value in frag.items():
            if key not in _TOOL_SPECIAL:
                _last_non_null(self.extra, key, value)
        fn = frag.get("function")
        if not isinstance(fn, dict):
            return
        if "name" in fn:
            self.name = _first_non_empty(self.name, fn["name"])
        args = fn.get("arguments")
        if isinstance(args, str):
            self.args.append(args)
        elif args is not None:
            self.args_other = args
        for key, value in fn.items():
            if key not in _FUNCTION_SPECIAL:
                _last_non_null(self.fn_extra, key, value)

    def result(self) -> dict[str, Any]:
        if self.args or self.args_other is _MISSING:
            arguments: Any = "".join(self.args)
        else:
            arguments = self.args_other
        function: dict[Any, Any] = {
            "name": None if self.name is _MISSING else self.name,
            "arguments": arguments,
        }
        function.update(self.fn_extra)
        out: dict[Any, Any] = {
            "id": None if self.id is _MISSING else self.id,
            "type": None if self.type is _MISSING else self.type,
            "function": function,
        }
        out.update(self.extra)
        return out


class _Choice:
    """One choice being assembled from its deltas (merged by ``index``)."""

    __slots__ = (
        "content",
        "content_seen",
        "extra",
        "finish_reason",
        "logprobs",
        "msg_extra",
        "reasoning",
        "role",
        "text",
        "tools",
    )

    def __init__(self) -> None:
        self.role: Any = _MISSING
        self.content: list[str] = []
        self.content_seen = False
        self.reasoning: dict[str, list[str]] = {}  # key the server used -> parts
        self.tools: dict[int, _ToolCall] = {}
        self.msg_extra: dict[Any, Any] = {}
        self.finish_reason: Any = None
        self.text: list[str] | None = None  # legacy completions' choice.text
        self.logprobs: Any = _MISSING
        self.extra: dict[Any, Any] = {}

    def add(self, choice: dict[Any, Any]) -> None:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = choice.get("message")  # a few servers stream whole messages
        if isinstance(delta, dict):
            self._add_delta(delta)
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason
        text = choice.get("text")
        if isinstance(text, str):
            if self.text is None:
                self.text = []
            self.text.append(text)
        if "logprobs" in choice:
            self._add_logprobs(choice["logprobs"])
        for key, value in choice.items():
            if key not in _CHOICE_SPECIAL:
                _last_non_null(self.extra, key, value)

    def _add_delta(self, delta: dict[Any, Any]) -> None:
        if "role" in delta:  # first non-null role (null only if nothing better came)
            role = delta["role"]
            if self.role is _MISSING or (self.role is None and role is not None):
                self.role = role
        content = delta.get("content")
        if isinstance(content, str):
            self.content.append(content)
            self.content_seen = True
        for key in _REASONING_KEYS:
            part = delta.get(key)
            if isinstance(part, str):
                self.reasoning.setdefault(key, []).append(part)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for pos, frag in enumerate(calls):
                if not isinstance(frag, dict):
                    continue
                index = _index(frag.get("index"), pos)  # else: position in this delta
                call = self.tools.get(index)
                if call is None:
                    call = self.tools[index] = _ToolCall()
                call.add(frag)
        for key, value in delta.items():
            if key not in _DELTA_SPECIAL:
                _last_non_null(self.msg_extra, key, value)

    def _add_logprobs(self, value: Any) -> None:
        """Concatenate the per-token lists (``content``, ``refusal``) like a full reply."""
        if value is None:
            return
        if not isinstance(value, dict):
            self.logprobs = value
            return
        if not isinstance(self.logprobs, dict):
            self.logprobs = {}
        cur = self.logprobs
        for key, item in value.items():
            old = cur.get(key)
            if isinstance(item, list):
                if isinstance(old, list):
                    old.extend(item)  # ``old`` is our own copy
                else:
                    cur[key] = list(item)
            else:
                _last_non_null(cur, key, item)

    def result(self, index: int) -> dict[str, Any]:
        msg: dict[Any, Any] = {
            "role": None if self.role is _MISSING else self.role,
            "content": "".join(self.content) if self.content_seen else None,
        }
        for key, parts in self.reasoning.items():
            msg[key] = "".join(parts)
        for key, value in self.msg_extra.items():
            msg[key] = value
        if self.tools:
            msg["tool_calls"] = [self.tools[i].result() for i in sorted(self.tools)]
        out: dict[Any, Any] = {"index": index}
        if self.text is not None:
            out["text"] = "".join(self.text)
        out["message"] = msg
        out["finish_reason"] = self.finish_reason
        if self.logprobs is not _MISSING:
            lp = self.logprobs
            out["logprobs"] = (
                {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
                if isinstance(lp, dict)
                else lp
            )
        out.update(self.extra)
        return out


class SSEMerger:
    """R9: merge OpenAI-style ``chat.completion.chunk`` events into one completion.

    - ``object`` becomes ``"chat.completion"``; ``choices`` is rebuilt; every
      other top-level key keeps its last non-null value (``usage``, ``timings``,
      ``prompt_progress``, a mid-stream ``error``...), or ``null`` if only
      ``null`` was sent.  ``choices`` is always present, ``[]`` if none came.
    - Choices are merged by ``index`` (position in the list when missing) and
      output sorted by it, each ``{"index", "message", "finish_reason", ...}``.
    - ``message``: ``role`` first non-null; ``content`` concatenated, ``null``
      if no delta carried a string; ``reasoning_content`` / ``reasoning``
      concatenated under the key(s) the server used; ``tool_calls`` (only when
      any were seen) merged by ``index`` in index order without ``index``;
      other delta keys last-non-null.
    - Tool call: ``id``, ``type``, ``function.name`` first non-empty (``null``
      when never sent); ``function.arguments`` concatenated (``""`` when none).
    - Choice level: ``finish_reason`` last non-null; ``logprobs`` merged like
      the full response (its per-token lists concatenated, other keys
      last-non-null); legacy ``text`` concatenated; other keys last-non-null.
    """

    __slots__ = ("_choices", "_count", "_top")

    def __init__(self) -> None:
        self._top: dict[Any, Any] = {}  # first-seen key order, last non-null value
        self._choices: dict[int, _Choice] = {}
        self._count = 0

    def add(self, event: dict[str, Any]) -> None:
        """Fold one parsed event into the merge; non-objects are ignored."""
        if not isinstance(event, dict):
            return
        self._count += 1
        top = self._top
        for key, value in event.items():
            if key == "choices" or key == "object":
                top.setdefault(key, None)  # remember its position only
            else:
                _last_non_null(top, key, value)
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for pos, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            index = _index(choice.get("index"), pos)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice()
            state.add(choice)

    def result(self) -> dict[str, Any] | None:
        """The merged completion, or None if no event was added."""
        if not self._count:
            return None
        out: dict[Any, Any] = dict(self._top)
        out["choices"] = [self._choices[i].result(i) for i in sorted(self._choices)]
        out["object"] = "chat.completion"
        return out


# ------------------------------------------------------------------------ NDJSON


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
    )

    def __init__(self) -> None:
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
            _last_non_null(self._msg, key, value)
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


# ------------------------------------------------------------------------- sniff

_SSE_TYPES = frozenset({"text/event-stream"})
# x-ndjson is what Ollama sends; the other two names are used by a few
# JSON-lines servers.  application/json-seq is left out: its records start
# with an RS byte, which this line splitter would count as bad chunks.
_NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "text/plain"})
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")
_WS = b" \t\r\n"


def sniff_stream(content_type: str | None, head: bytes) -> str | None:
    """R8: ``"sse"``, ``"ndjson"`` or None (not streamed) for a response.

    The content type decides (parameters and case ignored).  Only when it is
    missing or generic (``application/octet-stream``, ``text/plain``) are the
    first body bytes sniffed: an SSE field or comment first means SSE; a first
    line that is a JSON object followed by another non-blank line means NDJSON
    (``head`` must be long enough to hold the first line and the start of the
    next).  ``application/json`` and anything else is not a stream.
    """
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime in _SSE_TYPES:
        return "sse"
    if mime in _NDJSON_TYPES:
        return "ndjson"
    if mime not in _GENERIC_TYPES:
        return None
    head = bytes(head)
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:]
    head = head.lstrip(_WS)
    if head.startswith(_SSE_STARTS):
        return "sse"
    if not head.startswith(b"{"):
        return None
    first, nl, rest = head.partition(b"\n")
    if not nl or not rest.strip(_WS):
        return None
    try:
        obj = canonical.loads(first)
    except canonical.NotJSON:
        return None
    return "ndjson" if isinstance(obj, dict) else None


# ------------------------------------------------------------------------ capture


class StreamCapture:
    """Parse, count and merge one streamed response body, within the limit.

    ``feed`` never raises: the capture runs beside the client's bytes (R7) and
    a bug in a parser or merger must not lose it.  Only the first ``limit``
    bytes are parsed (R12); the merge keeps the events complete within them.

    Counters (R8): ``chunks`` is the SSE events with non-empty data, without
    the ``[DONE]`` sentinel, or the non-blank NDJSON lines; ``bad_chunks`` the
    ones that are not a JSON object.  An SSE event left unterminated at the end
    of the stream counts in both (so ``bad_chunks <= chunks`` always holds),
    unless the body was truncated (the limit cut it, not the server) or its
    data is ``[DONE]`` (then it only sets ``done_seen``).
    """

    __slots__ = (
        "_closed",
        "_merger",
        "_parsed",
        "_parser",
        "bad_chunks",
        "body_bytes",
        "chunks",
        "done_seen",
        "internal_errors",
        "kind",
        "limit",
        "truncated",
    )

    def __init__(self, kind: str, limit: int) -> None:
        if kind == "sse":
            self._parser: SSEParser | NDJSONParser = SSEParser()
            self._merger: SSEMerger | NDJSONMerger = SSEMerger()
        elif kind == "ndjson":
            self._parser = NDJSONParser()
            self._merger = NDJSONMerger()
        else:
            raise ValueError(f"unknown stream kind: {kind!r}")
        self.kind = kind
        self.limit = max(0, int(limit))
        self.chunks = 0
        self.bad_chunks = 0
        self.body_bytes = 0
        self.truncated = False
        self.done_seen = False
        #: Exceptions swallowed by feed/close: always 0 unless llmp has a bug.
        self.internal_errors = 0
        self._parsed = 0
        self._closed = False

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """Account for one piece of the body and parse what fits in the limit."""
        try:
            if not isinstance(piece, bytes):
                piece = bytes(piece)
            size = len(piece)
            self.body_bytes += size
            if self._closed or not size:
                return
            room = self.limit - self._parsed
            if size > room:
                self.truncated = True
                if room <= 0:
                    return
                piece = piece[:room]
            self._parsed += len(piece)
            items = self._parser.feed(piece)
        except Exception:
            self.internal_errors += 1
            return
        for item in items:
            self._item(item)

    def _item(self, item: str | bytes) -> None:
        try:
            if isinstance(item, str) and item.strip() == "[DONE]":
                self.done_seen = True
                return
            self.chunks += 1
            try:
                obj = canonical.loads(item)
            except canonical.NotJSON:
                obj = None
            if not isinstance(obj, dict):
                self.bad_chunks += 1
                return
            if self.kind == "ndjson" and obj.get("done") is True:
                self.done_seen = True
            self._merger.add(obj)
        except Exception:
            self.internal_errors += 1

    def close(self) -> None:
        """End the body: flush the parser and count what it held back."""
        if self._closed:
            return
        self._closed = True
        try:
            parser = self._parser
            if isinstance(parser, SSEParser):
                pending = parser.close()
                if pending and not self.truncated:
                    if parser.pending.strip() == "[DONE]":
                        self.done_seen = True
                    else:
                        self.chunks += 1
                        self.bad_chunks += 1
            else:
                lines = parser.close()
                if not self.truncated:  # a line cut by the limit is not the server's
                    for line in lines:
                        self._item(line)
        except Exception:
            self.internal_errors += 1

    def merged(self) -> dict[str, Any] | None:
        """The merged body (None if no JSON object event was parsed)."""
        try:
            return self._merger.result()
        except Exception:
            self.internal_errors += 1
            return None
