"""The readable report: the verdict for a person running agents on their machine.

It reads only the report header (the same data `--json` prints) and the
per-conversation summaries, so the words never disagree with the numbers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmp.analysis.causes import words as cause_words
from llmp.analysis.findings import BY_KIND
from llmp.analysis.report import ConversationSummary
from llmp.analysis.words import (
    duration,
    join_names,
    lost_text,
    money,
    n_of,
    short_model,
    value_of,
)


def sentence(f: dict[str, Any]) -> tuple[str, str]:
    """One finding as (what happened, what would fix it): its kind's own words."""
    kind = BY_KIND.get(f["kind"])
    if kind is None:
        return (f"{f['kind']}: {lost_text(f)}.", "")
    return kind.sentence(f)


_CONTEXT_KINDS = ("unused_tool", "large_tool_schema", "large_system_prompt")


def _losses_first(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt the server cut or refused, then the losses, biggest first: the head of
    the readable order (`readable_order`, `readable_findings`)."""
    first = [f for f in findings if f["kind"] == "context_overflow"]
    losses = [
        f for f in findings if f["kind"] not in _CONTEXT_KINDS and f["kind"] != "context_overflow"
    ]
    losses.sort(key=lambda f: (-(value_of(f.get("lost_ms")) or 0), -(f.get("lost_tokens") or 0)))
    return first + losses


def readable_order(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings in the order the readable report says them, one per finding (the
    unused tools of a client, which it says in one sentence, each apart)."""
    return _losses_first(findings) + [f for f in findings if f["kind"] in _CONTEXT_KINDS]


def _losses_in(findings: list[dict[str, Any]]) -> str:
    """`: 412 tokens (120 ms) lost in all`, the losses of findings a list leaves out, so the
    readable report still adds up to the loss table (R38); "" when they lost nothing."""
    tokens = sum(f.get("lost_tokens") or 0 for f in findings)
    if not tokens:
        return ""
    timed = [v for f in findings if (v := value_of(f.get("lost_ms"))) is not None]
    ms = f", {duration(sum(timed))}" if timed else ""
    return f", {n_of(tokens, 'token')}{ms} lost in all"


def readable_findings(findings: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(confidence, sentence, fix) in the order a person should act on them.

    The JSON keeps the spec's order (confidence first); a person wants the
    biggest loss first, and the unused tools of one client in one sentence.
    """
    # A prompt the server cut or refused comes first: the model worked
    # without part of its prompt, which is worse than slow.
    out = [(f["confidence"], *sentence(f)) for f in _losses_first(findings)]
    unused: dict[str, list[dict[str, Any]]] = {}
    for f in findings:
        if f["kind"] == "unused_tool":
            unused.setdefault(f["client"], []).append(f)
    for client, group in unused.items():
        if len(group) == 1:
            out.append((group[0]["confidence"], *sentence(group[0])))
            continue
        group.sort(key=lambda f: -(f.get("context_tokens") or 0))
        names = [f["evidence"]["tool"] for f in group]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        tokens = sum(f.get("context_tokens") or 0 for f in group)
        offered = max(f["evidence"]["offered"] for f in group)
        conf = "high" if all(f["confidence"] == "high" for f in group) else "medium"
        out.append(
            (
                conf,
                f"{client} offered {n_of(len(names), 'tool')} it never called ({shown}) in up "
                f"to {n_of(offered, 'request')}; together they cost {n_of(tokens, 'token')} of "
                "every prompt.",
                "Remove them, or offer them only when they are needed.",
            )
        )
    for f in findings:
        if f["kind"] in ("large_tool_schema", "large_system_prompt"):
            out.append((f["confidence"], *sentence(f)))
    return out


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M")


def render(
    console: Console,
    header: dict[str, Any],
    conversations: dict[int, ConversationSummary],
    label: Callable[[int], str],
    sessions: int,
    side_calls: int = 0,
    stateless: int = 0,
    per_client: int = 15,
    max_findings: int = 12,
) -> None:
    """Print the readable report."""
    cov = header["coverage"]
    window = header["window"]
    console.print(Text("llmp analyze", style="bold"))
    if window is None:
        console.print("The recording holds no records.")
        return

    # What was recorded.
    skipped = {k: v for k, v in cov["skipped"].items() if v}
    span = duration(float(window["end_ms"] - window["start_ms"]))
    lines = [
        f"{n_of(cov['records'], 'record')} from {_when(window['start_ms'])} to "
        f"{_when(window['end_ms'])} UTC ({span}), {n_of(sessions, 'session')}.",
        f"{n_of(cov['analysed'], 'chat request')} analysed: {n_of(cov['turns'], 'turn')} in "
        f"{n_of(cov['conversations'], 'conversation')}, {n_of(side_calls, 'side-call')}"
        + (f", {n_of(stateless, 'stateless request')}." if stateless else "."),
    ]
    if skipped:
        refused = cov.get("context_exceeded") or 0
        lines.append(
            "Skipped: "
            + ", ".join(
                f"{v:,} {k.replace('_', ' ')}"
                + (
                    f" ({refused:,} refused: prompt longer than the context)"
                    if k == "non_2xx" and refused
                    else ""
                )
                for k, v in skipped.items()
            )
            + "."
        )
    stored = cov.get("previous_response") or 0
    if stored:
        lines.append(
            f"{n_of(stored, 'Responses request')} continued a stored response "
            "(previous_response_id): the prompt they extend is the server's, not in the "
            "request, so they were not compared by their messages (counted as stateless)."
        )
    if cov["bad_lines"]:
        lines.append(f"{n_of(cov['bad_lines'], 'line')} could not be read.")
    if cov["turns"]:
        lines.append(
            f"The server reported cache reuse for {n_of(cov['turns_with_reuse'], 'turn')} and "
            f"timing for {cov['turns_with_timing']:,}."
        )
    for line in lines:
        console.print(line)
    console.print()

    # On a provider, money first (R36).
    for line in money_lines(header.get("cost")):
        console.print(line)

    # Prefill and loss.
    t = header["time"]
    prefill = value_of(t["prefill_ms"])
    lost = value_of(t["lost_ms"])
    if prefill is None and header.get("cost"):
        pass  # a provider's prefill is its own; the proxy times only streamed replies
    elif prefill is None:
        console.print("No request was timed, so the prefill time is unknown.")
    else:
        detail = n_of(t["lost_tokens"], "token")
        if lost is not None and prefill > 0:
            detail = f"{lost / prefill:.0%}, " + detail
        console.print(
            Text.assemble(
                "Prefill took ",
                (duration(prefill), "bold"),
                ". ",
                (
                    duration(lost) if lost is not None else "An unknown part",
                    "bold red" if lost else "bold",
                ),
                f" of it ({detail}) went to re-processing tokens the server could have reused.",
            )
        )
    if t["by_cause"]:
        table = Table(title="Loss by cause", title_justify="left")
        priced = any(c.get("usd") is not None for c in t["by_cause"].values())
        timed = prefill is not None or not priced  # on a provider, time only when timed
        columns = ["cause", "turns", "tokens", *(["time", "% of prefill"] if timed else [])]
        for col in [*columns, *(["cost"] if priced else [])]:
            table.add_column(col, justify="left" if col == "cause" else "right")
        ranked = sorted(
            t["by_cause"].items(),
            key=lambda kv: (
                -(value_of(kv[1]["ms"]) or 0) - (kv[1].get("usd") or 0) - kv[1]["tokens"] / 1e9
            ),
        )
        for cause, c in ranked:
            ms = value_of(c["ms"])
            pct = f"{ms / prefill:.1%}" if ms is not None and prefill else "-"
            cells = [cause_words(cause), str(c["rows"]), f"{c['tokens']:,}"]
            if timed:
                cells += [duration(ms), pct]
            if priced:
                cells.append(money(c["usd"]) if c.get("usd") is not None else "-")
            table.add_row(*cells)
        console.print(table)
        cut = [
            f
            for f in header["findings"]
            if f["kind"] == "context_overflow" and f.get("evidence", {}).get("truncated")
        ]
        if cut:
            # The rows keep what the counters show; the findings name the cause.
            console.print(
                "Note: "
                + join_names([short_model(f.get("model")) for f in cut])
                + " cut prompts that did not fit the context; the server-side losses of "
                "those turns come from the cut (see Findings)."
            )
    for line in speculative_lines(header.get("speculative")):
        console.print(line)
    console.print()

    # Findings: what cost time first, then what costs context.
    findings = header["findings"]
    if findings:
        console.print(Text("Findings", style="bold"))
        shown = [f for f in findings if not f.get("minor")]
        items = readable_findings(shown)
        for i, (confidence, what, fix) in enumerate(items[:max_findings], 1):
            console.print(Text.assemble(f"{i}. ", (f"[{confidence}] ", "dim"), what))
            if fix:
                console.print(Text.assemble("   ", ("Fix: ", "bold green"), fix))
        if len(items) > max_findings:
            # The same order `readable_findings` used: what it left out is its tail.
            hidden = _losses_in(readable_order(shown)[max_findings:])
            console.print(
                f"… and {n_of(len(items) - max_findings, 'more finding')}{hidden} (see --json)."
            )
        minor = [f for f in findings if f.get("minor")]
        if minor:
            console.print(
                f"{n_of(len(minor), 'smaller loss')}, each under the --min-lost-tokens threshold"
                f"{_losses_in(minor)} (see --json)."
            )
    else:
        console.print("No findings: nothing was lost that the recording can show.")
    console.print()
    agreement = agreement_lines(header.get("provider_agreement"))
    if agreement:
        for line in agreement:
            console.print(line)
        console.print()

    # Per client, its conversations.
    by_client: dict[str, list[ConversationSummary]] = {}
    for conv in conversations.values():
        by_client.setdefault(label(conv.client), []).append(conv)
    for cl in header["clients"]:
        name = cl["client"]
        convs = by_client.get(name, [])
        title = (
            f"{name}: {n_of(cl['requests'], 'request')}, "
            f"{n_of(cl['conversations'], 'conversation')}, {n_of(len(cl['tools']), 'tool')}"
        )
        if not convs:
            console.print(Text(title, style="bold"))
            continue
        table = Table(title=title, title_justify="left")
        for col, just in (
            ("conv", "right"),
            ("model", "left"),
            ("started", "left"),
            ("turns", "right"),
            ("last prompt", "right"),
            ("prefill", "right"),
            ("lost", "right"),
        ):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        priced = any(c.cost_usd is not None for c in convs)
        if priced:
            table.add_column("cost", justify="right")
        convs.sort(key=lambda c: (-(_mv(c.lost_ms.result()) or 0), c.number))
        for conv in convs[:per_client]:
            table.add_row(
                str(conv.number),
                conv.model,
                _when(conv.first_t),
                str(conv.turns),
                f"{conv.prompt_tokens:,}" if conv.prompt_tokens is not None else "-",
                duration(_mv(conv.prefill.result())),
                _conversation_loss(conv),
                *([money(conv.cost_usd) if conv.cost_usd is not None else "-"] if priced else []),
            )
        if len(convs) > per_client:
            table.caption = f"… and {len(convs) - per_client} more conversations"
        console.print(table)


def _conversation_loss(conv: ConversationSummary) -> str:
    """A conversation's loss as the table shows it: its time, or on a provider its dollars
    where the proxy could not time it."""
    if not conv.lost_tokens:
        return "-"
    ms = _mv(conv.lost_ms.result())
    if ms is None and conv.lost_usd is not None:
        return money(conv.lost_usd)
    return duration(ms)


def money_lines(cost: Any) -> list[str]:
    """What a provider's traffic cost (R36), first: `$4.12 spent, $1.37 of it on cache
    misses.`  None on a local server."""
    if not isinstance(cost, dict):
        return []
    total, lost = cost.get("total_usd"), cost.get("lost_usd")
    unread = cost.get("unread_write_usd")
    line = f"{money(total)} spent, {money(lost)} of it on cache misses"
    if unread:
        line += f", and {money(unread)} on cache writes no request read"
    lines = [line + f" (prices: {cost.get('prices')})."]
    unpriced = cost.get("unpriced_models") or []
    if unpriced:
        lines.append(
            f"No price is known for {join_names(unpriced)}: their requests are not in these "
            "figures (--prices FILE gives one)."
        )
    note = without_usage_text(cost)
    if note:
        lines.append(note)
    return lines


def without_usage_text(cost: dict[str, Any]) -> str:
    """The requests whose response reported no usage, said plainly: what they cost and
    read from the cache is unknown (a Chat Completions stream has a usage only when the
    request asks, `stream_options.include_usage`).  Empty when every one had a usage."""
    n = cost.get("requests_without_usage") or 0
    unasked = cost.get("streams_without_include_usage") or 0
    if not isinstance(n, int) or n <= 0:
        return ""
    unknown = (
        f"what {'it' if n == 1 else 'they'} cost and read from the cache is unknown, and "
        "not in these figures"
    )
    ask = 'stream_options: {"include_usage": true}'
    if unasked == n:
        return (
            f"{n_of(n, 'Chat Completions stream')} came without a usage: the "
            f"{'requests' if n > 1 else 'request'} did not ask for one ({ask}), so {unknown}."
        )
    why = f" ({unasked:,} of them Chat Completions streams that did not ask: {ask})"
    return f"{n_of(n, 'request')} came without a usage{why if unasked else ''}: {unknown}."


def agreement_lines(agreement: Any) -> list[str]:
    """The provider's own diagnosis against llmp's causes (R37), disagreements named."""
    if not isinstance(agreement, dict):
        return []
    compared, agreed = agreement.get("compared", 0), agreement.get("agreed", 0)
    if not compared:
        return ["The provider's own cache diagnosis named no miss to compare."]
    lines = [
        f"The provider's own cache diagnosis: {n_of(compared, 'miss')} compared, llmp "
        f"agreed on {agreed}."
    ]
    for d in agreement.get("disagreed") or []:
        lines.append(
            f"  request #{d.get('row')}: llmp says {d.get('llmp') or 'no loss'}, the provider "
            f"says {d.get('provider')}"
        )
    return lines


def speculative_text(spec: dict[str, Any]) -> str:
    """`qwen3-8b.gguf: 812 of 1,024 drafted tokens accepted (79%)`."""
    drafted, accepted = spec.get("draft_n") or 0, spec.get("draft_n_accepted") or 0
    rate = spec.get("acceptance")
    pct = f" ({rate:.0%})" if isinstance(rate, (int, float)) else ""
    model = short_model(spec.get("model"))
    return f"{model}: {accepted:,} of {drafted:,} drafted tokens accepted{pct}"


def speculative_lines(specs: Any) -> list[str]:
    """What speculative decoding kept, one line per served model (none without a draft)."""
    items = [s for s in specs or [] if isinstance(s, dict)]
    if not items:
        return []
    if len(items) == 1:
        return [f"Speculative decoding: {speculative_text(items[0])}."]
    return ["Speculative decoding:", *(f"  {speculative_text(s)}" for s in items)]


def _mv(mv: tuple[float, str] | None) -> float | None:
    return None if mv is None else mv[0]
