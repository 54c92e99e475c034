"""What changed between a broken turn and the turn it links to ("what changed" diffs).

`Changes` watches the analysis as it runs (`analyze(..., observe=...)`): it
keeps the prompt digest of each conversation's last turn, and when a turn
breaks its prefix it diffs the two prompts.  So the diffs come from the one
pass over the recording, standard input included, and nothing is read or
digested twice.  Only roles, sizes, hashes and tool names are kept: no
message text.

Each change is a dict: `session`, `id`, `linked_to`, `conversation`,
`turn`, `client`, `model`, `break_cause`, `cause`, `compaction`,
`new_conversation`, `losses`, `between`, `found` (both prompts were seen),
`broke_at` (`part`: system / tools / history / None, and the message
`index`), `tools` (hashes, counts, and the names added, removed or changed)
and `messages`: `{op, before, after}` with `op` one of kept, changed,
removed, added and each side `{index, role, chars, hash, tokens,
tool_calls, tool}`.
"""

from __future__ import annotations

import difflib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from llmp.analysis.classify import TURN
from llmp.analysis.engine import Fed
from llmp.analysis.exchange import SYSTEM_ROLES, Exchange
from llmp.analysis.rows import Row
from llmp.format.fastread import CallRef, Msg

__all__ = ["MAX_CHANGES", "Changes", "broke", "is_break", "prompt_of"]

MAX_CHANGES = 100
"""Diffs kept by default: the breaks with the largest loss."""
KEPT_PROMPTS = 4096
"""Last-turn prompts kept at most (the most recently active conversations)."""


def broke(kind: Any, linked_to: Any, break_cause: Any, lost: bool) -> bool:
    """A linked turn whose prompt broke (`break_cause`) or that lost tokens.

    These are the turns the "what changed" section explains; the page asks
    the same of a report row (`html.is_break`).
    """
    return kind == TURN and linked_to is not None and (break_cause is not None or lost)


def is_break(row: Row) -> bool:
    """`broke` for a row of the analysis."""
    lost = row.lost_client is not None or row.lost_external is not None
    return broke(row.kind, row.linked_to, row.break_cause, lost)


def _lost_tokens(row: Row) -> int:
    return sum(loss.tokens for loss in (row.lost_client, row.lost_external) if loss is not None)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _call_name(c: Any) -> Any:
    """A tool call's name: a parsed dict's (plain path) or a decoded `CallRef`'s."""
    if isinstance(c, dict):
        return c.get("name")
    return c.name if isinstance(c, CallRef) else None


def _message(index: int, m: Msg, tokens: dict[str, Any] | None) -> dict[str, Any]:
    """A message digest reduced to what the page shows: no text."""
    role = m.role
    h = m.hash
    chars = m.chars
    calls = m.tool_calls
    names = []
    if isinstance(calls, (list, tuple)):  # parsed (plain path) or decoded (fast path)
        for c in calls:
            name = _call_name(c)
            names.append(name if isinstance(name, str) else "?")
    tool = m.name if role == "tool" else None
    tok = tokens.get(h) if tokens is not None and isinstance(h, str) else None
    return {
        "index": index,
        "role": role if isinstance(role, str) else None,
        "chars": _int(chars) or 0,
        "hash": h if isinstance(h, str) else f"?{index}",
        "tokens": _int(tok),
        "tool_calls": names,
        "tool": tool if isinstance(tool, str) else None,
    }


def prompt_of(ex: Exchange) -> dict[str, Any]:
    """A request's messages and tools, as the diffs need them (digests only)."""
    tools = []
    for t in ex.tool_digests:
        name, h, chars = (t.name, t.hash, t.chars) if t is not None else (None, None, None)
        tools.append(
            {
                "name": name if isinstance(name, str) else "?",
                "hash": h if isinstance(h, str) else "",
                "chars": _int(chars) or 0,
            }
        )
    return {
        "messages": [_message(i, m, ex.tokmap) for i, m in enumerate(ex.msgs)],
        "tools": tools,
        "tools_hash": ex.tools.hash,
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


def _change(
    session: int, row: Row, before: dict[str, Any] | None, after: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "session": session,
        "id": row.id,
        "linked_to": row.linked_to,
        "conversation": row.conversation,
        "turn": row.turn,
        "client": row.client,  # a client key until `result` puts in the final label
        "model": row.model,
        "break_cause": row.break_cause,
        "cause": row.cause,
        "compaction": row.compaction,
        "new_conversation": row.new_conversation,
        "losses": [
            loss.as_json() for loss in (row.lost_client, row.lost_external) if loss is not None
        ],
        "between": {
            "side_calls": list(row.side_calls_between),
            "other_conversations": list(row.other_conversations_between),
            "other_domains": list(row.other_domains_between),
        },
        "found": False,
        "broke_at": {"part": None, "index": None},
        "tools": None,
        "messages": [],
    }
    if before is None:
        return out
    out["found"] = True
    out["broke_at"] = _broke_at(before, after)
    out["tools"] = _diff_tools(before, after)
    out["messages"] = _diff_messages(before["messages"], after["messages"])
    where = {c.get("index"): c for c in row.changed or ()}
    for op in out["messages"]:
        w = where.get(op["after"]["index"]) if op["op"] == "changed" and op["after"] else None
        if w is not None:  # where in the message it changed; no text, even in full mode
            op["where"] = {"within": w.get("within"), "offset": w.get("offset")}
    return out


class Changes:
    """Collects the "what changed" diffs while the analysis runs.

    At most `limit` breaks are kept, those with the largest loss (the
    earlier one on a tie).  `result` gives them in session and id order.
    """

    def __init__(self, limit: int = MAX_CHANGES, kept_prompts: int = KEPT_PROMPTS) -> None:
        self.limit = max(0, limit)
        self.kept_prompts = kept_prompts
        self.breaks = 0
        # (session, row id) -> (conversation, prompt) of each conversation's last turn
        self._prompts: OrderedDict[tuple[int, int], tuple[int, dict[str, Any]]] = OrderedDict()
        self._last_of: dict[tuple[int, int], int] = {}  # (session, conversation) -> row id
        self._heap: list[tuple[int, int, dict[str, Any]]] = []
        self._seq = itertools.count()

    def __call__(self, session: int, fed: Fed) -> None:
        """See one analysed record (the `observe` hook of `analyze`)."""
        row = fed.row
        if row.kind != TURN or row.conversation is None:
            return
        prompt = prompt_of(fed.exchange)
        if is_break(row):
            self.breaks += 1
            assert row.linked_to is not None
            linked = self._prompts.get((session, row.linked_to))
            change = _change(session, row, linked[1] if linked else None, prompt)
            if self.limit:
                item = (_lost_tokens(row), -next(self._seq), change)
                if len(self._heap) < self.limit:
                    heapq.heappush(self._heap, item)
                else:
                    heapq.heappushpop(self._heap, item)
        conv = (session, row.conversation)
        previous = self._last_of.get(conv)
        if previous is not None:
            self._prompts.pop((session, previous), None)
        self._last_of[conv] = row.id
        self._prompts[(session, row.id)] = (row.conversation, prompt)
        while len(self._prompts) > self.kept_prompts:
            (s, rid), (number, _) = self._prompts.popitem(last=False)
            if self._last_of.get((s, number)) == rid:
                del self._last_of[(s, number)]

    def result(self, label: Callable[[int], str]) -> list[dict[str, Any]]:
        """The kept changes in session and id order, with the final client labels."""
        out = [dict(change, client=label(change["client"])) for _, _, change in self._heap]
        out.sort(key=lambda c: (c["session"], c["id"]))
        return out
