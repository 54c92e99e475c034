"""Counters from what each server really sends (wire-formats.md)."""

from __future__ import annotations

from llmp.analysis.counters import Timing, counts_for
from llmp.apis.base import CountHints, Counts
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat

EST = (1000, "estimate")


def openai(top: dict, timing: Timing | None = None) -> Counts:
    return counts_for(OpenAIChat(), top, timing, CountHints(EST, 0.4))


def ollama(top: dict, known_old: bool = False) -> Counts:
    return counts_for(OllamaChat(), top, None, CountHints(EST, 0.4, known_old))


def test_llama_server_timings_and_usage() -> None:
    c = openai(
        {
            "usage": {
                "completion_tokens": 35,
                "prompt_tokens": 237,
                "total_tokens": 272,
                "prompt_tokens_details": {"cached_tokens": 236},
            },
            "timings": {
                "cache_n": 236,
                "prompt_n": 1,
                "prompt_ms": 30.958,
                "predicted_n": 35,
                "predicted_ms": 661.06,
            },
        }
    )
    assert c.prompt_tokens == (237, "server")
    assert c.reused_tokens == (236, "server")
    assert c.evaluated_tokens == (1, "server")
    assert c.completion_tokens == (35, "server")
    assert c.prefill_ms == (30.958, "server")
    assert c.decode_ms == (661.06, "server")
    assert c.load_ms is None
    assert c.reported() == [
        "prompt_tokens",
        "completion_tokens",
        "reused_tokens",
        "evaluated_tokens",
        "prefill_ms",
        "decode_ms",
    ]


def test_llama_server_timings_only() -> None:
    # Older builds: no usage chunk without include_usage, no cached_tokens.
    c = openai(
        {
            "timings": {
                "cache_n": 200,
                "prompt_n": 50,
                "prompt_ms": 100.0,
                "predicted_n": 9,
                "predicted_ms": 90.0,
            }
        }
    )
    assert c.prompt_tokens == (250, "server")
    assert c.reused_tokens == (200, "server")
    assert c.completion_tokens == (9, "server")


def test_vllm_and_openrouter_cached_tokens() -> None:
    c = openai(
        {
            "usage": {
                "prompt_tokens": 1000,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 768},
            }
        }
    )
    assert c.reused_tokens == (768, "server")
    assert c.evaluated_tokens == (232, "server")
    assert c.prefill_ms is None


def test_vllm_without_prompt_details_is_not_measured() -> None:
    c = openai(
        {"usage": {"prompt_tokens": 1000, "completion_tokens": 5, "prompt_tokens_details": None}}
    )
    assert c.prompt_tokens == (1000, "server")
    assert c.reused_tokens is None and c.evaluated_tokens is None


def test_sglang_cached_tokens_at_top_of_usage() -> None:
    c = openai({"usage": {"prompt_tokens": 500, "completion_tokens": 5, "cached_tokens": 300}})
    assert c.reused_tokens == (300, "server")


def test_deepseek_hit_and_miss() -> None:
    c = openai(
        {
            "usage": {
                "prompt_tokens": 900,
                "completion_tokens": 3,
                "prompt_cache_hit_tokens": 640,
                "prompt_cache_miss_tokens": 260,
            }
        }
    )
    assert c.reused_tokens == (640, "server")
    assert c.evaluated_tokens == (260, "server")
    c = openai(
        {
            "usage": {
                "completion_tokens": 3,
                "prompt_cache_hit_tokens": 640,
                "prompt_cache_miss_tokens": 260,
            }
        }
    )
    assert c.prompt_tokens == (900, "server")


def test_ollama_v1_endpoint_has_no_cache_counter() -> None:
    c = openai({"usage": {"prompt_tokens": 26, "completion_tokens": 10, "total_tokens": 36}})
    assert c.prompt_tokens == (26, "server")
    assert c.reused_tokens is None


def test_proxy_clock_when_the_server_gives_no_timing() -> None:
    c = openai({"usage": {"prompt_tokens": 26}}, Timing(1000, 1450, 2000, True))
    assert c.prefill_ms == (450.0, "proxy")
    assert c.decode_ms == (550.0, "proxy")
    # Not streamed: the first byte comes after decoding, so it says nothing.
    c = openai({"usage": {"prompt_tokens": 26}}, Timing(1000, 1450, 1451, False))
    assert c.prefill_ms is None


def test_null_is_not_zero() -> None:
    c = openai({})
    assert all(getattr(c, f) is None for f in ("prompt_tokens", "reused_tokens", "prefill_ms"))
    c = counts_for(OpenAIChat(), None, None, CountHints(EST, 0.4))
    assert c.prompt_tokens is None


OLLAMA_FINAL = {
    "model": "qwen3:8b",
    "done": True,
    "done_reason": "stop",
    "total_duration": 5_000_000_000,
    "load_duration": 20_000_000,
    "prompt_eval_duration": 1_500_000_000,
    "eval_count": 40,
    "eval_duration": 3_000_000_000,
}


def test_ollama_recent_build_with_cached_count() -> None:
    c = ollama({**OLLAMA_FINAL, "prompt_eval_count": 1200, "prompt_eval_cached_count": 1100})
    assert c.prompt_tokens == (1200, "server")
    assert c.reused_tokens == (1100, "server")
    assert c.evaluated_tokens == (100, "server")
    assert c.prefill_ms == (1500.0, "server")
    assert c.decode_ms == (3000.0, "server")
    assert c.load_ms == (20.0, "server")
    assert c.completion_tokens == (40, "server")
    assert c.meaning == "cached"


def test_ollama_recent_meaning_without_cached_count() -> None:
    c = ollama({**OLLAMA_FINAL, "prompt_eval_count": 1100})
    assert c.prompt_tokens == (1100, "server")
    assert c.reused_tokens is None and c.evaluated_tokens is None
    assert c.meaning == "whole"


def test_ollama_old_meaning_counts_only_the_evaluated_part() -> None:
    c = ollama({**OLLAMA_FINAL, "prompt_eval_count": 60})
    assert c.evaluated_tokens == (60, "server")
    assert c.prompt_tokens == (1000, "estimate")
    assert c.reused_tokens == (940, "estimate")
    assert c.meaning == "old"
    # Once proven old, a large count is still the evaluated part.
    c = ollama({**OLLAMA_FINAL, "prompt_eval_count": 990}, known_old=True)
    assert c.evaluated_tokens == (990, "server") and c.reused_tokens == (10, "estimate")


def test_ollama_old_build_leaves_the_count_out_when_all_was_cached() -> None:
    top = dict(OLLAMA_FINAL)
    del top["prompt_eval_duration"]
    c = ollama(top)
    assert c.evaluated_tokens == (0, "server")
    assert c.reused_tokens == (1000, "estimate")
    assert c.prefill_ms == (0.0, "server")  # left out because it was 0


def test_ollama_counters_missing_without_done_are_not_measured() -> None:
    c = ollama({"model": "qwen3:8b", "error": "boom"})
    assert c.prefill_ms is None and c.completion_tokens is None and c.prompt_tokens is None
