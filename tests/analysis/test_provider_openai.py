"""OpenAI on the analysis's side, from hand-made records: a Chat stream without a usage is
counted as unknown, never as zero (its cost and cache use left out, and said so);
OpenAI's overflow (R35: above 15 requests a minute on one prompt start and key) is named
with the busiest minute and what of it read the cache; a text format changed within a
conversation is that conversation's `settings_changed`.  The same end to end:
tests/e2e/test_provider_openai.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmp.analysis.html import render_html
from llmp.analysis.render import sentence, without_usage_text
from llmp.apis.providers import facts
from llmp.cli import main
from tests.support import scenarios as sc
from tests.support.adds_up import problems

UA = "a-harness/1.0"
SYSTEM = "You are a careful assistant. " * 300  # about 2,000 tokens


def usage(prompt: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": 8,
        "total_tokens": prompt + 8,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
    }


def exchange(
    tr: sc.Traffic,
    body: dict[str, Any],
    used: dict[str, Any] | None,
    *,
    stream: bool = False,
    at: int | None = None,
    upstream: str | None = "api.openai.com",
) -> None:
    """One Chat Completions exchange with api.openai.com (`used`: its usage, or none)."""
    t = tr.t if at is None else at
    reply = {
        "id": f"chatcmpl-{tr.next_id}",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "service_tier": "default",
    }
    if used is not None:
        reply["usage"] = used
    rec = tr._record(
        method="POST",
        path="/v1/chat/completions",
        ua=UA,
        body={**body, "stream": True} if stream else body,
        status=200,
        resp_body=reply,
        stream="sse" if stream else None,
        t_start=t,
        t_first=t + 200,
        t_end=t + 300,
    )
    if upstream is not None:
        rec["request"]["upstream"] = upstream
    tr.t = t + 1000


def body(user: str, key: str = "conv", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "gpt-5", "messages": messages, "prompt_cache_key": key, **extra}


def test_a_chat_stream_without_usage_is_unknown_not_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tr = sc.Traffic()
    exchange(tr, body("first"), None, stream=True)
    exchange(tr, body("second"), None, stream=True)
    asked = body("third", stream_options={"include_usage": True})
    exchange(tr, asked, None, stream=True)  # asked, yet none came (cut short)
    exchange(tr, body("fourth"), usage(2010, 1920))
    path = tr.write(tmp_path / "rec.jsonl")
    rep = sc.analyse(tr, tmp_path)
    rows = sc.rows_by_id(rep)
    for rid in (1, 2, 3):
        r = rows[rid]
        assert r["server"] == "openai"
        assert r["cache_read_tokens"] is None and r["uncached_tokens"] is None
        assert r["cost_usd"] is None and r["counts"]["prompt_tokens"] is None
    assert rows[4]["cache_read_tokens"] == 1920 and rows[4]["cost_usd"] > 0
    cost = rep["cost"]
    assert cost["requests_without_usage"] == 3
    assert cost["streams_without_include_usage"] == 2
    assert cost["total_usd"] == pytest.approx(rows[4]["cost_usd"], abs=1e-6)
    assert cost["unpriced_models"] == []  # unmeasured is not unpriced
    assert problems(rep) == []
    assert "Without usage" in render_html(rep, None)  # the page's money cards say it too
    assert main(["analyze", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "3 requests came without a usage (2 of them Chat Completions streams that did not "
        'ask: stream_options: {"include_usage": true}): what they cost and read from the '
        "cache is unknown, and not in these figures." in out
    )


def test_the_words_for_requests_without_usage() -> None:
    assert without_usage_text({"requests_without_usage": 0}) == ""
    assert without_usage_text({}) == ""
    one = without_usage_text({"requests_without_usage": 1, "streams_without_include_usage": 1})
    assert one == (
        "1 Chat Completions stream came without a usage: the request did not ask for one "
        '(stream_options: {"include_usage": true}), so what it cost and read from the cache '
        "is unknown, and not in these figures."
    )
    other = without_usage_text({"requests_without_usage": 2, "streams_without_include_usage": 0})
    assert other == (
        "2 requests came without a usage: what they cost and read from the cache is unknown, "
        "and not in these figures."
    )


def test_overflow_names_the_busiest_minute_and_what_of_it_read_the_cache(tmp_path: Path) -> None:
    """Ten conversations in a minute with one key for the whole account and the same
    prompt start: the second turns above OpenAI's 15 a minute read nothing (what OpenAI's
    overflow does); the finding names the busiest minute and how many of its requests
    read the cache."""
    limit = int(facts()["openai"]["overflow_per_minute"])
    tr = sc.Traffic()
    t0 = tr.t
    prompt = 2010
    for i in range(10):
        exchange(tr, body(f"conversation {i}", key="account"), usage(prompt, 1920 if i else 0))
    for i in range(10):
        second = body(f"conversation {i}", key="account")
        second["messages"] += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and then?"},
        ]
        n = 11 + i  # the request's place in the minute
        exchange(tr, second, usage(prompt + 20, 0 if n > limit else 1920))
    assert tr.t - t0 < 60_000
    rep = sc.analyse(tr, tmp_path)
    (f,) = [f for f in rep["findings"] if f["kind"] == "provider_evicted"]
    over = [r["id"] for r in rep["rows"] if r["lost_external"] is not None]
    assert over == list(range(limit + 1, 21)) and f["rows"] == over
    ev = f["evidence"]
    assert ev["overflow"] == len(over) and ev["overflow_per_minute"] == limit
    assert ev["per_minute"] == 20 and ev["read_per_minute"] == limit - 1
    assert "give each conversation its own prompt_cache_key" in ev["advice"]["text"]
    assert "Up to 20 requests a minute" in ev["advice"]["text"]
    story, _ = sentence(f)
    assert (
        f"{len(over)} turns of them came when 20 requests in a minute shared one prompt start "
        f"and key, and {limit - 1} of those read the cache: OpenAI serves about {limit} a "
        "minute from the machine that holds a prefix" in story
    )
    assert problems(rep) == []


@pytest.mark.parametrize("upstream", ["api.openai.com", None])
def test_a_text_format_changed_within_a_conversation(tmp_path: Path, upstream: str | None) -> None:
    """On a provider the text format is one of the conversation's cache settings (R35): a
    turn that continues the conversation whole, with its system prompt, tools and model,
    and asks for JSON is the conversation's next turn, its miss `settings_changed`.  On
    a local server the rule is not this one: the request is not linked to the turn before
    (a structured side-call, here the first turn of another conversation, since the next
    request continues it)."""
    tr = sc.Traffic()
    history: list[dict[str, Any]] = []
    prompt = 2010
    for n, fmt in enumerate((None, None, {"type": "json_object"}, {"type": "json_object"})):
        b = body(f"question {n}")
        b["messages"] = [b["messages"][0], *history, b["messages"][1]]
        if fmt is not None:
            b["response_format"] = fmt
        read = 0 if n in (0, 2) else prompt // 128 * 128
        exchange(tr, b, usage(prompt, read), upstream=upstream)
        history = [*b["messages"][1:], {"role": "assistant", "content": "ok"}]
        prompt += 30
    rep = sc.analyse(tr, tmp_path)
    rows = sc.rows_by_id(rep)
    if upstream is None:
        assert rows[3]["linked_to"] is None and rows[3]["conversation"] != 1
        return
    assert [r["kind"] for r in rep["rows"]] == ["turn"] * 4
    assert {r["conversation"] for r in rep["rows"]} == {1}
    assert rows[3]["linked_to"] == 2 and rows[4]["linked_to"] == 3
    loss = rows[3]["lost_client"]
    assert loss["cause"] == "settings_changed" and loss["tokens"] == 2040
    assert rows[4]["lost_client"] is None
    assert problems(rep) == []
