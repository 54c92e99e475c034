"""The "what changed" section: each broken turn against the turn it continues."""

from __future__ import annotations

from typing import Any

from llmp.analysis.exchange import SYSTEM_ROLES
from llmp.analysis.html.common import (
    DIFF_CONTEXT,
    _anchor,
    _cause_key,
    _cause_words,
    _e,
    _int,
    _mv,
    _obj,
    _obj_or_none,
    _short,
    _tokens,
    is_break,
)
from llmp.analysis.html.page import _Page
from llmp.analysis.words import WITHIN_WORDS, duration, n_of, short_model


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
        where = op.get("where")
        if isinstance(where, dict) and where.get("within") in WITHIN_WORDS:
            role += f", changed {WITHIN_WORDS[where['within']]}"
            if _int(where.get("offset")) is not None:
                role += f" (at character {where['offset']:,})"
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
    for key, noun, many in (
        ("side_calls", "side-call", None),
        (
            "other_conversations",
            "request of another conversation",
            "requests of other conversations",
        ),
        ("other_domains", "request to another model", "requests to other models"),
    ):
        ids = [i for i in btw.get(key) or [] if _int(i) is not None]
        if ids:
            shown = ", ".join(f"#{i}" for i in ids[:10]) + (" …" if len(ids) > 10 else "")
            bits.append(f"{n_of(len(ids), noun, many)} ({shown})")
    return "Ran in between: " + "; ".join(bits) + "." if bits else ""


def _changes(p: _Page, rows: list[dict[str, Any]], changes: list[dict[str, Any]] | None) -> None:
    p.add('<h2 id="changes">What changed</h2>\n')
    total = sum(1 for r in rows if is_break(r))
    if changes is None:
        p.add(
            f'<p class="note">{n_of(total, "turn")} with a break or a loss; the diffs were '
            "not collected.</p>\n"
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
            f'<p class="note">Showing {len(items):,} of {n_of(total, "turn")} with a break or a '
            "loss: those with the largest loss.</p>\n"
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
            f"lost {duration(_mv(loss.get('ms')))} ({_tokens(loss.get('tokens'))})"
            if _mv(loss.get("ms")) is not None
            else f"lost {_tokens(loss.get('tokens'))}"
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
                    f'<td colspan="4">{_e(n_of(n, "unchanged message"))} '
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
