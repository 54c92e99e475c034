"""The recorder in front of the real llama-server, driven by the real openai client.

One scenario runs once per module, through two recorders in a chain:

    openai client -> mitmdump (full) -> mitmdump (digest) -> llama-server

so both recordings hold exactly the same exchanges, byte for byte, and the
hashes of the two modes can be compared without any doubt about what the
(non-deterministic) model said. The scenario, on one slot (``-np 1``) with
the host-memory prompt cache off (``--cache-ram 0``):

1. three streamed turns of one conversation, with ``include_usage``;
2. a non-streamed side call with another system prompt (it takes the slot);
3. a fourth streamed turn of the conversation (its cache was evicted);
4. a streamed request too long for the context (``-c 512``): HTTP 400.

Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``; skipped without them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmp.apis.openai_chat import OpenAIChat
from llmp.format import canonical
from tests.support.mitm import Mitmdump, read_records
from tests.support.real import LlamaServer, real_server_marks

openai = pytest.importorskip("openai")

pytestmark = real_server_marks()

CTX = 512
MAX_TOKENS = 8
SYSTEM = "You are a terse assistant. Answer in one short sentence."
QUESTIONS = (
    "What is the capital of France?",
    "And of Italy?",
    "And of Spain?",
    "And of Portugal?",
)
SIDE_SYSTEM = "Write a one-line commit message for the change."
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 80  # about 800 tokens


@dataclass
class Turn:
    """What the client itself assembled from one exchange."""

    content: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    timings: dict[str, Any] | None
    stream: bool


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    context_error: dict[str, Any] | None = None
    full: list[dict[str, Any]] = field(default_factory=list)
    digest: list[dict[str, Any]] = field(default_factory=list)
    full_lines: dict[int, bytes] = field(default_factory=dict)
    full_path: Path | None = None
    digest_path: Path | None = None


def _streamed_turn(client: Any, messages: list[dict[str, Any]]) -> Turn:
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    content = ""
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.to_dict()
        extra = chunk.model_extra or {}
        if extra.get("timings") is not None:
            timings = extra["timings"]
    return Turn(content, finish, usage, timings, stream=True)


def _plain_call(client: Any, messages: list[dict[str, Any]]) -> Turn:
    resp = client.chat.completions.create(
        model="smol-weak", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    extra = resp.model_extra or {}
    usage = resp.usage.to_dict() if resp.usage is not None else None
    choice = resp.choices[0]
    return Turn(
        choice.message.content or "", choice.finish_reason, usage, extra.get("timings"), False
    )


def _scenario(client: Any, run: Run) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        turn = _streamed_turn(client, messages)
        run.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.content})
    side = [
        {"role": "system", "content": SIDE_SYSTEM},
        {"role": "user", "content": "diff: renamed foo to bar"},
    ]
    run.turns.append(_plain_call(client, side))
    messages.append({"role": "user", "content": QUESTIONS[3]})
    run.turns.append(_streamed_turn(client, messages))
    with pytest.raises(openai.BadRequestError) as info:
        _streamed_turn(client, [{"role": "user", "content": LONG_PROMPT}])
    run.context_error = {"status": info.value.status_code, "body": info.value.body}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama")
    with LlamaServer(ctx=CTX, log_path=tmp / "llama-server.log") as server:
        yield server


@pytest.fixture(scope="module")
def run(llama: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("real")
    result = Run(full_path=tmp / "full.jsonl", digest_path=tmp / "digest.jsonl")
    inner = Mitmdump(
        llama.url,
        result.digest_path,
        {"llmp_body": "digest", "llmp_tokenize": "true"},
        record_option="llmp_file",
        log_path=tmp / "mitm-digest.log",
    )
    with inner:
        outer = Mitmdump(
            inner.url,
            result.full_path,
            {"llmp_body": "full", "llmp_tokenize": "false"},  # its upstream is a recorder
            record_option="llmp_file",
            log_path=tmp / "mitm-full.log",
        )
        with outer:
            client = openai.OpenAI(base_url=outer.url + "/v1", api_key="x", max_retries=0)
            _scenario(client, result)
            client.close()
            outer.stop()  # SIGINT: in-flight records written, file closed
        inner.stop()
    assert result.full_path is not None and result.digest_path is not None
    result.full = read_records(result.full_path)
    result.digest = read_records(result.digest_path)
    for line in result.full_path.read_bytes().splitlines():
        if line.strip():
            rec = canonical.loads(line)
            result.full_lines[int(rec["id"])] = line
    return result


# The requests, in order: turns 1-3, the side call, turn 4, the context error.
STREAMED = (0, 1, 2, 4)
SIDE = 3
TOO_LONG = 5
N_EXCHANGES = 6


def _settled(rec: dict[str, Any]) -> None:
    """The exchange ended without error.

    openai-python closes the connection as soon as it reads ``data: [DONE]``,
    sometimes before the chunked terminator: the recorder must not call that
    a disconnect (see docs/real-traffic.md).
    """
    assert rec["error"] is None


def test_one_record_per_exchange(run: Run) -> None:
    for records in (run.full, run.digest):
        assert [r["id"] for r in records] == list(range(1, N_EXCHANGES + 1))
        for rec in records:
            assert rec["v"] == 1
            assert rec["request"]["method"] == "POST"
            assert rec["request"]["path"] == "/v1/chat/completions"
            assert rec["request"]["headers"]["user-agent"].startswith("OpenAI/Python")
            assert "authorization" not in rec["request"]["headers"]
    # The digest recorder sits in front of llama-server: its records carry the server's
    # counts (llmp_tokenize); the full one, in front of a recorder, asks nobody.
    assert all(rec["tokens"] is None for rec in run.full)
    for rec in run.digest:
        if rec["response"]["status"] == 200:
            hashes = {m["hash"] for m in rec["request"]["digest"]["messages"]}
            assert set(rec["tokens"]["messages"]) == hashes
    for i in (*STREAMED, SIDE):
        _settled(run.full[i])
        _settled(run.digest[i])


def test_streamed_turns_merged_as_the_client_saw_them(run: Run) -> None:
    for i in STREAMED:
        rec, turn = run.full[i], run.turns[i]
        resp = rec["response"]
        assert resp["status"] == 200
        assert resp["stream"] == "sse"
        assert resp["headers"]["content-type"].startswith("text/event-stream")
        assert resp["bad_chunks"] == 0
        # role chunk + one per token (at most) + finish chunk + usage chunk
        assert 3 <= resp["chunks"] <= MAX_TOKENS + 3
        body = resp["body"]
        assert body["object"] == "chat.completion"
        message = body["choices"][0]["message"]
        assert message["role"] == "assistant"
        assert message["content"] == turn.content
        assert body["choices"][0]["finish_reason"] == turn.finish_reason
        assert body["usage"] == turn.usage
        assert body["timings"] == turn.timings
        # llama-server answers with its model file, not the requested name (R20)
        assert rec["request"]["body"]["model"] == "smol"
        assert body["model"] != "smol"


def test_usage_and_timings_kept(run: Run) -> None:
    for i in (*STREAMED, SIDE):
        turn = run.turns[i]
        assert turn.usage is not None and turn.timings is not None
        for key in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"):
            assert key in turn.timings
        # prompt_n excludes the cached part; usage.prompt_tokens includes it
        assert turn.timings["cache_n"] + turn.timings["prompt_n"] == turn.usage["prompt_tokens"]
        assert turn.usage["prompt_tokens_details"]["cached_tokens"] == turn.timings["cache_n"]
        kept = run.digest[i]["response"]["digest"]["usage"]
        assert kept["usage"] == turn.usage
        assert kept["timings"] == turn.timings
        assert run.full[i]["response"]["body"]["timings"] == turn.timings


def test_cache_reuse_grows_then_side_call_evicts(run: Run) -> None:
    t1, t2, t3, side, t4 = (run.turns[i].timings for i in range(5))
    u1, u2, u3 = (run.turns[i].usage for i in range(3))
    assert t1 is not None and t2 is not None and t3 is not None
    assert side is not None and t4 is not None
    assert u1 is not None and u2 is not None and u3 is not None
    # each turn continues the last: the whole previous prompt is reused
    assert t2["cache_n"] > t1["cache_n"]
    assert t3["cache_n"] > t2["cache_n"]
    assert t2["cache_n"] >= u1["prompt_tokens"]
    assert t3["cache_n"] >= u2["prompt_tokens"]
    # the side call took the only slot: turn 4 starts (almost) from nothing
    assert side["cache_n"] < t3["cache_n"]
    assert t4["cache_n"] < u3["prompt_tokens"] // 2
    assert t4["prompt_n"] > t3["prompt_n"]


def test_times_ordered(run: Run) -> None:
    for records in (run.full, run.digest):
        for rec in records:
            first = rec["t_first_byte_ms"]
            assert first is not None  # every exchange here had a body
            assert rec["t_start_ms"] <= first <= rec["t_end_ms"]
        starts = [r["t_start_ms"] for r in records]
        assert starts == sorted(starts)
    now = int(time.time() * 1000)
    assert all(now - 3_600_000 < r["t_start_ms"] <= now for r in run.full)


def test_non_streamed_call(run: Run) -> None:
    rec, turn = run.full[SIDE], run.turns[SIDE]
    resp = rec["response"]
    assert resp["status"] == 200
    assert resp["stream"] is None
    assert resp["chunks"] is None and resp["bad_chunks"] is None
    assert resp["headers"]["content-type"].startswith("application/json")
    assert int(resp["headers"]["content-length"]) == resp["body_bytes"]
    assert resp["body"]["choices"][0]["message"]["content"] == turn.content
    assert resp["body"]["usage"] == turn.usage
    digest = run.digest[SIDE]
    assert digest["response"]["stream"] is None
    assert digest["request"]["digest"]["params"]["stream"] is False
    assert digest["request"]["digest"]["model"] == "smol-weak"


def test_context_error_recorded(run: Run) -> None:
    assert run.context_error is not None
    assert run.context_error["status"] == 400
    rec = run.full[TOO_LONG]
    assert rec["error"] is None  # a clean HTTP error is not a recorder error
    resp = rec["response"]
    assert resp["status"] == 400
    # streaming was asked for, but the error comes before it as plain JSON
    assert rec["request"]["body"]["stream"] is True
    assert resp["stream"] is None and resp["chunks"] is None
    assert resp["headers"]["content-type"].startswith("application/json")
    error = resp["body"]["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["code"] == 400
    assert error["n_ctx"] == CTX
    assert error["n_prompt_tokens"] > CTX
    assert "exceeds the available context size" in error["message"]
    # digest mode: the request is digested, a non-2xx response body is not
    digest = run.digest[TOO_LONG]
    assert digest["error"] is None
    assert digest["response"]["status"] == 400
    assert digest["response"]["digest"] is None
    assert digest["request"]["digest"] is not None


def test_digest_and_full_hash_alike(run: Run) -> None:
    for full, digest in zip(run.full, run.digest, strict=True):
        rid = full["id"]
        assert digest["id"] == rid
        assert full["request"]["digest"] is None and digest["request"]["body"] is None
        body = canonical.loads(run.full_lines[rid])["request"]["body"]
        recomputed = OpenAIChat().request_digest(body)
        assert recomputed is not None
        assert recomputed == digest["request"]["digest"]
        assert len(recomputed["messages"]) == len(full["request"]["body"]["messages"])
        if digest["response"]["digest"] is not None:
            merged = canonical.loads(run.full_lines[rid])["response"]["body"]
            assert OpenAIChat().response_digest(merged) == digest["response"]["digest"]
    # the conversation's messages keep their hashes from turn to turn
    turn_hashes = [
        [m["hash"] for m in run.digest[i]["request"]["digest"]["messages"]] for i in STREAMED
    ]
    for before, after in itertools.pairwise(turn_hashes):
        assert after[: len(before)] == before
        assert len(after) == len(before) + 2


def test_complete_stream_is_not_client_disconnected(llama: LlamaServer, tmp_path: Path) -> None:
    """openai-python drops the connection after ``[DONE]``; that is not a disconnect."""
    path = tmp_path / "race.jsonl"
    n = 20
    with Mitmdump(llama.url, path, {"llmp_body": "full"}, record_option="llmp_file") as md:
        client = openai.OpenAI(base_url=md.url + "/v1", api_key="x", max_retries=0)
        for i in range(n):
            stream = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": f"Say {i}."}],
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=1,
                temperature=0,
            )
            for _ in stream:
                pass
        client.close()
        md.stop()
    records = read_records(path)
    assert len(records) == n
    assert all(r["response"]["body"]["usage"] is not None for r in records)
    assert [r["id"] for r in records if r["error"] is not None] == []
