"""The readable report: the verdict for a person running agents on their machine.

It reads only the report header (the same data `--json` prints) and the
per-conversation summaries, so the words never disagree with the numbers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmp.analysis import causes
from llmp.analysis.report import ConversationSummary

SHAPE_WORDS = {
    "oneshot": "one-off (title, commit message)",
    "summarise": "summary",
    "structured": "structured-output",
}


def duration(ms: float | None) -> str:
    """A duration as a person says it."""
    if ms is None:
        return "not timed"
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _value(mv: Any) -> float | None:
    return float(mv["value"]) if isinstance(mv, dict) else None


def _lost(f: dict[str, Any]) -> str:
    ms = _value(f.get("lost_ms"))
    tokens = f.get("lost_tokens")
    if ms is not None:
        text = f"{duration(ms)} lost"
        if tokens is not None:
            text += f" ({tokens:,} tokens)"
        return text
    if tokens is not None:
        return f"{tokens:,} tokens re-processed (not timed)"
    return "loss not measured (the server reports no cache counters)"


def join_names(items: Sequence[str]) -> str:
    """Names as a sentence lists them: "a", "a and b", "a, b and c"."""
    items = list(items)
    if not items:
        return "a client"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n:,} times"


WITHIN_WORDS = {
    "first_256": "in its first 256 characters",
    "last_256": "in its last 256 characters",
    "between": "between its first and last 256 characters",
}


def where_text(changed: Any) -> str:
    """` (system block 1, in its first 256 characters)`: where the change was, no text."""
    if not isinstance(changed, list) or not changed or not isinstance(changed[0], dict):
        return ""
    c = changed[0]
    role, index = c.get("role"), c.get("index")
    what = f"{role} message {index}" if isinstance(index, int) else f"{role} message"
    if role in ("system", "developer") and isinstance(index, int):
        what = f"{role} block {index}" if index else f"first {role} block"
    parts = [what, WITHIN_WORDS.get(str(c.get("within")), "")]
    if isinstance(c.get("offset"), int):
        parts.append(f"at character {c['offset']:,}")
    return " (" + ", ".join(p for p in parts if p) + ")"


def _advised(ev: dict[str, Any], fallback: str) -> str:
    """The harness's own fix when the finding recognised it, else the general one."""
    tip = ev.get("advice")
    if not isinstance(tip, dict) or not tip.get("text"):
        return fallback
    who = f"{tip['harness']}: " if tip.get("harness") else ""
    sure = (
        f" ({tip.get('confidence')} confidence: {tip.get('because')})" if tip.get("because") else ""
    )
    return f"{who}{tip['text']}{sure}"


def _memory_note(ev: dict[str, Any]) -> str:
    """What the traffic shows of the model's memory (a `server_cache_loss` finding's)."""
    memory = ev.get("memory")
    if not isinstance(memory, dict) or not memory.get("text"):
        return ""
    return f" {memory['text']}"


def sentence(f: dict[str, Any]) -> tuple[str, str]:
    """One finding as (what happened, what would fix it)."""
    kind = f["kind"]
    ev = f.get("evidence", {})
    model = short_model(f.get("model"))
    n = len(f.get("rows", []))
    if kind == "side_call_on_conversation_model":
        shapes = ", ".join(SHAPE_WORDS.get(s, s) for s in ev.get("shapes", {})) or "side"
        return (
            f"{join_names(ev.get('clients', []))}'s {shapes} side-calls ran on {model}, the model "
            f"serving the conversation, and evicted the cache {_times(n)}: {_lost(f)}.",
            _advised(ev, causes.BY_NAME[causes.SIDE_CALL].fix),
        )
    if kind == "prefix_break":
        cause = causes.BY_NAME.get(str(ev.get("break_cause")))
        known = cause is not None and cause.group == causes.CLIENT
        what = cause.did if cause is not None and known else "broke its prompt prefix"
        fix = cause.fix if cause is not None and known else "Keep the start of the prompt stable."
        share = ev.get("share")
        pct = f" ({share:.0%})" if isinstance(share, (int, float)) else ""
        where = where_text(ev.get("changed"))
        return (
            f"{f.get('client')} {what} in {ev.get('broken')} of {ev.get('links')} turns{pct} "
            f"on {model}{where}: {_lost(f)}.",
            _advised(ev, fix),
        )
    if kind == "volatile_head":
        n_conv, n_comp = ev.get("conversations", 0), ev.get("compactions", 0)
        hit = join_names(
            [_n(k, noun) for k, noun in ((n_conv, "new conversation"), (n_comp, "compaction")) if k]
        )
        where = where_text([ev.get("changed")] if ev.get("changed") else [])
        return (
            f"{f.get('client')}'s system prompt differed only in its head{where}, and each "
            f"of {hit} on {model} read the whole prompt again: {_lost(f)}.",
            _advised(
                ev,
                "Keep the start of the system prompt identical across conversations: put "
                "anything that changes (a version, a date, a session id) after the stable part.",
            ),
        )
    if kind == "server_cache_loss":
        sub = causes.BY_NAME.get(str(ev.get("kind")))
        if sub is None or sub.group != causes.SERVER:
            sub = causes.BY_NAME[causes.SERVER_ROLLBACK]
        story = sub.story.format(model=model, times=_times(n), lost=_lost(f))
        return (story + _memory_note(ev), _advised(ev, sub.fix))
    if kind == "other_conversation_eviction":
        k = ev.get("other_conversations", 0)
        who = join_names(ev.get("clients", []))
        return (
            f"{k} other conversation{'s' if k != 1 else ''} ({who}) ran "
            f"on {model} between turns and evicted the cache {_times(n)}: {_lost(f)}.",
            causes.BY_NAME[causes.OTHER_CONVERSATION].fix,
        )
    if kind == "other_model_eviction":
        return (
            f"Requests to {join_names([short_model(m) for m in ev.get('other_models', [])])} ran "
            f"between turns on {model}, and "
            f"its cache was gone {_times(n)}: {_lost(f)}.",
            causes.BY_NAME[causes.OTHER_MODEL].fix,
        )
    if kind == "unused_tool":
        return (
            f"{f.get('client')} offered the tool {ev.get('tool')} in {ev.get('offered')} requests "
            f"over {ev.get('days', 0):.1f} days and never called it; it costs "
            f"{f.get('context_tokens')} tokens of every prompt.",
            "Remove it, or offer it only when it is needed.",
        )
    if kind == "large_tool_schema":
        return (
            f"{f.get('client')}'s tool {ev.get('tool')} takes {ev.get('schema_tokens')} tokens "
            f"(threshold {ev.get('threshold')}).",
            "Shorten its description and schema.",
        )
    if kind == "large_system_prompt":
        return (
            f"{f.get('client')}'s system prompt is {ev.get('system_tokens')} tokens (threshold "
            f"{ev.get('threshold')}); every cache miss re-processes it.",
            "Trim it, or move rarely needed instructions into tools or files read on demand.",
        )
    if kind == "context_overflow":
        return _overflow_sentence(f, model)
    return (f"{kind}: {_lost(f)}.", "")


def _overflow_sentence(f: dict[str, Any], model: str) -> tuple[str, str]:
    """context_overflow: prompts the server cut silently, or refused."""
    ev = f.get("evidence", {})
    n_ctx = ev.get("n_ctx")
    # Ollama's requests say num_ctx; llama-server's errors say n_ctx.
    name = "num_ctx" if ev.get("n_ctx_source") == "request" else "n_ctx"
    ctx = f" ({name} {n_ctx:,})" if isinstance(n_ctx, int) else ""
    sent = _value(ev.get("sent"))
    largest = f"{sent:,.0f} tokens" if sent is not None else "a size not recorded"
    cut = int(ev.get("truncated") or 0)
    refused = int(ev.get("refused") or 0)
    what: list[str] = []
    fixes: list[str] = []
    if cut:
        dropped = _value(ev.get("dropped"))
        gone = f", about {dropped:,.0f} tokens in all" if dropped else ""
        reported = ev.get("reported")
        counted = f"{reported:,}" if isinstance(reported, int) else "fewer"
        what.append(
            f"{model} silently dropped the start of {_n(cut, 'prompt')} that "
            f"{'was' if cut == 1 else 'were'} longer than its context{ctx}: it counted "
            f"{counted} tokens of the largest, which was about {largest}"
            f"{gone}. The model answered without the oldest messages, or without the "
            "system prompt and tools, and no error said so"
        )
        fixes.append(
            "Raise the context above the largest prompt (Ollama: options.num_ctx in the "
            "request, or OLLAMA_CONTEXT_LENGTH; llama-server: -c), or make the harness "
            "compact its history before the prompt reaches the limit."
        )
    if refused:
        if ev.get("refused_from") == "status":
            what.append(
                f"{model} refused {_n(refused, 'request')} with HTTP 400 when the prompt "
                f"grew past any it had accepted (up to {largest}); a digest recording keeps "
                "no error body, but on llama-server this is a prompt longer than the context"
            )
            fixes.append("Record with --full to see the server's own error.")
        else:
            what.append(
                f"{model} refused {_n(refused, 'request')} longer than its context{ctx}, "
                f"up to {largest}; those turns failed"
            )
        fixes.insert(
            0,
            "Start the server with a larger context (llama-server -c; with -np N each slot "
            "gets a share of it), or have the harness compact or trim its history before the "
            "prompt reaches the limit.",
        )
    return "; ".join(what) + ".", " ".join(dict.fromkeys(fixes))


_CONTEXT_KINDS = ("unused_tool", "large_tool_schema", "large_system_prompt")


def readable_findings(findings: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(confidence, sentence, fix) in the order a person should act on them.

    The JSON keeps the spec's order (confidence first); a person wants the
    biggest loss first, and the unused tools of one client in one sentence.
    """
    # A prompt the server cut or refused comes first: the model worked
    # without part of its prompt, which is worse than slow.
    out = [(f["confidence"], *sentence(f)) for f in findings if f["kind"] == "context_overflow"]
    losses = [
        f for f in findings if f["kind"] not in _CONTEXT_KINDS and f["kind"] != "context_overflow"
    ]
    losses.sort(key=lambda f: (-(_value(f.get("lost_ms")) or 0), -(f.get("lost_tokens") or 0)))
    out += [(f["confidence"], *sentence(f)) for f in losses]
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
                f"{client} offered {len(names)} tools it never called ({shown}) in up to "
                f"{offered} requests; together they cost {tokens:,} tokens of every prompt.",
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


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def short_model(name: str | None) -> str:
    """A model file path as its file name; a model name as it is."""
    if not name:
        return "the model"
    return name.rsplit("/", 1)[-1] if "/" in name and name.endswith((".gguf", ".bin")) else name


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
        f"{_n(cov['records'], 'record')} from {_when(window['start_ms'])} to "
        f"{_when(window['end_ms'])} UTC ({span}), {_n(sessions, 'session')}.",
        f"{_n(cov['analysed'], 'chat request')} analysed: {_n(cov['turns'], 'turn')} in "
        f"{_n(cov['conversations'], 'conversation')}, {_n(side_calls, 'side-call')}"
        + (f", {_n(stateless, 'stateless request')}." if stateless else "."),
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
            f"{_n(stored, 'Responses request')} continued a stored response "
            "(previous_response_id): the prompt they extend is the server's, not in the "
            "request, so they were not compared by their messages (counted as stateless)."
        )
    if cov["bad_lines"]:
        lines.append(f"{cov['bad_lines']:,} lines could not be read.")
    if cov["turns"]:
        lines.append(
            f"The server reported cache reuse for {cov['turns_with_reuse']:,} turns and timing "
            f"for {cov['turns_with_timing']:,}."
        )
    for line in lines:
        console.print(line)
    console.print()

    # Prefill and loss.
    t = header["time"]
    prefill = _value(t["prefill_ms"])
    lost = _value(t["lost_ms"])
    if prefill is None:
        console.print("No request was timed, so the prefill time is unknown.")
    else:
        detail = f"{t['lost_tokens']:,} tokens"
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
        table.add_column("cause")
        table.add_column("turns", justify="right")
        table.add_column("tokens", justify="right")
        table.add_column("time", justify="right")
        table.add_column("% of prefill", justify="right")
        ranked = sorted(
            t["by_cause"].items(),
            key=lambda kv: -(_value(kv[1]["ms"]) or 0) - kv[1]["tokens"] / 1e9,
        )
        for cause, c in ranked:
            ms = _value(c["ms"])
            pct = f"{ms / prefill:.1%}" if ms is not None and prefill else "-"
            table.add_row(
                causes.words(cause), str(c["rows"]), f"{c['tokens']:,}", duration(ms), pct
            )
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
        items = readable_findings(findings)
        for i, (confidence, what, fix) in enumerate(items[:max_findings], 1):
            console.print(Text.assemble(f"{i}. ", (f"[{confidence}] ", "dim"), what))
            if fix:
                console.print(Text.assemble("   ", ("Fix: ", "bold green"), fix))
        if len(items) > max_findings:
            console.print(f"… and {len(items) - max_findings} more (see --json).")
    elif header["time"]["lost_tokens"]:
        console.print(
            "No findings: each cause lost less than the thresholds a finding needs "
            "(--min-lost-tokens); the table above shows every loss."
        )
    else:
        console.print("No findings: nothing was lost that the recording can show.")
    console.print()

    # Per client, its conversations.
    by_client: dict[str, list[ConversationSummary]] = {}
    for conv in conversations.values():
        by_client.setdefault(label(conv.client), []).append(conv)
    for cl in header["clients"]:
        name = cl["client"]
        convs = by_client.get(name, [])
        title = (
            f"{name}: {_n(cl['requests'], 'request')}, {_n(cl['conversations'], 'conversation')}, "
            f"{_n(len(cl['tools']), 'tool')}"
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
        convs.sort(key=lambda c: (-(_mv(c.lost_ms.result()) or 0), c.number))
        for conv in convs[:per_client]:
            table.add_row(
                str(conv.number),
                conv.model,
                _when(conv.first_t),
                str(conv.turns),
                f"{conv.prompt_tokens:,}" if conv.prompt_tokens is not None else "-",
                duration(_mv(conv.prefill.result())),
                duration(_mv(conv.lost_ms.result())) if conv.lost_tokens else "-",
            )
        if len(convs) > per_client:
            table.caption = f"… and {len(convs) - per_client} more conversations"
        console.print(table)


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
