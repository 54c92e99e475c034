"""The fake OpenRouter (`llmp.demo.fakes.openrouter`), driven by the real openai SDK.

A system message of `system(n)` is exactly n tokens in the fakes' template
(`<|system|>` + text + `<|end|>\\n`, or one text part with a breakpoint).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llmp.demo.fakes import CacheDecision, ManualClock, OpenRouter, Upstream

HI: Any = {"role": "user", "content": "hi"}  # 18 characters: 5 tokens
OLD = "openai/gpt-5.5"
NEW = "openai/gpt-5.6"
CLAUDE = "anthropic/claude-sonnet-4.5"
PER_TOKEN = 1.0 / 1e6  # the fake's default input price: $1 per million tokens


def system(tokens: int, ch: str = "s") -> Any:
    return {"role": "system", "content": ch * (4 * tokens - 18)}


def marked(tokens: int, cache_control: Any) -> Any:
    """A system message of one text part (``tokens`` tokens, end tag included), marked."""
    part = {"type": "text", "text": "s" * (4 * tokens - 18), "cache_control": cache_control}
    return {"role": "system", "content": [part]}


@pytest.fixture
def up() -> Iterator[Upstream]:
    with Upstream("openrouter") as server:
        yield server


@pytest.fixture
def clock(up: Upstream) -> ManualClock:
    c = ManualClock()
    OpenRouter.of(up).clock = c
    return c


@pytest.fixture
def client(up: Upstream) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=up.url + "/api/v1", api_key="sk-or-test", max_retries=0, timeout=10
    ) as c:
        yield c


def decision(up: Upstream) -> CacheDecision:
    d = up.last.wait().cache
    assert isinstance(d, CacheDecision)
    return d


def usage_of(up: Upstream) -> dict[str, Any]:
    """The raw usage the fake sent last (body, or the stream's usage chunk)."""
    ex = up.last.wait()
    if ex.sse_data():
        chunks = [json.loads(d) for d in ex.sse_data() if d != "[DONE]"]
        with_usage = [c for c in chunks if "usage" in c]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        out: dict[str, Any] = with_usage[0]["usage"]
        return out
    body: dict[str, Any] = json.loads(ex.decoded_body)["usage"]
    return body


def ask(client: openai.OpenAI, model: str, messages: Any, **extra: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, **extra)


def test_auth(up: Upstream) -> None:
    r = httpx.post(up.url + "/api/v1/chat/completions", json={"model": OLD, "messages": []})
    assert r.status_code == 401
    assert r.json() == {"error": {"message": "No auth credentials found", "code": 401}}


def test_stream_shape(up: Upstream, client: openai.OpenAI) -> None:
    stream = ask(client, NEW, [HI], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello from fake openrouter"
    )
    reasoning = [getattr(c.choices[0].delta, "reasoning", None) for c in chunks if c.choices]
    assert "".join(r for r in reasoning if r) == "Let me think about it."
    ex = up.last
    assert ex.decoded_body.startswith(b": OPENROUTER PROCESSING\n\n")
    raw = [json.loads(d) for d in ex.sse_data() if d != "[DONE]"]
    assert ex.sse_data()[-1] == "[DONE]"
    assert all(c["provider"] == "OpenAI" and c["id"].startswith("gen-") for c in raw)
    assert raw[-2]["choices"][0]["native_finish_reason"] == "stop"
    assert raw[-1]["choices"] == []
    u = usage_of(up)
    assert u["prompt_tokens"] == 5 and u["completion_tokens_details"]["reasoning_tokens"] == 5
    assert set(u["prompt_tokens_details"]) == {
        "cached_tokens",
        "cache_write_tokens",
        "audio_tokens",
    }
    assert "cache_discount" in u and "cost" in u


def test_not_streamed_and_alias_path(up: Upstream) -> None:
    with openai.OpenAI(base_url=up.url + "/v1", api_key="k", max_retries=0) as c:
        r = ask(c, CLAUDE, [HI])
    assert r.choices[0].message.content == "Hello from fake openrouter"
    assert getattr(r.choices[0].message, "reasoning", None) == "Let me think about it."
    body = json.loads(up.last.decoded_body)
    assert body["provider"] == "Anthropic" and body["choices"][0]["native_finish_reason"] == "stop"
    assert decision(up).backend == "Anthropic"


def test_sticky_session(up: Upstream, client: openai.OpenAI, clock: ManualClock) -> None:
    sessions: list[tuple[str, dict[str, Any]]] = [
        ("a", {"extra_body": {"session_id": "s1"}}),
        ("b", {"extra_headers": {"x-session-id": "s2"}}),
    ]
    for ch, via in sessions:
        messages = [system(1100, ch), HI]  # its own prompt: no other session warmed it
        # 24h: the entry outlives the stickiness
        ask(client, OLD, messages, prompt_cache_retention="24h", **via)
        first = decision(up).backend
        clock.advance(599)
        r = ask(client, OLD, messages, prompt_cache_retention="24h", **via)
        assert decision(up).backend == first
        assert r.usage.prompt_tokens_details.cached_tokens == 1024
        clock.advance(601)  # idle too long: the next backend, a cold cache
        r = ask(client, OLD, messages, prompt_cache_retention="24h", **via)
        assert decision(up).backend != first
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_without_a_session_backends_take_turns(up: Upstream, client: openai.OpenAI) -> None:
    messages = [system(1100), HI]
    backends = []
    for _ in range(3):
        ask(client, OLD, messages)
        backends.append(decision(up).backend)
    assert backends == ["OpenAI", "Azure", "OpenAI"]
    assert usage_of(up)["prompt_tokens_details"]["cached_tokens"] == 1024
    assert up.log[1].cache.read == 0


def test_anthropic_writes_cost_and_discount(up: Upstream, client: openai.OpenAI) -> None:
    session = {"extra_body": {"session_id": "c"}}
    messages = [marked(1100, {"type": "ephemeral"}), HI]
    ask(client, CLAUDE, messages, **session)
    u = usage_of(up)
    assert u["prompt_tokens"] == 1105
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    assert u["prompt_tokens_details"]["cache_write_tokens"] == 1100
    assert u["cache_discount"] == pytest.approx(-1100 * 0.25 * PER_TOKEN)  # writes cost 1.25×
    output = u["completion_tokens"] * 4.0 / 1e6
    assert u["cost"] == pytest.approx((5 + 1100 * 1.25) * PER_TOKEN + output)
    ask(client, CLAUDE, [messages[0], {"role": "user", "content": "another"}], **session)
    u = usage_of(up)
    assert u["prompt_tokens_details"]["cached_tokens"] == 1100
    assert u["prompt_tokens_details"]["cache_write_tokens"] == 0
    assert u["cache_discount"] == pytest.approx(1100 * 0.9 * PER_TOKEN)  # reads cost 0.1×


def test_anthropic_one_hour_and_top_level(up: Upstream, client: openai.OpenAI) -> None:
    session = {"extra_body": {"session_id": "h"}}
    ask(client, CLAUDE, [marked(1100, {"type": "ephemeral", "ttl": "1h"}), HI], **session)
    assert decision(up).written_by_ttl == {"1h": 1100}
    assert usage_of(up)["cache_discount"] == pytest.approx(-1100 * 1.0 * PER_TOKEN)  # 2×
    body = {"session_id": "t", "cache_control": {"type": "ephemeral"}}
    ask(client, CLAUDE, [system(1100), HI], extra_body=body)
    assert decision(up).writes == [(1105, "5m")]  # the last part
    small = [marked(100, {"type": "ephemeral"}), HI]  # below Sonnet's 1024
    ask(client, CLAUDE, small, **session)
    assert usage_of(up)["prompt_tokens_details"]["cache_write_tokens"] == 0


def test_anthropic_five_breakpoints_refused(client: openai.OpenAI) -> None:
    part = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    messages: Any = [{"role": "system", "content": [part] * 5}, HI]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, CLAUDE, messages)
    body: Any = e.value.body
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in str(body)


def test_openai_56_through_openrouter(up: Upstream, client: openai.OpenAI) -> None:
    session = {"extra_body": {"session_id": "n"}}
    ask(client, NEW, [system(1100), HI], **session)
    u = usage_of(up)
    assert u["prompt_tokens_details"]["cache_write_tokens"] == 1105  # the implicit write
    assert u["cache_discount"] == pytest.approx(-1105 * 0.25 * PER_TOKEN)
    ask(client, NEW, [system(1100), HI], **session)
    u = usage_of(up)
    assert u["prompt_tokens_details"]["cached_tokens"] == 1105
    assert u["cache_discount"] == pytest.approx(1105 * 0.9 * PER_TOKEN)
