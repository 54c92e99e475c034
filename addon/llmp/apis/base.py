"""What every chat API module provides, and the digest pieces they share.

An API module is the single home of what llmp knows about one API: which
requests belong to it, its request digest, how its stream is merged, its
response digest, and the counters the analyzer reads from its responses.
Each one subclasses `ChatApi`; `llmp.apis` lists them.

The message digest shape (R4, R5) is the same for every API: a role, an
identity hash, the size of the text and the hashes of its two ends (and, for a
long text, its content-defined chunks: `llmp.format.chunks`).  Each
API decides what its identity value and its text are; `digest_message`
turns those into the digest.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import msgspec

from llmp.format import canonical
from llmp.format.canonical import (
    EMPTY_HASH,
    dumps,
    hash_bytes,
    hash_text,
    tagged_text,
    tagged_value,
)
from llmp.format.chunks import LONG_CHARS, chunks_of
from llmp.format.measure import MV, SERVER
from llmp.format.schema import (
    CacheBreakpoint,
    CacheDigest,
    CacheOptions,
    MessageDigest,
    Params,
    RequestDigest,
    ResponseDigest,
    StreamKind,
    ToolCallRef,
    ToolDigest,
)

EDGE_CHARS = 256
"""The head and tail windows of a message text, in Unicode scalar values (R5)."""

__all__ = [
    "EDGE_CHARS",
    "FIELDS",
    "CacheUsage",
    "ChatApi",
    "CountHints",
    "Counts",
    "DigestCache",
    "Marks",
    "Merger",
    "ToolsOf",
    "cache_options",
    "content_marks",
    "count",
    "diagnosis_safe",
    "digest_message",
    "edge_hashes",
    "enum_only",
    "enum_value",
    "first_int",
    "hashed_setting",
    "int_index",
    "is_set",
    "make_tool_digest",
    "marker_list",
    "nonneg",
    "nonneg_int",
    "nonneg_number",
    "string_end",
    "text_of",
    "tools_part",
    "top_level_spans",
]


# -- the interface -------------------------------------------------------------


class Merger(Protocol):
    """Folds a stream's parsed events into the API's non-streamed body."""

    ended: bool
    """The API's own end-of-stream event was seen (R29)."""

    def add(self, event: dict[str, Any]) -> None:
        """Fold one event (a JSON object) in; anything unexpected costs only that field."""

    def result(self) -> dict[str, Any] | None:
        """The merged body, or None when no event was added."""


FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "prefill_ms",
    "decode_ms",
    "load_ms",
)


@dataclass(slots=True)
class Counts:
    """The seven counters of a report row; None means the server did not say."""

    prompt_tokens: MV | None = None
    completion_tokens: MV | None = None
    reused_tokens: MV | None = None
    evaluated_tokens: MV | None = None
    prefill_ms: MV | None = None
    decode_ms: MV | None = None
    load_ms: MV | None = None
    # Not in the report: how Ollama's prompt_eval_count was read.
    meaning: str | None = None
    cache_write_tokens: MV | None = None
    """Not among the seven: the prompt tokens this request wrote into the server's
    cache, where the server says (vLLM's `created_cache_tokens`); what it held of the
    prompt afterwards is `reused_tokens` plus this (`apis.servers.ReuseSteps`)."""

    @classmethod
    def server(
        cls,
        prompt: float | None,
        completion: float | None,
        reused: float | None,
        evaluated: float | None,
    ) -> Counts:
        """The four token counters as the server reported them (None: it did not say)."""
        return cls(
            None if prompt is None else (prompt, SERVER),
            None if completion is None else (completion, SERVER),
            None if reused is None else (reused, SERVER),
            None if evaluated is None else (evaluated, SERVER),
        )

    def reported(self) -> list[str]:
        """The fields the server itself reported."""
        return [f for f in FIELDS if (v := getattr(self, f)) is not None and v[1] == SERVER]


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """R35's split of a prompt as the server reported it: read from the cache, written to
    it, and neither.  The three add up to the prompt."""

    read: int
    write: int
    """Every token written; `write_1h` of them with a one-hour (or a longer) life."""
    write_1h: int
    uncached: int
    output: int | None = None
    tier: str | None = None
    """The service tier the response reports it ran at (OpenAI's `service_tier`)."""
    retention: str | None = None
    """The retention the response reports (OpenAI's `prompt_cache_retention`)."""
    ttl: str | None = None
    """The time-to-live the response reports (OpenAI's `prompt_cache_options.ttl`)."""

    @property
    def prompt(self) -> int:
        return self.read + self.write + self.uncached

    @property
    def cached(self) -> int:
        """What this request left readable: the tokens it read and the ones it wrote."""
        return self.read + self.write

    @property
    def write_5m(self) -> int:
        """The tokens written with the default (five-minute) life."""
        return self.write - self.write_1h


@dataclass(frozen=True, slots=True)
class CountHints:
    """What the analysis knows beyond the response, for counters that need it."""

    estimated_prompt: MV = (0, "estimate")
    """The prompt's size in composition units (tokenizer counts or estimates)."""
    evaluated_share: float = 0.4
    known_old: bool = False
    """An earlier response proved Ollama's old prompt_eval_count meaning."""


class ChatApi:
    """One chat API.  Subclasses set the class attributes and the methods."""

    name: ClassVar[str]
    """The `api` value of its rows (R6, R21)."""
    stream: ClassVar[StreamKind]
    """How it streams: "sse" or "ndjson"."""
    messages_key: ClassVar[str] = "messages"
    """The body's array of messages, each digested alone (`item_digest`)."""
    stream_default: ClassVar[bool] = False
    """`params.stream` when the request does not say."""
    stream_usage_asked: ClassVar[bool] = False
    """Its streams carry a usage only when the request asks for one (Chat Completions'
    `stream_options.include_usage`)."""
    _cache: DigestCache | None = None

    def matches(self, method: str, path: str) -> bool:
        """Whether a request (its path without the query) belongs to this API."""
        raise NotImplementedError

    def request_digest(
        self,
        body: dict[str, Any],
        items: list[tuple[MessageDigest, Marks]] | None = None,
        tools_of: ToolsOf | None = None,
    ) -> RequestDigest:
        """The request digest of a body (an object), in R4's shape for every API.

        `items`: the digests of the items of `body[messages_key]`, with their
        `Marks`, and `tools_of`: `tools_of` of `body["tools"]`, already taken
        (`request_digest_bytes`); the body need not hold those values then.
        What differs by API is asked of its hooks: `messages_with_text` (or
        `leading_with_text` before `items`), `tools_digest`, `params`, and for
        R35's `cache` `item_marks` (`leading_marks`), `cache_markers` and
        `cache_settings`.
        """
        if items is None:
            messages = [d for d, _ in self.messages_with_text(body)]
            marks = self.messages_marks(body)
        else:
            messages = [d for d, _ in self.leading_with_text(body)]
            messages += [d for d, _ in items]
            marks = self.leading_marks(body) + [m for _, m in items]
        model = body.get("model")
        tools, tools_hash, tool_breaks = (
            self.tools_of(body.get("tools")) if tools_of is None else tools_of
        )
        return {
            "model": model if isinstance(model, str) else None,
            "params": self.params(body),
            "messages": messages,
            "tools": tools,
            "tools_hash": tools_hash,
            "cache": self.cache_digest(body, marks, tool_breaks),
        }

    def tools_of(self, tools: Any) -> ToolsOf:
        """`tools_digest` of a body's `tools` value, and the tools' cache markers."""
        digests, tools_hash = self.tools_digest(tools)
        return digests, tools_hash, marker_list(tools, self.cache_markers)

    # -- R35: what the request tells a provider's prompt cache ---------------------

    cache_markers: ClassVar[tuple[str, ...]] = ()
    """The keys of a block (or tool) that mark a cache breakpoint in this API."""

    def item_marks(self, item: Any) -> Marks:
        """The `Marks` of one item of the body's `messages_key` array, any JSON value:
        its content's blocks (a string is one), and the markers on them."""
        content = item.get("content") if isinstance(item, dict) else None
        return content_marks(content, self.cache_markers)

    def leading_marks(self, body: dict[str, Any]) -> list[Marks]:
        """The `Marks` of what `leading_with_text` gives (none by default)."""
        return []

    def messages_marks(self, body: dict[str, Any]) -> list[Marks]:
        """The `Marks` of each digest message, in `messages_with_text`'s order."""
        marks = self.leading_marks(body)
        items = body.get(self.messages_key)
        if isinstance(items, list):
            marks.extend(self.item_marks(item) for item in items)
        return marks

    def cache_settings(self, body: dict[str, Any], marks: list[Marks]) -> dict[str, Any]:
        """The API's settings whose change misses a provider's cache (R35), every key
        always present (None when not sent); none by default."""
        return {}

    def cache_digest(
        self, body: dict[str, Any], marks: list[Marks], tool_breaks: list[tuple[int, Any]]
    ) -> CacheDigest | None:
        """R35's `cache`: the breakpoints in prompt order, the blocks per message, the
        settings, and the cache fields of the body, without any text."""
        breakpoints: list[CacheBreakpoint] = [
            {"at": "tools", "index": i, "block": 0, "ttl": ttl} for i, ttl in tool_breaks
        ]
        for index, mark in enumerate(marks):
            breakpoints.extend(
                {"at": "messages", "index": index, "block": block, "ttl": ttl}
                for block, ttl in mark.breaks
            )
        auto = body.get("cache_control")
        key = body.get("prompt_cache_key")
        stream_options = body.get("stream_options")
        include = stream_options.get("include_usage") if isinstance(stream_options, dict) else None
        return {
            "breakpoints": breakpoints,
            "auto": {"ttl": enum_value(auto.get("ttl"))} if isinstance(auto, dict) else None,
            "blocks": [mark.blocks for mark in marks],
            "settings": self.cache_settings(body, marks),
            "key": hashed_key(key),
            "retention": enum_value(body.get("prompt_cache_retention")),
            "options": cache_options(body.get("prompt_cache_options")),
            "include_usage": include if isinstance(include, bool) else None,
        }

    def leading_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        """What `messages_with_text` puts before the items of `messages_key`: a system
        prompt the API keeps in a field of its own (none by default)."""
        return []

    def params(self, body: dict[str, Any]) -> Params:
        """The digest's `params`: the API's own fields for each (R4)."""
        stream = body.get("stream")
        return {
            "max_tokens": self.max_tokens(body),
            "response_format": self.response_format(body),
            "grammar": self.grammar(body),
            "stream": stream if isinstance(stream, bool) else self.stream_default,
        }

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        """The reply's token limit the request sets, if any."""
        raise NotImplementedError

    def response_format(self, body: dict[str, Any]) -> bool:
        """Whether the request asks for a structured reply (a JSON schema or format)."""
        raise NotImplementedError

    def grammar(self, body: dict[str, Any]) -> bool:
        """Whether the request constrains the reply with a grammar (none by default)."""
        return False

    def tools_digest(self, tools: Any) -> tuple[list[ToolDigest], str | None]:
        """The `tools` digests and `tools_hash` of a body's `tools` value (`tools_part`)."""
        return tools_part(self, tools, self.tool_name)

    @staticmethod
    def tool_name(tool: Any) -> Any:
        """A tool definition's name (`name`; None when it has none)."""
        return tool.get("name") if isinstance(tool, dict) else None

    def item_digest(self, item: Any) -> MessageDigest:
        """The digest of one item of the body's `messages_key` array, any JSON value."""
        raise NotImplementedError

    def request_digest_bytes(self, data: bytes) -> RequestDigest | None:
        """`request_digest` of the body `data` holds; None when it holds no JSON object.

        The same digest, taken faster when the body repeats messages sent
        before: an agent resends its whole history every turn.  Each item of
        the messages array is cut out unparsed (msgspec's `Raw`), and its
        digest is looked up by its bytes (`DigestCache`); only the others
        are parsed (`canonical.loads`, at their depth) and digested.  The
        rest of the body is parsed as always.  Whatever this path cannot
        vouch for (no messages array, a repeated top-level key, anything
        unusual) goes the plain way: the whole body parsed, then digested.
        """
        try:
            digest = self._digest_by_items(data)
        except Exception:  # not JSON, or not as expected: the plain way decides
            digest = None
        if digest is not None:
            return digest
        try:
            body = canonical.loads(data)
        except canonical.NotJSON:
            return None
        return self.request_digest(body) if isinstance(body, dict) else None

    def _digest_by_items(self, data: bytes) -> RequestDigest | None:
        top = _top_level(data)
        if top is None:
            return None
        key = self.messages_key
        raw_items = top.pop(key, None)
        if raw_items is None:
            return None
        raw_tools = top.pop("tools", None)
        body = {name: canonical.loads(raw, depth=1) for name, raw in top.items()}
        cache = self._cache
        if cache is None:
            cache = self._cache = DigestCache()
        tools_of = None
        if raw_tools is not None:  # agents resend the same tools every turn too
            tools_key = _TOOLS + bytes(raw_tools)
            tools_of = cache.get(tools_key)
            if tools_of is None:
                tools_of = self.tools_of(canonical.loads(tools_key[1:], depth=1))
                cache.put(tools_key, tools_of)
        items: list[tuple[MessageDigest, Marks]] = []
        for raw in _ITEMS.decode(raw_items):  # not an array: raises, the plain way
            item = bytes(raw)
            entry = cache.get(item)
            if entry is None:
                value = canonical.loads(item, depth=2)
                entry = (self.item_digest(value), self.item_marks(value))
                cache.put(item, entry)
            items.append(entry)
        return self.request_digest(body, items, tools_of)

    def merger(self) -> Merger:
        """A fresh merger for one streamed response."""
        raise NotImplementedError

    def response_digest(self, body: dict[str, Any]) -> ResponseDigest:
        """The response digest of a (merged) body: the counters verbatim, the reply's sizes."""
        raise NotImplementedError

    def counts(self, usage: dict[str, Any], hints: CountHints) -> Counts:
        """The row's counters from the response digest's `usage`."""
        raise NotImplementedError

    def cache_usage(self, top: dict[str, Any]) -> CacheUsage | None:
        """R35's cache read, write and uncached split from the response digest's `usage`
        (every top-level field of the reply), or None where the server reports none."""
        return None

    def provider_reason(self, top: dict[str, Any]) -> str | None:
        """R37: the provider's own cache diagnosis of this request in its own word, `none`
        where it compared and found nothing, `not_ready` where it had no answer yet;
        None where the response carries no diagnosis."""
        return None

    def count_targets(self, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        """What `--tokenize` counts: `{hash: text}` for the messages and for the tools."""
        messages: dict[str, str] = {}
        with hashes_only():
            pairs = self.messages_with_text(body)
        for digest, text in pairs:
            messages.setdefault(digest["hash"], text)
        tools: dict[str, str] = {}
        for tool in _list(body.get("tools")):
            canon = self.tool_json(tool)
            tools.setdefault(hash_bytes(canon), canon.decode("utf-8"))
        return messages, tools

    def messages_with_text(self, body: dict[str, Any]) -> list[tuple[MessageDigest, str]]:
        """Each message's digest with its text (the text never leaves the process)."""
        raise NotImplementedError

    def tool_json(self, tool: Any) -> bytes:
        """The canonical JSON a tool definition is hashed and sized by."""
        return dumps(tool)

    def context_limit(self, body: Any) -> int | None:
        """A context size the request itself sets (full bodies only), if the API has one."""
        return None

    def __repr__(self) -> str:
        return f"<api {self.name}>"


ToolsOf = tuple[list[ToolDigest], str | None, list[tuple[int, Any]]]
"""A tools value's digests, `tools_hash`, and its markers (`ChatApi.tools_of`)."""


class Marks(NamedTuple):
    """What one digest message tells a provider's prompt cache (R35), no text."""

    blocks: int
    """Its content blocks: a string is one (Anthropic's lookback counts blocks)."""
    breaks: tuple[tuple[int, Any], ...] = ()
    """`(block, ttl)` of each cache marker in it, in order."""
    images: int = 0
    """Its `image` blocks (Anthropic: images added or removed miss the cache)."""


# -- the digest cache --------------------------------------------------------------

CACHE_BYTES = 16 << 20
"""What a `DigestCache` holds at most: its keys' bytes, and `ENTRY_BYTES` per entry."""
ENTRY_BYTES = 512
"""About what a message digest costs in memory, beside its key."""
CHUNKS_BYTES = 2048
"""More per entry whose message is long enough to keep chunks (`format.chunks`): its
lists of ends and hashes, about 1-2 KB (at most 128 chunks a size)."""


class DigestCache:
    """Message digests (and tools digests) by their JSON bytes; the least recently used go first.

    A digest is a function of the message's value alone, and the same bytes
    parse to the same value, so a hit gives exactly the digest a parse
    would.  The digests are shared, not copied: whoever gets one must not
    change it.  One cache per API: their digests differ for the same bytes.
    """

    __slots__ = ("_map", "max_bytes", "size")

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._map: dict[bytes, Any] = {}  # oldest first

    def get(self, key: bytes) -> Any:
        digest = self._map.pop(key, None)
        if digest is not None:
            self._map[key] = digest  # now the most recent
        return digest

    @staticmethod
    def cost(key: bytes) -> int:
        """What an entry holds, as far as the bound counts it."""
        return len(key) + ENTRY_BYTES + (CHUNKS_BYTES if len(key) > LONG_CHARS else 0)

    def put(self, key: bytes, digest: Any) -> None:
        cost = self.cost(key)
        if cost > self.max_bytes:
            return
        if key in self._map:
            return
        self._map[key] = digest
        self.size += cost
        while self.size > self.max_bytes:
            old = next(iter(self._map))
            del self._map[old]
            self.size -= self.cost(old)

    def __len__(self) -> int:
        return len(self._map)


_ENVELOPE = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_KEY = msgspec.json.Decoder(str)
_TOOLS = b"\x00"
"""Before a `tools` value's bytes in the cache: no message's JSON starts with it."""
_WS = b" \t\r\n"
_SPACE = re.compile(rb"[ \t\r\n]*")


def top_level_spans(
    data: bytes,
) -> tuple[dict[str, msgspec.Raw], dict[str, tuple[int, int]]] | None:
    """The top-level values of a JSON object, unparsed, and where each lies in `data`
    (start, end); None where `_top_level` says None.  Raises if `data` is no JSON.

    For a change that must keep every other byte of a body as it was (the recorder's
    opt-in diagnosis, R37)."""
    spans: dict[str, tuple[int, int]] = {}
    top = _top_level(data, spans)
    return None if top is None else (top, spans)


def _top_level(
    data: bytes, spans: dict[str, tuple[int, int]] | None = None
) -> dict[str, msgspec.Raw] | None:
    """The top-level values of a JSON object, unparsed; None if a key repeats.

    msgspec keeps a repeated key's last value and skips the others without
    checking their text (UTF-8, escapes), which a full parse would reject.
    So the text must be exactly `{`, each key as a JSON string, `:` and its
    value, in order and `,`-separated, then `}`, with whitespace between.
    `spans`, when given, gets each value's (start, end) in `data`.
    """
    top = _ENVELOPE.decode(data)
    if not top:
        return None
    ws = _SPACE.match
    pos = 0
    opener = b"{"
    for key, raw in top.items():
        pos = ws(data, pos).end()  # type: ignore[union-attr]
        if data[pos : pos + 1] != opener:
            return None
        pos = ws(data, pos + 1).end()  # type: ignore[union-attr]
        end = string_end(data, pos + 1) if data[pos : pos + 1] == b'"' else -1
        if end < 0 or _KEY.decode(data[pos : end + 1]) != key:
            return None
        pos = ws(data, end + 1).end()  # type: ignore[union-attr]
        if data[pos : pos + 1] != b":":
            return None
        pos = ws(data, pos + 1).end()  # type: ignore[union-attr]
        if not data.startswith(raw, pos):
            return None
        if spans is not None:
            spans[key] = (pos, pos + len(raw))
        pos += len(raw)
        opener = b","
    return top if data[pos:].strip(_WS) == b"}" else None


def string_end(text: str | bytes, start: int) -> int:
    """The index of the quote ending the JSON string whose body starts at `start`, or -1.

    For the text of a JSON document (`str`) or its bytes alike: a quote ends
    the string unless an odd number of backslashes comes right before it.
    """
    quote, backslash = ('"', "\\") if isinstance(text, str) else (b'"', b"\\")
    end = start
    while True:
        end = text.find(quote, end)  # type: ignore[arg-type]
        if end < 0:
            return -1
        slashes = 0
        while text[end - 1 - slashes : end - slashes] == backslash:
            slashes += 1
        if not slashes % 2:
            return end
        end += 1


# -- shared digest pieces --------------------------------------------------------


def is_set(value: Any) -> bool:
    """The spec's "set": present, not null, and not an empty string."""
    return value is not None and value != ""


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def first_int(*values: Any) -> int | None:
    """The first non-negative integer among the values (booleans are not integers)."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
    return None


def text_of(value: Any) -> str:
    """A string value, or "" for anything else (a damaged field reads as empty)."""
    return value if isinstance(value, str) else ""


def int_index(value: Any) -> int | None:
    """An integer `index` of a stream event (booleans are not), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def nonneg_int(value: Any) -> int | None:
    """A non-negative plain `int` (no bool, no float), else None: a counter as sent."""
    return value if type(value) is int and value >= 0 else None


def nonneg_number(value: Any) -> float | None:
    """A non-negative number as a plain float (a full record's RawFloat too), else None."""
    if type(value) is float or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return float(value) if value >= 0 else None
    return None


MAX_COUNT = (1 << 63) - 1
"""A token counter past 63 bits is a damaged one: the fast reader refuses it too, and the
sums of a few such would not fit the 64 bits a report's integer has."""


def nonneg(d: dict[str, Any], key: str) -> int | None:
    """`d[key]` when it is a non-negative integer a counter can be (`MAX_COUNT`)."""
    v = d.get(key)
    return v if type(v) is int and 0 <= v <= MAX_COUNT else None


def count(d: Any, key: str) -> int | None:
    """`nonneg` of `d[key]`, where `d` may be anything (None when it is no object)."""
    return nonneg(d, key) if type(d) is dict else None


_ENUM = re.compile(r"[A-Za-z0-9_.:-]{0,64}")


def enum_value(value: Any) -> Any:
    """A setting as the digest keeps it: null, a bool, a number or a short enum-like
    string verbatim; anything else (a longer string, one with spaces, an object)
    as `fnv1a:<16 hex>` of its canonical JSON, since it could hold text."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and _ENUM.fullmatch(value):
        return value
    return tagged_value(value)


def hashed_setting(value: Any) -> str | None:
    """A setting that may hold text or a schema: `fnv1a:<16 hex>` of its canonical JSON,
    or None when it was not sent (or null)."""
    return None if value is None else tagged_value(value)


def enum_only(value: Any) -> Any:
    """`enum_value` without the hash: a value that is not an enum-like scalar is MISSING
    (dropped), for a response, which keeps no hash of what it does not need."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and _ENUM.fullmatch(value):
        return value
    return MISSING


def hashed_key(key: Any) -> str | None:
    """A `prompt_cache_key` as a digest keeps it (R1): a string's text hashed, any other
    value's canonical JSON; None when there is none."""
    if key is None:
        return None
    return tagged_text(key) if isinstance(key, str) else tagged_value(key)


def diagnosis_safe(value: Any, enums: tuple[str, ...] = ("type", "reason")) -> Any:
    """A provider's cache diagnosis (R37) without any text: objects keep their numbers,
    booleans and nulls, their `enums` (enum-like strings; by default `type` and
    `reason`) and their nested objects so filtered; every other string, and every array,
    goes.  A value that is no object is kept only when it is a number, a boolean or
    null.  With no `enums`, an object's numbers alone (OpenAI's `tool_usage`)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(item, dict):
                out[key] = diagnosis_safe(item, enums)
            elif isinstance(item, str):
                if key in enums and _ENUM.fullmatch(item):
                    out[key] = item
            elif item is None or isinstance(item, (bool, int, float)):
                out[key] = item
        return out
    return value if value is None or isinstance(value, (bool, int, float)) else None


def cache_options(options: Any) -> CacheOptions | None:
    """`prompt_cache_options`: `mode` and `ttl` as enums, and whether it names a
    response to compare with (the response's id is not kept)."""
    if not isinstance(options, dict):
        return None
    return {
        "mode": enum_value(options.get("mode")),
        "ttl": enum_value(options.get("ttl")),
        "comparison": options.get("comparison_response_id") is not None,
    }


def _marker(block: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The `ttl` of a block's cache marker (None when the marker has none), or MISSING
    when it carries none: a marker is an object under one of `keys`."""
    for key in keys:
        marker = block.get(key)
        if isinstance(marker, dict):
            return enum_value(marker.get("ttl"))
    return MISSING


def marker_list(values: Any, keys: tuple[str, ...]) -> list[tuple[int, Any]]:
    """`(index, ttl)` of the objects of a list that carry a cache marker."""
    if not keys or not isinstance(values, list):
        return []
    out = []
    for i, value in enumerate(values):
        if isinstance(value, dict) and (ttl := _marker(value, keys)) is not MISSING:
            out.append((i, ttl))
    return out


def content_marks(content: Any, keys: tuple[str, ...], extra_blocks: int = 0) -> Marks:
    """The `Marks` of a content value: a string is one block, an array has its elements;
    a marker on a block, or on a block nested in its own `content` (an Anthropic tool
    result's), is a breakpoint at that block."""
    if isinstance(content, str):
        return Marks(1 + extra_blocks)
    if not isinstance(content, list):
        return Marks(extra_blocks)
    breaks: list[tuple[int, Any]] = []
    images = 0
    for b, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        images += block.get("type") == "image"
        inner = block.get("content")
        if isinstance(inner, list):
            for sub in inner:
                if isinstance(sub, dict):
                    images += sub.get("type") == "image"
                    if keys and (ttl := _marker(sub, keys)) is not MISSING:
                        breaks.append((b, ttl))
        if keys and (ttl := _marker(block, keys)) is not MISSING:
            breaks.append((b, ttl))
    return Marks(len(content) + extra_blocks, tuple(breaks), images)


def edge_hashes(text: str) -> tuple[str, str]:
    """The head and tail hashes of a text (R5)."""
    if not text:
        return EMPTY_HASH, EMPTY_HASH
    if len(text) <= EDGE_CHARS:
        whole = hash_text(text)
        return whole, whole
    return hash_text(text[:EDGE_CHARS]), hash_text(text[-EDGE_CHARS:])


_KEEP_CHUNKS: ContextVar[bool] = ContextVar("llmp_keep_chunks", default=True)


@contextmanager
def hashes_only() -> Iterator[None]:
    """Message digests without their chunks, for a caller that reads only the hashes: the
    recorder's diagnosis, on the client's request path, and `--tokenize`'s targets.
    Chunking a long text costs far more than hashing it (60 ms against 3 ms for a
    330 KB request read cold, `bench/diagnosis_digest.py`).  Never around a digest that
    is written, nor one put in a `DigestCache` whose digests are."""
    token = _KEEP_CHUNKS.set(False)
    try:
        yield
    finally:
        _KEEP_CHUNKS.reset(token)


def digest_message(
    role: Any,
    identity: Any,
    text: str,
    tool_calls: list[ToolCallRef],
    tool_call_id: Any = None,
    name: Any = None,
) -> MessageDigest:
    """A message digest from its identity value (hashed as canonical JSON) and its text.

    A long text also keeps its chunks (`format.chunks`): where inside it a later version
    changed, and where that change ends (not under `hashes_only`).
    """
    head, tail = edge_hashes(text)
    return {
        "role": role,
        "hash": hash_bytes(dumps(identity)),
        "chars": len(text),
        "head": head,
        "tail": tail,
        "tool_calls": tool_calls,
        "tool_call_id": tool_call_id,
        "name": name,
        "chunks": chunks_of(text) if _KEEP_CHUNKS.get() else None,
    }


def make_tool_digest(name: Any, canon: bytes) -> ToolDigest:
    """A tool definition's name, and hash and size of its canonical JSON."""
    return {"name": name, "hash": hash_bytes(canon), "chars": len(canon.decode("utf-8"))}


def tools_part(api: ChatApi, tools: Any, name_of: Any) -> tuple[list[ToolDigest], str | None]:
    """The `tools` digests and `tools_hash` of a tools array (None when there are none)."""
    tool_list = _list(tools)
    digests = [make_tool_digest(name_of(t), api.tool_json(t)) for t in tool_list]
    if not tool_list:
        return digests, None
    return digests, hash_bytes(api.tool_json(tool_list))


# -- shared merge pieces ------------------------------------------------------------


class _Missing:
    """Marker for "this key was never sent" (distinct from a sent ``null``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def index_of(value: Any, pos: int) -> int:
    """An ``index`` field, or ``pos`` (position in its list) when it is not an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return pos


def first_non_empty(cur: Any, new: Any) -> Any:
    """The first value that is neither null nor ``""``; else the first one sent."""
    if cur is MISSING:
        return new
    if new is None or (isinstance(new, str) and not new):
        return cur
    if cur is None or (isinstance(cur, str) and not cur):
        return new
    return cur


def last_non_null(store: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` unless it is null and something was already kept."""
    if value is not None or key not in store:
        store[key] = value
