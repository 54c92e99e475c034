"""Anthropic's prompt cache as its documentation describes it: pure code, no server.

The rules and their sources are listed in ``anthropic_api``'s docstring; this
module holds them as code so the fake's tests can check each one directly:

- ``parse_prompt`` turns a Messages request into its prompt: the blocks in
  cache order (``tools``, ``system``, ``messages``), each with its token
  count, the hash of the prompt through it, and its breakpoint; it refuses
  (``RequestError``, an HTTP 400) what the API refuses.
- ``PromptCache`` keeps the entries the breakpoints wrote, looks back from
  each breakpoint, refreshes what a request read, and writes only once the
  response has begun (``plan``, then ``commit``).
- ``Decision`` is one request's outcome, and ``usage`` its counters.
- ``Fingerprint`` and ``diagnose`` are the cache diagnostics.

The numbers the cache depends on (lookback, breakpoints, time-to-live) come
from ``llmp.apis.providers``, the one home of the providers' facts.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmp.apis.providers import (
    anthropic_billing_block,
    anthropic_lookback_blocks,
    anthropic_ttl_seconds,
    facts,
)
from llmp.demo.fakes.model import count_tokens

Tier = Literal["tools", "system", "messages"]

_THINKING = ("thinking", "redacted_thinking")
_ORDER_NOTE = (
    "Note that blocks are processed in the following order: `tools`, `system`, `messages`."
)


class RequestError(Exception):
    """A request the API refuses with HTTP 400 ``invalid_request_error``; the message is its
    own wording where known (see ``anthropic_api``)."""


def canonical(value: Any) -> str:
    """A block as the fake renders it: compact JSON, keys in the order sent (a byte change
    is a change)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def strip_cache_control(value: Any) -> Any:
    """``value`` without ``cache_control`` at any depth: it says where to cache, it is not
    part of the prompt."""
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


def billing_line(block: dict[str, Any]) -> bool:
    """Claude Code's first system block, `x-anthropic-billing-header: cc_version=…;`: its
    text changes between requests, and the API still reads the prefix behind it (first-party
    hit ratios near 0.99 are reported with a per-request hash in it; wire-formats.md)."""
    text = block.get("text")
    return block.get("type") == "text" and isinstance(text, str) and anthropic_billing_block(text)


def block_tokens(block: dict[str, Any]) -> int:
    """The fake tokenizer on one block (``cache_control`` removed): a text block counts its
    text, any other block its compact JSON; one token per four characters, rounded up."""
    if block.get("type") == "text" and isinstance(block.get("text"), str):
        return count_tokens(block["text"])
    return count_tokens(canonical(block))


# ------------------------------------------------------------------ the prompt


@dataclass(frozen=True, slots=True)
class Block:
    """One position of the cached prefix: a tool, a system block or a message content block."""

    tier: Tier
    where: str
    """Its path in the request, as the API's error messages name it (``messages.3.content.0``)."""
    kind: str
    digest: str
    """This block alone: its tier, role, whether it starts a message, and its JSON."""
    chain: str
    """The prompt from its start through this block (what an entry here is keyed by)."""
    tokens: int
    end: int
    """Tokens from the start of the prompt through this block."""
    ttl: str | None
    """The breakpoint's time-to-live (``5m`` or ``1h``), or None: no breakpoint here."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The prompt-affecting settings outside the blocks, and the tiers each one invalidates."""

    speed: str
    toggles: str
    """Web search (a ``web_search*`` server tool) and citations (a document with
    ``citations.enabled``), on or off."""
    tool_choice: str
    thinking: str
    images: int

    def tier_key(self, tier: Tier) -> str:
        """What, besides the prefix, an entry in ``tier`` is keyed by: ``speed`` and the
        toggles reach the system and messages tiers; ``tool_choice``, thinking and the
        number of images the messages tier only. Tool definitions are the prefix itself."""
        if tier == "tools":
            return ""
        if tier == "system":
            return _sha(self.speed, self.toggles)
        return _sha(self.speed, self.toggles, self.tool_choice, self.thinking, str(self.images))

    def others(self) -> str:
        """The settings the diagnosis does not name (it says ``unavailable`` for them)."""
        return _sha(self.toggles, self.tool_choice, self.thinking, str(self.images))


@dataclass(frozen=True, slots=True)
class Prompt:
    model: str
    blocks: tuple[Block, ...]
    settings: Settings

    @property
    def total(self) -> int:
        return self.blocks[-1].end if self.blocks else 0

    @property
    def breakpoints(self) -> list[int]:
        """The positions (block indexes) that carry a breakpoint, in prompt order."""
        return [i for i, b in enumerate(self.blocks) if b.ttl is not None]


@dataclass(slots=True)
class _Raw:
    tier: Tier
    where: str
    role: str
    block: dict[str, Any]
    ttl: str | None = None


def _ttl(cc: Any, where: str) -> str:
    """A ``cache_control`` object's time-to-live, or the API's 400 for a malformed one."""
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise RequestError(f"{where}.cache_control.type: Input should be 'ephemeral'")
    ttl = cc.get("ttl", facts()["anthropic"]["default_ttl"])
    if ttl not in facts()["anthropic"]["ttl_seconds"]:
        raise RequestError(f"{where}.cache_control.ttl: Input should be '5m' or '1h'")
    return str(ttl)


def _cacheable(block: dict[str, Any]) -> bool:
    """Whether a block may carry a breakpoint: not thinking, not an empty text."""
    if block.get("type") in _THINKING:
        return False
    return not (block.get("type") == "text" and block.get("text") == "")


def _breakpoint(raw: _Raw) -> None:
    """Read a block's own ``cache_control`` into ``raw.ttl``, refusing it where the API does."""
    cc = raw.block.get("cache_control")
    if cc is None:
        return
    kind = raw.block.get("type")
    if kind in _THINKING:
        raise RequestError(f"{raw.where}.{kind}.cache_control: Extra inputs are not permitted")
    if kind == "text" and raw.block.get("text") == "":
        raise RequestError(f"{raw.where}.text: cache_control cannot be set for empty text blocks")
    raw.ttl = _ttl(cc, raw.where)


def _content(value: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """A ``system`` or message ``content`` as ``(where, block)``: a string is one text block."""
    if isinstance(value, str):
        return [(where, {"type": "text", "text": value})]
    if not isinstance(value, list):
        raise RequestError(f"{where}: Input should be a valid list")
    out: list[tuple[str, dict[str, Any]]] = []
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise RequestError(f"{where}.{j}: Input should be a valid dictionary")
        out.append((f"{where}.{j}", block))
    return out


def _last_fresh_user(messages: list[Any]) -> int:
    """The index of the last user message with content other than tool results (-1: none):
    thinking blocks before it are dropped from the prompt."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            return i
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") != "tool_result" for b in content
        ):
            return i
    return -1


def _images(messages: list[Any]) -> int:
    """Image blocks in the messages, those inside tool results included."""
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else []:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "image":
                n += 1
            inner = b.get("content") if b.get("type") == "tool_result" else None
            if isinstance(inner, list):
                n += sum(1 for x in inner if isinstance(x, dict) and x.get("type") == "image")
    return n


def _citations(messages: list[Any]) -> bool:
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else []:
            if isinstance(b, dict) and b.get("type") == "document":
                cit = b.get("citations")
                if isinstance(cit, dict) and cit.get("enabled") is True:
                    return True
    return False


def _raw_blocks(body: dict[str, Any]) -> list[_Raw]:
    """Every block of the prompt in cache order, with its own breakpoint; thinking blocks
    before the last fresh user message are not in the prompt (they are still checked)."""
    out: list[_Raw] = []
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("tools: Input should be a valid list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools.{i}: Input should be a valid dictionary")
        out.append(_Raw("tools", f"tools.{i}", "", tool))
    system = body.get("system")
    if system is not None and system != "":
        for where, block in _content(system, "system"):
            out.append(_Raw("system", where, "system", block))
    for raw in out:
        _breakpoint(raw)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages: Input should be a valid list")
    fresh = _last_fresh_user(messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages.{i}: Input should be a valid dictionary")
        for where, block in _content(m.get("content"), f"messages.{i}.content"):
            raw = _Raw("messages", where, str(m.get("role")), block)
            _breakpoint(raw)
            if i < fresh and block.get("type") in _THINKING:
                continue
            out.append(raw)
    return out


def _automatic(body: dict[str, Any], raws: list[_Raw]) -> int:
    """Apply a top-level ``cache_control`` to the last cacheable block; how many breakpoints
    it adds (0 when that block already has one of the same time-to-live)."""
    cc = body.get("cache_control")
    if cc is None:
        return 0
    ttl = _ttl(cc, "cache_control")
    target = next((r for r in reversed(raws) if _cacheable(r.block)), None)
    if target is None:
        return 0
    if target.ttl is None:
        target.ttl = ttl
        return 1
    if target.ttl != ttl:
        raise RequestError(
            f"cache_control.ttl: the automatic cache_control (ttl='{ttl}') falls on "
            f"{target.where}, which has its own with ttl='{target.ttl}'"
        )
    return 0


def _check_breakpoints(raws: list[_Raw], explicit_blocks: int) -> None:
    """At most four breakpoints; no 1-hour one after a 5-minute one."""
    limit = int(facts()["anthropic"]["max_breakpoints"])
    if explicit_blocks > limit:
        raise RequestError(
            f"A maximum of {limit} blocks with cache_control may be provided. "
            f"Found {explicit_blocks}."
        )
    seen_5m = False
    for raw in raws:
        if raw.ttl == "5m":
            seen_5m = True
        elif raw.ttl == "1h" and seen_5m:
            raise RequestError(
                f"{raw.where}.cache_control.ttl: a ttl='1h' cache_control block must not "
                f"come after a ttl='5m' cache_control block. {_ORDER_NOTE}"
            )


def parse_prompt(body: dict[str, Any]) -> Prompt:
    """The request's prompt in cache order, or ``RequestError`` where the API refuses it."""
    raws = _raw_blocks(body)
    explicit = sum(1 for r in raws if r.ttl is not None)
    explicit += _automatic(body, raws)
    _check_breakpoints(raws, explicit)
    blocks: list[Block] = []
    chain = _sha(str(body.get("model")))
    end = 0
    previous_message = ""
    for raw in raws:
        message = raw.where.rsplit(".content", 1)[0] if raw.tier == "messages" else raw.where
        starts = message != previous_message
        previous_message = message
        plain = strip_cache_control(raw.block)
        tokens = block_tokens(plain)
        end += tokens
        if raw.where == "system.0" and billing_line(plain):
            # Claude Code's per-request billing line: the API reads the prefix behind it
            # whatever it says (R35), so it is no part of any entry's key.
            digest = _sha(raw.tier, raw.role, "billing")
        else:
            digest = _sha(raw.tier, raw.role, "start" if starts else "", canonical(plain))
        chain = _sha(chain, digest)
        kind = str(plain.get("type") or ("tool" if raw.tier == "tools" else ""))
        blocks.append(Block(raw.tier, raw.where, kind, digest, chain, tokens, end, raw.ttl))
    messages = body.get("messages") or []
    web_search = any(
        isinstance(t, dict) and str(t.get("type") or "").startswith("web_search")
        for t in body.get("tools") or []
    )
    settings = Settings(
        speed=str(body.get("speed") or "standard"),
        toggles=f"web_search={web_search},citations={_citations(messages)}",
        tool_choice=canonical(body.get("tool_choice")),
        thinking=canonical(body.get("thinking")),
        images=_images(messages),
    )
    return Prompt(str(body.get("model")), tuple(blocks), settings)


# ------------------------------------------------------------------ the cache


@dataclass(slots=True)
class Entry:
    """What one breakpoint wrote: the prefix through ``position``, alive until ``expires``."""

    position: int
    tokens: int
    ttl: str
    tier: Tier
    written: float
    used: float
    """The last write or read."""
    expires: float
    writer: str
    """The message id of the response that wrote it."""


@dataclass(frozen=True, slots=True)
class Breakpoint:
    position: int
    tokens: int
    """Tokens from the start of the prompt through its block."""
    ttl: str
    counted: bool
    """Whether it reaches the model's minimum cacheable length (else it neither reads nor
    writes)."""


@dataclass(slots=True)
class Decision:
    """One request's cache outcome (the fake's own truth, logged as ``Exchange.cache``).

    ``hit`` is the furthest position read (None: nothing read); with C the last counted
    breakpoint and B the last 1-hour breakpoint after the hit, 1-hour writes are the
    tokens from the hit to B, 5-minute writes those from B to C, and ``uncached`` those
    after C. The three counters add up to ``prompt_tokens``.
    """

    prompt_tokens: int
    minimum: int
    breakpoints: tuple[Breakpoint, ...]
    hit: int | None
    read: int
    write_1h: int
    write_5m: int
    uncached: int
    written: tuple[int, ...]
    """The positions this request writes an entry at."""
    refreshed: tuple[int, ...]
    """The positions of the entries its read refreshed."""
    alive: int = 0
    """Entries alive once its writes were made (set by ``PromptCache.commit``)."""
    committed: bool = False
    _writes: list[tuple[str, Entry]] = field(default_factory=list, repr=False)

    @property
    def cached(self) -> int:
        """Tokens through the last counted breakpoint: read or written."""
        return self.read + self.write_1h + self.write_5m


def usage(d: Decision, output_tokens: int) -> dict[str, Any]:
    """The Messages API's ``usage`` for ``d`` (the body's, or ``message_start``'s)."""
    return {
        "input_tokens": d.uncached,
        "cache_creation_input_tokens": d.write_5m + d.write_1h,
        "cache_read_input_tokens": d.read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": d.write_5m,
            "ephemeral_1h_input_tokens": d.write_1h,
        },
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


class PromptCache:
    """Every entry the breakpoints wrote, per scope (model and API key), with their clocks.

    ``plan`` decides a request (reads and refreshes at once); ``commit`` makes its writes,
    called when its response begins, so a request that arrives before that does not see
    them. Safe to call from the tests' thread while the server's loop runs.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lookback = anthropic_lookback_blocks()
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(scope: str, prompt: Prompt, position: int) -> str:
        block = prompt.blocks[position]
        return _sha(scope, prompt.settings.tier_key(block.tier), block.chain)

    def _alive(self, key: str, now: float) -> Entry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and now < entry.expires else None

    def plan(self, prompt: Prompt, scope: str, minimum: int, *, read: bool = True) -> Decision:
        """Look ``prompt`` up: from each counted breakpoint, that position and earlier ones,
        at most ``lookback`` in all; the hit is the furthest found. ``read=False``: find
        nothing (the entries stay)."""
        blocks = prompt.blocks
        bps = tuple(
            Breakpoint(i, blocks[i].end, blocks[i].ttl or "", blocks[i].end >= minimum)
            for i in prompt.breakpoints
        )
        counted = [b.position for b in bps if b.counted]
        keys = [self.key(scope, prompt, i) for i in range(len(blocks))]
        with self._lock:
            now = self.clock()
            for k in [k for k, e in self._entries.items() if now >= e.expires]:
                del self._entries[k]
            hit: int | None = None
            for b in counted if read else []:
                for p in range(b, max(-1, b - self.lookback), -1):
                    if self._alive(keys[p], now) is not None:
                        hit = p if hit is None else max(hit, p)
                        break
            refreshed: list[int] = []
            if hit is not None:
                # the read prefix holds every entry on it: all of them stay warm
                for p in range(hit + 1):
                    entry = self._alive(keys[p], now)
                    if entry is not None:
                        entry.used = now
                        entry.expires = now + anthropic_ttl_seconds(entry.ttl)
                        refreshed.append(p)
        read_tokens = blocks[hit].end if hit is not None else 0
        after = [p for p in counted if hit is None or p > hit]
        one_hour = [p for p in after if blocks[p].ttl == "1h"]
        b_end = blocks[one_hour[-1]].end if one_hour else read_tokens
        c_end = blocks[after[-1]].end if after else read_tokens
        d = Decision(
            prompt_tokens=prompt.total,
            minimum=minimum,
            breakpoints=bps,
            hit=hit,
            read=read_tokens,
            write_1h=b_end - read_tokens,
            write_5m=c_end - b_end,
            uncached=prompt.total - c_end,
            written=tuple(after),
            refreshed=tuple(refreshed),
        )
        for p in after:
            ttl = blocks[p].ttl or ""
            entry = Entry(p, blocks[p].end, ttl, blocks[p].tier, 0.0, 0.0, 0.0, "")
            d._writes.append((keys[p], entry))
        return d

    def commit(self, d: Decision, writer: str) -> None:
        """Make ``d``'s writes: its response has begun, so later requests can read them."""
        with self._lock:
            now = self.clock()
            for key, entry in d._writes:
                ttl = anthropic_ttl_seconds(entry.ttl)
                self._entries[key] = replace(
                    entry, written=now, used=now, expires=now + ttl, writer=writer
                )
            d.alive = sum(1 for e in self._entries.values() if now < e.expires)
            d.committed = True

    def evict(self, position: int | None = None) -> int:
        """Drop every entry, or those at block ``position``; how many were dropped."""
        with self._lock:
            doomed = [k for k, e in self._entries.items() if position in (None, e.position)]
            for k in doomed:
                del self._entries[k]
            return len(doomed)

    def entries(self) -> list[Entry]:
        """Copies of the entries alive now, by position."""
        with self._lock:
            now = self.clock()
            alive = [replace(e) for e in self._entries.values() if now < e.expires]
        return sorted(alive, key=lambda e: (e.position, e.written))


# ------------------------------------------------------------------ diagnostics


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the diagnosis keeps of a request: hashes and token counts, never text."""

    scope: str
    model: str
    speed: str
    tools: tuple[tuple[str, int], ...]
    system: tuple[tuple[str, int], ...]
    messages: tuple[tuple[str, int], ...]
    others: str
    cached: int
    """Tokens through its last counted breakpoint (what it read or wrote)."""


def fingerprint(prompt: Prompt, scope: str, cached: int) -> Fingerprint:
    tiers: dict[str, list[tuple[str, int]]] = {"tools": [], "system": [], "messages": []}
    for b in prompt.blocks:
        tiers[b.tier].append((b.digest, b.tokens))
    return Fingerprint(
        scope=scope,
        model=prompt.model,
        speed=prompt.settings.speed,
        tools=tuple(tiers["tools"]),
        system=tuple(tiers["system"]),
        messages=tuple(tiers["messages"]),
        others=prompt.settings.others(),
        cached=cached,
    )


def _reason(kind: str, missed: int) -> dict[str, Any]:
    return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": max(0, missed)}}


def diagnose(
    prev: Fingerprint | None, cur: Fingerprint, depth: int | None = None
) -> dict[str, Any] | None:
    """The ``diagnostics`` object for ``cur`` against ``prev`` (None: the JSON ``null``,
    nothing diverged).

    The earliest divergence in prompt order is named: the model (or ``speed``), then the
    tools, the system blocks, and the messages (where only appending is no change).
    ``cache_missed_input_tokens`` is what ``prev`` cached beyond the blocks both share. A
    divergence at block ``depth`` or later, or a change only in another setting, is
    ``unavailable``; an unknown id (or another API key's) is ``previous_message_not_found``.
    """
    if prev is None or prev.scope != cur.scope:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if prev.model != cur.model or prev.speed != cur.speed:
        return _reason("model_changed", prev.cached)
    position = 0
    common = 0
    tiers = (
        ("tools_changed", prev.tools, cur.tools, False),
        ("system_changed", prev.system, cur.system, False),
        ("messages_changed", prev.messages, cur.messages, True),
    )
    for kind, old, new, appending in tiers:
        same = 0
        # Digests alone: the billing line's digest is constant while its length varies.
        while same < len(old) and same < len(new) and old[same][0] == new[same][0]:
            same += 1
        diverged = same < len(old) or (not appending and len(new) != len(old))
        if diverged:
            if depth is not None and position + same >= depth:
                return {"cache_miss_reason": {"type": "unavailable"}}
            common += sum(t for _, t in old[:same])
            return _reason(kind, prev.cached - common)
        position += len(old)
        common += sum(t for _, t in old)
    if prev.others != cur.others:
        return {"cache_miss_reason": {"type": "unavailable"}}
    return None


__all__ = [
    "Block",
    "Breakpoint",
    "Decision",
    "Entry",
    "Fingerprint",
    "Prompt",
    "PromptCache",
    "RequestError",
    "Settings",
    "Tier",
    "block_tokens",
    "canonical",
    "diagnose",
    "fingerprint",
    "parse_prompt",
    "strip_cache_control",
    "usage",
]
