"""The report v1: totals summed from rows, and writing it with rows streamed.

Rows are spilled to a temporary file as they are made; the report's other
parts are summed as rows go by, and at the end the header is written and the
rows copied behind it, so memory never holds the rows.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import orjson

from llmp.analysis.classify import TURN
from llmp.analysis.exchange import SKIP_REASONS, Exchange, Tools
from llmp.analysis.findings import UNREAD_CACHE_WRITES, ToolStats
from llmp.analysis.overflow import CONTEXT_OVERFLOW
from llmp.analysis.provider import NONE, agrees, comparable
from llmp.analysis.rows import Labels, LossByCause, Row, join_block, join_spilled, spill_line
from llmp.analysis.words import usd
from llmp.apis.base import FIELDS
from llmp.format.measure import MV, SERVER, Sum, as_json

if TYPE_CHECKING:
    from llmp.analysis.reader import ReadStats

REPORT_VERSION = 1


BLOCK = 256 << 10
"""Bytes of spilled rows read back at a time.  Larger blocks cost page faults: the
allocator hands each freed megabyte back to the system, and a block is copied a few
times on its way out (1 MiB blocks made the write ~2x slower, in system time)."""


class Spill:
    """Finished rows, serialised, in a temporary file."""

    BATCH = 512
    """Rows gathered before a write: a row is ~1 KB, and a write per row costs more
    than a list append and a join per batch."""

    def __init__(self) -> None:
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix="llmp-rows-", buffering=0)
        self._batch: list[bytes] = []
        self.count = 0

    def write(self, row: Row) -> None:
        batch = self._batch
        batch.append(spill_line(row))
        self.count += 1
        if len(batch) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._file.write(b"".join(self._batch))
            self._batch = []

    def lines(self) -> Iterator[bytes]:
        """The spilled lines, one by one (JSON text holds no raw line break)."""
        for block in self.blocks():
            yield from block.splitlines(keepends=True)

    def blocks(self, size: int = BLOCK) -> Iterator[bytes]:
        """The spilled lines, about `size` bytes of whole lines at a time."""
        self._flush()
        f = self._file
        f.seek(0)
        rest = b""
        while chunk := f.read(size):
            cut = chunk.rfind(b"\n") + 1
            if not cut:  # no line ends in it: a row longer than a block
                rest += chunk
                continue
            whole = chunk if cut == len(chunk) else chunk[:cut]
            yield rest + whole if rest else whole
            rest = chunk[cut:]
        if rest:
            yield rest

    def close(self) -> None:
        self._batch = []
        self._file.close()


@dataclass
class ConversationSummary:
    """What the readable report shows per conversation."""

    number: int
    client: int
    model: str
    served: str
    session: int
    turns: int = 0
    first_t: int = 0
    last_t: int = 0
    prompt_tokens: int | None = None
    prefill: Sum = field(default_factory=Sum)
    lost_tokens: int = 0
    lost_ms: Sum = field(default_factory=Sum)
    cost_usd: float | None = None
    """What its turns cost on a provider (R36); None where none was priced."""
    lost_usd: float | None = None
    """What its losses cost beyond reading the same tokens from the cache (R36)."""


@dataclass
class _Client:
    requests: int = 0
    conversations: int = 0
    tools: dict[str, None] = field(default_factory=dict)
    first_id: int = 0
    last_tools: Tools | None = None
    """The tools array whose names were added last: a harness resends the same one
    (the same cached object) on every request, and adding it again changes nothing."""


class Totals:
    """Everything outside `rows`, summed as rows (and skipped records) go by."""

    def __init__(self, summaries: bool = True) -> None:
        self.summaries = summaries  # per-conversation summaries, for the readable report
        self.records = 0
        self.skipped: Counter[str] = Counter()
        self.paths: Counter[str] = Counter()
        self.start_ms: int | None = None
        self.end_ms: int | None = None
        self.analysed = 0
        self.turns = 0
        self.turns_with_reuse = 0
        self.turns_with_timing = 0
        self.side_calls = 0
        self.stateless = 0
        self.stored_prompts = 0
        self.conversations = 0
        self.servers: dict[tuple[str, str | None], set[str]] = {}
        self._unseen: dict[tuple[str, str | None], list[str]] = {}
        self.cost = CostTotals()
        self.agreement = Agreement()
        self.prefill = Sum()
        self.losses = LossByCause()
        self.composition: list[float] = [0, 0, 0, 0]
        self.clients: dict[int, _Client] = {}
        self.offers: dict[tuple[int, str], list[Any]] = {}
        self.called: Counter[tuple[int, str]] = Counter()
        self.convs: dict[int, ConversationSummary] = {}
        self.sessions: set[int] = set()
        # Per served model: rows that reported drafting, Σ draft_n, Σ draft_n_accepted.
        self.speculative: dict[str, list[int]] = {}

    def record(self, t_start: int) -> None:
        self.records += 1
        if self.start_ms is None or t_start < self.start_ms:
            self.start_ms = t_start
        if self.end_ms is None or t_start > self.end_ms:
            self.end_ms = t_start

    def skip(self, reason: str, path: str | None) -> None:
        self.skipped[reason] += 1
        if path is not None:
            self.paths[path] += 1

    def stored(self, ex: Exchange) -> None:
        """A request that continues a stored prompt: counted, not compared."""
        self.stored_prompts += ex.stored_prompt

    def offer(self, client: int, ex: Exchange, session: int) -> None:
        """Tools offered and called by a row's request and reply."""
        tools = ex.tools
        if tools.names:
            key = (client, tools.hash or ",".join(sorted(tools.names)))
            entry = self.offers.get(key)
            if entry is None:
                self.offers[key] = [tools, 1, ex.t_start, ex.t_start, {session}]
            else:
                if tools.tokens >= entry[0].tokens:
                    entry[0] = tools
                entry[1] += 1
                entry[3] = ex.t_start
                entry[4].add(session)
            cl = self.clients.get(client)
            if cl is not None and cl.last_tools is not tools:
                cl.last_tools = tools
                for name, _, _ in tools.entries:
                    if name not in cl.tools:
                        cl.tools[name] = None
        for name in ex.out_tool_names:
            self.called[(client, name)] += 1

    def add(self, row: Row) -> None:
        """Sum one row into every total."""
        # Every row comes here: the attributes are read once, the sums inlined.
        self.analysed += 1
        self.sessions.add(row.session)
        c = row.counts
        client = row.client
        cl = self.clients.get(client)
        if cl is None:
            cl = self.clients[client] = _Client(first_id=row.id)
        cl.requests += 1
        api = (row.api, row.server)
        unseen = self._unseen.get(api)
        if unseen is None:
            self.servers[api] = set()
            unseen = self._unseen[api] = list(FIELDS)
        for f in unseen:  # empty once the server has reported every field
            v = getattr(c, f)
            if v is not None and v[1] == SERVER:
                reported = self.servers[api]
                for g in [g for g in unseen if (v := getattr(c, g)) is not None and v[1] == SERVER]:
                    reported.add(g)
                    unseen.remove(g)
                break
        pre = c.prefill_ms
        if pre is not None:
            self.prefill.add(pre)
        a, b, d, e = row.composition
        total = self.composition
        total[0] += a[0]
        total[1] += b[0]
        total[2] += d[0]
        total[3] += e[0]
        kind = row.kind
        if kind == TURN:
            self.turns += 1
            # The server reported what decides reuse (Ollama's old builds only
            # the evaluated part, from which reuse is derived).
            r = c.reused_tokens
            if r is not None and (
                r[1] == SERVER or ((ev := c.evaluated_tokens) is not None and ev[1] == SERVER)
            ):
                self.turns_with_reuse += 1
            if pre is not None:
                self.turns_with_timing += 1
            if row.turn == 1:
                self.conversations += 1
                cl.conversations += 1
            if self.summaries:
                self._conversation(row)
        elif kind == "side_call":
            self.side_calls += 1
        else:
            self.stateless += 1
        if row.lost_client is not None or row.lost_external is not None:
            self.losses.add(row)
        if row.prov is not None:
            self.cost.add(row)
        if row.provider_reason is not None:
            self.agreement.add(row)
        if row.draft_n is not None:
            spec = self.speculative.get(row.served)
            if spec is None:
                spec = self.speculative[row.served] = [0, 0, 0]
            spec[0] += 1
            spec[1] += row.draft_n
            spec[2] += row.draft_n_accepted or 0

    def _conversation(self, row: Row) -> None:
        assert row.conversation is not None
        s = self.convs.get(row.conversation)
        if s is None:
            s = self.convs[row.conversation] = ConversationSummary(
                row.conversation,
                row.client,
                row.model,
                row.served,
                row.session,
                first_t=row.t_start_ms,
            )
        s.turns += 1
        s.last_t = row.t_start_ms
        p = row.counts.prompt_tokens
        s.prompt_tokens = int(p[0]) if p is not None else None
        s.prefill.add(row.counts.prefill_ms)
        for loss in (row.lost_client, row.lost_external):
            if loss is not None:
                s.lost_tokens += loss.tokens
                s.lost_ms.add(loss.ms)
                if loss.usd is not None:
                    s.lost_usd = loss.usd + (s.lost_usd or 0.0)
        if row.cost_usd is not None:
            s.cost_usd = row.cost_usd + (s.cost_usd or 0.0)

    def tool_stats(self) -> dict[tuple[int, str], ToolStats]:
        """Per client key and tool name: size, offers, calls, when, sessions."""
        out: dict[tuple[int, str], ToolStats] = {}
        for (client, _), (tools, n, first, last, sessions) in self.offers.items():
            assert isinstance(tools, Tools)
            for name, tokens, src in tools.entries:
                ts = out.get((client, name))
                if ts is None:
                    ts = out[(client, name)] = ToolStats()
                if tokens >= ts.schema_tokens:
                    ts.schema_tokens, ts.source = tokens, src
                ts.offered += n
                ts.first_t = first if ts.first_t is None else min(ts.first_t, first)
                ts.last_t = last if ts.last_t is None else max(ts.last_t, last)
                ts.sessions |= sessions
        for (client, name), ts in out.items():
            ts.called = self.called.get((client, name), 0)
        return out


class CostTotals:
    """R36: what the provider rows cost, by model, and the models no price was found for."""

    def __init__(self) -> None:
        self.rows = 0
        self.total = 0.0
        self.by_model: dict[str, float] = {}
        self.unpriced: set[str] = set()
        self.without_usage = 0
        """Rows whose response reported no usage: their cost and cache use are unknown."""
        self.unasked = 0
        """Of those, streams that did not ask for one (`stream_options.include_usage`)."""

    def add(self, row: Row) -> None:
        self.rows += 1
        prov = row.prov
        if prov is not None and prov.usage is None:
            self.without_usage += 1
            self.unasked += prov.usage_unasked
        if row.cost_usd is None:
            if row.cache_read_tokens is not None:  # measured, yet no price
                self.unpriced.add(row.served)
            return
        self.total += row.cost_usd
        self.by_model[row.served] = self.by_model.get(row.served, 0.0) + row.cost_usd

    def report(
        self, lost: float | None, unread: float | None, prices: str
    ) -> dict[str, Any] | None:
        """The report's `cost`, or None where no row went to a provider (a local server)."""
        if not self.rows:
            return None
        return {
            "total_usd": usd(self.total),
            "lost_usd": usd(lost or 0.0),
            "unread_write_usd": usd(unread or 0.0),
            "by_model": {m: usd(v) for m, v in sorted(self.by_model.items())},
            "unpriced_models": sorted(self.unpriced),
            "prices": prices,
            # Additive: requests whose response carried no usage (not in these figures),
            # and of them the streams that did not ask for one.
            "requests_without_usage": self.without_usage,
            "streams_without_include_usage": self.unasked,
        }


class Agreement:
    """R37: llmp's cause against the provider's own diagnosis, on every row where both
    compared the request with an earlier one (the provider could, and llmp linked it to
    a turn) and either side saw a miss.  A row llmp compared with nothing (a side-call, a
    conversation's first turn) has no cause to set against the provider's: the recorder
    named some earlier response for it, but that is not a turn llmp charges it against
    (Codex's compaction request, sent without its tools, is told `tools_changed`)."""

    def __init__(self) -> None:
        self.diagnosed = 0
        self.compared = 0
        self.agreed = 0
        self.disagreed: list[dict[str, Any]] = []

    def add(self, row: Row) -> None:
        reason = row.provider_reason
        self.diagnosed += 1
        if not comparable(reason) or row.linked_to is None:
            return
        assert reason is not None
        loss = row.lost_client or row.lost_external
        mine = loss.cause if loss is not None else None
        if mine is None and reason == NONE:
            return  # nothing missed, and the provider says so: nothing to compare
        self.compared += 1
        if agrees(mine, reason, row.server):
            self.agreed += 1
        else:
            self.disagreed.append({"row": row.id, "llmp": mine, "provider": reason})

    def report(self) -> dict[str, Any] | None:
        """The report's `provider_agreement`; None where no response carried a diagnosis."""
        if not self.diagnosed:
            return None
        return {"compared": self.compared, "agreed": self.agreed, "disagreed": self.disagreed}


def speculative(totals: Totals) -> list[dict[str, Any]]:
    """Additive (docs/analysis.md §9): what speculative decoding kept, per served model."""
    return [
        {
            "model": model,
            "rows": rows,
            "draft_n": drafted,
            "draft_n_accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
        }
        for model, (rows, drafted, accepted) in sorted(totals.speculative.items())
    ]


def build_header(
    totals: Totals,
    stats: ReadStats | None,
    labels: list[str],
    user_agents: list[str | None],
    findings: list[dict[str, Any]],
    tool_stats: dict[tuple[int, str], ToolStats],
    prices: str = "",
) -> dict[str, Any]:
    """Every field of the report v1 except `rows`, in the spec's order (then the additive
    ones: `speculative`, R36's `cost`, R37's `provider_agreement`)."""
    window = None
    if totals.start_ms is not None and totals.end_ms is not None:
        window = {
            "start_ms": totals.start_ms,
            "end_ms": totals.end_ms,
            "days": round((totals.end_ms - totals.start_ms) / 86_400_000, 4),
        }
    prefill = totals.prefill.result()
    lost_ms: MV | None = None
    if totals.turns_with_timing:
        lost_ms = totals.losses.ms.result()
        if lost_ms is None and prefill is not None:
            lost_ms = (0, prefill[1])  # timed, and nothing lost
    by_cause = {
        cause: {
            "tokens": c.tokens,
            "ms": as_json(c.ms.result()),
            "rows": c.rows,
            "usd": None if c.usd is None else usd(c.usd),
        }
        for cause, c in totals.losses.by_cause()
    }

    clients: dict[str, dict[str, Any]] = {}
    for key in sorted(totals.clients, key=lambda k: totals.clients[k].first_id):
        cl = totals.clients[key]
        name = labels[key]
        entry = clients.get(name)
        if entry is None:
            entry = clients[name] = {
                "client": name,
                "user_agent": user_agents[key],
                "requests": 0,
                "conversations": 0,
                "tools": [],
            }
        entry["requests"] += cl.requests
        entry["conversations"] += cl.conversations
        for tool in cl.tools:
            if tool not in entry["tools"]:
                entry["tools"].append(tool)

    merged: dict[tuple[str, str], ToolStats] = {}
    order: list[tuple[str, str]] = []
    for (key, tool), ts in tool_stats.items():
        k = (labels[key], tool)
        if k not in merged:
            merged[k] = ToolStats()
            order.append(k)
        merged[k].merge(ts)
    client_order = {name: i for i, name in enumerate(clients)}
    order.sort(key=lambda k: (client_order.get(k[0], len(client_order)),))
    tools = [
        {
            "client": name,
            "name": tool,
            "schema_tokens": merged[(name, tool)].schema_tokens,
            "offered": merged[(name, tool)].offered,
            "called": merged[(name, tool)].called,
        }
        for name, tool in order
    ]

    servers = [
        {"api": api, "server": server, "fields": [f for f in FIELDS if f in fields]}
        for (api, server), fields in sorted(
            totals.servers.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
        )
    ]
    unread = [f for f in findings if f["kind"] == UNREAD_CACHE_WRITES]
    cost = totals.cost.report(
        totals.losses.usd,
        sum(f["evidence"].get("usd") or 0.0 for f in unread),
        prices,
    )
    return {
        "v": REPORT_VERSION,
        "window": window,
        "coverage": {
            "records": totals.records,
            "analysed": totals.analysed,
            "skipped": {reason: totals.skipped.get(reason, 0) for reason in SKIP_REASONS},
            "paths": dict(sorted(totals.paths.items())),
            "bad_lines": stats.bad_lines if stats is not None else 0,
            "turns": totals.turns,
            "conversations": totals.conversations,
            "turns_with_reuse": totals.turns_with_reuse,
            "turns_with_timing": totals.turns_with_timing,
            # Additive (docs/analysis.md §2): the part of skipped.non_2xx that
            # the server refused because the prompt did not fit its context.
            "context_exceeded": sum(
                f["evidence"]["refused"] for f in findings if f["kind"] == CONTEXT_OVERFLOW
            ),
            # Additive: Responses requests with previous_response_id (R25), stateless
            # rows, since the prompt they continue is the server's, not in the request.
            "previous_response": totals.stored_prompts,
        },
        "servers": servers,
        "time": {
            "prefill_ms": as_json(prefill),
            "lost_ms": as_json(lost_ms),
            "lost_tokens": totals.losses.tokens,
            "by_cause": by_cause,
        },
        "composition": dict(
            zip(
                ("system", "tools", "history", "new_content"),
                [int(v) for v in totals.composition],
                strict=True,
            )
        ),
        "clients": list(clients.values()),
        "tools": tools,
        "findings": findings,
        "speculative": speculative(totals),
        "cost": cost,
        "provider_agreement": totals.agreement.report(),
    }


def write_report(out: IO[bytes], header: dict[str, Any], rows: Iterator[bytes]) -> None:
    """The report as one JSON document: the header, then the rows streamed."""
    head = orjson.dumps(header)
    out.write(head[:-1])
    out.write(b',"rows":[')
    first = True
    for row in rows:
        if not first:
            out.write(b",")
        out.write(row)
        first = False
    out.write(b"]}\n")


def spilled_rows(spill: Spill, labels: list[str]) -> Iterator[bytes]:
    """The spilled rows with their final client labels, one by one."""
    encoded = [orjson.dumps(label) for label in labels]
    for line in spill.lines():
        yield join_spilled(line, encoded)


def spilled_blocks(spill: Spill, labels: list[str]) -> Iterator[bytes]:
    """The spilled rows with their final client labels, comma-separated, a block at a
    time: for `write_report`, which puts a comma between the items it is given."""
    encoded = Labels([orjson.dumps(label) for label in labels])
    for block in spill.blocks():
        yield join_block(block, encoded)


__all__ = [
    "REPORT_VERSION",
    "ConversationSummary",
    "Spill",
    "Totals",
    "build_header",
    "speculative",
    "spilled_blocks",
    "spilled_rows",
    "write_report",
]
