"""Token counts at record time (`llmp_tokenize`, recorder/tokens.py), through the real mitmdump.

The fake llama-server answers `/tokenize` with a token per 4 characters, and so do
the fake vLLM and SGLang in their own request shape; the fake Ollama has no such
endpoint.  A digest record carries the counts of its messages and tools by hash
(never their text), each hash is asked once, and only a server the response shows
to have the endpoint is asked (R35): never one that looks like none of them, never
one that says it is a cloud provider.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from llmp.apis.openai_chat import OpenAIChat
from llmp.demo.fakes import SharedCacheServer
from llmp.format import canonical
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

ON = {"llmp_tokenize": "true"}  # the product's default; the test helper's is off

SYSTEM = "You are terse. The secret word is marmalade."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _chat(url: str, turns: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-never-written", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} about the weather in Oslo"})
        out = client.chat.completions.create(
            model="smol",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=8,
        )
        messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    client.close()


def _tokenize_requests(up: Upstream) -> int:
    return sum(1 for ex in up.log if ex.path == "/tokenize")


def test_digest_records_carry_the_upstreams_counts(tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    with Upstream("llama") as up, Mitmdump(up.url, rec, ON) as proxy:
        _chat(proxy.url, 3)
        records = wait_for_records(rec, 3)
        asked = _tokenize_requests(up)
        chats = [ex for ex in up.log if ex.path == "/v1/chat/completions"]
        bodies = [canonical.loads(ex.request_body) for ex in chats]
    api = OpenAIChat()
    distinct: set[str] = set()
    for record, body in zip(records, bodies, strict=True):
        messages, tools = api.count_targets(body)
        distinct |= {k for k, t in (messages | tools).items() if t}
        tokens = record["tokens"]
        assert tokens is not None, record
        # The fake's tokenizer: one token per 4 characters of the counted text.
        assert tokens["messages"] == {k: math.ceil(len(t) / 4) for k, t in messages.items()}
        assert tokens["tools"] == {k: math.ceil(len(t) / 4) for k, t in tools.items()}
        hashes = [m["hash"] for m in record["request"]["digest"]["messages"]]
        assert set(tokens["messages"]) == set(hashes)
    # Each distinct text asked once (an empty one is 0 without asking): the system
    # message, three questions and the tool; the fake's replies here are tool calls.
    assert asked == len(distinct) >= 5
    text = rec.read_text()
    assert "marmalade" not in text and "Oslo" not in text and "sk-never-written" not in text


def test_off_and_an_upstream_without_a_tokenizer_give_no_counts(tmp_path: Path) -> None:
    rec = tmp_path / "off.jsonl"
    with Upstream("llama") as up, Mitmdump(up.url, rec, {"llmp_tokenize": "false"}) as proxy:
        _chat(proxy.url, 2)
        records = wait_for_records(rec, 2)
        assert _tokenize_requests(up) == 0
    assert [r["tokens"] for r in records] == [None, None]


def _only_the_clients(up: Upstream, rec: Path, options: dict[str, str], calls: int) -> None:
    """The upstream got the client's requests and nothing else; the records, no counts."""
    with Mitmdump(up.url, rec, options) as proxy:
        _chat(proxy.url, calls)
        records = wait_for_records(rec, calls)
        paths = [ex.path for ex in up.log]
    assert paths == ["/v1/chat/completions"] * calls
    assert [r["tokens"] for r in records] == [None] * calls
    assert [r["error"] for r in records] == [None] * calls


def test_a_server_that_looks_like_none_is_never_asked(tmp_path: Path) -> None:
    """R35: Ollama's OpenAI-style endpoint says nothing of llama-server, vLLM or SGLang
    (it has no /tokenize either): no message text goes anywhere the client did not send it."""
    with Upstream("ollama") as up:
        _only_the_clients(up, tmp_path / "ollama.jsonl", ON, 2)
    # A bare uvicorn server (vLLM's fingerprint and counters off, or any Python app).
    with Upstream("vllm", cache_report=False) as up:
        assert isinstance(up.app, SharedCacheServer)
        up.app.fingerprint = None
        _only_the_clients(up, tmp_path / "uvicorn.jsonl", ON, 2)


def test_a_server_posing_as_a_provider_is_never_asked(tmp_path: Path) -> None:
    """R35: a llama-server (its timings, its header) that also sends a header only
    OpenAI sends, or only Anthropic: a provider, whatever else it looks like."""
    for header in ("openai-processing-ms:7", "anthropic-organization-id:org-1"):
        with Upstream("llama", fake=f"header={header}") as up:
            _only_the_clients(up, tmp_path / f"{header[:6]}.jsonl", ON, 2)
        # The same server without that header is asked (the test can fail).
    with Upstream("llama") as up, Mitmdump(up.url, tmp_path / "plain.jsonl", ON) as proxy:
        _chat(proxy.url, 1)
        wait_for_records(tmp_path / "plain.jsonl", 1)
        assert _tokenize_requests(up) > 0


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_vllm_and_sglang_are_asked_in_their_own_shape(kind: str, tmp_path: Path) -> None:
    """vLLM's and SGLang's /tokenize take `{"prompt", "add_special_tokens"}`, not
    llama-server's `{"content"}`: asked so, each distinct text once, no model named."""
    rec = tmp_path / "rec.jsonl"
    with Upstream(kind) as up, Mitmdump(up.url, rec, ON) as proxy:  # type: ignore[arg-type]
        _chat(proxy.url, 3)
        records = wait_for_records(rec, 3)
        asked = [canonical.loads(ex.request_body) for ex in up.log if ex.path == "/tokenize"]
        chats = [ex for ex in up.log if ex.path == "/v1/chat/completions"]
        bodies = [canonical.loads(ex.request_body) for ex in chats]
    assert asked and all(set(a) == {"prompt", "add_special_tokens"} for a in asked)
    assert all(a["add_special_tokens"] is False for a in asked)
    prompts = [a["prompt"] for a in asked]
    assert len(prompts) == len(set(prompts))
    api = OpenAIChat()
    for record, body in zip(records, bodies, strict=True):
        messages, tools = api.count_targets(body)
        tokens = record["tokens"]
        assert tokens is not None, record
        # The fake's tokenizer, without the BOS add_special_tokens would add.
        assert tokens["messages"] == {k: math.ceil(len(t) / 4) for k, t in messages.items()}
        assert tokens["tools"] == {k: math.ceil(len(t) / 4) for k, t in tools.items()}
    assert "marmalade" not in rec.read_text()


def test_the_analyzer_reads_the_counts_as_the_tokenizers(tmp_path: Path) -> None:
    from llmp.analysis import analyze

    rec = tmp_path / "rec.jsonl"
    with Upstream("llama") as up, Mitmdump(up.url, rec, ON) as proxy:
        _chat(proxy.url, 2)
        wait_for_records(rec, 2)
    result = analyze([str(rec)])
    try:
        rows = result.report()["rows"]
    finally:
        result.close()
    assert rows[1]["composition"]["system"]["source"] == "tokenizer"


def test_a_stalled_tokenizer_holds_no_client_and_no_record_for_long(tmp_path: Path) -> None:
    """`/tokenize` that hangs: the client's answers never wait for it (the recorder asks
    off the client's path), the first record waits at most the tokenizer's time-out, and
    the rest, with the upstream paused, none; the records are whole, without counts."""
    from llmp.demo.fakes.llama import Llama
    from llmp.recorder.tokens import TIMEOUT

    rec = tmp_path / "stalled.jsonl"
    with Upstream("llama") as up, Mitmdump(up.url, rec, ON) as proxy:
        assert isinstance(up.app, Llama)
        up.app.tokenize_stall = 30.0
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        answered: list[float] = []
        for i in range(3):
            started = time.monotonic()
            client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
            )
            answered.append(time.monotonic())
            assert answered[-1] - started < 1.5, "the client waited for the tokenizer"
        client.close()
        records = wait_for_records(rec, 3, timeout=TIMEOUT + 8)
        written = time.monotonic()
    assert written - answered[0] < TIMEOUT + 8
    assert [r["tokens"] for r in records] == [None, None, None]
    assert [r["error"] for r in records] == [None, None, None]
    assert _tokenize_requests(up) == 1  # timed out once, then the upstream was paused
