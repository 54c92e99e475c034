"""Claude Code's traffic on Anthropic's API, explained and priced (R34-R38), end to end.

The real `anthropic` SDK sends Claude Code's request shape to `api.anthropic.com` through
the real mitmdump (forward mode, as `llmp run -- claude` records it); the fake Anthropic
API answers with the documented cache rules and keeps its own truth of each request
(`Exchange.cache`: what it read, wrote and left).  Every verdict is checked against that
truth, every cost against Anthropic's documented arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmp.demo.fakes import Decision
from tests.support.adds_up import problems
from tests.support.provider_session import (
    CC_1H,
    SONNET_45,
    ClaudeSession,
    anthropic_cost,
    claude_client,
    recorder,
    report,
    text,
)
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("anthropic-api") as up:
        yield up


def decisions(fake: Upstream) -> list[Decision]:
    """The fake's own cache decision of each /v1/messages request, in order."""
    out = [e.cache for e in fake.log if e.path.split("?")[0] == "/v1/messages"]
    return [d for d in out if isinstance(d, Decision)]


def rows(rep: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in rep["rows"]}


def loss_of(row: dict[str, Any]) -> dict[str, Any] | None:
    return row["lost_client"] or row["lost_external"]


def test_a_clean_session_loses_nothing_and_costs_what_anthropic_bills(
    fake: Upstream, tmp_path: Path
) -> None:
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = claude_client(md)
        s = ClaudeSession(client)
        usages = [s.turn("read calc.py").usage, s.turn("and the tests?").usage]
        # A title side-call in between (another system prompt, no tools): on a provider
        # it evicts nothing, and nothing is blamed on it.
        side = client.messages.create(
            model="claude-haiku-4-5",
            max_tokens=16,
            system="Write a five-word title for this conversation.",
            messages=[{"role": "user", "content": "read calc.py"}],
        )
        usages += [side.usage]
        # And another conversation, with its own system prompt and tools: the same.
        usages += [ClaudeSession(client, seed="other").turn("another task").usage]
        usages += [s.turn("now fix it").usage, s.turn("run them").usage]
        rep = report(rec, 6)
    d = decisions(fake)
    by = rows(rep)
    assert [r["server"] for r in rep["rows"]] == ["anthropic"] * 6
    turns = [r for r in rep["rows"] if r["kind"] == "turn"]
    assert len(turns) == 5 and len({r["conversation"] for r in turns}) == 2
    assert by[5]["linked_to"] == 2 and by[6]["linked_to"] == 5
    assert all(loss_of(r) is None for r in rep["rows"])
    assert rep["time"]["lost_tokens"] == 0
    assert rep["time"]["by_cause"] == {}
    # Only the last turns' writes were still unread when the recording ended: said so, at
    # low confidence (a later turn might have read them).
    (unread,) = rep["findings"]
    assert unread["kind"] == "unread_cache_writes" and unread["rows"] == [4, 6]
    assert unread["evidence"]["unread_at_end"] == 2 and unread["confidence"] == "low"
    # The row's split is the provider's own, to the token.
    for i, (row, dec) in enumerate(zip(rep["rows"], d, strict=True)):
        assert row["cache_read_tokens"] == dec.read, i
        assert row["cache_write_tokens"] == dec.write_5m + dec.write_1h, i
        assert row["uncached_tokens"] == dec.uncached, i
    # Each clean turn read all its linked turn left cached.
    assert d[1].read == d[0].cached and d[4].read == d[1].cached and d[5].read == d[4].cached
    # Cost: each row within 2 % of Anthropic's arithmetic at the documented prices.
    for row, usage in zip(rep["rows"], usages, strict=True):
        if row["model"].startswith("claude-sonnet-4-5"):
            want = anthropic_cost(usage, SONNET_45)
            assert row["cost_usd"] == pytest.approx(want, rel=0.02)
    cost = rep["cost"]
    assert cost["total_usd"] == pytest.approx(sum(r["cost_usd"] for r in by.values()), abs=1e-6)
    assert cost["lost_usd"] == 0 and cost["unpriced_models"] == []
    assert cost["unread_write_usd"] == pytest.approx(unread["evidence"]["usd"])
    assert cost["prices"].startswith("genai-prices ")
    assert rep["provider_agreement"] is None  # no diagnosis was asked or sent
    assert problems(rep) == []
    assert b"quick brown fox" not in rec.read_bytes()  # digest mode: no text
    assert b"sk-ant-test-secret" not in rec.read_bytes()


def test_each_client_change_is_charged_to_its_tier(fake: Upstream, tmp_path: Path) -> None:
    """One session, each change made after a clean turn: the miss is the provider's own
    shortfall (what the linked turn left cached, less what this one read), charged to the
    change's tier; Claude Code's billing line alone is no change on Anthropic (R35)."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        s = ClaudeSession(claude_client(md))
        s.turn("one")
        s.turn("two")
        s.tools = [*s.tools[:1], {**s.tools[1], "description": "changed"}, *s.tools[2:]]
        s.turn("three: tools changed")
        s.turn("four")
        s.instructions += " Also: be brief."
        s.turn("five: system changed")
        s.turn("six")
        s.extra = {"tool_choice": {"type": "any"}}
        s.turn("seven: tool_choice changed")
        s.turn("eight")
        s.messages[0]["content"][0]["text"] = "one, edited"
        s.turn("nine: history rewritten")
        s.billing = s.billing.replace("7c2", "d41")
        s.turn("ten: the billing line changed")
        s.model = "claude-sonnet-5"
        s.turn("eleven: another model")
        rep = report(rec, 11)
    d = decisions(fake)
    by = rows(rep)
    expect = {
        3: "tools_changed",
        5: "system_changed",
        7: "settings_changed",
        9: "history_rewritten",
        11: "model_changed",
    }
    assert len({r["conversation"] for r in rep["rows"]}) == 1
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in expect:
            assert loss is not None and row["lost_client"] is loss, rid
            assert loss["cause"] == expect[rid] and row["break_cause"] == expect[rid]
            # The provider's own shortfall, to the token.
            assert loss["tokens"] == d[rid - 2].cached - d[rid - 1].read, rid
            assert loss["usd"] is not None and loss["usd"] > 0
        else:
            assert loss is None, (rid, loss)
    assert d[9].read == d[8].cached  # the billing line changed: the API read it all
    kinds = {f["evidence"]["break_cause"] for f in rep["findings"] if f["kind"] == "prefix_break"}
    assert kinds == set(expect.values())
    # No local-server advice on a provider: no slots, no attribution header.
    text_of_findings = str(rep["findings"])
    assert "-np" not in text_of_findings and "ATTRIBUTION_HEADER" not in text_of_findings
    assert problems(rep) == []


def test_a_breakpoint_too_far_from_the_last_entry(fake: Upstream, tmp_path: Path) -> None:
    """The prompt is the same, but every breakpoint lies 20 or more blocks past the last
    entry: the lookback never reaches it (R35), and the client placed its breakpoints."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        s = ClaudeSession(claude_client(md))
        s.turn("one")
        many = [{"type": "text", "text": text(30, f"part {i}")} for i in range(24)]
        s.turn(many)  # the only breakpoint after the last entry is 24 blocks on
        rep = report(rec, 2)
    d = decisions(fake)
    row = rows(rep)[2]
    assert d[1].read < d[0].cached  # the fake read only the system entries
    loss = row["lost_client"]
    assert loss["cause"] == "breakpoint_too_far" and row["break_cause"] is None
    assert loss["tokens"] == d[0].cached - d[1].read
    (f,) = [f for f in rep["findings"] if f["kind"] == "breakpoint_too_far"]
    assert f["rows"] == [2] and f["evidence"]["lookback_blocks"] == 20
    assert f["evidence"]["distance"] >= 20
    assert problems(rep) == []


def test_the_providers_own_eviction(fake: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        s = ClaudeSession(claude_client(md))
        s.turn("one")
        s.turn("two")
        s.turn("three", fake="evict")
        s.turn("four")
        rep = report(rec, 4)
    d = decisions(fake)
    row = rows(rep)[3]
    loss = row["lost_external"]
    assert loss["cause"] == "provider_evicted" and row["cause"] == "server_reset"
    assert loss["tokens"] == d[1].cached - d[2].read and d[2].read == 0
    (f,) = [f for f in rep["findings"] if f["kind"] == "provider_evicted"]
    assert f["rows"] == [3] and f["lost_usd"] == pytest.approx(loss["usd"])
    assert all(loss_of(r) is None for r in rep["rows"] if r["id"] != 3)
    assert problems(rep) == []


def test_money_a_client_could_keep(fake: Upstream, tmp_path: Path) -> None:
    """Not losses: below the minimum nothing is cached; without a breakpoint nothing is
    asked; a 1-hour write no request read was paid for above the input price."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = claude_client(md, ua="a-harness/1.0")
        short = ClaudeSession(client, system_tokens=100, tools=0, seed="short")
        for i in range(3):
            short.turn(f"short {i}")
        bare = ClaudeSession(client, system_tokens=1500, tools=0, seed="bare")
        bare.ttl = None
        for i in range(3):
            body = bare.body(f"bare {i}")
            body["system"] = [{"type": "text", "text": bare.instructions}]
            for m in body["messages"]:
                for b in m["content"]:
                    b.pop("cache_control", None)
            msg = client.messages.create(**body)
            bare.messages = [
                *body["messages"],
                {"role": "assistant", "content": [{"type": "text", "text": msg.content[0].text}]},
            ]
        once = ClaudeSession(client, system_tokens=1500, tools=0, ttl=CC_1H, seed="once")
        once.turn("only this")
        rep = report(rec, 7)
    d = decisions(fake)
    assert all(x.read == 0 and x.write_5m + x.write_1h == 0 for x in d[:3])  # below minimum
    assert rep["time"]["lost_tokens"] == 0
    by_kind = {f["kind"]: f for f in rep["findings"]}
    assert set(by_kind) == {"below_cache_minimum", "no_cache_breakpoint", "unread_cache_writes"}
    for f in by_kind.values():
        assert f["lost_tokens"] is None and f["lost_ms"] is None
        assert f["evidence"]["usd"] is not None and f["evidence"]["usd"] > 0
    assert by_kind["below_cache_minimum"]["rows"] == [2, 3]
    assert by_kind["below_cache_minimum"]["evidence"]["minimum_tokens"] == 1024
    assert by_kind["no_cache_breakpoint"]["rows"] == [5, 6]
    unread = by_kind["unread_cache_writes"]
    assert 7 in unread["rows"] and unread["evidence"]["unread_at_end"] >= 1
    assert d[6].write_1h > 0
    assert rep["cost"]["unread_write_usd"] == pytest.approx(unread["evidence"]["usd"])
    assert problems(rep) == []


def test_with_the_diagnosis_on_llmp_agrees_with_anthropic(fake: Upstream, tmp_path: Path) -> None:
    """`llmp_diagnose` asks Anthropic about every turn (R37); on every miss the provider
    names, llmp's cause is the provider's own word, or its R37 equivalent."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec, diagnose=True) as md:
        s = ClaudeSession(claude_client(md))
        s.turn("one")
        s.turn("two")
        s.tools = [*s.tools[:1], {**s.tools[1], "description": "changed"}, *s.tools[2:]]
        s.turn("three: tools changed")
        s.instructions += " Also: be brief."
        s.turn("four: system changed")
        s.messages[2]["content"][0]["text"] = "two, edited"
        s.turn("five: history rewritten")
        s.turn("six", fake="evict")
        s.model = "claude-sonnet-5"
        s.turn("seven: another model")
        s.turn("eight")
        rep = report(rec, 8)
    by = rows(rep)
    reasons = {rid: r["provider_reason"] for rid, r in by.items()}
    assert reasons[1] == "none"  # a first turn (previous_message_id null): nothing diverged
    assert reasons[2] == reasons[8] == "none"
    assert reasons[3] == "tools_changed" and reasons[4] == "system_changed"
    assert reasons[5] == "messages_changed" and reasons[7] == "model_changed"
    assert reasons[6] == "none"  # the same request: the entry was gone (R37)
    evicted = loss_of(by[6])
    assert evicted is not None and evicted["cause"] == "provider_evicted"
    agreement = rep["provider_agreement"]
    assert agreement["compared"] == 5 and agreement["agreed"] == 5
    assert agreement["disagreed"] == []
    assert all(r["request"]["added"] for r in map(_record, rec.read_text().splitlines()))
    assert problems(rep) == []


def _record(line: str) -> Any:
    import json

    return json.loads(line)


@pytest.mark.slow
def test_a_gap_longer_than_five_minutes_expires_the_5m_entries_only(
    fake: Upstream, tmp_path: Path
) -> None:
    """The honest way to a time-to-live: a real gap of 5 minutes and a few seconds, the
    recorder's and the fake's clocks both real.  Claude Code's 5-minute entries expired
    (`cache_expired`, with its 1-hour setting as the fix); a session that asked for 1-hour
    entries read everything after the same gap."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = claude_client(md)
        short = ClaudeSession(client, seed="five")
        hour = ClaudeSession(client, ttl=CC_1H, seed="hour")
        # Two sessions, each its own first message, as two users' would be.
        short.turn("five: one")
        hour.turn("hour: one")
        time.sleep(305)
        short.turn("five: two")
        hour.turn("hour: two")
        rep = report(rec, 4)
    d = decisions(fake)
    by = rows(rep)
    assert d[2].read < d[0].cached and d[3].read == d[1].cached  # the fake's truth
    loss = by[3]["lost_external"]
    assert loss["cause"] == "cache_expired" and loss["tokens"] == d[0].cached - d[2].read
    assert loss_of(by[4]) is None
    (f,) = [f for f in rep["findings"] if f["kind"] == "cache_expired"]
    assert f["rows"] == [3] and 300 < f["evidence"]["gap_s"]["max"] < 400
    assert f["evidence"]["ttl_s"] == [300]
    assert "ENABLE_PROMPT_CACHING_1H=1" in f["evidence"]["advice"]["text"]
    assert problems(rep) == []
