"""A test-only mitmproxy script: the cloud providers' hosts answered by local fakes.

No test reaches api.anthropic.com or api.openai.com.  Loaded after the recorder
(`mitmdump -s addon/llmp_addon.py -s tests/support/redirect_addon.py`), it moves a
request for a provider's host to a fake on this machine in its `request` hook, after
the recorder's hooks have run: the recorder sees what it sees in use (the client
asked the provider's host, over TLS through the forward proxy), and only the last
hop goes elsewhere.  The map comes from the environment:

    LLMP_TEST_REDIRECT="api.anthropic.com=127.0.0.1:41234,api.openai.com=127.0.0.1:41235"

It is never part of llmp itself.
"""

from __future__ import annotations

import os

from mitmproxy import http

ENV = "LLMP_TEST_REDIRECT"


def _targets() -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for pair in os.environ.get(ENV, "").split(","):
        if "=" in pair:
            host, _, where = pair.partition("=")
            addr, _, port = where.rpartition(":")
            out[host.strip()] = (addr, int(port))
    return out


TARGETS = _targets()


def request(flow: http.HTTPFlow) -> None:
    target = TARGETS.get(flow.request.pretty_host)
    if target is not None and flow.response is None:
        flow.request.scheme = "http"
        flow.request.host, flow.request.port = target
