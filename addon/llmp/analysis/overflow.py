"""Context overflow: prompts the server cut or refused for its context (§10a of docs/analysis.md).

Two traces of a prompt longer than the server's context:

* **Silent truncation.** Ollama (and old llama-server builds with context
  shift) drops the start of the prompt, the system prompt and the tools
  first, and answers 200 as if nothing happened.  The only trace is the
  server's prompt count, far below what was sent.  "What was sent" is the
  row's composition total: tokenizer counts after `--tokenize`, otherwise
  the estimate (chars / 4), compared with a margin (`overflow_share`).
* **Refusal.** llama-server answers HTTP 400 with
  `{"error": {"type": "exceed_context_size_error", "n_prompt_tokens": …,
  "n_ctx": …}}`.  A full recording keeps that body; a digest recording keeps
  only the status, so a 400 there is taken for a context refusal only when
  its prompt is larger than every prompt the same model accepted in the
  session, before it and after it (the server's context is fixed for the
  life of its process, so a refusal for length cannot be smaller than a
  prompt it accepted), with low confidence.

Both become one additive `context_overflow` finding per served model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import inf
from typing import TYPE_CHECKING, Any

from llmp.apis import ChatApi, request_digest_of
from llmp.apis.servers import (
    CONTEXT_ERROR_MARKERS,
    CONTEXT_SIZE_PATTERNS,
    PROMPT_SIZE_PATTERNS,
    UNKNOWN,
    identify,
)
from llmp.format.measure import ESTIMATE, MV, RANK, SERVER, TOKENIZER, estimate, weakest

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.rows import Row

CONTEXT_OVERFLOW = "context_overflow"

_TEXT_LIMIT = 4096  # of an error body, enough for any message
_TRACKED = 4096  # conversations per session whose last turn is remembered

HIGH, MEDIUM, LOW = "high", "medium", "low"
_CONFIDENCE = (HIGH, MEDIUM, LOW)
_BY_RANK = {v: k for k, v in RANK.items()}

# Where the finding's n_ctx came from.
FROM_ERROR = "error"
FROM_REQUEST = "request"


@dataclass(slots=True)
class Refusal:
    """A chat request the server refused (4xx), maybe because of its context."""

    said: bool
    """The response body says it was the context; False: only the status is known."""
    n_ctx: int | None
    n_prompt: int | None
    """The server's own count of the refused prompt (llama-server's `n_prompt_tokens`)."""
    model: str | None
    """The model the request asked for."""
    sent: MV | None
    """The prompt in composition units (tokenizer counts or the estimate)."""
    server: str = ""
    """The server program its response names (`apis.servers`), or "" when it says none."""


def _pos_int(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        m = pattern.search(text)
        if m is not None:
            return int(m.group(1))
    return None


def _from_body(body: Any, text: Any) -> tuple[int | None, int | None] | None:
    """(n_ctx, n_prompt) when an error body says the prompt did not fit, else None."""
    parts: list[str] = []
    n_ctx = n_prompt = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            for key in ("type", "code", "message"):
                v = err.get(key)
                if isinstance(v, str):
                    parts.append(v)
            n_ctx = _pos_int(err.get("n_ctx"))
            n_prompt = _pos_int(err.get("n_prompt_tokens"))
        elif isinstance(err, str):
            parts.append(err)
        for key in ("message", "detail"):
            v = body.get(key)
            if isinstance(v, str):
                parts.append(v)
    if isinstance(text, str):
        parts.append(text[:_TEXT_LIMIT])
    said = " ".join(parts)
    low = said.lower()
    if not any(p in low for p in CONTEXT_ERROR_MARKERS):
        return None
    if n_ctx is None:
        n_ctx = _first(CONTEXT_SIZE_PATTERNS, low)
    if n_prompt is None:
        n_prompt = _first(PROMPT_SIZE_PATTERNS, low)
    return n_ctx, n_prompt


def _request_size(
    rec: dict[str, Any], req: dict[str, Any], api: ChatApi
) -> tuple[str | None, MV | None]:
    """The requested model and the prompt's size in composition units."""
    try:
        digest: Any = request_digest_of(req, api)
    except (ValueError, TypeError, RecursionError):
        return None, None
    if digest is None:
        return None, None
    model = digest.get("model")
    tokens = rec.get("tokens")
    msg_tok = tokens.get("messages") if isinstance(tokens, dict) else None
    tool_tok = tokens.get("tools") if isinstance(tokens, dict) else None
    total = 0
    src = TOKENIZER if isinstance(msg_tok, dict) else ESTIMATE
    for group, tokmap in ((digest.get("messages"), msg_tok), (digest.get("tools"), tool_tok)):
        if not isinstance(group, list):
            continue
        for item in group:
            if not isinstance(item, dict):
                continue
            h = item.get("hash")
            n = tokmap.get(h) if isinstance(tokmap, dict) and isinstance(h, str) else None
            if type(n) is int:
                total += n
            else:
                chars = item.get("chars")
                total += estimate(chars if type(chars) is int else 0)
                src = ESTIMATE
    return (model if isinstance(model, str) and model else None), (total, src)


def refusal_of(
    rec: dict[str, Any], req: dict[str, Any], resp: dict[str, Any], api: ChatApi, status: Any
) -> Refusal | None:
    """The Refusal of a non-2xx chat record, or None when it is not one.

    With a response body (full mode), the body decides.  Without one (digest
    mode drops non-2xx bodies), only a plain 400 can be a context refusal;
    the analysis then decides from the prompt's size (`Overflow.refused`).
    """
    if type(status) is not int or not 400 <= status < 500:
        return None
    body = resp.get("body")
    text = resp.get("body_text")
    if body is not None or (isinstance(text, str) and text):
        info = _from_body(body, text)
        if info is None:
            return None
        said = True
        n_ctx, n_prompt = info
    elif status == 400:
        said = False
        n_ctx = n_prompt = None
    else:
        return None
    model, sent = _request_size(rec, req, api)
    headers = resp.get("headers")
    header = headers.get("server") if isinstance(headers, dict) else None
    server = identify(header if isinstance(header, str) else None, api.name)
    return Refusal(said, n_ctx, n_prompt, model, sent, "" if server is UNKNOWN else server.name)


@dataclass
class _Group:
    """What one served model's overflow adds up to."""

    cut: list[int] = field(default_factory=list)
    dropped: float = 0
    dropped_rank: int = RANK[SERVER]
    sure: bool = False  # some cut row is certain: tokenizer counts, or within num_ctx < sent
    largest_cut: tuple[float, str, float] | None = None  # sent, source, reported
    num_ctx: int | None = None  # the largest num_ctx the cut requests set
    refused: list[int] = field(default_factory=list)
    refused_guessed: list[int] = field(default_factory=list)
    largest_refused: MV | None = None
    n_ctx_error: int | None = None


class Overflow:
    """Collects cut rows and refusals, per served model; builds the findings."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.groups: dict[str, _Group] = {}
        self.session: int | None = None
        self.served_by: dict[str, str] = {}  # requested model -> served model, this session
        self.largest_ok: dict[str, float] = {}  # served model -> largest accepted prompt
        self.old: set[str] = set()  # Ollama models whose count was read as the evaluated part
        # Per conversation of this session: its last turn's id and server prompt count.
        self.last_turn: dict[int, tuple[int, float | None]] = {}
        # Per conversation of this session: the smallest prompt the server cut.
        self.cut_at: dict[int, float] = {}
        # Status-only refusals of this session, until a larger accepted prompt
        # of the same model disproves them: (record id, served model, size).
        self.pending: list[tuple[int, str, MV]] = []
        self.servers: dict[str, str] = {}
        """The server program behind each served model (`Row.server`, a refusal's
        header): whose settings the finding's fix names."""

    def _session(self, number: int) -> None:
        if number != self.session:
            self._flush()
            self.session = number
            self.served_by.clear()
            self.largest_ok.clear()
            self.last_turn.clear()
            self.cut_at.clear()

    def _flush(self) -> None:
        """The pending refusals stand: nothing later in their session disproved them."""
        for record_id, served, sent in self.pending:
            g = self._group(served)
            g.refused_guessed.append(record_id)
            if g.largest_refused is None or sent[0] > g.largest_refused[0]:
                g.largest_refused = sent
        self.pending.clear()

    def _group(self, served: str) -> _Group:
        g = self.groups.get(served)
        if g is None:
            g = self.groups[served] = _Group()
        return g

    def row(self, row: Row, num_ctx: int | None) -> bool:
        """Take one row; True when the server cut its prompt."""
        if row.session != self.session:
            self._session(row.session)
        served = row.served
        self.served_by[row.model] = served
        if row.server:
            self.servers[served] = row.server
        a, b, c, d = row.composition
        sent = a[0] + b[0] + c[0] + d[0]
        src = a[1]
        if not (src is b[1] is c[1] is d[1]):  # one source throughout: the usual case
            src = weakest(src, b[1], c[1], d[1])
        if sent > self.largest_ok.get(served, -1.0):
            self.largest_ok[served] = sent
        if self.pending:
            self.pending = [p for p in self.pending if p[1] != served or p[2][0] > sent]
        counts = row.counts
        prompt = counts.prompt_tokens
        reported = prompt[0] if prompt is not None and prompt[1] == SERVER else None
        before = self._last_turn(row, reported)
        if counts.meaning == "old":
            # An old Ollama build counts only the evaluated part: a small count
            # is reuse, not a cut, and earlier "whole" readings are suspect.
            self.old.add(served)
            return False
        if reported is None or not self._cut(row, sent, src, reported, before, num_ctx):
            return False
        self._note_cut(row, sent, src, reported, num_ctx)
        return True

    def _last_turn(self, row: Row, reported: float | None) -> tuple[int, float | None] | None:
        """The conversation's last turn before this row (its id and count); this row is next."""
        if row.conversation is None:
            return None
        # Most recently active last, at most _TRACKED: like the engine's
        # conversations, an idle one is forgotten.
        before = self.last_turn.pop(row.conversation, None)
        self.last_turn[row.conversation] = (row.id, reported)
        if len(self.last_turn) > _TRACKED:
            forgotten = next(iter(self.last_turn))
            del self.last_turn[forgotten]
            self.cut_at.pop(forgotten, None)
        return before

    def _cut(
        self,
        row: Row,
        sent: float,
        src: str,
        reported: float,
        before: tuple[int, float | None] | None,
        num_ctx: int | None,
    ) -> bool:
        """Whether the server's count of the prompt says it dropped part of what was sent."""
        cfg = self.cfg
        least = cfg.overflow_min_tokens
        share = cfg.overflow_share_tokenizer if src == TOKENIZER else cfg.overflow_share
        if reported < share * sent and sent - reported >= least:
            return True  # far below what was sent: more than the estimate's error explains
        if src == TOKENIZER and num_ctx is not None and reported <= num_ctx < sent - least:
            return True  # counted exactly, and larger than the context the request asked for
        if (
            before is not None
            and before[0] == row.linked_to
            and before[1] is not None
            and row.break_cause is None
            and not row.compaction
            and not row.new_conversation
            and row.composition[3][0] > cfg.reuse_tolerance_tokens
            and reported <= before[1]
            and reported < sent
        ):
            # The client only appended to the turn before, yet the server's
            # count did not grow, and it is below the client's own size.
            return True
        # The context does not grow: a prompt at least as large as one of
        # this conversation the server already cut was cut too.
        return (
            row.conversation is not None
            and sent >= self.cut_at.get(row.conversation, inf)
            and reported < sent
        )

    def _note_cut(
        self, row: Row, sent: float, src: str, reported: float, num_ctx: int | None
    ) -> None:
        """Add a cut row to its served model's group."""
        if row.conversation is not None:
            self.cut_at[row.conversation] = min(sent, self.cut_at.get(row.conversation, inf))
        g = self._group(row.served)
        g.cut.append(row.id)
        g.sure = g.sure or src == TOKENIZER or (num_ctx is not None and reported <= num_ctx < sent)
        g.dropped += max(0.0, sent - reported)
        g.dropped_rank = max(g.dropped_rank, RANK[src])
        if g.largest_cut is None or sent > g.largest_cut[0]:
            g.largest_cut = (sent, src, reported)
        if num_ctx is not None:
            g.num_ctx = num_ctx if g.num_ctx is None else max(g.num_ctx, num_ctx)

    def refused(self, session: int, record_id: int, refusal: Refusal) -> None:
        """Take one refused chat request (a 4xx that may be about the context)."""
        self._session(session)
        model = refusal.model
        served = (self.served_by.get(model) or model) if model is not None else "unknown"
        if refusal.server and served not in self.servers:
            self.servers[served] = refusal.server
        if refusal.said:
            sent: MV | None = refusal.sent
            if refusal.n_prompt is not None:
                sent = (refusal.n_prompt, SERVER)
            g = self._group(served)
            g.refused.append(record_id)
            if refusal.n_ctx is not None:
                g.n_ctx_error = refusal.n_ctx
            if sent is not None and (g.largest_refused is None or sent[0] > g.largest_refused[0]):
                g.largest_refused = sent
            return
        sent = refusal.sent
        best = self.largest_ok.get(served)
        if sent is not None and best is not None and sent[0] > best:
            self.pending.append((record_id, served, sent))

    def build(self) -> list[dict[str, Any]]:
        """One `context_overflow` finding per served model that had any."""
        # Pending refusals count as they stand (a live host may ask mid-session;
        # nothing is moved, so a later row can still disprove them).
        pending: dict[str, list[tuple[int, str, MV]]] = {}
        for p in self.pending:
            pending.setdefault(p[1], []).append(p)
        out: list[dict[str, Any]] = []
        for served in {**self.groups, **pending}:
            g = self.groups.get(served) or _Group()
            f = self._finding(served, g, pending.get(served, []))
            if f is not None:
                out.append(f)
        return out

    def _finding(
        self, served: str, g: _Group, mine: list[tuple[int, str, MV]]
    ) -> dict[str, Any] | None:
        """A served model's finding, its pending refusals counted as guessed ones."""
        guessed = g.refused_guessed + [p[0] for p in mine]
        largest_refused = g.largest_refused
        for p in mine:
            if largest_refused is None or p[2][0] > largest_refused[0]:
                largest_refused = p[2]
        cut = [] if served in self.old else g.cut
        refused = g.refused + guessed
        if not cut and not refused:
            return None
        n_ctx, n_ctx_source = None, None
        if g.n_ctx_error is not None:
            n_ctx, n_ctx_source = g.n_ctx_error, FROM_ERROR
        elif cut and g.num_ctx is not None:
            n_ctx, n_ctx_source = g.num_ctx, FROM_REQUEST
        levels: list[str] = []
        if g.refused:
            levels.append(HIGH)
        if cut:
            levels.append(HIGH if g.sure else MEDIUM)
        if guessed:
            levels.append(LOW)
        sent: MV | None = None
        reported: float | None = None
        if cut and g.largest_cut is not None:
            sent, reported = (g.largest_cut[0], g.largest_cut[1]), g.largest_cut[2]
        if largest_refused is not None and (sent is None or largest_refused[0] > sent[0]):
            sent, reported = largest_refused, None
        return {
            "kind": CONTEXT_OVERFLOW,
            "model": served,
            "client": None,
            "rows": sorted(cut),
            "lost_tokens": None,
            "lost_ms": None,
            "context_tokens": n_ctx,
            "confidence": min(levels, key=_CONFIDENCE.index),
            "evidence": {
                "n_ctx": n_ctx,
                "n_ctx_source": n_ctx_source,
                "turns": len(cut) + len(refused),
                "truncated": len(cut),
                "refused": len(refused),
                "refused_ids": sorted(refused),
                "refused_from": _refused_from(bool(g.refused), bool(guessed)),
                "sent": _mv(sent),
                "reported": None if reported is None else int(reported),
                "dropped": (_mv((g.dropped, _BY_RANK[g.dropped_rank])) if cut else None),
                "server": self.servers.get(served),
            },
        }


def _refused_from(said: bool, guessed: bool) -> str | None:
    """How the refusals were recognised: the error body, or the status and size alone."""
    if said and guessed:
        return "body_and_status"
    if said:
        return "body"
    return "status" if guessed else None


def _mv(mv: MV | None) -> dict[str, Any] | None:
    if mv is None:
        return None
    return {"value": int(mv[0]), "source": mv[1]}


__all__ = [
    "CONTEXT_OVERFLOW",
    "FROM_ERROR",
    "FROM_REQUEST",
    "Overflow",
    "Refusal",
    "refusal_of",
]
