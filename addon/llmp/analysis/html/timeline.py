"""The timeline: one bar chart per conversation, a bar per turn, losses in colour."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from llmp.analysis.html.common import (
    CAUSES,
    MAX_BARS,
    MAX_CHARTS,
    _anchor,
    _cause_key,
    _cause_words,
    _e,
    _fmt_axis,
    _int,
    _losses,
    _lost_ms,
    _lost_tokens,
    _mv,
    _nice,
    _num,
    _obj,
    _tokens,
    _when,
)
from llmp.analysis.html.page import _Page
from llmp.analysis.render import duration, short_model
from llmp.analysis.words import n_of


def _legend(causes: Iterable[str], unmeasured: bool) -> str:
    items = [
        '<li class="legend-item" data-series="reused"><span class="sw reused"></span>'
        "reused from the cache</li>",
        '<li class="legend-item" data-series="evaluated"><span class="sw evaluated"></span>'
        "evaluated (new)</li>",
        '<li class="legend-item" data-series="prefill"><span class="sw prefill"></span>'
        "prefill time</li>",
    ]
    if unmeasured:
        items.insert(
            2,
            '<li class="legend-item" data-series="unmeasured"><span class="sw unmeasured"></span>'
            "prompt, reuse not reported</li>",
        )
    for cause in causes:
        key = _cause_key(cause)
        items.append(
            f'<li class="legend-item" data-cause="{_e(key)}"><span class="sw b-{key}"></span>'
            f'<span class="tri t-{key}"></span>lost: {_e(_cause_words(cause))}</li>'
        )
    return '<ul class="legend">' + "".join(items) + "</ul>\n"


def _report_causes(report: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    t = _obj(report, "time")
    by = _obj(t, "by_cause")
    seen = {c for c in by if isinstance(c, str)}
    for r in rows:
        for loss in _losses(r):
            if isinstance(loss.get("cause"), str):
                seen.add(loss["cause"])
    order = list(CAUSES)
    return sorted(seen, key=lambda c: (order.index(c) if c in order else len(order), c))


def _timeline(
    p: _Page,
    report: dict[str, Any],
    rows: list[dict[str, Any]],
    changes: list[dict[str, Any]] | None,
) -> None:
    p.add('<h2 id="timeline">Timeline of turns</h2>\n')
    turns = [r for r in rows if r.get("kind") == "turn" and _int(r.get("conversation"))]
    if not turns:
        p.add(
            "<p>No turns to draw"
            + ("" if rows or "rows" in report else " (the report has no rows)")
            + ".</p>\n"
        )
        return
    p.add(
        '<p class="note">One bar per turn, in order: the prompt in tokens, split into what the '
        "server reused from its cache, what it had to re-process although it could have "
        "reused it (coloured by cause, with a marker above), and what it evaluated because it "
        "was new. Below, the prefill time of the turn. Hover a bar for its numbers; a marked "
        "bar links to what changed.</p>\n"
    )
    unmeasured = any(
        _mv(_obj(r, "counts").get("reused_tokens")) is None
        or _mv(_obj(r, "counts").get("evaluated_tokens")) is None
        for r in turns
    )
    p.add(_legend(_report_causes(report, rows), unmeasured))
    diffed = {
        (_int(c.get("session")), _int(c.get("id"))) for c in changes or [] if isinstance(c, dict)
    }
    convs: dict[int, list[dict[str, Any]]] = {}
    for r in turns:
        convs.setdefault(_int(r["conversation"]) or 0, []).append(r)
    client_order = {
        c.get("client"): i for i, c in enumerate(report.get("clients") or []) if isinstance(c, dict)
    }

    def conv_key(item: tuple[int, list[dict[str, Any]]]) -> tuple[int, float, int]:
        number, rs = item
        lost = sum(_lost_ms(r) or 0 for r in rs)
        return (client_order.get(rs[0].get("client"), len(client_order)), -lost, number)

    ordered = sorted(convs.items(), key=conv_key)
    if len(ordered) > MAX_CHARTS:
        worst = sorted(ordered, key=lambda it: (-sum(_lost_tokens(r) for r in it[1]), it[0]))[
            :MAX_CHARTS
        ]
        keep = {n for n, _ in worst}
        drawn = [it for it in ordered if it[0] in keep]
        rest = [it for it in ordered if it[0] not in keep]
    else:
        drawn, rest = ordered, []
    current_client: Any = object()
    for number, rs in drawn:
        client = rs[0].get("client")
        if client != current_client:
            p.add(f"<h3>{_e(client)}</h3>\n")
            current_client = client
        rs.sort(key=lambda r: (_int(r.get("turn")) or 0, _int(r.get("id")) or 0))
        _conversation_chart(p, number, rs, diffed)
    if rest:
        p.add(
            f"<h3>{n_of(len(rest), 'more conversation')}</h3>\n"
            f'<p class="note">Only the {MAX_CHARTS} conversations with the largest loss are '
            "drawn.</p>\n<table><thead><tr><th>conversation</th><th>client</th><th>model</th>"
            '<th class="n">turns</th><th class="n">prefill</th><th class="n">lost</th></tr>'
            "</thead><tbody>\n"
        )
        for number, rs in rest:
            prefill = sum(_mv((r.get("counts") or {}).get("prefill_ms")) or 0 for r in rs)
            lost = sum(_lost_ms(r) or 0 for r in rs)
            p.add(
                f"<tr><td>{number}</td><td>{_e(rs[0].get('client'))}</td>"
                f'<td>{_e(short_model(rs[0].get("model")))}</td><td class="n">{len(rs)}</td>'
                f'<td class="n">{_e(duration(prefill))}</td>'
                f'<td class="n">{_e(duration(lost) if lost else "–")}</td></tr>\n'
            )
        p.add("</tbody></table>\n")


class _Bar:
    """One bar of a conversation chart: a turn, or a bucket of turns."""

    def __init__(self) -> None:
        self.first_turn = 0
        self.last_turn = 0
        self.rows: list[dict[str, Any]] = []
        self.reused = 0.0
        self.evaluated = 0.0
        self.unmeasured = 0.0
        self.prefill = 0.0
        self.timed = False
        self.lost: dict[str, float] = {}
        self.lost_ms: dict[str, float] = {}

    def add(self, r: dict[str, Any]) -> None:
        if not self.rows:
            self.first_turn = _int(r.get("turn")) or 0
        self.last_turn = _int(r.get("turn")) or 0
        self.rows.append(r)
        counts = _obj(r, "counts")
        reused = _mv(counts.get("reused_tokens"))
        evaluated = _mv(counts.get("evaluated_tokens"))
        prompt = _mv(counts.get("prompt_tokens"))
        if reused is not None and evaluated is not None:
            self.reused += reused
            self.evaluated += evaluated
        elif prompt is not None:
            self.unmeasured += prompt
        else:
            comp = _obj(r, "composition")
            self.unmeasured += sum(_mv(v) or 0 for v in comp.values())
        ms = _mv(counts.get("prefill_ms"))
        if ms is not None:
            self.prefill += ms
            self.timed = True
        for loss in _losses(r):
            cause = _cause_key(loss.get("cause"))
            self.lost[cause] = self.lost.get(cause, 0) + (_int(loss.get("tokens")) or 0)
            lms = _mv(loss.get("ms"))
            if lms is not None:
                self.lost_ms[cause] = self.lost_ms.get(cause, 0) + lms

    @property
    def total(self) -> float:
        return self.reused + self.evaluated + self.unmeasured

    def main_cause(self) -> str | None:
        if not self.lost:
            return None
        return max(self.lost.items(), key=lambda kv: kv[1])[0]


def _turn_title(bar: _Bar) -> str:
    if len(bar.rows) == 1:
        r = bar.rows[0]
        counts = _obj(r, "counts")
        lines = [
            f"Turn {bar.first_turn} (request #{r.get('id')}"
            + (f", session {r.get('session')}" if _int(r.get("session")) != 1 else "")
            + ")"
        ]
        prompt = _mv(counts.get("prompt_tokens"))
        reused = _mv(counts.get("reused_tokens"))
        evaluated = _mv(counts.get("evaluated_tokens"))
        lines.append(f"prompt: {_tokens(prompt)}")
        if reused is not None and evaluated is not None:
            lines.append(f"reused {_num(reused)}, evaluated {_num(evaluated)}")
        else:
            lines.append("the server did not report reuse")
        lines.append(f"prefill: {duration(_mv(counts.get('prefill_ms')))}")
        linked = _int(r.get("linked_to"))
        if linked is not None:
            lines.append(
                f"linked to request #{linked}"
                + (" (new conversation)" if r.get("new_conversation") else "")
            )
        if r.get("break_cause"):
            lines.append(f"break: {_cause_words(r.get('break_cause'))}")
        if r.get("compaction"):
            lines.append("compaction (not charged)")
        for loss in _losses(r):
            lines.append(
                f"lost {_tokens(loss.get('tokens'))} "
                f"({duration(_mv(loss.get('ms')))}): {_cause_words(loss.get('cause'))}"
            )
        between = []
        for key, noun in (
            ("side_calls_between", "side-call"),
            ("other_conversations_between", "other-conversation request"),
            ("other_domains_between", "other-model request"),
        ):
            ids = [i for i in r.get(key) or [] if _int(i) is not None]
            if ids:
                between.append(
                    n_of(len(ids), noun)
                    + " ("
                    + ", ".join(f"#{i}" for i in ids[:8])
                    + (" …" if len(ids) > 8 else "")
                    + ")"
                )
        if between:
            lines.append("ran in between: " + "; ".join(between))
        return "\n".join(lines)
    lines = [f"Turns {bar.first_turn}–{bar.last_turn}"]
    if bar.reused or bar.evaluated:
        lines.append(f"reused {_num(bar.reused)}, evaluated {_tokens(bar.evaluated)}")
    if bar.unmeasured:
        lines.append(f"{_tokens(bar.unmeasured)} without reuse counters")
    lines.append(f"prefill: {duration(bar.prefill) if bar.timed else 'not timed'}")
    for cause, tokens in bar.lost.items():
        ms = bar.lost_ms.get(cause)
        lines.append(f"lost {_tokens(tokens)} ({duration(ms)}): {_cause_words(cause)}")
    return "\n".join(lines)


def _conversation_chart(
    p: _Page, number: int, rs: list[dict[str, Any]], diffed: set[tuple[int | None, int | None]]
) -> None:
    first = rs[0]
    prefill_total = sum(_mv((r.get("counts") or {}).get("prefill_ms")) or 0 for r in rs)
    timed = any(_mv((r.get("counts") or {}).get("prefill_ms")) is not None for r in rs)
    lost_ms = sum(_lost_ms(r) or 0 for r in rs)
    lost_tokens = sum(_lost_tokens(r) for r in rs)
    broken = sum(1 for r in rs if _losses(r))
    models = sorted({short_model(r.get("model")) for r in rs if isinstance(r.get("model"), str)})
    meta = [
        ", ".join(models) or "unknown model",
        n_of(len(rs), "turn"),
        f"started {_when(first.get('t_start_ms'))}",
        f"prefill {duration(prefill_total) if timed else 'not timed'}",
    ]
    if lost_tokens:
        meta.append(
            f"lost {duration(lost_ms) if lost_ms else 'untimed'} ({n_of(lost_tokens, 'token')}) "
            f"in {n_of(broken, 'turn')}"
        )
    p.add(
        f'<div class="conv" id="conv-{number}" data-conversation="{number}">'
        f"<h3>Conversation {number}</h3>"
        f'<p class="meta">{_e(" · ".join(meta))}</p>\n'
    )

    bucket = max(1, math.ceil(len(rs) / MAX_BARS))
    bars: list[_Bar] = []
    for i, r in enumerate(rs):
        if i % bucket == 0:
            bars.append(_Bar())
        bars[-1].add(r)

    left, right, top = 72, 14, 18
    tok_h, gap, pre_h, bottom = 150, 18, 56, 22
    max_w = 1100
    step = min(40.0, (max_w - left - right) / max(len(bars), 1))
    width = max(440, round(left + right + step * len(bars)))
    bar_w = max(1.0, step * 0.72)
    height = top + tok_h + gap + pre_h + bottom
    tok_max = _nice(max((b.total for b in bars), default=0) or 1)
    pre_max = _nice(max((b.prefill for b in bars), default=0) or 1)
    y0 = top + tok_h  # token baseline
    p0 = y0 + gap + pre_h  # prefill baseline

    s: list[str] = [
        f'<svg class="chart timeline" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="Turns of conversation {number}">'
    ]
    for frac in (0.0, 0.5, 1.0):
        y = y0 - tok_h * frac
        s.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_e(_fmt_axis(tok_max * frac))}</text>"
        )
    s.append(
        f'<text x="14" y="{y0 - tok_h / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {y0 - tok_h / 2:.1f})">tokens</text>'
        f'<line class="axis" x1="{left}" x2="{width - right}" y1="{p0}" y2="{p0}"/>'
        f'<line class="grid" x1="{left}" x2="{width - right}" y1="{p0 - pre_h}" '
        f'y2="{p0 - pre_h}"/>'
        f'<text x="{left - 6}" y="{p0 - pre_h + 4}" text-anchor="end">'
        f"{_e(duration(pre_max))}</text>"
        f'<text x="{left - 6}" y="{p0 + 4}" text-anchor="end">0</text>'
        f'<text x="14" y="{p0 - pre_h / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {p0 - pre_h / 2:.1f})">prefill</text>'
    )
    label_every = max(1, math.ceil(len(bars) / 25))
    for i, b in enumerate(bars):
        x = left + i * step + (step - bar_w) / 2
        r0 = b.rows[0]
        single = len(b.rows) == 1
        attrs = (
            f'class="turn" data-conversation="{number}" data-turn="{b.first_turn}" '
            f'data-row="{_int(r0.get("id")) or 0}"'
        )
        cause = b.main_cause()
        if cause is not None:
            attrs += f' data-cause="{_e(cause)}"'
        if bucket > 1:
            attrs += f' data-last-turn="{b.last_turn}"'
        key = (_int(r0.get("session")), _int(r0.get("id")))
        link = single and key in diffed
        g = [f"<g {attrs}><title>{_e(_turn_title(b))}</title>"]
        if link:
            g.append(f'<a href="#{_anchor(r0.get("session"), r0.get("id"))}">')
        # A transparent hit area over the whole column makes small bars hoverable.
        g.append(
            f'<rect class="hit" x="{left + i * step:.2f}" y="{top - 14}" width="{step:.2f}" '
            f'height="{p0 - top + 14}"/>'
        )
        scale = tok_h / tok_max
        y = float(y0)
        lost_total = sum(b.lost.values())
        segments: list[tuple[str, float]] = []
        if b.unmeasured:
            segments.append(("unmeasured", b.unmeasured))
        if b.reused:
            segments.append(("reused", b.reused))
        measured_eval = b.evaluated
        lost_in_eval = min(lost_total, measured_eval) if measured_eval else 0.0
        for c, tokens in sorted(b.lost.items()):
            share = tokens / lost_total if lost_total else 0.0
            amount = lost_in_eval * share if measured_eval else 0.0
            if amount > 0:
                segments.append((f"f-{c}", amount))
        if measured_eval - lost_in_eval > 0:
            segments.append(("evaluated", measured_eval - lost_in_eval))
        for cls, amount in segments:
            h = amount * scale
            y -= h
            g.append(
                f'<rect class="{cls}" x="{x:.2f}" y="{y:.2f}" width="{bar_w:.2f}" '
                f'height="{max(h, 0.5):.2f}"/>'
            )
        if cause is not None:
            cx = x + bar_w / 2
            half = max(3.0, min(7.0, bar_w / 2 + 1))
            g.append(
                f'<path class="loss-marker f-{cause}" d="M{cx - half:.2f},{top - 12} '
                f'L{cx + half:.2f},{top - 12} L{cx:.2f},{top - 2} Z"/>'
            )
        if b.timed:
            pscale = pre_h / pre_max
            ph = b.prefill * pscale
            g.append(
                f'<rect class="prefill" x="{x:.2f}" y="{p0 - ph:.2f}" width="{bar_w:.2f}" '
                f'height="{max(ph, 0.5):.2f}"/>'
            )
            yy = float(p0)
            for c, lms in sorted(b.lost_ms.items()):
                lh = min(lms, b.prefill) * pscale
                yy -= lh
                if lh > 0:
                    g.append(
                        f'<rect class="lost-ms f-{c}" x="{x:.2f}" y="{yy:.2f}" '
                        f'width="{bar_w:.2f}" height="{lh:.2f}"/>'
                    )
        if link:
            g.append("</a>")
        g.append("</g>")
        s.append("".join(g))
        if i % label_every == 0:
            s.append(
                f'<text x="{x + bar_w / 2:.2f}" y="{p0 + 15}" text-anchor="middle">'
                f"{b.first_turn}</text>"
            )
    s.append(f'<text x="{left - 6}" y="{p0 + 15}" text-anchor="end">turn</text></svg>')
    p.add("".join(s), "\n")
    if bucket > 1:
        p.add(f'<p class="note">Each bar sums {bucket} consecutive turns.</p>\n')
    p.add("</div>\n")
