"""R35's verdict on a provider turn, as pure code: the order of the causes, the granule, the
time-to-live, the lookback, and what a miss cost (R36); R37's agreement words."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmp.analysis.causes import (
    BREAKPOINT_TOO_FAR,
    CACHE_EXPIRED,
    CACHE_KEY_CHANGED,
    HISTORY_REWRITTEN,
    MODEL_CHANGED,
    PROVIDER_EVICTED,
    SETTINGS_CHANGED,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
)
from llmp.analysis.config import Config
from llmp.analysis.cost import Rates
from llmp.analysis.loss import Structure
from llmp.analysis.provider import (
    ProviderTurn,
    agrees,
    client_cause,
    comparable,
    family_of,
    miss_usd,
    verdict,
)
from llmp.apis.base import CacheUsage, Counts
from llmp.format.measure import SERVER

CFG = Config()


def turn(
    family: str = "openai",
    *,
    read: int = 0,
    write: int = 0,
    uncached: int = 2000,
    left: int | None = 2000,
    at_ms: int = 0,
    lives_s: int = 300,
    granule: int = 128,
    key: str | None = "k",
    settings: tuple[tuple[str, str], ...] = (),
    breakpoints: tuple[int, ...] = (),
) -> ProviderTurn:
    return ProviderTurn(
        provider=family,
        family=family,
        model="m",
        usage=CacheUsage(read=read, write=write, write_1h=0, uncached=uncached),
        settings=settings,
        key=key,
        breakpoints=breakpoints,
        at_ms=at_ms,
        lives_s=lives_s,
        left=left,
        granule=granule,
        minimum=1024,
        explicit=bool(breakpoints),
    )


def linked(break_cause: str | None = None) -> Structure:
    st = Structure((100, SERVER), (100, SERVER), (1800, SERVER), (20, SERVER), linked=True)
    st.prefix = 2000
    st.break_cause = break_cause
    return st


def counts(now: ProviderTurn) -> Counts:
    assert now.usage is not None
    return Counts.server(now.usage.prompt, 10, now.usage.read, now.usage.prompt - now.usage.read)


def decide(
    now: ProviderTurn, last: ProviderTurn, st: Structure | None = None, *, at_ms: int = 1000
) -> tuple[str | None, int, bool]:
    """(cause, tokens, external) of `now` against `last`; (None, 0, False) for no loss."""
    v, _ = verdict(st or linked(), counts(now), now, last, False, CFG, at_ms)
    loss = v.lost_client or v.lost_external
    if loss is None:
        return None, 0, False
    return loss.cause, loss.tokens, v.lost_external is not None


def test_family_of_a_gateway_is_the_models_maker() -> None:
    assert family_of("openrouter", "anthropic/claude-sonnet-4.5") == "anthropic"
    assert family_of("openrouter", "openai/gpt-5") == "openai"
    assert family_of("openrouter", None) == "openai"
    assert family_of("anthropic", "whatever") == "anthropic"


@pytest.mark.parametrize(("short", "lost"), [(127, False), (128, True), (0, False)])
def test_a_shortfall_under_one_granule_is_no_loss(short: int, lost: bool) -> None:
    last = turn(uncached=2000, left=2000)
    now = turn(read=2000 - short, uncached=short + 40)
    cause, tokens, external = decide(now, last)
    assert (cause is not None) == lost
    if lost:
        assert (cause, tokens, external) == (PROVIDER_EVICTED, short, True)


def test_anthropic_counts_every_token() -> None:
    last = turn("anthropic", read=1500, write=500, uncached=0, left=2000, granule=1)
    now = turn("anthropic", read=1999, write=30, uncached=0, granule=1)
    assert decide(now, last) == (PROVIDER_EVICTED, 1, True)


def test_an_unchanged_prefix_expires_after_its_time_to_live_else_is_evicted() -> None:
    last = turn(at_ms=0, lives_s=300)
    now = turn(read=0, uncached=2040)
    assert decide(now, last, at_ms=299_000) == (PROVIDER_EVICTED, 2000, True)
    assert decide(now, last, at_ms=301_000) == (CACHE_EXPIRED, 2000, True)


def test_the_lookback_comes_before_the_time_to_live() -> None:
    last = turn("anthropic", write=2000, uncached=0, granule=1, breakpoints=(3,))
    far = turn("anthropic", write=2040, uncached=0, granule=1, breakpoints=(23,))
    near = replace(far, breakpoints=(10, 23))
    assert decide(far, last, at_ms=999_000) == (BREAKPOINT_TOO_FAR, 2000, False)
    assert decide(near, last, at_ms=999_000) == (CACHE_EXPIRED, 2000, True)
    assert decide(replace(far, breakpoints=(22,)), last) == (PROVIDER_EVICTED, 2000, True)


def test_a_clients_change_is_charged_to_the_client() -> None:
    last = turn()
    now = turn(read=0, uncached=2040)
    assert decide(now, last, linked(SYSTEM_CHANGED)) == (SYSTEM_CHANGED, 2000, False)
    assert decide(replace(now, key="other"), last) == (CACHE_KEY_CHANGED, 2000, False)


def test_the_cause_is_the_earliest_change_in_the_providers_own_order() -> None:
    base = turn("openai")
    keyed = replace(base, key="other", settings=(("reasoning.effort", "low"),))
    assert client_cause(linked(TOOLS_CHANGED), base, base, True) == MODEL_CHANGED
    # OpenAI: the key, then the settings, select the cache before any token
    assert client_cause(linked(TOOLS_CHANGED), keyed, base, False) == CACHE_KEY_CHANGED
    tuned = replace(base, settings=(("reasoning.effort", "low"),))
    assert client_cause(linked(TOOLS_CHANGED), tuned, base, False) == SETTINGS_CHANGED
    assert client_cause(linked(HISTORY_REWRITTEN), base, base, False) == HISTORY_REWRITTEN
    # Anthropic: the settings reach the messages only; the key means nothing there
    a = turn("anthropic", key=None)
    a_tuned = replace(a, settings=(("tool_choice", "any"),), key="x")
    assert client_cause(linked(TOOLS_CHANGED), a_tuned, a, False) == TOOLS_CHANGED
    assert client_cause(linked(SYSTEM_CHANGED), a_tuned, a, False) == SYSTEM_CHANGED
    assert client_cause(linked(HISTORY_REWRITTEN), a_tuned, a, False) == SETTINGS_CHANGED
    assert client_cause(linked(None), a_tuned, a, False) == SETTINGS_CHANGED


def test_nothing_is_charged_without_the_providers_counts() -> None:
    last = turn(left=None)
    now = turn(read=0, uncached=2040)
    assert decide(now, last) == (None, 0, False)
    v, why = verdict(linked(), counts(now), now, None, False, CFG, 0)
    assert v.lost_client is None and v.lost_external is None and why is None


def test_a_miss_is_billed_as_the_hour_writes_then_the_five_minute_ones_then_input() -> None:
    rates = Rates(input=3e-6, output=15e-6, cache_read=0.3e-6, cache_write_5m=3.75e-6,
                  cache_write_1h=6e-6)  # fmt: skip
    usage = CacheUsage(read=0, write=1500, write_1h=1000, uncached=700)
    got = miss_usd(rates, usage, 2000)
    want = 1000 * (6e-6 - 0.3e-6) + 500 * (3.75e-6 - 0.3e-6) + 500 * (3e-6 - 0.3e-6)
    assert got == pytest.approx(want)
    assert miss_usd(None, usage, 2000) is None
    assert miss_usd(rates, None, 2000) is None


@pytest.mark.parametrize(
    ("llmp", "reason", "provider", "agree"),
    [
        (None, "none", "anthropic", True),
        (None, "system_changed", "anthropic", False),
        (SYSTEM_CHANGED, "system_changed", "anthropic", True),
        (SYSTEM_CHANGED, "input_changed", "openai", True),
        (SYSTEM_CHANGED, "input_changed", "anthropic", False),
        (HISTORY_REWRITTEN, "messages_changed", "anthropic", True),
        (SETTINGS_CHANGED, "reasoning_effort_changed", "openai", True),
        (CACHE_KEY_CHANGED, "prompt_cache_key_changed", "openai", True),
        (CACHE_EXPIRED, "none", "anthropic", True),
        (PROVIDER_EVICTED, "none", "openai", True),
        (PROVIDER_EVICTED, "tools_changed", "openai", False),
        (TOOLS_CHANGED, "system_changed", "anthropic", False),
    ],
)
def test_agreement_words(llmp: str | None, reason: str, provider: str, agree: bool) -> None:
    assert agrees(llmp, reason, provider) is agree


def test_what_compares() -> None:
    assert comparable("none") and comparable("system_changed")
    for reason in (None, "unavailable", "previous_message_not_found", "not_ready"):
        assert not comparable(reason)
