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


def _without_server_header(src: Path, dst: Path, body_too: bool = False) -> None:
    """The same recording as a recorder without the `server` header would have made it;
    `body_too`: and from a vLLM that says nothing of itself in its body either
    (`--fingerprint-mode none`, a build before `created_cache_tokens`)."""
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        response = rec.get("response") or {}
        (response.get("headers") or {}).pop("server", None)
        body = response.get("body") or {}
        if body_too:
            body.pop("system_fingerprint", None)
            details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
            details.pop("created_cache_tokens", None)
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
    assert finding["evidence"]["server"] == {"vllm": "vLLM", "sglang": "SGLang"}[kind]
    text = analyze_text(rec)
    knob = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}[kind]
    assert knob in text and "shared prefix cache" in text
    assert "evicted" not in text and "side-calls ran" not in text
    assert "llama-server" not in text and "-np" not in text

    plain = tmp_path / "no-header.jsonl"
    _without_server_header(rec, plain)
    if kind == "vllm":  # its body still says vLLM
        assert _row(analyze(plain), 3)["lost_external"]["cause"] == "server_capacity"
        _without_server_header(rec, plain, body_too=True)
    old = _row(analyze(plain), 3)
    assert old["lost_external"]["cause"] == "side_call"


def _blocks_conversation(up: Upstream, rec: Path, turns: int, side: str = "") -> list[Any]:
    """A first prompt shorter than one block, then appended turns with a side-call
    (`side` before its question: a long one takes memory)."""
    usages = []
    with Mitmdump(up.url, rec, {"llmp_body": "digest"}) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
        for i in range(turns):
            content, _, usage = _turn(client, history)
            usages.append(usage)
            if i == 2:
                title = side + "Title this chat in five words."
                _turn(client, [{"role": "user", "content": title}])
            history += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"Step {i}: " + "read the next file, then " * 30},
            ]
        wait_for_records(rec, turns + 1)
    return usages


@pytest.mark.parametrize("block", [128, 64])
def test_a_block_is_learned_from_the_traffic(block: int, tmp_path: Path) -> None:
    """vLLM's CPU build reuses whole blocks of 128 tokens (another build, another size):
    a first prompt below one block caches nothing, and every later turn is short of its
    prefix by up to a block.  Neither is a loss."""
    rec = tmp_path / "rec.jsonl"
    with Upstream("vllm", block=block) as up:
        usages = _blocks_conversation(up, rec, 6)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[1] == 0 and all(c % block == 0 for c in cached) and max(cached) > block
    report = analyze(rec)
    assert report["time"]["by_cause"] == {}, [r.get("lost_external") for r in report["rows"]]
    assert all(r.get("lost_external") is None for r in report["rows"])


def test_the_cpu_builds_capacity_fix_names_its_own_knobs(tmp_path: Path) -> None:
    """A vLLM whose blocks are 128 tokens is the CPU build: its KV cache is host memory,
    sized by VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes."""
    rec = tmp_path / "rec.jsonl"
    with Upstream("vllm", block=128, capacity=700) as up:
        _blocks_conversation(up, rec, 6, side="Some unrelated notes to keep. " * 60)
    report = analyze(rec)
    (finding,) = [f for f in report["findings"] if f["kind"] == "server_cache_loss"]
    assert finding["evidence"] == {"kind": "server_capacity", "server": "vLLM (CPU)"}
    text = analyze_text(rec)
    assert "VLLM_CPU_KVCACHE_SPACE" in text and "--kv-cache-memory-bytes" in text
    assert "llama-server" not in text


@pytest.mark.parametrize(
    ("kind", "knob"), [("vllm", "--max-model-len"), ("sglang", "--context-length")]
)
@pytest.mark.parametrize("body", ["full", "digest"])
def test_a_refusal_for_the_context_names_the_servers_own_setting(
    kind: str, knob: str, body: str, tmp_path: Path
) -> None:
    """A prompt past vLLM's --max-model-len (SGLang's --context-length) is refused: the
    context_overflow finding's fix names that setting, never llama-server's -c."""
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind, n_ctx=300) as up, Mitmdump(up.url, rec, {"llmp_body": body}) as proxy:  # type: ignore[arg-type]
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Read this. " * 20}]
        refused = 0
        for _ in range(5):
            try:
                content, _, _ = _turn(client, history)
            except openai.BadRequestError:
                refused += 1
                break
            history += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "And this. " * 40},
            ]
        assert refused == 1
        records = wait_for_records(rec, len(up.log))
    assert records[-1]["response"]["status"] == 400
    report = analyze(rec)
    (finding,) = [f for f in report["findings"] if f["kind"] == "context_overflow"]
    assert finding["evidence"]["server"] == {"vllm": "vLLM", "sglang": "SGLang"}[kind]
    text = analyze_text(rec)
    assert knob in text and "llama-server" not in text and " -c" not in text, text
