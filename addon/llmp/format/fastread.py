"""A digest record decoded straight into typed structs: the analyzer's fast path.

`format.lines.parse_line` builds a dict for every field of a line, and the
analysis then reads a handful of them.  On a digest recording most of a
line is message digests, and most of the cost of reading it is making
(and later freeing) a dict, eight keys and four strings per message.
`decode_digest(line)` decodes the same line with msgspec into the structs
below, which name only what the record holds, and builds nothing else.

It is a fast path, not a second reader: it accepts a line only when the
plain reader (`parse_line`, orjson) would read the same values from it, and
says None otherwise, so the caller reads that line the plain way.  That
makes the structs strict where orjson is lenient:

* every field the recorder writes is declared with its type, and any other
  field refuses the line (`forbid_unknown_fields`).  So nothing in an
  accepted line is skipped unseen, and its nesting is bounded by the
  structs: orjson refuses lines nested more than 1024 deep, msgspec does
  not, and no accepted line comes near;
* integers must fit in 64 bits: beyond that orjson gives a float where
  msgspec gives an int, and the analysis treats the two differently;
* the response digest's `usage` (every top-level field of the server's
  reply, R: response digest) is kept as raw JSON and parsed by orjson, at
  the depth it has in the line (`usage()`), so it is exactly the plain
  reader's dict; or, when it is llama-server's fields and nothing else, each
  of its type, decoded into `LlamaTop` (`llama_usage()`, or in the line's
  own pass: `decode_llama_digest()`), which the analysis reads as it reads
  that dict;
* a record with a full body (`request.body` or `response.body` not null)
  is refused: full records keep number text (R2) and go the plain way.

Which accepted records the analysis may take this way (chat or not, 2xx,
no error) is the analysis's choice (`llmp.analysis.exchange.fast_ok`).
`Msg` and `ToolDef` are also what the plain path turns its dicts into, so
both paths hand the engine the same objects.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson

__all__ = [
    "NULL",
    "CallRef",
    "DigestRecord",
    "FastCache",
    "FastChunks",
    "FastMsg",
    "FastTool",
    "Histories",
    "LlamaRecord",
    "LlamaResponseDigest",
    "LlamaTop",
    "Msg",
    "ToolDef",
    "ToolLists",
    "decode_digest",
    "decode_llama_digest",
    "llama_usage",
    "usage",
]

Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
"""An integer orjson also reads as an int (it turns larger ones into floats)."""


class Msg(msgspec.Struct, gc=False):
    """One message digest (R4, R5) as the analysis keeps it.

    The plain path fills it from a parsed dict with the values as they were
    (any JSON value: the analysis checks each one where it uses it); the fast
    path decodes `FastMsg`, the same struct with the types checked.
    """

    role: Any
    hash: Any
    chars: Any = None
    head: Any = None
    tail: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None
    chunks: Any = None
    """A long text's chunks (`format.chunks`): a list of objects from the plain path,
    of `FastChunks` from the fast one; absent in older recordings."""


class ToolDef(msgspec.Struct, gc=False):
    """One tool definition's digest: `name`, `hash`, `chars` of its canonical JSON."""

    name: Any = None
    hash: Any = None
    chars: Any = None


class _Strict(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A struct that refuses fields it does not name (see the module's docstring)."""


class CallRef(_Strict):
    """`{id, name}` of a tool call, in a message digest or a reply."""

    id: str | None = None
    name: str | None = None


class FastChunks(_Strict):
    """A long text's chunks of one size (`format.chunks`); `format.chunks.locate` reads
    these as it reads the plain path's objects."""

    size: Int
    ends: tuple[Int, ...]
    hashes: str


class FastMsg(Msg, forbid_unknown_fields=True):
    role: str
    hash: str
    chars: Int | None = None
    head: str | None = None
    tail: str | None = None
    tool_calls: tuple[CallRef, ...] | None = None
    """A tuple: the empty one is shared, most messages call no tool."""
    tool_call_id: str | None = None
    name: str | None = None
    chunks: tuple[FastChunks, ...] | None = None


class FastTool(ToolDef, forbid_unknown_fields=True):
    name: str | None = None
    hash: str | None = None
    chars: Int | None = None


class FastParams(_Strict):
    max_tokens: Int | None = None
    response_format: bool | None = None
    grammar: bool | None = None
    stream: bool | None = None
    previous_response: bool | None = None


NULL = msgspec.Raw(b"null")

Scalar = str | bool | Int | float | None
"""A setting as a cache digest keeps it (an enum, a flag, a number, or a hash)."""


class FastBreakpoint(_Strict):
    """One cache marker of a request (R35): where it is, and its `ttl`."""

    at: str
    index: Int
    block: Int
    ttl: Scalar = None


class FastAuto(_Strict):
    ttl: Scalar = None


class FastCacheOptions(_Strict):
    mode: Scalar = None
    ttl: Scalar = None
    comparison: bool | None = None


class FastCache(_Strict):
    """A request digest's `cache` (R35): what it tells a provider's prompt cache."""

    breakpoints: list[FastBreakpoint] | None = None
    auto: FastAuto | None = None
    blocks: list[Int] | None = None
    settings: dict[str, Scalar] | None = None
    key: str | None = None
    retention: Scalar = None
    options: FastCacheOptions | None = None
    include_usage: bool | None = None


class FastRequestDigest(_Strict):
    model: str | None = None
    params: FastParams | None = None
    messages: msgspec.Raw = NULL
    """Raw JSON: `Histories.decode` makes it a list of `FastMsg`s."""
    tools: msgspec.Raw = NULL
    """Raw JSON: `ToolLists.decode` makes it a list of `FastTool`s."""
    tools_hash: str | None = None
    cache: FastCache | None = None


class FastOutput(_Strict):
    content_chars: Int | None = None
    reasoning_chars: Int | None = None
    tool_calls: list[CallRef] | None = None


class FastResponseDigest(_Strict):
    usage: msgspec.Raw = NULL
    """Raw JSON: `usage()` parses it."""
    output: FastOutput | None = None


class Headers(
    _Strict,
    rename={
        "user_agent": "user-agent",
        "content_type": "content-type",
        "content_length": "content-length",
        "transfer_encoding": "transfer-encoding",
        "x_title": "x-title",
        "http_referer": "http-referer",
        "x_app": "x-app",
        "retry_count": "x-stainless-retry-count",
        "claude_code_session_id": "x-claude-code-session-id",
        "session_id": "session-id",
        "session_id_": "session_id",
        "thread_id": "thread-id",
        "codex_window_id": "x-codex-window-id",
        "x_session_id": "x-session-id",
        "session_affinity": "x-session-affinity",
        "affinity": "x-affinity",
        "anthropic_beta": "anthropic-beta",
    },
):
    """The request headers a record keeps (spec: Request, `headers`; R32; R35's
    `anthropic-beta`), and `server`, which older readers took from a response too."""

    user_agent: str | None = None
    content_type: str | None = None
    content_length: str | None = None
    transfer_encoding: str | None = None
    x_title: str | None = None
    http_referer: str | None = None
    originator: str | None = None
    x_app: str | None = None
    retry_count: str | None = None
    claude_code_session_id: str | None = None
    session_id: str | None = None
    session_id_: str | None = None
    thread_id: str | None = None
    codex_window_id: str | None = None
    x_session_id: str | None = None
    session_affinity: str | None = None
    affinity: str | None = None
    anthropic_beta: str | None = None
    server: str | None = None


class Request(_Strict):
    method: str
    path: str
    upstream: str | None = None
    """R34: the host the request went to."""
    headers: Headers | None = None
    body_bytes: int | None = None
    body: None = None
    body_text: str | None = None
    digest: FastRequestDigest | None = None
    added: list[str] | None = None
    """R37: the request fields the recorder added."""


class Response(_Strict):
    status: Int | None = None
    headers: dict[str, str] | None = None
    """Every value a string, each checked: R34 keeps Anthropic's rate-limit headers by
    name, a set no struct can list (`server`, the providers' ids, R15's four)."""
    stream: str | None = None
    chunks: int | None = None
    bad_chunks: int | None = None
    body_bytes: int | None = None
    truncated: bool | None = None
    body: None = None
    body_text: str | None = None
    digest: FastResponseDigest | None = None


class FastTokens(_Strict):
    messages: dict[str, Int] | None = None
    tools: dict[str, Int] | None = None


class DigestRecord(_Strict):
    """A recording line without a full body, decoded (spec: Record)."""

    v: int
    id: Int
    t_start_ms: Int
    request: Request
    conn: int | None = None
    t_first_byte_ms: Int | None = None
    t_first_event_ms: Int | None = None
    t_end_ms: Int | None = None
    response: Response | None = None
    error: str | None = None
    tokens: FastTokens | None = None


class LlamaDetails(_Strict):
    cached_tokens: Int | None = None


class LlamaUsage(_Strict):
    completion_tokens: Int | None = None
    prompt_tokens: Int | None = None
    total_tokens: Int | None = None
    prompt_tokens_details: LlamaDetails | None = None


class LlamaTimings(_Strict):
    cache_n: Int | None = None
    prompt_n: Int | None = None
    prompt_ms: float | None = None
    prompt_per_token_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_n: Int | None = None
    predicted_ms: float | None = None
    predicted_per_token_ms: float | None = None
    predicted_per_second: float | None = None
    draft_n: Int | None = None
    draft_n_accepted: Int | None = None


class LlamaTop(_Strict):
    """A response digest's `usage` as llama-server writes it, every field named and
    typed: read into this instead of a dict of dicts (`llama_usage`)."""

    id: str | None = None
    object: str | None = None
    created: Int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    usage: LlamaUsage | None = None
    timings: LlamaTimings | None = None


class LlamaResponseDigest(FastResponseDigest):
    """A response digest whose `usage` is llama-server's (or null), decoded in the
    line's own pass instead of a second one (`decode_llama_digest`)."""

    usage: LlamaTop | None = None  # type: ignore[assignment]


class LlamaResponse(Response):
    digest: LlamaResponseDigest | None = None


class LlamaRecord(DigestRecord):
    """`DigestRecord` with llama-server's `usage` typed (`LlamaResponseDigest`)."""

    response: LlamaResponse | None = None


_decode = msgspec.json.Decoder(DigestRecord).decode
_decode_llama_record = msgspec.json.Decoder(LlamaRecord).decode
_decode_llama = msgspec.json.Decoder(LlamaTop).decode
_decode_msgs = msgspec.json.Decoder(list[FastMsg] | None).decode
_decode_tools = msgspec.json.Decoder(list[FastTool] | None).decode
_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

KEY_BYTES = 320
"""How much of a messages array names its conversation in `Histories`: the first
message digest (~200 bytes) and the start of the second, with its hash."""


class Histories:
    """Message lists decoded once: a request's history is its conversation's last
    request's, byte for byte, and then some.

    A conversation resends its whole history on every turn, so the JSON text of a
    request's `messages` begins with the text of the previous request's, less its
    closing bracket.  That takes one comparison of the two texts to see; the
    messages it covers are then the previous request's structs, and only those
    after it are decoded.  The text is exact (equal bytes decode to equal values,
    and the analysis never changes a message), and most requests decode two or
    three messages instead of dozens, and free as few.

    The previous request is found by the start of the text (`KEY_BYTES`: the system
    message and the first user message begin there); a miss only costs a whole
    decode.  At most `size` lists are remembered, the least recently used dropped.
    """

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._last: dict[bytes, tuple[memoryview, list[FastMsg], tuple[str, ...]]] = {}

    def decode(self, raw: msgspec.Raw) -> tuple[list[FastMsg], tuple[str, ...]] | None:
        """The messages (none for a JSON null) and their hashes, or None when the text
        is not a list of message digests as `FastMsg` reads them (read the line the
        plain way).  The hashes are kept with the list: a request's are its previous
        request's and a few more."""
        text = bytes(raw)
        key = text[:KEY_BYTES]
        last = self._last.pop(key, None)
        msgs: list[FastMsg] | None = None
        if last is not None and text.startswith(last[0]):
            stem, prev, hashes = last
            rest = text[len(stem) :]
            if rest == b"]":
                msgs = prev
            elif rest[:1] == b",":
                try:
                    more = _decode_msgs(b"[" + rest[1:])
                except _ERRORS:
                    more = None  # decode it whole: only that says whether it reads
                if more is not None:
                    msgs = prev + more
                    hashes += tuple([m.hash for m in more])
        if msgs is None:
            try:
                msgs = _decode_msgs(text)
            except _ERRORS:
                return None
            if msgs is None:
                return [], ()
            hashes = tuple([m.hash for m in msgs])
        self._last[key] = (memoryview(text)[:-1], msgs, hashes)
        if len(self._last) > self.size:
            del self._last[next(iter(self._last))]
        return msgs, hashes

    def cut(self, line: bytes | memoryview) -> tuple[bytes, Cut] | None:
        """The line with its known messages cut out, for `decode_digest`; None when
        its `messages` text does not begin with a remembered list's.

        Decoding a line scans every byte of it, and most of a line is its history,
        which the previous request of its conversation had already: the cut line
        keeps only the messages after those (`"messages":[` and the new ones), so
        the scan is a few KB instead of the whole line.  Exact: the text cut out
        is byte for byte a list prefix that decoded before, in the same place of
        the line (the only `"messages":` key but the tokens'), so the cut line
        decodes as the whole would, and `decode_cut` adds the known messages
        back.  A line that cannot be cut so is decoded whole.
        """
        text = bytes(line)
        p = text.find(_MESSAGES_KEY)
        if p < 0:
            return None
        p += len(_MESSAGES_KEY)
        key = text[p : p + KEY_BYTES]
        last = self._last.get(key)
        if last is None or not text.startswith(last[0], p):
            return None
        q = p + len(last[0])
        nxt = text[q : q + 2]
        if nxt[:1] == b"]":
            cut = text[:p] + b"[" + text[q:]
        elif nxt == b",{":
            cut = text[:p] + b"[" + text[q + 1 :]
        else:
            return None  # not a list of message digests as the last one was
        again = text.find(_MESSAGES_KEY, q)
        if again >= 0 and (
            text[again - len(_TOKENS_KEY) : again] != _TOKENS_KEY
            or text.find(_MESSAGES_KEY, again + 1) >= 0
        ):
            return None  # a key said twice: the decode would keep the last one
        return cut, (text, p, q, key, last)

    def decode_cut(self, raw: msgspec.Raw, c: Cut) -> tuple[list[FastMsg], tuple[str, ...]] | None:
        """`decode` of a cut line's messages (`cut`): the known ones, then those after."""
        text, p, q, key, (_, prev, hashes) = c
        n = len(memoryview(raw))
        if n == 2:  # `[]`: no new message
            msgs = prev
            end = q
        else:
            try:
                more = _decode_msgs(raw)
            except _ERRORS:
                return None
            if more is None:
                return None
            msgs = prev + more
            hashes += tuple([m.hash for m in more])
            end = q + n - 1
        # The same key (the known messages are longer than it), last in the LRU order;
        # the text is a view of the line's (no copy).
        del self._last[key]
        self._last[key] = (memoryview(text)[p:end], msgs, hashes)
        return msgs, hashes


_MESSAGES_KEY = b'"messages":'
_TOKENS_KEY = b'"tokens":{'


Cut = tuple[bytes, int, int, bytes, tuple[memoryview, list[FastMsg], tuple[str, ...]]]
"""Where `Histories.cut` cut a line: its text, the messages' start, the end of the
known ones, their key and what is remembered under it (a plain tuple: one is made
for most lines)."""


class ToolLists:
    """Tools digests decoded once: a harness resends the same tools array, byte for
    byte, on every request, and its `tools_hash` names it.

    The text is compared whole, so a reused list is exactly what decoding would
    give; the analysis never changes one.  At most `size` are remembered.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._known: dict[str | None, tuple[bytes, list[FastTool]]] = {}

    def decode(self, raw: msgspec.Raw, tools_hash: str | None) -> list[FastTool] | None:
        """The tools (an empty list for a JSON null), or None when the text is not a
        list of tool digests as `FastTool` reads them (read the line the plain way)."""
        text = bytes(raw)
        known = self._known.get(tools_hash)
        if known is not None and known[0] == text:
            return known[1]
        try:
            tools = _decode_tools(text)
        except _ERRORS:
            return None
        if tools is None:
            return []
        if len(self._known) >= self.size:
            self._known.clear()
        self._known[tools_hash] = (text, tools)
        return tools


def decode_digest(line: bytes | memoryview) -> DigestRecord | None:
    """The line as a `DigestRecord`, or None: read it the plain way (`parse_line`).

    None also for a line that is no record at all (`v` not 1, not JSON): the
    plain reader decides what counts as a bad line.
    """
    try:
        rec = _decode(line)
    except _ERRORS:
        return None
    return rec if rec.v == 1 else None


def decode_llama_digest(line: bytes | memoryview) -> LlamaRecord | None:
    """`decode_digest` with the response's `usage` read as a `LlamaTop` (or null) in
    the same pass; None also when `usage` is anything else (then `decode_digest`).

    What it accepts `decode_digest` accepts too, with the same values, and
    `llama_usage` of that usage gives this `LlamaTop`: one decode instead of two
    for a llama-server recording's every line."""
    try:
        rec = _decode_llama_record(line)
    except _ERRORS:
        return None
    return rec if rec.v == 1 else None


def usage(digest: FastResponseDigest) -> Any:
    """The response digest's `usage`, parsed as the plain reader parses it.

    Wrapped in the three levels that hold it in a line (record, response,
    digest), so that orjson's nesting limit applies to it as it does to the
    whole line (a text shorter than twice that limit cannot reach it).  Raises
    orjson.JSONDecodeError where the plain reader would have refused the line.
    """
    raw = digest.usage
    if len(memoryview(raw)) < _SHALLOW:
        return orjson.loads(memoryview(raw))
    return orjson.loads(b"".join((b"[[[", raw, b"]]]")))[0][0][0]


def llama_usage(digest: FastResponseDigest) -> LlamaTop | None:
    """The response digest's `usage` as a `LlamaTop`, or None: parse it with `usage`.

    Only a text that is all llama-server's fields, each of its JSON type, reads
    so; anything else (another server's fields, a string for a count, null) is
    the plain reader's to parse.  Every value is decoded and checked (no field
    is skipped unread), so a text this accepts orjson reads to the same values.
    """
    try:
        return _decode_llama(digest.usage)
    except _ERRORS:
        return None


_SHALLOW = 2000
"""Bytes below which a JSON text cannot nest as deep as orjson's limit (1024 levels
take 2048 brackets)."""
