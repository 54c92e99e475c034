"""`llmp analyze --html FILE`: the report v1 drawn as one self-contained page.

The page is built from the report v1 (the dict `llmp analyze --json` prints)
and, for the "what changed" diffs, from message digests read again from the
recording (`collect_changes`).  It holds no message text, ever: only roles,
sizes, short hashes, tool names, client and model names.  It needs no
network: inline CSS, hand-drawn inline SVG, no script, no external font, and
a Content-Security-Policy that forbids loading anything.

Everything that comes from traffic (client names, tool names, models) is
escaped with `html.escape`.  See docs/html-report.md.
"""

from __future__ import annotations

import datetime as dt
import difflib
import html
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmp.analysis.reader import read_all
from llmp.analysis.render import CAUSE_WORDS, duration, sentence, short_model
from llmp.apis import api_for, request_digest_of

__all__ = [
    "CAUSES",
    "collect_changes",
    "is_break",
    "render_html",
    "write_html",
]

# Loss causes in the order the legend lists them, with colours from the
# Okabe-Ito palette (distinguishable with the common colour-vision
# deficiencies), and Paul Tol's wine and indigo for two server causes.  The
# token bars themselves are greys, so that only a loss is in colour.
CAUSES: dict[str, str] = {
    "system_changed": "#D55E00",
    "tools_changed": "#E69F00",
    "history_rewritten": "#CC79A7",
    "side_call": "#0072B2",
    "other_conversation": "#56B4E9",
    "other_model": "#009E73",
    "server_empty": "#882255",
    "server_head_only": "#F0E442",
    "server_rollback": "#332288",
}
_UNKNOWN_CAUSE = "other"
_UNKNOWN_COLOUR = "#9A9A9A"

SYSTEM_ROLES = frozenset(("system", "developer"))

MAX_CHANGES = 100
"""Diffs collected by default: the breaks with the largest loss."""
MAX_BARS = 400
"""Bars per conversation chart; longer conversations are drawn in buckets of turns."""
MAX_CHARTS = 60
"""Conversations drawn; the rest are listed in a table."""
DIFF_CONTEXT = 3
"""Unchanged messages shown on each side of a change; longer runs are folded."""


# -- small helpers -----------------------------------------------------------


def _e(value: Any) -> str:
    """Escape anything for HTML text or a quoted attribute."""
    return html.escape(str(value), quote=True)


def _mv(value: Any) -> float | None:
    """The number of a measured value, or None."""
    if isinstance(value, dict):
        v = value.get("value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _obj(d: dict[str, Any], key: str) -> dict[str, Any]:
    """`d[key]` when it is an object, else an empty one."""
    v = d.get(key)
    return v if isinstance(v, dict) else {}


def _obj_or_none(d: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = d.get(key)
    return v if isinstance(v, dict) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return None


def _cause_key(cause: Any) -> str:
    return cause if isinstance(cause, str) and cause in CAUSES else _UNKNOWN_CAUSE


def _cause_words(cause: Any) -> str:
    if isinstance(cause, str):
        return CAUSE_WORDS.get(cause, cause.replace("_", " "))
    return "unknown cause"


def _num(n: float | int | None) -> str:
    if n is None:
        return "–"
    return f"{round(n):,}"


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _when(ms: Any) -> str:
    if not isinstance(ms, int) or isinstance(ms, bool):
        return "–"
    try:
        return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):
        return "–"


def _short(h: Any) -> str:
    return str(h)[:8] if isinstance(h, str) and h else "–"


def _nice(x: float) -> float:
    """A round number at or above x, for an axis maximum."""
    if x <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if x <= m * exp:
            return m * exp
    return 10 * exp


def _fmt_axis(v: float) -> str:
    if v >= 1_000_000:
        return f"{v / 1_000_000:g}M"
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = report.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _losses(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        loss for key in ("lost_client", "lost_external") if isinstance(loss := row.get(key), dict)
    ]


def _lost_tokens(row: dict[str, Any]) -> int:
    return sum(_int(loss.get("tokens")) or 0 for loss in _losses(row))


def _lost_ms(row: dict[str, Any]) -> float | None:
    values = [_mv(loss.get("ms")) for loss in _losses(row)]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def is_break(row: dict[str, Any]) -> bool:
    """A linked turn whose prompt broke (`break_cause`) or that lost tokens.

    These are the turns the "what changed" section explains.
    """
    return (
        row.get("kind") == "turn"
        and _int(row.get("linked_to")) is not None
        and (row.get("break_cause") is not None or bool(_losses(row)))
    )


def _anchor(session: Any, row_id: Any) -> str:
    return f"change-s{_int(session) or 0}-{_int(row_id) or 0}"


# -- what changed: digests from the recording --------------------------------


def _message(index: int, m: Any, tokens: dict[str, Any] | None) -> dict[str, Any]:
    """A message digest reduced to what the page shows: no text."""
    if not isinstance(m, dict):
        m = {}
    role = m.get("role")
    h = m.get("hash")
    chars = m.get("chars")
    calls = m.get("tool_calls")
    names = []
    if isinstance(calls, list):
        for c in calls:
            name = c.get("name") if isinstance(c, dict) else None
            names.append(name if isinstance(name, str) else "?")
    tool = m.get("name") if role == "tool" else None
    tok = tokens.get(h) if tokens is not None and isinstance(h, str) else None
    return {
        "index": index,
        "role": role if isinstance(role, str) else None,
        "chars": chars if isinstance(chars, int) and not isinstance(chars, bool) else 0,
        "hash": h if isinstance(h, str) else f"?{index}",
        "tokens": tok if isinstance(tok, int) and not isinstance(tok, bool) else None,
        "tool_calls": names,
        "tool": tool if isinstance(tool, str) else None,
    }


def _prompt(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The messages and tools of a record's request, as digests; None if unreadable."""
    req = rec.get("request")
    if not isinstance(req, dict):
        return None
    method, path = req.get("method"), req.get("path")
    if not isinstance(method, str) or not isinstance(path, str):
        return None
    api = api_for(method, path)
    if api is None:
        return None
    digest: Any = request_digest_of(req, api)
    if digest is None:
        return None
    tok = rec.get("tokens")
    msg_tokens = tok.get("messages") if isinstance(tok, dict) else None
    msg_tokens = msg_tokens if isinstance(msg_tokens, dict) else None
    msgs = digest.get("messages")
    msgs = msgs if isinstance(msgs, list) else []
    tools = []
    raw_tools = digest.get("tools")
    for t in raw_tools if isinstance(raw_tools, list) else []:
        t = t if isinstance(t, dict) else {}
        name, h, chars = t.get("name"), t.get("hash"), t.get("chars")
        tools.append(
            {
                "name": name if isinstance(name, str) else "?",
                "hash": h if isinstance(h, str) else "",
                "chars": chars if isinstance(chars, int) and not isinstance(chars, bool) else 0,
            }
        )
    th = digest.get("tools_hash")
    return {
        "messages": [_message(i, m, msg_tokens) for i, m in enumerate(msgs)],
        "tools": tools,
        "tools_hash": th if isinstance(th, str) else None,
    }


def _n_sys(msgs: list[dict[str, Any]]) -> int:
    n = 0
    for m in msgs:
        if m["role"] not in SYSTEM_ROLES:
            break
        n += 1
    return n


def _broke_at(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where the later prompt first parts from the earlier one, in prompt order
    (system messages, then the tools block, then the rest)."""
    a = [m["hash"] for m in before["messages"]]
    b = [m["hash"] for m in after["messages"]]
    sa, sb = _n_sys(before["messages"]), _n_sys(after["messages"])
    for i in range(max(sa, sb)):
        if i >= sa or i >= sb or a[i] != b[i]:
            return {"part": "system", "index": i}
    if before["tools_hash"] != after["tools_hash"]:
        return {"part": "tools", "index": None}
    for i in range(sa, len(a)):
        if i >= len(b) or a[i] != b[i]:
            return {"part": "history", "index": i}
    return {"part": None, "index": None}


def _diff_messages(
    before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Kept / changed / removed / added messages, by identity hash."""
    a = [m["hash"] for m in before]
    b = [m["hash"] for m in after]
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    ops: list[dict[str, Any]] = [
        {"op": "kept", "before": before[i], "after": after[i]} for i in range(head)
    ]
    sm = difflib.SequenceMatcher(None, a[head : len(a) - tail], b[head : len(b) - tail], False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        i1, i2, j1, j2 = i1 + head, i2 + head, j1 + head, j2 + head
        if tag == "equal":
            ops += [
                {"op": "kept", "before": before[i], "after": after[j]}
                for i, j in zip(range(i1, i2), range(j1, j2), strict=True)
            ]
            continue
        olds, news = before[i1:i2], after[j1:j2]
        paired = 0
        while paired < min(len(olds), len(news)) and olds[paired]["role"] == news[paired]["role"]:
            paired += 1
        ops += [{"op": "changed", "before": olds[k], "after": news[k]} for k in range(paired)]
        ops += [{"op": "removed", "before": m, "after": None} for m in olds[paired:]]
        ops += [{"op": "added", "before": None, "after": m} for m in news[paired:]]
    ops += [
        {"op": "kept", "before": before[len(a) - tail + k], "after": after[len(b) - tail + k]}
        for k in range(tail)
    ]
    return ops


def _diff_tools(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    old = {t["name"]: t["hash"] for t in before["tools"]}
    new = {t["name"]: t["hash"] for t in after["tools"]}
    return {
        "before": before["tools_hash"],
        "after": after["tools_hash"],
        "count_before": len(before["tools"]),
        "count_after": len(after["tools"]),
        "chars_before": sum(t["chars"] for t in before["tools"]),
        "chars_after": sum(t["chars"] for t in after["tools"]),
        "added": [n for n in new if n not in old],
        "removed": [n for n in old if n not in new],
        "changed": [n for n in new if n in old and old[n] != new[n]],
    }


def _change(row: dict[str, Any], prompts: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    session = _int(row.get("session")) or 0
    rid = _int(row.get("id")) or 0
    linked = _int(row.get("linked_to")) or 0
    out: dict[str, Any] = {
        "session": session,
        "id": rid,
        "linked_to": linked,
        "conversation": _int(row.get("conversation")),
        "turn": _int(row.get("turn")),
        "client": row.get("client"),
        "model": row.get("model"),
        "break_cause": row.get("break_cause"),
        "cause": row.get("cause"),
        "compaction": bool(row.get("compaction")),
        "new_conversation": bool(row.get("new_conversation")),
        "losses": [
            {"cause": loss.get("cause"), "tokens": _int(loss.get("tokens")), "ms": loss.get("ms")}
            for loss in _losses(row)
        ],
        "between": {
            "side_calls": list(row.get("side_calls_between") or []),
            "other_conversations": list(row.get("other_conversations_between") or []),
            "other_domains": list(row.get("other_domains_between") or []),
        },
        "found": False,
        "broke_at": {"part": None, "index": None},
        "tools": None,
        "messages": [],
    }
    before = prompts.get((session, linked))
    after = prompts.get((session, rid))
    if before is None or after is None:
        return out
    out["found"] = True
    out["broke_at"] = _broke_at(before, after)
    out["tools"] = _diff_tools(before, after)
    out["messages"] = _diff_messages(before["messages"], after["messages"])
    return out


def collect_changes(
    paths: Sequence[str], report: dict[str, Any], *, limit: int = MAX_CHANGES
) -> list[dict[str, Any]]:
    """What changed between each broken turn and the turn it links to.

    Reads the recording again (the same files, in the same order, as the
    report was made from) and keeps the message digests of the rows that
    `is_break` selects and of the turns they link to.  At most `limit`
    breaks are kept, those with the largest loss; the result is in session
    and id order.  Standard input (`-`) cannot be read twice: ValueError.

    Each change holds `session`, `id`, `linked_to`, `conversation`, `turn`,
    `client`, `model`, `break_cause`, `cause`, `compaction`,
    `new_conversation`, `losses`, `between`, `found` (both requests were
    found), `broke_at` (`part`: system / tools / history / None, and the
    message `index`), `tools` (hashes, counts, and the names added, removed
    or changed) and `messages`: `{op, before, after}` with `op` one of
    kept, changed, removed, added and each side `{index, role, chars, hash,
    tokens, tool_calls, tool}`.  No message text.
    """
    if any(p == "-" for p in paths):
        raise ValueError("the diffs need to read the recording again; standard input cannot be")
    breaks = [r for r in _rows(report) if is_break(r)]
    breaks.sort(key=lambda r: -_lost_tokens(r))
    breaks = breaks[: max(0, limit)]
    breaks.sort(key=lambda r: (_int(r.get("session")) or 0, _int(r.get("id")) or 0))
    wanted: set[tuple[int, int]] = set()
    for r in breaks:
        session = _int(r.get("session")) or 0
        wanted.add((session, _int(r.get("id")) or 0))
        wanted.add((session, _int(r.get("linked_to")) or 0))

    def consume(records: Iterator[tuple[int, dict[str, Any]]]) -> dict[tuple[int, int], Any]:
        found: dict[tuple[int, int], Any] = {}
        if not wanted:
            return found
        for session, rec in records:
            key = (session, rec["id"])
            if key in wanted:
                prompt = _prompt(rec)
                if prompt is not None:
                    found[key] = prompt
        return found

    prompts, _ = read_all(list(paths), consume, progress=False)
    return [_change(r, prompts) for r in breaks]


# -- the page ------------------------------------------------------------------

_CSS = """
:root { color-scheme: light; --ink:#1d232b; --muted:#5a6572; --line:#d8dee6;
  --bg:#ffffff; --panel:#f6f8fa; --reused:#c9d1da; --evaluated:#6b7785;
  --unmeasured:#f1f3f5; --prefill:#8d98a5; --good:#1a7f37; --bad:#b42318; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
  "DejaVu Sans", sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 64px; }
h1 { font-size: 1.6rem; margin: 0 0 4px; }
h2 { font-size: 1.25rem; margin: 40px 0 12px; padding-bottom: 6px;
  border-bottom: 1px solid var(--line); }
h3 { font-size: 1.02rem; margin: 22px 0 6px; }
p { margin: 6px 0; }
a { color: #0b5cad; }
.sub, .meta, .note { color: var(--muted); }
.note { font-size: .88rem; }
nav { margin: 10px 0 0; font-size: .92rem; }
nav a { margin-right: 14px; }
.cards { display:flex; flex-wrap:wrap; gap:12px; margin: 18px 0 6px; }
.card { background:var(--panel); border:1px solid var(--line); border-radius:8px;
  padding:10px 14px; min-width: 170px; flex: 1 1 170px; }
.card .k { font-size:.8rem; color:var(--muted); text-transform: uppercase; letter-spacing:.04em; }
.card .v { font-size:1.35rem; font-weight:600; }
.card .v.bad { color: var(--bad); }
.card .d { font-size:.85rem; color:var(--muted); }
svg { display:block; max-width:100%; height:auto; font-family: inherit; }
svg text { fill: var(--muted); font-size: 11px; }
svg .lbl { fill: var(--ink); font-size: 12.5px; }
svg .val { fill: var(--ink); font-size: 12px; }
svg .grid { stroke: var(--line); stroke-width: 1; }
svg .axis { stroke: #9aa5b1; stroke-width: 1; }
svg .reused { fill: var(--reused); }
svg .evaluated { fill: var(--evaluated); }
svg .unmeasured { fill: var(--unmeasured); stroke: #8a96a3; stroke-width: .8;
  stroke-dasharray: 2 2; }
svg .prefill { fill: var(--prefill); }
svg .turn:hover rect, svg .cause-bar:hover rect { opacity: .8; }
svg .turn .hit { fill: transparent; }
.legend { display:flex; flex-wrap:wrap; gap: 6px 18px; margin: 8px 0 12px; padding:0;
  list-style:none; font-size:.9rem; }
.legend li { display:flex; align-items:center; gap:6px; }
.sw { display:inline-block; width:14px; height:14px; border-radius:3px;
  border:1px solid rgba(0,0,0,.25); flex: none; }
.sw.reused { background: var(--reused); }
.sw.evaluated { background: var(--evaluated); }
.sw.unmeasured { background: var(--unmeasured); border: 1px dashed #8a96a3; }
.sw.prefill { background: var(--prefill); }
.tri { width:0; height:0; border-left:7px solid transparent; border-right:7px solid transparent;
  border-top:10px solid #555; }
.conv { border:1px solid var(--line); border-radius:8px; padding: 10px 14px 8px; margin: 14px 0; }
.conv h3 { margin: 2px 0; }
table { border-collapse: collapse; width: 100%; font-size: .92rem; }
table.diff { width: auto; min-width: 50%; }
table.tools { max-width: 860px; }
th, td { text-align:left; padding: 4px 8px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { font-weight:600; color: var(--muted); font-size: .82rem; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
ol.findings { padding-left: 1.4em; }
ol.findings li { margin: 0 0 14px; }
.badge { display:inline-block; font-size:.75rem; font-weight:600; border-radius: 10px;
  padding: 0 8px; margin-right: 6px; border:1px solid; vertical-align: 1px; }
.badge.high { color:#8a1c0f; border-color:#e7b1a9; background:#fdf0ee; }
.badge.medium { color:#7a5400; border-color:#e6cf95; background:#fdf7e7; }
.badge.low { color:#45505c; border-color:#cdd3da; background:#f3f5f7; }
.fix { margin-top: 2px; }
.fix b { color: var(--good); }
.chip { display:inline-block; font-size:.8rem; font-weight:600; padding: 0 8px;
  border-radius: 10px; color:#111; margin-left: 6px; vertical-align: 1px; }
.client { margin: 18px 0 26px; }
.never { color: var(--bad); font-weight: 600; }
.bar { display:inline-block; height: 9px; background: var(--evaluated); border-radius: 2px;
  vertical-align: middle; margin-right: 6px; }
.change { border:1px solid var(--line); border-radius: 8px; margin: 16px 0; padding: 10px 14px; }
.change h3 { margin: 0 0 4px; }
.broke { margin: 6px 0 8px; }
table.diff { font: 12.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas,
  "DejaVu Sans Mono", "Liberation Mono", monospace; }
table.diff td { border-bottom: none; padding: 1px 8px; white-space: nowrap; }
table.diff td.sign { width: 1.6em; text-align:center; font-weight:700; }
table.diff tr.kept td { color: #3b4450; }
table.diff tr.changed td { background: #fff4d6; }
table.diff tr.removed td { background: #ffe4e1; }
table.diff tr.added td { background: #e2f6e5; }
table.diff tr.skip td { color: var(--muted); font-style: italic; background: var(--panel); }
table.diff tr.tools td { border-top: 1px dashed var(--line);
  border-bottom: 1px dashed var(--line); }
table.diff tr.first td:first-child { box-shadow: inset 3px 0 0 var(--bad); }
.scroll { overflow-x: auto; }
footer { margin-top: 48px; color: var(--muted); font-size: .85rem; }
"""


def _cause_css() -> str:
    lines = []
    for cause, colour in [*CAUSES.items(), (_UNKNOWN_CAUSE, _UNKNOWN_COLOUR)]:
        lines.append(f"svg .f-{cause} {{ fill: {colour}; }}")
        lines.append(f".b-{cause} {{ background: {colour}; }}")
        lines.append(f".tri.t-{cause} {{ border-top-color: {colour}; }}")
    # Chip text: white on the three dark colours, near-black on the others
    # (each pair has a WCAG contrast of at least 4.5).
    lines.append(
        ".chip.b-side_call, .chip.b-server_empty, .chip.b-server_rollback { color: #fff; }"
    )
    return "\n".join(lines)


class _Page:
    """Accumulates the page's HTML."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, *parts: str) -> None:
        self.parts.extend(parts)

    def text(self) -> str:
        return "".join(self.parts)


def render_html(
    report: dict[str, Any],
    changes: list[dict[str, Any]] | None = None,
    *,
    title: str | None = None,
) -> str:
    """The whole page as a string (see `write_html`)."""
    window = _obj_or_none(report, "window")
    if title is None:
        start = window.get("start_ms") if window else None
        title = "llmp analyze" + (f": {_when(start)}" if window else "")
    rows = _rows(report)
    p = _Page()
    p.add(
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">\n",
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        '<meta name="color-scheme" content="light">\n',
        '<meta name="generator" content="llmp analyze --html">\n',
        f"<title>{_e(title)}</title>\n<style>{_CSS}\n{_cause_css()}</style>\n</head>\n<body>\n",
        "<main>\n",
    )
    _header(p, report, rows, title)
    _loss_by_cause(p, report)
    _findings(p, report)
    _timeline(p, report, rows, changes)
    _clients(p, report)
    _changes(p, rows, changes)
    p.add(
        "<footer>Made by <code>llmp analyze --html</code> from the report v1. The page holds "
        "no message text: only roles, sizes, hashes, tool, client and model names.</footer>\n",
        "</main>\n</body>\n</html>\n",
    )
    return p.text()


def write_html(
    report: dict[str, Any],
    out: Path,
    *,
    changes: list[dict[str, Any]] | None = None,
    title: str | None = None,
) -> None:
    """Write the page for `report` (the report v1 as `llmp analyze --json`
    prints it, parsed) to `out`; `changes` from `collect_changes` adds the
    "what changed" diffs."""
    Path(out).write_text(render_html(report, changes, title=title), encoding="utf-8")


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
        extra = f", {_plural(side, 'side-call')}" if rows else ""
        if stateless:
            extra += f", {_plural(stateless, 'stateless request')}"
        p.add(
            f'<p class="sub">{_plural(_int(cov.get("records")) or 0, "record")} from '
            f"{_e(_when(window.get('start_ms')))} to {_e(_when(window.get('end_ms')))} "
            f"({_e(span)}). {_plural(_int(cov.get('analysed')) or 0, 'chat request')} analysed: "
            f"{_plural(_int(cov.get('turns')) or 0, 'turn')} in "
            f"{_plural(_int(cov.get('conversations')) or 0, 'conversation')}{_e(extra)}.</p>\n"
        )
        skipped = _obj(cov, "skipped")
        skip = [f"{v:,} {k.replace('_', ' ')}" for k, v in skipped.items() if _int(v)]
        if skip or _int(cov.get("bad_lines")):
            bits = []
            if skip:
                bits.append("Skipped: " + ", ".join(skip) + ".")
            if _int(cov.get("bad_lines")):
                bits.append(f"{cov['bad_lines']:,} lines could not be read.")
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
    p.add('<div class="cards">')
    for k, v, d, cls in cards:
        p.add(
            f'<div class="card"><div class="k">{_e(k)}</div>'
            f'<div class="v {cls}">{_e(v)}</div><div class="d">{_e(d)}</div></div>'
        )
    p.add("</div>\n")


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
            f"{_plural(n, 'turn')}{share}"
        )
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
            f"<h3>{_plural(len(rest), 'more conversation')}</h3>\n"
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
        lines.append(f"prompt: {_num(prompt)} tokens")
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
                f"lost {_num(_int(loss.get('tokens')))} tokens "
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
                    _plural(len(ids), noun)
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
        lines.append(f"reused {_num(bar.reused)}, evaluated {_num(bar.evaluated)} tokens")
    if bar.unmeasured:
        lines.append(f"{_num(bar.unmeasured)} tokens without reuse counters")
    lines.append(f"prefill: {duration(bar.prefill) if bar.timed else 'not timed'}")
    for cause, tokens in bar.lost.items():
        ms = bar.lost_ms.get(cause)
        lines.append(f"lost {_num(tokens)} tokens ({duration(ms)}): {_cause_words(cause)}")
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
        _plural(len(rs), "turn"),
        f"started {_when(first.get('t_start_ms'))}",
        f"prefill {duration(prefill_total) if timed else 'not timed'}",
    ]
    if lost_tokens:
        meta.append(
            f"lost {duration(lost_ms) if lost_ms else 'untimed'} ({lost_tokens:,} tokens) "
            f"in {_plural(broken, 'turn')}"
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
            _plural(_int(c.get("requests")) or 0, "request"),
            _plural(_int(c.get("conversations")) or 0, "conversation"),
            _plural(len(offered_names), "tool") + " offered",
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
                f'<td class="n">{_e(_plural(_int(t.get("offered")) or 0, "request"))}</td>'
                + (f'<td class="n">{called:,}</td>' if called else '<td class="n never">never</td>')
                + "</tr>\n"
            )
        p.add("</tbody></table></div>\n")


def _msg_cells(m: dict[str, Any] | None) -> tuple[str, str, str]:
    """Role, chars and hash cells for one side of a diff line."""
    if m is None:
        return "", "", ""
    role = m.get("role") or "?"
    if m.get("tool"):
        role += f" ({m['tool']})"
    chars = f"{_int(m.get('chars')) or 0:,}"
    if _int(m.get("tokens")) is not None:
        chars += f" ≈{m['tokens']:,} tok"
    return role, chars, _short(m.get("hash"))


def _diff_line(op: dict[str, Any], first: bool) -> str:
    kind = op.get("op")
    before, after = op.get("before"), op.get("after")
    sign = {"kept": "", "changed": "~", "removed": "−", "added": "+"}.get(str(kind), "?")
    bi = str(before["index"]) if isinstance(before, dict) else ""
    ai = str(after["index"]) if isinstance(after, dict) else ""
    role_b, chars_b, hash_b = _msg_cells(before)
    role_a, chars_a, hash_a = _msg_cells(after)
    if kind == "changed":
        role = role_a if role_a == role_b else f"{role_b} → {role_a}"
        chars = f"{chars_b} → {chars_a}"
        hsh = f"{hash_b} → {hash_a}"
    elif kind == "removed":
        role, chars, hsh = role_b, chars_b, hash_b
    else:
        role, chars, hsh = role_a, chars_a, hash_a
    side = after if isinstance(after, dict) else before
    calls = side.get("tool_calls") if isinstance(side, dict) else None
    calls_text = ", ".join(str(c) for c in calls) if isinstance(calls, list) else ""
    cls = f"{kind} first" if first else str(kind)
    title = {
        "kept": "kept: the same message",
        "changed": "changed: a different message at this place",
        "removed": "removed: only in the earlier turn",
        "added": "added: only in this turn",
    }.get(str(kind), "")
    return (
        f'<tr class="{_e(cls)}" title="{_e(title)}"><td class="sign">{_e(sign)}</td>'
        f'<td class="n">{_e(bi)}</td><td class="n">{_e(ai)}</td><td>{_e(role)}</td>'
        f'<td class="n">{_e(chars)}</td><td>{_e(hsh)}</td><td>{_e(calls_text)}</td></tr>\n'
    )


def _tools_line(tools: dict[str, Any], first: bool) -> str:
    same = tools.get("before") == tools.get("after")
    cb, ca = _int(tools.get("count_before")) or 0, _int(tools.get("count_after")) or 0
    if same:
        sign, cls = "", "kept"
        what = f"tools ({cb})" if cb else "no tools"
        chars = f"{_int(tools.get('chars_after')) or 0:,}" if ca else ""
        hsh = _short(tools.get("after")) if ca else ""
        note = ""
    else:
        sign, cls = "~", "changed first" if first else "changed"
        what = f"tools ({cb} → {ca})"
        chars = (
            f"{_int(tools.get('chars_before')) or 0:,} → {_int(tools.get('chars_after')) or 0:,}"
        )
        hsh = f"{_short(tools.get('before'))} → {_short(tools.get('after'))}"
        bits = []
        for key, mark in (("added", "+"), ("removed", "−"), ("changed", "~")):
            names = [str(n) for n in tools.get(key) or []]
            if names:
                bits.append(" ".join(f"{mark}{n}" for n in names))
        note = "; ".join(bits) or "same tools, reordered"
    return (
        f'<tr class="tools {cls}" title="the tools block, between the system messages and the '
        f'rest"><td class="sign">{sign}</td><td class="n"></td><td class="n"></td>'
        f'<td>{_e(what)}</td><td class="n">{_e(chars)}</td><td>{_e(hsh)}</td>'
        f"<td>{_e(note)}</td></tr>\n"
    )


def _fold(ops: list[dict[str, Any]]) -> list[dict[str, Any] | tuple[int, int]]:
    """Runs of kept messages longer than the context folded into (count, chars)."""
    out: list[dict[str, Any] | tuple[int, int]] = []
    i = 0
    n = len(ops)
    while i < n:
        if ops[i].get("op") != "kept":
            out.append(ops[i])
            i += 1
            continue
        j = i
        while j < n and ops[j].get("op") == "kept":
            j += 1
        lead = DIFF_CONTEXT if i > 0 else 0
        trail = DIFF_CONTEXT if j < n else 0
        if j - i > lead + trail + 1:
            out += ops[i : i + lead]
            hidden = ops[i + lead : j - trail]
            chars = sum(_int((o.get("after") or {}).get("chars")) or 0 for o in hidden)
            out.append((len(hidden), chars))
            out += ops[j - trail : j]
        else:
            out += ops[i:j]
        i = j
    return out


def _broke_text(c: dict[str, Any]) -> str:
    at = _obj(c, "broke_at")
    part, index = at.get("part"), at.get("index")
    if part == "system":
        return (
            f"Broke at message {index}, in the system prompt: everything after it was re-processed."
        )
    if part == "tools":
        return (
            "Broke at the tools block: the system prompt stayed reusable, the tools and "
            "everything after them were not."
        )
    if part == "history":
        return f"Broke at message {index}, in the history: the messages before it stayed reusable."
    return "The prompt continued the earlier one unchanged: nothing in it broke the cache."


def _between_text(c: dict[str, Any]) -> str:
    btw = _obj(c, "between")
    bits = []
    for key, noun in (
        ("side_calls", "side-call"),
        ("other_conversations", "request of another conversation"),
        ("other_domains", "request to another model"),
    ):
        ids = [i for i in btw.get(key) or [] if _int(i) is not None]
        if ids:
            shown = ", ".join(f"#{i}" for i in ids[:10]) + (" …" if len(ids) > 10 else "")
            bits.append(f"{_plural(len(ids), noun)} ({shown})")
    return "Ran in between: " + "; ".join(bits) + "." if bits else ""


def _changes(p: _Page, rows: list[dict[str, Any]], changes: list[dict[str, Any]] | None) -> None:
    p.add('<h2 id="changes">What changed</h2>\n')
    total = sum(1 for r in rows if is_break(r))
    if changes is None:
        p.add(
            f'<p class="note">{_plural(total, "turn")} with a break or a loss; the diffs were '
            "not collected (they need the recording itself).</p>\n"
            if total
            else "<p>No turn broke its prompt or lost its cached prefix.</p>\n"
        )
        return
    items = [c for c in changes if isinstance(c, dict)]
    if not items:
        p.add("<p>No turn broke its prompt or lost its cached prefix.</p>\n")
        return
    p.add(
        '<p class="note">Each block compares a turn with the turn it continues, message by '
        "message, in prompt order: the system messages, the tools block, then the rest. A "
        "message is known by the hash of its role, content and tool calls; the page shows its "
        "role, size in characters and the first 8 hex digits of that hash, never its text. "
        "<b>~</b> changed, <b>−</b> removed, <b>+</b> added; unchanged runs are folded.</p>\n"
    )
    if total > len(items):
        p.add(
            f'<p class="note">Showing {len(items):,} of {total:,} turns with a break or a loss: '
            "those with the largest loss.</p>\n"
        )
    for c in items:
        _change_block(p, c)


def _change_block(p: _Page, c: dict[str, Any]) -> None:
    losses = [x for x in c.get("losses") or [] if isinstance(x, dict)]
    # The cause of the larger loss, as the timeline colours the turn.
    cause = (
        max(losses, key=lambda x: _int(x.get("tokens")) or 0).get("cause")
        if losses
        else c.get("break_cause")
    )
    key = _cause_key(cause)
    chips = []
    if c.get("break_cause"):
        bk = _cause_key(c["break_cause"])
        chips.append(f'<span class="chip b-{bk}">{_e(_cause_words(c["break_cause"]))}</span>')
    for loss in losses:
        if loss.get("cause") != c.get("break_cause"):
            lk = _cause_key(loss.get("cause"))
            chips.append(f'<span class="chip b-{lk}">{_e(_cause_words(loss.get("cause")))}</span>')
    session = _int(c.get("session")) or 0
    head = (
        f"Conversation {_e(c.get('conversation'))}, turn {_e(c.get('turn'))}"
        if c.get("conversation") is not None
        else f"Request #{_e(c.get('id'))}"
    )
    p.add(
        f'<section class="change" id="{_anchor(session, c.get("id"))}" '
        f'data-row="{_int(c.get("id")) or 0}" data-session="{session}" data-cause="{_e(key)}">'
        f"<h3>{head}{''.join(chips)}</h3>\n"
    )
    meta = [
        f"request #{c.get('id')} compared with request #{c.get('linked_to')}"
        + (f" (session {session})" if session != 1 else ""),
        str(c.get("client")),
        short_model(c.get("model") if isinstance(c.get("model"), str) else None),
    ]
    for loss in losses:
        meta.append(
            f"lost {duration(_mv(loss.get('ms')))} ({_num(_int(loss.get('tokens')))} tokens)"
            if _mv(loss.get("ms")) is not None
            else f"lost {_num(_int(loss.get('tokens')))} tokens"
        )
    if c.get("compaction"):
        meta.append("a compaction: not charged to the client")
    if c.get("new_conversation"):
        meta.append("a new conversation that shares only its start")
    p.add(f'<p class="meta">{_e(" · ".join(meta))}</p>\n')
    if not c.get("found"):
        p.add(
            '<p class="note">The recording no longer holds a readable request for one of the '
            "two turns, so the diff cannot be shown.</p></section>\n"
        )
        return
    p.add(f'<p class="broke">{_e(_broke_text(c))}')
    btw = _between_text(c)
    if btw:
        p.add(f" {_e(btw)}")
    p.add("</p>\n")
    ops = [o for o in c.get("messages") or [] if isinstance(o, dict)]
    at = _obj(c, "broke_at")
    first_index = at.get("index")
    p.add(
        '<div class="scroll"><table class="diff"><thead><tr><th></th>'
        '<th class="n">before</th><th class="n">after</th><th>role</th>'
        '<th class="n">chars</th><th>hash</th><th>tool calls / tools</th></tr></thead><tbody>\n'
    )
    tools = _obj_or_none(c, "tools")

    def is_sys(o: dict[str, Any]) -> bool:
        side = o.get("after") or o.get("before") or {}
        return side.get("role") in SYSTEM_ROLES

    # The system messages lead both prompts; the tools block comes after them.
    lead = 0
    while lead < len(ops) and is_sys(ops[lead]):
        lead += 1
    for part in (ops[:lead], None, ops[lead:]):
        if part is None:
            if tools is not None:
                p.add(_tools_line(tools, at.get("part") == "tools"))
            continue
        for item in _fold(part):
            if isinstance(item, tuple):
                n, chars = item
                p.add(
                    f'<tr class="skip"><td class="sign">⋯</td><td></td><td></td>'
                    f'<td colspan="4">{_e(_plural(n, "unchanged message"))} '
                    f"({chars:,} chars)</td></tr>\n"
                )
                continue
            before = item.get("before") or {}
            after = item.get("after") or {}
            first = (
                first_index is not None
                and item.get("op") != "kept"
                and (before.get("index") == first_index or after.get("index") == first_index)
            )
            p.add(_diff_line(item, first))
    p.add("</tbody></table></div></section>\n")
