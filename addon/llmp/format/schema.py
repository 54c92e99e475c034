"""The recording v1 record, typed: what a line holds, field by field.

These TypedDicts are the contract of `../shared/spec/llmp-formats-v1.md` as
Python types, for the writer (which builds records) and the reader (which
reads them back).  A reader must still check every value it uses: a line
can come from any producer.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

RECORD_VERSION = 1

FULL = "full"
DIGEST = "digest"
BODY_MODES = (DIGEST, FULL)

# The `error` values (R13).
UPSTREAM_UNREACHABLE = "upstream_unreachable"
UPSTREAM_RESET = "upstream_reset"
CLIENT_DISCONNECTED = "client_disconnected"
TIMEOUT = "timeout"
BODY_TOO_LARGE = "body_too_large"
ERRORS = (UPSTREAM_UNREACHABLE, UPSTREAM_RESET, CLIENT_DISCONNECTED, TIMEOUT, BODY_TOO_LARGE)

# R32: the request headers that say which program and which session sent a request.
NAMING_HEADERS = ("x-title", "http-referer", "originator", "x-app", "x-stainless-retry-count")
"""Kept verbatim: they name a program, not a person."""
SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "thread-id",
    "x-codex-window-id",
    "x-session-id",
    "x-session-affinity",
    "x-affinity",
)
"""Kept only as `fnv1a:<16 hex>` of the value: they identify a session, and are only
ever compared."""

FEATURE_HEADERS = ("anthropic-beta",)
"""Request headers kept verbatim beside R32's: they name API features, not a person, and
R35 counts the set of `anthropic-beta` values among the settings whose change misses
Anthropic's cache."""

SERVER_HEADERS = ("server",)
"""The response headers kept verbatim besides R15's four: they name the server's program,
which tells the analyzer whose cache model applies (issue 29)."""

# R34: the response headers that tell a cloud provider, and its request, apart.
PROVIDER_HEADERS = ("request-id", "x-request-id", "openai-processing-ms", "openai-version")
"""Kept verbatim: an id of the request, a time, an API version."""
ACCOUNT_HEADERS = (
    "anthropic-organization-id",
    "anthropic-workspace-id",
    "openai-organization",
    "openai-project",
)
"""Kept only as `fnv1a:<16 hex>` of the value: they name an account."""
NAME_ONLY_PREFIXES = ("anthropic-ratelimit-",)
"""Response headers kept by name only, each with the value `""`: which limits a provider
reports, never how much of them is left."""

StreamKind = Literal["sse", "ndjson"]
SSE: StreamKind = "sse"
NDJSON: StreamKind = "ndjson"


class ToolCallRef(TypedDict):
    id: Any
    name: Any


class ChunkLevel(TypedDict):
    """A long text's chunks of one size (`format.chunks`): where each ends, and the
    first hex digits of each one's FNV, one after the other."""

    size: int
    ends: list[int]
    hashes: str


class MessageDigest(TypedDict):
    role: Any
    hash: str
    chars: int
    head: str
    tail: str
    tool_calls: list[ToolCallRef]
    tool_call_id: Any
    name: Any
    chunks: list[ChunkLevel] | None  # additive: a long text's chunks (format.chunks)


class ToolDigest(TypedDict):
    name: Any
    hash: str
    chars: int


class Params(TypedDict):
    max_tokens: int | None
    response_format: bool
    grammar: bool
    stream: bool
    previous_response: NotRequired[bool]  # R25: Responses only


class CacheBreakpoint(TypedDict):
    """One cache marker (R35): `cache_control`, or OpenAI's `prompt_cache_breakpoint`."""

    at: Literal["tools", "messages"]
    index: int
    """The tool's index, or the message's in the digest's `messages`."""
    block: int
    """The content block's index within that message (0 for a tool or a string)."""
    ttl: Any
    """The marker's `ttl` as sent (a short enum, else hashed), or None."""


class CacheAuto(TypedDict):
    ttl: Any


class CacheOptions(TypedDict):
    """`prompt_cache_options` without the response id it may name."""

    mode: Any
    ttl: Any
    comparison: bool


class CacheDigest(TypedDict):
    """What a request tells a provider's prompt cache (R35), no text."""

    breakpoints: list[CacheBreakpoint]
    auto: CacheAuto | None
    """Anthropic's top-level `cache_control` (automatic caching)."""
    blocks: list[int]
    """The content blocks of each digest message (Anthropic's lookback counts them)."""
    settings: dict[str, Any]
    """The API's settings whose change misses the cache, every key always written."""
    key: str | None
    """`prompt_cache_key`, hashed."""
    retention: Any
    options: CacheOptions | None
    include_usage: bool | None
    """Chat's `stream_options.include_usage`: without it a stream reports no usage."""


class RequestDigest(TypedDict):
    model: str | None
    params: Params
    messages: list[MessageDigest]
    tools: list[ToolDigest]
    tools_hash: str | None
    cache: NotRequired[CacheDigest | None]  # R35, additive: null for Ollama's /api/chat


class Output(TypedDict):
    content_chars: int
    reasoning_chars: int
    tool_calls: list[ToolCallRef]


class ResponseDigest(TypedDict):
    usage: dict[str, Any]
    output: Output


class RequestPart(TypedDict):
    method: str
    path: str
    upstream: NotRequired[str | None]  # R34, additive: the host the request went to
    headers: dict[str, str]
    body_bytes: int
    body: Any
    body_text: str | None
    digest: RequestDigest | None
    added: NotRequired[list[str] | None]  # R37, additive: fields the recorder added


class ResponsePart(TypedDict):
    status: int
    headers: dict[str, str]
    stream: StreamKind | None
    chunks: int | None
    bad_chunks: int | None
    body_bytes: int
    truncated: bool
    body: Any
    body_text: str | None
    digest: ResponseDigest | None


class Tokens(TypedDict):
    messages: dict[str, int]
    tools: dict[str, int]


class Record(TypedDict):
    v: int
    id: int
    conn: int
    t_start_ms: int
    t_first_byte_ms: int | None
    t_first_event_ms: NotRequired[int | None]  # R28, additive: written by this recorder
    t_end_ms: int
    request: RequestPart
    response: ResponsePart | None
    error: str | None
    tokens: Tokens | None
