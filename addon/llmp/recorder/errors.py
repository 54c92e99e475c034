"""One place that turns mitmproxy's error strings into the five `error` values (R13).

mitmproxy's messages are not a stable API, so every pattern is matched here
and each case is provoked for real in the end-to-end tests.
"""

from __future__ import annotations

from llmp.format.schema import CLIENT_DISCONNECTED, TIMEOUT, UPSTREAM_RESET, UPSTREAM_UNREACHABLE

_UNREACHABLE = (
    "connect call failed",
    "connection refused",
    "errno 111",
    "name or service not known",
    "nodename nor servname",
    "getaddrinfo",
    "temporary failure in name resolution",
    "no route to host",
    "network is unreachable",
    "errno 113",
    "errno 101",
    "cannot open connection",
    "no hostname given",
)


def classify_error(message: str, *, response_started: bool, timed_out: bool = False) -> str:
    """Map mitmproxy's error message for a flow to one recording `error` value."""
    if timed_out:
        return TIMEOUT
    low = message.lower()
    if "client disconnected" in low:
        return CLIENT_DISCONNECTED
    if "timed out" in low or ("timeout" in low and not response_started):
        return TIMEOUT
    if not response_started and any(p in low for p in _UNREACHABLE):
        return UPSTREAM_UNREACHABLE
    # "server closed connection", "peer closed connection without sending
    # complete message body", protocol errors, kills at shutdown: the server
    # side failed before the response ended.
    return UPSTREAM_RESET
