"""A report on the fake OpenAI API checked against the fake's own truth: the
`CacheDecision` it logged for each request (what it read, wrote and left for a later one).

The report's rows are the fake's `/v1/responses` requests in order (row `i` is the
`i`-th request), as in a recording of one client that sends nothing else there.
"""

from __future__ import annotations

import json
from typing import Any

from llmp.demo.fakes.exchange import Exchange
from llmp.demo.fakes.provider_cache import CacheDecision
from tests.support.upstreams import Upstream

PATH = "/v1/responses"


def posts(fake: Upstream) -> list[Exchange]:
    """The fake's `POST /v1/responses` exchanges, in order."""
    return [e for e in fake.log if e.method == "POST" and e.path.split("?")[0] == PATH]


def decisions(fake: Upstream) -> dict[int, CacheDecision]:
    """Each request's decision, by the id of its row."""
    truth = [e.cache for e in posts(fake)]
    assert all(isinstance(d, CacheDecision) for d in truth)
    return {i: d for i, d in enumerate(truth, 1) if isinstance(d, CacheDecision)}


def charged(rows: list[dict[str, Any]], fake: Upstream, granule: int) -> list[dict[str, Any]]:
    """Check each row against the fake's decision of its request, and give the rows
    charged a loss.  A row's counts are the fake's.  A turn's miss is what it did not
    read of what its linked turn left (`CacheDecision.reusable`): one of at least
    `granule` tokens is charged, exactly, and a smaller one not at all (no false loss and
    no missed one); a side-call or a turn compared with nothing is charged nothing."""
    decided = decisions(fake)
    assert [r["id"] for r in rows] == list(decided)
    out = []
    for row in rows:
        d = decided[row["id"]]
        assert row["cache_read_tokens"] == d.read, (row["id"], d)
        assert row["cache_write_tokens"] == d.written, (row["id"], d)
        assert row["uncached_tokens"] == d.uncached, (row["id"], d)
        loss = row["lost_client"] or row["lost_external"]
        linked = row["linked_to"]
        if row["kind"] != "turn" or linked is None:
            assert loss is None, (row["id"], loss)
            continue
        miss = decided[linked].reusable - d.read
        if miss >= granule:
            assert loss is not None and loss["tokens"] == miss, (row["id"], loss, miss)
            out.append(row)
        else:
            assert loss is None, (row["id"], loss, miss)
    return out


def response_ids(fake: Upstream) -> list[str]:
    """The ids of the responses the fake sent on `/v1/responses`, in order."""
    out = []
    for e in posts(fake):
        created = [json.loads(d) for d in e.sse_data() if '"response.created"' in d]
        out.append(created[0]["response"]["id"])
    return out


def diagnosed_against_linked(rows: list[dict[str, Any]], fake: Upstream) -> None:
    """Each turn llmp linked was compared by the provider (R37, `llmp_diagnose`) with the
    response of the turn llmp links it to."""
    ids = response_ids(fake)
    sent = posts(fake)
    assert len(sent) == len(rows)
    for row, e in zip(rows, sent, strict=True):
        asked = (e.request_json.get("prompt_cache_options") or {}).get("comparison_response_id")
        if row["kind"] == "turn" and row["linked_to"] is not None:
            assert asked == ids[row["linked_to"] - 1], (row["id"], asked)


__all__ = ["charged", "decisions", "diagnosed_against_linked", "posts", "response_ids"]
