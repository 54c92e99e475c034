"""apis/servers.py: which server answered, and what its cache does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from llmp.apis import servers
from llmp.demo.fakes.shared_cache import BLOCK


@pytest.mark.parametrize(
    ("header", "api", "expected"),
    [
        ("llama.cpp", "openai_chat", servers.LLAMA_SERVER),
        ("Llama.cpp ", "anthropic_messages", servers.LLAMA_SERVER),
        ("uvicorn", "openai_chat", servers.VLLM_OR_SGLANG),
        (None, "ollama_chat", servers.OLLAMA),
        (None, "openai_chat", servers.UNKNOWN),
        ("nginx/1.27", "openai_chat", servers.UNKNOWN),
        ("", None, servers.UNKNOWN),
    ],
)
def test_identify(header: str | None, api: str | None, expected: servers.Server) -> None:
    assert servers.identify(header, api) is expected


def test_counters_win_over_the_header() -> None:
    """llama-server's `timings` behind a uvicorn proxy (LiteLLM) are llama-server's slots."""
    assert servers.identify("uvicorn", "openai_chat", timings=True) is servers.LLAMA_SERVER
    assert servers.identify(None, "anthropic_messages", timings=True) is servers.LLAMA_SERVER
    assert servers.identify(None, "ollama_chat", timings=True) is servers.OLLAMA


def test_cache_models() -> None:
    assert servers.LLAMA_SERVER.cache == servers.OLLAMA.cache == servers.SLOTS
    assert servers.VLLM_OR_SGLANG.cache == servers.VLLM.cache == servers.SGLANG.cache
    assert servers.VLLM_OR_SGLANG.cache == servers.SHARED
    # Each kind's default is its fake's block; until the traffic says more, a uvicorn
    # server that may be either is given vLLM's (the coarser) on a GPU.
    assert servers.VLLM.block_tokens == BLOCK["vllm"] == servers.VLLM_OR_SGLANG.block_tokens
    assert servers.SGLANG.block_tokens == BLOCK["sglang"] == 1
    assert servers.VLLM_CPU.block_tokens == servers.CPU_BLOCK == 128
    assert servers.UNKNOWN.block_tokens == servers.LLAMA_SERVER.block_tokens == 1


# What the real vLLM 0.32 (CPU build) and SGLang's OpenAI layer send (docs/analysis.md).
VLLM_TOP = {
    "id": "chatcmpl-994e75a89eec23e7",
    "system_fingerprint": "vllm-0.32.0-6cbdfb74",
    "usage": {
        "prompt_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0},
    },
    "kv_transfer_params": None,
}
SGLANG_TOP = {
    "id": "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
    "usage": {"prompt_tokens": 32, "prompt_tokens_details": None, "reasoning_tokens": 0},
    "metadata": {"weight_version": "default"},
}


def test_the_body_tells_vllm_and_sglang_apart() -> None:
    assert servers.identify("uvicorn", "openai_chat", top=VLLM_TOP) is servers.VLLM
    # vLLM's fingerprint behind a proxy that sends its own header still says vLLM.
    assert servers.identify("nginx", "openai_chat", top=VLLM_TOP) is servers.VLLM
    cpu = {**VLLM_TOP, "system_fingerprint": "vllm-0.11.0+cpu-1a2b3c4d"}
    assert servers.identify("uvicorn", "openai_chat", top=cpu) is servers.VLLM_CPU
    no_fp = {**VLLM_TOP, "system_fingerprint": None}  # --fingerprint-mode none
    assert servers.identify(None, "openai_chat", top=no_fp) is servers.VLLM
    assert servers.identify("uvicorn", "openai_chat", top=SGLANG_TOP) is servers.SGLANG
    # SGLang's marker only counts behind uvicorn; a bare uvicorn is either.
    assert servers.identify(None, "openai_chat", top=SGLANG_TOP) is servers.UNKNOWN
    assert servers.identify("uvicorn", "openai_chat", top={"usage": {}}) is (servers.VLLM_OR_SGLANG)
    # Counters still win: llama-server's timings behind a vLLM-looking body.
    assert servers.identify(None, "openai_chat", timings=True, top=VLLM_TOP) is (
        servers.LLAMA_SERVER
    )


def _block(counts: Sequence[tuple[int | None, int, int | None]], default: int) -> int:
    steps = servers.ReuseSteps()
    for prompt, reused, written in counts:
        steps.add(prompt, reused, written)
    return steps.block(default)


def test_the_block_is_the_counts_common_step_once_trusted() -> None:
    # vLLM on a GPU before created_cache_tokens: reuse counts only.
    assert _block([(None, 32, None)], 16) == 16  # one count: the kind's
    assert _block([(None, 256, None), (None, 256, None), (None, 256, None)], 16) == 16
    assert _block([(None, 256, None), (None, 384, None), (None, 640, None)], 16) == 128
    # Counts that do not share the kind's step: never a block they are not whole in.
    assert _block([(None, 200, None)], 16) == 8
    # SGLang's token-exact reuse: the step falls to one.
    assert _block([(None, 301, None), (None, 517, None), (None, 733, None)], 16) == 1
    # Nothing reused yet: the kind's.
    assert _block([(40, 0, 0)], 16) == 16


def test_what_a_response_left_uncached_bounds_the_block_from_below() -> None:
    """vLLM's CPU build, as the real one answered: a 33-token prompt cached nothing,
    a 355-token one 256 (two blocks of 128, its tail of 99 left out)."""
    real = [(33, 0, 0), (355, 0, 256), (377, 256, 0), (1046, 0, 1024), (1068, 1024, 0)]
    for n in range(2, len(real) + 1):
        assert _block(real[:n], 16) == 128, real[:n]
    # Another run: 453 tokens wrote 384, then 476 and 500 reused 384.
    again = [(33, 0, 0), (453, 0, 384), (476, 384, 0), (43, 0, 0), (500, 384, 0)]
    for n in range(2, len(again) + 1):
        assert _block(again[:n], 16) == 128, again[:n]
    # A tail longer than the kind's block: the smallest block the counts allow, vLLM's
    # usual 128 where it fits (453 tokens, 384 written: 128, not 96; 300 tokens, 256
    # written: 128, not 64), else a power of two, else any divisor.
    assert _block([(453, 0, 384)], 16) == 128
    assert _block([(300, 0, 256)], 16) == 128
    assert _block([(300, 0, 192)], 16) == 192  # 3 x 64, a tail of 108: no power of two fits
    assert _block([(400, 0, 360)], 8) == 45
    # A tail past 128 rules vLLM's usual sizes out: the next power of two.
    assert _block([(700, 0, 512)], 16) == 256
    # The tail alone, before anything was cached, is no block: caching may be off.
    assert _block([(900, 0, 0)], 16) == 16


def test_a_learned_block_and_the_cpu_build() -> None:
    assert servers.with_learned_block(servers.VLLM, 128) is servers.VLLM_CPU
    assert servers.with_learned_block(servers.VLLM_OR_SGLANG, 128) is servers.VLLM_CPU
    assert servers.with_learned_block(servers.VLLM, 16) is servers.VLLM
    sglang = servers.with_learned_block(servers.SGLANG, 64)
    assert sglang.name == "SGLang" and sglang.block_tokens == 64
    # llama-server's checkpoints at regular positions are no block.
    assert servers.with_learned_block(servers.LLAMA_SERVER, 256) is servers.LLAMA_SERVER
    assert servers.with_learned_block(servers.UNKNOWN, 128).block_tokens == 128
