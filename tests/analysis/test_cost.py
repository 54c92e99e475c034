"""Cost in US dollars (R36): `llmp.analysis.cost` against hand arithmetic, genai-prices'
own `calc_price`, dates, service tiers, `--prices` files and the loss helper."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tomllib
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import pytest
from genai_prices import Usage, calc_price

from llmp.analysis import cost
from llmp.analysis.config import Config
from llmp.analysis.cost import Override, Prices, PricesFileError, Rates, default_prices
from llmp.apis.providers import facts
from llmp.cli import main
from tests.support import scenarios as sc

M = 1e-6  # a per-million price, per token

# Anthropic's documented multipliers (wire-formats, "Cloud prompt caches", Prices):
# 5-minute writes 1.25x input, 1-hour writes 2x, reads 0.1x.
W5, W1H, READ = 1.25, 2.0, 0.1


def ms(year: int, month: int, day: int, hour: int = 12) -> int:
    return int(datetime(year, month, day, hour, tzinfo=UTC).timestamp() * 1000)


NOW = ms(2026, 11, 1)


def uncached_cost(prices: Prices, model: str, provider: str, t_ms: int, n: int) -> float | None:
    return prices.cost(
        model, provider, t_ms, uncached=n, cache_read=0, write_5m=0, write_1h=0, output=0
    )


def close(a: float | None, b: float) -> bool:
    """Within 0.1 % (the brief's tolerance for a row's cost)."""
    return a is not None and abs(a - b) <= 1e-3 * abs(b)


# -- rows against hand arithmetic --------------------------------------------------


# (model as the harness sends it, input $/M, output $/M): wire-formats, "Prices".
ANTHROPIC_MODELS = [
    ("claude-sonnet-4-5-20250929", 3.0, 15.0),
    ("claude-opus-4-5-20251101", 5.0, 25.0),
    ("claude-haiku-4-5-20251001", 1.0, 5.0),
]


@pytest.mark.parametrize(("model", "inp", "out"), ANTHROPIC_MODELS)
def test_anthropic_row_cost_by_hand(model: str, inp: float, out: float) -> None:
    got = Prices().cost(
        model,
        "anthropic",
        NOW,
        uncached=1_200,
        cache_read=50_000,
        write_5m=2_000,
        write_1h=3_000,
        output=700,
    )
    want = (
        1_200 * inp + 50_000 * inp * READ + 2_000 * inp * W5 + 3_000 * inp * W1H + 700 * out
    ) * M
    assert close(got, want), (got, want)


def test_multipliers_are_the_documented_ones() -> None:
    """The hand arithmetic's multipliers are provider_caches.toml's."""
    a = facts()["anthropic"]
    assert (a["write_multiplier"]["5m"], a["write_multiplier"]["1h"], a["read_multiplier"]) == (
        W5,
        W1H,
        READ,
    )


def test_openai_gpt5_writes_are_plain_input() -> None:
    """Before GPT-5.6 OpenAI has no write fee: a written token costs what input does.
    gpt-5: $1.25 in, $0.125 cached, $10 out (genai-prices 0.2.5, OpenAI's price page)."""
    prices = Prices()
    r = prices.rates("gpt-5-2025-08-07", "openai", NOW)
    assert r is not None
    assert r.cache_write_5m == r.input == pytest.approx(1.25 * M)
    got = prices.cost(
        "gpt-5",
        "openai",
        NOW,
        uncached=1_000,
        cache_read=8_192,
        write_5m=512,
        write_1h=0,
        output=300,
    )
    assert close(got, (1_000 * 1.25 + 8_192 * 0.125 + 512 * 1.25 + 300 * 10.0) * M)


def test_openai_gpt56_has_a_write_price() -> None:
    """GPT-5.6 writes at 1.25x and reads at 0.1x of input (provider_caches.toml's
    explicit generation); gpt-5.6 is $4 in, $20 out since 2026-08-21 (genai-prices)."""
    explicit = facts()["openai"]["explicit"]
    r = Prices().rates("gpt-5.6", "openai", NOW)
    assert r is not None
    assert r.input == pytest.approx(4.0 * M) and r.output == pytest.approx(20.0 * M)
    assert r.cache_write_5m == pytest.approx(r.input * explicit["write_multiplier"])
    assert r.cache_read == pytest.approx(r.input * explicit["read_multiplier"])
    got = Prices().cost(
        "gpt-5.6",
        "openai",
        NOW,
        uncached=2_000,
        cache_read=40_000,
        write_5m=6_000,
        write_1h=0,
        output=1_000,
    )
    assert close(got, (2_000 * 4 + 40_000 * 0.4 + 6_000 * 5 + 1_000 * 20) * M)


@pytest.mark.parametrize(
    ("model", "provider", "t_ms", "tier", "read", "w5", "w1h", "uncached", "out"),
    [
        ("claude-sonnet-4-5-20250929", "anthropic", NOW, None, 90_000, 4_000, 2_000, 10, 800),
        # Above 200k tokens the whole request is at the long-context rates.
        ("claude-sonnet-4-5", "anthropic", NOW, None, 190_000, 9_000, 2_000, 10, 800),
        ("claude-opus-4-6", "anthropic", ms(2026, 3, 1), None, 250_000, 0, 0, 5, 100),
        ("claude-haiku-4-5", "anthropic", NOW, None, 0, 0, 70_000, 3, 10),
        ("gpt-5", "openai", NOW, "flex", 30_000, 0, 0, 1_000, 500),
        ("gpt-5.5", "openai", NOW, "priority", 300_000, 0, 0, 1_000, 500),
        ("gpt-5.6", "openai", ms(2026, 8, 1), None, 100_000, 20_000, 0, 300, 50),
        ("gpt-5.6", "openai", NOW, None, 270_000, 5_000, 0, 300, 50),
        ("anthropic/claude-sonnet-4.5", "openrouter", NOW, None, 10_000, 1_000, 0, 50, 20),
        ("openai/gpt-5", "openrouter", NOW, None, 10_000, 0, 0, 50, 20),
    ],
)
def test_cost_is_genai_prices_own(
    model: str,
    provider: str,
    t_ms: int,
    tier: str | None,
    read: int,
    w5: int,
    w1h: int,
    uncached: int,
    out: int,
) -> None:
    """A row's cost is what genai-prices' `calc_price` says for the same usage, at the
    same date and tier (the rates are read from it, not copied)."""
    got = Prices().cost(
        model,
        provider,
        t_ms,
        uncached=uncached,
        cache_read=read,
        write_5m=w5,
        write_1h=w1h,
        output=out,
        tier=tier,
    )
    usage = Usage(
        input_tokens=uncached + read + w5 + w1h,
        cache_read_tokens=read,
        cache_write_tokens=w5 + w1h,
        cache_write_5m_tokens=w5,
        cache_write_1h_tokens=w1h,
        output_tokens=out,
    )
    want = calc_price(
        usage,
        model,
        provider_id=provider,
        genai_request_timestamp=datetime.fromtimestamp(t_ms / 1000, UTC),
        price_context={"service_tier": tier} if tier else None,
    ).total_price
    assert got == pytest.approx(float(want), rel=1e-9)


def test_long_context_tier_starts_above_its_threshold() -> None:
    prices = Prices()
    at = prices.rates("claude-sonnet-4-5", "anthropic", NOW, prompt_tokens=200_000)
    above = prices.rates("claude-sonnet-4-5", "anthropic", NOW, prompt_tokens=200_001)
    assert at is not None and above is not None
    assert at.input == pytest.approx(3.0 * M) and above.input == pytest.approx(6.0 * M)


# -- the date ----------------------------------------------------------------------


def test_a_price_change_is_priced_at_the_request_date() -> None:
    """OpenAI cut gpt-5.6 (Sol) from $5 to $4 input on 2026-08-21 (genai-prices' history)."""
    prices = Prices()
    before = prices.rates("gpt-5.6", "openai", ms(2026, 8, 20, 23))
    after = prices.rates("gpt-5.6", "openai", ms(2026, 8, 21, 0))
    assert before is not None and after is not None
    assert before.input == pytest.approx(5.0 * M) and after.input == pytest.approx(4.0 * M)
    assert uncached_cost(prices, "gpt-5.6", "openai", ms(2026, 8, 1), 10_000) == pytest.approx(0.05)
    assert uncached_cost(prices, "gpt-5.6", "openai", ms(2026, 9, 1), 10_000) == pytest.approx(0.04)


def test_opus_46_long_context_price_ended() -> None:
    """Opus 4.6 billed prompts above 200k at $10 input until 2026-03-13, then $5 flat."""
    prices = Prices()
    before = prices.rates("claude-opus-4-6", "anthropic", ms(2026, 3, 1), prompt_tokens=300_000)
    after = prices.rates("claude-opus-4-6", "anthropic", ms(2026, 4, 1), prompt_tokens=300_000)
    assert before is not None and after is not None
    assert (before.input, after.input) == pytest.approx((10.0 * M, 5.0 * M))


def test_the_list_is_asked_once_per_model_and_day(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    real = cost._listed

    def counting(*args: object) -> object:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cost, "_listed", counting)
    prices = Prices()
    for i in range(500):  # one UTC day, every prompt length
        assert prices.rates("gpt-5", "openai", ms(2026, 11, 1, 0) + i * 60_000, None, i) is not None
    assert prices.rates("gpt-5", "openai", ms(2026, 11, 2, 0)) is not None
    assert prices.rates("gpt-5", "openai", ms(2026, 11, 2, 0), "flex") is not None
    assert len(calls) == 3


# -- unknown models, names, providers ----------------------------------------------


def test_unknown_model_is_never_guessed() -> None:
    prices = Prices()
    assert prices.rates("qwen3-coder-30b", "openai", NOW) is None
    assert uncached_cost(prices, "claude-nonesuch-9", "anthropic", NOW, 1) is None
    # The list matches OpenRouter's own spelling, not another one.
    assert prices.rates("anthropic/claude-sonnet-4-5", "openrouter", NOW) is None
    # A vendor prefix is OpenRouter's way; the OpenAI API's list does not know it.
    assert prices.rates("openai/gpt-5", "openai", NOW) is None


@pytest.mark.parametrize(
    ("model", "provider", "same_as"),
    [
        ("claude-sonnet-4-5-20250929", "anthropic", "claude-sonnet-4-5"),
        ("CLAUDE-SONNET-4-5", "anthropic", "claude-sonnet-4-5"),
        ("gpt-5-2025-08-07", "openai", "gpt-5"),
        ("gpt-5.6", "openai", "gpt-5.6-sol"),
        ("anthropic/claude-sonnet-4.5", "openrouter", "claude-sonnet-4-5"),
    ],
)
def test_names_as_harnesses_send_them(model: str, provider: str, same_as: str) -> None:
    prices = Prices()
    r = prices.rates(model, provider, NOW)
    listed = prices.rates(same_as, "anthropic" if "claude" in same_as else "openai", NOW)
    assert r is not None and listed is not None
    assert (r.input, r.output, r.cache_read, r.cache_write_5m) == (
        listed.input,
        listed.output,
        listed.cache_read,
        listed.cache_write_5m,
    )


def test_no_provider_no_price() -> None:
    """R36: a local server's rows are not priced, whatever the model's name."""
    prices = Prices()
    assert prices.rates("gpt-5", None, NOW) is None
    assert prices.rates("claude-sonnet-4-5", "llama-server", NOW) is None
    assert prices.rates("", "openai", NOW) is None


def test_one_hour_writes_at_their_own_rate_where_the_list_has_none() -> None:
    """OpenRouter's Claude entries have no 1-hour write price; genai-prices would bill such
    a write as a 5-minute one.  R36 wants its own rate: 2x input (Anthropic's)."""
    r = Prices().rates("anthropic/claude-sonnet-4.5", "openrouter", NOW)
    assert r is not None
    assert r.cache_write_5m == pytest.approx(3.0 * W5 * M)
    assert r.cache_write_1h == pytest.approx(3.0 * W1H * M)
    theirs = calc_price(
        Usage(input_tokens=100_000, cache_write_tokens=100_000, cache_write_1h_tokens=100_000),
        "anthropic/claude-sonnet-4.5",
        provider_id="openrouter",
        genai_request_timestamp=datetime.fromtimestamp(NOW / 1000, UTC),
    ).total_price
    assert float(theirs) == pytest.approx(100_000 * 3.75 * M)  # the fallback not taken


# -- service tiers -----------------------------------------------------------------


def test_service_tiers_from_the_list() -> None:
    """genai-prices prices OpenAI's flex (half) and priority (double) tiers; `default`,
    `scale` and any other tier are at the standard rates."""
    prices = Prices()
    std = prices.rates("gpt-5", "openai", NOW)
    flex = prices.rates("gpt-5", "openai", NOW, "flex")
    prio = prices.rates("gpt-5", "openai", NOW, "priority")
    assert std is not None and flex is not None and prio is not None
    assert (flex.input, flex.cache_read, flex.output) == pytest.approx(
        (std.input / 2, std.cache_read / 2, std.output / 2)
    )
    assert (prio.input, prio.cache_read, prio.output) == pytest.approx(
        (std.input * 2, std.cache_read * 2, std.output * 2)
    )
    for tier in ("default", "scale", "auto", ""):
        assert prices.rates("gpt-5", "openai", NOW, tier) == std
    # Anthropic's list has no service-tier prices: standard.
    assert prices.rates("claude-opus-4-5", "anthropic", NOW, "priority") == prices.rates(
        "claude-opus-4-5", "anthropic", NOW
    )


def test_tier_prices_only_from_when_the_list_has_them() -> None:
    """The list verified tier prices on 2026-10-12 and models no earlier history."""
    prices = Prices()
    earlier = ms(2026, 10, 1)
    assert prices.rates("gpt-5", "openai", earlier, "flex") == prices.rates(
        "gpt-5", "openai", earlier
    )


# -- the loss helper ---------------------------------------------------------------


def test_miss_usd_is_what_the_miss_cost_beyond_a_read() -> None:
    r = Prices().rates("claude-sonnet-4-5", "anthropic", NOW)
    assert r is not None
    # 10k tokens written again for 5 minutes, 4k for an hour, 1k sent uncached, where
    # reading all 15k would have cost $0.30/M.
    got = r.miss_usd(written_5m=10_000, written_1h=4_000, uncached=1_000)
    want = (10_000 * (3.75 - 0.3) + 4_000 * (6.0 - 0.3) + 1_000 * (3.0 - 0.3)) * M
    assert got == pytest.approx(want)
    assert r.miss_usd() == 0.0


def test_miss_usd_on_openai_before_56() -> None:
    """No write fee: a re-written token is input, $1.25 against $0.125 for a read."""
    r = Prices().rates("gpt-5", "openai", NOW)
    assert r is not None
    assert r.miss_usd(written_5m=1_024) == pytest.approx(1_024 * (1.25 - 0.125) * M)
    assert r.miss_usd(written_5m=1_024) == pytest.approx(r.miss_usd(uncached=1_024))


def test_usd_adds_up_the_kinds() -> None:
    r = Rates(input=1.0, output=10.0, cache_read=0.1, cache_write_5m=1.25, cache_write_1h=2.0)
    assert r.usd(uncached=1, cache_read=2, write_5m=3, write_1h=4, output=5) == pytest.approx(
        1 + 0.2 + 3.75 + 8 + 50
    )


# -- --prices files ----------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "prices.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


FULL = """
["claude-sonnet-4-5"]
input = 2.4
output = 12.0
cache_read = 0.24
cache_write_5m = 3.0
cache_write_1h = 4.8
"""


def test_prices_file_overrides_the_list(tmp_path: Path) -> None:
    prices = Prices.from_file(write(tmp_path, FULL))
    assert prices.label == f"genai-prices {version('genai-prices')} and prices.toml"
    # The key is the list's model id, so the dated name the API answers with matches it.
    r = prices.rates("claude-sonnet-4-5-20250929", "anthropic", NOW)
    assert r == Rates(2.4 * M, 12.0 * M, 0.24 * M, 3.0 * M, 4.8 * M)
    # At every prompt length, date and tier: negotiated rates have no long-context tier.
    assert prices.rates("claude-sonnet-4-5", "anthropic", ms(2025, 1, 1), "x", 500_000) == r
    # Other models keep the list's prices.
    other = prices.rates("claude-opus-4-5", "anthropic", NOW)
    assert other is not None and other.input == pytest.approx(5.0 * M)


def test_prices_file_derives_missing_rates_from_the_lists_ratios(tmp_path: Path) -> None:
    path = write(tmp_path, '["claude-sonnet-4-5"]\ninput = 2.4\noutput = 12.0\n')
    r = Prices.from_file(path).rates("claude-sonnet-4-5", "anthropic", NOW)
    assert r is not None
    assert (r.cache_read, r.cache_write_5m, r.cache_write_1h) == pytest.approx(
        (0.24 * M, 3.0 * M, 4.8 * M)
    )


def test_prices_file_prices_a_model_the_list_lacks(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '["claude-custom-9"]\ninput = 1\noutput = 2\n'
        '["gpt-4-internal"]\ninput = 1\noutput = 2\n'
        '["gpt-4-internal-b"]\ninput = 1\noutput = 2\ncache_read = 0.5\n'
        '["gpt-5.6-codex"]\ninput = 4\noutput = 20\n',
    )
    prices = Prices.from_file(path)
    # Anthropic's documented multipliers.
    claude = prices.rates("claude-custom-9", "anthropic", NOW)
    assert claude is not None
    assert (claude.cache_read, claude.cache_write_5m, claude.cache_write_1h) == pytest.approx(
        (READ * M, W5 * M, W1H * M)
    )
    # OpenAI before GPT-5.6: writes are input; no documented read discount, so without a
    # cache_read the model stays unpriced rather than guessed.
    assert prices.rates("gpt-4-internal", "openai", NOW) is None
    b = prices.rates("gpt-4-internal-b", "openai", NOW)
    assert b is not None and b.cache_write_5m == b.input == pytest.approx(1 * M)
    assert b.cache_read == pytest.approx(0.5 * M)
    # GPT-5.6 and later: the explicit generation's multipliers.
    codex = prices.rates("gpt-5.6-codex", "openai", NOW)
    assert codex is not None
    assert (codex.cache_write_5m, codex.cache_read) == pytest.approx((5.0 * M, 0.4 * M))
    # Not on a provider: still not priced.
    assert prices.rates("claude-custom-9", None, NOW) is None


def test_overrides_in_code() -> None:
    prices = Prices({"GPT-5": Override(input=1 * M, output=8 * M, cache_read=0.1 * M)})
    assert prices.label == f"genai-prices {version('genai-prices')} and overrides"
    r = prices.rates("gpt-5", "openai", NOW)
    assert r is not None and r.cache_write_5m == pytest.approx(1 * M)  # gpt-5: writes = input
    assert Prices().label == f"genai-prices {version('genai-prices')}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("input = 3", "[input] must be a table"),
        ('["m"]\ninput = 3\n', "[m] needs output"),
        ('["m"]\noutput = 3\n', "[m] needs input"),
        ('["m"]\ninput = 3\noutput = 15\ncache_write = 1\n', "[m] has no rate 'cache_write'"),
        ('["m"]\ninput = "3"\noutput = 15\n', "[m] input must be a number"),
        ('["m"]\ninput = true\noutput = 15\n', "[m] input must be a number"),
        ('["m"]\ninput = 3\noutput = -1\n', "[m] output must be 0 or more"),
        ('["m"]\ninput = 3\noutput = nan\n', "[m] output must be 0 or more"),
        ('["m"]\ninput = 3\noutput = 1\n["M"]\ninput = 3\noutput = 1\n', "[M] is given twice"),
        ('["claude/x.1"]\ninput = 3\n', '["claude/x.1"] needs output'),
        ('["m"\ninput = 3\n', "not TOML"),
    ],
)
def test_bad_prices_file(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PricesFileError) as info:
        Prices.from_file(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"--prices {path}: ")
    assert says in str(info.value)


def test_missing_prices_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(PricesFileError, match=r"--prices .*nope\.toml: No such file"):
        Prices.from_file(path)


def test_the_spec_example_parses(tmp_path: Path) -> None:
    assert tomllib.loads(FULL)  # the example in docs/analysis.md is this one
    doc = Path(__file__).parents[2] / "docs" / "analysis.md"
    assert FULL.strip() in doc.read_text()


# -- wiring ------------------------------------------------------------------------


def test_config_prices() -> None:
    assert Config().pricing() is default_prices()
    mine = Prices()
    assert Config(prices=mine).pricing() is mine


def test_prices_survive_pickling_for_jobs() -> None:
    prices = Prices({"m": Override(1 * M, 2 * M, 0.1 * M, 1.25 * M, 2 * M)}, source="p.toml")
    assert prices.rates("m", "anthropic", NOW) is not None  # a filled cache travels too
    back = pickle.loads(pickle.dumps(Config(prices=prices)))
    assert back.pricing().label == prices.label
    assert back.pricing().rates("m", "anthropic", NOW) == prices.rates("m", "anthropic", NOW)


def test_analyze_refuses_a_bad_prices_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = str(sc.title_side_call().write(tmp_path / "r.jsonl", "digest"))
    bad = write(tmp_path, '["m"]\ninput = 3\n')
    assert main(["analyze", rec, "--prices", bad]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"llmp analyze: --prices {bad}: [m] needs output (US dollars per million tokens)\n"
    )
    good = write(tmp_path, FULL, "good.toml")
    assert main(["analyze", rec, "--json", "--prices", good]) == 0


def test_a_local_recording_never_loads_the_price_list(tmp_path: Path) -> None:
    """genai-prices (with pydantic, about half a second) loads only to price a provider's
    row, so `llmp analyze` of a local server's recording does not pay for it."""
    rec = str(sc.title_side_call().write(tmp_path / "r.jsonl", "digest"))
    probe = (
        "import sys\n"
        "from llmp.cli import main\n"
        "code = main(['analyze', '--json', sys.argv[1]])\n"
        "print(code, sorted(m for m in sys.modules if m.startswith(('genai_prices', 'pydantic'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, rec], capture_output=True, text=True, check=True
    ).stdout.splitlines()[-1]
    assert out == "0 []"


def test_the_pin_is_the_installed_version() -> None:
    """The report names the installed version; pyproject pins exactly that one."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert f"genai-prices=={version('genai-prices')}" in project["project"]["dependencies"]
