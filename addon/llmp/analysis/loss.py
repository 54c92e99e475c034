"""Prefix, break cause, compaction, and the client and external losses (§6, §7).

`compare` works in composition units (tokenizer counts or estimates);
`losses` converts to the server's units with the row's own ratio and charges
each lost token to a cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from llmp.analysis.causes import (
    HISTORY_REWRITTEN,
    OTHER_CONVERSATION,
    OTHER_MODEL,
    SERVER_CAPACITY,
    SERVER_EMPTY,
    SERVER_HEAD_ONLY,
    SERVER_NO_ROLLBACK,
    SERVER_ROLLBACK,
    SERVER_TEMPLATE,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
)
from llmp.analysis.classify import SIDE_CALL, STATELESS
from llmp.analysis.linking import (
    CONTINUATION,
    HEAD,
    OVERLAP,
    PREFIX,
    SUMMARY,
    Conversation,
    Link,
    RingEntry,
    Session,
    TurnState,
    lcp,
)
from llmp.analysis.rows import Loss
from llmp.apis.base import EDGE_CHARS
from llmp.apis.servers import SHARED, UNKNOWN, Server
from llmp.format.chunks import locate
from llmp.format.measure import (
    ESTIMATE,
    MV,
    RANK,
    SERVER,
    TOKENIZER,
    estimate,
    weakest,
)

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.apis.base import Counts

# A row's cause when its client's change cost more than anything else (`Verdict.cause`).
STRUCTURAL = "structural"
SERVER_RESET = "server_reset"
UNDETERMINED = "undetermined"

# Where a changed message changed (`Structure.changed`).
FIRST_256 = "first_256"
LAST_256 = "last_256"
BETWEEN = "between"
MINOR_ESTIMATE = 0.1
"""An estimated correction below this share of a server-measured loss leaves it `server`."""
ESTIMATED_MATCH = 0.6
"""With estimates: how near the server's prompt must be to the messages alone."""
ESTIMATED_TOOLS_SHARE = 0.2
"""With estimates: tools smaller than this share of the messages are never dropped."""
CONTEXT_BEFORE = 24
CONTEXT_AFTER = 40
"""Characters of `context` around a change, full mode only."""


class Structure:
    """How a request's prompt relates to the turn it links to, in composition units.

    A plain class: the defaults are class attributes, and a row sets the few that
    apply to it (a slotted dataclass set all 27 fields for every row, 6x the cost)."""

    system: MV
    tools: MV
    history: MV
    new: MV
    prefix: int | None = None
    break_cause: str | None = None
    compaction: bool = False
    new_conversation: bool = False
    after: int = 0  # tokens from the break on: what the server had to read again
    fresh: int = 0  # the part of `after` that is new content (no earlier prompt had it)
    lost_source: str = ESTIMATE
    exact_prefix: int | None = None  # the linked turn's server prompt, for a clean continuation
    linked: bool = False
    tools_in_prefix: bool = False  # `prefix` counts the tools block
    tools_after: int = 0  # the tools block's part of `after`
    tools_fresh: int = 0  # its new tools' part of `fresh`
    tools_differ: bool = False  # the tools array changed (its place is the template's)
    tools_same: bool = True
    """The tools array is the linked turn's (set for every linked request)."""
    changed: list[dict[str, Any]] | None = None
    """Where each changed message changed (digest mode: which part; full mode: the offset)."""
    prev_prompt: int | None = None  # the linked turn's prompt, as its server counted it
    refused_prompt: int | None = None  # a prompt refused in between, as the server counted it
    old_msgs: int = 0  # the linked turn's messages, estimated
    old_tools: int = 0  # and its tools
    removed_msgs: int = 0  # the part of them this prompt no longer holds
    removed_tools: int = 0
    tools_dropped: bool = False  # the template left the tools out (drop_unrendered_tools)
    volatile: int = 0
    """A volatile head: what a new conversation re-read because only its head changed."""
    within: int = 0
    within_slack: int | None = None
    """How far past `within` the change may begin, when the chunks placed it (None: a
    guess from the ends of the message)."""
    before: int | None = None
    """How many whole messages come before the break (R31's P counts their template tokens)."""
    messages: int = 0
    """How many messages the prompt holds."""
    """Of `prefix`, the part inside the first changed message: the unchanged text before the
    change (R31: the break begins there, not at the message's start)."""
    volatile_where: dict[str, Any] | None = None
    rerender: int | None = None
    """A clean continuation that adds a user message after replies that followed the
    previous one: where the first of those replies starts (a template that renders earlier
    turns differently, such as Qwen 3.x dropping their reasoning, re-reads from there)."""
    rerender_msgs: int = 0
    """How many whole messages come before `rerender`."""

    def __init__(self, system: MV, tools: MV, history: MV, new: MV, linked: bool = False) -> None:
        self.system = system
        self.tools = tools
        self.history = history
        self.new = new
        if linked:
            self.linked = True

    @property
    def lost(self) -> int:
        """Re-read only because of the break: the old content after it (W - P)."""
        return max(0, self.after - self.fresh)

    @property
    def total(self) -> int:
        return int(self.system[0] + self.tools[0] + self.history[0] + self.new[0])

    @property
    def source(self) -> str:
        a, b, c, d = self.system[1], self.tools[1], self.history[1], self.new[1]
        if a is b and b is c and c is d:
            return a  # the usual case: one source throughout
        return weakest(a, b, c, d)

    def unlinked(self) -> Structure:
        """The same prompt, compared with nothing (side-calls, stateless rows)."""
        rest = (self.history[0] + self.new[0], weakest(self.history[1], self.new[1]))
        return Structure(self.system, self.tools, (0, rest[1]), rest)


def _tools_mv(ex: Exchange) -> MV:
    if ex.tools.names:
        return (ex.tools.tokens, ex.tools.source)
    return (0, ESTIMATE if ex.tokmap is None else TOKENIZER)  # an empty sum


def compare(ex: Exchange, link: Link | None, cfg: Config, head_is_free: bool = False) -> Structure:
    """The structure of a request against the turn it links to (or nothing).

    `head_is_free`: a change confined to the first system block is no change, because the
    server reads the prefix behind it whatever it says (Claude Code's billing line on
    Anthropic's API, R35)."""
    nsys = ex.n_sys
    n = len(ex.hashes)
    system = ex.range_tokens(0, nsys)
    tools = _tools_mv(ex)
    if link is None:
        return Structure(system, tools, (0, system[1]), ex.range_tokens(nsys, n))
    last = link.conv.last
    mode = link.mode
    k = link.k
    history, new = _history_and_new(ex, link, system)
    st = Structure(system, tools, history, new, linked=True)
    st.messages = n

    sys = ex.hashes[:nsys]
    sys_eq = sys == last.sys or (
        head_is_free and nsys > 0 and len(last.sys) == nsys and sys[1:] == last.sys[1:]
    )
    tools_eq = ex.tools.hash == last.tools_hash
    st.tools_same = tools_eq
    ps = nsys if sys_eq else lcp(sys, last.sys)
    prefix = system[0] if sys_eq else ex.range_tokens(0, ps)[0]
    if sys_eq and tools_eq:
        prefix += tools[0]
        st.tools_in_prefix = True
        if mode in (CONTINUATION, PREFIX):
            prefix += history[0]
    st.prefix = int(prefix)

    if mode == HEAD:
        st.new_conversation = True
        _volatile_head(ex, st, last, ps, sys_eq, tools_eq, cfg)
        return st
    if not sys_eq:
        st.break_cause = SYSTEM_CHANGED
    elif not tools_eq:
        st.break_cause = TOOLS_CHANGED
    elif mode != CONTINUATION:
        st.break_cause = HISTORY_REWRITTEN
    if st.break_cause is None:
        st.exact_prefix = last.prompt_server
        if mode == CONTINUATION:
            a = _replies_since_the_last_user(ex, nsys, nsys + k, n)
            if a is not None:
                st.rerender = int(system[0] + tools[0] + ex.range_tokens(nsys, a)[0])
                st.rerender_msgs = a
        return st
    _where_it_broke(ex, st, link, ps, cfg.estimate_margin)
    if _is_compaction(ex, st, link, cfg):
        st.compaction = True
        st.within, st.within_slack = 0, None
        _volatile_head(ex, st, last, ps, sys_eq, tools_eq, cfg)
        return st
    st.prefix += st.within
    _charge(ex, st, last, ps, sys_eq, tools_eq, k if st.break_cause == HISTORY_REWRITTEN else 0)
    return st


def _history_and_new(ex: Exchange, link: Link, system: MV) -> tuple[MV, MV]:
    """The tokens of the conversation's history this request carries, and of the rest."""
    nsys, n, k, last = ex.n_sys, len(ex.hashes), link.k, link.conv.last
    mode = link.mode
    if mode == CONTINUATION:
        if ex.tokmap is None and last.rest_source == ESTIMATE:
            history: MV = (last.rest_tokens, ESTIMATE)  # same hashes, same sizes
        else:
            history = ex.range_tokens(nsys, nsys + k)
        return history, ex.range_tokens(nsys + k, n)
    if mode == PREFIX:
        return ex.range_tokens(nsys, nsys + k), ex.range_tokens(nsys + k, n)
    if mode == OVERLAP:
        seen = last.rest_set
        history = ex.tokens_of([i for i in range(nsys, n) if ex.hashes[i] in seen])
        total = ex.range_tokens(nsys, n)
        return history, (total[0] - history[0], total[1])
    return (0, system[1]), ex.range_tokens(nsys, n)


def _where_it_broke(ex: Exchange, st: Structure, link: Link, ps: int, margin: float) -> None:
    """R31's P for a break: the whole messages before it (`before`), and the kept part of
    the first changed one (`within`, `within_slack`)."""
    nsys, k, last = ex.n_sys, link.k, link.conv.last
    if st.break_cause == SYSTEM_CHANGED:
        st.before = ps
        if ps < nsys and ps < len(last.sys):
            st.within, st.within_slack = _kept_within(ex, ps, last, ps, margin)
    elif st.break_cause == HISTORY_REWRITTEN and link.mode in (CONTINUATION, PREFIX, OVERLAP):
        # OVERLAP: the first message after the system ones changed (k is 0), and the
        # history after it is resent (a pasted file edited, aider's rewritten repo map).
        st.before = nsys + k
        j = _old_counterpart(ex, nsys + k, last, ps, nsys, k)
        if j is not None:
            st.within, st.within_slack = _kept_within(ex, nsys + k, last, j, margin)


def _is_compaction(ex: Exchange, st: Structure, link: Link, cfg: Config) -> bool:
    """A break that shrank the history to a summary (or resent a side-call's reply as one):
    a compaction, which is charged as a new start, not as a rewrite."""
    mode = link.mode
    if mode == SUMMARY:
        return True
    if (
        st.break_cause == HISTORY_REWRITTEN
        and st.history[0] + st.new[0] <= cfg.compaction_ratio * link.conv.last.rest_tokens
    ):
        return True
    at = ex.n_sys + (link.k if mode in (CONTINUATION, PREFIX) else 0)
    return _carries_summary(ex, at, link.conv, cfg) or _resends_a_side_reply(ex, at, link.conv)


def _replies_since_the_last_user(ex: Exchange, lo: int, hi: int, n: int) -> int | None:
    """The first assistant message after the last user message of messages [lo, hi), when
    messages [hi, n) add a user message: the replies a template may now render otherwise."""
    msgs = ex.msgs
    if not any(msgs[i].role == "user" for i in range(hi, n)):
        return None
    first = None
    for i in range(hi - 1, lo - 1, -1):
        role = msgs[i].role
        if role == "user":
            return first
        if role == "assistant":
            first = i
    return None


def _charge(
    ex: Exchange, st: Structure, last: TurnState, ps: int, sys_eq: bool, tools_eq: bool, k: int
) -> None:
    """What the break made the server read again, and how much of it is new.

    Had the client not changed its prompt, everything up to the new content
    would have been reusable; so what follows the break point is charged,
    less the content no earlier prompt had.  A changed message is charged
    from where it changed: only its changed span is new (`_change_in`,
    docs/analysis.md §7).  The break point is the first changed system
    message, or the tools block, or the first rewritten history message (`k`
    shared before it).
    """
    tok, est = ex.cumulative()
    nsys = ex.n_sys
    n = len(ex.hashes)
    hashes = ex.hashes
    old = set(last.sys) | last.rest_set
    estimated = False
    first = ps if not sys_eq else nsys if not tools_eq else nsys + k
    after = fresh = 0
    paired: dict[int, int] = {}  # old message index -> its characters the edit replaced
    for i in range(first, n):
        t = tok[i + 1] - tok[i]
        estimated = estimated or est[i + 1] != est[i]
        after += t
        if hashes[i] in old:
            continue
        j = _old_counterpart(ex, i, last, ps, nsys, k)
        if j is None:
            fresh += t
            continue
        change = _change_in(ex, i, last, j)
        if st.changed is None:
            st.changed = []
        st.changed.append(_where_changed(ex, i, last, j, change))
        chars = ex.edges(i)[0]
        if chars > 0:
            fresh += round(t * min(change.new, chars) / chars)
        paired[j] = change.old
    if not (sys_eq and tools_eq):  # else the tools block is inside the prefix
        t = int(st.tools[0])
        st.tools_after = t
        after += t
        estimated = estimated or (t > 0 and st.tools[1] == ESTIMATE)
        if not tools_eq:
            st.tools_differ = True
            st.tools_fresh = _new_tools_tokens(ex, last)
            fresh += st.tools_fresh
    after -= st.within  # the changed message's text before the change is still reusable
    st.after = int(after)
    st.fresh = int(min(fresh, after))
    st.lost_source = ESTIMATE if estimated or ex.tokmap is None else TOKENIZER
    _removed(ex, st, last, paired)


def _removed(ex: Exchange, st: Structure, last: TurnState, paired: dict[int, int]) -> None:
    """What of the linked turn's prompt this one no longer holds, in estimated units.

    Old messages it does not resend count whole, an edited one by what the
    edit replaced (`_change_in`), and old tools by theirs.  With the linked
    turn's server prompt this gives the old content that is still there,
    which the server should have kept (`_client_loss`).
    """
    st.prev_prompt = last.prompt_server
    now = set(ex.hashes)  # strings: prepare made every hash safe to use
    old_hashes = last.sys + last.rest
    total = removed = 0
    for j, h in enumerate(old_hashes):
        chars = last.edges(j)[0]
        e = estimate(chars)
        total += e
        if h in now:
            continue
        gone = paired.get(j)
        removed += e if gone is None else estimate(min(chars, gone))
    st.old_msgs, st.removed_msgs = total, removed
    tools_now = {th for t in ex.tool_digests if t is not None and type(th := t.hash) is str}
    for t in last.tool_digests:
        size = t.chars if t is not None else None
        e = estimate(size) if type(size) is int else 0
        st.old_tools += e
        old_hash = t.hash if t is not None else None
        if type(old_hash) is str and old_hash not in tools_now:
            st.removed_tools += e


def _volatile_head(
    ex: Exchange,
    st: Structure,
    last: TurnState,
    ps: int,
    sys_eq: bool,
    tools_eq: bool,
    cfg: Config,
) -> None:
    """A new conversation or a compaction whose prompt differs from the client's last
    one only in a short leading part (Claude Code's attribution line, a date at the top).

    A new conversation is otherwise charged nothing (R: Conversations), but here the
    server read again everything after that part: the rest of the system prompt
    and the tools, which a stable head would have kept reusable.  That is
    `Structure.volatile` (composition units), charged on the row as `lost_client`
    with cause `system_changed` (R38), and sized into the `volatile_head` finding.
    """
    nsys = ex.n_sys
    if sys_eq or not tools_eq or ps >= nsys or len(last.sys) != nsys:
        return
    if ex.hashes[ps + 1 : nsys] != last.sys[ps + 1 :]:
        return  # more than one system message changed
    chars, head, tail = ex.edges(ps)
    ochars, ohead, otail = last.edges(ps)
    short = max(chars, ochars) <= cfg.volatile_head_chars
    edited_head = head != ohead and tail == otail and abs(chars - ochars) <= cfg.volatile_head_chars
    if not (short or edited_head):
        return
    where = _where_changed(ex, ps, last, ps)
    tok, _ = ex.cumulative()
    changed = tok[ps + 1] - tok[ps]
    kept_in_changed = 0 if short else max(0, changed - estimate(min(chars, EDGE_CHARS)))
    shared = (tok[nsys] - tok[ps + 1]) + kept_in_changed + int(st.tools[0])
    if shared > 0:
        st.volatile = shared
        st.volatile_where = where


def _kept_within(
    ex: Exchange, i: int, last: TurnState, j: int, margin: float
) -> tuple[int, int | None]:
    """The tokens of message i before the point where it first differs from the earlier
    message j (composition units): where, inside the message, the prompt changed.  And,
    when the chunks placed the change, how far past that point it may begin: the chunk
    it falls in, and `margin` of the kept tokens, which are the message's share by
    characters (None when they did not: the point is then a guess from the message's
    ends).
    """
    if i >= len(ex.hashes) or j >= len(last.sys) + len(last.rest):
        return 0, None
    chars = ex.edges(i)[0]
    if chars <= 0:
        return 0, None
    tok, _ = ex.cumulative()
    tokens = tok[i + 1] - tok[i]
    change = _change_in(ex, i, last, j)
    within = round(tokens * change.kept / chars)
    if change.slack is None:
        return within, None
    return within, round(tokens * change.slack / chars + margin * within)


class Change(NamedTuple):
    """Where inside a message its earlier version changed, in characters."""

    kept: int
    """Characters at its start as before: where the change begins (R31's P)."""
    slack: int | None
    """The change begins within `[kept, kept + slack]`; None when the chunks did not say
    (`kept` is then a guess from the message's ends)."""
    span: int
    """The changed span now, after `kept`: where the chunks differ (without them, `new`)."""
    new: int
    """The message's new content: the span less half its first and half its last chunk
    (now or before, whichever is less), and at least what the message grew by (without
    the chunks, what it grew by, or all of it when both its ends changed)."""
    old: int
    """What the edit replaced of the earlier version: `new` less what it grew by."""


def _change_in(ex: Exchange, i: int, last: TurnState, j: int) -> Change:
    """Where inside message i the change from the earlier message j lies: the one home
    of that rule, for P (`_kept_within`), the new content (`_charge`), what the edit
    removed (`_removed`) and the report (`_where_changed`).

    Only what a digest holds is used, so a full and a digest recording charge alike.
    The chunks of a long message (`format.chunks`) place the change's start within a
    chunk (64 characters, or 1/64 of a longer message), and its end where the chunks
    match again: so a block rewritten in the middle of a pasted file is new content,
    and what comes after it old.  The edit begins somewhere in the span's first chunk
    and ends somewhere in its last, so the span less half of each counts as new (none
    of a span of one chunk), and at least what the message grew by; of the two
    versions, the one whose span has fewer cuts says it better (an edit just before a
    cut moves that cut, and shows as two chunks on one side and one on the other).
    Counting the span whole made a clock that ticked in the last chunk of a
    2,000-token system prompt some 90 tokens of new content, 15 % of the client's
    charge on a server that went back to the clock (tests/real/test_loss_truth.py);
    counting only the chunks between the first and the last missed a third of a
    rewritten block.  A head that is as before keeps at least its 256 characters.  When
    the chunks never match again although the last 256 characters are the same (a text
    so regular that only the length limit cut it, so the cuts moved with the edit), only
    what the message grew by is new.

    Without the chunks (a short message, an older recording, a version whose length
    moved too far) the head and tail hashes (R5) decide: a change in the first 256
    characters keeps nothing, one only in the last 256 keeps what comes before them,
    and one in between keeps the first 256; and only what the message grew by is new,
    all of it when both ends changed (a rewrite).
    """
    chars, head, tail = ex.edges(i)
    ochars, ohead, otail = last.edges(j)
    old_chunks = last.msgs[j].chunks if j < len(last.msgs) else None
    found = locate(chars, ex.msgs[i].chunks, ochars, old_chunks)
    grown = chars - ochars
    f = found
    if f is not None:
        lift = 0
        if head == ohead and f.kept < EDGE_CHARS <= min(chars, ochars):
            # The change begins after the head.
            lift = min(EDGE_CHARS - f.kept, f.slack, f.first, f.old_first)
        guess = min(
            _midway(f.new, f.first, f.last, lift),
            _midway(f.old, f.old_first, f.old_last, lift) + grown,
        )
        span = f.new - lift
        if tail == otail and f.kept + f.new == chars and f.kept + f.old == ochars:
            # The chunks never matched again, yet the last 256 characters are as before:
            # a text too regular for the rolling hash to cut was cut by length alone, so
            # every cut after the edit moved with it.  The span says nothing of the edit's
            # size; only what the message grew by is known to be new.
            new = max(0, grown)
            return Change(f.kept + lift, f.slack - lift, span, new, max(0, -grown))
        new = max(0, min(span, max(grown, round(guess))))
        return Change(f.kept + lift, f.slack - lift, span, new, max(0, new - grown))
    if head != ohead:
        kept = 0
    elif tail != otail:
        kept = max(0, min(chars, ochars) - EDGE_CHARS)
    else:
        kept = min(chars, EDGE_CHARS)
    if head != ohead and tail != otail:
        return Change(0, None, chars, chars, ochars)
    new = max(0, grown)
    return Change(min(kept, chars), None, new, new, max(0, -grown))


def _midway(span: int, first: int, last: int, lift: int) -> float:
    """A changed span less half its first and half its last chunk (characters), the
    first `lift` characters of it known to be as before: where inside the two the edit
    begins and ends is not known.  0 for a span of one chunk or none."""
    if first >= span:
        return 0.0
    return span - lift - (first - lift + last) / 2


def _old_counterpart(
    ex: Exchange, i: int, last: TurnState, ps: int, nsys: int, k: int
) -> int | None:
    """The earlier message that message i changed, or None when it is a new one.

    A system message is paired with the earlier system message at the same
    place; the first rewritten history message with the earlier one after
    the shared `k` when both have the same role.
    """
    old_nsys = len(last.sys)
    if i < nsys:
        return i if i < old_nsys else None
    if i == nsys + k and old_nsys + k < len(last.msgs):
        j = old_nsys + k
        return j if ex.msgs[i].role == last.role(j) else None
    return None


def _where_changed(
    ex: Exchange, i: int, last: TurnState, j: int, change: Change | None = None
) -> dict[str, Any]:
    """Where message i differs from the earlier message j: no text in digest mode.

    `within` says which part changed first, from the head and tail hashes
    (R5): its first 256 characters, only its last 256, or in between;
    `kept_chars`, how many characters at its start the digest shows unchanged,
    and `edited_chars`, how many after them it shows changed (`_change_in`).
    In full mode `offset` is the first differing character and `context` and
    `was` a few characters around it, now and before.  The charge does not
    use them, so a full and a digest recording charge alike.
    """
    chars, head, tail = ex.edges(i)
    ochars, ohead, otail = last.edges(j)
    if head != ohead:
        within = FIRST_256
    elif tail != otail:
        within = LAST_256
    else:
        within = BETWEEN
    if change is None:
        change = _change_in(ex, i, last, j)
    role = ex.msgs[i].role
    out: dict[str, Any] = {
        "index": i,
        "role": role if isinstance(role, str) else None,
        "within": within,
        "chars_before": ochars,
        "chars_after": chars,
        "kept_chars": change.kept,
        "edited_chars": change.span,
        "offset": None,
        "context": None,
        "was": None,
    }
    if ex.texts is not None and last.texts is not None and j < len(last.texts):
        new, was = ex.texts[i], last.texts[j]
        off = _common_prefix(new, was)
        out["offset"] = off
        out["context"] = new[max(0, off - CONTEXT_BEFORE) : off + CONTEXT_AFTER]
        out["was"] = was[max(0, off - CONTEXT_BEFORE) : off + CONTEXT_AFTER]
    return out


def _new_tools_tokens(ex: Exchange, last: TurnState) -> int:
    """Tokens of the tools no earlier request of the conversation had."""
    total = 0
    for t in ex.tool_digests:
        if t is None:
            continue
        h = t.hash
        if type(h) is not str or h in last.tool_hashes:
            continue
        chars = t.chars
        total += estimate(chars if type(chars) is int else 0)
    if not total:
        return 0
    # In the tools block's own units (tokenizer counts where it has them).
    block = sum(estimate(c) for t in ex.tool_digests if t is not None and type(c := t.chars) is int)
    return round(int(ex.tools.tokens) * total / block) if block else total


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # by halves: long system prompts differ late
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _resends_a_side_reply(ex: Exchange, index: int, conv: Conversation) -> bool:
    """A rewritten history that resends, as an assistant message, the reply of a side-call
    of this conversation: the harness summarised it beside the conversation and now
    continues from the summary (opencode's compaction agent), whatever its size."""
    if not conv.replies:
        return False
    for m in ex.msgs[index:]:
        if m.role == "assistant" and m.chars in conv.replies:
            return True
    return False


def _carries_summary(ex: Exchange, index: int, conv: Conversation, cfg: Config) -> bool:
    if index >= len(ex.msgs) or not conv.summaries:
        return False
    chars = ex.msgs[index].chars
    if type(chars) is not int:
        return False
    return any(
        cfg.summary_min_chars <= s <= chars <= s + cfg.summary_wrap_chars for s in conv.summaries
    )


class Between:
    """Rows that ran between a turn and the turn it links to."""

    __slots__ = (
        "conversation",
        "entries",
        "last_same",
        "other_conversations",
        "other_domains",
        "served",
        "side_calls",
        "skipped",
    )

    def __init__(
        self,
        side_calls: list[int],
        other_conversations: list[int],
        other_domains: list[int],
        entries: list[RingEntry],
        last_same: str | None = None,
        skipped: bool = False,
        served: str = "",
        conversation: int | None = None,
    ) -> None:
        self.side_calls = side_calls
        self.other_conversations = other_conversations
        self.other_domains = other_domains
        self.entries = entries
        self.last_same = last_same  # kind of the last same-model row in between
        self.skipped = skipped
        self.served = served  # the turn's served model and conversation, which sort
        self.conversation = conversation  # `entries` into the three kinds

    @property
    def would_cause(self) -> str | None:
        """The external cause a loss here would get, if any row ran in between."""
        if self.last_same is not None:
            return self.last_same
        if self.other_domains:
            return OTHER_MODEL
        return None

    # The entries of `side_calls`, `other_conversations` and `other_domains`: what the
    # findings look at for the few rows that lost their cache to them (made then).

    @property
    def side_entries(self) -> list[RingEntry]:
        served = self.served
        return [e for e in self.entries if e.served == served and e.kind == SIDE_CALL]

    @property
    def other_entries(self) -> list[RingEntry]:
        served, conv = self.served, self.conversation
        return [
            e
            for e in self.entries
            if e.served == served
            and e.kind != SIDE_CALL
            and (e.kind == STATELESS or e.conversation != conv)
        ]

    @property
    def domain_entries(self) -> list[RingEntry]:
        served = self.served
        return [e for e in self.entries if e.served != served]


NOTHING_BETWEEN = Between([], [], [], [])
"""Shared by every turn that nothing ran before; never mutated."""


def between(session: Session, since: int, served: str, conversation: int | None) -> Between:
    """Scan the session's recent rows back to the linked turn."""
    ring = session.ring
    skipped = session.skipped
    sk = bool(skipped) and skipped[-1] > since
    if (not ring or ring[-1].id <= since) and not sk:
        return NOTHING_BETWEEN  # the usual case
    entries = []
    for e in reversed(ring):
        if e.id <= since:
            break
        entries.append(e)
    entries.reverse()
    return _sorted(entries, served, conversation, sk)


def resort(btw: Between) -> Between:
    """The same rows in between, sorted again after one of them changed kind."""
    return _sorted(btw.entries, btw.served, btw.conversation, btw.skipped)


def _sorted(entries: list[RingEntry], served: str, conversation: int | None, sk: bool) -> Between:
    """Rows in between, oldest first, sorted into side-calls, other conversations and
    other models."""
    side: list[int] = []
    others: list[int] = []
    domains: list[int] = []
    last_same = None
    for e in entries:  # oldest first: the last one sets `last_same`
        if e.served == served:
            kind = e.kind
            if kind == SIDE_CALL:
                side.append(e.id)
                last_same = SIDE_CALL
            elif kind == STATELESS or e.conversation != conversation:
                others.append(e.id)
                last_same = OTHER_CONVERSATION
        else:
            domains.append(e.id)
    return Between(side, others, domains, entries, last_same, sk, served, conversation)


class Verdict:
    """A row's reuse, losses and cause (a plain class: most rows set few of them)."""

    predicted_reuse: float | None = None
    observed_reuse: float | None = None
    lost_client: Loss | None = None
    lost_external: Loss | None = None
    cause: str | None = None
    server_kind: str | None = None
    rolled_back: bool = False
    """The server reused past the start of the changed message: it can go back (R31)."""


def loss_ms(tokens: float, src: str, counts: Counts) -> MV | None:
    """What re-reading `tokens` took, at the row's own prefill rate, in whole milliseconds:
    every figure of the report sums the same integers, so they add up exactly (R38)."""
    pre, ev = counts.prefill_ms, counts.evaluated_tokens
    if pre is None or ev is None or ev[0] <= 0:
        return None
    return (round(tokens * pre[0] / ev[0]), weakest(src, pre[1], ev[1]))


def loss_measured(counts: Counts) -> bool:
    """Every counter a loss needs was known."""
    return (
        counts.reused_tokens is not None
        and counts.prompt_tokens is not None
        and counts.evaluated_tokens is not None
        and counts.prefill_ms is not None
    )


def drop_unrendered_tools(st: Structure, counts: Counts) -> bool:
    """Take the tools out of the structure when the chat template left them out.

    A chat template only adds tokens to the texts it renders, so a server
    prompt that holds the messages' tokenizer counts but not the tools' means
    the tools were not rendered (SmolLM2's template ignores `tools`: two tools
    of 100 tokens, a 37-token prompt), or only in a much shorter form.
    Counting their JSON would claim tokens the server never processed and
    skew the scale from composition units to server tokens.  A prompt smaller
    than the messages alone is something else (a cut prompt) and is left as
    it is.  With estimates, which are rough, only a clear gap tells
    (`_tools_missing_from_estimate`).  Real harnesses against SmolLM2 show it
    (docs/real-harness.md): every prompt was 0.92-1.18x the estimate without
    the tools and 0.11-0.54x with them.
    """
    t = int(st.tools[0])
    prompt = counts.prompt_tokens
    if not t or prompt is None or prompt[1] != SERVER:
        return False
    total = st.total
    without = total - t
    if st.source == TOKENIZER:
        if not without <= prompt[0] < total:
            return False
    elif not _tools_missing_from_estimate(prompt[0], without, t):
        return False
    st.tools = (0, st.tools[1])
    st.tools_dropped = True
    if st.prefix is not None and st.tools_in_prefix:
        st.prefix -= t
        st.tools_in_prefix = False
    if st.tools_after:
        st.after -= st.tools_after
        st.fresh = max(0, st.fresh - st.tools_fresh)
        st.tools_after = st.tools_fresh = 0
    return True


def _client_loss(
    st: Structure,
    counts: Counts,
    factor: float | None,
    unit_src: str,
    external: float,
    tol: int,
) -> Loss | None:
    """What the client's change made the server read again (docs/analysis.md §7).

    With the server's counters and the linked turn's server prompt it is that
    old prompt, less what this prompt no longer holds of it, less what the
    server reused, less what the server lost by itself (`external`): the old
    content the server read again, with no estimate of the new content at
    all.  Without the old prompt, it is what the server evaluated less the
    new content in server units (charged + new + external = evaluated).
    Without the counters, it is the old content after the break, scaled to
    the server's units where the prompt's size is known.
    """
    assert st.break_cause is not None
    evaluated, reused = counts.evaluated_tokens, counts.reused_tokens
    prev = st.prev_prompt
    refused = st.refused_prompt
    if (
        refused is not None
        and prev is not None
        and refused >= prev
        and evaluated is not None
        and evaluated[1] == SERVER
    ):
        # The refused prompt was the old one plus everything new: the server counted
        # the new content itself, and the whole figure is the server's.
        lc = evaluated[0] - (refused - prev) - external
        src = evaluated[1] if not external else weakest(evaluated[1], unit_src)
        if lc <= tol:
            return None
    elif reused is not None and reused[1] == SERVER and (prev is not None or evaluated):
        # Two ways to the same figure, each with one estimated part: the old prompt
        # less what this one no longer holds of it, less the reuse; or what the
        # server evaluated less the new content.  The one with less estimate wins.
        options: list[tuple[float, float]] = []
        if prev is not None:
            old_total = st.old_msgs + (0 if st.tools_dropped else st.old_tools)
            gone = st.removed_msgs + (0 if st.tools_dropped else st.removed_tools)
            gone_srv = prev * gone / old_total if old_total else 0.0
            options.append((gone_srv, prev - gone_srv - reused[0] - external))
        if evaluated is not None and factor is not None:
            fresh_srv = st.fresh * factor
            options.append((fresh_srv, evaluated[0] - fresh_srv - external))
        if not options:
            return None
        part, lc = min(options)
        src = weakest(reused[1], evaluated[1]) if evaluated is not None else reused[1]
        if part > MINOR_ESTIMATE * max(lc, 1.0) or external:
            src = weakest(src, unit_src)  # an estimate entered the figure, not as a detail
        if lc <= tol:
            return None
    else:
        if st.lost <= 0:
            return None
        lc = st.lost * factor if factor is not None else float(st.lost)
        src = weakest(st.lost_source, unit_src) if factor is not None else st.lost_source
    return Loss(st.break_cause, round(lc), loss_ms(lc, src, counts))


def _volatile_loss(
    st: Structure, counts: Counts, factor: float | None, unit_src: str, tol: int
) -> Loss | None:
    """A volatile head's cost: the shared part after it, as far as the server read it again."""
    evaluated = counts.evaluated_tokens
    shared = st.volatile * factor if factor is not None else float(st.volatile)
    if evaluated is not None:
        tokens = min(float(evaluated[0]), shared)
        src = evaluated[1] if tokens == evaluated[0] else weakest(evaluated[1], unit_src)
    else:
        tokens, src = shared, weakest(st.source, unit_src)
    if tokens <= tol:
        return None
    return Loss(SYSTEM_CHANGED, round(tokens), loss_ms(tokens, src, counts))


def _tools_missing_from_estimate(prompt: float, without: int, tools: int) -> bool:
    """With estimates (chars / 4, rough), only a clear gap tells the tools were left
    out: they are a sizeable part of the estimate, and the server's prompt is near the
    messages alone (within `ESTIMATED_MATCH`) and nearer to them than to messages and
    tools together (in ratio)."""
    if without <= 0 or prompt <= 0 or tools < ESTIMATED_TOOLS_SHARE * without:
        return False
    if not ESTIMATED_MATCH * without <= prompt <= without / ESTIMATED_MATCH:
        return False
    total = without + tools
    return max(prompt, without) / min(prompt, without) < max(prompt, total) / min(prompt, total)


def _rerendered(
    st: Structure, counts: Counts, factor: float | None, reused: float, tol: int
) -> str | None:
    """`SERVER_TEMPLATE` when the server's reuse stopped where the replies since the
    previous user message begin: the chat template rendered them otherwise this time."""
    assert st.rerender is not None
    prompt = counts.prompt_tokens
    total = st.total
    if prompt is None or prompt[0] <= 0 or factor is None:
        return None
    if st.new[1] == TOKENIZER and prompt[1] == SERVER and prompt[0] >= total:
        at = st.rerender + (prompt[0] - total) / max(1, st.messages) * st.rerender_msgs
    else:
        at = st.rerender * factor
    return SERVER_TEMPLATE if abs(reused - at) <= tol + 0.1 * at else None


def losses(
    st: Structure,
    counts: Counts,
    btw: Between | None,
    cfg: Config,
    rolls_back: bool = False,
    down: bool = False,
    server: Server = UNKNOWN,
) -> Verdict:
    """Predicted and observed reuse, the two losses, and the row's cause.

    `st` loses its tools block first when the template did not render it
    (`drop_unrendered_tools`); the row's composition is taken from `st` after.
    `rolls_back`: the served model was seen going back into a changed message before
    (`Verdict.rolled_back`), so its cache can return to any position (R31).  A shared
    prefix cache (vLLM, SGLang) always can: it keeps every whole block of a prompt, so
    it re-reads from the last block boundary before the change whatever the model.
    `down`: the server was found down since the linked turn (a restart empties the
    cache whatever the model), so a shortfall keeps its own kind, not R31's.
    `server`: the program that answered (`apis.servers`).  A shared cache (vLLM, SGLang)
    counts reuse in blocks, so a block's shortfall is no loss, and a request in between
    evicts nothing by itself: a loss there is the cache's capacity, not that request's.
    """
    # Every row comes here: `Structure.total` and `.source` and `weakest` of two are
    # inlined, and the tools are only looked at when there are some.
    v = Verdict()
    prompt = counts.prompt_tokens
    reused = counts.reused_tokens
    sy, tl, hi, nw = st.system, st.tools, st.history, st.new
    if tl[0] and prompt is not None and prompt[1] == SERVER and drop_unrendered_tools(st, counts):
        tl = st.tools
    total = int(sy[0] + tl[0] + hi[0] + nw[0])
    if prompt is not None and prompt[0] > 0 and reused is not None:
        v.observed_reuse = round(min(1.0, reused[0] / prompt[0]), 4)
    if not st.linked or st.prefix is None:
        v.predicted_reuse = 0.0
        return v

    factor: float | None = None
    a, b, c, d = sy[1], tl[1], hi[1], nw[1]
    source = unit_src = a if a is b and b is c and c is d else weakest(a, b, c, d)
    if prompt is not None and prompt[0] > 0 and total > 0:
        factor = prompt[0] / total
        p_src = prompt[1]
        unit_src = source if source is not p_src and RANK[source] > RANK[p_src] else p_src
    p_srv, p_src, scaled = _break_position(st, prompt, total, factor, source, unit_src)
    if prompt is not None and prompt[0] > 0:
        v.predicted_reuse = round(min(1.0, p_srv / prompt[0]), 4)
    elif total > 0:
        v.predicted_reuse = round(min(1.0, st.prefix / total), 4)

    tol = cfg.reuse_tolerance_tokens
    rolls_back = rolls_back or server.cache == SHARED
    if st.volatile:
        # R38: a new conversation (or a compaction) that re-read what the server held,
        # only because the prompt's head changed, is charged on its row.
        v.lost_client = _volatile_loss(st, counts, factor, unit_src, tol)

    charged = st.break_cause is not None and not st.compaction
    deficit = 0.0
    external = False
    if reused is not None and factor is not None:
        p_cut = _where_the_server_had_to_go(
            v, st, reused[0], p_srv, p_src, factor, scaled, charged, rolls_back, btw, tol
        )
        deficit = p_cut - reused[0]
        threshold: float = tol + server.block_tokens - 1
        if scaled and source == ESTIMATE:
            threshold += cfg.estimate_margin * p_srv
        external = _external_loss(
            v, st, counts, btw, cfg, deficit, threshold, p_srv, p_src, factor, charged, down, server
        )

    if charged:
        v.lost_client = _client_loss(
            st, counts, factor, unit_src, deficit if external else 0.0, tol
        )

    if v.lost_client is not None and (
        v.lost_external is None or v.lost_client.tokens >= v.lost_external.tokens
    ):
        v.cause = STRUCTURAL
    return v


def _break_position(
    st: Structure,
    prompt: MV | None,
    total: int,
    factor: float | None,
    source: str,
    unit_src: str,
) -> tuple[float, str, bool]:
    """P, where the prompt stops matching the linked turn's, in the server's tokens: its
    value, its source, and whether it was scaled from composition units."""
    assert st.prefix is not None
    if st.exact_prefix is not None and prompt is not None and prompt[1] == SERVER:
        return min(st.exact_prefix, prompt[0]), SERVER, False
    if (
        st.before is not None
        and source == TOKENIZER
        and prompt is not None
        and prompt[1] == SERVER
        and prompt[0] >= total
    ):
        # The tokenizer counted each message's text; the template adds a few tokens to
        # every message wherever it stands, so the messages before the break carry their
        # share of what the server counted beyond the texts, not a share by size.
        per_message = (prompt[0] - total) / max(1, st.messages)
        return st.prefix + per_message * st.before, TOKENIZER, True
    if factor is not None:
        return st.prefix * factor, unit_src, True
    return float(st.prefix), source, True


def _where_the_server_had_to_go(
    v: Verdict,
    st: Structure,
    reused: float,
    p_srv: float,
    p_src: str,
    factor: float,
    scaled: bool,
    charged: bool,
    rolls_back: bool,
    btw: Between | None,
    tol: int,
) -> float:
    """P as the server's own reuse corrects it: a server that went back into the changed
    message showed where the change began (`Verdict.rolled_back`, R31)."""
    assert st.prefix is not None
    p_cut = p_srv
    if st.within and scaled:
        # Where in the changed message the change falls is known only roughly from the
        # ends of a digest's message; a server that reused past the message's start has
        # shown it can go back to any position, and its own reuse is where the change
        # began.  Where the chunks placed the change, only a reuse that reaches it
        # (within its slack) shows that: one short of it is a checkpoint before it,
        # which a sliding-window cache restores (R31).
        if st.within_slack is not None:
            went_back = reused >= p_srv - max(tol, st.within_slack * factor)
        else:
            went_back = reused > (st.prefix - st.within) * factor + tol
        if went_back:
            v.rolled_back = True
            p_cut = min(p_srv, reused)
    if rolls_back and charged and p_src != TOKENIZER and (btw is None or not btw.would_cause):
        # A cache that can go back re-read from the change: where an estimate put the
        # change past the server's reuse, the estimate is what was off.
        p_cut = min(p_cut, reused)
    return p_cut


def _external_loss(
    v: Verdict,
    st: Structure,
    counts: Counts,
    btw: Between | None,
    cfg: Config,
    deficit: float,
    threshold: float,
    p_srv: float,
    p_src: str,
    factor: float,
    charged: bool,
    down: bool,
    server: Server,
) -> bool:
    """Charge what the server re-read short of P to what ran in between, or to the server
    itself (`Verdict.lost_external`); whether anything was charged."""
    reused = counts.reused_tokens
    assert reused is not None
    why = btw.would_cause if btw is not None else None
    shared = server.cache == SHARED
    capacity = shared and why is not None
    if capacity:
        why = None  # a shared cache: what ran in between took memory, not a slot
    if charged and st.tools_differ and why is None:
        # The chat template decides where the tools sit (before the system
        # text, inside it, or late): a changed tools array may break the
        # prompt before its predicted place, and the shortfall is the
        # client's, not the server's (docs/analysis.md §7).
        return False
    if deficit <= threshold:
        return False
    r = reused[0]
    if capacity:
        kind = SERVER_CAPACITY
    elif st.rerender is not None and why is None:
        tol = cfg.reuse_tolerance_tokens
        kind = _rerendered(st, counts, factor, r, tol) or _shortfall(r, p_srv, cfg)
    elif charged and not down and not shared:
        # R31: the client's change began at P; a cache that cannot return to an
        # earlier position re-read what came before it too.
        kind = SERVER_NO_ROLLBACK
    else:
        kind = _shortfall(r, p_srv, cfg)
    v.server_kind = kind
    if why is not None:
        ext_cause, row_cause = why, why
    else:
        ext_cause = kind
        skipped = btw is not None and btw.skipped and not capacity
        row_cause = UNDETERMINED if skipped else SERVER_RESET
    src = weakest(p_src, reused[1])
    v.lost_external = Loss(ext_cause, round(deficit), loss_ms(deficit, src, counts))
    v.cause = row_cause
    return True


def _shortfall(reused: float, p_srv: float, cfg: Config) -> str:
    """How much of the cache the server kept, as a server cause."""
    if reused <= cfg.empty_reuse_tokens:
        return SERVER_EMPTY
    if reused < cfg.head_share * p_srv:
        return SERVER_HEAD_ONLY
    return SERVER_ROLLBACK
