"""The opt-in provider diagnosis (R37, `llmp_diagnose`): ask the provider why a turn missed.

Toward Anthropic's Messages API the recorder adds `"diagnostics":
{"previous_message_id": …}` and the diagnosis beta value; toward OpenAI's Responses
API (the explicit generation) it adds `prompt_cache_options.comparison_response_id`.
Both name the conversation's previous response, so the recorder keeps, per proxy,
which requests it forwarded and which response ids came back (`Chains`, the one home
of that rule; docs/recording.md, "The provider's own diagnosis").

Pure: this module takes body bytes, header values and response pieces, and gives
new bytes, new header values and the names of what it added; mitmproxy stays in
the addon (`recorder.addon`), which runs `Diagnosis.request` off the event loop.
The body keeps every byte the client sent: the field is spliced in, never
re-serialised.  What the provider answers is recorded as any response is.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from llmp.apis import ChatApi, api_by_name
from llmp.apis.base import hashes_only, top_level_spans
from llmp.apis.providers import (
    ANTHROPIC,
    DiagnosisAsk,
    anthropic_billing_block,
    diagnosis_apis,
    diagnosis_ask,
)
from llmp.apis.sse import SSEParser
from llmp.format import canonical
from llmp.recorder.record import decoded_pieces

__all__ = [
    "BETA_HEADER",
    "Chains",
    "Diagnosis",
    "Rewrite",
    "Turn",
    "response_id",
    "wants",
]

BETA_HEADER = "anthropic-beta"
"""The header that carries Anthropic's beta values; `request.added` names it when the
diagnosis beta was appended."""
MAX_TURNS = 1024
"""Requests remembered for chaining (their response ids); the oldest go first."""
MAX_PENDING = 256
"""Responses waiting to have their id read (at the next provider request)."""
ID_SCAN_BYTES = 1 << 16
"""How much of a streamed response is read for its id: it is in the first event."""


def wants(provider: str | None, api_name: str) -> bool:
    """Whether a request of API `api_name` toward `provider` may be asked for a
    diagnosis (the cheap check on the event loop, before any parse)."""
    return api_name in diagnosis_apis(provider)


@dataclass(frozen=True, slots=True)
class Turn:
    """A provider request, as the later turns of its conversation look it up."""

    api: str
    model: str
    head: int
    """The identity of what comes before the messages: the system prompt and the tools
    (`Chains` prefers a turn with the same)."""
    prefixes: tuple[int, ...]
    """For each n, a hash of the first n + 1 messages' identity hashes, chained."""


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What the diagnosis does to one request."""

    body: bytes | None
    """The body to send, or None: the client's, unchanged."""
    beta: list[str] | None
    """The `anthropic-beta` header values to send, or None: unchanged."""
    added: tuple[str, ...]
    """`request.added`: the names of what was added (empty: nothing)."""
    turn: Turn
    """The request as its conversation's later turns look it up."""


class Chains:
    """The conversation's previous turn of a request, and its response id: the rule.

    A request's previous turn is the earlier request, on the same API and the same
    model, that shares the longest start of its messages with it (by llmp's message
    identity, `ChatApi.item_digest`'s hash: moved `cache_control` and a Responses item's
    `id` do not count, R22, R30), the latest of those; of them, one with the same system
    prompt and the same tools wins (Claude Code's billing line left out, R35), so a
    side-call that resends the history under another system prompt (Claude Code's) or
    without the tools (Codex's compaction request) is never taken for the turn before the
    next one.  So a turn that continues its conversation is compared with the turn before it,
    and one that rewrote its history with the turn it rewrote, as the analysis links
    them (docs/analysis.md §6).  Where no request on the same model shares a start, one
    on another model whose messages are all this one's first is taken: the conversation
    went on with another model, and the provider can say `model_changed` (R35).
    Bounded: the oldest `max_turns` requests go first.
    """

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        self.max_turns = max_turns
        self._seqs: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        self._starts: dict[Any, tuple[int, str]] = {}
        """By (API, model, n, the first n messages): the latest request that began so."""
        self._same: dict[Any, tuple[int, str]] = {}
        """The same, with the system prompt and the tools."""
        self._models: dict[Any, tuple[int, str]] = {}
        """By the messages alone (all of them), whatever the model."""

    def __len__(self) -> int:
        return len(self._seqs)

    def previous(self, seq: int, turn: Turn) -> str | None:
        """The response id of `turn`'s previous turn (request `seq`), or None."""
        for n in range(len(turn.prefixes), 0, -1):
            key = (turn.api, turn.model, n, turn.prefixes[n - 1])
            for hit in (self._same.get((turn.head, key)), self._starts.get(key)):
                if hit is not None and hit[0] < seq:
                    return hit[1]
        other: tuple[int, str] | None = None
        for n, chain in enumerate(turn.prefixes, 1):
            hit = self._models.get((turn.api, n, chain))
            if hit is not None and hit[0] < seq and (other is None or hit[0] > other[0]):
                other = hit
        return None if other is None else other[1]

    def remember(self, seq: int, turn: Turn, response_id: str) -> None:
        """Request `seq` (`turn`) was answered as `response_id`."""
        if not turn.prefixes or seq in self._seqs:
            return
        keys: list[Any] = []
        for n, chain in enumerate(turn.prefixes, 1):
            key = (turn.api, turn.model, n, chain)
            keys += [(self._starts, key), (self._same, (turn.head, key))]
        keys.append((self._models, (turn.api, len(turn.prefixes), turn.prefixes[-1])))
        for index, k in keys:
            held = index.get(k)
            if held is None or held[0] < seq:
                index[k] = (seq, response_id)
        self._seqs[seq] = keys
        while len(self._seqs) > self.max_turns:
            old, old_keys = self._seqs.popitem(last=False)
            for index, k in old_keys:
                held = index.get(k)
                if held is not None and held[0] == old:
                    del index[k]


def _chain(hashes: Iterable[str]) -> tuple[int, ...]:
    out: list[int] = []
    h = 0
    for item in hashes:
        h = hash((h, item))
        out.append(h)
    return tuple(out)


class _Id(msgspec.Struct):
    id: Any = None


_ID = msgspec.json.Decoder(_Id)


def _event_id(data: str) -> str | None:
    """The response id an event carries: Anthropic's `message_start.message.id`,
    OpenAI's `response.*.response.id`."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    for key in ("message", "response"):
        inner = event.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("id"), str) and inner["id"]:
            return str(inner["id"])
    return None


def response_id(pieces: Sequence[bytes], encoding: str | None) -> str | None:
    """The id of a response (its body as relayed, with its content-encoding): the
    top-level `id` of a JSON body, or the one in a stream's first events."""
    decoded = decoded_pieces(pieces, encoding)
    first = b""
    for piece in decoded:
        first = piece.lstrip()
        if first:
            break
    if not first:
        return None
    if first.startswith(b"{"):  # one JSON body
        data = first + b"".join(decoded)
        try:
            rid = _ID.decode(data).id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return rid if isinstance(rid, str) and rid else None
    parser = SSEParser()
    seen = 0
    for piece in itertools.chain((first,), decoded):
        for event in parser.feed(piece):
            rid = _event_id(event)
            if rid is not None:
                return rid
        seen += len(piece)
        if seen > ID_SCAN_BYTES:
            return None
    return None


def _beta_values(values: Sequence[str], beta: str) -> list[str] | None:
    """The `anthropic-beta` values with `beta` appended to the comma list, or None when
    they already hold it."""
    held = {v.strip() for value in values for v in value.split(",")}
    if beta in held:
        return None
    if not values or not values[-1].strip():
        return [*values[:-1], beta] if values else [beta]
    return [*values[:-1], values[-1] + "," + beta]


def _splice(data: bytes, at: int, text: bytes) -> bytes:
    return data[:at] + text + data[at:]


class Diagnosis:
    """The proxy's diagnosis state: its chains, and the responses whose ids are due.

    `request` runs on one worker thread at a time (the addon's executor);
    `responded` is called on the event loop and only appends to a queue.
    """

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        self.chains = Chains(max_turns)
        self._pending: collections.deque[tuple[int, list[bytes], str | None]] = collections.deque(
            maxlen=MAX_PENDING
        )
        self._awaiting: collections.OrderedDict[int, Turn] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Our own API objects: their digest caches serve this thread only.
        self._apis: dict[str, ChatApi] = {}

    def _api(self, name: str) -> ChatApi | None:
        api = self._apis.get(name)
        if api is None:
            shared = api_by_name(name)
            if shared is None:
                return None
            api = self._apis[name] = type(shared)()
        return api

    def responded(self, seq: int, pieces: list[bytes], encoding: str | None) -> None:
        """Request `seq` got a 2xx response, relayed as `pieces`: read its id later."""
        self._pending.append((seq, pieces, encoding))

    def forget(self, seq: int) -> None:
        """Request `seq` got no usable response."""
        with self._lock:
            self._awaiting.pop(seq, None)

    def _learn(self) -> None:
        while self._pending:
            seq, pieces, encoding = self._pending.popleft()
            turn = self._awaiting.pop(seq, None)
            if turn is None:
                continue
            rid = response_id(pieces, encoding)
            if rid is not None:
                self.chains.remember(seq, turn, rid)

    def request(
        self, seq: int, provider: str, api_name: str, data: bytes, beta: Sequence[str]
    ) -> Rewrite | None:
        """What to send for request `seq` toward `provider` (body `data`, identity
        encoded; its `anthropic-beta` values `beta`); None: leave it as it is."""
        with self._lock:
            self._learn()
            api = self._api(api_name)
            if api is None:
                return None
            try:
                parsed = top_level_spans(data)
            except Exception:  # not JSON: the provider will say so, untouched
                return None
            if parsed is None:
                return None
            top, spans = parsed
            model = _string(top.get("model"))
            ask = diagnosis_ask(provider, model)
            if ask is None or ask.api != api_name or model is None:
                return None
            with hashes_only():  # only the hashes are read, on the client's request path
                turn = self._turn(api, provider, model, top, data)
            if turn is None:
                return None
            self._awaiting[seq] = turn
            while len(self._awaiting) > MAX_PENDING:
                self._awaiting.popitem(last=False)
            rewrite = self._rewrite(seq, ask, turn, top, spans, data, beta)
        return rewrite

    def _turn(
        self, api: ChatApi, provider: str, model: str, top: dict[str, Any], data: bytes
    ) -> Turn | None:
        digest = api.request_digest_bytes(data)
        if digest is None:
            return None
        rest = {
            name: canonical.loads(raw, depth=1)
            for name, raw in top.items()
            if name not in (api.messages_key, "tools")
        }
        leading = api.leading_with_text(rest)
        system = tuple(
            d["hash"]
            for d, text in leading
            if not (provider == ANTHROPIC and anthropic_billing_block(text))
        )
        hashes = [m["hash"] for m in digest["messages"][len(leading) :]]
        return Turn(api.name, model, hash((system, digest["tools_hash"])), _chain(hashes))

    def _rewrite(
        self,
        seq: int,
        ask: DiagnosisAsk,
        turn: Turn,
        top: dict[str, Any],
        spans: dict[str, tuple[int, int]],
        data: bytes,
        beta: Sequence[str],
    ) -> Rewrite:
        unchanged = Rewrite(None, None, (), turn)
        held = top.get(ask.field)
        if ask.provider == ANTHROPIC:
            if held is not None:  # the client asked itself
                return unchanged
            previous = self.chains.previous(seq, turn)
            body = _splice(
                data,
                _end_of_object(data),
                b"," + orjson.dumps(ask.field) + b":" + orjson.dumps({ask.key: previous}),
            )
            added = [ask.added_name]
            new_beta = _beta_values(beta, ask.beta) if ask.beta else None
            if new_beta is not None:
                added.append(BETA_HEADER)
            return Rewrite(body, new_beta, tuple(added), turn)
        previous = _string(top.get("previous_response_id")) or self.chains.previous(seq, turn)
        if previous is None:
            return unchanged
        member = orjson.dumps(ask.key) + b":" + orjson.dumps(previous)
        if held is None:
            body = _splice(
                data, _end_of_object(data), b"," + orjson.dumps(ask.field) + b":{" + member + b"}"
            )
        else:
            try:
                options = canonical.loads(held, depth=1)
            except canonical.NotJSON:
                return unchanged
            start, end = spans[ask.field]
            if options is None:  # `null`: the object takes its place
                body = data[:start] + b"{" + member + b"}" + data[end:]
            elif not isinstance(options, dict) or ask.key in options:
                return unchanged  # the client's own comparison, or a value it must fix
            else:
                comma = b"," if options else b""
                body = _splice(data, start + 1, member + comma)  # the value starts with `{`
        return Rewrite(body, None, (ask.added_name,), turn)


def _string(raw: Any) -> str | None:
    """A top-level value that is a JSON string, as a str; None otherwise."""
    if raw is None:
        return None
    try:
        value = canonical.loads(raw, depth=1)
    except canonical.NotJSON:
        return None
    return value if isinstance(value, str) else None


def _end_of_object(data: bytes) -> int:
    """Where the top-level object's closing brace is (`top_level_spans` checked it)."""
    return data.rstrip(b" \t\r\n").rindex(b"}")
