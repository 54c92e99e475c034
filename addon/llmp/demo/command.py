"""`llmp demo`: record a short scripted agent session and explain it.

It needs no model server: by default it starts the bundled fake llama-server
(`llmp.demo.fakes`), which speaks llama-server's wire format and simulates a
one-slot prefix cache. With `LLMP_LLAMA_SERVER` and `LLMP_LLAMA_MODEL` set it
starts that real llama-server instead (`-np 1`, so the cache losses are real).
The traffic goes through the real `mitmdump -s addon/llmp_addon.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from llmp.analysis.command import print_readable

USER_AGENT = "llmp-demo-agent/1.0"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "File path"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and report failures.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


GUIDELINES = [
    "Read a file before you change it, and change only what the task needs.",
    "Keep the existing style: names, formatting, docstrings and type hints.",
    "Run the tests after every change and report failures with their output.",
    "Never invent APIs; look them up in the repository or say you are unsure.",
    "Prefer small, reviewable steps, and explain each one in a sentence.",
    "Do not touch generated files, lock files or vendored code.",
    "When a command fails, read the error before trying something else.",
    "Ask before deleting files or rewriting history.",
]


def _system(clock: str) -> dict[str, str]:
    # Like many harnesses' prompts: long, and the clock near the top, so that
    # a new minute invalidates everything after it.
    rules = "\n".join(f"{n}. {rule}" for n, rule in enumerate(GUIDELINES * 3, 1))
    return {
        "role": "system",
        "content": f"Current time: {clock}.\n"
        "You are a careful coding agent working in a small Python repository. "
        f"Answer briefly. Use the tools when you need to look at files.\n{rules}",
    }


def scripted_session() -> Iterator[tuple[str, dict[str, Any]]]:
    """The agent's requests, in order, each with a label saying what it shows."""
    history: list[dict[str, Any]] = [
        _system("2026-11-30 09:00"),
        {"role": "user", "content": "What does utils.py do? Keep it short."},
    ]
    reply = "It holds small string helpers."
    yield "turn 1: a new conversation", {"messages": list(history)}
    history += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Is there a test for slugify()?"},
    ]
    yield "turn 2: continues turn 1 (prefix reused)", {"messages": list(history)}
    title = [
        {"role": "system", "content": "Write a 3-5 word title for this conversation."},
        {"role": "user", "content": history[1]["content"]},
    ]
    yield "side-call: a title request on the same model", {"messages": title, "tools": None}
    history += [
        {"role": "assistant", "content": "Yes, tests/test_utils.py covers it."},
        {"role": "user", "content": "Run the tests please."},
    ]
    yield "turn 3: continues, after the side-call evicted the slot", {"messages": list(history)}
    history[0] = _system("2026-11-30 09:01")
    history += [
        {"role": "assistant", "content": "All 12 tests pass."},
        {"role": "user", "content": "Thanks. Anything else worth fixing?"},
    ]
    yield "turn 4: the system prompt's clock changed", {"messages": list(history)}
    history += [
        {"role": "assistant", "content": "slugify() ignores unicode; worth a test."},
        {"role": "user", "content": "Add that test."},
    ]
    yield "turn 5: continues normally", {"messages": list(history)}


def post_chat(base_url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Send one streamed chat request like an agent would; return what it assembled."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout
    )
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={
                "content-type": "application/json",
                "user-agent": USER_AGENT,
                "authorization": "Bearer demo-key-not-recorded",
            },
        )
        resp = conn.getresponse()
        content: list[str] = []
        usage: dict[str, Any] = {}
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if isinstance(piece, str):
                    content.append(piece)
            for key in ("usage", "timings"):
                if event.get(key):
                    usage[key] = event[key]
        return {"status": resp.status, "content": "".join(content), **usage}
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, path: str, timeout: float) -> None:
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready within {timeout:.0f} s")


@contextlib.contextmanager
def model_server(log_dir: Path) -> Iterator[tuple[str, str]]:
    """A real llama-server when the environment names one, else the bundled fake."""
    binary = os.environ.get("LLMP_LLAMA_SERVER")
    model = os.environ.get("LLMP_LLAMA_MODEL")
    if binary and model:
        port = _free_port()
        log = open(log_dir / "llama-server.log", "wb")
        proc = subprocess.Popen(
            [
                binary,
                "-m",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-c",
                "4096",
                "-np",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url, "/health", 180)
            yield url, f"real llama-server ({Path(model).name})"
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
            log.close()
        return
    from llmp.demo.fakes import Upstream

    with Upstream("llama") as up:
        yield up.url, "the bundled fake llama-server"


def addon_script() -> Path:
    """The mitmdump entry script beside the package."""
    import llmp

    return Path(llmp.__file__).resolve().parent.parent / "llmp_addon.py"


@contextlib.contextmanager
def mitmdump(upstream: str, record: Path, log_dir: Path) -> Iterator[str]:
    """The real mitmdump with the recorder, in reverse mode in front of `upstream`."""
    exe = Path(sys.executable).with_name("mitmdump")
    log_path = log_dir / "mitmdump.log"
    port = _free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                str(exe),
                "-s",
                str(addon_script()),
                "--mode",
                f"reverse:{upstream}",
                "--listen-host",
                "127.0.0.1",
                "-p",
                str(port),
                "--set",
                f"confdir={log_dir / 'mitmproxy'}",
                "--set",
                "flow_detail=0",
                "--set",
                f"llmp_file={record}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while "llmp: recording to" not in log_path.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "mitmdump did not start:\n" + log_path.read_text(errors="replace")
                    )
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def show_recording(path: Path) -> None:
    """A compact table of the records, so the user sees what was captured."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{path.name}: one record per exchange (digest mode: no text)")
    for col in (
        "id",
        "status",
        "stream",
        "chunks",
        "msgs",
        "tools",
        "reused",
        "evaluated",
        "prefill ms",
    ):
        table.add_column(col, justify="left" if col == "stream" else "right")
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        req, resp = rec["request"], rec["response"] or {}
        dig = req.get("digest") or {}
        timings = ((resp.get("digest") or {}).get("usage") or {}).get("timings") or {}
        table.add_row(
            str(rec["id"]),
            str(resp.get("status", "-")),
            str(resp.get("stream")),
            str(resp.get("chunks")),
            str(len(dig.get("messages", []))),
            str(len(dig.get("tools", []))),
            str(timings.get("cache_n", "-")),
            str(timings.get("prompt_n", "-")),
            str(timings.get("prompt_ms", "-")),
        )
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    """Start a server and the recorder, drive the session, show the recording and the report."""
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="llmp-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / "demo.jsonl"
    record.unlink(missing_ok=True)
    with model_server(out_dir) as (server_url, server_name):
        print(f"llmp demo: model server: {server_name} at {server_url}")
        with mitmdump(server_url, record, out_dir) as proxy_url:
            print(f"llmp demo: recording through mitmdump at {proxy_url} into {record}\n")
            for label, extra in scripted_session():
                body: dict[str, Any] = {
                    "model": "demo-model",
                    "stream": True,
                    "max_tokens": 16,
                    "temperature": 0.0,
                    "stream_options": {"include_usage": True},
                    "tools": TOOLS,
                }
                body.update(extra)
                if body.get("tools") is None:
                    body.pop("tools")
                reply = post_chat(proxy_url, body)
                timings = reply.get("timings") or {}
                print(
                    f"  {label:<58} reused {timings.get('cache_n', '?'):>5}, "
                    f"processed {timings.get('prompt_n', '?'):>5} prompt tokens"
                )
    print()
    show_recording(record)
    print()
    print_readable([str(record)])
    return 0


def register(sub: Any) -> None:
    """Add the `demo` subcommand."""
    parser = sub.add_parser(
        "demo",
        help="record a scripted agent session through mitmdump and explain it",
        description=__doc__,
    )
    parser.add_argument(
        "--out", help="folder for the recording and logs (default: a new temp folder)"
    )
    parser.set_defaults(handler=run)
