"""The prompt cache under the fake cloud providers, with each request's decision as truth.

Pure: no HTTP and no wall clock of its own (``clock`` is injected), so the rules can be
tested directly and a fake's log can say what the cache really did.  The API modules
(``openai_api``, ``openrouter``) render a request into a ``Prompt`` (segments: tools,
instructions, one per message or content part), choose a ``Policy`` from the model's
generation (``llmp.apis.providers``) and ask ``ProviderCache.decide``.

Two kinds of policy:

- **automatic** (OpenAI before GPT-5.6): the whole prompt is kept, on the machine the
  request was routed to (a hash of the namespace, the first ``routing_prefix_tokens`` of
  the prompt and the ``prompt_cache_key``, modulo ``machines``); a later request reads
  the longest prefix it shares with an entry on that machine, reported in whole
  ``granule`` steps from ``minimum`` up (1024, 1152, …), and pays no write fee.  Above
  ``overflow_per_minute`` requests in a trailing minute for one route, the excess go to
  another machine, read nothing and store nothing (the overflow).
- **breakpoints** (OpenAI from GPT-5.6, Anthropic through a gateway): entries are written
  only at marked positions (``Segment.breakpoint``, the latest ``max_marked`` of them) and,
  with ``end_write``, at the end of the prompt; at least ``minimum`` tokens each.  A
  request reads the longest live entry that is a prefix of its prompt, exactly (no
  granule); the tokens from there to its furthest new entry are billed as written.
  There is one store for these (no machines, no overflow).

Entries live ``ttl_seconds[ttl]`` after their last write or read.  Entries are keyed by
the namespace (model and every setting that changes the prefix) and the cache key, so a
changed key never reads another key's entry, even on the same machine.  Expired and
evicted entries are remembered for a while, so a decision can say what was lost and why
(``CacheDecision.lost``).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmp.apis.providers import OPENAI, facts
from llmp.demo.fakes.model import common_prefix, count_tokens

Clock = Callable[[], float]

#: Entries kept per machine (automatic) or in the breakpoint store, oldest use dropped
#: first; far above what a test or a demo session writes, it only bounds memory.
MAX_ENTRIES = 4096
#: Removed entries remembered to explain a later miss.
GONE_KEPT = 4096
#: The window the overflow rate is counted over, in seconds.
RATE_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of a rendered prompt, tokenized on its own (ceil(chars/4)).

    ``breakpoint`` is the time-to-live name of a write the request marked at this
    segment's end (``prompt_cache_breakpoint``, ``cache_control``), or None."""

    text: str
    kind: str = "message"
    breakpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Mark:
    """A position in a prompt: its tokens and characters from the start."""

    tokens: int
    chars: int
    ttl: str


class Prompt:
    """A rendered prompt: its segments in order, their text and token positions."""

    def __init__(self, segments: Iterable[Segment]) -> None:
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.text = "".join(s.text for s in self.segments)
        self._chars: list[int] = []
        self._tokens: list[int] = []
        chars = tokens = 0
        for s in self.segments:
            chars += len(s.text)
            tokens += count_tokens(s.text)
            self._chars.append(chars)
            self._tokens.append(tokens)
        self.tokens = tokens

    def _segment(self, chars: int) -> int:
        """Index of the segment holding character ``chars`` (the one it ends, if any)."""
        return bisect.bisect_left(self._chars, chars)

    def tokens_at(self, chars: int) -> int:
        """Whole tokens within the first ``chars`` characters."""
        if chars <= 0:
            return 0
        i = self._segment(chars)
        if i >= len(self._chars):
            return self.tokens
        start_c = self._chars[i - 1] if i else 0
        start_t = self._tokens[i - 1] if i else 0
        if chars == self._chars[i]:
            return self._tokens[i]
        return start_t + (chars - start_c) // 4

    def chars_at(self, tokens: int) -> int:
        """The characters of the first ``tokens`` tokens (all of them when fewer)."""
        if tokens >= self.tokens:
            return len(self.text)
        i = bisect.bisect_right(self._tokens, tokens)
        start_c = self._chars[i - 1] if i else 0
        start_t = self._tokens[i - 1] if i else 0
        end_c = self._chars[i]
        return min(end_c, start_c + (tokens - start_t) * 4)

    def segment_index(self, chars: int) -> int:
        """The segment the character at offset ``chars`` belongs to."""
        return bisect.bisect_right(self._chars, chars)

    def marks(self) -> list[Mark]:
        """The breakpoints the request marked, in order."""
        out: list[Mark] = []
        for s, c, t in zip(self.segments, self._chars, self._tokens, strict=True):
            if s.breakpoint is not None:
                out.append(Mark(t, c, s.breakpoint))
        return out


@dataclass(frozen=True, slots=True)
class Policy:
    """How one request may use the cache: its model's generation and its own options."""

    automatic: bool
    minimum: int
    granule: int
    ttl: str
    """The request's time-to-live name (a retention, or a ttl such as ``30m``)."""
    ttl_seconds: Mapping[str, int]
    end_write: bool = False
    """Write an entry at the end of the prompt (GPT-5.6's implicit mode)."""
    max_marked: int = 0
    """How many of the latest marked breakpoints are written."""


@dataclass
class Entry:
    """One cached prefix."""

    model: str
    namespace: str
    key: str
    text: str
    tokens: int
    ttl: str
    ttl_s: int
    last_used: float
    machine: int | None

    def alive(self, now: float) -> bool:
        return now - self.last_used <= self.ttl_s


@dataclass
class CacheDecision:
    """What the cache did for one request: the fake's own truth, logged on its ``Exchange``.

    ``read`` is what the usage reports as cached (rounded to the granule),
    ``matched`` the exact prefix found; ``written`` the tokens billed as cache writes
    (``written_by_ttl`` split by time-to-live); ``uncached`` the rest of the prompt.
    ``lost`` names why a longer prefix the cache once had was not read
    (``overflow``, ``expired``, ``evicted``, ``rerouted``: on another machine), with the
    tokens it would have given (``lost_tokens``)."""

    generation: str
    namespace: str
    key: str
    route: str
    machine: int | None
    overflow: bool
    prompt_tokens: int
    read: int = 0
    matched: int = 0
    written: int = 0
    written_by_ttl: dict[str, int] = field(default_factory=dict)
    writes: list[tuple[int, str]] = field(default_factory=list)
    """Entries this request wrote: (tokens, ttl)."""
    refreshed: list[int] = field(default_factory=list)
    """Entries at marked positions that existed and were kept alive (tokens)."""
    stored: int = 0
    """Automatic: the tokens kept for later requests (the prompt, if long enough)."""
    lost: str | None = None
    lost_tokens: int = 0
    t: float = 0.0
    backend: str | None = None
    """Gateways: the backend (provider) the request went to."""
    diagnosis: dict[str, object] | None = None
    """The ``prompt_cache_diagnostics`` answered, when one was asked."""
    processing_ms: int = 0

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.read - self.written

    @property
    def reusable(self) -> int:
        """The prefix this request leaves for a later one to read."""
        if self.generation == "automatic":
            return self.stored
        return max([self.matched, *(t for t, _ in self.writes), *self.refreshed])


class ManualClock:
    """A clock a test moves by hand: ``clock.advance(301)``."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ProviderCache:
    """One provider's prompt cache: machines for the automatic generation, one store for
    breakpoints, the overflow counter, and the controls a test needs."""

    def __init__(
        self,
        *,
        machines: int = 4,
        clock: Clock = time.time,
        routing_prefix_tokens: int | None = None,
        overflow_per_minute: int | None = None,
    ) -> None:
        o = facts()[OPENAI]
        if machines < 1:
            raise ValueError("machines must be at least 1")
        self.clock = clock
        self.routing_prefix_tokens: int = (
            o["routing_prefix_tokens"] if routing_prefix_tokens is None else routing_prefix_tokens
        )
        self.overflow_per_minute: int = (
            o["overflow_per_minute"] if overflow_per_minute is None else overflow_per_minute
        )
        self._machines = machines
        self._lock = threading.Lock()
        self._auto: dict[int, list[Entry]] = {}
        self._marked: list[Entry] = []
        self._gone: deque[tuple[Entry, str]] = deque(maxlen=GONE_KEPT)
        self._rate: dict[str, deque[float]] = {}
        self._forced_overflow = 0
        self._overflow_turn = 0

    # controls ------------------------------------------------------------------

    @property
    def machines(self) -> int:
        return self._machines

    def set_machines(self, n: int) -> None:
        """Route over ``n`` machines from now on; machines beyond ``n`` lose their entries."""
        if n < 1:
            raise ValueError("machines must be at least 1")
        with self._lock:
            for m in [m for m in self._auto if m >= n]:
                for e in self._auto.pop(m):
                    self._gone.append((e, "evicted"))
            self._machines = n

    def force_overflow(self, n: int = 1) -> None:
        """The next ``n`` automatic-generation requests overflow (go elsewhere and miss)."""
        with self._lock:
            self._forced_overflow += n

    def evict(
        self,
        *,
        model: str | None = None,
        key: str | None = None,
        machine: int | None = None,
    ) -> int:
        """Drop entries (all, or those of a model, a cache key or a machine); how many."""

        def hit(e: Entry) -> bool:
            return (
                (model is None or e.model == model)
                and (key is None or e.key == key)
                and (machine is None or e.machine == machine)
            )

        with self._lock:
            n = 0
            for m, entries in self._auto.items():
                keep = [e for e in entries if not hit(e)]
                for e in entries:
                    if hit(e):
                        self._gone.append((e, "evicted"))
                n += len(entries) - len(keep)
                self._auto[m] = keep
            keep = [e for e in self._marked if not hit(e)]
            for e in self._marked:
                if hit(e):
                    self._gone.append((e, "evicted"))
            n += len(self._marked) - len(keep)
            self._marked = keep
            return n

    def entries(self) -> list[Entry]:
        """Every live entry (a copy of the list, for tests)."""
        with self._lock:
            self._expire(self.clock())
            return [e for m in sorted(self._auto) for e in self._auto[m]] + list(self._marked)

    # the decision --------------------------------------------------------------------

    def route(self, prompt: Prompt, namespace: str, key: str) -> str:
        """The routing hash: the namespace, the prompt's first tokens and the cache key."""
        head = prompt.text[: prompt.chars_at(self.routing_prefix_tokens)]
        h = hashlib.sha256("\0".join((namespace, key, head)).encode()).hexdigest()
        return h[:16]

    def decide(
        self,
        prompt: Prompt,
        model: str,
        namespace: str,
        key: str | None,
        policy: Policy,
        *,
        overflow: bool = False,
        cold: bool = False,
    ) -> CacheDecision:
        """Read, write and report for one request. ``namespace`` holds the model and every
        setting that changes the prefix; ``overflow`` forces this one over the rate;
        ``cold`` reads nothing (the ``cache_miss`` mode)."""
        k = key or ""
        with self._lock:
            now = self.clock()
            self._expire(now)
            route = self.route(prompt, namespace, k)
            if policy.automatic:
                return self._automatic(
                    prompt, model, namespace, k, route, policy, now, overflow, cold
                )
            return self._breakpoints(prompt, model, namespace, k, route, policy, now, cold)

    def _automatic(
        self,
        prompt: Prompt,
        model: str,
        ns: str,
        key: str,
        route: str,
        policy: Policy,
        now: float,
        overflow: bool,
        cold: bool,
    ) -> CacheDecision:
        home = int(route, 16) % self._machines
        if len(self._rate) > MAX_ENTRIES:  # forget routes idle for a whole window
            for r in [r for r, q in self._rate.items() if not q or now - q[-1] >= RATE_WINDOW_S]:
                del self._rate[r]
        stamps = self._rate.setdefault(route, deque())
        while stamps and now - stamps[0] >= RATE_WINDOW_S:
            stamps.popleft()
        stamps.append(now)
        if self._forced_overflow > 0:
            self._forced_overflow -= 1
            overflow = True
        overflow = overflow or len(stamps) > self.overflow_per_minute
        d = CacheDecision("automatic", ns, key, route, home, overflow, prompt.tokens, t=now)
        entries = self._auto.setdefault(home, [])
        best, best_entry = self._longest(prompt, entries, ns, key)
        if overflow:
            if self._machines > 1:
                self._overflow_turn += 1
                d.machine = (home + 1 + (self._overflow_turn - 1) % (self._machines - 1)) % (
                    self._machines
                )
            if best >= policy.minimum:
                d.lost, d.lost_tokens = "overflow", best
            return d
        if not cold and best >= policy.minimum:
            d.matched = best
            d.read = best // policy.granule * policy.granule
            assert best_entry is not None
            best_entry.last_used = now
            best_entry.ttl, best_entry.ttl_s = policy.ttl, policy.ttl_seconds[policy.ttl]
        self._explain(d, prompt, ns, key, home)
        if prompt.tokens >= policy.minimum:
            kept = [e for e in entries if not _covers(prompt.text, e, ns, key)]
            kept.append(
                Entry(
                    model,
                    ns,
                    key,
                    prompt.text,
                    prompt.tokens,
                    policy.ttl,
                    policy.ttl_seconds[policy.ttl],
                    now,
                    home,
                )
            )
            self._auto[home] = _bounded(kept)
            d.stored = prompt.tokens
        return d

    def _breakpoints(
        self,
        prompt: Prompt,
        model: str,
        ns: str,
        key: str,
        route: str,
        policy: Policy,
        now: float,
        cold: bool,
    ) -> CacheDecision:
        d = CacheDecision("breakpoints", ns, key, route, None, False, prompt.tokens, t=now)
        marks = prompt.marks()[-policy.max_marked :] if policy.max_marked else []
        if policy.end_write and prompt.tokens:
            marks.append(Mark(prompt.tokens, len(prompt.text), policy.ttl))
        if not marks:
            return d  # nothing marked and no implicit write: the request does not use the cache
        if not cold:
            best, best_entry = 0, None
            for e in self._marked:
                if e.namespace == ns and e.key == key and prompt.text.startswith(e.text):
                    n = prompt.tokens_at(len(e.text))
                    if n > best:
                        best, best_entry = n, e
            if best_entry is not None:
                best_entry.last_used = now
                d.matched = d.read = best
        self._explain(d, prompt, ns, key, None)
        by_chars: dict[int, Mark] = {}
        for m in marks:
            old = by_chars.get(m.chars)
            if old is None or policy.ttl_seconds[m.ttl] > policy.ttl_seconds[old.ttl]:
                by_chars[m.chars] = m
        new: list[Mark] = []
        for m in sorted(by_chars.values(), key=lambda m: m.chars):
            if m.tokens < policy.minimum:
                continue
            text = prompt.text[: m.chars]
            existing = next(
                (e for e in self._marked if e.namespace == ns and e.key == key and e.text == text),
                None,
            )
            if existing is not None and not cold:
                existing.last_used = now
                d.refreshed.append(m.tokens)
                continue
            if existing is not None:
                self._marked.remove(existing)
            ttl_s = policy.ttl_seconds[m.ttl]
            self._marked.append(Entry(model, ns, key, text, m.tokens, m.ttl, ttl_s, now, None))
            new.append(m)
        self._marked = _bounded(self._marked)
        prev = d.read
        for m in new:
            d.writes.append((m.tokens, m.ttl))
            if m.tokens > prev:
                d.written_by_ttl[m.ttl] = d.written_by_ttl.get(m.ttl, 0) + m.tokens - prev
                prev = m.tokens
        d.written = sum(d.written_by_ttl.values())
        return d

    # helpers -----------------------------------------------------------------------

    @staticmethod
    def _longest(
        prompt: Prompt, entries: Sequence[Entry], ns: str, key: str
    ) -> tuple[int, Entry | None]:
        best, best_entry = 0, None
        for e in entries:
            if e.namespace == ns and e.key == key:
                n = prompt.tokens_at(common_prefix(e.text, prompt.text))
                if n > best:
                    best, best_entry = n, e
        return best, best_entry

    def _explain(
        self, d: CacheDecision, prompt: Prompt, ns: str, key: str, home: int | None
    ) -> None:
        """Name why a longer prefix the cache once held (or holds elsewhere) was not read."""
        candidates: list[tuple[Entry, str]] = list(self._gone)
        if home is not None:
            for m, entries in self._auto.items():
                if m != home:
                    candidates += [(e, "rerouted") for e in entries]
        for e, why in candidates:
            if e.namespace != ns or e.key != key or (home is not None) != (e.machine is not None):
                continue
            if home is None:
                n = prompt.tokens_at(len(e.text)) if prompt.text.startswith(e.text) else 0
            else:
                n = prompt.tokens_at(common_prefix(e.text, prompt.text))
            if n > max(d.matched, d.lost_tokens):
                d.lost, d.lost_tokens = why, n

    def _expire(self, now: float) -> None:
        for m, entries in self._auto.items():
            if any(not e.alive(now) for e in entries):
                self._gone.extend((e, "expired") for e in entries if not e.alive(now))
                self._auto[m] = [e for e in entries if e.alive(now)]
        if any(not e.alive(now) for e in self._marked):
            self._gone.extend((e, "expired") for e in self._marked if not e.alive(now))
            self._marked = [e for e in self._marked if e.alive(now)]


def _covers(text: str, e: Entry, ns: str, key: str) -> bool:
    """Whether a new prompt ``text`` holds entry ``e`` whole (it replaces it)."""
    return e.namespace == ns and e.key == key and text.startswith(e.text)


def _bounded(entries: list[Entry]) -> list[Entry]:
    if len(entries) <= MAX_ENTRIES:
        return entries
    return sorted(entries, key=lambda e: e.last_used)[-MAX_ENTRIES:]
