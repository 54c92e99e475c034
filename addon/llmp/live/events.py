"""One row as an LLMP_TURN event and as a log line; the summary line.

Nothing here holds message text: only counts, client labels, model names
and causes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from llmp.analysis.causes import words
from llmp.analysis.classify import SIDE_CALL, STATELESS, TURN
from llmp.analysis.loss import STRUCTURAL, UNDETERMINED, Between
from llmp.analysis.rows import Loss, Row
from llmp.analysis.words import SHAPE_WORDS, duration, join_names, money, n_of, short_model, usd
from llmp.format.measure import MV, clean, weakest
from llmp.live.contract import VERSION


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ordered_losses(row: Row) -> tuple[Loss | None, Loss | None]:
    """The loss that gave the row its cause, then the other one."""
    if row.cause == STRUCTURAL or row.lost_external is None:
        return row.lost_client, row.lost_external
    return row.lost_external, row.lost_client


def between_text(row: Row, btw: Between | None, label: Callable[[int], str]) -> str | None:
    """What ran between a turn and the turn it links to, e.g.
    "2 side-calls from aider/0.86 ran in between"; None when nothing did."""
    if btw is None or not btw.entries:
        return None
    by_id = {e.id: e for e in btw.entries}
    parts: list[str] = []
    side = [by_id[i] for i in row.side_calls_between if i in by_id]
    if side:
        who = join_names(_unique(label(e.client) for e in side))
        parts.append(f"{n_of(len(side), 'side-call')} from {who}")
    other = [by_id[i] for i in row.other_conversations_between if i in by_id]
    if other:
        who = join_names(_unique(label(e.client) for e in other))
        parts.append(f"{n_of(len(other), 'request')} of other conversations from {who}")
    models = [by_id[i] for i in row.other_domains_between if i in by_id]
    if models:
        names = join_names(_unique(short_model(e.served) for e in models))
        parts.append(f"{n_of(len(models), 'request')} to {names}")
    if not parts:
        return None
    return f"{join_names(parts)} ran in between"


def cause_text(row: Row, btw: Between | None, label: Callable[[int], str]) -> str | None:
    """The cause of a turn's loss in the readable report's words, and what ran in between."""
    first, second = _ordered_losses(row)
    if first is None:
        first, second = second, None
    if first is None:
        return None
    text = words(first.cause)
    if second is not None:
        text += f", and {words(second.cause)}"
    if row.cause == UNDETERMINED:
        text += " (or a failed chat request in between evicted it)"
    ran = between_text(row, btw, label)
    if ran is not None:
        text += f"; {ran}"
    return text


def _int(mv: MV | None) -> int | None:
    return None if mv is None else int(mv[0])


def _val(mv: MV | None) -> float | None:
    return None if mv is None else mv[0]


def _loss_ms(loss: Loss | None) -> float | None:
    return None if loss is None or loss.ms is None else loss.ms[0]


def turn_event(row: Row, btw: Between | None, label: Callable[[int], str]) -> dict[str, Any]:
    """The LLMP_TURN object of a row (without `warn`, which the thresholds decide)."""
    c = row.counts
    losses = [x for x in (row.lost_client, row.lost_external) if x is not None]
    lost_tokens: int | None
    lost_ms: float | None
    priced = [x.usd for x in losses if x.usd is not None]
    lost_usd = usd(sum(priced)) if priced else None
    if row.kind != TURN:
        lost_tokens = lost_ms = None  # side-calls and stateless rows are compared with nothing
    elif losses:
        lost_tokens = sum(x.tokens for x in losses)
        timed = [x.ms[0] for x in losses if x.ms is not None]
        lost_ms = clean(sum(timed)) if len(timed) == len(losses) else None
    elif row.loss_measured:
        lost_tokens, lost_ms = 0, 0
    else:
        lost_tokens = lost_ms = None
    prompt, reused, evaluated, prefill = (
        c.prompt_tokens,
        c.reused_tokens,
        c.evaluated_tokens,
        c.prefill_ms,
    )
    sources = [mv[1] for mv in (prompt, reused, evaluated, prefill) if mv is not None]
    lc, le = row.lost_client, row.lost_external
    return {
        "v": VERSION,
        "id": row.id,
        "t_start_ms": row.t_start_ms,
        "kind": row.kind,
        "side_call_shape": row.side_call_shape,
        "client": label(row.client),
        "model": row.model,
        "served_model": row.served,
        "conversation": row.conversation,
        "turn": row.turn,
        "linked_to": row.linked_to,
        "new_conversation": row.new_conversation,
        "compaction": row.compaction,
        "break_cause": row.break_cause,
        "prompt_tokens": None if prompt is None else int(prompt[0]),
        "reused_tokens": None if reused is None else int(reused[0]),
        "evaluated_tokens": None if evaluated is None else int(evaluated[0]),
        "completion_tokens": _int(c.completion_tokens),
        "prefill_ms": None if prefill is None else prefill[0],
        "decode_ms": _val(c.decode_ms),
        "load_ms": _val(c.load_ms),
        "counts_source": weakest(*sources) if sources else None,
        "reuse": row.observed_reuse,
        "predicted_reuse": row.predicted_reuse,
        "loss_measured": row.loss_measured,
        "cause": row.cause,
        "lost_tokens": lost_tokens,
        "lost_ms": lost_ms,
        "lost_client_cause": None if lc is None else lc.cause,
        "lost_client_tokens": None if lc is None else lc.tokens,
        "lost_client_ms": _loss_ms(lc),
        "lost_external_cause": None if le is None else le.cause,
        "lost_external_tokens": None if le is None else le.tokens,
        "lost_external_ms": _loss_ms(le),
        "side_calls_between": len(row.side_calls_between),
        "other_conversations_between": len(row.other_conversations_between),
        "other_models_between": len(row.other_domains_between),
        "cause_text": cause_text(row, btw, label) if losses else None,
        "warn": False,
        "draft_n": row.draft_n,
        "draft_n_accepted": row.draft_n_accepted,
        "server": row.server,
        "cost_usd": row.cost_usd,
        "lost_usd": lost_usd if row.kind == TURN else None,
    }


def over_threshold(ev: dict[str, Any], warn_ms: float, warn_tokens: int) -> bool:
    """A turn lost more than either threshold (tokens, or ms when timed)."""
    tokens = ev.get("lost_tokens")
    if ev.get("kind") != TURN or not tokens:
        return False
    ms = ev.get("lost_ms")
    return bool(tokens > warn_tokens or (ms is not None and ms > warn_ms))


def request_line(ev: dict[str, Any]) -> str:
    """The log line of one event, e.g.
    `llmp: aider/0.86 conv 2 turn 5: 12,304 prompt tokens, 97% reused, prefill 310 ms`."""
    kind = ev["kind"]
    who = ev["client"]
    if kind == TURN:
        head = f"{who} conv {ev['conversation']} turn {ev['turn']}"
    elif kind == SIDE_CALL:
        shape = ev.get("side_call_shape")
        head = f"{who} side-call" + (f", {SHAPE_WORDS.get(shape, shape)}" if shape else "")
    else:
        head = f"{who} {STATELESS} request"
    prompt = ev["prompt_tokens"]
    facts = [n_of(prompt, "prompt token") if prompt is not None else "prompt tokens not reported"]
    if kind == TURN:
        reuse = ev["reuse"]
        facts.append(f"{reuse:.0%} reused" if reuse is not None else "reuse not reported")
    facts.append(f"prefill {duration(ev['prefill_ms'])}")
    drafted = ev.get("draft_n")
    if drafted:
        accepted = ev.get("draft_n_accepted") or 0
        facts.append(f"draft {accepted / drafted:.0%} accepted ({accepted:,} of {drafted:,})")
    line = f"{head}: {', '.join(facts)}"
    lost = ev.get("lost_tokens")
    if lost:
        usd = ev.get("lost_usd")
        price = f"{money(usd)}, " if usd is not None else ""
        line += (
            f"; lost {n_of(lost, 'token')} ({price}{duration(ev['lost_ms'])}): {ev['cause_text']}"
        )
    return ("llmp: warning: " if ev.get("warn") else "llmp: ") + line


def summary_line(s: dict[str, Any]) -> str:
    """The one line the live view logs at shutdown."""
    if not s["requests"]:
        return "llmp: live view: no chat request was analysed"
    lost = s["lost_tokens"]
    text = (
        f"llmp: live view: {n_of(s['turns'], 'turn')} in "
        f"{n_of(s['conversations'], 'conversation')}, {n_of(s['side_calls'], 'side-call')}; "
        f"prefill {duration(s['prefill_ms'])}"
    )
    if lost:
        text += f", of which {duration(s['lost_ms'])} ({n_of(lost, 'token')}) lost"
    return text + f"; {n_of(s['warnings'], 'warning')}"
