"""The analysis engine: one record in, at most one row out.

The engine is fed records one at a time in session and id order, and makes
each row as soon as its record arrives, from what came before it only.  The
report after the fact and the recorder's live view (issue 7) both drive this
one engine.  State is bounded by the number of live conversations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

from llmp.analysis.causes import CLIENT_CAUSES, MODEL_CHANGED
from llmp.analysis.classify import ONESHOT, SIDE_CALL, STATELESS, SUMMARISE, TURN, classify
from llmp.analysis.clients import ClientRegistry
from llmp.analysis.config import Config
from llmp.analysis.counters import exchange_counts
from llmp.analysis.exchange import Digested, Exchange, Skip, Tools, prepare
from llmp.analysis.findings import Findings
from llmp.analysis.identity import conflicts
from llmp.analysis.linking import (
    HEAD,
    PREFIX,
    REPLY_MIN_CHARS,
    Conversation,
    RingEntry,
    Session,
    TurnState,
    find_link,
)
from llmp.analysis.loss import (
    Between,
    Structure,
    Verdict,
    between,
    compare,
    loss_measured,
    losses,
    resort,
)
from llmp.analysis.provider import Miss, ProviderTurn, billing_line, miss_usd, turn_of
from llmp.analysis.provider import verdict as provider_verdict
from llmp.analysis.reader import ReadStats
from llmp.analysis.report import (
    Spill,
    Totals,
    build_header,
    spilled_blocks,
    spilled_rows,
    write_report,
)
from llmp.analysis.rows import Row
from llmp.apis.base import CacheUsage, Counts
from llmp.apis.providers import ANTHROPIC
from llmp.format.measure import SERVER, weakest


@dataclass(slots=True)
class _Held:
    """A first turn held back until the client's next request says what it was."""

    fed: Fed
    conv: Conversation
    entry: RingEntry
    waited: int = 0


def _may_be_a_side_call(ex: Exchange) -> bool:
    """A first turn that could be a one-off side-call: no tools, nothing answered yet."""
    return not ex.tools.names and not ex.has_model_msgs and len(ex.hashes) - ex.n_sys <= 2


@dataclass(slots=True)
class Fed:
    """What one record became: its row, and what ran since the turn it links to."""

    row: Row
    between: Between | None
    """Rows that ran between this turn and `row.linked_to`; None for side-calls and
    stateless rows, which are compared with nothing."""
    exchange: Exchange
    """The record as the analysis read it (hashes, sizes, counters; no text)."""
    structure: Structure | None = None
    """What its verdict was worked out from, while it may still be worked out again."""
    entry: RingEntry | None = None
    """Its entry in the session's ring, while a later request may change its kind."""


@dataclass(slots=True)
class _Waiting:
    """Rows held back while a side-call among them may yet prove the first turn of a
    conversation: a later request that continues a request makes it one (R33's
    structure rules, docs/analysis.md §5)."""

    rows: deque[Fed] = field(default_factory=deque)
    open: dict[int, int] = field(default_factory=dict)
    """The rows still undecided: row id -> records seen since."""
    forks: dict[int, Conversation] = field(default_factory=dict)
    """Of those, the turns that kept only the start of their conversation's last turn:
    row id -> the conversation (its `alt` holds the turn they left)."""


def _set_verdict(row: Row, v: Verdict) -> None:
    row.predicted_reuse, row.observed_reuse = v.predicted_reuse, v.observed_reuse
    row.cause = v.cause
    row.lost_client, row.lost_external = v.lost_client, v.lost_external


def _continues_alt(ex: Exchange, conv: Conversation) -> bool:
    """Whether `ex` continues the turn a fork left (`conv.alt`) and not the fork's line:
    it carries what the fork dropped, so the fork was another conversation."""
    alt = conv.alt
    if alt is None or ex.ua != conv.ua or ex.served_model != conv.served:
        return False
    if conflicts(ex.sessions, conv.sessions):
        return False
    rest = ex.hashes[ex.n_sys :]
    n = len(alt.rest)
    tip = conv.last.rest
    return (
        len(rest) >= n
        and alt.sys == ex.hashes[: ex.n_sys]
        and rest[:n] == alt.rest
        and rest[: len(tip)] != tip
    )


def continues(ex: Exchange, first: Exchange) -> bool:
    """Whether `ex` continues `first`: it resends all of `first`'s messages, then
    something that is not the user's (the reply `first` got), from the same client
    and session, on the same model."""
    n = len(first.hashes)
    return (
        len(ex.hashes) > n
        and ex.ua == first.ua
        and ex.served_model == first.served_model
        and not conflicts(ex.sessions, first.sessions)
        and ex.hashes[:n] == first.hashes
        and ex.msgs[n].role not in ("user", "system", "developer")
    )


class Engine:
    """Feed records with `feed`; get the report with `header` and `rows`."""

    def __init__(
        self,
        cfg: Config | None = None,
        *,
        spill: bool = True,
        summaries: bool = True,
        report: bool = True,
        keep: bool = False,
    ) -> None:
        """`spill` keeps the rows for `--json`; `summaries` one line per
        conversation for the readable report; `report=False` keeps no totals
        and no findings (the live view only wants rows, and runs for days);
        `keep` holds every row in `kept` (the HTML page draws them all)."""
        self.cfg = cfg or Config()
        self.clients = ClientRegistry()
        self.totals = Totals(summaries)
        self.findings = Findings(self.cfg)
        self.spill: Spill | None = Spill() if spill else None
        self.kept: list[Row] | None = [] if keep else None
        self.report = report
        self.session: Session | None = None
        self.conversations = 0
        self._tools_cache: dict[str, Tools] = {}
        # A first turn that may yet prove a side-call (`_decide_held`); offline only.
        self._held: _Held | None = None
        self._made: tuple[Conversation, RingEntry] | None = None
        self._waiting = _Waiting()
        self._last_structure: Structure | None = None
        self._forked: Conversation | None = None
        """The conversation this row forked (`Conversation.alt`), if it did."""
        self.recording = 0
        """The file the records fed now come from, for `Row.recording` (the reader sets it)."""

    # -- input ------------------------------------------------------------

    def feed(self, session: int, rec: dict[str, Any] | Digested) -> Fed | None:
        """Analyse one record of `session`: what it became, or None when it is no row.

        `rec` is a parsed record (`format.lines.parse_line`), or one the fast path
        read (`exchange.read_record`); both give the same row.
        """
        ex = prepare(rec, self._tools_cache)
        if type(rec) is Digested:
            t_start = rec.rec.t_start_ms
        else:
            assert isinstance(rec, dict)
            t_start = rec["t_start_ms"]
        report = self.report
        if report:
            totals = self.totals  # Totals.record, inlined: every record
            totals.records += 1
            if totals.start_ms is None or t_start < totals.start_ms:
                totals.start_ms = t_start
            if totals.end_ms is None or t_start > totals.end_ms:
                totals.end_ms = t_start
        s = self.session
        if s is None or s.number != session:
            self.flush()
            s = self.session = Session(session, self.cfg)
        held = self._held
        if held is not None:
            held.waited += 1
            ua = held.fed.exchange.ua
            if isinstance(ex, Exchange) and ex.ua == ua:
                self._decide_held(s, ex.tools.names, ex.hashes[: ex.n_sys])
            elif isinstance(ex, Skip) and ex.probe is not None and ex.probe.ua == ua:
                # A request of the same client that failed still shows its next move.
                self._decide_held(s, ex.probe.tool_names, ex.probe.sys)
            elif (isinstance(ex, Skip) and ex.refusal is not None) or (
                held.waited > self.cfg.side_call_lookahead
            ):
                # A refusal is told apart by the rows before it (their served models):
                # the held row goes first.
                self._emit(self._release())
        if isinstance(ex, Skip):
            if ex.chat:  # a chat request that is no row: the plain path's records only
                assert isinstance(rec, dict)
                s.skip(rec)
                refusal = ex.refusal
                if refusal is not None and refusal.n_prompt is not None:
                    s.refused.append((rec["id"], refusal.model, refusal.n_prompt))
                if report and refusal is not None:
                    self.findings.refused(session, rec["id"], refusal)
            if report:
                self.totals.skip(ex.reason, ex.path)
            return None
        if self._waiting.open:
            self._step_waiting(s, ex)
        self._made = None
        row, btw = self._row(s, ex)
        row.recording = self.recording
        row.draft_n, row.draft_n_accepted = ex.draft_n, ex.draft_n_accepted
        fed = Fed(row, btw, ex)
        if report and self.cfg.side_call_lookahead > 0:
            if row.kind == SIDE_CALL:
                self._waiting.open[row.id] = 0
            elif self._forked is not None:
                self._waiting.open[row.id] = 0
                self._waiting.forks[row.id] = self._forked
            if self._waiting.open:  # kept to be worked out again if it changes
                fed.structure, fed.entry = self._last_structure, s.ring[-1] if s.ring else None
        made = self._made
        if (
            report
            and made is not None
            and self.cfg.side_call_lookahead > 0
            and _may_be_a_side_call(ex)
        ):
            if self._held is not None:  # another client's, still undecided: as it looked
                self._emit(self._release())
            self._held = _Held(fed, made[0], made[1])  # decided by what the client sends next
        else:
            self._emit(fed)
        return fed

    def _emit(self, fed: Fed) -> None:
        """A decided row: final unless a side-call held before it may still change it."""
        waiting = self._waiting
        if waiting.open or waiting.rows:
            waiting.rows.append(fed)
            self._drain()
        else:
            self._final(fed)

    def _drain(self) -> None:
        """Make final the held rows no undecided side-call comes before."""
        waiting = self._waiting
        rows, open_ = waiting.rows, waiting.open
        while rows and rows[0].row.id not in open_:
            fed = rows.popleft()
            fed.structure = fed.entry = None
            self._final(fed)

    def _step_waiting(self, s: Session, ex: Exchange) -> None:
        """Before `ex` is linked: the held side-calls it continues become first turns;
        those it waited too long for stay side-calls."""
        waiting = self._waiting
        for fed in list(waiting.rows):
            rid = fed.row.id
            if rid not in waiting.open:
                continue
            conv = waiting.forks.get(rid)
            if conv is not None:
                if _continues_alt(ex, conv):
                    del waiting.open[rid], waiting.forks[rid]
                    self._split(s, fed, conv)
                else:
                    waiting.open[rid] += 1
                    if waiting.open[rid] > self.cfg.side_call_lookahead:
                        del waiting.open[rid], waiting.forks[rid]
                        conv.alt = None  # a rewrite of its own history after all
                continue
            if continues(ex, fed.exchange):
                del waiting.open[rid]
                self._start_from(s, fed)
            else:
                waiting.open[rid] += 1
                if waiting.open[rid] > self.cfg.side_call_lookahead:
                    del waiting.open[rid]
        for rid in [r for r in waiting.open if not any(f.row.id == r for f in waiting.rows)]:
            del waiting.open[rid]  # emitted elsewhere (a held first turn's decision)
            conv = waiting.forks.pop(rid, None)
            if conv is not None:
                conv.alt = None
        self._drain()

    def _start_from(self, s: Session, fed: Fed) -> None:
        """A side-call a later request continues was the first turn of a conversation:
        so is its row, and the held rows that counted it as a side-call in between
        count it as another conversation."""
        row, ex, st = fed.row, fed.exchange, fed.structure
        assert st is not None
        self.conversations += 1
        family = self.clients.family_for(ex.ua, ex.tools.names)
        conv = Conversation(
            self.conversations,
            ex.ua,
            ex.served_model,
            family,
            self.clients.key(ex.ua, family),
            self._turn_state(ex, st, row.counts),
            sessions=ex.sessions,
        )
        row.kind, row.side_call_shape, row.client = TURN, None, conv.client
        row.conversation, row.turn = conv.number, 1
        row.server = s.server_for(ex.served_model).name
        _set_verdict(row, losses(st, row.counts, None, self.cfg))
        fed.between = Between([], [], [], [])
        s.touch(conv)
        if fed.entry is not None and fed.entry.id == row.id:
            fed.entry.kind, fed.entry.shape = TURN, None
            fed.entry.conversation, fed.entry.client = conv.number, conv.client
        for other in self._waiting.rows:
            btw = other.between
            if btw is not None and row.id in btw.side_calls and other.structure is not None:
                btw = other.between = resort(btw)
                o = other.row
                o.side_calls_between = btw.side_calls
                o.other_conversations_between = btw.other_conversations
                down = o.linked_to is not None and s.down_since(o.linked_to)
                server = s.server_for(o.served)
                rolls = o.served in s.rolls_back
                verdict = losses(other.structure, o.counts, btw, self.cfg, rolls, down, server)
                _set_verdict(o, verdict)

    def _split(self, s: Session, fork: Fed, conv: Conversation) -> None:
        """A fork proved another conversation with the same start: it and the turns
        after it on its line become a new conversation, and `conv` goes back to the
        turn the fork left.  The fork is compared with nothing: what it shares with
        `conv` is a start both had, not a history it rewrote."""
        self.conversations += 1
        new = Conversation(
            self.conversations,
            conv.ua,
            conv.served,
            conv.family,
            conv.client,
            conv.last,
            turns=0,
            sessions=conv.sessions,
        )
        first = fork.row.id
        for fed in self._waiting.rows:
            row = fed.row
            if row.kind != TURN or row.conversation != conv.number or row.id < first:
                continue
            new.turns += 1
            conv.turns -= 1
            row.conversation, row.turn = new.number, new.turns
            if fed.entry is not None and fed.entry.id == row.id:
                fed.entry.conversation = new.number
        row, st = fork.row, fork.structure
        assert st is not None and conv.alt is not None
        flat = st.unlinked()
        row.composition = (flat.system, flat.tools, flat.history, flat.new)
        row.linked_to, row.new_conversation, row.prefix_tokens = None, False, None
        row.break_cause, row.compaction, row.changed, row.volatile_where = None, False, None, None
        row.side_calls_between, row.other_conversations_between = [], []
        row.other_domains_between = []
        _set_verdict(row, losses(flat, row.counts, None, self.cfg))
        fork.between = Between([], [], [], [])
        conv.last, conv.alt = conv.alt, None
        s.touch(new)
        s.touch(conv)

    def _final(self, fed: Fed) -> None:
        """Sum a final row into the totals and findings, and keep it."""
        row, ex = fed.row, fed.exchange
        if self.report:
            totals = self.totals
            totals.add(row)
            totals.stored_prompts += ex.stored_prompt  # Totals.stored, inlined
            totals.offer(row.client, ex, row.session)
            self.findings.add(row, fed.between, ex)
        if self.spill is not None:
            self.spill.write(row)
        if self.kept is not None:
            self.kept.append(row)

    def _release(self) -> Fed:
        held, self._held = self._held, None
        assert held is not None
        return held.fed

    def flush(self) -> None:
        """Decide what still waits (at the end of the input, or of a session)."""
        if self._held is not None:
            self._emit(self._release())
        self._waiting.open.clear()
        for conv in self._waiting.forks.values():
            conv.alt = None
        self._waiting.forks.clear()
        self._drain()

    def _decide_held(self, s: Session, tool_names: frozenset[str], sys: tuple[str, ...]) -> None:
        """The held first turn was a side-call when the same client's next request starts
        a tool-using conversation with another system prompt (opencode's title call
        before its first turn, docs/analysis.md §5); else it was the turn it looked."""
        held = self._held
        assert held is not None
        fed = self._release()
        first = fed.exchange
        if not (tool_names and sys != first.hashes[: first.n_sys]):
            self._emit(fed)
            return
        row, conv = fed.row, held.conv
        s.forget(conv)
        if conv.number == self.conversations:
            self.conversations -= 1  # its number goes to the conversation that follows
        row.kind, row.side_call_shape = SIDE_CALL, ONESHOT
        row.conversation = row.turn = None
        row.new_conversation = False
        held.entry.kind, held.entry.shape, held.entry.conversation = SIDE_CALL, ONESHOT, None
        self._emit(fed)

    def _row(self, s: Session, ex: Exchange) -> tuple[Row, Between | None]:
        # The hot path: lookups are inlined.  `Row` is built by keywords (about 1.5 µs a
        # row more than positionally, docs/performance.md, "Fast-path twins").
        cfg = self.cfg
        self._forked = None
        n_sys = ex.n_sys
        hashes = ex.hashes
        ua, served = ex.ua, ex.served_model
        same_start = s.by_first.get((ua, served, hashes[n_sys])) if len(hashes) > n_sys else None
        group = None if ex.stored_prompt else s.by_key.get((ua, served))
        link = find_link(ex, group, same_start, cfg) if group else None
        provider = ex.provider
        model_changed = False
        if provider is not None and not ex.stored_prompt and (link is None or link.mode == HEAD):
            # On a provider a conversation may go on with another model (R35).
            other = s.other_model(ex, cfg)
            if other is not None:
                link, model_changed = other, True
        ref = link.conv if link is not None else s.recent_for(ua, ex.sessions)
        if ua is not ex.user_agent:
            self.clients.name(ua, ex.user_agent)
        st = compare(ex, link, cfg, provider == ANTHROPIC and billing_line(ex))
        if link is not None and st.break_cause is not None:
            # A prompt refused for its context on the way here (a harness that cut its
            # prompt after a 400): the server's own count of it measures the new content.
            st.refused_prompt = s.refused_since(link.conv.last.row_id, ex.id, ex.requested_model)
        sy, tl, hi, nw = st.system, st.tools, st.history, st.new  # Structure.total, .source
        total = int(sy[0] + tl[0] + hi[0] + nw[0])
        a, b, c, d = sy[1], tl[1], hi[1], nw[1]
        source = a if a is b and b is c and c is d else weakest(a, b, c, d)
        kind, shape = classify(ex, link, ref, total, cfg)
        known_old = served in s.ollama_old
        counts = exchange_counts(ex, (total, source), cfg.ollama_evaluated_share, known_old)
        if counts.meaning == "old" and not known_old:
            s.ollama_old.add(served)
        if counts.reused_tokens is not None:
            s.observe(served, counts)  # every row's reuse shows the server's block
        model = ex.requested_model or served
        api_name = ex.api.name
        pm = counts.prefill_ms
        top = ex.top
        server = s.server_of(
            served,
            ex.server,
            api_name,
            pm is not None and pm[1] == SERVER,
            top if type(top) is dict else None,
            provider,
        )
        usage = ex.cache_usage()
        prov = (
            turn_of(ex, provider, usage, ex.t_first_byte or ex.t_start)
            if provider is not None
            else None
        )

        if kind != TURN:
            clients = self.clients
            client = clients.key(ua, clients.family_for(ua, ex.tools.names))
            if kind == SIDE_CALL and ref is not None:
                if shape == SUMMARISE:
                    ref.summaries.append(ex.out_chars)
                    del ref.summaries[:-4]
                if ex.out_chars >= REPLY_MIN_CHARS:
                    ref.replies.append(ex.out_chars)
                    del ref.replies[:-4]
            flat = self._last_structure = st.unlinked()
            row = Row(
                id=ex.id,
                api=api_name,
                model=model,
                client=client,
                t_start_ms=ex.t_start,
                kind=kind,
                side_call_shape=shape,
                session=s.number,
                conversation=None,
                turn=None,
                counts=counts,
                composition=(flat.system, flat.tools, flat.history, flat.new),
                loss_measured=loss_measured(counts),
                served=served,
            )
            self._money(row, ex, server.name, usage, prov)
            s.ring.append(RingEntry(ex.id, served, kind, None, shape, client, model))
            return row, None

        if link is None:
            st = st.unlinked()
        self._last_structure = st
        state = self._turn_state(ex, st, counts, prov)
        if (
            link is not None
            and link.mode == PREFIX
            and self.report
            and cfg.side_call_lookahead > 0
            and link.conv.alt is None
            and link.k < len(link.conv.last.rest)
        ):
            link.conv.alt = link.conv.last
            self._forked = link.conv
        if link is None or link.mode == HEAD:
            self.conversations += 1
            family = self.clients.family_for(ua, ex.tools.names)
            conv = Conversation(
                self.conversations,
                ua,
                served,
                family,
                self.clients.key(ua, family),
                state,
                sessions=ex.sessions,
            )
        else:
            conv = link.conv
            conv.turns += 1
            self.clients.widen(ua, conv.family, ex.tools.names)
            if model_changed:
                s.rekey(conv, served)

        btw: Between | None = None
        linked_to: int | None = None
        if link is not None:
            linked_to = link.conv.last.row_id
            btw = between(s, linked_to, served, conv.number)
        down = linked_to is not None and s.down_since(linked_to)
        why: Miss | None = None
        if prov is not None:
            last = link.conv.last.prov if link is not None else None
            verdict, why = provider_verdict(st, counts, prov, last, model_changed, cfg, ex.t_start)
            lc = verdict.lost_client
            if not (st.new_conversation or st.compaction):
                if model_changed:
                    st.break_cause = MODEL_CHANGED
                elif lc is not None and lc.cause in CLIENT_CAUSES:
                    st.break_cause = lc.cause  # the tier that decided it (R35)
        else:
            verdict = losses(st, counts, btw, cfg, served in s.rolls_back, down, server)
        if verdict.rolled_back:
            s.rolls_back.add(served)
        row = Row(
            id=ex.id,
            api=api_name,
            model=model,
            client=conv.client,
            t_start_ms=ex.t_start,
            kind=TURN,
            side_call_shape=None,
            session=s.number,
            conversation=conv.number,
            turn=conv.turns,
            counts=counts,
            composition=(st.system, st.tools, st.history, st.new),
            linked_to=linked_to,
            new_conversation=st.new_conversation,
            prefix_tokens=st.prefix,
            break_cause=st.break_cause,
            compaction=st.compaction,
            predicted_reuse=verdict.predicted_reuse,
            observed_reuse=verdict.observed_reuse,
            cause=verdict.cause,
            lost_client=verdict.lost_client,
            lost_external=verdict.lost_external,
            side_calls_between=btw.side_calls if btw is not None else [],
            other_conversations_between=btw.other_conversations if btw is not None else [],
            other_domains_between=btw.other_domains if btw is not None else [],
            loss_measured=loss_measured(counts),
            changed=st.changed or None,
            served=served,
            volatile_where=st.volatile_where,
            miss=why,
        )
        self._money(row, ex, server.name, usage, prov)
        conv.last = state
        s.touch(conv)
        entry = RingEntry(ex.id, served, TURN, conv.number, None, conv.client, model)
        s.ring.append(entry)
        if link is None:
            self._made = (conv, entry)
        return row, btw

    def _money(
        self,
        row: Row,
        ex: Exchange,
        server: str,
        usage: CacheUsage | None,
        prov: ProviderTurn | None,
    ) -> None:
        """R34-R36 on a row: its server, its cache split, and on a provider what it cost
        and what its losses cost beyond reading the same tokens from the cache."""
        row.server = server
        row.provider_reason = ex.provider_reason()
        if usage is not None:
            row.cache_read_tokens = usage.read
            row.cache_write_tokens = usage.write
            row.uncached_tokens = usage.uncached
        row.prov = prov
        if prov is None or usage is None:
            return
        # On a provider a loss needs only its counts (tokens and dollars), not a time.
        row.loss_measured = True
        rates = self.cfg.pricing().rates(
            ex.served_model, prov.provider, ex.t_start, usage.tier, usage.prompt
        )
        if rates is None:
            return
        row.rates = rates
        row.cost_usd = rates.usd(
            uncached=usage.uncached,
            cache_read=usage.read,
            write_5m=usage.write_5m,
            write_1h=usage.write_1h,
            output=usage.output or 0,
        )
        for loss in (row.lost_client, row.lost_external):
            if loss is not None:
                loss.usd = miss_usd(rates, usage, loss.tokens)

    @staticmethod
    def _turn_state(
        ex: Exchange, st: Structure, counts: Counts, prov: ProviderTurn | None = None
    ) -> TurnState:
        prompt = counts.prompt_tokens
        history, new = st.history, st.new
        n_sys = ex.n_sys
        rest = ex.hashes[n_sys:]
        hs, ns = history[1], new[1]
        return TurnState(
            ex.id,
            ex.hashes[:n_sys],
            ex.tools.hash,
            rest,
            int(history[0] + new[0]),
            hs if hs is ns else weakest(hs, ns),
            int(prompt[0]) if prompt is not None and prompt[1] == SERVER else None,
            ex.requested_model,
            ex.structured,
            bool(ex.tools.names),
            ex.max_tokens,
            ex.out_chars,
            hash(rest),
            ex.msgs,
            ex.tool_digests,
            ex.texts,
            prov,
        )

    # -- output -----------------------------------------------------------

    def header(self, stats: ReadStats | None = None) -> dict[str, Any]:
        """The report v1 without its rows (`stats` gives the reader's bad lines)."""
        self.flush()  # rows held back are final at the end of the input
        labels = self.clients.labels()
        user_agents = [self.clients.user_agent(k) for k in range(len(labels))]
        tool_stats = self.totals.tool_stats()
        findings = self.findings.build(self.clients.label, tool_stats)
        prices = self.cfg.pricing().label if self.totals.cost.rows else ""
        return build_header(self.totals, stats, labels, user_agents, findings, tool_stats, prices)

    def write_json(self, out: IO[bytes], stats: ReadStats | None = None) -> None:
        """The whole report v1, rows copied from the spill file."""
        header = self.header(stats)
        assert self.spill is not None
        write_report(out, header, spilled_blocks(self.spill, self.clients.labels()))

    def row_lines(self) -> list[bytes]:
        """The rows as JSON (for tests and small reports)."""
        assert self.spill is not None
        return list(spilled_rows(self.spill, self.clients.labels()))

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()


__all__ = ["STATELESS", "Engine", "Fed"]
