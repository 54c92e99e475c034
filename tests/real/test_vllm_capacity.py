"""A capacity eviction on the real vLLM (CPU build): a small KV cache, three conversations.

vLLM keeps every request's prompt in one prefix cache until its memory runs short, then
frees the least recently used blocks.  With ``--kv-cache-memory-bytes 100M`` it holds
35 blocks of 128 tokens (4,480 tokens of SmolLM2): a conversation of about 1,500
tokens, then two others as long, and the first one's blocks are gone when it comes
back.  That is the cache's capacity (``server_capacity``), not the other conversations'
doing, and the fix names the CPU build's own knobs.

The truth is vLLM's `cached_tokens` of the returning turn, held against the prefix it
had cached (its previous prompt and reply), and `/metrics`.  Needs ``LLMP_VLLM_PYTHON``
and ``LLMP_VLLM_MODEL``; skipped without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live_checks import analyze_text
from tests.support.real_cases import MODES, Case, log_lines, record, rules, turn
from tests.support.real_vllm import VllmServer, real_vllm_marks

pytestmark = real_vllm_marks()

BLOCK = 128
KV_CACHE = "100M"
"""35 blocks of 2,949,120 bytes (SmolLM2 in bf16: 30 layers, 3 KV heads of 64)."""
FIRST, RETURN = (1, 2), 7
OTHERS = (3, 4, 5, 6)


def _conversation(system: str, start: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"{system}\n{rules(12, start)}"},
        {"role": "user", "content": log_lines(14, start)},
    ]


def _drive(case: Case, client: Any) -> None:
    def step(conv: list[dict[str, Any]], user: str) -> None:
        reply = turn(client, conv)
        conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]

    first = _conversation("You are an ops assistant.", 0)
    step(first, "Which requests failed?")  # 1
    step(first, "And in which region?")  # 2
    for n, system in enumerate(("You are a release manager.", "You are an auditor.")):
        other = _conversation(system, 12 * (n + 1))
        step(other, "Summarise it.")  # 3, 5
        step(other, "Thanks.")  # 4, 6
    step(first, "Who owns the gateway?")  # 7: its blocks are gone


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    with VllmServer(tmp_path_factory.mktemp("vllm-small"), kv_cache_bytes=KV_CACHE) as vllm:
        before = vllm.metrics()
        recorded = record(vllm, tmp_path_factory.mktemp("case"), "small", lambda c, k: _drive(k, c))
        after = vllm.metrics()
        recorded.notes["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
        recorded.notes["log"] = vllm.log_text()
        yield recorded


def _usage(case: Case, rid: int) -> dict[str, Any]:
    usage: dict[str, Any] = case.digest[rid]["response"]["digest"]["usage"]["usage"]
    return usage


def _cached(case: Case, rid: int) -> int:
    return int(_usage(case, rid)["prompt_tokens_details"]["cached_tokens"])


def test_the_server_evicted_the_first_conversation(case: Case) -> None:
    """vLLM's own counters: its cache was 4,480 tokens; the first conversation's second
    turn reused its first, and its return reused less than it had cached."""
    assert "KV cache size: 4,480 tokens" in case.notes["log"]
    held = _usage(case, 2)["prompt_tokens"] + _usage(case, 2)["completion_tokens"]
    assert _cached(case, 2) >= _usage(case, 1)["prompt_tokens"] - BLOCK
    assert _cached(case, RETURN) < held - 2 * BLOCK, (_cached(case, RETURN), held)
    usages = [_usage(case, rid) for rid in sorted(case.digest)]
    metrics = case.notes["metrics"]
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert metrics["vllm:prefix_cache_hits_total"] == hits
    assert metrics["vllm:prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in usages)


@pytest.mark.parametrize("mode", MODES)
def test_it_is_the_caches_capacity_to_within_a_block(case: Case, mode: str) -> None:
    """Charged to the cache's memory, by what vLLM re-read short of the prefix it had
    held, and never to the other conversations."""
    row = case.row(RETURN, mode)
    assert row["linked_to"] == 2 and row["other_conversations_between"], row
    lost = row["lost_external"]
    assert lost is not None and lost["cause"] == "server_capacity", row
    assert row.get("lost_client") is None
    # What the first conversation had in the cache after its second turn: that prompt
    # and its reply; vLLM read back all but `cached_tokens` of it.
    truth = _usage(case, 2)["prompt_tokens"] + _usage(case, 2)["completion_tokens"]
    truth -= _cached(case, RETURN)
    assert abs(lost["tokens"] - truth) <= BLOCK, (lost, truth)
    for rid in (*FIRST, *OTHERS):
        assert case.row(rid, mode).get("lost_external") is None, case.row(rid, mode)
    by_cause = case.reports[mode]["time"]["by_cause"]
    assert set(by_cause) == {"server_capacity"}, by_cause


def test_the_fix_is_the_cpu_builds(case: Case) -> None:
    """The CPU build's cache is host memory: VLLM_CPU_KVCACHE_SPACE or
    --kv-cache-memory-bytes; no llama-server flag, no slot."""
    report = case.reports["digest"]
    (finding,) = [f for f in report["findings"] if f["kind"] == "server_cache_loss"]
    assert finding["evidence"] == {"kind": "server_capacity", "server": "vLLM (CPU)"}
    assert not [f for f in report["findings"] if f["kind"].endswith("eviction")]
    text = analyze_text(Path(case.notes["digest_path"]))
    assert "VLLM_CPU_KVCACHE_SPACE" in text and "--kv-cache-memory-bytes" in text
    assert "llama-server" not in text and "-np" not in text
