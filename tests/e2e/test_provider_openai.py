"""A harness on OpenAI's API, explained and priced (R34-R38), end to end, on the Responses
API and Chat Completions alike.

The real `openai` SDK sends a harness's request shape (instructions and tools first, the
history resent whole, one `prompt_cache_key` per conversation, as Codex sends it) to
`api.openai.com` through the real mitmdump (forward mode, as `llmp run -- codex` records
it); the fake OpenAI API answers with OpenAI's documented cache rules and keeps its own
truth of each request (`CacheDecision`: what it read, wrote and kept, and why a longer
prefix was lost).  Every verdict is checked against that truth, every cost against
OpenAI's arithmetic at documented prices, computed here.  A time-to-live is crossed by
moving the fake's clock and the proxy's together (`Skew`), never by waiting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmp.analysis.render import sentence
from llmp.cli import main
from llmp.demo.fakes import CacheDecision, OpenAIAPI
from tests.support.adds_up import problems, readable_problems
from tests.support.mitm import read_records
from tests.support.openai_session import (
    APIS,
    CHAT,
    GPT_5,
    GPT_56,
    RESPONSES,
    SETTINGS,
    GptSession,
    Skew,
    Usage,
    decisions,
)
from tests.support.provider_session import openai_client, recorder, report, text
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

GRANULE = 128


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("openai-api") as up:
        yield up


def rows(rep: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in rep["rows"]}


def loss_of(row: dict[str, Any]) -> dict[str, Any] | None:
    return row["lost_client"] or row["lost_external"]


def lost_usd(row: dict[str, Any]) -> float:
    loss = loss_of(row)
    return float(loss["usd"]) if loss is not None else 0.0


def ask(tag: str) -> str:
    """A user message of about 120 tokens: a history long enough that a change early in
    it misses more than one 128-token step."""
    return text(120, tag)


def missed(d: list[CacheDecision], rid: int, linked: int) -> int:
    """What the fake says request `rid` did not read of what request `linked` left."""
    return d[linked - 1].reusable - d[rid - 1].read


def merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_split(rep: dict[str, Any], d: list[CacheDecision]) -> None:
    """Each row's split is the provider's own, to the token."""
    assert len(rep["rows"]) == len(d)
    for row, dec in zip(rep["rows"], d, strict=True):
        assert row["server"] == "openai", row["id"]
        assert row["cache_read_tokens"] == dec.read, row["id"]
        assert row["cache_write_tokens"] == dec.written, row["id"]
        assert row["uncached_tokens"] == dec.uncached, row["id"]


def check_fixes(rep: dict[str, Any]) -> None:
    """Each finding's fix, as the report words it, is for a provider: no local server's
    flags, and a `prompt_cache_key` is one per conversation, not one for an account."""
    for f in rep["findings"]:
        what, fix = sentence(f)
        for local in ("-np", "--cache-reuse", "llama-server", "--swa-full", "ATTRIBUTION_HEADER"):
            assert local not in what + fix, (f["kind"], local)
        if "prompt_cache_key" in fix:
            assert "per conversation" in fix and "whole account" in fix, fix


# -- 1. a clean session --------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_a_clean_session_loses_nothing(fake: Upstream, tmp_path: Path, api: str) -> None:
    """A stable `prompt_cache_key`, a growing conversation, streamed and not, another
    conversation in between: nothing is lost, and each row reads what OpenAI read."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = openai_client(md)
        s = GptSession(client, api, key="conv-1")
        usages = [s.turn(ask("read calc.py"))]
        s.stream = True
        usages.append(s.turn(ask("and the tests?")))
        other = GptSession(client, api, key="conv-2", seed="other", tools=0)
        usages.append(other.turn(ask("something else entirely")))
        s.stream = False
        usages.append(s.turn(ask("now fix it")))
        s.stream = True
        usages.append(s.turn(ask("run them")))
        rep = report(rec, 5)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    assert [r["conversation"] for r in rep["rows"] if r["kind"] == "turn"].count(1) == 4
    assert by[3]["conversation"] != 1
    assert all(loss_of(r) is None for r in rep["rows"])
    assert rep["time"]["lost_tokens"] == 0 and rep["findings"] == []
    for row, u in zip(rep["rows"], usages, strict=True):
        assert u is not None and row["cache_read_tokens"] == u.read
    # Each turn read all its linked turn kept, to OpenAI's 128-token step (R35).
    for rid, linked in ((2, 1), (4, 2), (5, 4)):
        assert by[rid]["linked_to"] == linked
        assert 0 <= missed(d, rid, linked) < GRANULE and d[rid - 1].read > 0
    # Cost: each row within 2 % of OpenAI's arithmetic at the documented prices.
    for row, u in zip(rep["rows"], usages, strict=True):
        assert u is not None and u.tier == "default"
        want = GPT_5["default"].cost(u.prompt - u.read - u.written, u.read, u.written, u.output)
        assert row["cost_usd"] == pytest.approx(want, rel=0.02)
    cost = rep["cost"]
    assert cost["total_usd"] == pytest.approx(sum(r["cost_usd"] for r in by.values()), abs=1e-5)
    assert cost["lost_usd"] == 0 and cost["unpriced_models"] == []
    assert cost["requests_without_usage"] == 0
    assert rep["provider_agreement"] is None  # nothing was asked or sent
    assert problems(rep) == []
    raw = rec.read_bytes()
    assert b"quick brown fox" not in raw and b"sk-test-secret" not in raw


@pytest.mark.parametrize("api", APIS)
def test_a_shortfall_below_one_step_is_no_loss(fake: Upstream, tmp_path: Path, api: str) -> None:
    """Before GPT-5.6 OpenAI reports reads in whole 128-token steps: a turn that read all
    but the last part-step of its linked turn lost nothing; one more step short is a loss.
    From GPT-5.6 the count is exact, and a clean turn reads every token."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = openai_client(md)
        old = GptSession(client, api, seed="steps", key="steps")
        for i in range(4):
            old.turn(text(40, f"question {i}"))  # under a step a turn, with the reply
        new = GptSession(client, api, model="gpt-5.6", seed="exact", key="exact")
        for i in range(3):
            new.turn(text(40, f"exact question {i}"))
        # A rewrite of the first reply misses more than a step: a loss, of what was missed.
        old.history[1]["content"] = "a first reply, rewritten"
        old.turn(text(40, "and again"))
        rep = report(rec, 8)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    for rid in (2, 3, 4):
        short = missed(d, rid, rid - 1)
        assert 0 < short < GRANULE and d[rid - 1].read % GRANULE == 0, rid
        assert loss_of(by[rid]) is None, rid
    for rid in (6, 7):
        assert d[rid - 1].read == d[rid - 2].reusable and missed(d, rid, rid - 1) == 0
        assert loss_of(by[rid]) is None
    loss = by[8]["lost_client"]
    assert by[8]["linked_to"] == 4 and missed(d, 8, 4) >= GRANULE
    assert loss["cause"] == "history_rewritten" and loss["tokens"] == missed(d, 8, 4)
    assert problems(rep) == []


# -- 2. each cause -------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_each_client_change_is_charged_to_its_tier(
    fake: Upstream, tmp_path: Path, api: str
) -> None:
    """One conversation, each change made after a clean turn: the miss is OpenAI's own
    shortfall (what the linked turn kept, less what this one read), charged to the change;
    another conversation in between is charged nothing."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = openai_client(md)
        s = GptSession(client, api, key="conv-1")
        s.turn(ask("one"))
        s.turn(ask("two"))
        s.key = "conv-1-again"
        s.turn(ask("three: another prompt_cache_key"))
        s.turn(ask("four"))
        s.tools = [s.tools[0], {**s.tools[1], "description": "changed"}, *s.tools[2:]]
        s.turn(ask("five: a tool's description changed"))
        s.turn(ask("six"))
        GptSession(client, api, key="other", seed="other").turn(ask("an unrelated request"))
        s.instructions = "Today is 2026-12-07. " + s.instructions
        s.turn(ask("eight: the date at the top of the instructions"))
        s.turn(ask("nine"))
        s.history[2]["content"] = ask("two, edited")
        s.turn(ask("ten: an earlier message rewritten"))
        s.model = "gpt-5-codex"
        s.turn(ask("eleven: another model"))
        s.turn(ask("twelve"))
        rep = report(rec, 12)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    expect = {
        3: "cache_key_changed",
        5: "tools_changed",
        8: "system_changed",
        10: "history_rewritten",
        11: "model_changed",
    }
    assert {r["conversation"] for rid, r in by.items() if rid != 7} == {1}
    assert by[7]["conversation"] != 1
    assert by[8]["linked_to"] == 6 and 7 in by[8]["other_conversations_between"]
    for rid, row in by.items():
        loss = loss_of(row)
        if rid not in expect:
            assert loss is None, (rid, loss)
            continue
        assert loss is not None and row["lost_client"] is loss, rid
        assert loss["cause"] == expect[rid] and row["break_cause"] == expect[rid], rid
        assert loss["tokens"] == missed(d, rid, row["linked_to"]) >= GRANULE, rid
        assert loss["usd"] is not None and loss["usd"] > 0
    # The fake's truth: a changed key, tools or model read nothing at all.
    assert d[2].read == d[4].read == d[10].read == 0
    causes = {f["evidence"]["break_cause"] for f in rep["findings"] if f["kind"] == "prefix_break"}
    assert causes == set(expect.values())
    (key,) = [f for f in rep["findings"] if f["evidence"].get("break_cause") == "cache_key_changed"]
    assert key["rows"] == [3]
    assert "Keep one prompt_cache_key per conversation" in sentence(key)[1]
    check_fixes(rep)
    assert problems(rep) == []


@pytest.mark.parametrize("api", APIS)
def test_each_setting_that_keys_the_cache_is_settings_changed(
    fake: Upstream, tmp_path: Path, api: str
) -> None:
    """`reasoning.effort`, `text.verbosity`, `text.format`, `parallel_tool_calls`,
    `service_tier` (Chat: `reasoning_effort`, `verbosity`, `response_format`, …): OpenAI
    keys its cache by each, so a change reads nothing; each is `settings_changed`."""
    rec = tmp_path / "rec.jsonl"
    changed: list[int] = []
    with recorder(fake, rec) as md:
        s = GptSession(openai_client(md), api, key="conv-1")
        s.turn(ask("one"))
        n = 1
        for name, by_api in SETTINGS.items():
            s.extra = merged(s.extra, by_api[api])
            s.turn(ask(f"{name} changed"))
            s.turn(ask(f"after {name}"))
            changed.append(n + 1)
            n += 2
        rep = report(rec, n)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    assert {r["conversation"] for r in rep["rows"]} == {1}
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in changed:
            assert d[rid - 1].read == 0, rid
            assert loss is not None and loss["cause"] == "settings_changed", rid
            assert loss["tokens"] == missed(d, rid, rid - 1), rid
        else:
            assert loss is None, (rid, loss)
    (f,) = rep["findings"]
    assert f["evidence"]["break_cause"] == "settings_changed" and f["rows"] == changed
    check_fixes(rep)
    assert problems(rep) == []


@pytest.mark.parametrize("api", APIS)
def test_an_entry_outlived_by_the_gap_is_cache_expired(
    fake: Upstream, tmp_path: Path, api: str
) -> None:
    """The retention the response reports decides (R35): `in_memory` counts as 5
    minutes, `24h` as a day, GPT-5.6's `prompt_cache_options.ttl` as given (30 minutes).
    The fake's clock and the proxy's move on together: nobody waits."""
    rec = tmp_path / "rec.jsonl"
    skew = Skew(tmp_path / "skew")
    OpenAIAPI.of(fake).clock = skew
    with recorder(fake, rec, skew=skew.path) as md:
        client = openai_client(md)
        memory = GptSession(client, api, seed="memory", key="memory")
        day = GptSession(client, api, seed="day", key="day")
        day.extra = {"prompt_cache_retention": "24h"}
        newer = GptSession(client, api, model="gpt-5.6", seed="newer", key="newer")
        sessions = (memory, day, newer)
        for s in sessions:
            s.turn(ask(f"{s.key} one"))
        skew.advance(301)  # past 5 minutes
        for s in sessions:
            s.turn(ask(f"{s.key} two"))
        skew.advance(1801)  # past 30 minutes
        for s in sessions:
            s.turn(ask(f"{s.key} three"))
        rep = report(rec, 9)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    expired = {4: 1, 7: 4, 9: 6}  # row: the row it is linked to
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in expired:
            assert d[rid - 1].lost == "expired", rid  # the fake's truth
            assert row["linked_to"] == expired[rid]
            assert loss is not None and row["lost_external"] is loss, rid
            assert loss["cause"] == "cache_expired" and row["cause"] == "server_reset"
            assert loss["tokens"] == missed(d, rid, expired[rid]) > 0, rid
        else:
            assert loss is None, (rid, loss)
    assert d[4].read > 0 and d[7].read > 0  # a day's retention outlived both gaps
    assert d[5].read == d[2].reusable  # GPT-5.6's 30 minutes outlived the first
    found = {f["model"]: f for f in rep["findings"] if f["kind"] == "cache_expired"}
    assert set(found) == {"gpt-5", "gpt-5.6"}
    assert found["gpt-5"]["rows"] == [4, 7] and found["gpt-5"]["evidence"]["ttl_s"] == [300]
    assert found["gpt-5.6"]["rows"] == [9] and found["gpt-5.6"]["evidence"]["ttl_s"] == [1800]
    gaps = found["gpt-5"]["evidence"]["gap_s"]
    assert 300 < gaps["min"] < 310 and 1800 < gaps["max"] < 1810
    for f in found.values():
        assert "prompt_cache_retention" in f["evidence"]["advice"]["text"]
    assert {f["kind"] for f in rep["findings"]} <= {"cache_expired", "unread_cache_writes"}
    check_fixes(rep)
    assert problems(rep) == []


@pytest.mark.parametrize("api", APIS)
def test_the_providers_own_eviction(fake: Upstream, tmp_path: Path, api: str) -> None:
    """The same prefix, alive, not read: OpenAI dropped it (`provider_evicted`, the
    provider's, not the client's); no overflow is claimed where the traffic shows none."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        s = GptSession(openai_client(md), api)
        s.turn(ask("one"))
        s.turn(ask("two"))
        OpenAIAPI.of(fake).cache.evict()
        s.turn(ask("three: its entry was evicted"))
        s.turn(ask("four: it read nothing"), fake="cache_miss")
        s.turn(ask("five"))
        rep = report(rec, 5)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    assert d[2].lost == "evicted" and d[2].read == d[3].read == 0
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in (3, 4):
            assert loss is not None and row["lost_external"] is loss, rid
            assert loss["cause"] == "provider_evicted" and row["cause"] == "server_reset"
            assert loss["tokens"] == missed(d, rid, rid - 1), rid
        else:
            assert loss is None, (rid, loss)
    (f,) = rep["findings"]
    assert f["kind"] == "provider_evicted" and f["rows"] == [3, 4]
    assert f["evidence"]["overflow"] == 0 and "advice" not in f["evidence"]
    assert f["lost_usd"] == pytest.approx(sum(lost_usd(by[i]) for i in (3, 4)), abs=1e-6)
    check_fixes(rep)
    assert problems(rep) == []


@pytest.mark.parametrize("api", APIS)
def test_one_key_for_the_whole_account_overflows(fake: Upstream, tmp_path: Path, api: str) -> None:
    """Ten conversations in a minute, one `prompt_cache_key` for all of them and the same
    instructions: above 15 requests a minute OpenAI sends the rest to other machines,
    which miss.  The finding names the overflow, the busiest minute and how many of its
    requests read the cache, and the fix is a stable key per conversation."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = openai_client(md)
        sessions = [GptSession(client, api, key="the-account", seed="same") for _ in range(10)]
        for i, s in enumerate(sessions):
            s.turn(ask(f"conversation {i}"))
        for i, s in enumerate(sessions):
            s.turn(ask(f"conversation {i}, go on"))
        rep = report(rec, 20)
    d = decisions(fake)
    by = rows(rep)
    check_split(rep, d)
    over = [i + 1 for i, x in enumerate(d) if x.overflow]
    assert over == [16, 17, 18, 19, 20]  # the fake's truth: above 15 in the minute
    for rid, row in by.items():
        loss = loss_of(row)
        if rid in over:
            assert row["linked_to"] == rid - 10
            assert loss is not None and loss["cause"] == "provider_evicted", rid
            assert loss["tokens"] == missed(d, rid, rid - 10), rid
        else:
            assert loss is None, (rid, loss)
    (f,) = [f for f in rep["findings"] if f["kind"] == "provider_evicted"]
    ev = f["evidence"]
    assert f["rows"] == over
    assert ev["overflow"] == 5 and ev["overflow_per_minute"] == 15
    assert ev["per_minute"] == 20 and ev["read_per_minute"] == 14  # the first read nothing
    assert ev["advice"]["confidence"] == "high"
    check_fixes(rep)
    assert "a stable one per conversation" in sentence(f)[1]
    assert problems(rep) == []


# -- 4. Chat usage, asked for and not ------------------------------------------------------


def test_chat_streams_with_and_without_include_usage(
    fake: Upstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `stream_options.include_usage` the counts are the last chunk's; without, the
    stream carries none: the rows' counts are null (never zero), their cost is unknown,
    and the report says so plainly."""
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        client = openai_client(md)
        asked = GptSession(client, CHAT, stream=True, seed="asked", key="asked")
        silent = GptSession(client, CHAT, stream=True, include_usage=False, seed="silent")
        got: list[Usage | None] = []
        for i in range(3):
            got.append(asked.turn(ask(f"asked {i}")))
            got.append(silent.turn(ask(f"silent {i}")))
        rep = report(rec, 6)
    d = decisions(fake)
    by = rows(rep)
    records = read_records(rec)
    for rid, row in by.items():
        u, dec = got[rid - 1], d[rid - 1]
        if rid % 2:  # asked: the last chunk's usage, the fake's own counts
            assert u is not None and row["cache_read_tokens"] == u.read == dec.read
            assert row["uncached_tokens"] == dec.uncached
            assert row["counts"]["prompt_tokens"]["value"] == dec.prompt_tokens
            assert row["cost_usd"] is not None
            assert records[rid - 1]["request"]["digest"]["cache"]["include_usage"] is True
        else:
            assert u is None
            assert row["cache_read_tokens"] is None and row["uncached_tokens"] is None
            assert row["cache_write_tokens"] is None and row["cost_usd"] is None
            assert row["counts"]["prompt_tokens"] is None
            assert row["counts"]["reused_tokens"] is None
            assert records[rid - 1]["request"]["digest"]["cache"]["include_usage"] is None
        assert loss_of(row) is None
    cost = rep["cost"]
    assert cost["requests_without_usage"] == 3 and cost["streams_without_include_usage"] == 3
    assert cost["total_usd"] == pytest.approx(sum(by[i]["cost_usd"] for i in (1, 3, 5)), abs=1e-5)
    assert problems(rep) == []
    assert main(["analyze", str(rec)]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert (
        "3 Chat Completions streams came without a usage: the requests did not ask for one "
        '(stream_options: {"include_usage": true}), so what they cost and read from the cache '
        "is unknown, and not in these figures." in flat
    )
    assert readable_problems(out, rep) == []


# -- 5. cost -------------------------------------------------------------------------------


def test_cost_is_openais_arithmetic_by_tier_and_generation(fake: Upstream, tmp_path: Path) -> None:
    """Each row within 2 % of OpenAI's arithmetic at the documented prices: the service
    tier the response reports (flex half, priority twice the standard), and GPT-5.6's
    write price (1.25x input) and read price (0.1x); a miss costs what its tokens were
    billed at beyond a read."""
    rec = tmp_path / "rec.jsonl"
    got: list[tuple[str, Usage | None]] = []
    with recorder(fake, rec) as md:
        client = openai_client(md)
        plan = [
            (RESPONSES, "gpt-5", None),
            (CHAT, "gpt-5", "flex"),
            (RESPONSES, "gpt-5", "priority"),
            (RESPONSES, "gpt-5.6", None),
            (CHAT, "gpt-5.6", None),
        ]
        for n, (api, model, tier) in enumerate(plan):
            s = GptSession(client, api, model=model, seed=f"cost {n}", key=f"cost-{n}")
            if tier is not None:
                s.extra = {"service_tier": tier}
            got.append((model, s.turn(ask(f"{n} one"))))
            got.append((model, s.turn(ask(f"{n} two"))))
            s.key = f"cost-{n}-changed"  # a miss, priced
            got.append((model, s.turn(ask(f"{n} three"))))
        rep = report(rec, len(got))
    d = decisions(fake)
    check_split(rep, d)
    tiers = []
    for row, (model, u) in zip(rep["rows"], got, strict=True):
        assert u is not None and u.tier is not None
        tiers.append(u.tier)
        price = GPT_56 if model == "gpt-5.6" else GPT_5[u.tier]
        uncached = u.prompt - u.read - u.written
        assert row["cost_usd"] == pytest.approx(
            price.cost(uncached, u.read, u.written, u.output), rel=0.02
        ), row["id"]
        loss = loss_of(row)
        if loss is None:
            continue
        # The missed tokens came right after what was read: written again (GPT-5.6) or
        # sent uncached, each instead of a read.
        assert loss["cause"] == "cache_key_changed"
        again = price.write if model == "gpt-5.6" else price.input
        want = loss["tokens"] * (again - price.cached) / 1e6
        assert loss["usd"] == pytest.approx(want, rel=0.02), row["id"]
    assert tiers == ["default"] * 3 + ["flex"] * 3 + ["priority"] * 3 + ["default"] * 6
    assert all(d[i].written > 0 for i in range(9, 15))  # GPT-5.6 writes, and bills them
    assert all(d[i].written == 0 for i in range(9))
    cost = rep["cost"]
    by_model = {
        m: sum(r["cost_usd"] for r in rep["rows"] if r["model"] == m) for m in cost["by_model"]
    }
    assert cost["by_model"] == pytest.approx(by_model, abs=1e-5)
    assert cost["lost_usd"] == pytest.approx(sum(map(lost_usd, rep["rows"])), abs=1e-5)
    assert cost["unpriced_models"] == []
    assert problems(rep) == []


# -- 6. the provider's own diagnosis -------------------------------------------------------


def d_diagnosis(fake: Upstream) -> list[Any]:
    return [x.diagnosis for x in decisions(fake)]


def test_without_the_diagnosis_not_one_byte_changes(fake: Upstream, tmp_path: Path) -> None:
    """`llmp_diagnose` off: every body reaches OpenAI as the SDK sent it, and a diagnosis
    the client asked for itself is kept and compared."""
    rec = tmp_path / "rec.jsonl"
    sent: list[bytes] = []
    with recorder(fake, rec) as md:
        client = openai_client(md, sent=sent)
        s = GptSession(client, RESPONSES, model="gpt-5.6")
        first = s.turn(ask("one"))
        assert first is not None
        s.extra = {"prompt_cache_options": {"comparison_response_id": first.response_id}}
        s.turn(ask("two: the client asks itself"))
        GptSession(client, CHAT, model="gpt-5.6", seed="chat").turn(ask("chat"))
        GptSession(client, RESPONSES, seed="older").turn(ask("an older model"))
        rep = report(rec, 4)
    got = [e for e in fake.log if e.method == "POST"]
    assert [e.request_body for e in got] == sent
    assert [r["request"]["added"] for r in read_records(rec)] == [None] * 4
    assert d_diagnosis(fake) == [None, {"type": "cache_hit"}, None, None]
    reasons = [r["provider_reason"] for r in rep["rows"]]
    assert reasons == [None, "none", None, None]
    # OpenAI found no divergence and llmp no loss: nothing to compare, but it was kept.
    assert rep["provider_agreement"] == {"compared": 0, "agreed": 0, "disagreed": []}
    assert problems(rep) == []


def test_with_the_diagnosis_on_llmp_agrees_with_openai(fake: Upstream, tmp_path: Path) -> None:
    """`llmp_diagnose` asks OpenAI about every GPT-5.6 Responses turn, comparing it with its
    conversation's previous response (R37); on every miss OpenAI names, llmp's cause is
    OpenAI's own word or its R37 equivalent, and an eviction or an expiry is OpenAI's
    `cache_hit` (the request was the same; the entry was gone)."""
    rec = tmp_path / "rec.jsonl"
    skew = Skew(tmp_path / "skew")
    OpenAIAPI.of(fake).clock = skew
    ids: list[str | None] = []
    with recorder(fake, rec, diagnose=True, skew=skew.path) as md:
        client = openai_client(md)
        s = GptSession(client, RESPONSES, model="gpt-5.6")
        other = GptSession(client, RESPONSES, model="gpt-5.6", seed="other", key="other")

        def turn(session: GptSession, user: str) -> None:
            u = session.turn(ask(user))
            ids.append(u.response_id if u is not None else None)

        turn(s, "one")
        turn(other, "another conversation")
        turn(s, "two")
        s.tools = s.tools[:2]
        turn(s, "four: a tool less")
        s.key = "conv-1-again"
        turn(s, "five: another key")
        s.extra = {"reasoning": {"effort": "high"}}
        turn(s, "six: more effort")
        s.instructions = "Today is 2026-12-07. " + s.instructions
        turn(s, "seven: the date at the top")
        s.history[2]["content"] = ask("two, edited")
        turn(s, "eight: an earlier message rewritten")
        turn(other, "go on")
        OpenAIAPI.of(fake).cache.evict()
        turn(s, "ten: evicted")
        skew.advance(1801)
        turn(s, "eleven: expired")
        s.model = "gpt-5.6-codex"
        turn(s, "twelve: another model")
        turn(s, "thirteen")
        GptSession(client, CHAT, model="gpt-5.6", seed="chat").turn(ask("chat is not asked"))
        rep = report(rec, 14)
    asked = [
        (json.loads(e.request_body).get("prompt_cache_options") or {}).get("comparison_response_id")
        for e in fake.log
        if e.method == "POST"
    ]
    # Each conversation's previous response; the first turns and Chat are not asked.
    previous = {3: 1, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7, 9: 2, 10: 8, 11: 10, 12: 11, 13: 12}
    assert asked == [None, None, *(ids[previous[i] - 1] for i in range(3, 14)), None]
    by = rows(rep)
    reasons = {rid: r["provider_reason"] for rid, r in by.items()}
    assert reasons == {
        1: None,
        2: None,
        3: "none",
        4: "tools_changed",
        5: "prompt_cache_key_changed",
        6: "reasoning_effort_changed",
        7: "input_changed",
        8: "input_changed",
        9: "none",
        10: "none",
        11: "none",
        12: "model_changed",
        13: "none",
        14: None,
    }
    llmp = {rid: (loss_of(r) or {}).get("cause") for rid, r in by.items()}
    assert llmp == {
        **dict.fromkeys(range(1, 15)),
        4: "tools_changed",
        5: "cache_key_changed",
        6: "settings_changed",
        7: "system_changed",
        8: "history_rewritten",
        10: "provider_evicted",
        11: "cache_expired",
        12: "model_changed",
    }
    agreement = rep["provider_agreement"]
    assert agreement == {"compared": 8, "agreed": 8, "disagreed": []}
    added = [r["request"]["added"] for r in read_records(rec)]
    assert added == [None, None, *[["prompt_cache_options.comparison_response_id"]] * 11, None]
    check_fixes(rep)
    assert problems(rep) == []
