"""The OpenAI Responses API: `POST /v1/responses` (R21, R25-R27, R30).

Codex speaks it; llama-server, vLLM and Ollama serve it.  A request is a
list of typed items (messages, function calls and their outputs, reasoning),
each hashed whole but for its `id` (R30); a stream is a sequence of typed events whose last
`response.completed` already holds the whole response.
"""

from __future__ import annotations

from typing import Any

from llmp.apis.base import (
    MISSING,
    CacheUsage,
    ChatApi,
    CountHints,
    Counts,
    Marks,
    cache_options,
    content_marks,
    count,
    diagnosis_safe,
    digest_message,
    enum_only,
    enum_value,
    first_int,
    hashed_key,
    hashed_setting,
    int_index,
    is_set,
    nonneg,
    text_of,
)
from llmp.apis.openai_chat import openai_cache_usage, openai_reason, timings_into
from llmp.format.canonical import dumps
from llmp.format.schema import (
    MessageDigest,
    Params,
    ResponseDigest,
    ToolCallRef,
)

__all__ = [
    "OpenAIResponses",
    "ResponsesMerger",
    "item_text",
    "reasoning_text",
    "response_top",
    "responses_counts",
]


# -- the request digest (R25) --------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")  # a tuple: a part type may be unhashable


def _parts_text(value: Any) -> str:
    """A string, or the `text` of its `input_text` / `output_text` / `text` parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            text_of(p.get("text"))
            for p in value
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
        )
    return ""


def _any_text(parts: Any) -> str:
    """The `text` of every part of a list, whatever its type."""
    if not isinstance(parts, list):
        return ""
    return "".join(text_of(p.get("text")) for p in parts if isinstance(p, dict))


def reasoning_text(item: dict[str, Any]) -> str:
    """A `reasoning` item's text: its `summary` parts, then its `content` parts."""
    return _any_text(item.get("summary")) + _any_text(item.get("content"))


def _is_message(item: dict[str, Any]) -> bool:
    """A message item: `type: "message"`, or the short form with a role and no type."""
    kind = item.get("type")
    return kind == "message" or (kind is None and item.get("role") is not None)


def item_text(item: Any) -> str:
    """One input item's text (R25)."""
    if not isinstance(item, dict):
        return ""
    if _is_message(item):
        return _parts_text(item.get("content"))
    kind = item.get("type")
    if kind == "function_call":
        return dumps(item).decode("utf-8")
    if kind == "function_call_output":
        return _parts_text(item.get("output"))
    if kind == "reasoning":
        return reasoning_text(item)
    return ""


def _call_ref(item: dict[str, Any]) -> ToolCallRef:
    return {"id": item.get("call_id"), "name": item.get("name")}


def _instructions_with_text(body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
    """`instructions`, when set, as a system message (R25)."""
    instructions = body.get("instructions")
    if is_set(instructions):
        return [_item_with_text({"role": "system", "content": instructions})]
    return []


def _item_with_text(item: Any) -> tuple[MessageDigest, str]:
    """An item's digest: its role (or type), the item hashed without its `id`, its text.

    R30: the server renders no item `id` into the prompt and Codex renews them
    all after a compaction, so the `id` is no part of what the model sees.
    """
    hashed = item
    if isinstance(item, dict):
        hashed = {key: value for key, value in item.items() if key != "id"}
        role = item.get("role")
        if role is None:
            role = item.get("type")
        kind = item.get("type")
        calls = [_call_ref(item)] if kind == "function_call" else []
        call_id = item.get("call_id") if kind == "function_call_output" else None
    else:
        role, calls, call_id = None, [], None
    text = item_text(item)
    return digest_message(role, [role, hashed, None, None, None], text, calls, call_id, None), text


def _tool_name(tool: Any) -> Any:
    """`name`, or `function.name` (the chat-completions shape)."""
    if not isinstance(tool, dict):
        return None
    name = tool.get("name")
    if name is None:
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    return name


_KEPT_STRINGS = frozenset(
    (
        "id",
        "object",
        "status",
        "model",
        "service_tier",
        "truncation",
        "previous_response_id",
        "prompt_cache_retention",
    )
)
"""Top-level strings of a response kept verbatim: ids, states and names, never text."""
_KEPT_OBJECTS = frozenset(("usage", "timings", "error", "incomplete_details"))
"""Top-level objects kept verbatim: the counters (OpenAI's `usage`, llama-server's
`timings`) and what went wrong."""


def _settings_only(value: Any) -> dict[str, Any]:
    """An object's enum-like scalars (`enum_only`); every other value goes."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, item in value.items() if (v := enum_only(item)) is not MISSING}


def response_top(body: dict[str, Any]) -> dict[str, Any]:
    """R27's `usage` (every top-level field but the reply), on an allow-list: OpenAI's
    response object echoes the request (`instructions`, `input`, `tools`, `text`,
    `metadata`, `user`, `prompt`), and digest mode writes no text (docs/recording.md).

    Kept: numbers, booleans and nulls; the strings of `_KEPT_STRINGS`; the objects of
    `_KEPT_OBJECTS` verbatim; `prompt_cache_key` hashed (R1); `prompt_cache_options`
    as a request's (R35); `prompt_cache_diagnostics` without text (R37); `reasoning`'s
    enum-like settings; `text` as its `verbosity` and `format.type`; `tool_usage`'s
    numbers; `conversation`'s `id`.  Everything else is dropped.
    """
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("output", "output_text"):
            continue
        if value is None or isinstance(value, (bool, int, float)):
            out[key] = value
        elif key in _KEPT_STRINGS:
            if isinstance(value, str):
                out[key] = value
        elif key in _KEPT_OBJECTS:
            out[key] = value
        elif key == "prompt_cache_key":
            out[key] = hashed_key(value)
        elif key == "prompt_cache_options":
            out[key] = cache_options(value)
        elif key == "prompt_cache_diagnostics":
            out[key] = diagnosis_safe(value)
        elif key == "reasoning":
            out[key] = _settings_only(value)
        elif key == "text":
            out[key] = _text_settings(value)
        elif key == "tool_usage":
            out[key] = diagnosis_safe(value, enums=())
        elif key == "conversation" and isinstance(value, dict):
            ident = value.get("id")
            out[key] = {"id": ident} if isinstance(ident, str) else {}
    return out


def _text_settings(text: Any) -> dict[str, Any]:
    """A response's `text` config as its `verbosity` and its format's `type` (a JSON
    schema's name, description and schema go)."""
    if not isinstance(text, dict):
        return {}
    out: dict[str, Any] = {}
    if "verbosity" in text and (v := enum_only(text["verbosity"])) is not MISSING:
        out["verbosity"] = v
    fmt = text.get("format")
    if isinstance(fmt, dict) and (kind := enum_only(fmt.get("type"))) is not MISSING:
        out["format"] = {"type": kind}
    return out


class OpenAIResponses(ChatApi):
    """`/v1/responses`, `/responses`, or a path ending in `/v1/responses`."""

    name = "openai_responses"
    messages_key = "input"
    stream = "sse"

    def matches(self, method: str, path: str) -> bool:
        return method.upper() == "POST" and (path == "/responses" or path.endswith("/v1/responses"))

    def messages_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        """`instructions` first (a system message), then each `input` item (R25)."""
        out = self.leading_with_text(body)
        inp = body.get("input")
        if isinstance(inp, str):
            out.append(_item_with_text({"role": "user", "content": inp}))
        elif isinstance(inp, list):
            out.extend(_item_with_text(item) for item in inp)
        return out

    def leading_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        return _instructions_with_text(body)

    def item_digest(self, item: Any) -> MessageDigest:
        return _item_with_text(item)[0]

    tool_name = staticmethod(_tool_name)

    # R35: GPT-5.6's `prompt_cache_breakpoint` on a content part (and `cache_control`,
    # which gateways pass on to Anthropic's models) is a breakpoint.
    cache_markers = ("prompt_cache_breakpoint", "cache_control")

    def item_marks(self, item: Any) -> Marks:
        """An item is one block unless its `content` is an array; a marker on a part of a
        `function_call_output`'s `output` array is at its block 0."""
        if not isinstance(item, dict):
            return Marks(1)
        content = item.get("content")
        if isinstance(content, list):
            return content_marks(content, self.cache_markers)
        output = item.get("output")
        if isinstance(output, list):
            inner = content_marks(output, self.cache_markers)
            return Marks(1, tuple((0, ttl) for _, ttl in inner.breaks), inner.images)
        return Marks(1)

    def leading_marks(self, body: dict[str, Any]) -> list[Marks]:
        instructions = body.get("instructions")
        return [self.item_marks({"content": instructions})] if is_set(instructions) else []

    def messages_marks(self, body: dict[str, Any]) -> list[Marks]:
        """As `messages_with_text`: a string `input` is one message of one block."""
        if isinstance(body.get("input"), str):
            return [*self.leading_marks(body), Marks(1)]
        return super().messages_marks(body)

    def cache_settings(self, body: dict[str, Any], marks: list[Marks]) -> dict[str, Any]:
        """R35's OpenAI settings: `reasoning.effort`, `text.verbosity`, `text.format`
        (hashed: it may hold a schema), `parallel_tool_calls`, `service_tier`."""
        reasoning = body.get("reasoning")
        text = body.get("text")
        if not isinstance(text, dict):
            text = {}
        return {
            "reasoning_effort": enum_value(
                reasoning.get("effort") if isinstance(reasoning, dict) else None
            ),
            "verbosity": enum_value(text.get("verbosity")),
            "text_format": hashed_setting(text.get("format")),
            "parallel_tool_calls": enum_value(body.get("parallel_tool_calls")),
            "service_tier": enum_value(body.get("service_tier")),
        }

    def params(self, body: dict[str, Any]) -> Params:
        params = super().params(body)
        # The server holds the start of this prompt; the request does not.
        params["previous_response"] = is_set(body.get("previous_response_id"))
        return params

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        return first_int(body.get("max_output_tokens"))

    def response_format(self, body: dict[str, Any]) -> bool:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        return is_set(kind) and kind != "text"

    def merger(self) -> ResponsesMerger:
        return ResponsesMerger()

    def response_digest(self, body: dict[str, Any]) -> ResponseDigest:
        """R27: the top-level fields but `output` and `output_text`, on `response_top`'s
        allow-list (OpenAI's response object echoes the request's text); the reply is
        `output`."""
        usage = response_top(body)
        output = body.get("output")
        content = reasoning = 0
        calls: list[ToolCallRef] = []
        for item in output if isinstance(output, list) else []:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if _is_message(item):
                parts = item.get("content")
                if isinstance(parts, list):
                    content += sum(
                        len(text_of(p.get("text")))
                        for p in parts
                        if isinstance(p, dict) and p.get("type") == "output_text"
                    )
            elif kind == "reasoning":
                reasoning += len(reasoning_text(item))
            elif kind == "function_call":
                calls.append(_call_ref(item))
        return {
            "usage": usage,
            "output": {"content_chars": content, "reasoning_chars": reasoning, "tool_calls": calls},
        }

    def counts(self, usage: dict[str, Any], hints: CountHints) -> Counts:
        return responses_counts(usage)

    def cache_usage(self, top: dict[str, Any]) -> CacheUsage | None:
        usage = top.get("usage")
        if type(usage) is not dict:
            return None
        options = top.get("prompt_cache_options")
        ttl = options.get("ttl") if type(options) is dict else None
        return openai_cache_usage(
            count(usage, "input_tokens"),
            usage.get("input_tokens_details"),
            count(usage, "output_tokens"),
            top,
            ttl if type(ttl) is str else None,
        )

    def provider_reason(self, top: dict[str, Any]) -> str | None:
        return openai_reason(top.get("prompt_cache_diagnostics"))


# -- the counters (R27) ---------------------------------------------------------------


def responses_counts(top: dict[str, Any]) -> Counts:
    """R27: `input_tokens` is the whole prompt, `cached_tokens` the reused part of it."""
    usage = top.get("usage")
    if type(usage) is not dict:
        usage = {}
    prompt = nonneg(usage, "input_tokens")
    details = usage.get("input_tokens_details")
    cached = nonneg(details, "cached_tokens") if type(details) is dict else None
    evaluated = None if prompt is None or cached is None else max(0, prompt - cached)
    completion = nonneg(usage, "output_tokens")
    c = Counts.server(prompt, completion, cached, evaluated)
    timings = top.get("timings")
    if type(timings) is dict:
        timings_into(c, timings)
    return c


# -- the stream merge (R26) -------------------------------------------------------------

_END_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})

# R26: the keys of an event that are its own, not the merged body's.
_EVENT_KEYS = frozenset(
    {
        "type",
        "response",
        "item",
        "delta",
        "item_id",
        "output_index",
        "content_index",
        "part",
        "text",
        "sequence_number",
    }
)
# The other per-item payload keys of OpenAI's own events (function_call_arguments.done,
# refusal.done, output_text.delta's logprobs, annotations, custom tool input,
# partial images, ...).  They carry generated text or bulk, never a server's
# counters, and digest mode keeps no text; so they stay off the body too.
# An `error` event keeps all its keys (`code`, `message`, `param`).
_PAYLOAD_KEYS = frozenset(
    {
        "annotation",
        "annotation_index",
        "arguments",
        "code",
        "input",
        "logprobs",
        "name",
        "obfuscation",
        "partial_image_b64",
        "partial_image_index",
        "refusal",
        "summary_index",
    }
)
_SKIPPED = _EVENT_KEYS | _PAYLOAD_KEYS


class _Item:
    """An output item announced by `output_item.added`, and its text deltas since."""

    __slots__ = ("current", "done", "item", "parts", "texts")

    def __init__(self, item: dict[Any, Any]) -> None:
        self.item = item
        self.done = False
        self.parts: dict[int, dict[Any, Any]] = {}  # content_part.added, by content index
        self.texts: dict[int, list[str]] = {}  # output_text.delta, by content index
        self.current = 0  # the content index a delta without one goes to

    def add_part(self, given: Any, part: Any) -> None:
        index = int_index(given)
        if index is None:
            known = set(self.parts) | set(self.texts)
            index = max(known) + 1 if known else len(self._content())
        if isinstance(part, dict):
            self.parts[index] = part
        self.current = index

    def add_text(self, given: Any, delta: str) -> None:
        index = int_index(given)
        if index is None:
            index = self.current
        self.texts.setdefault(index, []).append(delta)

    def _content(self) -> list[Any]:
        content = self.item.get("content")
        return list(content) if isinstance(content, list) else []

    def result(self) -> dict[Any, Any]:
        out = dict(self.item)
        if not self.parts and not self.texts:
            return out
        content = self._content()
        for index in sorted(set(self.parts) | set(self.texts)):
            base = self.parts.get(index)
            inside = 0 <= index < len(content)
            if base is None:
                old = content[index] if inside else None
                base = old if isinstance(old, dict) else {"type": "output_text", "text": ""}
            part = dict(base)
            if index in self.texts:
                part["text"] = text_of(part.get("text")) + "".join(self.texts[index])
            if inside:
                content[index] = part
            else:
                content.append(part)
        out["content"] = content
        return out


class ResponsesMerger:
    """R26: merge Responses stream events into the response object.

    - The data's `type` decides (the SSE `event:` name never reaches here).
    - The body is the `response` of the last `response.completed`,
      `response.incomplete` or `response.failed` (each sets `ended`, R29).
    - A cut stream: the last `response` seen, its `output` rebuilt from the
      `output_item.done` items in order, then the items added and not done,
      with the text of their `output_text.delta`s (placed by `content_index`,
      else in the last part announced).  Items are matched by id, else by
      `output_index` (llama-server sends neither index).
    - Every other top-level key of an event is set on the body (llama-server's
      `timings` beside `response`), except the event's own keys listed in R26
      and OpenAI's per-item payload keys (`_PAYLOAD_KEYS`).
    - An `error` event's `error` is the body's `error`; OpenAI's form, with
      `code` and `message` at the top, becomes `{code, message, param}`.
    """

    __slots__ = (
        "_by_id",
        "_by_index",
        "_count",
        "_done_items",
        "_extra",
        "_final",
        "_last_response",
        "_pending",
        "ended",
    )

    def __init__(self) -> None:
        self.ended = False  # response.completed / incomplete / failed came (R29)
        self._count = 0
        self._final: dict[Any, Any] | None = None
        self._last_response: dict[Any, Any] | None = None
        self._done_items: list[Any] = []
        self._pending: list[_Item] = []  # added items, in order
        self._by_id: dict[str, _Item] = {}
        self._by_index: dict[int, _Item] = {}
        self._extra: dict[Any, Any] = {}

    def add(self, event: dict[str, Any]) -> None:
        """Fold one parsed event into the merge; non-objects are ignored."""
        if not isinstance(event, dict):
            return
        self._count += 1
        kind = event.get("type")
        if not isinstance(kind, str):
            kind = None  # an object or array type must not reach the set lookups
        response = event.get("response")
        if isinstance(response, dict):
            self._last_response = response
        if kind in _END_EVENTS:
            self.ended = True
            if isinstance(response, dict):
                self._final = response
        elif kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, dict):
                self._added(event, item)
        elif kind == "response.output_item.done":
            item = event.get("item")
            if isinstance(item, dict):
                self._done_items.append(item)
                entry = self._find(item.get("id"), event.get("output_index"))
                if entry is not None:
                    entry.done = True
        elif kind == "response.content_part.added":
            entry = self._find(event.get("item_id"), event.get("output_index"))
            if entry is not None:
                entry.add_part(event.get("content_index"), event.get("part"))
        elif kind == "response.output_text.delta":
            delta = event.get("delta")
            entry = self._find(event.get("item_id"), event.get("output_index"))
            if entry is not None and isinstance(delta, str):
                entry.add_text(event.get("content_index"), delta)
        skip = _SKIPPED
        if kind == "error":
            skip = _EVENT_KEYS
            if "error" not in event:
                self._extra["error"] = {
                    k: v for k, v in event.items() if k not in ("type", "sequence_number")
                }
        for key, value in event.items():
            if key not in skip:
                self._extra[key] = value

    def _added(self, event: dict[str, Any], item: dict[Any, Any]) -> None:
        entry = _Item(item)
        self._pending.append(entry)
        ident = item.get("id")
        if isinstance(ident, str) and ident:
            self._by_id[ident] = entry
        index = int_index(event.get("output_index"))
        if index is not None:
            self._by_index[index] = entry

    def _find(self, ident: Any, index: Any) -> _Item | None:
        if isinstance(ident, str) and ident in self._by_id:
            return self._by_id[ident]
        pos = int_index(index)
        return None if pos is None else self._by_index.get(pos)

    def result(self) -> dict[str, Any] | None:
        """The merged response, or None if no event was added."""
        if not self._count:
            return None
        if self._final is not None:
            out: dict[Any, Any] = dict(self._final)
        else:
            out = dict(self._last_response) if self._last_response is not None else {}
            output = list(self._done_items)
            output.extend(e.result() for e in self._pending if not e.done)
            out["output"] = output
        out.update(self._extra)
        return out
