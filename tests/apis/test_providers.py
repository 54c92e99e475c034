"""The cloud providers' cache facts (apis/providers.py over provider_caches.toml)."""

from __future__ import annotations

import pytest

from llmp.apis import providers as p


@pytest.mark.parametrize(
    ("model", "tokens"),
    [
        ("claude-opus-4-5", 4096),
        ("claude-opus-4-6-20260101", 4096),
        ("claude-haiku-4-5-20251001", 4096),
        ("claude-opus-4-7", 2048),
        ("claude-3-haiku-20240307", 2048),
        ("claude-opus-4-8", 1024),
        ("claude-sonnet-4-5", 1024),
        ("claude-sonnet-5", 1024),
        ("claude-sonnet-5-5", 512),
        ("claude-opus-5", 512),
        ("claude-3-5-sonnet-20241022", 1024),
        ("something-else", 1024),
    ],
)
def test_anthropic_minimum_lengths_follow_the_documented_table(model: str, tokens: int) -> None:
    assert p.anthropic_minimum_tokens(model) == tokens


@pytest.mark.parametrize(
    ("model", "explicit"),
    [
        ("gpt-5.6", True),
        ("gpt-5.6-mini", True),
        ("openai/gpt-5.7", True),
        ("gpt-6", True),
        ("gpt-5.5-codex", False),
        ("gpt-5", False),
        ("gpt-4o", False),
        ("o3", False),
        ("llama", False),
    ],
)
def test_openai_generation_by_version(model: str, explicit: bool) -> None:
    assert p.openai_explicit(model) is explicit
    rules = p.openai_cache(model)
    assert rules.granule_tokens == (1 if explicit else 128)
    assert (rules.write_multiplier > 0) is explicit


def test_provider_is_told_by_host_then_header_then_usage() -> None:
    assert p.provider_of("API.Anthropic.com") == p.ANTHROPIC
    assert p.provider_of("api.openai.com") == p.OPENAI
    assert p.provider_of("openrouter.ai") == p.OPENROUTER
    assert p.provider_of("127.0.0.1") is None
    assert p.provider_of(None, {"request-id": "req_011abc"}) == p.ANTHROPIC
    assert p.provider_of(None, {"request-id": "abc"}) is None
    assert p.provider_of("10.0.0.2", {"openai-processing-ms": "31"}) == p.OPENAI
    # The host wins over a header.
    assert p.provider_of("api.openai.com", {"anthropic-organization-id": "x"}) == p.OPENAI
    anthropic_usage = {"cache_creation_input_tokens": 0, "cache_creation": {}}
    assert p.provider_of(None, None, anthropic_usage) == p.ANTHROPIC
    responses_usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}}
    assert p.provider_of(None, None, responses_usage) == p.OPENAI
    # llama-server's Responses usage has the same shape, with its timings beside it.
    assert p.provider_of(None, None, responses_usage, timings=True) is None


def test_time_to_live_and_retention() -> None:
    assert p.anthropic_ttl_seconds(None) == 300
    assert p.anthropic_ttl_seconds("5m") == 300
    assert p.anthropic_ttl_seconds("1h") == 3600
    assert p.openai_retention_seconds(None) == 300
    assert p.openai_retention_seconds("in_memory") == 300
    assert p.openai_retention_seconds("24h") == 86400
    assert p.openai_retention_seconds("in_memory", "30m") == 1800
    assert p.parse_ttl("nonsense") is None
