"""The analyzer on counters from the real llama-server (`-np 1 --cache-ram 0`).

A scripted agent talks to the server; each exchange is written as the
recorder writes a full record (request and response bodies), so the verdicts
come from the server's real `cache_n`, `prompt_n` and `prompt_ms`.  Run with
`eval "$(../shared/tools/real-llama-server --env)"`; skipped otherwise.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmp.format.canonical import dumps, loads, record_dumps

SERVER = os.environ.get("LLMP_LLAMA_SERVER")
MODEL = os.environ.get("LLMP_LLAMA_MODEL")

pytestmark = [
    pytest.mark.real_server,
    pytest.mark.skipif(
        not (SERVER and MODEL and os.path.exists(SERVER) and os.path.exists(MODEL)),
        reason="needs LLMP_LLAMA_SERVER and LLMP_LLAMA_MODEL",
    ),
]

SYSTEM = (
    "You are a careful coding assistant. Answer in one short sentence. "
    "Never use lists. Prefer plain words over jargon. "
) * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    assert SERVER and MODEL
    proc = subprocess.Popen(
        [SERVER, "-m", MODEL, "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "1",
         "--cache-ram", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline or proc.poll() is not None:
                pytest.skip("llama-server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


class Recorder:
    """Sends chats and keeps full records, as the recorder would write them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.records: list[dict[str, Any]] = []

    def chat(self, body: dict[str, Any], ua: str) -> dict[str, Any]:
        raw = dumps(body)
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=raw,
            headers={"content-type": "application/json", "user-agent": ua},
        )
        t0 = int(time.time() * 1000)
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
            status = r.status
        t1 = int(time.time() * 1000)
        resp = loads(data)
        self.records.append(
            {
                "v": 1,
                "id": len(self.records) + 1,
                "conn": 1,
                "t_start_ms": t0,
                "t_first_byte_ms": t1,
                "t_end_ms": t1,
                "request": {
                    "method": "POST",
                    "path": "/v1/chat/completions",
                    "headers": {"content-type": "application/json", "user-agent": ua},
                    "body_bytes": len(raw),
                    "body": loads(raw),
                    "body_text": None,
                    "digest": None,
                },
                "response": {
                    "status": status,
                    "headers": {"content-type": "application/json"},
                    "stream": None,
                    "chunks": None,
                    "bad_chunks": None,
                    "body_bytes": len(data),
                    "truncated": False,
                    "body": resp,
                    "body_text": None,
                    "digest": None,
                },
                "error": None,
                "tokens": None,
            }
        )
        return resp

    def write(self, path: Path) -> Path:
        path.write_bytes(b"".join(record_dumps(r) + b"\n" for r in self.records))
        return path


def test_real_server_causes(server: str, tmp_path: Path) -> None:
    from llmp.analysis import Config, analyze

    rec = Recorder(server)
    ua = "scripted-agent/1.0"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        body = {"model": "main", "messages": messages, "max_tokens": 24, "temperature": 0.0}
        reply = rec.chat(body, ua)["choices"][0]["message"]
        messages.append({"role": "assistant", "content": reply.get("content") or ""})

    turn("What does a compiler do? " * 6)  # 1
    turn("And an interpreter? " * 6)  # 2: continues 1
    rec.chat(  # 3: a title side-call, another model name, its own system prompt
        {
            "model": "weak",
            "messages": [
                {"role": "system", "content": "Write a title of at most five words."},
                {"role": "user", "content": "What does a compiler do?"},
            ],
            "max_tokens": 8,
        },
        ua,
    )
    turn("Which one is faster? " * 6)  # 4: the slot was evicted by 3
    messages[0] = {"role": "system", "content": "Today is Monday. " + SYSTEM}
    turn("Why? " * 6)  # 5: the system prompt changed
    turn("Thanks. " * 6)  # 6: clean again

    path = rec.write(tmp_path / "real.jsonl")
    # A tiny model and short prompts: lower the noise floor of findings.
    result = analyze([str(path)], Config(min_lost_tokens=16))
    rep = result.report()
    result.close()
    rows = {r["id"]: r for r in rep["rows"]}

    # The served model is the model file, for both requested names (R20).
    assert rep["servers"][0]["api"] == "openai_chat"
    assert "reused_tokens" in rep["servers"][0]["fields"]
    assert rows[3]["kind"] == "side_call" and rows[3]["side_call_shape"] == "oneshot"
    assert [rows[i]["kind"] for i in (1, 2, 4, 5, 6)] == ["turn"] * 5
    assert {rows[i]["conversation"] for i in (1, 2, 4, 5, 6)} == {1}

    def reused(i: int) -> int:
        return int(rows[i]["counts"]["reused_tokens"]["value"])

    def prompt(i: int) -> int:
        return int(rows[i]["counts"]["prompt_tokens"]["value"])

    # 2 continued 1: the server reused at least 1's prompt, nothing lost.
    assert reused(2) >= prompt(1) - 2
    assert rows[2]["cause"] is None and rows[2]["lost_external"] is None

    # 4 came after the side-call on the same slot: real eviction, named.
    assert reused(4) < 16
    assert rows[4]["linked_to"] == 2 and rows[4]["side_calls_between"] == [3]
    assert rows[4]["cause"] == "side_call"
    ext = rows[4]["lost_external"]
    assert ext["cause"] == "side_call"
    assert ext["tokens"] == prompt(2) - reused(4)
    assert ext["ms"]["source"] == "server"

    # 5 changed its system prompt: a client break, the server could reuse nothing.
    assert rows[5]["break_cause"] == "system_changed"
    assert rows[5]["cause"] == "structural"
    assert rows[5]["lost_client"]["cause"] == "system_changed"
    assert rows[5]["lost_client"]["tokens"] > 0.5 * (prompt(4) - 60)

    # 6 continued 5 cleanly.
    assert rows[6]["break_cause"] is None and rows[6]["cause"] is None
    kinds = {f["kind"] for f in rep["findings"]}
    assert "side_call_on_conversation_model" in kinds
    assert "prefix_break" in kinds
