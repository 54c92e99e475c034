"""On a cloud provider, the provider's cache rules decide a miss (R35), and R37's diagnosis
is compared with llmp's.

A provider keeps every prefix a request wrote until its time-to-live ends, whatever runs
in between, so the local server's external causes (a side-call, another conversation or
model that took the slot) never apply there.  A **miss** is what a turn did not read of
what its linked turn left cached; it is charged to exactly one cause, the first that
holds:

1. the client's change, by tier (the earliest part of the prompt it touches): the model,
   OpenAI's `prompt_cache_key`, the tools, the system prompt, the cache settings
   (`settings_changed`), the history;
2. `breakpoint_too_far` (Anthropic): the prefix is the same, but the block where the
   linked turn wrote its last entry lies out of every breakpoint's reach (the API looks
   back a fixed number of blocks, `lookback_blocks`);
3. `cache_expired`: more time passed since that entry was written or last read than it
   lives (Anthropic: 5 minutes, or an hour; OpenAI: the retention the response reports);
4. `provider_evicted`: the provider dropped it, or routed the request elsewhere.

What a turn "left cached" is the provider's own count where the provider writes at
breakpoints (Anthropic, OpenAI from GPT-5.6: the tokens it read plus those it wrote), and
the whole prompt where caching is automatic (OpenAI before GPT-5.6 bills no write: every
prompt of at least 1,024 tokens is cached, and read back in 128-token steps, so a
shortfall under one step is no loss).  The facts (TTLs, lookback, minimums, granules)
are `apis.providers`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmp.analysis.causes import (
    BREAKPOINT_TOO_FAR,
    CACHE_EXPIRED,
    CACHE_KEY_CHANGED,
    MODEL_CHANGED,
    PROVIDER_EVICTED,
    SETTINGS_CHANGED,
    SYSTEM_CHANGED,
    TOOLS_CHANGED,
)
from llmp.analysis.loss import SERVER_RESET, STRUCTURAL, Structure, Verdict, loss_ms
from llmp.analysis.rows import Loss
from llmp.apis import providers
from llmp.apis.base import CacheUsage
from llmp.format.measure import ESTIMATE, SERVER, weakest

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.cost import Rates
    from llmp.analysis.exchange import Exchange
    from llmp.apis.base import Counts

BILLING_MAX_CHARS = 400
"""Claude Code's billing line (`x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;`,
with a per-request `cch=…`, `cc_prompt_id=…` or `cc_prev_req=…` on newer versions) is 75 to
about 240 characters; the instructions behind it are thousands."""
CLAUDE_CODE_UA = "claude-cli/"

NOT_READY = "not_ready"
"""R37's `provider_reason` for a diagnosis the provider had not worked out yet."""
NONE = "none"
CANNOT_COMPARE = frozenset(
    {"unavailable", "previous_message_not_found", "comparison_response_not_found", NOT_READY}
)
"""Provider reasons that compare nothing: the provider could not say (R37)."""


def billing_line(ex: Exchange) -> bool:
    """Whether the request's first system block is Claude Code's billing line: its text in
    a full recording, else (a digest keeps no text) Claude Code's user-agent and a short
    first system block."""
    if ex.n_sys == 0:
        return False
    if ex.texts is not None:
        return providers.anthropic_billing_block(ex.texts[0])
    chars = ex.msgs[0].chars
    return (
        (ex.user_agent or "").startswith(CLAUDE_CODE_UA)
        and type(chars) is int
        and 0 < chars <= BILLING_MAX_CHARS
    )


# -- what one provider request asked and left ----------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderTurn:
    """What a provider request told the cache, and what it left there for the next turn."""

    provider: str
    family: str
    """Whose cache rules apply: `anthropic` or `openai` (OpenRouter passes one of them)."""
    model: str | None
    usage: CacheUsage | None
    settings: tuple[tuple[str, Any], ...]
    key: str | None
    breakpoints: tuple[int, ...]
    """The blocks that carry a breakpoint, as positions in the whole prompt (tools, then
    the system blocks, then each message's blocks), in order."""
    at_ms: int
    """When what it read and wrote was last touched: its response began (R35: an entry is
    readable from then)."""
    lives_s: int
    """How long, idle, what it left lives (the time-to-live of its last entry)."""
    left: int | None
    """The tokens it left readable for the next turn; None when not measured."""
    granule: int
    minimum: int
    explicit: bool
    """It placed breakpoints (Anthropic's `cache_control`, OpenAI's explicit ones)."""
    route: str | None = None
    """What OpenAI routes by besides the key, as far as a digest tells: the first message."""
    usage_unasked: bool = False
    """No usage came because the request did not ask for one: a stream of an API that
    reports it only when asked (Chat Completions' `stream_options.include_usage`)."""


def family_of(provider: str, model: str | None) -> str:
    """Whose cache rules a request meets: a gateway passes the model's own provider's."""
    if provider != providers.OPENROUTER:
        return provider
    low = (model or "").lower()
    return (
        providers.ANTHROPIC if "claude" in low or low.startswith("anthropic/") else providers.OPENAI
    )


def turn_of(ex: Exchange, provider: str, usage: CacheUsage | None, at_ms: int) -> ProviderTurn:
    """The `ProviderTurn` of one provider request."""
    model = ex.requested_model or ex.served_model
    family = family_of(provider, model)
    cache = ex.cache
    n_tools = len(ex.tool_digests)
    blocks = list(cache.blocks or []) if cache is not None else []
    starts = [n_tools]
    for b in blocks:
        starts.append(starts[-1] + max(0, b))
    positions: list[tuple[int, Any]] = []
    if cache is not None:
        for bp in cache.breakpoints or []:
            if bp.at == "tools":
                positions.append((bp.index, bp.ttl))
            elif 0 <= bp.index < len(blocks):
                positions.append((starts[bp.index] + bp.block, bp.ttl))
        if cache.auto is not None and starts[-1] > 0:
            positions.append((starts[-1] - 1, cache.auto.ttl))
    positions.sort(key=lambda p: p[0])
    last_ttl = positions[-1][1] if positions else None
    settings = dict(cache.settings or {}) if cache is not None else {}
    if family == providers.ANTHROPIC and provider == providers.ANTHROPIC:
        settings["betas"] = _betas(ex.betas)
    explicit = bool(positions)
    if family == providers.ANTHROPIC:
        granule = 1
        minimum = providers.anthropic_minimum_tokens(model)
        lives = providers.anthropic_ttl_seconds(last_ttl if isinstance(last_ttl, str) else None)
        left = usage.cached if usage is not None else None
    else:
        rules = providers.openai_cache(model)
        granule, minimum = rules.granule_tokens, rules.minimum_tokens
        lives = _openai_lives(ex, usage, last_ttl, rules.explicit)
        if usage is None:
            left = None
        elif rules.explicit or usage.write:
            left = usage.cached
        else:  # automatic: the whole prompt is cached, from the minimum on
            left = usage.prompt if usage.prompt >= minimum else 0
    return ProviderTurn(
        provider=provider,
        family=family,
        model=model,
        usage=usage,
        settings=tuple(sorted(settings.items())),
        key=cache.key if cache is not None else None,
        breakpoints=tuple(p for p, _ in positions),
        at_ms=at_ms,
        lives_s=lives,
        left=left,
        granule=granule,
        minimum=minimum,
        explicit=explicit,
        route=ex.hashes[0] if ex.hashes else None,
        usage_unasked=usage is None
        and ex.streamed
        and ex.api.stream_usage_asked
        and not (cache is not None and cache.include_usage is True),
    )


def _betas(header: str | None) -> str:
    """The set of `anthropic-beta` values (R35), without the diagnosis beta, which
    `llmp_diagnose` may add: asking for a diagnosis changes nothing that is cached (R37)."""
    beta = providers.facts()["anthropic"]["diagnosis_beta"]
    values = {b.strip() for b in (header or "").split(",")}
    return ",".join(sorted(values - {"", beta}))


def _openai_lives(ex: Exchange, usage: CacheUsage | None, last_ttl: Any, explicit: bool) -> int:
    """OpenAI: the time-to-live the response reports (`prompt_cache_options.ttl`), else the
    last breakpoint's, else the request's options; else the retention (R35)."""
    cache = ex.cache
    ttl = usage.ttl if usage is not None else None
    if ttl is None and isinstance(last_ttl, str):
        ttl = last_ttl
    if ttl is None and cache is not None and cache.options is not None:
        opt = cache.options.ttl
        ttl = opt if isinstance(opt, str) else None
    if ttl is None and explicit:
        ttl = providers.facts()["openai"]["explicit"]["default_ttl"]
    retention = usage.retention if usage is not None else None
    if retention is None and cache is not None and isinstance(cache.retention, str):
        retention = cache.retention
    return providers.openai_retention_seconds(retention, ttl)


# -- the verdict ---------------------------------------------------------------------------


@dataclass(slots=True)
class Miss:
    """Why a provider turn read less than it could, for the findings' evidence."""

    cause: str
    gap_s: float
    lives_s: int
    lookback: int | None = None
    """Blocks from the linked turn's last entry to this request's nearest breakpoint."""


def client_cause(
    st: Structure, now: ProviderTurn, last: ProviderTurn, model_changed: bool
) -> str | None:
    """The client's change that a miss is charged to, by tier: the earliest part of the
    prompt it touches (R35).  OpenAI keys its cache by the key and the settings before the
    first token; Anthropic's settings reach the messages tier only."""
    if model_changed:
        return MODEL_CHANGED
    settings = now.settings != last.settings
    if now.family == providers.OPENAI:
        if now.key != last.key:
            return CACHE_KEY_CHANGED
        if settings:
            return SETTINGS_CHANGED
    if st.break_cause in (TOOLS_CHANGED, SYSTEM_CHANGED):
        return st.break_cause
    if settings:
        return SETTINGS_CHANGED
    return st.break_cause


def _too_far(now: ProviderTurn, last: ProviderTurn) -> int | None:
    """Anthropic's lookback: from each breakpoint the API checks that block and earlier ones,
    at most `lookback_blocks` with it.  The distance from the linked turn's last entry to
    this request's nearest breakpoint after it, when every one is out of reach; else None."""
    if now.family != providers.ANTHROPIC or not last.breakpoints or not now.breakpoints:
        return None
    written = last.breakpoints[-1]
    reach = providers.anthropic_lookback_blocks()
    after = [b - written for b in now.breakpoints if b >= written]
    if not after or min(after) < reach:
        return None
    return min(after)


def verdict(
    st: Structure,
    counts: Counts,
    now: ProviderTurn,
    last: ProviderTurn | None,
    model_changed: bool,
    cfg: Config,
    t_start: int,
) -> tuple[Verdict, Miss | None]:
    """A provider turn's reuse, loss and cause (R35), and why it missed."""
    v = Verdict()
    prompt = counts.prompt_tokens
    reused = counts.reused_tokens
    if prompt is not None and prompt[0] > 0 and reused is not None:
        v.observed_reuse = round(min(1.0, reused[0] / prompt[0]), 4)
    if not st.linked or st.prefix is None or last is None:
        v.predicted_reuse = 0.0
        return v, None
    usage = now.usage
    if usage is None or last.left is None:
        return v, None
    could = float(last.left)
    src = SERVER
    margin = 0.0
    head_only = st.new_conversation or st.compaction
    if head_only:
        # Only the start is shared (a new conversation, or a compaction that kept the system
        # prompt and tools): what could be read is that start, scaled from the composition.
        # A provider caches the tools first, then the system prompt: changed tools leave
        # nothing shared; otherwise the tools and the system prompt up to its change are.
        total = st.total
        if total <= 0:
            return v, None
        if not st.tools_same:
            units = 0.0
        elif st.tools_in_prefix or st.volatile:
            units = float(st.prefix + st.volatile)  # the tools are inside either already
        else:
            units = float(st.prefix + st.tools[0])
        shared = units * usage.prompt / total
        could = min(could, shared)
        src = weakest(SERVER, st.source, ESTIMATE)
        margin = cfg.estimate_margin * shared
    if usage.prompt:
        v.predicted_reuse = round(min(1.0, could / usage.prompt), 4)
    miss = could - usage.read
    if miss < now.granule + margin or miss <= 0:
        return v, None
    if head_only and not st.volatile:
        if st.compaction:
            return v, None  # a compaction is a new start: what it re-read is not charged
        cause = None
    elif head_only:
        cause = SYSTEM_CHANGED  # R38: a volatile head, charged on the row
    else:
        cause = client_cause(st, now, last, model_changed)
    gap_s = max(0.0, (t_start - last.at_ms) / 1000)
    why = Miss(cause or "", gap_s, last.lives_s)
    if cause is None:
        distance = _too_far(now, last) if not head_only else None
        if distance is not None:
            cause, why.lookback = BREAKPOINT_TOO_FAR, distance
        elif gap_s > last.lives_s:
            cause = CACHE_EXPIRED
        else:
            cause = PROVIDER_EVICTED
        why.cause = cause
    loss = Loss(cause, round(miss), loss_ms(miss, src, counts))
    if cause in (CACHE_EXPIRED, PROVIDER_EVICTED):
        v.lost_external = loss
        v.cause = SERVER_RESET
    else:
        v.lost_client = loss
        v.cause = STRUCTURAL
    return v, why


# -- money (R36) ---------------------------------------------------------------------------


def miss_usd(rates: Rates | None, usage: CacheUsage | None, tokens: int) -> float | None:
    """What missing `tokens` cost beyond reading them from the cache: the missed part of a
    prompt comes right after what was read, so it was billed as the 1-hour writes first,
    then the 5-minute ones, then as uncached input (the provider's own arithmetic)."""
    if rates is None or usage is None:
        return None
    hour = min(tokens, usage.write_1h)
    five = min(tokens - hour, usage.write_5m)
    plain = max(0, tokens - hour - five)
    return rates.miss_usd(written_5m=five, written_1h=hour, uncached=plain)


# -- the provider's own diagnosis (R37) ----------------------------------------------------

_AGREE: dict[str, frozenset[str]] = {
    "system_changed": frozenset({"system_changed"}),
    "tools_changed": frozenset({"tools_changed"}),
    "model_changed": frozenset({"model_changed"}),
    "cache_key_changed": frozenset({"prompt_cache_key_changed"}),
    "history_rewritten": frozenset({"messages_changed", "input_changed", "context_compacted"}),
    "settings_changed": frozenset(
        {
            "messages_changed",
            "input_changed",
            "service_tier_changed",
            "text_format_changed",
            "reasoning_effort_changed",
            "verbosity_changed",
        }
    ),
    "cache_expired": frozenset({NONE}),
    "provider_evicted": frozenset({NONE}),
}
"""llmp's cause against the provider's word (R37).  OpenAI reports a changed instruction as
`input_changed`, so on OpenAI `system_changed` agrees with it too (`agrees`)."""


def comparable(reason: str | None) -> bool:
    """Whether a provider reason compares anything (it named a change, or found none)."""
    return reason is not None and reason not in CANNOT_COMPARE


def agrees(llmp: str | None, reason: str, provider: str | None = None) -> bool:
    """Whether llmp's cause (None: no loss) agrees with the provider's reason."""
    if llmp is None:
        return reason == NONE
    if llmp == SYSTEM_CHANGED and provider == providers.OPENAI and reason == "input_changed":
        return True
    if llmp == TOOLS_CHANGED and reason == "tools_changed":
        return True
    return reason in _AGREE.get(llmp, frozenset()) or reason == llmp


__all__ = [
    "BILLING_MAX_CHARS",
    "NOT_READY",
    "Miss",
    "ProviderTurn",
    "agrees",
    "billing_line",
    "client_cause",
    "comparable",
    "family_of",
    "miss_usd",
    "turn_of",
    "verdict",
]
