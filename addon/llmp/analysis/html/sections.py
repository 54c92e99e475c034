"""The page's sections: the header cards, loss by cause, findings, the clients."""

from __future__ import annotations

from typing import Any

from llmp.analysis.html.common import (
    _cause_key,
    _cause_words,
    _e,
    _int,
    _mv,
    _obj,
    _obj_or_none,
    _when,
)
from llmp.analysis.html.page import _Page
from llmp.analysis.render import agreement_lines, duration, sentence, speculative_text
from llmp.analysis.words import money, n_of

# -- sections ------------------------------------------------------------------


def _header(p: _Page, report: dict[str, Any], rows: list[dict[str, Any]], title: str) -> None:
    cov = _obj(report, "coverage")
    window = _obj_or_none(report, "window")
    p.add(f"<h1>{_e(title)}</h1>\n")
    if window is None:
        p.add('<p class="sub">The recording holds no records.</p>\n')
    else:
        span = duration(
            float((_int(window.get("end_ms")) or 0) - (_int(window.get("start_ms")) or 0))
        )
        side = sum(1 for r in rows if r.get("kind") == "side_call")
        stateless = sum(1 for r in rows if r.get("kind") == "stateless")
        extra = f", {n_of(side, 'side-call')}" if rows else ""
        if stateless:
            extra += f", {n_of(stateless, 'stateless request')}"
        p.add(
            f'<p class="sub">{n_of(_int(cov.get("records")) or 0, "record")} from '
            f"{_e(_when(window.get('start_ms')))} to {_e(_when(window.get('end_ms')))} "
            f"({_e(span)}). {n_of(_int(cov.get('analysed')) or 0, 'chat request')} analysed: "
            f"{n_of(_int(cov.get('turns')) or 0, 'turn')} in "
            f"{n_of(_int(cov.get('conversations')) or 0, 'conversation')}{_e(extra)}.</p>\n"
        )
        skipped = _obj(cov, "skipped")
        skip = [f"{v:,} {k.replace('_', ' ')}" for k, v in skipped.items() if _int(v)]
        if skip or _int(cov.get("bad_lines")):
            bits = []
            if skip:
                bits.append("Skipped: " + ", ".join(skip) + ".")
            if _int(cov.get("bad_lines")):
                bits.append(f"{n_of(cov['bad_lines'], 'line')} could not be read.")
            p.add(f'<p class="note">{_e(" ".join(bits))}</p>\n')
    p.add(
        '<nav><a href="#loss">Loss by cause</a><a href="#findings">Findings</a>'
        '<a href="#timeline">Timeline</a><a href="#clients">Clients and tools</a>'
        '<a href="#changes">What changed</a></nav>\n'
    )
    t = _obj(report, "time")
    prefill = _mv(t.get("prefill_ms"))
    lost = _mv(t.get("lost_ms"))
    lost_tokens = _int(t.get("lost_tokens")) or 0
    turns = _int(cov.get("turns")) or 0
    pct = f"{lost / prefill:.0%} of the prefill" if lost is not None and prefill else ""
    cards = [
        ("Prefill", duration(prefill), "time the server spent reading prompts", ""),
        (
            "Lost",
            duration(lost) if lost is not None else "not timed",
            pct or "re-processing tokens it could have reused",
            "bad" if lost else "",
        ),
        ("Lost tokens", f"{lost_tokens:,}", "re-processed, could have been reused", ""),
        (
            "Measured",
            f"{_int(cov.get('turns_with_reuse')) or 0:,} / {turns:,}",
            f"turns with cache counters; {_int(cov.get('turns_with_timing')) or 0:,} timed",
            "",
        ),
    ]
    cards = _money_cards(report) + cards
    specs = [s for s in report.get("speculative") or [] if isinstance(s, dict)]
    drafted = sum(_int(s.get("draft_n")) or 0 for s in specs)
    if drafted:
        accepted = sum(_int(s.get("draft_n_accepted")) or 0 for s in specs)
        cards.append(
            (
                "Draft accepted",
                f"{accepted / drafted:.0%}",
                f"{accepted:,} of {drafted:,} drafted tokens (speculative decoding)",
                "",
            )
        )
    p.add('<div class="cards">')
    for k, v, d, cls in cards:
        p.add(
            f'<div class="card"><div class="k">{_e(k)}</div>'
            f'<div class="v {cls}">{_e(v)}</div><div class="d">{_e(d)}</div></div>'
        )
    p.add("</div>\n")
    if specs:
        p.add(
            '<p class="note speculative">Speculative decoding: '
            + "; ".join(_e(speculative_text(s)) for s in specs)
            + ".</p>\n"
        )


def _money_cards(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """On a provider, money leads the page (R36): what was spent, what misses cost, what
    writes nobody read cost, and how llmp's causes compare with the provider's own (R37)."""
    cost = _obj_or_none(report, "cost")
    if cost is None:
        return []
    total = cost.get("total_usd")
    lost = cost.get("lost_usd")
    share = f"{lost / total:.0%} of the spend, " if total and lost is not None else ""
    cards = [
        ("Spent", money(total), f"priced by {cost.get('prices')}", ""),
        ("On misses", money(lost), share + "beyond reading from the cache", "bad" if lost else ""),
    ]
    unread = cost.get("unread_write_usd")
    if unread:
        cards.append(("Unread writes", money(unread), "cache writes no request read", ""))
    without = _int(cost.get("requests_without_usage")) or 0
    if without:
        sub = "requests whose cost and cache use are unknown: no usage came"
        if cost.get("streams_without_include_usage"):
            sub += " (Chat streams without stream_options.include_usage)"
        cards.append(("Without usage", f"{without:,}", sub, "bad"))
    agreement = _obj_or_none(report, "provider_agreement")
    if agreement is not None and agreement.get("compared"):
        cards.append(
            (
                "Provider agrees",
                f"{agreement.get('agreed')} / {agreement.get('compared')}",
                "misses where the provider's own diagnosis names llmp's cause",
                "" if agreement.get("agreed") == agreement.get("compared") else "bad",
            )
        )
    return cards


def _loss_by_cause(p: _Page, report: dict[str, Any]) -> None:
    p.add('<h2 id="loss">Loss by cause</h2>\n')
    t = _obj(report, "time")
    by = _obj(t, "by_cause")
    prefill = _mv(t.get("prefill_ms"))
    items = [(c, v) for c, v in by.items() if isinstance(v, dict)]
    if not items:
        p.add("<p>Nothing was lost that the recording can show.</p>\n")
        return
    timed = any(_mv(v.get("ms")) is not None for _, v in items)
    items.sort(key=lambda cv: (-(_mv(cv[1].get("ms")) or 0), -(_int(cv[1].get("tokens")) or 0)))
    metric = [
        (_mv(v.get("ms")) or 0.0) if timed else float(_int(v.get("tokens")) or 0) for _, v in items
    ]
    top = max(metric) or 1.0
    label_w, bar_w, value_w, row_h = 250, 560, 330, 30
    width = label_w + bar_w + value_w
    height = row_h * len(items) + 8
    p.add(
        f'<svg class="chart by-cause" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="Loss by cause">\n'
    )
    for i, ((cause, v), m) in enumerate(zip(items, metric, strict=True)):
        y = 4 + i * row_h
        w = max(2.0, bar_w * m / top) if m else 0.0
        ms = _mv(v.get("ms"))
        tokens = _int(v.get("tokens")) or 0
        n = _int(v.get("rows")) or 0
        share = f", {ms / prefill:.1%} of prefill" if ms is not None and prefill else ""
        value = f"{duration(ms) if ms is not None else 'not timed'} · {tokens:,} tokens · " + (
            f"{n_of(n, 'turn')}{share}"
        )
        if v.get("usd") is not None:
            value = f"{money(v['usd'])} · {value}"
        words = _cause_words(cause)
        p.add(
            f'<g class="cause-bar" data-cause="{_e(_cause_key(cause))}">'
            f"<title>{_e(words)}: {_e(value)}</title>"
            f'<text class="lbl" x="{label_w - 10}" y="{y + 19}" text-anchor="end">'
            f"{_e(words)}</text>"
            f'<rect class="f-{_cause_key(cause)}" x="{label_w}" y="{y + 5}" width="{w:.1f}" '
            f'height="{row_h - 10}" rx="3"/>'
            f'<text class="val" x="{label_w + w + 8:.1f}" y="{y + 19}">{_e(value)}</text></g>\n'
        )
    p.add("</svg>\n")
    basis = "time" if timed else "tokens (no turn was timed)"
    p.add(f'<p class="note">Bars are scaled by {_e(basis)}. Hover a bar for its numbers.</p>\n')


def _findings(p: _Page, report: dict[str, Any]) -> None:
    p.add('<h2 id="findings">Findings</h2>\n')
    findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
    if not findings:
        p.add("<p>No findings: nothing was lost that the recording can show.</p>\n")
        return
    p.add('<ol class="findings">\n')
    for f in findings:
        what, fix = sentence(f)
        conf = f.get("confidence")
        conf_cls = conf if conf in ("high", "medium", "low") else "low"
        rows = [r for r in f.get("rows") or [] if _int(r) is not None]
        cited = ""
        if rows:
            shown = ", ".join(f"#{r}" for r in rows[:12]) + (" …" if len(rows) > 12 else "")
            cited = f'<div class="note">Requests {_e(shown)}</div>'
        p.add(
            f'<li class="finding" data-kind="{_e(f.get("kind"))}">'
            f'<span class="badge {conf_cls}">{_e(conf)}</span>{_e(what)}'
            + (f'<div class="fix"><b>Fix:</b> {_e(fix)}</div>' if fix else "")
            + cited
            + "</li>\n"
        )
    p.add("</ol>\n")
    agreement = agreement_lines(report.get("provider_agreement"))
    if agreement:
        p.add('<p class="note agreement">' + "<br>".join(_e(x) for x in agreement) + "</p>\n")


def _clients(p: _Page, report: dict[str, Any]) -> None:
    p.add('<h2 id="clients">Clients and their tools</h2>\n')
    clients = [c for c in report.get("clients") or [] if isinstance(c, dict)]
    tools = [t for t in report.get("tools") or [] if isinstance(t, dict)]
    if not clients:
        p.add("<p>No client sent a chat request.</p>\n")
        return
    for c in clients:
        name = c.get("client")
        mine = [t for t in tools if t.get("client") == name]
        offered_names = [n for n in c.get("tools") or [] if isinstance(n, str)]
        ua = c.get("user_agent")
        desc = [
            n_of(_int(c.get("requests")) or 0, "request"),
            n_of(_int(c.get("conversations")) or 0, "conversation"),
            n_of(len(offered_names), "tool") + " offered",
        ]
        p.add(
            f'<div class="client" data-client="{_e(name)}"><h3>{_e(name)}</h3>'
            f'<p class="meta">{_e(" · ".join(desc))}'
            + (f" · user-agent <code>{_e(ua)}</code>" if isinstance(ua, str) and ua != name else "")
            + ("" if isinstance(ua, str) else " · sent no user-agent")
            + "</p>\n"
        )
        if not mine:
            p.add('<p class="note">No tools offered.</p></div>\n')
            continue
        biggest = max((_int(t.get("schema_tokens")) or 0 for t in mine), default=0) or 1
        p.add(
            '<table class="tools"><thead><tr><th>tool</th><th class="n">schema tokens</th>'
            '<th class="n">offered in</th><th class="n">called</th></tr></thead><tbody>\n'
        )
        for t in mine:
            tokens = _int(t.get("schema_tokens")) or 0
            called = _int(t.get("called")) or 0
            w = max(1, round(120 * tokens / biggest))
            p.add(
                f'<tr class="tool"><td><code>{_e(t.get("name"))}</code></td>'
                f'<td class="n"><span class="bar" style="width:{w}px"></span>{tokens:,}</td>'
                f'<td class="n">{_e(n_of(_int(t.get("offered")) or 0, "request"))}</td>'
                + (f'<td class="n">{called:,}</td>' if called else '<td class="n never">never</td>')
                + "</tr>\n"
            )
        p.add("</tbody></table></div>\n")
