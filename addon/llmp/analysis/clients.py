"""Telling clients apart: user-agent, then tool families (spec, §8 of the design).

A client's name is its user-agent, or, for a generic library's, the program name
the harness sends beside it (`identity.client_name`, R33).

Several harnesses built on one SDK send the same user-agent; their tool sets
tell them apart.  A tool set that is a subset or superset of a family's joins
it (a subagent, or tools that grow as MCP servers connect); any other starts a
new family.  Labels are only final at the end, so rows carry a client key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Family:
    names: set[str]
    last_used: int = 0
    widened: frozenset[str] | None = None
    """The tool set `widen` last found in `names` (names only grow)."""


@dataclass
class ClientRegistry:
    """Client keys, in order of first request, and their final labels."""

    keys: list[tuple[str | None, int | None]] = field(default_factory=list)
    _index: dict[tuple[str | None, int | None], int] = field(default_factory=dict)
    _families: dict[str | None, list[_Family]] = field(default_factory=dict)
    _clock: int = 0
    _last: tuple[str | None, frozenset[str], int] | None = None
    _agents: dict[str | None, str | None] = field(default_factory=dict)
    """The user-agent sent, for a client named otherwise (R33: `Kilo Code (python-httpx/…)`)."""

    def name(self, name: str | None, user_agent: str | None) -> None:
        """A client name that is not the user-agent it was sent with."""
        if name != user_agent:
            self._agents[name] = user_agent

    def family_for(self, ua: str | None, names: frozenset[str]) -> int | None:
        """The family a tool set belongs to under a user-agent; None without tools."""
        if not names:
            return None
        self._clock += 1
        last = self._last
        if last is not None and last[0] == ua and last[1] is names:
            fam = self._families[ua][last[2]]
            fam.last_used = self._clock
            return last[2]
        fams = self._families.setdefault(ua, [])
        best: int | None = None
        for i, f in enumerate(fams):
            if (names <= f.names or f.names <= names) and (
                best is None or f.last_used > fams[best].last_used
            ):
                best = i
        if best is None:
            fams.append(_Family(set(names)))
            best = len(fams) - 1
        else:
            fams[best].names |= names
        fams[best].last_used = self._clock
        self._last = (ua, names, best)
        return best

    def widen(self, ua: str | None, family: int | None, names: frozenset[str]) -> None:
        """A conversation of this family offered these tools too."""
        if family is None or not names:
            return
        fam = self._families[ua][family]
        if names is not fam.widened and not names <= fam.names:
            fam.names |= names
        fam.widened = names  # a harness resends the same tools (the same cached set)
        self._clock += 1
        fam.last_used = self._clock

    def key(self, ua: str | None, family: int | None) -> int:
        """The client key of (user-agent, family), created on first use."""
        k = (ua, family)
        idx = self._index.get(k)
        if idx is None:
            idx = self._index[k] = len(self.keys)
            self.keys.append(k)
        return idx

    def label(self, key: int) -> str:
        """`<user-agent>`, or `<user-agent> #n` when it has several tool families."""
        ua, family = self.keys[key]
        base = ua if ua is not None else "unknown"
        if family is not None and len(self._families.get(ua, ())) > 1:
            return f"{base} #{family + 1}"
        return base

    def labels(self) -> list[str]:
        return [self.label(k) for k in range(len(self.keys))]

    def user_agent(self, key: int) -> str | None:
        name = self.keys[key][0]
        return self._agents.get(name, name)
