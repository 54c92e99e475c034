"""What a row on a cloud provider cost, in US dollars (R36), and what a miss cost.

Where each number comes from:

- **The price list** is the `genai-prices` package (the Pydantic team's, pinned in
  `pyproject.toml`; the report names its version through `Prices.label`).  It says
  which listed model a name as the harness sent it is (`claude-sonnet-4-5-20250929`,
  OpenRouter's `anthropic/claude-sonnet-4.5`, `gpt-5-2025-08-07`), the price on the
  request's UTC day (the list keeps dated price changes), the service tier's price
  (OpenAI's `flex`, `priority`…, where the list has one; any other tier, `scale`
  among them, is priced at the standard rates) and the long-context price above a
  prompt length.  A name it does not match is not priced: `rates` returns None and the
  report lists the model as unpriced; nothing is guessed.
- **Each rate is genai-prices' own arithmetic.**  `Rates` are read by pricing, with
  `genai_prices.calc_price`, a prompt made of one kind of token at a time
  (`input_tokens` is the whole prompt; `cache_read_tokens`; `cache_write_tokens`
  with `cache_write_5m_tokens` or, for Anthropic's 1-hour writes,
  `cache_write_1h_tokens`; `output_tokens`), once per long-context band.  So a rate
  the list does not give is billed as genai-prices bills it: a write on a model
  without a write price is plain input (OpenAI before GPT-5.6), a read without a read
  price is input.
- **One exception, the 1-hour write** (R36: 5-minute and 1-hour writes at their own
  rates).  Where the list has a write price but no 1-hour one for a Claude model
  (OpenRouter's Claude entries), it is the input price times Anthropic's documented
  1-hour multiplier in `llmp/apis/provider_caches.toml` (2×), not the 5-minute price
  genai-prices would fall back to.
- **`--prices FILE`** (`Prices.from_file`) replaces the list's rates for the models it
  names (negotiated rates), at every date, tier and prompt length.  A rate the file
  leaves out is derived from its `input` by the ratio the list has for that model on
  that day, else by the provider's documented multipliers in `provider_caches.toml`;
  where neither exists the model is unpriced.
- Only token prices count: a listed per-request or per-search fee is no part of
  `cost_usd`.  A row not on a provider (`anthropic`, `openai`, `openrouter`) is not
  priced (R36: on a local server the cost fields are null).

A miss's `usd` (R36, "beyond reading the same tokens from the cache") is
`Rates.miss_usd`: for each missed token, the rate it was billed at (a 5-minute or
1-hour write, or uncached input) minus the cache-read rate, summed.

Pure: no I/O but reading the prices file it is given.  `genai_prices` (and pydantic
under it, about half a second) is imported on the first lookup, so an analysis of a
local server never pays for it.  Rates are kept per (model, provider, tier, UTC day):
pricing thousands of rows costs a dict lookup each.
"""

from __future__ import annotations

import math
import os
import tomllib
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from decimal import Decimal
from functools import cache
from typing import Any

from llmp.apis.providers import (
    ANTHROPIC,
    OPENAI,
    OPENROUTER,
    PROVIDERS,
    facts,
    openai_cache,
    openai_version,
)

PACKAGE = "genai-prices"
DAY_MS = 86_400_000
PER_MILLION = 1_000_000


@dataclass(frozen=True, slots=True)
class Rates:
    """US dollars per token of each kind, for one model at one time."""

    input: float
    output: float
    cache_read: float
    cache_write_5m: float
    cache_write_1h: float

    def usd(
        self,
        *,
        uncached: int = 0,
        cache_read: int = 0,
        write_5m: int = 0,
        write_1h: int = 0,
        output: int = 0,
    ) -> float:
        """The price of a request's tokens: each input token at exactly one rate."""
        return (
            uncached * self.input
            + cache_read * self.cache_read
            + write_5m * self.cache_write_5m
            + write_1h * self.cache_write_1h
            + output * self.output
        )

    def miss_usd(self, *, written_5m: int = 0, written_1h: int = 0, uncached: int = 0) -> float:
        """What missed tokens cost beyond reading them from the cache (R36's loss `usd`).

        Each missed token was billed again as a 5-minute write, a 1-hour write or
        uncached input; had the cache been read, it would have cost the read rate.  The
        difference, summed, is the loss."""
        return (
            written_5m * (self.cache_write_5m - self.cache_read)
            + written_1h * (self.cache_write_1h - self.cache_read)
            + uncached * (self.input - self.cache_read)
        )


@dataclass(frozen=True, slots=True)
class Override:
    """A model's negotiated rates from `--prices`, in US dollars per token; a cache rate
    left out (None) is derived (see the module's docstring)."""

    input: float
    output: float
    cache_read: float | None = None
    cache_write_5m: float | None = None
    cache_write_1h: float | None = None


class PricesFileError(ValueError):
    """A `--prices` file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class _Schedule:
    """A model's rates by prompt length: `rates[i]` applies above `starts[i - 1]` tokens
    (genai-prices' long-context tiers bill the whole request at the higher rate)."""

    starts: tuple[int, ...]
    rates: tuple[Rates, ...]

    def at(self, prompt_tokens: int) -> Rates:
        return self.rates[bisect_left(self.starts, prompt_tokens)]


_Key = tuple[str, str, str | None, int]


class Prices:
    """The price of rows on a provider: genai-prices' list, with `--prices` overrides."""

    def __init__(
        self, overrides: Mapping[str, Rates | Override] | None = None, source: str | None = None
    ) -> None:
        self._overrides: dict[str, Override] = {
            name.lower(): _as_override(r) for name, r in (overrides or {}).items()
        }
        self.label = list_label()
        if self._overrides or source:
            self.label += f" and {source or 'overrides'}"
        self._cache: dict[_Key, _Schedule | None] = {}

    @classmethod
    def from_file(cls, path: str) -> Prices:
        """The list with the rates of a `--prices` TOML file (model -> per-million rates)."""
        return cls(read_overrides(path), source=os.path.basename(path))

    def rates(
        self,
        model: str | None,
        provider: str | None,
        t_ms: int,
        tier: str | None = None,
        prompt_tokens: int = 0,
    ) -> Rates | None:
        """The rates for `model` on `provider` at `t_ms` (ms since the epoch) in the
        service `tier`, for a prompt of `prompt_tokens` (the whole input); None for a
        model neither the list nor the overrides price, or a server that is no provider."""
        if not model or provider not in PROVIDERS:
            return None
        key = (model, provider, tier or None, t_ms // DAY_MS)
        try:
            schedule = self._cache[key]
        except KeyError:
            schedule = self._cache[key] = self._schedule(*key)
        return None if schedule is None else schedule.at(prompt_tokens)

    def cost(
        self,
        model: str | None,
        provider: str | None,
        t_ms: int,
        *,
        uncached: int,
        cache_read: int,
        write_5m: int,
        write_1h: int,
        output: int,
        tier: str | None = None,
    ) -> float | None:
        """A row's `cost_usd`: its input (uncached, read, written) and output, priced;
        None where `rates` is."""
        prompt = uncached + cache_read + write_5m + write_1h
        r = self.rates(model, provider, t_ms, tier, prompt)
        if r is None:
            return None
        return r.usd(
            uncached=uncached,
            cache_read=cache_read,
            write_5m=write_5m,
            write_1h=write_1h,
            output=output,
        )

    def _schedule(self, model: str, provider: str, tier: str | None, day: int) -> _Schedule | None:
        listed = _listed(model, provider, tier, day)
        override = self._overrides.get(model.lower())
        if override is None and listed is not None:
            override = self._overrides.get(listed[0])
        if override is None:
            return None if listed is None else listed[1]
        base = None if listed is None else listed[1].rates[0]
        rates = _complete(override, base, model, provider)
        return None if rates is None else _Schedule((), (rates,))


@cache
def list_label() -> str:
    """`genai-prices <version>`: the list the report's prices come from (R36)."""
    from importlib.metadata import version  # ~10 ms, only once something is priced

    return f"{PACKAGE} {version(PACKAGE)}"


@cache
def default_prices() -> Prices:
    """genai-prices' list as it is (no `--prices`), one per process so its cache is shared."""
    return Prices()


# -- the list ------------------------------------------------------------------------


def _listed(model: str, provider: str, tier: str | None, day: int) -> tuple[str, _Schedule] | None:
    """The list's id for `model` and its rates on the UTC `day`, or None if it has none."""
    from genai_prices import Usage, calc_price
    from genai_prices.types import PriceCalculation, TieredPrices

    when = datetime.fromtimestamp(day * (DAY_MS // 1000), UTC)
    context = {"service_tier": tier} if tier else None

    def price(usage: Usage) -> PriceCalculation:
        return calc_price(
            usage, model, provider_id=provider, genai_request_timestamp=when, price_context=context
        )

    try:
        found = price(Usage())
    except LookupError:
        return None
    listed = found.model_price
    fee = found.total_price  # a per-request fee, if the list has one: not a token's price
    # Where a long-context tier begins (a tier from 0 tokens on is simply the price).
    starts = sorted(
        {
            t.start
            for p in vars(listed).values()
            if isinstance(p, TieredPrices)
            for t in p.tiers
            if t.start > 0
        }
    )
    claude = "claude" in found.model.id.lower()
    has_1h = getattr(listed, "cache_write_1h_mtok", None) is not None
    one_hour = Decimal(str(facts()[ANTHROPIC]["write_multiplier"]["1h"]))

    def band(n: int) -> Rates:
        """The rates for a prompt of `n` tokens: `n` tokens of each kind, priced."""

        def per_token(**usage: int) -> Decimal:
            return (price(Usage(input_tokens=n, **usage)).total_price - fee) / n

        input_rate = per_token()
        if has_1h or not claude:
            write_1h = per_token(cache_write_tokens=n, cache_write_1h_tokens=n)
        else:
            write_1h = input_rate * one_hour
        return Rates(
            input=float(input_rate),
            output=float(per_token(output_tokens=n) - input_rate),
            cache_read=float(per_token(cache_read_tokens=n)),
            cache_write_5m=float(per_token(cache_write_tokens=n, cache_write_5m_tokens=n)),
            cache_write_1h=float(write_1h),
        )

    # One prompt length in each band: 1 token, then one above each tier's start.
    bands = tuple(band(n) for n in [1, *(s + 1 for s in starts)])
    return found.model.id.lower(), _Schedule(tuple(starts), bands)


# -- overrides -----------------------------------------------------------------------

_RATE_KEYS = tuple(f.name for f in fields(Rates))
_REQUIRED = ("input", "output")


def _as_override(r: Rates | Override) -> Override:
    if isinstance(r, Override):
        return r
    return Override(r.input, r.output, r.cache_read, r.cache_write_5m, r.cache_write_1h)


def _documented(model: str, provider: str) -> dict[str, float | None] | None:
    """The provider's documented cache rates as multiples of input
    (`provider_caches.toml`): Anthropic's, OpenAI's by generation (before GPT-5.6 a write
    is plain input and the read discount varies by model, so it is not given), and on
    OpenRouter the model's maker's; None where there is nothing documented."""
    low = model.lower()
    if provider == ANTHROPIC or (provider == OPENROUTER and "claude" in low):
        a = facts()[ANTHROPIC]
        return {
            "cache_read": float(a["read_multiplier"]),
            "cache_write_5m": float(a["write_multiplier"]["5m"]),
            "cache_write_1h": float(a["write_multiplier"]["1h"]),
        }
    if provider == OPENAI or (provider == OPENROUTER and openai_version(low) is not None):
        rules = openai_cache(low)
        if rules.explicit:
            write = rules.write_multiplier
            read: float | None = float(facts()[OPENAI]["explicit"]["read_multiplier"])
        else:
            write, read = 1.0, None
        return {"cache_read": read, "cache_write_5m": write, "cache_write_1h": write}
    return None


def _complete(o: Override, base: Rates | None, model: str, provider: str) -> Rates | None:
    """An override with every rate: the ones it leaves out from its `input`, by the list's
    ratio for the model, else the documented multiple; None if one cannot be had."""
    documented = None if base is not None else _documented(model, provider)
    values: dict[str, float] = {"input": o.input, "output": o.output}
    for name in ("cache_read", "cache_write_5m", "cache_write_1h"):
        given: float | None = getattr(o, name)
        if given is None:
            if base is not None:
                ratio: float | None = getattr(base, name) / base.input if base.input else None
            else:
                ratio = None if documented is None else documented[name]
            if ratio is None:
                return None
            given = o.input * ratio
        values[name] = given
    return Rates(**values)


def read_overrides(path: str) -> dict[str, Override]:
    """A `--prices` file: one table per model, rates in US dollars per million tokens
    (`input` and `output` required; `cache_read`, `cache_write_5m`, `cache_write_1h`
    optional).  Raises `PricesFileError` naming the file and the key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise PricesFileError(f"--prices {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PricesFileError(f"--prices {path}: not TOML: {exc}") from exc
    out: dict[str, Override] = {}
    for model, table in data.items():
        where = f"--prices {path}: [{_toml_key(model)}]"
        if not isinstance(table, dict):
            raise PricesFileError(
                f"{where} must be a table of rates per million tokens, e.g. "
                f'["{model}"] then input = 3.0 and output = 15.0 on the lines below'
            )
        unknown = sorted(set(table) - set(_RATE_KEYS))
        if unknown:
            raise PricesFileError(
                f"{where} has no rate {unknown[0]!r}; the rates are {', '.join(_RATE_KEYS)}"
            )
        missing = [k for k in _REQUIRED if k not in table]
        if missing:
            raise PricesFileError(f"{where} needs {missing[0]} (US dollars per million tokens)")
        rates = {k: _per_token(where, k, v) for k, v in table.items()}
        if model.lower() in out:
            raise PricesFileError(f"{where} is given twice (model names ignore case)")
        out[model.lower()] = Override(**rates)
    return out


def _per_token(where: str, key: str, value: Any) -> float:
    """A per-million rate from the file, per token; a clear error for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PricesFileError(
            f"{where} {key} must be a number (US dollars per million tokens), not {value!r}"
        )
    if not math.isfinite(value) or value < 0:
        raise PricesFileError(f"{where} {key} must be 0 or more, not {value!r}")
    return float(value) / PER_MILLION


def _toml_key(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else f'"{name}"'


__all__ = [
    "Override",
    "Prices",
    "PricesFileError",
    "Rates",
    "default_prices",
    "list_label",
    "read_overrides",
]
