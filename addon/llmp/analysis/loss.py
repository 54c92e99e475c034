"""Prefix, break cause, compaction, and the client and external losses (§6, §7).

`compare` works in composition units (tokenizer counts or estimates);
`losses` converts to the server's units with the row's own ratio and charges
each lost token to a cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
from llmp.format.measure import ESTIMATE, MV, SERVER, TOKENIZER, clean, weakest

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange
    from llmp.apis.base import Counts

SYSTEM_CHANGED = "system_changed"
TOOLS_CHANGED = "tools_changed"
HISTORY_REWRITTEN = "history_rewritten"

STRUCTURAL = "structural"
OTHER_CONVERSATION = "other_conversation"
OTHER_MODEL = "other_model"
SERVER_RESET = "server_reset"
UNDETERMINED = "undetermined"
SERVER_EMPTY = "server_empty"
SERVER_HEAD_ONLY = "server_head_only"
SERVER_ROLLBACK = "server_rollback"

CLIENT_CAUSES = (TOOLS_CHANGED, SYSTEM_CHANGED, HISTORY_REWRITTEN)
EXTERNAL_CAUSES = (SIDE_CALL, OTHER_CONVERSATION, OTHER_MODEL)
SERVER_KINDS = (SERVER_EMPTY, SERVER_HEAD_ONLY, SERVER_ROLLBACK)


@dataclass(slots=True)
class Structure:
    """How a request's prompt relates to the turn it links to, in composition units."""

    system: MV
    tools: MV
    history: MV
    new: MV
    prefix: int | None = None
    break_cause: str | None = None
    compaction: bool = False
    new_conversation: bool = False
    lost: int = 0  # W - P: reusable had the client kept its prompt
    lost_start: int = 0  # where the first of those tokens sits in the prompt
    lost_source: str = ESTIMATE
    exact_prefix: int | None = None  # the linked turn's server prompt, for a clean continuation
    linked: bool = False
    tools_in_prefix: bool = False  # `prefix` counts the tools block
    tools_lost: int = 0  # the part of `lost` that is the tools block

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


def compare(ex: Exchange, link: Link | None, cfg: Config) -> Structure:
    """The structure of a request against the turn it links to (or nothing)."""
    nsys = ex.n_sys
    n = len(ex.hashes)
    system = ex.range_tokens(0, nsys)
    tools = _tools_mv(ex)
    if link is None:
        return Structure(system, tools, (0, system[1]), ex.range_tokens(nsys, n))
    last = link.conv.last
    mode = link.mode
    k = link.k
    if mode == CONTINUATION:
        if ex.tokmap is None and last.rest_source == ESTIMATE:
            history: MV = (last.rest_tokens, ESTIMATE)  # same hashes, same sizes
        else:
            history = ex.range_tokens(nsys, nsys + k)
        new = ex.range_tokens(nsys + k, n)
    elif mode == PREFIX:
        history = ex.range_tokens(nsys, nsys + k)
        new = ex.range_tokens(nsys + k, n)
    elif mode == OVERLAP:
        seen = last.rest_set
        found = [i for i in range(nsys, n) if ex.hashes[i] in seen]
        history = ex.tokens_of(found)
        total = ex.range_tokens(nsys, n)
        new = (total[0] - history[0], total[1])
    else:
        history = (0, system[1])
        new = ex.range_tokens(nsys, n)
    st = Structure(system, tools, history, new, linked=True)

    sys = ex.hashes[:nsys]
    sys_eq = sys == last.sys
    tools_eq = ex.tools.hash == last.tools_hash
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
        return st
    if not sys_eq:
        st.break_cause = SYSTEM_CHANGED
    elif not tools_eq:
        st.break_cause = TOOLS_CHANGED
    elif mode != CONTINUATION:
        st.break_cause = HISTORY_REWRITTEN
    if st.break_cause is None:
        st.exact_prefix = last.prompt_server
        return st

    rest_total = history[0] + new[0]
    if mode == SUMMARY:
        st.compaction = True
    elif (
        st.break_cause == HISTORY_REWRITTEN
        and rest_total <= cfg.compaction_ratio * last.rest_tokens
    ):
        st.compaction = True
    elif _carries_summary(ex, nsys + (k if mode in (CONTINUATION, PREFIX) else 0), link.conv, cfg):
        st.compaction = True
    if st.compaction:
        return st
    _walk_lost(ex, st, last, ps, sys_eq, tools_eq, k if st.break_cause == HISTORY_REWRITTEN else 0)
    return st


def _walk_lost(
    ex: Exchange, st: Structure, last: TurnState, ps: int, sys_eq: bool, tools_eq: bool, k: int
) -> None:
    """W - P, and where it starts: the blocks after the break that the linked
    turn had too, which the server re-processed only because of the break."""
    tok, est = ex.cumulative()
    nsys = ex.n_sys
    n = len(ex.hashes)
    hashes = ex.hashes
    pos = st.prefix or 0
    lost = 0
    first: int | None = None
    estimated = False
    if not sys_eq:
        old_sys = frozenset(last.sys)
        for i in range(ps, nsys):
            t = tok[i + 1] - tok[i]
            if hashes[i] in old_sys:
                first = pos if first is None else first
                lost += t
                estimated = estimated or est[i + 1] != est[i]
            pos += t
    if not (sys_eq and tools_eq):
        t = int(st.tools[0])
        if tools_eq and t:
            first = pos if first is None else first
            lost += t
            st.tools_lost = t
            estimated = estimated or st.tools[1] == ESTIMATE
        pos += t
    seen = last.rest_set
    for i in range(nsys + k, n):
        t = tok[i + 1] - tok[i]
        if hashes[i] in seen:
            first = pos if first is None else first
            lost += t
            estimated = estimated or est[i + 1] != est[i]
        pos += t
    st.lost = int(lost)
    st.lost_start = first if first is not None else pos
    st.lost_source = ESTIMATE if estimated or ex.tokmap is None else TOKENIZER


def _carries_summary(ex: Exchange, index: int, conv: Conversation, cfg: Config) -> bool:
    if index >= len(ex.msgs) or not conv.summaries:
        return False
    m = ex.msgs[index]
    chars = m.get("chars") if isinstance(m, dict) else None
    if type(chars) is not int:
        return False
    return any(
        cfg.summary_min_chars <= s <= chars <= s + cfg.summary_wrap_chars for s in conv.summaries
    )


@dataclass(slots=True)
class Between:
    """Rows that ran between a turn and the turn it links to."""

    side_calls: list[int] = field(default_factory=list)
    other_conversations: list[int] = field(default_factory=list)
    other_domains: list[int] = field(default_factory=list)
    entries: list[RingEntry] = field(default_factory=list)
    last_same: str | None = None  # kind of the last same-model row in between
    skipped: bool = False

    @property
    def would_cause(self) -> str | None:
        """The external cause a loss here would get, if any row ran in between."""
        if self.last_same is not None:
            return self.last_same
        if self.other_domains:
            return OTHER_MODEL
        return None


NOTHING_BETWEEN = Between()
"""Shared by every turn that nothing ran before; never mutated."""


def between(session: Session, since: int, served: str, conversation: int | None) -> Between:
    """Scan the session's recent rows back to the linked turn."""
    ring = session.ring
    if (not ring or ring[-1].id <= since) and not (session.skipped and session.skipped[-1] > since):
        return NOTHING_BETWEEN  # the usual case
    b = Between()
    for e in reversed(session.ring):
        if e.id <= since:
            break
        b.entries.append(e)
        if e.served == served:
            if e.kind == SIDE_CALL:
                b.side_calls.append(e.id)
                if b.last_same is None:
                    b.last_same = SIDE_CALL
            elif e.kind == STATELESS or e.conversation != conversation:
                b.other_conversations.append(e.id)
                if b.last_same is None:
                    b.last_same = OTHER_CONVERSATION
        else:
            b.other_domains.append(e.id)
    b.side_calls.reverse()
    b.other_conversations.reverse()
    b.other_domains.reverse()
    b.entries.reverse()
    b.skipped = bool(session.skipped) and session.skipped[-1] > since
    return b


@dataclass(slots=True)
class Verdict:
    predicted_reuse: float | None = None
    observed_reuse: float | None = None
    lost_client: Loss | None = None
    lost_external: Loss | None = None
    cause: str | None = None
    server_kind: str | None = None


def _ms(tokens: float, src: str, counts: Counts) -> MV | None:
    pre, ev = counts.prefill_ms, counts.evaluated_tokens
    if pre is None or ev is None or ev[0] <= 0:
        return None
    return (clean(tokens * pre[0] / ev[0]), weakest(src, pre[1], ev[1]))


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
    it is.  Only with tokenizer counts: estimates are too rough to tell.
    """
    t = int(st.tools[0])
    prompt = counts.prompt_tokens
    if not t or prompt is None or prompt[1] != SERVER or st.source != TOKENIZER:
        return False
    if not st.total - t <= prompt[0] < st.total:
        return False
    st.tools = (0, st.tools[1])
    if st.prefix is not None and st.tools_in_prefix:
        st.prefix -= t
        st.tools_in_prefix = False
    if st.tools_lost:
        st.lost -= st.tools_lost
        st.tools_lost = 0
    sys_end = int(st.system[0])
    if st.lost_start > sys_end:
        st.lost_start = max(sys_end, st.lost_start - t)
    return True


def losses(st: Structure, counts: Counts, btw: Between | None, cfg: Config) -> Verdict:
    """Predicted and observed reuse, the two losses, and the row's cause.

    `st` loses its tools block first when the template did not render it
    (`drop_unrendered_tools`); the row's composition is taken from `st` after.
    """
    v = Verdict()
    drop_unrendered_tools(st, counts)
    prompt = counts.prompt_tokens
    reused = counts.reused_tokens
    total = st.total
    if prompt is not None and prompt[0] > 0 and reused is not None:
        v.observed_reuse = round(min(1.0, reused[0] / prompt[0]), 4)
    if not st.linked or st.prefix is None:
        v.predicted_reuse = 0.0
        return v

    factor: float | None = None
    unit_src = st.source
    if prompt is not None and prompt[0] > 0 and total > 0:
        factor = prompt[0] / total
        unit_src = weakest(prompt[1], st.source)
    scaled = True
    if st.exact_prefix is not None and prompt is not None and prompt[1] == SERVER:
        p_srv: float = min(st.exact_prefix, prompt[0])
        p_src = SERVER
        scaled = False
    elif factor is not None:
        p_srv, p_src = st.prefix * factor, unit_src
    else:
        p_srv, p_src = float(st.prefix), st.source
    if prompt is not None and prompt[0] > 0:
        v.predicted_reuse = round(min(1.0, p_srv / prompt[0]), 4)
    elif total > 0:
        v.predicted_reuse = round(min(1.0, st.prefix / total), 4)

    r_known = reused is not None and factor is not None
    tol = cfg.reuse_tolerance_tokens

    if st.break_cause is not None and not st.compaction and st.lost > 0:
        lost_srv = st.lost * factor if factor is not None else float(st.lost)
        src = weakest(st.lost_source, unit_src) if factor is not None else st.lost_source
        if r_known and reused is not None and factor is not None:
            # Reuse that reached into the lost region saved part of it.
            lc = lost_srv - max(0.0, reused[0] - st.lost_start * factor)
            src = weakest(src, reused[1])
            keep = lc > tol
        else:
            lc = lost_srv
            keep = lc > 0
        if keep:
            v.lost_client = Loss(st.break_cause, round(lc), _ms(lc, src, counts))

    if r_known and reused is not None:
        deficit = p_srv - reused[0]
        threshold: float = tol
        if scaled and st.source == ESTIMATE:
            threshold += cfg.estimate_margin * p_srv
        if deficit > threshold:
            src = weakest(p_src, reused[1])
            r = reused[0]
            if r <= cfg.empty_reuse_tokens:
                kind = SERVER_EMPTY
            elif r < cfg.head_share * p_srv:
                kind = SERVER_HEAD_ONLY
            else:
                kind = SERVER_ROLLBACK
            v.server_kind = kind
            why = btw.would_cause if btw is not None else None
            if why is not None:
                ext_cause, row_cause = why, why
            else:
                ext_cause = kind
                row_cause = UNDETERMINED if btw is not None and btw.skipped else SERVER_RESET
            v.lost_external = Loss(ext_cause, round(deficit), _ms(deficit, src, counts))
            v.cause = row_cause

    if v.lost_client is not None and (
        v.lost_external is None or v.lost_client.tokens >= v.lost_external.tokens
    ):
        v.cause = STRUCTURAL
    return v
