"""Token counts at record time: each new message counted once by the upstream's tokenizer.

R18's `tokens` field (`{"messages": {hash: n}, "tools": {hash: n}}`, source
`tokenizer`) was filled only by `llmp analyze --tokenize`, which needs a full
recording.  Here the builder child, which holds the request body anyway, asks
the upstream's `/tokenize` for the messages and tools it has not counted
before, so a digest recording carries the server's own token counts too: counts
are not text, and digest mode keeps its promise.  Where in the prompt a change
begins (R31) is then known in the server's tokens.

It never stands in the client's way: it runs in the child, after the exchange
ended, and it fails softly.  An upstream without the endpoint is not asked
again; one that errs or is slow is left alone for a while; and a record it
cannot count is written without counts, never held back for long.  The
tokenizer client is `format.token_counts`'s, with no retries.

It asks only a server known to have `/tokenize` (R35), in that server's own
request shape (`tokenizer_shape`): llama-server (its `timings`, or `server:
llama.cpp`), vLLM (its `system_fingerprint`, its `created_cache_tokens`) and
SGLang (its usage behind uvicorn), each as the response that came back shows it.
Never a cloud provider (by the host the request went to, or a header only the
provider sends), never a server that looks like none of them: message text
goes nowhere the client did not send it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any
from urllib.parse import urlsplit

from llmp.apis.base import ChatApi
from llmp.apis.providers import provider_of
from llmp.apis.servers import identify
from llmp.format.token_counts import TokenizeError, Tokenizer

TIMEOUT = 2.0
"""Seconds one /tokenize call may take before the upstream is left alone for a while."""
PAUSE = 60.0
"""Seconds an upstream that failed or was slow is not asked."""
MAX_COUNTS = 100_000
"""Counts kept by (upstream, hash): a long session's messages, a few MB."""
MAX_NEW = 256
"""Messages and tools counted for one record at most (a first request of a long
conversation resent to a new proxy); the rest wait for the next record."""


def tokenizer_shape(
    upstream: str, api_name: str, headers: dict[str, str], top: dict[str, Any] | None
) -> str | None:
    """The `/tokenize` request shape of the server that answered, or None: not to be
    asked (R35).

    `upstream` is the base URL the request went to, `headers` the response's (names
    lower-case), `top` its body's top level (`choices` need not be there).
    """
    try:
        host = urlsplit(upstream).hostname
    except ValueError:
        return None
    if provider_of(host, headers) is not None:
        return None
    timings = top is not None and isinstance(top.get("timings"), dict)
    return identify(headers.get("server"), api_name, timings, top).tokenize


class RecordTokens:
    """Counts of messages and tools by hash, per upstream, asked once each."""

    shape = staticmethod(tokenizer_shape)

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self.timeout = timeout
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._clients: dict[tuple[str, str], Tokenizer] = {}
        self._paused: dict[str, float] = {}  # upstream -> monotonic time it may be asked again
        self._none: set[str] = set()  # upstreams without the endpoint

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _client(self, upstream: str, shape: str) -> Tokenizer | None:
        if upstream in self._none or self._paused.get(upstream, 0.0) > time.monotonic():
            return None
        client = self._clients.get((upstream, shape))
        if client is None:
            client = self._clients[(upstream, shape)] = Tokenizer(
                upstream, timeout=self.timeout, retries=0, backoff=0.0, pool=1, shape=shape
            )
        return client

    def counts(
        self, upstream: str, api: ChatApi, body: Any, shape: str | None
    ) -> dict[str, Any] | None:
        """The record's `tokens`, or None when the upstream cannot count (or not now).

        `shape`: the answering server's `/tokenize` request (`tokenizer_shape`); None
        asks nothing, and counts only what was counted before."""
        if not isinstance(body, dict):
            return None
        try:
            messages, tools = api.count_targets(body)
        except Exception:  # a body the API cannot read: no counts, the record still goes
            return None
        out: dict[str, Any] = {"messages": {}, "tools": {}}
        budget = MAX_NEW
        for part, targets in (("messages", messages), ("tools", tools)):
            for key, text in targets.items():
                n = self._counts.get((upstream, key))
                if n is None:
                    if budget <= 0:
                        return None
                    budget -= 1
                    n = self._count(upstream, text, shape)
                    if n is None:
                        return None
                    self._remember((upstream, key), n)
                else:
                    self._counts.move_to_end((upstream, key))
                out[part][key] = n
        return out

    def _count(self, upstream: str, text: str, shape: str | None) -> int | None:
        if not text:
            return 0
        client = self._client(upstream, shape) if shape is not None else None
        if client is None:
            return None
        try:
            return client.count(text)
        except TokenizeError as exc:
            if exc.missing:
                self._none.add(upstream)
            else:
                self._paused[upstream] = time.monotonic() + PAUSE
            return None
        except Exception:  # anything else the network does: leave the upstream alone a while
            self._paused[upstream] = time.monotonic() + PAUSE
            return None

    def _remember(self, key: tuple[str, str], n: int) -> None:
        self._counts[key] = n
        if len(self._counts) > MAX_COUNTS:
            self._counts.popitem(last=False)
