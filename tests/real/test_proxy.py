"""`llmp proxy` alone, in front of the real llama-server, with the real openai client (issue 6)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.mitm import read_records
from tests.support.proxy import LlmpProxy
from tests.support.real import LlamaServer, real_server_marks

pytestmark = real_server_marks()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama-proxy")
    with LlamaServer(ctx=2048, log_path=tmp / "llama-server.log") as server:
        yield server


def test_llmp_proxy_records_real_clients(llama: LlamaServer, tmp_path: Path) -> None:
    out = tmp_path / "rec.jsonl"
    proxy = LlmpProxy(
        ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(out)],
        tmp_path / "work",
        tmp_path / "conf",
    )
    with proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-not-recorded", max_retries=0)
        messages: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]
        replies = []
        for turn in range(2):
            stream = client.chat.completions.create(  # type: ignore[call-overload]
                model="smol",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=8,
                temperature=0,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            replies.append(text)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And {turn}?"},
            ]
        assert proxy.stop() == 0
    assert "OLLAMA_HOST=" in proxy.stdout()
    records = read_records(out)
    assert [r["id"] for r in records] == [1, 2]
    for rec, text in zip(records, replies, strict=True):
        assert rec["error"] is None and rec["response"]["status"] == 200
        assert rec["response"]["stream"] == "sse" and rec["response"]["chunks"] > 0
        assert rec["response"]["digest"]["output"]["content_chars"] == len(text)
        assert "timings" in rec["response"]["digest"]["usage"]
    assert records[1]["response"]["digest"]["usage"]["timings"]["cache_n"] > 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert b"sk-not-recorded" not in out.read_bytes()
