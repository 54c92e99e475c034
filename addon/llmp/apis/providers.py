"""The cloud providers' prompt caches (R34, R35): who they are and what their caches do.

The facts are data (`provider_caches.toml`, dated), read once here; the fakes, the
recorder and the analysis ask this module, so a changed minimum length or a new
generation of OpenAI models is one edit of that file.

A provider is told (R34, first match wins) by the host the request went to, a
response header only it sends, or, for recordings without either, the shape of its
usage.  `provider_of` does that; `ANTHROPIC`, `OPENAI` and `OPENROUTER` are the
names the report uses.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from typing import Any

ANTHROPIC = "anthropic"
OPENAI = "openai"
OPENROUTER = "openrouter"
PROVIDERS = (ANTHROPIC, OPENAI, OPENROUTER)


@cache
def facts() -> dict[str, Any]:
    """`provider_caches.toml`, parsed (once)."""
    text = resources.files("llmp.apis").joinpath("provider_caches.toml").read_text("utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=1024)
def provider_of_host(host: str | None) -> str | None:
    """The provider a request to `host` went to (its name), or None.  Remembered: a
    recording has a handful of hosts, and every record asks."""
    if not host:
        return None
    low = host.strip().lower().rstrip(".")
    for name in PROVIDERS:
        for h in facts()[name]["hosts"]:
            if low == h or low.endswith("." + h):
                return name
    return None


def provider_of_headers(headers: dict[str, Any] | None) -> str | None:
    """The provider a response's headers name (a header only it sends), or None."""
    if not headers:
        return None
    a = facts()[ANTHROPIC]
    if any(h in headers for h in a["headers"]):
        return ANTHROPIC
    rid = headers.get("request-id")
    if isinstance(rid, str) and rid.startswith(a["request_id_prefix"]):
        return ANTHROPIC
    if any(h in headers for h in facts()[OPENAI]["headers"]):
        return OPENAI
    return None


def provider_of_usage(usage: Any, timings: bool = False, model: Any = None) -> str | None:
    """For recordings without host or headers: the provider a usage's shape names.

    `usage` is the response's own `usage` object.  Anthropic's has
    `cache_creation_input_tokens` together with a `cache_creation` object; OpenAI's
    Responses usage has `input_tokens_details.cached_tokens` and no llama-server
    `timings` beside it.  A reply whose `model` is a model file (llama-server answers
    with its path: `…/qwen3-8b.gguf`) is a local server's whatever its usage looks like
    (llama-server's non-streamed Responses carry no `timings` either)."""
    if not isinstance(usage, dict):
        return None
    if isinstance(model, str) and (model.startswith("/") or model.endswith((".gguf", ".bin"))):
        return None
    if "cache_creation_input_tokens" in usage and isinstance(usage.get("cache_creation"), dict):
        return ANTHROPIC
    details = usage.get("input_tokens_details")
    if not timings and isinstance(details, dict) and "cached_tokens" in details:
        return OPENAI
    return None


def provider_of(
    host: str | None,
    headers: dict[str, Any] | None = None,
    usage: Any = None,
    timings: bool = False,
    model: Any = None,
) -> str | None:
    """R34's order: the upstream host, then a provider's own response header, then, for
    recordings made before the host was kept (`host` None), the usage's shape."""
    found = provider_of_host(host) or provider_of_headers(headers)
    if found is None and host is None:
        found = provider_of_usage(usage, timings, model)
    return found


# -- R37's opt-in diagnosis --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DiagnosisAsk:
    """How a provider is asked for its own cache diagnosis (R37): on which API's
    requests, in which top-level field and key, and with which beta value."""

    provider: str
    api: str
    """The `ChatApi.name` of the requests that may carry it."""
    field: str
    """The top-level request field: Anthropic's `diagnostics`, OpenAI's
    `prompt_cache_options`."""
    key: str
    """The key in it naming the earlier response: `previous_message_id`,
    `comparison_response_id`."""
    beta: str | None
    """The `anthropic-beta` value the request needs, or None."""

    @property
    def added_name(self) -> str:
        """The name `request.added` gives what is added: the field itself where the
        whole field is added (Anthropic), its key's path where one key is merged into
        an object the client may already send (OpenAI)."""
        return self.field if self.provider == ANTHROPIC else f"{self.field}.{self.key}"


def diagnosis_ask(provider: str | None, model: str | None) -> DiagnosisAsk | None:
    """How to ask `provider` for its diagnosis of a request for `model`, or None when it
    gives none: Anthropic for every model; OpenAI's Responses API for the explicit
    generation only (GPT-5.6 and later)."""
    if provider == ANTHROPIC:
        a = facts()[ANTHROPIC]
        field, key = a["diagnosis_request"]
        return DiagnosisAsk(ANTHROPIC, a["diagnosis_api"], field, key, a["diagnosis_beta"])
    if provider == OPENAI and openai_explicit(model):
        o = facts()[OPENAI]
        field, key = o["diagnosis_request"]
        return DiagnosisAsk(OPENAI, o["diagnosis_api"], field, key, None)
    return None


def diagnosis_apis(provider: str | None) -> frozenset[str]:
    """The APIs whose requests toward `provider` may be asked for a diagnosis."""
    if provider in (ANTHROPIC, OPENAI):
        return frozenset((facts()[provider]["diagnosis_api"],))
    return frozenset()


def anthropic_billing_block(text: str) -> bool:
    """Whether a system block's text is Claude Code's billing line (R35)."""
    return text.startswith(facts()[ANTHROPIC]["billing_block_prefix"])


# -- Anthropic --------------------------------------------------------------------


def anthropic_minimum_tokens(model: str | None) -> int:
    """The model's minimum cacheable length (tokens to the breakpoint), as documented."""
    low = (model or "").lower()
    for rule in facts()[ANTHROPIC]["minimum"]:
        if re.search(rule["pattern"], low):
            return int(rule["tokens"])
    return 1024  # the table ends with a catch-all; this is only its figure again


def anthropic_ttl_seconds(ttl: str | None) -> int:
    """Seconds an entry written with `ttl` (None: the default, 5 minutes) lives unread."""
    a = facts()[ANTHROPIC]
    table: dict[str, int] = a["ttl_seconds"]
    return int(table.get(ttl or a["default_ttl"], table[a["default_ttl"]]))


def anthropic_lookback_blocks() -> int:
    """How many blocks back from a breakpoint the API looks for an entry to read."""
    return int(facts()[ANTHROPIC]["lookback_blocks"])


# -- OpenAI -----------------------------------------------------------------------

_VERSION = re.compile(r"(?:^|[/:])(?:gpt|o)-?(\d+)(?:\.(\d+))?")


def openai_overflow_per_minute() -> int:
    """OpenAI's requests a minute on one prompt start and key before some overflow to
    other machines (and miss)."""
    return int(facts()[OPENAI]["overflow_per_minute"])


def openai_version(model: str | None) -> tuple[int, int] | None:
    """`gpt-5.6-codex` -> (5, 6); `gpt-4o` -> (4, 0); None for a name with no version."""
    m = _VERSION.search((model or "").lower())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def openai_explicit(model: str | None) -> bool:
    """Whether the model is of the explicit generation (breakpoints, write price, exact
    counts, a time-to-live): GPT-5.6 and later."""
    v = openai_version(model)
    if v is None:
        return False
    major, minor = (int(x) for x in facts()[OPENAI]["explicit"]["from_version"].split("."))
    return v >= (major, minor)


@dataclass(frozen=True, slots=True)
class OpenAICache:
    """What OpenAI's cache does for one model."""

    explicit: bool
    minimum_tokens: int
    granule_tokens: int
    write_multiplier: float


def openai_cache(model: str | None) -> OpenAICache:
    """The cache rules that apply to `model` (its generation's)."""
    o = facts()[OPENAI]
    if openai_explicit(model):
        e = o["explicit"]
        return OpenAICache(True, e["minimum_tokens"], e["granule_tokens"], e["write_multiplier"])
    return OpenAICache(False, o["minimum_tokens"], o["granule_tokens"], 0.0)


def openai_retention_seconds(retention: str | None, options_ttl: str | None = None) -> int:
    """Seconds an entry lives idle: `prompt_cache_options.ttl` as given (`30m`), else the
    `prompt_cache_retention` (`in_memory` counts as 5 minutes, `24h` as a day)."""
    if options_ttl:
        seconds = parse_ttl(options_ttl)
        if seconds is not None:
            return seconds
    o = facts()[OPENAI]
    table: dict[str, int] = o["retention_seconds"]
    return int(table.get(retention or o["default_retention"], table[o["default_retention"]]))


_TTL = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


def parse_ttl(text: str) -> int | None:
    """`30m` -> 1800, `24h` -> 86400, `5m` -> 300; None when it is no such duration."""
    m = _TTL.match(text.lower())
    if m is None:
        return None
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


__all__ = [
    "ANTHROPIC",
    "OPENAI",
    "OPENROUTER",
    "PROVIDERS",
    "DiagnosisAsk",
    "OpenAICache",
    "anthropic_billing_block",
    "anthropic_minimum_tokens",
    "anthropic_ttl_seconds",
    "diagnosis_apis",
    "diagnosis_ask",
    "facts",
    "openai_cache",
    "openai_explicit",
    "openai_retention_seconds",
    "openai_version",
    "parse_ttl",
    "provider_of",
    "provider_of_headers",
    "provider_of_host",
    "provider_of_usage",
]
