"""The OpenAI Chat Completions API: `POST /v1/chat/completions` (R6).

llama-server, vLLM, SGLang, Ollama's `/v1`, LM Studio and most hosted
servers speak it.  Its message shape (R4, R5) is also Ollama's, so
`llmp.apis.ollama_chat` builds on this module.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from llmp.apis.base import (
    MAX_COUNT,
    MISSING,
    CacheUsage,
    ChatApi,
    CountHints,
    Counts,
    Marks,
    content_marks,
    count,
    digest_message,
    enum_value,
    first_int,
    first_non_empty,
    hashed_setting,
    index_of,
    is_set,
    last_non_null,
    make_tool_digest,
    nonneg_number,
    string_end,
)
from llmp.apis.providers import parse_ttl
from llmp.format import canonical
from llmp.format.canonical import dumps
from llmp.format.fastread import LlamaTop
from llmp.format.measure import SERVER
from llmp.format.schema import (
    MessageDigest,
    ResponseDigest,
    StreamKind,
    ToolCallRef,
    ToolDigest,
)

__all__ = [
    "OpenAIChat",
    "SSEMerger",
    "content_text",
    "message_digest",
    "message_text",
    "message_with_text",
    "openai_counts",
    "reply_message",
    "tool_call_refs",
    "tool_digest",
]


# -- the request digest (R4, R5) -------------------------------------------------


def content_text(content: Any) -> str:
    """The text of a content value: a string, or the joined text parts of an array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def _nonempty_list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) and value else None


def message_name(msg: dict[str, Any]) -> Any:
    """`name`, or Ollama's `tool_name`."""
    name = msg.get("name")
    return name if name is not None else msg.get("tool_name")


def message_text(msg: dict[str, Any]) -> str:
    """R5: the content's text, then the canonical JSON of any tool calls."""
    text = content_text(msg.get("content"))
    calls = _nonempty_list(msg.get("tool_calls"))
    if calls is not None:
        text += dumps(calls).decode("utf-8")
    return text


def tool_call_refs(calls: Any) -> list[ToolCallRef]:
    """`[{id, name}]` for each tool call; `id` is null when the server gave none."""
    if not isinstance(calls, list):
        return []
    refs: list[ToolCallRef] = []
    for call in calls:
        if not isinstance(call, dict):
            refs.append({"id": None, "name": None})
            continue
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            name = call.get("name")
        refs.append({"id": call.get("id"), "name": name})
    return refs


def message_digest(msg: Any) -> MessageDigest:
    """One message's digest (R4, R5)."""
    return message_with_text(msg)[0]


def message_with_text(msg: Any) -> tuple[MessageDigest, str]:
    """One message's digest (R4, R5), and its text."""
    if not isinstance(msg, dict):
        msg = {}
    role = msg.get("role")
    calls = _nonempty_list(msg.get("tool_calls"))
    name = message_name(msg)
    identity = [role, msg.get("content"), calls, name, msg.get("tool_call_id")]
    text = message_text(msg)
    return digest_message(
        role, identity, text, tool_call_refs(calls), msg.get("tool_call_id"), name
    ), text


def tool_name(tool: Any) -> Any:
    """`function.name`, or `name`."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    return tool.get("name") if name is None else name


def tool_digest(tool: Any) -> ToolDigest:
    """A tool definition's digest: its name, and hash and size of its canonical JSON."""
    return make_tool_digest(tool_name(tool), dumps(tool))


def reply_message(body: dict[str, Any]) -> dict[str, Any] | None:
    """The reply: `choices[0].message`, or Ollama's `message`."""
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        if isinstance(msg, dict):
            return msg
    msg = body.get("message")
    return msg if isinstance(msg, dict) else None


class OpenAIChat(ChatApi):
    """`/v1/chat/completions`, `/chat/completions`, or a path ending in `/v1/chat/completions`."""

    name = "openai_chat"
    stream: ClassVar[StreamKind] = "sse"
    stream_usage_asked = True

    def matches(self, method: str, path: str) -> bool:
        return path in ("/v1/chat/completions", "/chat/completions") or path.endswith(
            "/v1/chat/completions"
        )

    def messages_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        messages = body.get("messages")
        return [message_with_text(m) for m in messages] if isinstance(messages, list) else []

    def item_digest(self, item: Any) -> MessageDigest:
        return message_digest(item)

    tool_name = staticmethod(tool_name)

    # R35: `cache_control` on a content part (OpenRouter passes it on to Anthropic's
    # models) and GPT-5.6's `prompt_cache_breakpoint` are breakpoints.
    cache_markers = ("cache_control", "prompt_cache_breakpoint")

    def item_marks(self, item: Any) -> Marks:
        """The content's blocks (a string is one, null none), and one per tool call: a
        gateway sends each as a block of its own to Anthropic's models."""
        if not isinstance(item, dict):
            return Marks(0)
        calls = item.get("tool_calls")
        return content_marks(
            item.get("content"), self.cache_markers, len(calls) if isinstance(calls, list) else 0
        )

    def cache_settings(self, body: dict[str, Any], marks: list[Marks]) -> dict[str, Any]:
        """R35's OpenAI settings, as Chat Completions names them: `reasoning_effort` (or
        a gateway's `reasoning.effort`), `verbosity`, `response_format` (hashed: it may
        hold a schema), `parallel_tool_calls`, `service_tier`."""
        effort = body.get("reasoning_effort")
        reasoning = body.get("reasoning")
        if effort is None and isinstance(reasoning, dict):
            effort = reasoning.get("effort")
        return {
            "reasoning_effort": enum_value(effort),
            "verbosity": enum_value(body.get("verbosity")),
            "text_format": hashed_setting(body.get("response_format")),
            "parallel_tool_calls": enum_value(body.get("parallel_tool_calls")),
            "service_tier": enum_value(body.get("service_tier")),
        }

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        options = body.get("options")
        return first_int(
            body.get("max_tokens"),
            body.get("max_completion_tokens"),
            body.get("n_predict"),
            options.get("num_predict") if isinstance(options, dict) else None,
        )

    def response_format(self, body: dict[str, Any]) -> bool:
        fmt = body.get("response_format")
        if is_set(fmt):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            if kind != "text":
                return True
        return is_set(body.get("format"))

    def grammar(self, body: dict[str, Any]) -> bool:
        return is_set(body.get("grammar")) or is_set(body.get("json_schema"))

    def merger(self) -> SSEMerger:
        return SSEMerger()

    def response_digest(self, body: dict[str, Any]) -> ResponseDigest:
        usage = {k: v for k, v in body.items() if k not in ("choices", "message")}
        reply = reply_message(body) or {}
        reasoning = 0
        for key in ("reasoning_content", "reasoning", "thinking"):
            value = reply.get(key)
            if isinstance(value, str):
                reasoning = len(value)
                break
        return {
            "usage": usage,
            "output": {
                "content_chars": len(content_text(reply.get("content"))),
                "reasoning_chars": reasoning,
                "tool_calls": tool_call_refs(reply.get("tool_calls")),
            },
        }

    def cache_usage(self, top: dict[str, Any]) -> CacheUsage | None:
        usage = top.get("usage")
        if type(usage) is not dict:
            return None
        return openai_cache_usage(
            count(usage, "prompt_tokens"),
            usage.get("prompt_tokens_details"),
            count(usage, "completion_tokens"),
            top,
        )

    def counts(self, usage: dict[str, Any], hints: CountHints) -> Counts:
        return openai_counts(usage)


# -- the counters -----------------------------------------------------------------


def _int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    return v if type(v) is int else None


def _nat(v: int | None) -> int | None:
    return v if v is not None and 0 <= v <= MAX_COUNT else None


def openai_cache_usage(
    prompt: int | None,
    details: Any,
    output: int | None,
    top: dict[str, Any],
    ttl: str | None = None,
) -> CacheUsage | None:
    """R35 for OpenAI's usage (Chat's `prompt_tokens`, Responses' `input_tokens`, either with
    its details): `cached_tokens` read, `cache_write_tokens` written (vLLM's
    `created_cache_tokens`; 0 where absent: before GPT-5.6 nothing is billed as a write),
    the rest uncached.  `cache_write_tokens_details`
    (`ttl_<ttl>_tokens`) says which writes live an hour or more.  None without a prompt
    count or a cached count (a stream without `include_usage`, a server that says nothing)."""
    if type(details) is not dict or prompt is None:
        return None
    read = count(details, "cached_tokens")
    if read is None:
        return None
    # vLLM says what this request wrote to its prefix cache as `created_cache_tokens`.
    write = count(details, "cache_write_tokens") or count(details, "created_cache_tokens") or 0
    long = 0
    by_ttl = details.get("cache_write_tokens_details")
    if type(by_ttl) is dict:
        for key, n in by_ttl.items():
            seconds = parse_ttl(key.removeprefix("ttl_").removesuffix("_tokens"))
            if seconds is not None and seconds >= 3600 and type(n) is int and 0 < n <= MAX_COUNT:
                long += n
    tier, retention = top.get("service_tier"), top.get("prompt_cache_retention")
    return CacheUsage(
        read,
        write,
        min(long, write),
        max(0, prompt - read - write),
        output,
        tier=tier if type(tier) is str else None,
        retention=retention if type(retention) is str else None,
        ttl=ttl,
    )


def openai_reason(diag: Any) -> str | None:
    """R37: OpenAI's `prompt_cache_diagnostics` in its own word: `cache_hit` is `none`, a
    `cache_miss` its `reason`, any other `type` (`comparison_response_not_found`,
    `unavailable`) itself; None where there is none."""
    if type(diag) is not dict:
        return None
    kind = diag.get("type")
    if kind == "cache_hit":
        return "none"
    if kind == "cache_miss":
        reason = diag.get("reason")
        return reason if type(reason) is str and reason else "cache_miss"
    return kind if type(kind) is str and kind else None


def openai_counts(top: dict[str, Any] | LlamaTop) -> Counts:
    """llama-server, vLLM, SGLang, OpenRouter, DeepSeek, Ollama's /v1 (docs/analysis.md §4).

    vLLM's `prompt_tokens_details.created_cache_tokens` (what the request wrote into the
    cache) is `Counts.cache_write_tokens`.

    `top` is the reply's top level as the plain reader parses it, or llama-server's
    as the fast path decodes it (`fastread.LlamaTop`): only the reading differs, and
    gives the same values (an integer, a time any number, else None)."""
    prompt = completion = cache_n = prompt_n = predicted = None
    details = flat = hit_n = miss_n = created = None
    pm = dm = None
    if isinstance(top, LlamaTop):
        u, t = top.usage, top.timings
        if u is not None:
            prompt, completion = u.prompt_tokens, u.completion_tokens
            if u.prompt_tokens_details is not None:
                details = u.prompt_tokens_details.cached_tokens
        if t is not None:
            cache_n, prompt_n, predicted = t.cache_n, t.prompt_n, t.predicted_n
            pm, dm = t.prompt_ms, t.predicted_ms
    else:
        usage = top.get("usage")
        if type(usage) is dict:
            prompt, completion = _int(usage, "prompt_tokens"), _int(usage, "completion_tokens")
            d = usage.get("prompt_tokens_details")
            if type(d) is dict:
                details = _int(d, "cached_tokens")
                created = _int(d, "created_cache_tokens")  # vLLM: what it wrote
            flat = _int(usage, "cached_tokens")
            hit_n = _int(usage, "prompt_cache_hit_tokens")
            miss_n = _int(usage, "prompt_cache_miss_tokens")
        timings = top.get("timings")
        if type(timings) is dict:
            cache_n, prompt_n = _int(timings, "cache_n"), _int(timings, "prompt_n")
            predicted = _int(timings, "predicted_n")
            pm = nonneg_number(timings.get("prompt_ms"))
            dm = nonneg_number(timings.get("predicted_ms"))

    # The values read, one rule: a negative count is not said; the first cache counter
    # said is the one used (cache_n, then cached_tokens, then DeepSeek's hit and miss).
    prompt, completion = _nat(prompt), _nat(completion)
    cache_n, prompt_n = _nat(cache_n), _nat(prompt_n)
    cached = hit = miss = None
    if cache_n is None:
        cached = _nat(details)
        if cached is None:
            cached = _nat(flat)
        if cached is None:
            hit, miss = _nat(hit_n), _nat(miss_n)
    if prompt is None:
        if cache_n is not None and prompt_n is not None:
            prompt = cache_n + prompt_n
        elif hit is not None and miss is not None:
            prompt = hit + miss
    reused = cache_n if cache_n is not None else cached if cached is not None else hit
    evaluated = prompt_n if prompt_n is not None else miss
    if evaluated is None and prompt is not None and reused is not None:
        evaluated = max(0, prompt - reused)
    if completion is None:
        completion = _nat(predicted)
    c = Counts.server(prompt, completion, reused, evaluated)
    if (created := _nat(created)) is not None:
        c.cache_write_tokens = (created, SERVER)
    if pm is not None and pm >= 0:
        c.prefill_ms = (pm, SERVER)
    if dm is not None and dm >= 0:
        c.decode_ms = (dm, SERVER)
    return c


def timings_into(c: Counts, timings: dict[str, Any]) -> None:
    """llama-server's `timings`: prompt_ms and predicted_ms (any API that carries them)."""
    pm = nonneg_number(timings.get("prompt_ms"))
    if pm is not None:
        c.prefill_ms = (pm, SERVER)
    dm = nonneg_number(timings.get("predicted_ms"))
    if dm is not None:
        c.decode_ms = (dm, SERVER)


# -- the stream merge (R9) --------------------------------------------------------

# Keys of a delta that are merged specially; the rest are last-non-null.
_REASONING_KEYS = ("reasoning_content", "reasoning")
_DELTA_SPECIAL = frozenset({"role", "content", "tool_calls", *_REASONING_KEYS})
_CHOICE_SPECIAL = frozenset({"index", "delta", "message", "finish_reason", "text", "logprobs"})
_TOOL_SPECIAL = frozenset({"index", "id", "type", "function"})
_FUNCTION_SPECIAL = frozenset({"name", "arguments"})
_APPENDED_KEYS = ("content", *_REASONING_KEYS)
"""The delta's strings that a merge appends: `SSEMerger.add_same_run` folds an event of one."""
_STRING = msgspec.json.Decoder(str)


# --------------------------------------------------------------------------- SSE


class _ToolCall:
    """One tool call being assembled from its fragments (merged by ``index``)."""

    __slots__ = ("args", "args_other", "extra", "fn_extra", "id", "name", "type")

    def __init__(self) -> None:
        self.id: Any = MISSING
        self.type: Any = MISSING
        self.name: Any = MISSING
        self.args: list[str] = []
        self.args_other: Any = MISSING  # non-string arguments, if a server sends objects
        self.extra: dict[Any, Any] = {}
        self.fn_extra: dict[Any, Any] = {}

    def add(self, frag: dict[Any, Any]) -> None:
        if "id" in frag:
            self.id = first_non_empty(self.id, frag["id"])
        if "type" in frag:
            self.type = first_non_empty(self.type, frag["type"])
        for key, value in frag.items():
            if key not in _TOOL_SPECIAL:
                last_non_null(self.extra, key, value)
        fn = frag.get("function")
        if not isinstance(fn, dict):
            return
        if "name" in fn:
            self.name = first_non_empty(self.name, fn["name"])
        args = fn.get("arguments")
        if isinstance(args, str):
            self.args.append(args)
        elif args is not None:
            self.args_other = args
        for key, value in fn.items():
            if key not in _FUNCTION_SPECIAL:
                last_non_null(self.fn_extra, key, value)

    def result(self) -> dict[str, Any]:
        if self.args or self.args_other is MISSING:
            arguments: Any = "".join(self.args)
        else:
            arguments = self.args_other
        function: dict[Any, Any] = {
            "name": None if self.name is MISSING else self.name,
            "arguments": arguments,
        }
        function.update(self.fn_extra)
        out: dict[Any, Any] = {
            "id": None if self.id is MISSING else self.id,
            "type": None if self.type is MISSING else self.type,
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
        self.role: Any = MISSING
        self.content: list[str] = []
        self.content_seen = False
        self.reasoning: dict[str, list[str]] = {}  # key the server used -> parts
        self.tools: dict[int, _ToolCall] = {}
        self.msg_extra: dict[Any, Any] = {}
        self.finish_reason: Any = None
        self.text: list[str] | None = None  # legacy completions' choice.text
        self.logprobs: Any = MISSING
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
        extra = self.extra
        for key, value in choice.items():
            if key not in _CHOICE_SPECIAL and (value is not None or key not in extra):
                extra[key] = value  # last non-null (`last_non_null`, inlined: per event)

    def _add_delta(self, delta: dict[Any, Any]) -> None:
        if "role" in delta:  # first non-null role (null only if nothing better came)
            role = delta["role"]
            if self.role is MISSING or (self.role is None and role is not None):
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
                index = index_of(frag.get("index"), pos)  # else: position in this delta
                call = self.tools.get(index)
                if call is None:
                    call = self.tools[index] = _ToolCall()
                call.add(frag)
        extra = self.msg_extra
        for key, value in delta.items():
            if key not in _DELTA_SPECIAL and (value is not None or key not in extra):
                extra[key] = value  # last non-null, inlined

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
                last_non_null(cur, key, item)

    def result(self, index: int) -> dict[str, Any]:
        msg: dict[Any, Any] = {
            "role": None if self.role is MISSING else self.role,
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
        if self.logprobs is not MISSING:
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

    __slots__ = ("_choices", "_count", "_parts", "_prefix", "_suffix", "_top", "ended")

    def __init__(self) -> None:
        self.ended = False  # the end is `data: [DONE]`, which is no JSON event (StreamCapture)
        self._top: dict[Any, Any] = {}  # first-seen key order, last non-null value
        self._choices: dict[int, _Choice] = {}
        self._count = 0
        # `add_same_run`'s template: the last event's text around its one appended string.
        self._prefix: str | None = None
        self._suffix = ""
        self._parts: list[str] = []  # where that string's value goes

    def add(self, event: dict[str, Any]) -> None:
        """Fold one parsed event into the merge; non-objects are ignored."""
        if not isinstance(event, dict):
            return
        self._prefix = None  # the template was the last event's: this one is the last now
        self._count += 1
        top = self._top
        for key, value in event.items():
            if key == "choices" or key == "object":
                top.setdefault(key, None)  # remember its position only
            elif value is not None or key not in top:
                top[key] = value  # last non-null, inlined
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for pos, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            index = index_of(choice.get("index"), pos)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice()
            state.add(choice)

    def learn(self, event: dict[str, Any], text: str) -> None:
        """After `add(event)`: keep `text` as the template `add_same_run` folds by.

        Only for an event whose merge, apart from one string it appends (the
        delta's `content`, or a reasoning key), gives the same state when
        applied again: one choice, no tool calls, no `text`, no logprobs.
        Every other key is first-non-null or last-non-null, so an event that
        repeats them changes nothing but that string.  The string's place in
        the text is proven by parsing the text with another string there.
        """
        self._prefix = None
        try:
            choices = event.get("choices")
            if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
                return
            choice = choices[0]
            delta = choice.get("delta")
            if (
                type(delta) is not dict
                or isinstance(choice.get("text"), str)
                or choice.get("logprobs") is not None
                or isinstance(delta.get("tool_calls"), list)
            ):
                return
            keys = [k for k in _APPENDED_KEYS if isinstance(delta.get(k), str)]
            if len(keys) != 1:
                return
            key = keys[0]
            needle = f'"{key}":"'
            if text.count(needle) != 1:
                return
            start = text.index(needle) + len(needle)
            end = string_end(text, start)
            if end < 0:
                return
            prefix, suffix = text[:start], text[end:]
            probe = "llmp-probe" if delta[key] != "llmp-probe" else "llmp-probe-2"
            expect = dict(event)
            expect["choices"] = [dict(choice, delta=dict(delta, **{key: probe}))]
            if canonical.loads(prefix + probe + suffix) != expect:
                return  # the string found is not (only) that one: e.g. a duplicate key
            state = self._choices[index_of(choice.get("index"), 0)]
            self._parts = state.content if key == "content" else state.reasoning[key]
            self._prefix, self._suffix = prefix, suffix
        except Exception:  # a surprise costs the fast path only
            self._prefix = None

    def add_same_run(self, texts: list[str], start: int) -> int:
        """Fold the events of `texts[start:]` that are the last one's text with another
        appended string, until one is not; the index of that one.

        A folded event's string is appended, and nothing else changes
        (`learn`).  The caller parses the first one not folded and calls
        `add`, as for any event.  One loop for a run of events:
        llama-server's content deltas come hundreds in a row.
        """
        prefix = self._prefix
        if prefix is None:
            return start
        suffix = self._suffix
        low, cut = len(prefix), len(suffix)
        append = self._parts.append
        at = start
        for text in texts[start:] if start else texts:
            end = len(text) - cut
            if end < low or not text.startswith(prefix) or not text.endswith(suffix):
                break
            body = text[low:end]
            if '"' in body or "\\" in body or not body.isprintable():
                # Escapes, or characters printed as such: let the JSON parser
                # say whether it is one string, and what it holds.
                try:
                    body = _STRING.decode(f'"{body}"')
                except Exception:
                    break
            append(body)  # else a JSON string body with nothing to unescape
            at += 1
        self._count += at - start
        return at

    def result(self) -> dict[str, Any] | None:
        """The merged completion, or None if no event was added."""
        if not self._count:
            return None
        out: dict[Any, Any] = dict(self._top)
        out["choices"] = [self._choices[i].result(i) for i in sorted(self._choices)]
        out["object"] = "chat.completion"
        return out
