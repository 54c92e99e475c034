"""What a harness says about itself in its request headers (R32, R33).

The recorder keeps a few identity headers: names verbatim, session values
hashed.  What the harness says wins over what the analysis guesses: two
requests with different values of the same session header are never one
conversation, a request the SDK marks as a retry follows the request it
retried, and a generic HTTP library's user-agent is labelled by the program
name the harness sends beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmp.format.schema import SESSION_HEADERS

SEPARATING_HEADERS = tuple(h for h in SESSION_HEADERS if h != "x-codex-window-id")
"""The session headers whose values tell conversations apart.  Not Codex's
`x-codex-window-id`: it names a context window of its session and changes after a
compaction, within one conversation (the `codex-3` capture: `…:0`, then `…:1`)."""

NAME_HEADERS = ("x-title", "originator")
"""The program name a harness sends, first found wins (R33)."""

GENERIC_AGENTS = (
    "python-httpx/",
    "python-requests/",
    "aiohttp/",
    "openai/",
    "anthropic/",
    "async openai/",
    "async anthropic/",
    "node-fetch",
    "node",
    "undici",
    "axios/",
    "bun/",
    "deno/",
    "got ",
    "okhttp/",
    "go-http-client/",
    "curl/",
    "reqwest/",
    "java-http-client/",
)
"""User-agent starts (lower-cased) of HTTP libraries and SDKs many programs share:
they say how a request was sent, not which program sent it."""

Sessions = tuple[tuple[str, str], ...]
NO_SESSIONS: Sessions = ()


def is_generic(ua: str) -> bool:
    """Whether a user-agent names a library, not a program."""
    return ua.lower().startswith(GENERIC_AGENTS)


def client_name(ua: str | None, headers: Mapping[str, Any] | None) -> str | None:
    """The name a client is known by: its user-agent, or for a generic one the program
    name sent beside it, `Kilo Code (python-httpx/0.28.1)` (R33)."""
    if headers is None or (ua is not None and not is_generic(ua)):
        return ua
    for name in NAME_HEADERS:
        value = headers.get(name)
        if type(value) is str and value.strip():
            title = value.strip()
            return f"{title} ({ua})" if ua is not None else title
    return ua


def sessions_of(headers: Mapping[str, Any] | None) -> Sessions:
    """The separating session headers sent, as (name, value) pairs in a fixed order."""
    if not headers:
        return NO_SESSIONS
    return tuple(
        (name, value)
        for name in SEPARATING_HEADERS
        if type(value := headers.get(name)) is str and value
    )


def is_retry(headers: Mapping[str, Any] | None) -> bool:
    """`x-stainless-retry-count` above 0: the SDK sends this request again (R33)."""
    value = headers.get("x-stainless-retry-count") if headers else None
    if type(value) is not str:
        return False
    try:
        return int(value.strip()) > 0
    except ValueError:
        return False


def conflicts(a: Sessions, b: Sessions) -> bool:
    """Whether two requests sent different values of the same session header: then
    they are never turns of one conversation.  One shared value does not make them
    one (a subagent may send its parent's)."""
    if not a or not b:
        return False
    if a == b:
        return False
    mine = dict(a)
    return any(name in mine and mine[name] != value for name, value in b)
