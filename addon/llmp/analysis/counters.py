"""Server counters to the report's Counts, from what servers really send.

See `../shared/spec/wire-formats.md` and `docs/analysis.md` §4.  Every value
is a measured value `(value, source)` or None when the server did not say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmp.apis.chat import OLLAMA_CHAT
from llmp.format.measure import ESTIMATE, MV, PROXY, SERVER, weakest

FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "prefill_ms",
    "decode_ms",
    "load_ms",
)


@dataclass(slots=True)
class Counts:
    """The seven counters of a row; None means not reported."""

    prompt_tokens: MV | None = None
    completion_tokens: MV | None = None
    reused_tokens: MV | None = None
    evaluated_tokens: MV | None = None
    prefill_ms: MV | None = None
    decode_ms: MV | None = None
    load_ms: MV | None = None
    # Not in the report: how Ollama's prompt_eval_count was read.
    meaning: str | None = None

    def reported(self) -> list[str]:
        """The fields the server itself reported."""
        return [f for f in FIELDS if (v := getattr(self, f)) is not None and v[1] == SERVER]


def _int(value: Any) -> int | None:
    if type(value) is int and value >= 0:
        return value
    return None


def _num(value: Any) -> float | None:
    """A non-negative number as a plain float (a full record's RawFloat too)."""
    if type(value) is float or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return float(value) if value >= 0 else None
    return None


def _srv(value: float | None) -> MV | None:
    return None if value is None else (value, SERVER)


@dataclass(slots=True)
class Timing:
    """The proxy's own clock for one exchange."""

    t_start: int
    t_first_byte: int | None
    t_end: int
    streamed: bool


def _proxy_times(counts: Counts, timing: Timing | None) -> None:
    # Without server timings, a streamed response's first byte marks the end
    # of prefill, as well as the proxy can tell.
    if timing is None or not timing.streamed or timing.t_first_byte is None:
        return
    if counts.prefill_ms is None:
        counts.prefill_ms = (float(max(0, timing.t_first_byte - timing.t_start)), PROXY)
    if counts.decode_ms is None:
        counts.decode_ms = (float(max(0, timing.t_end - timing.t_first_byte)), PROXY)


def _nonneg(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    return v if type(v) is int and v >= 0 else None


def openai_counts(top: dict[str, Any], timing: Timing | None) -> Counts:
    """llama-server, vLLM, SGLang, OpenRouter, DeepSeek, Ollama's /v1."""
    usage = top.get("usage")
    if type(usage) is not dict:
        usage = {}
    timings = top.get("timings")
    if type(timings) is not dict:
        timings = {}

    prompt = _nonneg(usage, "prompt_tokens")
    cache_n = _nonneg(timings, "cache_n")
    prompt_n = _nonneg(timings, "prompt_n")
    cached = hit = miss = None
    if cache_n is None:
        details = usage.get("prompt_tokens_details")
        if type(details) is dict:
            cached = _nonneg(details, "cached_tokens")
        if cached is None:
            cached = _nonneg(usage, "cached_tokens")
        if cached is None:
            hit = _nonneg(usage, "prompt_cache_hit_tokens")
            miss = _nonneg(usage, "prompt_cache_miss_tokens")

    if prompt is None:
        if cache_n is not None and prompt_n is not None:
            prompt = cache_n + prompt_n
        elif hit is not None and miss is not None:
            prompt = hit + miss
    reused = cache_n if cache_n is not None else cached if cached is not None else hit
    evaluated = prompt_n if prompt_n is not None else miss
    if evaluated is None and prompt is not None and reused is not None:
        evaluated = max(0, prompt - reused)
    completion = _nonneg(usage, "completion_tokens")
    if completion is None:
        completion = _nonneg(timings, "predicted_n")
    prefill = decode = None
    if timings:
        pm = _num(timings.get("prompt_ms"))
        if pm is not None:
            prefill = (pm, SERVER)
        dm = _num(timings.get("predicted_ms"))
        if dm is not None:
            decode = (dm, SERVER)
    c = Counts(
        None if prompt is None else (prompt, SERVER),
        None if completion is None else (completion, SERVER),
        None if reused is None else (reused, SERVER),
        None if evaluated is None else (evaluated, SERVER),
        prefill,
        decode,
    )
    if prefill is None or decode is None:
        _proxy_times(c, timing)
    return c


def ollama_counts(
    top: dict[str, Any],
    timing: Timing | None,
    estimated_prompt: MV,
    evaluated_share: float,
    known_old: bool = False,
) -> Counts:
    """Ollama's /api/chat: ns durations, and prompt_eval_count's two meanings.

    `known_old` says an earlier response of the same model in this session
    already proved the old meaning (a count far below the prompt).
    """
    c = Counts()
    done = top.get("done") is True

    def count(key: str) -> int | None:
        value = _int(top.get(key))
        if value is None and done and top.get(key) is None:
            return 0  # the final object leaves a counter out when it is 0
        return value

    def ms(key: str) -> MV | None:
        raw = top.get(key)
        value = _num(raw)
        if value is None:
            return (0.0, SERVER) if done and raw is None else None
        return (value / 1e6, SERVER)

    c.prefill_ms = ms("prompt_eval_duration")
    c.decode_ms = ms("eval_duration")
    c.load_ms = ms("load_duration")
    c.completion_tokens = _srv(count("eval_count"))

    pec = _int(top.get("prompt_eval_count"))
    cached = _int(top.get("prompt_eval_cached_count"))
    est, est_src = estimated_prompt
    if cached is not None:
        if pec is None:
            pec = 0
        c.meaning = "cached"
        if pec >= cached:  # 0.34 on: the count is the whole prompt
            c.prompt_tokens = _srv(pec)
            c.reused_tokens = _srv(cached)
            c.evaluated_tokens = _srv(pec - cached)
        else:  # the count can only be the evaluated part
            c.prompt_tokens = _srv(pec + cached)
            c.reused_tokens = _srv(cached)
            c.evaluated_tokens = _srv(pec)
    elif pec is None:
        if done and top.get("prompt_eval_count") is None:
            # Only old builds leave it out, and only when all of it was cached.
            src = weakest(est_src, ESTIMATE)
            c.meaning = "old"
            c.evaluated_tokens = (0, SERVER)
            c.prompt_tokens = (est, src)
            c.reused_tokens = (est, src)
    elif est > 0 and (known_old or pec < evaluated_share * est):
        # Old meaning: only the evaluated part was counted.
        src = weakest(est_src, ESTIMATE)
        c.meaning = "old"
        c.evaluated_tokens = (pec, SERVER)
        c.prompt_tokens = (max(est, pec), src)
        c.reused_tokens = (max(0, est - pec), src)
    else:
        c.meaning = "whole"
        c.prompt_tokens = _srv(pec)
    _proxy_times(c, timing)
    return c


def counts_for(
    api: str,
    top: dict[str, Any] | None,
    timing: Timing | None,
    estimated_prompt: MV,
    evaluated_share: float,
    known_old: bool = False,
) -> Counts:
    """The Counts of one response, by API."""
    if top is None:
        c = Counts()
        _proxy_times(c, timing)
        return c
    if api == OLLAMA_CHAT:
        return ollama_counts(top, timing, estimated_prompt, evaluated_share, known_old)
    return openai_counts(top, timing)
