"""`/v1/messages` and `/v1/responses` of the real llama-server, through the real mitmdump.

The real `anthropic` and `openai` SDKs talk to a real llama-server (one slot,
no host-memory cache) through two recorders in a chain, a digest one in front
of a full one (`tests/e2e/test_messages_and_responses.py`), for three turns on each API,
streamed and not.  Every row's reused and evaluated counts must be the
server's own counters as recorded, the merged replies must be what the SDKs
assembled, and the digest recording's hashes those of the full bodies.
Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``; skipped without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.live_checks import analyze, value
from tests.support.real import LlamaServer, real_server_marks
from tests.support.sdk_chain import (
    CLAUDE_UA,
    CODEX_UA,
    blocks,
    chain,
    check_digests,
    completed,
    plain,
    records,
    user_item,
)

pytestmark = real_server_marks()

SYSTEM: Any = [
    {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=2.1.328.7c2; cc_entrypoint=sdk-cli;",
    },
    {
        "type": "text",
        "text": "You are a terse assistant. Answer in one short sentence. " * 6,
        "cache_control": {"type": "ephemeral"},
    },
]
DEVELOPER: Any = {
    "type": "message",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a terse assistant. Answer briefly. " * 6}],
}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama-new-apis")
    with LlamaServer(ctx=4096, log_path=tmp / "llama-server.log") as server:
        yield server


def test_messages_on_the_real_server(llama: LlamaServer, tmp_path: Path) -> None:
    with chain(llama.url, tmp_path) as (md, digest_path, full_path):
        client = anthropic.Anthropic(
            base_url=md.url,
            api_key="x",
            max_retries=0,
            timeout=120,
            default_headers={"user-agent": CLAUDE_UA},
        )
        history: list[Any] = []
        replies: list[Any] = []
        for n, question in enumerate(QUESTIONS):
            history.append({"role": "user", "content": question})
            args: Any = {
                "model": "smol",
                "max_tokens": 12,
                "system": SYSTEM,
                "messages": history,
            }
            if n == 1:
                msg: Any = client.messages.create(**args)
            else:
                with client.messages.stream(**args) as stream:
                    msg = stream.get_final_message()
            replies.append(msg)
            content = [b.model_dump(exclude_none=True) for b in msg.content]
            history.append({"role": "assistant", "content": content})
        digest, full = records(digest_path, 3), records(full_path, 3)

    check_digests(digest, full)
    assert [r["response"]["stream"] for r in full] == ["sse", None, "sse"]
    for rec, msg in zip(full, replies, strict=True):
        body = plain(rec["response"]["body"])
        assert blocks(body["content"]) == blocks(msg.content)
        assert (body["id"], body["stop_reason"]) == (msg.id, msg.stop_reason)
        assert body["usage"] == msg.usage.model_dump(exclude_none=True)
        assert "timings" not in body  # llama-server sends none on this endpoint
    for rec in digest:
        assert rec["error"] is None
        assert (rec["t_first_event_ms"] is None) == (rec["response"]["stream"] is None)

    report = analyze(digest_path)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in (1, 2, 3)] == ["anthropic_messages"] * 3
    assert [(rows[i]["conversation"], rows[i]["turn"]) for i in (1, 2, 3)] == [
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    for rec in digest:
        usage = rec["response"]["digest"]["usage"]["usage"]
        c = rows[rec["id"]]["counts"]
        assert c["reused_tokens"] == {"value": usage["cache_read_input_tokens"], "source": "server"}
        assert c["evaluated_tokens"] == {"value": usage["input_tokens"], "source": "server"}
    assert value(rows[2]["counts"]["reused_tokens"]) > 0  # the conversation's prefix was reused
    assert value(rows[3]["counts"]["reused_tokens"]) > value(rows[2]["counts"]["reused_tokens"])
    assert rows[1]["counts"]["prefill_ms"]["source"] == "proxy"
    assert rows[2]["counts"]["prefill_ms"] is None  # not streamed, no timings
    assert all(rows[i]["cause"] is None and rows[i]["break_cause"] is None for i in (2, 3))


def test_responses_on_the_real_server(llama: LlamaServer, tmp_path: Path) -> None:
    with chain(llama.url, tmp_path) as (md, digest_path, full_path):
        client = openai.OpenAI(
            base_url=md.url + "/v1",
            api_key="x",
            max_retries=0,
            timeout=120,
            default_headers={"user-agent": CODEX_UA},
        )
        items: list[Any] = [DEVELOPER]
        replies: list[Any] = []
        for n, question in enumerate(QUESTIONS):
            items.append(user_item(question))
            args: Any = {
                "model": "smol",
                "input": items,
                "max_output_tokens": 12,
                "temperature": 0,
                "store": False,
            }
            if n == 1:
                resp: Any = client.responses.create(**args)
            else:
                resp = completed(client.responses.create(stream=True, **args))
            replies.append(resp)
            items += [o.model_dump(exclude_none=True) for o in resp.output]
        digest, full = records(digest_path, 3), records(full_path, 3)

    check_digests(digest, full)
    assert [r["response"]["stream"] for r in full] == ["sse", None, "sse"]
    for rec, resp in zip(full, replies, strict=True):
        body = plain(rec["response"]["body"])
        assert blocks(body["output"]) == blocks(resp.output)
        assert body["id"] == resp.id
        assert body["usage"] == resp.usage.model_dump(exclude_none=True)
        assert ("timings" in body) == (rec["response"]["stream"] == "sse")
    assert all(r["error"] is None for r in digest)

    report = analyze(digest_path)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in (1, 2, 3)] == ["openai_responses"] * 3
    assert [(rows[i]["conversation"], rows[i]["turn"]) for i in (1, 2, 3)] == [
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    for rec in digest:
        top = rec["response"]["digest"]["usage"]
        usage = top["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        c = rows[rec["id"]]["counts"]
        assert c["reused_tokens"] == {"value": cached, "source": "server"}
        assert c["evaluated_tokens"] == {
            "value": usage["input_tokens"] - cached,
            "source": "server",
        }
        if "timings" in top:  # streamed: the server's own prefill and its counters agree
            assert c["prefill_ms"] == {"value": top["timings"]["prompt_ms"], "source": "server"}
            assert top["timings"]["cache_n"] == cached
        else:
            assert c["prefill_ms"] is None
    assert value(rows[2]["counts"]["reused_tokens"]) > 0
    assert value(rows[3]["counts"]["reused_tokens"]) > value(rows[2]["counts"]["reused_tokens"])
    assert all(rows[i]["cause"] is None and rows[i]["break_cause"] is None for i in (2, 3))
