"""Conversations and how a request finds the earlier turn it follows (§6).

State is per session and bounded: one `TurnState` (the last turn) per
conversation, conversations kept in least-recently-active order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmp.analysis.identity import NO_SESSIONS, Sessions, conflicts
from llmp.apis.servers import UNKNOWN, ReuseSteps, Server, identify, with_learned_block
from llmp.format.measure import SERVER

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.apis.base import Counts
    from llmp.format.fastread import Msg, ToolDef

RECENT = 64  # conversations the rules after a shared start look at
REPLY_MIN_CHARS = 32  # a side-call reply shorter than this is too common a size to tell

# Errors of requests that never reached the server.
NOT_SENT_ERRORS = frozenset(("upstream_unreachable", "timeout"))

CONTINUATION = "continuation"
PREFIX = "prefix"
OVERLAP = "overlap"
SUMMARY = "summary"
HEAD = "head"


@dataclass(slots=True)
class TurnState:
    """What a later request is compared with: the last turn of a conversation."""

    row_id: int
    sys: tuple[str, ...]
    tools_hash: str | None
    rest: tuple[str, ...]
    rest_tokens: int
    rest_source: str
    prompt_server: int | None
    requested_model: str | None
    structured: bool
    has_tools: bool
    max_tokens: int | None
    out_chars: int
    rest_hash: int = 0  # hash(rest): a continuation check that touches no old strings
    msgs: list[Msg] = field(default_factory=list)
    """The message digests as read (kept by reference: no work per message per turn);
    where in a message a later change falls comes from their sizes and edge hashes."""
    tool_digests: list[ToolDef | None] = field(default_factory=list)
    texts: tuple[str, ...] | None = None
    """Each message's text, in full mode only."""
    prov: Any = None
    """On a cloud provider: what the turn told the cache and left there (R35): a
    `provider.ProviderTurn`, which imports this module's neighbours, so it is not named."""
    _rest_set: frozenset[str] | None = None
    _tool_hashes: frozenset[str] | None = None

    @property
    def rest_set(self) -> frozenset[str]:
        if self._rest_set is None:
            self._rest_set = frozenset(self.rest)
        return self._rest_set

    @property
    def tool_hashes(self) -> frozenset[str]:
        """The hashes of its tool definitions (built once, when a change asks)."""
        if self._tool_hashes is None:
            self._tool_hashes = frozenset(
                h for t in self.tool_digests if t is not None and type(h := t.hash) is str
            )
        return self._tool_hashes

    def edges(self, j: int) -> tuple[int, Any, Any]:
        """Message j's size in characters and its head and tail hashes (R5)."""
        if j >= len(self.msgs):
            return 0, None, None
        m = self.msgs[j]
        chars = m.chars
        return (chars if type(chars) is int else 0), m.head, m.tail

    def role(self, j: int) -> Any:
        return self.msgs[j].role if j < len(self.msgs) else None


@dataclass(slots=True)
class Conversation:
    number: int
    ua: str | None
    served: str
    family: int | None
    client: int
    last: TurnState
    turns: int = 1
    summaries: list[int] = field(default_factory=list)
    replies: list[int] = field(default_factory=list)
    """Reply sizes of its recent side-calls (at least `REPLY_MIN_CHARS`): a turn that
    resends one as an assistant message continues from a compaction."""
    first: str | None = None  # first rest message of the last turn, as indexed
    sessions: Sessions = NO_SESSIONS
    """The session header values its first turn sent (R33)."""
    alt: TurnState | None = None
    """The last turn before a request that kept only the start of it (a `PREFIX`
    link): a later request that continues it proves that request another
    conversation with the same start (engine `_Waiting`)."""


@dataclass(slots=True)
class Link:
    conv: Conversation
    mode: str
    k: int  # length of the shared start of the rest sequences


@dataclass(slots=True)
class RingEntry:
    """A row as later rows see it when asking what ran in between."""

    id: int
    served: str
    kind: str
    conversation: int | None
    shape: str | None
    client: int
    model: str = ""
    """The model the request asked for (its `served` may differ, R20)."""


class Session:
    """Per-session state: conversations by (user-agent, served model), recent rows."""

    def __init__(self, number: int, cfg: Config) -> None:
        self.number = number
        self.cfg = cfg
        self.by_key: dict[tuple[str | None, str], OrderedDict[int, Conversation]] = {}
        # Continuation and shared start need the same first rest message:
        # this index finds those candidates without scanning every conversation.
        self.by_first: dict[tuple[str | None, str, str], dict[int, Conversation]] = {}
        self.recent_by_ua: dict[str | None, Conversation] = {}
        self.lru: OrderedDict[int, Conversation] = OrderedDict()
        self.ring: deque[RingEntry] = deque(maxlen=cfg.between_window)
        self.skipped: deque[int] = deque(maxlen=1024)
        self.down: deque[int] = deque(maxlen=1024)
        """Chat requests the server could not take because it was not there (no connect,
        a time-out, 503 while it loads): it may have restarted, and lost its cache so."""
        # Served models whose Ollama counts proved the old prompt_eval_count meaning.
        self.ollama_old: set[str] = set()
        self.rolls_back: set[str] = set()
        """Served models that went back into a changed message: their caches can return to
        any earlier position, so a shortfall after a change is the estimate's, not R31's."""
        self.servers: dict[str, Server] = {}
        """Which server program answered for each served model (`apis.servers`)."""
        self.steps: dict[str, ReuseSteps] = {}
        """What each served model's reuse counts show of its server's block."""
        # Prompts the server refused for its context, as it counted them: (id, model, tokens).
        self.refused: deque[tuple[int, str | None, int]] = deque(maxlen=64)

    def refused_since(self, since: int, until: int, model: str | None) -> int | None:
        """The server's count of the last prompt of `model` it refused between two ids."""
        for rid, m, tokens in reversed(self.refused):
            if rid <= since:
                return None
            if rid < until and m == model:
                return tokens
        return None

    def recent_for(self, ua: str | None, sessions: Sessions) -> Conversation | None:
        """The client's most recently active conversation that its session headers
        allow (R33): what a request that links to none is classified against."""
        conv = self.recent_by_ua.get(ua)
        if conv is None or not conflicts(sessions, conv.sessions):
            return conv
        for c in reversed(self.lru.values()):
            if c.ua == ua and not conflicts(sessions, c.sessions):
                return c
        return None

    def skip(self, rec: dict[str, Any]) -> None:
        """A chat request that is no row: remembered when it may have taken a slot."""
        if may_have_run(rec):
            self.skipped.append(rec["id"])
        elif was_down(rec):
            self.down.append(rec["id"])

    def server_of(
        self,
        served: str,
        header: str | None,
        api_name: str,
        timings: bool,
        top: Any = None,
        provider: str | None = None,
    ) -> Server:
        """The server behind `served`: what this response says, else what an earlier one
        said (a proxy in between may drop the header now and then), with the block its
        counts have shown so far (`observe`)."""
        server = identify(header, api_name, timings, top, provider)
        if server is not UNKNOWN:
            self.servers[served] = server
        else:
            server = self.servers.get(served, server)
        return self._with_block(served, server)

    def server_for(self, served: str) -> Server:
        """The server last seen behind `served`, with its block (`server_of`)."""
        return self._with_block(served, self.servers.get(served, UNKNOWN))

    def _with_block(self, served: str, server: Server) -> Server:
        if server.exact:
            return server  # token-exact: no block to learn (`Server.exact`)
        steps = self.steps.get(served)
        if steps is None:
            return server
        return with_learned_block(server, steps.block(server.block_tokens))

    def observe(self, served: str, counts: Counts) -> None:
        """A response's reuse counts, as the server said them: its block (`ReuseSteps`)."""
        reused = counts.reused_tokens
        if reused is None or reused[1] != SERVER:
            return
        steps = self.steps.get(served)
        if steps is None:
            steps = self.steps[served] = ReuseSteps()
        prompt, written = counts.prompt_tokens, counts.cache_write_tokens
        steps.add(
            int(prompt[0]) if prompt is not None and prompt[1] == SERVER else None,
            int(reused[0]),
            int(written[0]) if written is not None else None,
        )

    def down_since(self, since: int) -> bool:
        """The server was seen down after record `since`."""
        return bool(self.down) and self.down[-1] > since

    def candidates(self, ua: str | None, served: str) -> OrderedDict[int, Conversation] | None:
        return self.by_key.get((ua, served))

    def starting_with(
        self, ua: str | None, served: str, first: str
    ) -> dict[int, Conversation] | None:
        return self.by_first.get((ua, served, first))

    def _index(self, conv: Conversation, first: str | None) -> None:
        if conv.first == first:
            return
        if conv.first is not None:
            key = (conv.ua, conv.served, conv.first)
            bucket = self.by_first.get(key)
            if bucket is not None:
                bucket.pop(conv.number, None)
                if not bucket:
                    del self.by_first[key]
        conv.first = first
        if first is not None:
            self.by_first.setdefault((conv.ua, conv.served, first), {})[conv.number] = conv

    def other_model(self, ex: Exchange, cfg: Config) -> Link | None:
        """A conversation of the same client, on another served model, that this request
        continues (its messages, then more): on a provider, a conversation that went on
        with another model (`model_changed`, R35).  Only a continuation or a shared start
        of the history counts: a shared system prompt is any new conversation's."""
        rest = ex.hashes[ex.n_sys :]
        if not rest:
            return None
        for (ua, served), group in list(self.by_key.items()):
            if ua != ex.ua or served == ex.served_model:
                continue
            same = self.by_first.get((ua, served, rest[0]))
            if not same:
                continue
            link = find_link(ex, group, same, cfg)
            if link is not None and link.mode in (CONTINUATION, PREFIX):
                return link
        return None

    def rekey(self, conv: Conversation, served: str) -> None:
        """Move a conversation to another served model (it went on with that model); the
        caller touches it after, which indexes it anew."""
        self.forget(conv)
        conv.served = served

    def forget(self, conv: Conversation) -> None:
        """Drop a conversation that proved no conversation (a side-call held back)."""
        self.lru.pop(conv.number, None)
        self._index(conv, None)
        group = self.by_key.get((conv.ua, conv.served))
        if group is not None:
            group.pop(conv.number, None)
            if not group:
                del self.by_key[(conv.ua, conv.served)]
        if self.recent_by_ua.get(conv.ua) is conv:
            del self.recent_by_ua[conv.ua]

    def touch(self, conv: Conversation) -> None:
        """Mark a conversation as the most recently active one."""
        key = (conv.ua, conv.served)
        group = self.by_key.get(key)
        if group is None:
            group = self.by_key[key] = OrderedDict()
        group[conv.number] = conv
        group.move_to_end(conv.number)
        self.lru[conv.number] = conv
        self.lru.move_to_end(conv.number)
        self.recent_by_ua[conv.ua] = conv
        rest = conv.last.rest
        self._index(conv, rest[0] if rest else None)
        while len(self.lru) > self.cfg.max_conversations:
            _, old = self.lru.popitem(last=False)
            self._index(old, None)
            grp = self.by_key.get((old.ua, old.served))
            if grp is not None:
                grp.pop(old.number, None)
                if not grp:
                    del self.by_key[(old.ua, old.served)]
            if self.recent_by_ua.get(old.ua) is old:
                del self.recent_by_ua[old.ua]


def may_have_run(rec: dict[str, Any]) -> bool:
    """Whether a skipped chat request may have been processed into a slot.

    Not when the proxy never reached the server (`upstream_unreachable`,
    `timeout`), nor when the server refused it before evaluating anything: a
    4xx (llama-server's `exceed_context_size_error` is counted, not evaluated,
    and leaves the slot as it was) or a 503 (llama-server's "Loading model"
    while it starts, an overloaded server).  Everything else may have: a
    client that hung up mid-generation, a reset, another 5xx, an unreadable
    body.
    """
    err = rec.get("error")
    if err is not None:
        return not (type(err) is str and err in NOT_SENT_ERRORS)
    resp = rec.get("response")
    status = resp.get("status") if isinstance(resp, dict) else None
    return not (type(status) is int and (400 <= status < 500 or status == 503))


def was_down(rec: dict[str, Any]) -> bool:
    """A chat request that found no server: no connect, a time-out, or a 503 (llama-server
    answers 503 "Loading model" while it starts)."""
    err = rec.get("error")
    if err is not None:
        return type(err) is str and err in NOT_SENT_ERRORS
    resp = rec.get("response")
    return isinstance(resp, dict) and resp.get("status") == 503


def lcp(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many leading items two sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def carries_reply(ex: Exchange, out_chars: int) -> bool:
    """Whether the request resends a reply of `out_chars` characters (an assistant
    message that long after the system messages)."""
    if out_chars <= 0:
        return False
    for m in ex.msgs[ex.n_sys :]:
        if m.chars == out_chars and m.role == "assistant":
            return True
    return False


def _reply_sizes(ex: Exchange) -> frozenset[Any]:
    """The sizes of the request's assistant messages after the system ones:
    `carries_reply(ex, n)` is `n > 0 and n in` them, without a scan of the messages
    for every conversation asked about.  Only numbers can equal a reply's size (an
    int), and equal numbers hash alike."""
    return frozenset(
        [
            m.chars
            for m in ex.msgs[ex.n_sys :]
            if type(m.chars) in _NUMBERS and m.role == "assistant"
        ]
    )


_NUMBERS = (int, float, bool)


def find_link(
    ex: Exchange,
    group: OrderedDict[int, Conversation] | None,
    same_start: dict[int, Conversation] | None,
    cfg: Config,
) -> Link | None:
    """The earlier turn this request follows, by the rules of §6, or None.

    `group` holds the conversations of the same user-agent and served model;
    `same_start` those of them whose last turn starts its rest as this one.
    """
    if not group:
        return None
    rest = ex.hashes[ex.n_sys :]
    nrest = len(rest)
    sessions = ex.sessions
    if sessions and same_start:  # R33: never a conversation of another session
        same_start = {n: c for n, c in same_start.items() if not conflicts(sessions, c.sessions)}

    best: Conversation | None = None
    if same_start and ex.retry:
        # R33: a retry follows the request it retried, the last one with its messages.
        for c in same_start.values():
            if (
                c.last.rest == rest
                and c.last.sys == ex.hashes[: ex.n_sys]
                and (best is None or c.last.row_id > best.last.row_id)
            ):
                best = c
        if best is not None:
            return Link(best, CONTINUATION, nrest)
    if same_start:
        # 1. Continuation: the candidate's rest is a prefix of ours; the
        # longest wins, then the most recent. The tuples are compared by
        # their hashes: this request's strings are fresh and their hashes
        # already computed (prepare), while comparing them one by one with
        # the stored turn's strings would read cold memory for every message.
        # Equal 64-bit hashes and equal ends are taken as equal tuples.
        best_n = 0
        for c in same_start.values():
            crest = c.last.rest
            n = len(crest)
            if (
                n <= nrest
                and (
                    n > best_n
                    or (n == best_n and best is not None and c.last.row_id > best.last.row_id)
                )
                and crest[-1] == rest[n - 1]
                and hash(rest[:n]) == c.last.rest_hash
            ):
                best, best_n = c, n
        if best is not None:
            return Link(best, CONTINUATION, best_n)

        # 2. Longest shared start of the rest.
        best_k = 0
        for c in same_start.values():
            k = lcp(rest, c.last.rest)
            if k > best_k or (
                k == best_k and best is not None and c.last.row_id > best.last.row_id
            ):
                best, best_k = c, k
        if best is not None:
            return Link(best, PREFIX, best_k)

    # The rarer rules look at the most recently active conversations only:
    # a turn resumes one of those, and scanning hundreds per request would
    # make every side-call and first turn cost as much as the whole state.
    convs = list(itertools.islice(reversed(group.values()), RECENT))
    if sessions:
        convs = [c for c in convs if not conflicts(sessions, c.sessions)]
    # 3. Shared history after a broken start: at least two of the turn's
    # messages reappear, and either they are most of them (aider's rewritten
    # repo map) or the request also resends the turn's reply (aider's /ask:
    # another system prompt and other scaffolding around the same history).
    if nrest >= 2:
        mine = frozenset(rest)
        replies = _reply_sizes(ex)
        for c in convs[:16]:
            crest = c.last.rest
            # else too short to hold that much of it (side-calls, first turns)
            share = nrest >= max(2, cfg.link_overlap * len(crest))
            out_chars = c.last.out_chars
            reply = out_chars > 0 and out_chars in replies  # carries_reply, for each
            if not (share or reply):
                continue
            found = sum(map(mine.__contains__, crest))  # how many of its messages are ours
            if found >= 2 and (reply or found >= cfg.link_overlap * len(crest)):
                return Link(c, OVERLAP, 0)

    # 4. The first message carries a summary this conversation produced.
    if nrest:
        chars = ex.msgs[ex.n_sys].chars
        if type(chars) is int:
            wrap = cfg.summary_wrap_chars
            for c in convs[:16]:
                if any(cfg.summary_min_chars <= s <= chars <= s + wrap for s in c.summaries):
                    return Link(c, SUMMARY, 0)

    # 5. Only the head (system prompt or tools) is shared.
    sys = ex.hashes[: ex.n_sys]
    th = ex.tools.hash
    for c in convs:
        if (sys and c.last.sys == sys) or (th is not None and c.last.tools_hash == th):
            return Link(c, HEAD, 0)
    return None
