"""vLLM's and SGLang's chat API end to end: the real mitmdump, the real openai SDK, the
fakes' shared prefix cache (one cache for all requests, LRU under memory pressure).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from llmp.demo.fakes import SharedCacheServer
from tests.support.live_checks import analyze, analyze_text
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful coding agent. " + "Read the file before you edit it. " * 60


def _turn(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        model="qwen",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, reasoning, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            extra = choice.delta.model_extra or {}
            reasoning.append(extra.get("reasoning") or extra.get("reasoning_content") or "")
    return "".join(content), "".join(reasoning), usage


def _conversation(up: Upstream, rec: Path) -> tuple[list[Any], list[dict[str, Any]]]:
    """An agent's two turns with a side-call between them."""
    with Mitmdump(up.url, rec, {"llmp_body": "full"}) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        history: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files."},
        ]
        first = _turn(client, history)
        side = _turn(client, [{"role": "user", "content": "Title this chat in five words."}])
        history += [
            {"role": "assistant", "content": first[0]},
            {"role": "user", "content": "Now open main.py."},
        ]
        second = _turn(client, history)
        records = wait_for_records(rec, 3)
    return [first, side, second], records


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_shared_cache_keeps_the_agent_across_a_side_call(kind: str, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind) as up:  # type: ignore[arg-type]
        turns, records = _conversation(up, rec)
        assert [e.response_header("server") for e in up.log] == ["uvicorn"] * 3
    (content, reasoning, usage) = turns[2]
    assert content == f"Hello from fake {kind}" and reasoning == "Let me think about it."
    # the side-call did not evict the agent: the second turn reuses its first prompt
    first_prompt = turns[0][2].prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    block = 16 if kind == "vllm" else 1
    assert first_prompt - block <= cached <= first_prompt
    assert cached % block == 0
    assert [r["response"]["headers"]["server"] for r in records] == ["uvicorn"] * 3
    body = records[2]["response"]["body"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert body["choices"][0]["message"]["content"] == content
    report = analyze(rec)
    assert report["time"]["by_cause"].get("side_call", 0) == 0


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_short_memory_evicts_and_no_flag_no_counter(kind: str, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind, capacity=200, cache_report=False) as up:  # type: ignore[arg-type]
        turns, records = _conversation(up, rec)
        # 200 tokens of memory hold the side-call or the agent, not both
        app = up.app
        assert isinstance(app, SharedCacheServer)
        assert list(app.cache.prompts.values()) == [turns[2][2].prompt_tokens]
    for r in records:
        usage = r["response"]["body"]["usage"]
        assert usage["prompt_tokens"] > 0
        assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is None


def test_context_errors_have_each_servers_shape(tmp_path: Path) -> None:
    for kind, needle in (("vllm", "maximum context length"), ("sglang", "context length")):
        with Upstream(kind, n_ctx=64) as up:  # type: ignore[arg-type]
            client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": SYSTEM}]
                )
        assert needle in str(err.value)


def _without_server_header(src: Path, dst: Path) -> None:
    """The same recording as a recorder without the `server` header would have made it."""
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        ((rec.get("response") or {}).get("headers") or {}).pop("server", None)
        lines.append(json.dumps(rec))
    dst.write_text("\n".join(lines) + "\n")


def _row(report: dict[str, Any], rid: int) -> dict[str, Any]:
    return next(r for r in report["rows"] if r["id"] == rid)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_shared_cache_loses_nothing_to_a_side_call_or_its_blocks(
    kind: str, tmp_path: Path
) -> None:
    """Memory to spare: the side-call evicted nothing, and vLLM's reuse, a block short of
    the prefix, is its granularity: nothing is lost, and nothing is blamed."""
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind) as up:  # type: ignore[arg-type]
        _conversation(up, rec)
    report = analyze(rec)
    second = _row(report, 3)
    assert second["kind"] == "turn" and second["linked_to"] == 1
    assert second["side_calls_between"] == [2]
    assert second["lost_external"] is None and second["cause"] is None, second
    assert report["time"]["by_cause"] == {}
    assert not [f for f in report["findings"] if f["kind"] != "large_system_prompt"]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_shared_cache_short_of_memory_is_capacity_not_the_side_call(
    kind: str, tmp_path: Path
) -> None:
    """200 tokens of KV memory hold the side-call or the agent, not both: the agent's
    next turn re-reads its prompt.  On a shared cache that is the cache's capacity; the
    same traffic without the `server` header is read as llama-server's slot eviction."""
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind, capacity=200) as up:  # type: ignore[arg-type]
        turns, _ = _conversation(up, rec)
    assert turns[2][2].prompt_tokens_details.cached_tokens == 0  # the server's own count
    report = analyze(rec)
    second = _row(report, 3)
    assert second["lost_external"]["cause"] == "server_capacity", second
    assert second["cause"] == "server_reset"
    assert second["lost_external"]["tokens"] >= turns[0][2].prompt_tokens - 32
    assert "side_call" not in report["time"]["by_cause"]
    (finding,) = [f for f in report["findings"] if f["kind"] == "server_cache_loss"]
    assert finding["evidence"]["kind"] == "server_capacity"
    assert not [f for f in report["findings"] if f["kind"].endswith("eviction")]
    assert not [f for f in report["findings"] if f["kind"] == "side_call_on_conversation_model"]
    text = analyze_text(rec)
    assert "--gpu-memory-utilization" in text and "shared prefix cache" in text
    assert "evicted" not in text and "side-calls ran" not in text

    plain = tmp_path / "no-header.jsonl"
    _without_server_header(rec, plain)
    old = _row(analyze(plain), 3)
    assert old["lost_external"]["cause"] == "side_call"
