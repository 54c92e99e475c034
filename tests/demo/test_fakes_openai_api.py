"""The fake OpenAI API (`llmp.demo.fakes.openai_api`), driven by the real openai SDK.

Token counts are the fakes' template: each segment is ceil(chars / 4) tokens, and
`instructions(n)` is an instruction segment of exactly n tokens
(`<|instructions|>` + text + `<|end|>\\n`), so the expected numbers below are worked
out by hand.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from llmp.demo.fakes import CacheDecision, ManualClock, OpenAIAPI, OpenRouter, Upstream
from llmp.demo.fakes.openai_prompt import responses_prompt
from llmp.demo.fakes.provider_cache import Prompt, Segment

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness"
OLD = "gpt-5.5"
NEW = "gpt-5.6"
HI = 5
"""`<|user|>hi<|end|>\\n`: 18 characters."""
USER_HI: Any = {"role": "user", "content": "hi"}
WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def instructions(tokens: int, ch: str = "a") -> str:
    """Instructions whose segment is exactly ``tokens`` tokens."""
    return ch * (4 * tokens - 24)


def developer(tokens: int, *, mark: dict[str, Any] | None = None, tail: str = "go") -> Any:
    """A developer message of two parts: the first part's segment exactly ``tokens``
    tokens (``<|developer|>`` + text), marked with ``mark``; the second ``tail``."""
    first: dict[str, Any] = {"type": "input_text", "text": "d" * (4 * tokens - 13)}
    if mark is not None:
        first["prompt_cache_breakpoint"] = mark
    return {
        "type": "message",
        "role": "developer",
        "content": [first, {"type": "input_text", "text": tail}],
    }


EXPLICIT = {"mode": "explicit"}


@pytest.fixture
def up() -> Iterator[Upstream]:
    with Upstream("openai-api") as server:
        yield server


@pytest.fixture
def clock(up: Upstream) -> ManualClock:
    c = ManualClock()
    OpenAIAPI.of(up).clock = c
    return c


@pytest.fixture
def client(up: Upstream) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=up.url + "/v1", api_key="sk-test", max_retries=0, timeout=10) as c:
        yield c


def decision(up: Upstream) -> CacheDecision:
    d = up.last.wait().cache
    assert isinstance(d, CacheDecision)
    return d


def usage(r: Any) -> Any:
    """A response's usage (never None here)."""
    assert r.usage is not None
    return r.usage


def cached(r: Any) -> int:
    return int(usage(r).input_tokens_details.cached_tokens)


def written(r: Any) -> int:
    return int(usage(r).input_tokens_details.cache_write_tokens)


# ----------------------------------------------------------------- the prompt


def test_rendering_is_per_segment_and_documented() -> None:
    body = {"instructions": instructions(1000), "input": "hi", "tools": [WEATHER_TOOL]}
    p = responses_prompt(body, [], lambda part: None)
    tools_chars = len(
        "<|tools|>" + json.dumps([WEATHER_TOOL], sort_keys=True, separators=(",", ":")) + "\n"
    )
    assert [s.kind for s in p.segments] == ["tools", "instructions", "message"]
    assert p.tokens == -(-tools_chars // 4) + 1000 + HI
    assert p.segments[2].text == "<|user|>hi<|end|>\n"


def test_prompt_positions() -> None:
    p = Prompt([Segment("abcdefghij"), Segment("klm", breakpoint="30m"), Segment("nopqrstu")])
    assert p.tokens == 3 + 1 + 2
    assert [p.tokens_at(c) for c in (0, 3, 4, 10, 11, 13, 14, 21)] == [0, 0, 1, 3, 3, 4, 4, 6]
    assert p.chars_at(3) == 10 and p.chars_at(2) == 8 and p.chars_at(99) == 21
    assert [(m.tokens, m.chars, m.ttl) for m in p.marks()] == [(4, 13, "30m")]


# ----------------------------------------------------------- auth and headers


def test_auth_required(up: Upstream) -> None:
    r = httpx.post(up.url + "/v1/responses", json={"model": OLD, "input": "hi"})
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "didn't provide an API key" in err["message"]
    basic = {"authorization": "Basic dXNlcjpwYXNz"}
    r = httpx.post(up.url + "/v1/chat/completions", headers=basic, json={"model": OLD})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    OpenAIAPI.of(up).api_key = "sk-right-key-0000"
    with openai.OpenAI(base_url=up.url + "/v1", api_key="sk-wrong-key-1234", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.responses.create(model=OLD, input="hi")
    assert e.value.code == "invalid_api_key"
    assert "sk-wrong-key-1234" not in up.last.decoded_body.decode()
    assert up.last.cache is None


def test_headers_and_ids(up: Upstream, client: openai.OpenAI) -> None:
    r = client.responses.create(model=OLD, input="hi")
    ex = up.last.wait()
    assert r.id.startswith("resp_") and len(r.id) == 5 + 48
    for name in ("openai-organization", "openai-project", "openai-version"):
        assert ex.response_header(name)
    assert (ex.response_header("x-request-id") or "").startswith("req_")
    assert int(ex.response_header("openai-processing-ms") or "x") == decision(up).processing_ms
    assert ex.response_header("content-type") == "application/json"
    c = client.chat.completions.create(model=OLD, messages=[{"role": "user", "content": "hi"}])
    assert c.id.startswith("chatcmpl-")
    assert up.log[0].response_header("x-request-id") != up.last.response_header("x-request-id")
    assert "__cf_bm=" in (up.last.response_header("set-cookie") or "")


def test_unknown_path_and_models(up: Upstream, client: openai.OpenAI) -> None:
    r = httpx.post(up.url + "/v1/nope", headers={"authorization": "Bearer x"}, json={})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (POST /v1/nope)"
    assert NEW in [m.id for m in client.models.list()]
    with pytest.raises(TypeError):
        OpenRouter.of(up)


# ------------------------------------------------- before GPT-5.6: automatic


def test_floor_and_128_steps(up: Upstream, client: openai.OpenAI) -> None:
    short = instructions(1000)  # 1005 tokens with "hi": nothing is kept
    for _ in range(2):
        r = client.responses.create(model=OLD, instructions=short, input="hi")
        assert usage(r).input_tokens == 1000 + HI
        assert cached(r) == 0 and written(r) == 0
    assert decision(up).stored == 0

    long = instructions(1300, "b")
    first = client.responses.create(model=OLD, instructions=long, input="hi")
    assert cached(first) == 0 and decision(up).stored == 1300 + HI
    again = client.responses.create(model=OLD, instructions=long, input="hi")
    assert cached(again) == 1280  # 1305 shared, in whole 128-token steps
    assert decision(up).matched == 1305
    other = client.responses.create(model=OLD, instructions=long, input="hello")
    # "<|user|>h" is shared: 9 characters, 2 whole tokens past the instructions
    assert decision(up).matched == 1302 and cached(other) == 1280
    assert (
        written(other) == 0 and usage(other).input_tokens_details.cache_write_tokens_details is None
    )

    just = instructions(1030, "c")  # 1035 shared: above the floor, one step
    client.responses.create(model=OLD, instructions=just, input="hi")
    assert cached(client.responses.create(model=OLD, instructions=just, input="hi")) == 1024


def test_chat_counts_the_same_way(up: Upstream, client: openai.OpenAI) -> None:
    system = "s" * (4 * 1200 - 18)  # "<|system|>" + text + "<|end|>\n": 1200 tokens
    messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=OLD, messages=messages)
    assert first.usage is not None and first.usage.prompt_tokens == 1200 + HI
    second = client.chat.completions.create(model=OLD, messages=messages)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 1152
    assert second.usage.prompt_tokens_details.cache_write_tokens is None
    assert second.service_tier == "default"


def test_routing_by_prefix_and_key(up: Upstream, client: openai.OpenAI) -> None:
    api = OpenAIAPI.of(up)
    text = instructions(1100)
    client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="a")
    da = decision(up)
    assert da.machine == int(da.route, 16) % api.cache.machines
    r = client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="b")
    db = decision(up)
    assert cached(r) == 0 and db.route != da.route  # another key: a cold cache
    assert db.lost is None  # nothing of key "b" was ever kept
    r = client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="a")
    assert cached(r) == 1024 and decision(up).machine == da.machine
    # the route hashes about the first 256 tokens: a change after them keeps the route
    r = client.responses.create(model=OLD, instructions=text, input="bye", prompt_cache_key="a")
    assert decision(up).route == da.route and cached(r) == 1024
    changed = "z" + text[1:]
    client.responses.create(model=OLD, instructions=changed, input="hi", prompt_cache_key="a")
    assert decision(up).route != da.route


def test_overflow_above_15_a_minute(
    up: Upstream, client: openai.OpenAI, clock: ManualClock
) -> None:
    text = instructions(1100)
    reads = []
    for _ in range(16):
        reads.append(cached(client.responses.create(model=OLD, instructions=text, input="hi")))
        clock.advance(1)
    home = up.log[0].cache.machine
    assert reads[0] == 0 and reads[1:15] == [1024] * 14
    assert reads[15] == 0  # the 16th in a minute went elsewhere and missed
    d = decision(up)
    assert d.overflow and d.machine != home and d.lost == "overflow" and d.lost_tokens == 1105
    assert d.stored == 0
    clock.advance(60)  # the minute has passed: one request, back home, a hit
    assert cached(client.responses.create(model=OLD, instructions=text, input="hi")) == 1024
    assert not decision(up).overflow and decision(up).machine == home


def test_forced_overflow(up: Upstream, client: openai.OpenAI) -> None:
    text = instructions(1100)
    client.responses.create(model=OLD, instructions=text, input="hi")
    r = client.responses.create(
        model=OLD, instructions=text, input="hi", extra_headers={"x-fake": "overflow"}
    )
    assert cached(r) == 0 and decision(up).overflow
    OpenAIAPI.of(up).cache.force_overflow()
    assert cached(client.responses.create(model=OLD, instructions=text, input="hi")) == 0
    assert cached(client.responses.create(model=OLD, instructions=text, input="hi")) == 1024


@pytest.mark.parametrize(
    ("retention", "alive", "dead"),
    [(None, 300, 301), ("in_memory", 300, 301), ("24h", 86400, 86401)],
)
def test_retention(
    up: Upstream,
    client: openai.OpenAI,
    clock: ManualClock,
    retention: Any,
    alive: int,
    dead: int,
) -> None:
    text = instructions(1100)
    extra = {} if retention is None else {"prompt_cache_retention": retention}
    r = client.responses.create(model=OLD, instructions=text, input="hi", **extra)
    assert r.prompt_cache_retention == (retention or "in_memory")
    clock.advance(alive)
    assert (
        cached(client.responses.create(model=OLD, instructions=text, input="hi", **extra)) == 1024
    )
    clock.advance(dead)  # idle since the read: gone
    assert cached(client.responses.create(model=OLD, instructions=text, input="hi", **extra)) == 0
    assert decision(up).lost == "expired" and decision(up).lost_tokens == 1100 + HI


@pytest.mark.parametrize(
    "change",
    [
        {"model": "gpt-4.1"},
        {"service_tier": "flex"},
        {"parallel_tool_calls": False},
        {"tools": [WEATHER_TOOL]},
        {"reasoning": {"effort": "high"}},
        {"text": {"verbosity": "low"}},
        {"text": {"format": {"type": "json_object"}}},
    ],
)
def test_what_changes_the_prefix(client: openai.OpenAI, change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"model": OLD, "instructions": instructions(1100), "input": "hi"}
    client.responses.create(**base)
    assert cached(client.responses.create(**base)) == 1024
    assert cached(client.responses.create(**{**base, **change})) == 0


def test_same_settings_spelled_differently(client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": OLD, "instructions": instructions(1100), "input": "hi"}
    client.responses.create(**base)
    spelled: dict[str, Any] = {
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "text": {"verbosity": "medium", "format": {"type": "text"}},
        "metadata": {"turn": "2"},
        "tool_choice": "auto",
    }
    assert cached(client.responses.create(**base, **spelled)) == 1024


def test_service_tier_echo(client: openai.OpenAI) -> None:
    tiers = {
        None: "default",
        "auto": "default",
        "flex": "flex",
        "priority": "priority",
        "fast": "priority",
    }
    for asked, ran in tiers.items():
        extra: dict[str, Any] = {} if asked is None else {"service_tier": asked}
        assert client.responses.create(model=OLD, input="hi", **extra).service_tier == ran
        chat = client.chat.completions.create(
            model=OLD, messages=[{"role": "user", "content": "hi"}], **extra
        )
        assert chat.service_tier == ran


# ------------------------------------------------ GPT-5.6: explicit and implicit


def test_explicit_mode_without_breakpoints_does_not_cache(
    up: Upstream, client: openai.OpenAI
) -> None:
    for _ in range(2):
        r = client.responses.create(
            model=NEW, input=[developer(1500)], prompt_cache_options={"mode": "explicit"}
        )
        assert cached(r) == 0 and written(r) == 0
    assert decision(up).writes == [] and OpenAIAPI.of(up).cache.entries() == []
    assert r.prompt_cache_options is not None and r.prompt_cache_options.mode == "explicit"


def test_explicit_breakpoint_writes_and_reads_exactly(up: Upstream, client: openai.OpenAI) -> None:
    opts: Any = {"mode": "explicit"}
    first = client.responses.create(
        model=NEW, input=[developer(1100, mark=EXPLICIT), USER_HI], prompt_cache_options=opts
    )
    total = usage(first).input_tokens
    assert total == 1100 + 3 + HI  # "go<|end|>\n": 10 characters
    assert cached(first) == 0 and written(first) == 1100
    assert usage(first).input_tokens_details.cache_write_tokens_details is not None
    assert usage(first).input_tokens_details.cache_write_tokens_details.ttl_30m_tokens == 1100
    assert decision(up).writes == [(1100, "30m")] and decision(up).uncached == total - 1100
    second = client.responses.create(
        model=NEW,
        input=[developer(1100, mark=EXPLICIT, tail="another tail"), USER_HI],
        prompt_cache_options=opts,
    )
    assert cached(second) == 1100 and written(second) == 0  # exact, no 128 steps
    assert decision(up).refreshed == [1100]


def test_breakpoint_below_the_minimum_writes_nothing(client: openai.OpenAI) -> None:
    opts: Any = {"mode": "explicit"}
    for _ in range(2):
        r = client.responses.create(
            model=NEW, input=[developer(1000, mark=EXPLICIT), USER_HI], prompt_cache_options=opts
        )
        assert cached(r) == 0 and written(r) == 0


def test_at_most_four_writes(up: Upstream, client: openai.OpenAI) -> None:
    parts = []
    for i in range(5):
        parts.append(
            {
                "type": "input_text",
                "text": chr(ord("a") + i) * 5000,
                "prompt_cache_breakpoint": EXPLICIT,
            }
        )
    item: Any = {"type": "message", "role": "developer", "content": parts}
    r = client.responses.create(model=NEW, input=[item], prompt_cache_options={"mode": "explicit"})
    # 1250 tokens a part; the first holds "<|developer|>" (13 characters), the last "<|end|>\n"
    ends = [1254, 2504, 3754, 5004, 6256]
    assert [t for t, _ in decision(up).writes] == ends[1:]  # not the first of five
    assert written(r) == 6256 and cached(r) == 0
    # implicit mode: the end of the prompt and the latest three breakpoints
    r = client.responses.create(
        model=NEW, input=[item, USER_HI], prompt_cache_options={"mode": "implicit"}
    )
    assert [t for t, _ in decision(up).writes] == [6256 + HI]
    assert decision(up).refreshed == ends[2:]
    assert cached(r) == 6256 and written(r) == HI


def test_implicit_mode_follows_a_conversation(up: Upstream, client: openai.OpenAI) -> None:
    text = instructions(1100)
    first = client.responses.create(model=NEW, instructions=text, input="hi")
    assert first.prompt_cache_options is not None and first.prompt_cache_options.mode == "implicit"
    assert cached(first) == 0 and written(first) == 1100 + HI
    second = client.responses.create(
        model=NEW,
        instructions=text,
        input=[USER_HI, *cast(list[Any], first.output), {"role": "user", "content": "and now?"}],
    )
    assert cached(second) == 1100 + HI  # exactly the first prompt
    assert written(second) == usage(second).input_tokens - 1100 - HI
    assert decision(up).uncached == 0


def test_explicit_ttl_refreshed_by_reads(
    up: Upstream, client: openai.OpenAI, clock: ManualClock
) -> None:
    text = instructions(1100)
    client.responses.create(model=NEW, instructions=text, input="hi")
    clock.advance(29 * 60)
    assert cached(client.responses.create(model=NEW, instructions=text, input="hi")) == 1105
    clock.advance(29 * 60)  # 58 minutes after the write, 29 after the read
    assert cached(client.responses.create(model=NEW, instructions=text, input="hi")) == 1105
    clock.advance(30 * 60 + 1)
    r = client.responses.create(model=NEW, instructions=text, input="hi")
    assert cached(r) == 0 and written(r) == 1105 and decision(up).lost == "expired"


def test_12h_ttl(up: Upstream, client: openai.OpenAI, clock: ManualClock) -> None:
    text = instructions(1100)
    opts: Any = {"ttl": "12h"}
    r = client.responses.create(model=NEW, instructions=text, input="hi", prompt_cache_options=opts)
    details = usage(r).input_tokens_details.cache_write_tokens_details
    assert details is not None and details.ttl_12h_tokens == 1105 and details.ttl_30m_tokens == 0
    clock.advance(11 * 3600)
    r = client.responses.create(model=NEW, instructions=text, input="hi", prompt_cache_options=opts)
    assert cached(r) == 1105
    assert r.prompt_cache_options is not None and r.prompt_cache_options.ttl == "12h"


def test_breakpoint_ttl_and_mixed_writes(up: Upstream, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=NEW,
        input=[developer(1100, mark={"mode": "explicit", "ttl": "12h"}), USER_HI],
    )
    details = usage(r).input_tokens_details.cache_write_tokens_details
    assert details is not None
    assert details.ttl_12h_tokens == 1100 and details.ttl_30m_tokens == 3 + HI
    assert written(r) == 1108 and decision(up).written_by_ttl == {"12h": 1100, "30m": 8}


def test_chat_breakpoints_and_usage(up: Upstream, client: openai.OpenAI) -> None:
    system: Any = {
        "role": "system",
        "content": [
            {"type": "text", "text": "s" * (4 * 1100 - 10), "prompt_cache_breakpoint": EXPLICIT},
            {"type": "text", "text": "rules"},
        ],
    }
    messages: Any = [system, {"role": "user", "content": "hi"}]
    opts: Any = {"mode": "explicit"}
    first = client.chat.completions.create(model=NEW, messages=messages, prompt_cache_options=opts)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cache_write_tokens == 1100
    messages[1]["content"] = "something else"
    second = client.chat.completions.create(model=NEW, messages=messages, prompt_cache_options=opts)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 1100
    assert second.usage.prompt_tokens_details.cache_write_tokens == 0


def test_options_are_ignored_before_56(up: Upstream, client: openai.OpenAI) -> None:
    opts: Any = {"mode": "explicit", "comparison_response_id": "resp_x"}
    r = client.responses.create(
        model=OLD,
        instructions=instructions(1100),
        input=[developer(1100, mark=EXPLICIT)],
        prompt_cache_options=opts,
    )
    assert r.prompt_cache_options is None and r.prompt_cache_diagnostics is None
    assert decision(up).generation == "automatic" and written(r) == 0


def test_bad_options(client: openai.OpenAI) -> None:
    bad: Any = {"ttl": "1h"}
    bad_retention: Any = "1h"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NEW, input="hi", prompt_cache_options=bad)
    assert e.value.param == "prompt_cache_options.ttl"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NEW, input=[developer(10, mark={"mode": "automatic"})])
    assert e.value.param == "prompt_cache_breakpoint.mode"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=OLD, input="hi", prompt_cache_retention=bad_retention)


# -------------------------------------------------------------------- usage shapes


def test_chat_stream_usage_only_when_asked(up: Upstream, client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model=NEW, messages=messages, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all("usage" not in json.loads(d) for d in up.last.sse_data()[:-1])
    assert up.last.sse_data()[-1] == "[DONE]"
    chunks = list(
        client.chat.completions.create(
            model=NEW, messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    raw = [json.loads(d) for d in up.last.sse_data()[:-1]]
    assert all(c["usage"] is None for c in raw[:-1])
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["prompt_tokens"] == HI
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cache_write_tokens == 0  # below the minimum
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello from fake openai"
    )
    assert all(c.service_tier == "default" for c in chunks)


def test_responses_stream(up: Upstream, client: openai.OpenAI) -> None:
    text = instructions(1100)
    client.responses.create(model=OLD, instructions=text, input="hi")
    with client.responses.stream(
        model=OLD, instructions=text, input="hi", reasoning={"summary": "auto"}
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == "Hello from fake openai"
    assert cached(final) == 1024 and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in kinds
    events = [json.loads(d) for d in up.last.sse_data()]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["usage"] is None
    done = events[-1]["response"]
    assert done["usage"]["input_tokens_details"] == {"cached_tokens": 1024, "cache_write_tokens": 0}
    reasoning = done["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"]
    assert "encrypted_content" not in reasoning
    assert b"[DONE]" not in up.last.decoded_body and not up.last.decoded_body.startswith(b":")


def test_responses_stream_without_obfuscation_and_with_encrypted_reasoning(
    up: Upstream, client: openai.OpenAI
) -> None:
    stream = client.responses.create(
        model=NEW,
        input="hi",
        stream=True,
        include=["reasoning.encrypted_content"],
        stream_options={"include_obfuscation": False},
    )
    last = list(stream)[-1]
    assert last.type == "response.completed"
    events = [json.loads(d) for d in up.last.sse_data()]
    assert not any("obfuscation" in e for e in events)
    assert str(events[-1]["response"]["output"][0]["encrypted_content"]).startswith("gAAAAA")


def test_echo(up: Upstream, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=NEW,
        instructions="Be brief.",
        input="hi",
        tools=[WEATHER_TOOL],
        text={"verbosity": "low"},
        reasoning={"effort": "low", "summary": "auto"},
        metadata={"run": "7"},
        prompt_cache_key="conv-1",
        prompt_cache_retention="24h",
        prompt_cache_options={"ttl": "30m"},
        service_tier="flex",
        store=False,
    )
    assert r.instructions == "Be brief."
    assert [t.name for t in r.tools if t.type == "function"] == ["get_weather"]
    assert r.text is not None and r.text.verbosity == "low"
    assert r.reasoning is not None and r.reasoning.effort == "low"
    assert r.reasoning.summary == "auto"
    assert r.metadata == {"run": "7"}
    assert r.prompt_cache_key == "conv-1" and r.prompt_cache_retention == "24h"
    assert r.prompt_cache_options is not None
    assert (r.prompt_cache_options.mode, r.prompt_cache_options.ttl) == ("implicit", "30m")
    assert r.service_tier == "flex" and json.loads(up.last.decoded_body)["store"] is False


def test_function_call_and_max_output_tokens(up: Upstream, client: openai.OpenAI) -> None:
    stream = client.responses.create(
        model=NEW, input="What's the weather in Tokyo?", tools=[WEATHER_TOOL], stream=True
    )
    kinds = [e.type for e in stream]
    assert "response.function_call_arguments.done" in kinds
    done = json.loads(up.last.sse_data()[-1])["response"]
    call = done["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Tokyo"} and call["call_id"].startswith(
        "call_"
    )
    chat = client.chat.completions.create(
        model=NEW,
        messages=[{"role": "user", "content": "weather in Tokyo?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
    )
    assert chat.choices[0].finish_reason == "tool_calls"
    calls = chat.choices[0].message.tool_calls
    assert calls is not None and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    cut = client.responses.create(model=NEW, input="hi", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and usage(cut).output_tokens == 2


def test_reasoning_effort_none(client: openai.OpenAI) -> None:
    r = client.responses.create(model=NEW, input="hi", reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"]
    assert r.usage is not None and usage(r).output_tokens_details.reasoning_tokens == 0


def test_previous_response_id(up: Upstream, client: openai.OpenAI) -> None:
    text = instructions(1100)
    first = client.responses.create(model=OLD, instructions=text, input="hi")
    second = client.responses.create(
        model=OLD, instructions=text, input="and?", previous_response_id=first.id
    )
    full = client.responses.create(
        model=OLD,
        instructions=text,
        input=[USER_HI, *cast(list[Any], first.output), {"role": "user", "content": "and?"}],
        store=False,
    )
    assert second.usage is not None and full.usage is not None
    assert usage(second).input_tokens == usage(full).input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=OLD, input="x", previous_response_id=full.id)
    assert e.value.code == "previous_response_not_found"


def test_errors(up: Upstream, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NEW, input="hi", extra_headers={"x-fake": "context_error"})
    assert e.value.code == "context_length_exceeded"
    OpenAIAPI.of(up).context_window = 100
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NEW, messages=[{"role": "user", "content": "x" * 1000}]
        )
    assert e.value.code == "context_length_exceeded" and "254 tokens" in e.value.message
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model=NEW, input="hi", extra_headers={"x-fake": "status=429"})
    stream = client.chat.completions.create(
        model=NEW,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-fake": "midstream_error,error_after=2"},
    )
    with pytest.raises(openai.APIError):
        list(stream)


# --------------------------------------------------------------------- diagnostics


def diag(r: Any) -> dict[str, Any]:
    assert r.prompt_cache_diagnostics is not None
    out: dict[str, Any] = r.prompt_cache_diagnostics.model_dump(exclude_none=True)
    return out


def compare(prev: Any, **extra: Any) -> Any:
    return {"comparison_response_id": prev.id, **extra}


def test_diagnosis_hit_and_not_asked(up: Upstream, client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": NEW, "instructions": instructions(1100), "input": "hi"}
    first = client.responses.create(**base)
    assert first.prompt_cache_diagnostics is None
    second = client.responses.create(**base, prompt_cache_options=compare(first))
    assert diag(second) == {"type": "cache_hit"}
    assert second.prompt_cache_options is not None
    assert second.prompt_cache_options.comparison_response_id == first.id
    assert decision(up).diagnosis == {"type": "cache_hit"}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model": "gpt-5.6-codex"}, "model_changed"),
        ({"prompt_cache_key": "other"}, "prompt_cache_key_changed"),
        ({"service_tier": "priority"}, "service_tier_changed"),
        ({"tools": [WEATHER_TOOL]}, "tools_changed"),
        ({"parallel_tool_calls": False}, "tools_changed"),
        ({"text": {"format": {"type": "json_object"}}}, "text_format_changed"),
        ({"reasoning": {"effort": "high"}}, "reasoning_effort_changed"),
        ({"text": {"verbosity": "high"}}, "verbosity_changed"),
    ],
)
def test_diagnosis_of_a_setting(client: openai.OpenAI, change: dict[str, Any], reason: str) -> None:
    base: dict[str, Any] = {"model": NEW, "instructions": instructions(1100), "input": "hi"}
    first = client.responses.create(**base)
    r = client.responses.create(**{**base, **change}, prompt_cache_options=compare(first))
    assert cached(r) == 0
    assert diag(r) == {
        "type": "cache_miss",
        "reason": reason,
        "cache_missed_tokens": usage(r).input_tokens,
        "comparison_reusable_tokens": 1100 + HI,
    }


def test_diagnosis_of_the_input(client: openai.OpenAI) -> None:
    first = client.responses.create(model=NEW, instructions=instructions(1100), input="hi")
    changed = instructions(1100)[:-40] + "b" * 40  # the last 10 tokens differ
    r = client.responses.create(
        model=NEW, instructions=changed, input="hi", prompt_cache_options=compare(first)
    )
    assert diag(r) == {
        "type": "cache_miss",
        "reason": "input_changed",
        "cache_missed_tokens": 10 + 2 + HI,  # from the change, and "<|end|>\n"
        "comparison_reusable_tokens": 1100 + HI,
    }
    compaction: Any = {"type": "compaction", "encrypted_content": "c" * 400}
    r = client.responses.create(
        model=NEW,
        instructions=instructions(1100),
        input=[compaction, USER_HI],
        prompt_cache_options=compare(first),
    )
    d = diag(r)
    assert d["reason"] == "context_compacted" and d["cache_missed_tokens"] == 100 + 4 + HI


def test_diagnosis_not_found_and_unavailable(up: Upstream, client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=NEW, input="hi", prompt_cache_options={"comparison_response_id": "resp_nope"}
    )
    assert diag(r) == {"type": "comparison_response_not_found"}
    base: dict[str, Any] = {"model": NEW, "instructions": instructions(1100), "input": "hi"}
    first = client.responses.create(**base)
    r = client.responses.create(
        **base,
        prompt_cache_options=compare(first),
        extra_headers={"x-fake": "diagnosis_unavailable"},
    )
    assert diag(r) == {"type": "unavailable"} and cached(r) == 1105
    OpenAIAPI.of(up).unavailable_next()
    assert diag(client.responses.create(**base, prompt_cache_options=compare(first))) == {
        "type": "unavailable"
    }
    assert diag(client.responses.create(**base, prompt_cache_options=compare(first))) == {
        "type": "cache_hit"
    }
    tiny = client.responses.create(model=NEW, input="hi")  # left nothing reusable
    r = client.responses.create(model=NEW, input="hi", prompt_cache_options=compare(tiny))
    assert diag(r) == {"type": "unavailable"}


def test_diagnosis_streamed_and_after_expiry(
    up: Upstream, client: openai.OpenAI, clock: ManualClock
) -> None:
    base: dict[str, Any] = {"model": NEW, "instructions": instructions(1100), "input": "hi"}
    first = client.responses.create(**base, store=False)
    clock.advance(31 * 60)
    with client.responses.stream(**base, prompt_cache_options=compare(first)) as stream:
        final = stream.get_final_response()
    # the same request: the provider says so, although the entry had expired
    assert diag(final) == {"type": "cache_hit"} and cached(final) == 0
    done = json.loads(up.last.sse_data()[-1])
    assert done["type"] == "response.completed"
    assert done["response"]["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    created = json.loads(up.last.sse_data()[0])
    assert created["response"]["prompt_cache_diagnostics"] is None


def test_diagnosis_changes_nothing_cached() -> None:
    """The same requests, with and without a diagnosis asked: the same usage and entries."""
    results = []
    for ask in (False, True):
        with Upstream("openai-api") as server:
            with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as c:
                text = instructions(1100)
                first = c.responses.create(model=NEW, instructions=text, input="hi")
                usages = []
                for tail in ("hi", "bye", "hi"):
                    extra: Any = {"prompt_cache_options": compare(first)} if ask else {}
                    r = c.responses.create(model=NEW, instructions=text, input=tail, **extra)
                    usages.append(r.usage.model_dump() if r.usage else None)
                entries = [(e.text, e.tokens) for e in OpenAIAPI.of(server).cache.entries()]
                results.append((usages, entries))
    assert results[0] == results[1]


# ------------------------------------------------------------------------ controls


def test_evict_machines_and_cold(up: Upstream, client: openai.OpenAI) -> None:
    api = OpenAIAPI.of(up)
    text = instructions(1100)
    client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="k")
    assert api.cache.evict(key="other") == 0
    assert api.cache.evict(key="k") == 1
    r = client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="k")
    assert cached(r) == 0 and decision(up).lost == "evicted"
    r = client.responses.create(
        model=OLD,
        instructions=text,
        input="hi",
        prompt_cache_key="k",
        extra_headers={"x-fake": "cache_miss"},
    )
    assert cached(r) == 0 and decision(up).stored == 1105
    api.cache.set_machines(1)
    r = client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="k")
    assert decision(up).machine == 0
    if up.log[-2].cache.machine != 0:
        assert cached(r) == 0  # its machine is gone
    else:
        assert cached(r) == 1024
    assert (
        cached(
            client.responses.create(model=OLD, instructions=text, input="hi", prompt_cache_key="k")
        )
        == 1024
    )


def test_codex_request_shape(up: Upstream) -> None:
    """A real Codex request (captured): its tools, items and cache key, streamed."""
    with gzip.open(FIXTURES / "codex-1.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    body = json.loads(first["request_body"]["text"])
    body["model"] = "gpt-5.5-codex"
    headers = {"authorization": "Bearer sk-test", "accept": "text/event-stream"}
    with httpx.Client(base_url=up.url, headers=headers, timeout=10) as h:
        for _ in range(2):
            r = h.post("/v1/responses", json=body)
            assert r.status_code == 200
    events = up.last.sse_events()
    assert events[-1][0] == "response.completed"
    done = json.loads(events[-1][1])["response"]
    total = done["usage"]["input_tokens"]
    assert total > 1024 and done["prompt_cache_key"] == body["prompt_cache_key"]
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == total // 128 * 128
    assert decision(up).key == body["prompt_cache_key"]


def test_flavours() -> None:
    with Upstream("openrouter") as server:
        assert isinstance(OpenRouter.of(server), OpenRouter)
    with contextlib.suppress(ValueError), Upstream("nope") as _:  # type: ignore[arg-type]
        raise AssertionError("an unknown flavour must be refused")


def test_compact_then_continue(up: Upstream, client: openai.OpenAI) -> None:
    text = instructions(1100)
    first = client.responses.create(model=NEW, instructions=text, input=[USER_HI])
    history: Any = [USER_HI, *first.output, {"role": "user", "content": "more"}]
    second = client.responses.create(model=NEW, instructions=text, input=history)
    compacted = client.responses.compact(model=NEW, instructions=text, input=history)
    assert compacted.object == "response.compaction"
    kinds = [getattr(o, "type", None) for o in compacted.output]
    assert kinds == ["message", "message", "compaction"]  # the two user messages, then it
    assert compacted.usage.input_tokens == decision(up).prompt_tokens
    # sent back as the JSON it came in: the SDK types compaction output as output items
    raw: Any = json.loads(up.last.decoded_body)["output"]
    r = client.responses.create(
        model=NEW,
        instructions=text,
        input=[*raw, {"role": "user", "content": "go on"}],
        prompt_cache_options=compare(second),
    )
    d = diag(r)
    assert d["reason"] == "context_compacted"
    assert d["comparison_reusable_tokens"] == usage(second).input_tokens
    assert cached(r) == 1100 + HI  # the instructions and the first message are still shared
