"""The Anthropic Messages API: `POST /v1/messages` (R21-R24).

Claude Code speaks it; llama-server, vLLM and Ollama serve it.  Its shape is
not OpenAI's: the system prompt is a top-level value, content is an array of
typed blocks, tool calls and their results are blocks too, and the
`cache_control` markers a client moves from turn to turn are removed before
anything is hashed, so that a moved marker never looks like rewritten history.
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
    content_marks,
    count,
    diagnosis_safe,
    digest_message,
    enum_value,
    first_int,
    hashed_setting,
    int_index,
    is_set,
    last_non_null,
    nonneg,
    text_of,
)
from llmp.apis.openai_chat import timings_into
from llmp.format import canonical
from llmp.format.canonical import dumps
from llmp.format.schema import (
    MessageDigest,
    ResponseDigest,
    ToolCallRef,
)

__all__ = [
    "AnthropicMessages",
    "MessagesMerger",
    "anthropic_counts",
    "block_text",
    "content_text",
    "strip_cache_control",
]

CACHE_CONTROL = "cache_control"


# -- the request digest (R22) ------------------------------------------------------


def strip_cache_control(value: Any) -> Any:
    """A copy of a JSON value without any `cache_control` key, at every depth (R22).

    The marker only tells the server where to cache; the prompt is the same
    without it.  Values other than objects and arrays are shared, not copied.
    """
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != CACHE_CONTROL}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def _hashed_content(content: Any) -> Any:
    """Content as hashed: a string is one text block (R22); markers removed."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return strip_cache_control(content)


def _text_blocks(content: Any) -> str:
    """A `tool_result`'s content: a string, or its `text` blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            text_of(b.get("text"))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def block_text(block: Any) -> str:
    """One content block's share of the message text (R22).

    `block` must already be free of `cache_control` (a `tool_use` block
    counts as its canonical JSON).
    """
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return text_of(block.get("text"))
    if kind == "thinking":
        return text_of(block.get("thinking"))
    if kind == "tool_use":
        return dumps(block).decode("utf-8")
    if kind == "tool_result":
        return _text_blocks(block.get("content"))
    return ""


def content_text(content: Any) -> str:
    """A message's text: the string, or its blocks' texts joined without separator."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(block_text(b) for b in content)
    return ""


def _tool_use_refs(content: Any) -> list[ToolCallRef]:
    """`[{id, name}]` of the `tool_use` blocks of a content array."""
    if not isinstance(content, list):
        return []
    return [
        {"id": b.get("id"), "name": b.get("name")}
        for b in content
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def _tool_result_id(content: Any) -> Any:
    """The `tool_use_id` of the first `tool_result` block, else None."""
    if isinstance(content, list):
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                return b.get("tool_use_id")
    return None


def _system_with_text(body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
    """The `system` value as messages, one per block (R22)."""
    system = body.get("system")
    if isinstance(system, str):
        return [_message_with_text("system", _hashed_content(system))]
    if isinstance(system, list):
        return [_message_with_text("system", [strip_cache_control(b)]) for b in system]
    return []


def _item_with_text(msg: Any) -> tuple[MessageDigest, str]:
    """One item of `messages` (anything: not an object counts as an empty one)."""
    if not isinstance(msg, dict):
        msg = {}
    return _message_with_text(msg.get("role"), _hashed_content(msg.get("content")))


def _message_with_text(role: Any, content: Any) -> tuple[MessageDigest, str]:
    """A digest from a role and content already normalised and stripped."""
    text = content_text(content)
    digest = digest_message(
        role,
        [role, content, None, None, None],
        text,
        _tool_use_refs(content),
        _tool_result_id(content),
        None,
    )
    return digest, text


class AnthropicMessages(ChatApi):
    """`/v1/messages`, or a path ending in it (`/v1/messages/count_tokens` is not chat)."""

    name = "anthropic_messages"
    stream = "sse"

    def matches(self, method: str, path: str) -> bool:
        return method.upper() == "POST" and path.endswith("/v1/messages")

    def messages_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        """The `system` value first (one message per block), then `messages` (R22)."""
        out = self.leading_with_text(body)
        messages = body.get("messages")
        if isinstance(messages, list):
            out.extend(_item_with_text(msg) for msg in messages)
        return out

    def leading_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        return _system_with_text(body)

    def item_digest(self, item: Any) -> MessageDigest:
        return _item_with_text(item)[0]

    # R35: `cache_control` on a tool, a system block or a content block (or on a block
    # inside a tool result) is a breakpoint; a string content is one block.
    cache_markers = (CACHE_CONTROL,)

    def leading_marks(self, body: dict[str, Any]) -> list[Marks]:
        """The `system` value as `_system_with_text` makes it messages: one block each."""
        system = body.get("system")
        if isinstance(system, str):
            return [Marks(1)]
        if isinstance(system, list):
            return [content_marks([b], self.cache_markers) for b in system]
        return []

    def cache_settings(self, body: dict[str, Any], marks: list[Marks]) -> dict[str, Any]:
        """R35's Anthropic settings: `tool_choice` and `thinking` hashed, the images in
        the messages counted, `speed` as sent."""
        return {
            "tool_choice": hashed_setting(body.get("tool_choice")),
            "thinking": hashed_setting(body.get("thinking")),
            "images": sum(m.images for m in marks),
            "speed": enum_value(body.get("speed")),
        }

    def tool_json(self, tool: Any) -> bytes:
        """A tool definition (or the tools array) as canonical JSON, without markers."""
        return dumps(strip_cache_control(tool))

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        return first_int(body.get("max_tokens"))

    def response_format(self, body: dict[str, Any]) -> bool:
        if is_set(body.get("output_format")):
            return True
        config = body.get("output_config")
        return isinstance(config, dict) and is_set(config.get("format"))

    def merger(self) -> MessagesMerger:
        return MessagesMerger()

    def response_digest(self, body: dict[str, Any]) -> ResponseDigest:
        """R24: every top-level field but `content`; the reply is the message itself.

        R37: `diagnostics` keeps only its structure, the miss reason's `type` and its
        token counts (`diagnosis_safe`): digest mode writes no text.
        """
        usage = {k: v for k, v in body.items() if k != "content"}
        if "diagnostics" in usage:
            usage["diagnostics"] = diagnosis_safe(usage["diagnostics"])
        content = body.get("content")
        blocks: list[Any] = (
            [{"type": "text", "text": content}]
            if isinstance(content, str)
            else content
            if isinstance(content, list)
            else []
        )
        text = thinking = 0
        for b in blocks:
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            if kind == "text":
                text += len(text_of(b.get("text")))
            elif kind == "thinking":
                thinking += len(text_of(b.get("thinking")))
        return {
            "usage": usage,
            "output": {
                "content_chars": text,
                "reasoning_chars": thinking,
                "tool_calls": _tool_use_refs(blocks),
            },
        }

    def cache_usage(self, top: dict[str, Any]) -> CacheUsage | None:
        return anthropic_cache_usage(top)

    def provider_reason(self, top: dict[str, Any]) -> str | None:
        return anthropic_reason(top)

    def counts(self, usage: dict[str, Any], hints: CountHints) -> Counts:
        return anthropic_counts(usage)


# -- the counters (R24) -------------------------------------------------------------


def anthropic_counts(top: dict[str, Any]) -> Counts:
    """R24: `input_tokens` is the evaluated part, `cache_read_input_tokens` the reused one.

    An absent (or null) cache counter adds nothing; without `input_tokens`
    neither the prompt nor the evaluated part is known.
    """
    usage = top.get("usage")
    if type(usage) is not dict:
        usage = {}
    inp = nonneg(usage, "input_tokens")
    created = nonneg(usage, "cache_creation_input_tokens")
    read = nonneg(usage, "cache_read_input_tokens")
    completion = nonneg(usage, "output_tokens")
    evaluated = None if inp is None else inp + (created or 0)
    prompt = None if evaluated is None else evaluated + (read or 0)
    c = Counts.server(prompt, completion, read, evaluated)
    timings = top.get("timings")
    if type(timings) is dict:
        timings_into(c, timings)
    return c


def anthropic_cache_usage(top: dict[str, Any]) -> CacheUsage | None:
    """R35: `cache_read_input_tokens`, `cache_creation_input_tokens` (split by time-to-live in
    `cache_creation`) and `input_tokens`, which add up to the prompt; None without
    `input_tokens`, or without any cache counter (an old llama-server build).  Streamed, the
    merged message keeps `message_start`'s split: `message_delta` never repeats it."""
    usage = top.get("usage")
    if type(usage) is not dict:
        return None
    uncached = count(usage, "input_tokens")
    read = count(usage, "cache_read_input_tokens")
    write = count(usage, "cache_creation_input_tokens")
    if uncached is None or (read is None and write is None):
        return None
    split = usage.get("cache_creation")
    hour = count(split, "ephemeral_1h_input_tokens")
    tier = usage.get("service_tier")
    return CacheUsage(
        read or 0,
        write or 0,
        min(hour or 0, write or 0),
        uncached,
        count(usage, "output_tokens"),
        tier=tier if type(tier) is str else None,
    )


def anthropic_reason(top: dict[str, Any]) -> str | None:
    """R37: the message's `diagnostics` in the provider's own word.

    Absent: nothing was asked (None).  `null`: nothing diverged from the previous message
    (`none`).  `{"cache_miss_reason": null}`: the comparison was not ready (`not_ready`).
    Otherwise the reason's `type` (`system_changed`, `messages_changed`, `unavailable`…)."""
    if "diagnostics" not in top:
        return None
    diag = top["diagnostics"]
    if diag is None:
        return "none"
    if type(diag) is not dict:
        return None
    reason = diag.get("cache_miss_reason")
    if reason is None:
        return "not_ready" if "cache_miss_reason" in diag else None
    kind = reason.get("type") if type(reason) is dict else None
    return kind if type(kind) is str and kind else None


# -- the stream merge (R23) -----------------------------------------------------------


# The block type a delta implies, for a delta whose block never started.
_DELTA_BLOCK = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "signature_delta": "thinking",
    "input_json_delta": "tool_use",
}


class _Block:
    """One content block: its `content_block_start` value and the deltas since."""

    __slots__ = ("base", "json", "signature", "text", "thinking")

    def __init__(self, base: dict[Any, Any]) -> None:
        self.base = base
        self.text: list[str] | None = None
        self.thinking: list[str] | None = None
        self.json: list[str] | None = None
        self.signature: Any = MISSING

    def add(self, kind: Any, delta: dict[Any, Any]) -> None:
        if kind == "text_delta":
            part = delta.get("text")
            if isinstance(part, str):
                if self.text is None:
                    self.text = []
                self.text.append(part)
        elif kind == "thinking_delta":
            part = delta.get("thinking")
            if isinstance(part, str):
                if self.thinking is None:
                    self.thinking = []
                self.thinking.append(part)
        elif kind == "input_json_delta":
            part = delta.get("partial_json")
            if isinstance(part, str):
                if self.json is None:
                    self.json = []
                self.json.append(part)
        elif kind == "signature_delta":
            if "signature" in delta:
                self.signature = delta["signature"]

    def result(self) -> dict[Any, Any]:
        out = dict(self.base)
        if self.text is not None:
            out["text"] = text_of(out.get("text")) + "".join(self.text)
        if self.thinking is not None:
            out["thinking"] = text_of(out.get("thinking")) + "".join(self.thinking)
        if self.json is not None:
            raw = "".join(self.json)
            if raw:  # only empty fragments came: the start's input stands
                try:
                    out["input"] = canonical.loads(raw)  # number text kept (R2)
                except (canonical.NotJSON, ValueError, RecursionError):
                    out["input"] = raw
        if self.signature is not MISSING:
            out["signature"] = self.signature
        return out


class MessagesMerger:
    """R23: merge Anthropic stream events into one non-streamed Message.

    - The data's `type` decides (the SSE `event:` name never reaches here).
    - `message_start`'s `message` is the base; its `content` blocks, if any,
      are the first blocks.  `content_block_start` sets block `index`;
      `content_block_delta` appends `text` / `thinking` / the tool input's
      JSON text, or sets `signature`.  The input is that text parsed (number
      text kept) when it parses, else the text; with no (non-empty) fragment
      the start's `input` stays.  Blocks are output in index order.
    - `message_delta`: its `delta` keys are set on the message, its `usage`
      keys in `message.usage` (a null never erases a count), any other key
      but `type` on the message (a server's `timings`).
    - `error`: its `error` is kept as the message's `error`.
    - `message_stop` sets `ended` (R29); `ping`, `content_block_stop` and
      unknown events add nothing.
    - An event without an integer `index` goes to a new block (start) or to
      the last started one (delta).
    """

    __slots__ = ("_blocks", "_count", "_last", "_message", "_usage", "ended")

    def __init__(self) -> None:
        self.ended = False  # `message_stop` came (R29)
        self._message: dict[Any, Any] = {}
        self._usage: dict[Any, Any] | None = None  # message.usage, our own copy
        self._blocks: dict[int, _Block] = {}
        self._last: int | None = None  # the block started last
        self._count = 0

    def add(self, event: dict[str, Any]) -> None:
        """Fold one parsed event into the merge; non-objects are ignored."""
        if not isinstance(event, dict):
            return
        self._count += 1
        kind = event.get("type")
        if kind == "message_start":
            self._start(event.get("message"))
        elif kind == "content_block_start":
            self._block_start(event)
        elif kind == "content_block_delta":
            self._block_delta(event)
        elif kind == "message_delta":
            self._message_delta(event)
        elif kind == "error":
            if "error" in event:
                self._message["error"] = event["error"]
        elif kind == "message_stop":
            self.ended = True

    def _start(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        self._message = dict(message)
        usage = message.get("usage")
        self._usage = dict(usage) if isinstance(usage, dict) else None
        content = message.get("content")
        if isinstance(content, list):
            for pos, block in enumerate(content):
                if pos not in self._blocks and isinstance(block, dict):
                    self._blocks[pos] = _Block(block)

    def _block_start(self, event: dict[str, Any]) -> None:
        index = int_index(event.get("index"))
        if index is None:
            index = max(self._blocks) + 1 if self._blocks else 0
        block = event.get("content_block")
        self._blocks[index] = _Block(block if isinstance(block, dict) else {})
        self._last = index

    def _block_delta(self, event: dict[str, Any]) -> None:
        delta = event.get("delta")
        if not isinstance(delta, dict):
            return
        kind = delta.get("type")
        implied = _DELTA_BLOCK.get(kind) if isinstance(kind, str) else None
        if implied is None:
            return  # citations_delta and the like: not part of the text
        index = int_index(event.get("index"))
        if index is None:
            index = self._last if self._last is not None else 0
        block = self._blocks.get(index)
        if block is None:  # a delta whose start never came: a block of its kind
            block = self._blocks[index] = _Block({"type": implied})
        block.add(kind, delta)

    def _message_delta(self, event: dict[str, Any]) -> None:
        message = self._message
        delta = event.get("delta")
        if isinstance(delta, dict):
            for key, value in delta.items():
                message[key] = value
        usage = event.get("usage")
        if isinstance(usage, dict):
            if self._usage is None:
                self._usage = {}
                message.setdefault("usage", None)  # its place among the keys
            for key, value in usage.items():
                last_non_null(self._usage, key, value)
        for key, value in event.items():
            if key not in ("type", "delta", "usage"):
                message[key] = value

    def result(self) -> dict[str, Any] | None:
        """The merged Message, or None if no event was added."""
        if not self._count:
            return None
        out: dict[Any, Any] = dict(self._message)
        out["content"] = [self._blocks[i].result() for i in sorted(self._blocks)]
        if self._usage is not None:
            out["usage"] = dict(self._usage)
        return out
