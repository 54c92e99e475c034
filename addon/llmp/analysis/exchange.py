"""From a recording record to the few facts the analysis needs.

Full-mode bodies are digested here with the recorder's own functions, so a
full and a digest recording of the same traffic give the same facts (R2).
Nothing here keeps message text: only hashes, sizes and counters.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from llmp.analysis.identity import NO_SESSIONS, Sessions, client_name, is_retry, sessions_of
from llmp.analysis.overflow import Refusal, refusal_of
from llmp.apis import ChatApi, api_for, request_digest_of, response_digest_of, strip_query
from llmp.apis.base import CacheUsage
from llmp.apis.openai_chat import OpenAIChat
from llmp.apis.providers import provider_of
from llmp.format.canonical import record_dumps
from llmp.format.fastread import (
    NULL,
    CallRef,
    DigestRecord,
    FastCache,
    FastOutput,
    FastParams,
    FastRequestDigest,
    FastResponseDigest,
    FastTokens,
    Headers,
    Histories,
    LlamaRecord,
    LlamaResponse,
    LlamaResponseDigest,
    LlamaTop,
    Msg,
    Request,
    Response,
    ToolDef,
    ToolLists,
    decode_digest,
    decode_llama_digest,
    llama_usage,
    usage,
)
from llmp.format.lines import parse_line
from llmp.format.measure import ESTIMATE, MV, TOKENIZER, estimate
from llmp.format.schema import NAMING_HEADERS, SESSION_HEADERS

_HASH = operator.itemgetter("hash")
SYSTEM_ROLES = frozenset(("system", "developer"))
MODEL_ROLES = frozenset(("assistant", "tool", "function", "ipython"))

# Skip reasons, in the order they are checked.
NOT_CHAT = "not_chat"
ERROR = "error"
NON_2XX = "non_2xx"
UNPARSED = "unparsed"
SKIP_REASONS = (NOT_CHAT, ERROR, NON_2XX, UNPARSED)


class Skip:
    """A record that does not become a row, and why.

    `refusal` is set for a chat request answered with a 4xx that may have
    been refused for its context (see overflow.py).
    """

    __slots__ = ("chat", "path", "probe", "reason", "refusal")

    def __init__(
        self,
        reason: str,
        path: str | None = None,
        chat: bool = False,
        refusal: Refusal | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.reason = reason
        self.path = path
        self.chat = chat
        self.refusal = refusal
        self.probe = probe


class Probe:
    """What a skipped chat request still says about its client's next move: its
    user-agent, tools and system prompt (a first turn held back is decided by it)."""

    __slots__ = ("sys", "tool_names", "ua")

    def __init__(self, ua: str | None, tool_names: frozenset[str], sys: tuple[str, ...]) -> None:
        self.ua = ua
        self.tool_names = tool_names
        self.sys = sys


def _probe(req: dict[str, Any], api: ChatApi) -> Probe | None:
    """The Probe of a skipped chat request whose request can be read, else None."""
    try:
        digest: Any = request_digest_of(req, api)
    except (ValueError, TypeError, RecursionError):
        return None
    if digest is None:
        return None
    ua, _, _ = identity(headers_of(req.get("headers")))
    msgs = digest.get("messages") if isinstance(digest.get("messages"), list) else []
    sys: list[str] = []
    for m in msgs:
        role = m.get("role") if isinstance(m, dict) else None
        if type(role) is not str or role not in SYSTEM_ROLES:  # a damaged role may be a list
            break
        h = m.get("hash")
        sys.append(h if type(h) is str else "?")
    tools = digest.get("tools") if isinstance(digest.get("tools"), list) else []
    names = frozenset(n for t in tools if isinstance(t, dict) and type(n := t.get("name")) is str)
    return Probe(ua, names, tuple(sys))


_HEADER_FIELDS = tuple((f.name, f.encode_name) for f in msgspec.structs.fields(Headers))
"""`Headers`' fields with their header names (`headers_of`)."""

_IDENTITY_FIELDS = tuple(
    (a, name) for a, name in _HEADER_FIELDS if name in NAMING_HEADERS or name in SESSION_HEADERS
)
"""`Headers`' fields of R32, with their header names."""


def headers_of(headers: Any) -> Headers | None:
    """A parsed record's request (or response) headers as the fast path decodes them: the ones
    `Headers` names, when a string (the analysis reads no other), else None."""
    if type(headers) is not dict:
        return None
    return Headers(**{a: v for a, name in _HEADER_FIELDS if type(v := headers.get(name)) is str})


def response_headers_of(headers: Any) -> dict[str, str] | None:
    """A parsed record's response headers as the fast path decodes them: those whose
    value is a string (the fast path reads a line only when every value is one)."""
    if type(headers) is not dict:
        return None
    return {k: v for k, v in headers.items() if type(v) is str}


def cache_of(cache: Any) -> FastCache | None:
    """A parsed request digest's `cache` (R35) as the fast path decodes it, or None
    where that decode would refuse it (the fast path then reads the line this way)."""
    if cache is None:
        return None
    try:
        return msgspec.convert(cache, FastCache)
    except (msgspec.ValidationError, TypeError, RecursionError):
        pass
    try:  # a full body's digest keeps number text (R2): read it as its digest line would be
        return msgspec.convert(orjson.loads(record_dumps(cache)), FastCache)
    except (msgspec.ValidationError, TypeError, RecursionError, orjson.JSONDecodeError):
        return None


def identity(headers: Headers | None) -> tuple[str | None, Sessions, bool]:
    """A record's client name (`identity.client_name`), separating session values and
    whether it is a retry, from its request `headers`."""
    if headers is None:
        return None, NO_SESSIONS, False
    ua = headers.user_agent or None
    sent = {name: v for attr, name in _IDENTITY_FIELDS if (v := getattr(headers, attr)) is not None}
    if not sent:
        return ua, NO_SESSIONS, False
    return client_name(ua, sent), sessions_of(sent), is_retry(sent)


def tool_defs(tools: list[Any]) -> list[ToolDef | None]:
    """A parsed tools digest as `ToolDef`s, the values as they were; None for an
    entry that is no object (what the fast path decodes, for the plain path)."""
    return [
        ToolDef(t.get("name"), t.get("hash"), t.get("chars")) if isinstance(t, dict) else None
        for t in tools
    ]


def msg_digests(msgs: list[dict[str, Any]]) -> list[Msg]:
    """Parsed message digests (dicts, each with a `hash`) as `Msg`s, the values as they
    were: what the fast path decodes, for the plain path."""
    return [
        Msg(
            m.get("role"),
            m["hash"],
            m.get("chars"),
            m.get("head"),
            m.get("tail"),
            m.get("tool_calls"),
            m.get("tool_call_id"),
            m.get("name"),
            m.get("chunks"),
        )
        for m in msgs
    ]


class Tools:
    """One distinct tools array: names, per-tool sizes, total size."""

    __slots__ = ("entries", "hash", "names", "source", "tokens")

    def __init__(
        self, tools: list[ToolDef | None], tokmap: dict[str, Any] | None, tools_hash: str | None
    ) -> None:
        self.hash = tools_hash
        entries: list[tuple[str, int, str]] = []
        total = 0
        src = TOKENIZER if tokmap is not None else ESTIMATE
        for t in tools:
            if t is None:
                continue
            name = t.name
            h = t.hash
            n = tokmap.get(h) if tokmap is not None and isinstance(h, str) else None
            if type(n) is int:
                tok, s = n, TOKENIZER
            else:
                chars = t.chars
                tok, s = estimate(chars if type(chars) is int else 0), ESTIMATE
                src = ESTIMATE
            entries.append((name if isinstance(name, str) else str(h), tok, s))
            total += tok
        self.entries = entries
        self.names = frozenset(e[0] for e in entries)
        self.tokens = total
        self.source = src


EMPTY_TOOLS = Tools([], None, None)


@dataclass(slots=True, kw_only=True, eq=False)
class Exchange:
    """One chat request that becomes a row, reduced to what the analysis uses."""

    id: int
    api: ChatApi
    t_start: int
    t_first_byte: int | None
    t_first_event: int | None
    t_end: int
    ua: str | None
    """The client's name: its user-agent, or a generic one labelled (R33)."""
    user_agent: str | None
    """The user-agent as sent."""
    sessions: Sessions
    """Separating session header values (R33)."""
    retry: bool
    """`x-stainless-retry-count` above 0 (R33)."""
    requested_model: str | None
    served_model: str
    server: str | None
    """The response's `server` header (vLLM and SGLang: `uvicorn`): whose cache model
    decides an external loss (`apis.servers`)."""
    msgs: list[Msg]
    hashes: tuple[str, ...]
    n_sys: int
    has_model_msgs: bool
    tools: Tools
    tool_digests: list[ToolDef | None]
    structured: bool
    stored_prompt: bool
    """A Responses request with `previous_response_id` (R25): it continues a prompt the
    server stored, which the request does not carry, so it is not compared by messages."""
    max_tokens: int | None
    num_ctx: int | None
    tokmap: dict[str, Any] | None
    top: dict[str, Any] | LlamaTop | None
    streamed: bool
    out_chars: int
    out_tool_names: list[str]
    texts: tuple[str, ...] | None
    """Each message's text, in full mode only: where in a message a change falls."""
    draft_n: int | None
    """llama-server's `timings.draft_n` (a draft model ran), kept out of `Counts`."""
    draft_n_accepted: int | None
    upstream: str | None = None
    """R34: the host the request went to."""
    provider: str | None = None
    """R34: the cloud provider that answered (`apis.providers`), or None for a local server."""
    cache: FastCache | None = None
    """R35: what the request told a provider's prompt cache (breakpoints, settings, key)."""
    betas: str | None = None
    """The `anthropic-beta` values as sent: part of Anthropic's cache settings (R35)."""
    _cum: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)

    def cache_usage(self) -> CacheUsage | None:
        """R35's read, write and uncached split as the server reported it, or None."""
        top = self.top
        if top is None:
            return None
        if type(top) is LlamaTop:
            u = top.usage
            details = u.prompt_tokens_details if u is not None else None
            if u is None or details is None or u.prompt_tokens is None:
                return None
            read = details.cached_tokens
            if read is None or read < 0 or u.prompt_tokens < 0:
                return None
            out = u.completion_tokens
            return CacheUsage(
                read,
                0,
                0,
                max(0, u.prompt_tokens - read),
                out if out is not None and out >= 0 else None,
            )
        assert isinstance(top, dict)
        return self.api.cache_usage(top)

    def provider_reason(self) -> str | None:
        """R37: the provider's own diagnosis of this request, in its word (None: none)."""
        top = self.top
        return self.api.provider_reason(top) if type(top) is dict else None

    def edges(self, i: int) -> tuple[int, Any, Any]:
        """Message i's size in characters and its head and tail hashes (R5)."""
        m = self.msgs[i]
        chars = m.chars
        return (chars if type(chars) is int else 0), m.head, m.tail

    def msg_tokens(self, i: int) -> tuple[int, bool]:
        """Tokens of message i, and whether they came from the tokenizer."""
        if self.tokmap is not None:
            n = self.tokmap.get(self.hashes[i])
            if type(n) is int:
                return n, True
        chars = self.msgs[i].chars
        return estimate(chars if type(chars) is int else 0), False

    def range_tokens(self, lo: int, hi: int) -> MV:
        """Tokens of messages [lo, hi) with the weakest source."""
        if self._cum is not None:
            tok, est = self._cum
            return tok[hi] - tok[lo], ESTIMATE if est[hi] - est[lo] else TOKENIZER
        if self.tokmap is None:
            total = 0
            for m in self.msgs[lo:hi]:
                c = m.chars
                if type(c) is int and c > 0:
                    total += (c + 3) // 4
            return total, ESTIMATE
        self.cumulative()
        return self.range_tokens(lo, hi)

    def cumulative(self) -> tuple[list[int], list[int]]:
        """Prefix sums of tokens and of estimated messages (built once, on demand)."""
        if self._cum is None:
            tok = [0]
            est = [0]
            t = e = 0
            for i in range(len(self.hashes)):
                n, exact = self.msg_tokens(i)
                t += n
                e += not exact
                tok.append(t)
                est.append(e)
            self._cum = (tok, est)
        return self._cum

    def tokens_of(self, indices: list[int]) -> MV:
        """Tokens of the given messages, with the weakest source."""
        tok, est = self.cumulative()
        total = 0
        estimated = False
        for i in indices:
            total += tok[i + 1] - tok[i]
            estimated = estimated or est[i + 1] != est[i]
        if estimated or self.tokmap is None:
            return total, ESTIMATE
        return total, TOKENIZER


def _slow_hashes(msgs: list[Any]) -> tuple[tuple[str, ...], list[Msg]]:
    """Hashes and messages of a damaged digest, every field made safe to use."""
    fixed: list[Msg] = []
    hashes: list[str] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            m = {}
        h = m.get("hash")
        role = m.get("role")
        chars = m.get("chars")
        hashes.append(h if type(h) is str else f"?{i}")
        fixed.append(
            Msg(role if type(role) is str else None, hashes[-1], chars if type(chars) is int else 0)
        )
    return tuple(hashes), fixed


MAX_TEXT_CHARS = 4_000_000
"""Texts of a full-mode request kept at most, for where a change falls."""


def _texts(api: ChatApi, body: dict[str, Any]) -> tuple[str, ...] | None:
    """The message texts of a full body (None past `MAX_TEXT_CHARS`)."""
    texts = tuple(text for _, text in api.messages_with_text(body))
    return texts if sum(map(len, texts)) <= MAX_TEXT_CHARS else None


def draft_counts(top: dict[str, Any] | LlamaTop | None) -> tuple[int | None, int | None]:
    """`timings.draft_n` and `timings.draft_n_accepted`: what speculative decoding drafted
    and kept (llama-server sends both only when a draft model ran); None when not said.

    `top` is a response's usage as the plain reader parses it, or as the fast path
    decodes it: only the reading differs, each count taken when it is an integer."""
    if isinstance(top, LlamaTop):
        timings = top.timings
        if timings is None:
            return None, None
        n, a = timings.draft_n, timings.draft_n_accepted
    else:
        t = top.get("timings") if top is not None else None
        if type(t) is not dict:
            return None, None
        n, a = t.get("draft_n"), t.get("draft_n_accepted")
        n = n if type(n) is int else None
        a = a if type(a) is int else None
    if n is None or n < 0:
        return None, None
    return n, a if a is not None and a >= 0 else None


_APIS: dict[tuple[str, str], ChatApi | None] = {}


def chat_api(method: str, path: str) -> ChatApi | None:
    """`api_for`, remembered: a recording has a handful of distinct (method, path)."""
    key = (method, path)
    try:
        return _APIS[key]
    except KeyError:
        if len(_APIS) > 1024:
            _APIS.clear()
        api = _APIS[key] = api_for(method, path)
        return api


def _tools_of(
    tools: list[ToolDef | None],
    th: Any,
    tools_tok: dict[str, Any] | None,
    tools_cache: dict[str, Tools] | None,
) -> Tools:
    """The Tools of a request's tools digest (`tools_cache`: see `prepare`)."""
    if not tools:
        return EMPTY_TOOLS
    th = th if isinstance(th, str) else None
    if tools_tok is None and tools_cache is not None and th is not None:
        cached = tools_cache.get(th)
        if cached is None:
            if len(tools_cache) > 4096:
                tools_cache.clear()
            cached = tools_cache[th] = Tools(tools, None, th)
        return cached
    return Tools(tools, tools_tok, th)


# -- the fast path: digest records decoded into typed structs (format.fastread) ------


class Digested:
    """A record as `prepare` reads it: typed as the fast path decodes a digest record
    (`read_record`), or as the plain path makes a parsed one so (`digested`), with its
    chat API (None: not chat), its parsed `usage`, its messages and tools, and a full
    record's message texts and request body."""

    __slots__ = ("api", "body", "hashes", "msgs", "rec", "texts", "tools", "top")

    def __init__(
        self,
        rec: DigestRecord,
        api: ChatApi | None,
        top: Any,
        msgs: list[Msg],
        hashes: tuple[str, ...],
        tools: list[ToolDef | None],
        texts: tuple[str, ...] | None = None,
        body: Any = None,
    ) -> None:
        self.rec = rec
        self.api = api
        self.top = top
        self.msgs = msgs
        self.hashes = hashes
        self.tools = tools
        self.texts = texts
        self.body = body


_OPENAI_COUNTS = OpenAIChat.counts
"""The counters that read a `LlamaTop` as they read its dict (`openai_chat.openai_counts`)."""

HISTORIES = Histories()
"""The fast path's message lists, shared by every record it reads."""
TOOL_LISTS = ToolLists()
"""The fast path's tools digests, shared likewise."""


def read_record(line: bytes | memoryview) -> dict[str, Any] | Digested | None:
    """A recording line read for the analysis: the fast way when it can, else the plain
    way (`format.lines.parse_line`); None for a bad line.

    The fast way takes digest records that are no chat request, and chat requests
    answered with a 2xx, without an error, with a request digest: nearly every line of
    a digest recording.  The rest (errors, refusals, full bodies, other producers'
    fields) is rare, and read as before, which keeps one implementation of them.
    """
    cut = HISTORIES.cut(line)
    text = line if cut is None else cut[0]
    d: DigestRecord | None = None
    typed = _USAGE.typed
    if typed:  # llama-server's usage read in the line's own pass
        d = decode_llama_digest(text)
    if d is None:
        d = decode_digest(text)
        if d is not None and typed:
            _USAGE.typed = False  # only the usage told the two decodes apart
        if d is None and cut is not None:
            cut = None  # the whole line decides
            text = line
            d = decode_digest(line)
        if d is None:
            return parse_line(line)
    req = d.request
    api = chat_api(req.method, req.path)
    resp = d.response
    if type(d) is LlamaRecord:
        assert type(resp) is LlamaResponse or resp is None
        lrd = resp.digest if resp is not None else None
        if (
            lrd is not None
            and lrd.usage is not None
            and not (api is not None and type(api).counts is _OPENAI_COUNTS)
        ):
            # llama-server's fields where the API reads `usage` as a dict: read it so.
            _USAGE.typed = False
            d = decode_digest(text)
            assert d is not None  # a raw `usage` takes any JSON the typed one took
            resp = d.response
    digest = d.request.digest
    if api is not None:
        if d.error is not None or resp is None or digest is None:
            return parse_line(line)
        status = resp.status
        if status is None or not 200 <= status < 300:
            return parse_line(line)
    msgs: list[Msg] = []
    hashes: tuple[str, ...] = ()
    tools: list[ToolDef | None] = []
    if digest is not None:
        if cut is None:
            decoded = HISTORIES.decode(digest.messages)
        else:
            decoded = HISTORIES.decode_cut(digest.messages, cut[1])
        decoded_tools = TOOL_LISTS.decode(digest.tools, digest.tools_hash)
        if decoded is None or decoded_tools is None:
            return parse_line(line)
        msgs, hashes = decoded  # type: ignore[assignment]  # FastMsg is a Msg
        tools = decoded_tools  # type: ignore[assignment]  # FastTool is a ToolDef
        digest.messages = digest.tools = NULL  # decoded: no view of the line outlives this
    top: Any = None
    rd = resp.digest if resp is not None else None
    if type(rd) is LlamaResponseDigest:
        top = rd.usage  # read by `openai_counts` (None: null, as orjson reads it)
    elif rd is not None:
        if api is not None and type(api).counts is _OPENAI_COUNTS:
            top = llama_usage(rd)  # read by `openai_counts`
            # Usage of this shape again: the next line is tried typed in one pass.
            _USAGE.typed = top is not None
        if top is None:
            try:
                top = usage(rd)
            except orjson.JSONDecodeError:
                return parse_line(line)  # too deep for orjson: the plain reader says bad line
        rd.usage = NULL  # parsed: no view of the line outlives this call
    return Digested(d, api, top, msgs, hashes, tools)


class _Usage:
    """Whether to try `decode_llama_digest` first: yes until a line's usage is not
    llama-server's (or is, under an API that reads it as a dict), then no until a
    chat line's usage reads as llama-server's again: a failed typed decode costs a
    decode, and a recording of another server's traffic would pay it on every line."""

    typed = True


_USAGE = _Usage()


_NO_PARAMS = FastParams()


def prepare(
    rec: dict[str, Any] | Digested, tools_cache: dict[str, Tools] | None = None
) -> Exchange | Skip:
    """The Exchange of a record, or why it is skipped.

    `rec` is a parsed record (`format.lines.parse_line`), made typed here by
    `digested`, or one the fast path read (`read_record`): one reading of both.
    `tools_cache` maps a tools_hash to its Tools for records without tokenizer
    counts, so a tools array resent on every turn is sized once.
    """
    if type(rec) is not Digested:
        assert isinstance(rec, dict)
        got = digested(rec)
        if type(got) is Skip:
            return got
        assert type(got) is Digested
        rec = got
    d = rec.rec
    req = d.request
    api = rec.api
    if api is None:
        return Skip(NOT_CHAT, strip_query(req.path))
    resp = d.response
    digest = req.digest
    assert resp is not None and digest is not None  # read_record's and digested's conditions
    top = rec.top
    if type(top) is not LlamaTop and type(top) is not dict:
        top = None
    rd = resp.digest
    out = rd.output if rd is not None else None
    headers = req.headers
    ua, sessions, retry = identity(headers)
    requested = digest.model or None
    served = (top.model if type(top) is LlamaTop else top.get("model")) if top is not None else None
    draft_n, draft_n_accepted = draft_counts(top)
    msgs = rec.msgs
    n_sys = 0
    for m in msgs:
        if m.role not in SYSTEM_ROLES:
            break
        n_sys += 1
    has_model = False
    for m in msgs:
        if m.role in MODEL_ROLES:
            has_model = True
            break
    tokens = d.tokens
    tokmap = tools_tok = None
    if tokens is not None:
        tokmap = tokens.messages
        tools_tok = tokens.tools
    tools = rec.tools
    params = digest.params
    if params is None:
        params = _NO_PARAMS
    names: list[str] = []
    out_chars = 0
    if out is not None:
        oc = out.content_chars
        out_chars = oc if oc is not None else 0
        calls = out.tool_calls
        if calls:
            for call in calls:
                if call.name is not None:
                    names.append(call.name)
    t_start = d.t_start_ms
    te = d.t_end_ms
    upstream = req.upstream
    rh = resp.headers
    return Exchange(
        id=d.id,
        api=api,
        t_start=t_start,
        t_first_byte=d.t_first_byte_ms,
        t_first_event=d.t_first_event_ms,
        t_end=te if te is not None else t_start,
        ua=ua,
        user_agent=(headers.user_agent or None) if headers is not None else None,
        sessions=sessions,
        retry=retry,
        requested_model=requested,
        served_model=served if type(served) is str and served else requested or "unknown",
        server=(rh.get("server") or None) if rh is not None else None,
        msgs=msgs,
        hashes=rec.hashes,
        n_sys=n_sys,
        has_model_msgs=has_model,
        tools=_tools_of(tools, digest.tools_hash, tools_tok, tools_cache),
        tool_digests=tools,
        structured=params.response_format is True or params.grammar is True,
        stored_prompt=params.previous_response is True,
        max_tokens=params.max_tokens,
        num_ctx=api.context_limit(rec.body),  # full mode only: digests drop options
        tokmap=tokmap,
        top=top,
        streamed=resp.stream is not None,
        out_chars=out_chars,
        out_tool_names=names,
        texts=rec.texts,
        draft_n=draft_n,
        draft_n_accepted=draft_n_accepted,
        upstream=upstream,
        provider=provider_of_record(upstream, rh, top),
        cache=digest.cache,
        betas=headers.anthropic_beta if headers is not None else None,
    )


def provider_of_record(
    upstream: str | None, headers: dict[str, str] | None, top: dict[str, Any] | LlamaTop | None
) -> str | None:
    """R34 (`providers.provider_of`): the usage's shape only in a plain reply's top level,
    never llama-server's own, which the fast path types."""
    if upstream is None and type(top) is dict:  # a recording made before R34
        return provider_of(None, headers, top.get("usage"), "timings" in top, top.get("model"))
    return provider_of(upstream, headers)


def digested(rec: dict[str, Any]) -> Digested | Skip:
    """A parsed record as `prepare` reads it: checked, its values typed as the fast path
    decodes them (a value of another type is as absent), or why it is skipped."""
    req = rec.get("request")
    if type(req) is not dict:
        return Skip(UNPARSED)
    method = req.get("method")
    path = req.get("path")
    if type(method) is not str or type(path) is not str:
        return Skip(NOT_CHAT, strip_query(path) if isinstance(path, str) else "?")
    api = chat_api(method, path)
    if api is None:
        return Skip(NOT_CHAT, strip_query(path))
    resp = rec.get("response")
    if rec.get("error") is not None or type(resp) is not dict:
        return Skip(ERROR, chat=True, probe=_probe(req, api))
    status = resp.get("status")
    if type(status) is not int or not 200 <= status < 300:
        refusal = refusal_of(rec, req, resp, api, status)
        return Skip(NON_2XX, chat=True, refusal=refusal, probe=_probe(req, api))
    texts: tuple[str, ...] | None = None
    body = req.get("body")
    try:
        digest: Any = request_digest_of(req, api)
        rd: Any = response_digest_of(resp, api)
        if req.get("digest") is None and isinstance(body, dict):
            texts = _texts(api, body)
    except (ValueError, TypeError, RecursionError):
        return Skip(UNPARSED, chat=True)  # a body the digest cannot be taken of
    if type(digest) is not dict:
        return Skip(UNPARSED, chat=True)
    top = out = None
    if type(rd) is dict:
        top = rd.get("usage")
        out = rd.get("output")

    raw_msgs = digest.get("messages")
    if type(raw_msgs) is not list:
        raw_msgs = []
    msgs: list[Msg]
    try:
        hashes = tuple(map(_HASH, raw_msgs))
        hash(hashes)  # every element hashable: sets and lookups will work
        for m in raw_msgs:  # the roles `prepare` reads are there and hashable
            if m["role"] not in SYSTEM_ROLES:
                break
        for m in raw_msgs:
            if m["role"] in MODEL_ROLES:
                break
        msgs = msg_digests(raw_msgs)
    except (TypeError, KeyError):
        hashes, msgs = _slow_hashes(raw_msgs)
    raw_tools = digest.get("tools")
    th = digest.get("tools_hash")
    params = digest.get("params")
    params = params if isinstance(params, dict) else {}
    model = digest.get("model")
    mt = params.get("max_tokens")
    tokens = rec.get("tokens")
    fast_tokens = None
    if isinstance(tokens, dict):
        tm, tt = tokens.get("messages"), tokens.get("tools")
        fast_tokens = FastTokens(
            messages=tm if isinstance(tm, dict) else None,
            tools=tt if isinstance(tt, dict) else None,
        )
    output = None
    if type(out) is dict:
        oc = out.get("content_chars")
        calls = out.get("tool_calls")
        output = FastOutput(
            content_chars=oc if type(oc) is int else None,
            tool_calls=[
                CallRef(name=name)
                for call in calls
                if type(call) is dict and type(name := call.get("name")) is str
            ]
            if type(calls) is list
            else None,
        )
    stream = resp.get("stream")
    upstream = req.get("upstream")  # R34; absent in recordings made before it
    added = req.get("added")
    tfb = rec.get("t_first_byte_ms")
    tfe = rec.get("t_first_event_ms")  # R28; absent in recordings made before it
    te = rec.get("t_end_ms")
    typed = DigestRecord(
        v=1,
        id=rec["id"],
        t_start_ms=rec["t_start_ms"],
        request=Request(
            method=method,
            path=path,
            upstream=upstream if type(upstream) is str else None,
            headers=headers_of(req.get("headers")),
            digest=FastRequestDigest(
                model=model if type(model) is str else None,
                params=FastParams(
                    max_tokens=mt if type(mt) is int else None,
                    response_format=params.get("response_format") is True,
                    grammar=params.get("grammar") is True,
                    previous_response=params.get("previous_response") is True,
                ),
                tools_hash=th if isinstance(th, str) else None,
                cache=cache_of(digest.get("cache")),
            ),
            added=added if type(added) is list and all(type(a) is str for a in added) else None,
        ),
        t_first_byte_ms=tfb if type(tfb) is int else None,
        t_first_event_ms=tfe if type(tfe) is int else None,
        t_end_ms=te if type(te) is int else None,
        response=Response(
            status=status,
            headers=response_headers_of(resp.get("headers")),
            stream=None if stream is None else stream if type(stream) is str else "",
            digest=FastResponseDigest(output=output),
        ),
        tokens=fast_tokens,
    )
    tools = tool_defs(raw_tools) if isinstance(raw_tools, list) else []
    return Digested(typed, api, top, msgs, hashes, tools, texts, body)
