"""apis/servers.py: which server answered, and what its cache does."""

from __future__ import annotations

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
    assert servers.VLLM_OR_SGLANG.cache == servers.SHARED
    # The granularity that is no loss covers the coarser of the two (vLLM's blocks).
    assert servers.VLLM_OR_SGLANG.block_tokens == max(BLOCK.values())
    assert servers.UNKNOWN.block_tokens == servers.LLAMA_SERVER.block_tokens == 1
