"""A harness through OpenRouter (a gateway that passes the provider's cache through),
explained and priced, end to end: the real `openai` SDK to `https://openrouter.ai/api/v1`
through the real mitmdump, answered by the fake OpenRouter, whose backends keep OpenAI's
and Anthropic's cache rules and whose log keeps each request's `CacheDecision`.

OpenRouter's usage carries `cached_tokens`, `cache_write_tokens`, its own `cost` and
`cache_discount` (what the cache saved, negative where Anthropic's writes outweigh the
reads): the rows' split is the backend's own, and llmp's cost agrees with OpenRouter's
own accounting.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmp.demo.fakes import OpenRouter
from tests.support.adds_up import problems
from tests.support.mitm import Mitmdump, read_records
from tests.support.openai_session import CHAT, GPT_5, GptSession, decisions
from tests.support.provider_session import openai_client, recorder, report, text
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

BASE_URL = "https://openrouter.ai/api/v1"
# Per million tokens: OpenAI's gpt-5 and Anthropic's Sonnet 4.5 as OpenRouter lists them
# (the makers' own prices, wire-formats.md and OpenAI's price page).
PRICES = {"openai/gpt-5": (GPT_5["default"].input, GPT_5["default"].output)}
PRICES["anthropic/claude-sonnet-4.5"] = (3.0, 15.0)


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("openrouter") as up:
        yield up


def router(md: Mitmdump) -> openai.OpenAI:
    return openai_client(md, base_url=BASE_URL)


def priced(fake: Upstream, model: str) -> None:
    """The fake bills at one price for every model: the model's own, from now on."""
    app = OpenRouter.of(fake)
    app.input_usd_per_mtok, app.output_usd_per_mtok = PRICES[model]


def usage_of(record: dict[str, Any]) -> dict[str, Any]:
    """OpenRouter's `usage` as the recording kept it (digest mode keeps the counters)."""
    kept = record["response"]["digest"]["usage"]["usage"]
    assert isinstance(kept, dict)
    return kept


def loss_of(row: dict[str, Any]) -> dict[str, Any] | None:
    return row["lost_client"] or row["lost_external"]


def test_the_gateways_counts_and_money(fake: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = router(md)
        priced(fake, "openai/gpt-5")
        gpt = GptSession(client, CHAT, model="openai/gpt-5", key="conv-gpt", seed="gpt")
        gpt.gateway = {"session_id": "conv-gpt"}
        gpt.turn(text(120, "gpt one"))
        gpt.stream = True
        gpt.turn(text(120, "gpt two"))
        gpt.key = "conv-gpt-again"
        gpt.turn(text(120, "gpt three: another prompt_cache_key"))
        priced(fake, "anthropic/claude-sonnet-4.5")
        claude = GptSession(
            client, CHAT, model="anthropic/claude-sonnet-4.5", key=None, seed="claude"
        )
        claude.gateway = {"session_id": "conv-claude", "cache_control": {"type": "ephemeral"}}
        claude.turn(text(120, "claude one"))
        claude.turn(text(120, "claude two"))
        claude.tools = claude.tools[:2]
        claude.turn(text(120, "claude three: a tool less"))
        rep = report(rec, 6)
    d = decisions(fake)
    records = read_records(rec)
    rows = rep["rows"]
    assert [r["server"] for r in rows] == ["openrouter"] * 6
    assert {r["request"]["upstream"] for r in records} == {"openrouter.ai"}
    for row, dec, record in zip(rows, d, records, strict=True):
        u = usage_of(record)
        details = u["prompt_tokens_details"]
        # The split is the backend's own, as OpenRouter passed it through.
        assert row["cache_read_tokens"] == dec.read == details["cached_tokens"], row["id"]
        assert row["cache_write_tokens"] == dec.written == details["cache_write_tokens"]
        assert row["uncached_tokens"] == dec.uncached
        # llmp's cost is OpenRouter's own bill, and with the cache's discount added back
        # it is every token at the full price: the discount is what the cache saved.
        assert row["cost_usd"] == pytest.approx(u["cost"], rel=0.02), row["id"]
        inp, out = PRICES[row["model"]]
        full = (u["prompt_tokens"] * inp + u["completion_tokens"] * out) / 1e6
        assert row["cost_usd"] + u["cache_discount"] == pytest.approx(full, rel=0.02)
    assert d[3].written > 0 and usage_of(records[3])["cache_discount"] < 0  # a write costs
    assert d[1].read > 0 and usage_of(records[1])["cache_discount"] > 0  # a read saves
    by = {r["id"]: r for r in rows}
    expect = {3: "cache_key_changed", 6: "tools_changed"}
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in expect:
            assert loss is not None and loss["cause"] == expect[rid], rid
            linked = row["linked_to"]
            assert loss["tokens"] == d[linked - 1].reusable - d[rid - 1].read, rid
        else:
            assert loss is None, (rid, loss)
    assert rep["cost"]["unpriced_models"] == []
    assert problems(rep) == []


def test_one_key_for_the_whole_account_caps_the_hit_rate(fake: Upstream, tmp_path: Path) -> None:
    """A gateway that sends every conversation with one `prompt_cache_key` (and one
    session): above 15 requests a minute on one prompt start and key, OpenAI's overflow
    sends the rest to machines that miss.  The report names the busiest minute and how
    many of its requests read the cache, and the fix is a stable key per conversation."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = router(md)
        sessions = []
        for i in range(10):
            s = GptSession(client, CHAT, model="openai/gpt-5", key="the-account", seed="same")
            s.gateway = {"session_id": "the-account"}
            s.turn(text(120, f"conversation {i}"))
            sessions.append(s)
        for i, s in enumerate(sessions):
            s.turn(text(120, f"conversation {i}, go on"))
        rep = report(rec, 20)
    d = decisions(fake)
    assert len({x.backend for x in d}) == 1  # one session: one backend
    over = [i + 1 for i, x in enumerate(d) if x.overflow]
    assert over == [16, 17, 18, 19, 20]
    by = {r["id"]: r for r in rep["rows"]}
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in over:
            assert loss is not None and loss["cause"] == "provider_evicted", rid
            assert loss["tokens"] == d[rid - 11].reusable - d[rid - 1].read
        else:
            assert loss is None, (rid, loss)
    hits = [r["cache_read_tokens"] > 0 for r in rep["rows"]]
    assert sum(hits) == 14  # of 20 in the minute: the first wrote, 5 overflowed
    (f,) = [f for f in rep["findings"] if f["kind"] == "provider_evicted"]
    ev = f["evidence"]
    assert f["rows"] == over and ev["provider"] == "openai"
    assert ev["overflow"] == 5 and ev["per_minute"] == 20 and ev["read_per_minute"] == 14
    advice = ev["advice"]["text"]
    assert "its own prompt_cache_key (a stable one per conversation" in advice
    assert "not one for a whole account" in advice
    assert problems(rep) == []
