"""`llmp demo`: record a short scripted agent session and explain it.

It needs no model server: by default it starts the bundled fake llama-server
(`llmp.demo.fakes`), which speaks llama-server's wire format and simulates a
one-slot prefix cache. With `LLMP_LLAMA_SERVER` and `LLMP_LLAMA_MODEL` set it
starts that real llama-server instead (`-np 1`, so the cache losses are real).
The traffic goes through the real `mitmdump -s addon/llmp_addon.py`.

Three agents take turns on the one server: an OpenAI-chat agent (whose
system prompt carries a clock), a Claude-Code-like agent on `/v1/messages`
(whose attribution line changes when it compacts), and a Codex-like agent on
`/v1/responses` (a clean conversation).  Plain `http.client` is all they use.

Then the same two harnesses pay a provider: a Claude-Code-like agent on the bundled fake
of Anthropic's API and a Codex-like one on the fake of OpenAI's, each keeping its
provider's documented cache rules, so the second report is in dollars: what the session
cost, and what a tool added mid-conversation and a new `prompt_cache_key` cost on top.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from llmp.analysis.command import print_readable
from llmp.format.nouns import plural

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


CLAUDE_UA = "claude-cli/2.1.328 (external, sdk-cli)"
CODEX_UA = "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)"
CLAUDE_TOOLS: list[dict[str, Any]] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
CODEX_TOOLS: list[dict[str, Any]] = [{"type": "function", **t["function"]} for t in TOOLS]
_MARK = {"type": "ephemeral"}


def _claude_system(suffix: str) -> list[dict[str, Any]]:
    """Claude Code's system blocks: its attribution line first, then the stable part."""
    rules = "\n".join(f"{n}. {rule}" for n, rule in enumerate(GUIDELINES * 3, 1))
    return [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; "
            "cc_entrypoint=sdk-cli;",
        },
        {
            "type": "text",
            "text": "You are Claude Code, a CLI coding agent.",
            "cache_control": _MARK,
        },
        {"type": "text", "text": rules, "cache_control": _MARK},
    ]


def _claude_body(suffix: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Like Claude Code: the latest message as a one-block array carrying `cache_control`
    (a plain string on the next turn), so the marker moves every turn."""
    sent = [dict(m) for m in messages]
    sent[-1]["content"] = [{"type": "text", "text": sent[-1]["content"], "cache_control": _MARK}]
    return {
        "model": "demo-model",
        "messages": sent,
        "system": _claude_system(suffix),
        "tools": CLAUDE_TOOLS,
        "max_tokens": 16,
        "stream": True,
    }


def claude_session() -> Iterator[tuple[str, dict[str, Any]]]:
    """A Claude-Code-like agent on `/v1/messages`."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Where is slugify() defined?"}]
    yield "claude 1: a new conversation", _claude_body("7c2", history)
    history += [
        {"role": "assistant", "content": "In utils.py."},
        {"role": "user", "content": "Does it handle unicode?"},
    ]
    yield "claude 2: continues (cache_control moved)", _claude_body("7c2", history)
    compacted = [
        {"role": "user", "content": "Summary: we looked at slugify() in utils.py."},
        {"role": "assistant", "content": "Understood."},
        {"role": "user", "content": "Add a unicode test."},
    ]
    yield "claude 3: after /compact, a new attribution line", _claude_body("119", compacted)


def codex_session(
    turns: int = 3, developer: str | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """A Codex-like agent on `/v1/responses`: the whole input resent every turn."""

    def message(role: str, text: str) -> dict[str, Any]:
        kind = "output_text" if role == "assistant" else "input_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}

    items = [
        message("developer", developer or _system("2026-11-30 09:00")["content"]),
        message("user", "<environment_context><cwd>/repo</cwd></environment_context>"),
        message("user", "List the Python files."),
    ]
    steps = [
        ("utils.py and app.py.", "Which one has tests?"),
        ("utils.py.", "Run them."),
        ("All pass.", "Any slow ones?"),
    ]
    for n in range(turns):
        label = "codex 1: a new conversation" if n == 0 else f"codex {n + 1}: continues"
        yield (
            label,
            {
                "model": "demo-model",
                "input": list(items),
                "tools": CODEX_TOOLS,
                "store": False,
                "stream": True,
                "max_output_tokens": 16,
                "client_metadata": {"turn_id": f"turn-{n}"},  # changes every turn, not the prompt
            },
        )
        if n < len(steps):
            answer, ask = steps[n]
            items += [message("assistant", answer), message("user", ask)]


# -- the provider part: the same harnesses, paying ----------------------------------------

PROVIDER_RULES = "\n".join(f"{n}. {rule}" for n, rule in enumerate(GUIDELINES * 12, 1))
"""Long enough (about 1,500 tokens) to pass both providers' minimum cacheable length."""
MCP_TOOL: dict[str, Any] = {
    "name": "search_issues",
    "description": "Search the issue tracker (an MCP server connected mid-session).",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
}


def anthropic_session() -> Iterator[tuple[str, dict[str, Any]]]:
    """Claude-Code-like turns on Anthropic's API; the third adds an MCP tool, and since a
    provider caches the tools first, nothing of the cached prefix is read again."""
    system = _claude_system("7c2")
    system[2]["text"] = PROVIDER_RULES
    history: list[dict[str, Any]] = [{"role": "user", "content": "Where is slugify() defined?"}]
    steps = [
        ("anthropic 1: a new conversation (writes the cache)", CLAUDE_TOOLS),
        ("anthropic 2: continues (reads it)", CLAUDE_TOOLS),
        ("anthropic 3: an MCP tool was connected", [*CLAUDE_TOOLS, MCP_TOOL]),
        ("anthropic 4: continues", [*CLAUDE_TOOLS, MCP_TOOL]),
    ]
    for n, (label, tools) in enumerate(steps):
        body = _claude_body("7c2", history)
        body.update(model="claude-sonnet-4-5", system=system, tools=tools)
        yield label, body
        history += [
            {"role": "assistant", "content": f"Answer {n + 1}."},
            {"role": "user", "content": f"Follow-up question {n + 2}?"},
        ]


def openai_session() -> Iterator[tuple[str, dict[str, Any]]]:
    """Codex-like turns on OpenAI's Responses API (automatic caching, routed by the prompt's
    start and `prompt_cache_key`); the third comes with a new key, as a harness that keys
    by request rather than by conversation would send it."""
    keys = ["conv-7f3a", "conv-7f3a", "req-91c2", "req-91c2"]
    for n, (_, body) in enumerate(codex_session(turns=4, developer=PROVIDER_RULES)):
        label = [
            "openai 1: a new conversation",
            "openai 2: continues (reads the cache)",
            "openai 3: a new prompt_cache_key",
            "openai 4: continues",
        ][n]
        body.update(model="gpt-5", prompt_cache_key=keys[n])
        yield label, body


def _counters(path: str, event: dict[str, Any], got: dict[str, Any]) -> None:
    """Keep the counters one streamed event carries (each API has its own)."""
    if path == "/v1/chat/completions":
        if event.get("timings"):
            got["reused"] = event["timings"].get("cache_n")
            got["processed"] = event["timings"].get("prompt_n")
    elif path == "/v1/messages":
        usage = (event.get("message") or {}).get("usage") or {}
        if "input_tokens" in usage:
            got["reused"] = usage.get("cache_read_input_tokens")
            got["written"] = usage.get("cache_creation_input_tokens")
            got["processed"] = usage["input_tokens"]
    elif event.get("type") == "response.completed":
        usage = (event.get("response") or {}).get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens")
        got["reused"] = cached
        got["written"] = details.get("cache_write_tokens", 0)
        if isinstance(cached, int) and isinstance(usage.get("input_tokens"), int):
            got["processed"] = usage["input_tokens"] - cached


def post_stream(
    base_url: str, path: str, body: dict[str, Any], user_agent: str, timeout: float = 300.0
) -> dict[str, Any]:
    """Send one streamed request like an agent would; return the server's counters."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout
    )
    try:
        conn.request(
            "POST",
            path + ("?beta=true" if path == "/v1/messages" else ""),
            body=json.dumps(body).encode(),
            headers={
                "content-type": "application/json",
                "user-agent": user_agent,
                "authorization": "Bearer demo-key-not-recorded",
            },
        )
        resp = conn.getresponse()
        got: dict[str, Any] = {"status": resp.status}
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            _counters(path, json.loads(line[5:]), got)
        return got
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
        args = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
        args += ["-c", "4096", "-np", "1"]
        usage = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        if "--cache-ram" in usage.stdout + usage.stderr:
            args += ["--cache-ram", "0"]  # else its host-memory cache would hide the eviction
        log = open(log_dir / "llama-server.log", "wb")
        proc = subprocess.Popen(
            args,
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

    from llmp.apis import CountHints, api_for

    table = Table(title=f"{path.name}: one record per exchange (digest mode: no text)")
    short = {"openai_chat": "chat", "anthropic_messages": "messages"}
    for col in ("id", "api", "chunks", "msgs", "tools", "reused", "evaluated", "prefill"):
        table.add_column(col, justify="left" if col == "api" else "right")
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        req, resp = rec["request"], rec["response"] or {}
        dig = req.get("digest") or {}
        api = api_for(req["method"], req["path"])
        usage = (resp.get("digest") or {}).get("usage")
        counts = api.counts(usage, CountHints()) if api and isinstance(usage, dict) else None

        def cell(mv: Any) -> str:
            return "-" if mv is None else f"{mv[0]:g}"

        table.add_row(
            str(rec["id"]),
            short.get(api.name, api.name.removeprefix("openai_")) if api else "other",
            str(resp.get("chunks") or "-"),
            str(len(dig.get("messages", []))),
            str(len(dig.get("tools", []))),
            cell(counts and counts.reused_tokens),
            cell(counts and counts.evaluated_tokens),
            cell(counts and counts.prefill_ms),
        )
    Console().print(table)
    print("(prefill: the server's own ms; /v1/messages reports none, so llmp times it itself)")


def _report_line(label: str, got: dict[str, Any], provider: bool = False) -> None:
    reused, processed = got.get("reused", "?"), got.get("processed", "?")
    tokens = plural("prompt token", processed) if isinstance(processed, int) else "prompt tokens"
    if provider:  # what it read, wrote and billed in full
        written = got.get("written", "?")
        print(f"  {label:<58} read {reused:>5}, wrote {written:>5}, uncached {processed:>5}")
        return
    print(f"  {label:<58} reused {reused:>5}, processed {processed:>5} {tokens}")


def provider_part(out_dir: Path) -> Path:
    """The Claude-Code-like and Codex-like agents on the fake providers, recorded into one
    file per provider (two mitmdumps, one in front of each); returns the folder."""
    from llmp.demo.fakes import Upstream
    from llmp.demo.fakes.model import Flavor

    folder = out_dir / "provider"
    folder.mkdir(exist_ok=True)
    parts: list[tuple[Flavor, str, Callable[[], Iterator[tuple[str, dict[str, Any]]]], str]] = [
        ("anthropic-api", "/v1/messages", anthropic_session, CLAUDE_UA),
        ("openai-api", "/v1/responses", openai_session, CODEX_UA),
    ]
    for flavor, path, session, agent in parts:
        record = folder / f"{flavor}.jsonl"
        record.unlink(missing_ok=True)
        (folder / flavor).mkdir(exist_ok=True)
        with Upstream(flavor) as up, mitmdump(up.url, record, folder / flavor) as proxy_url:
            print(f"llmp demo: the fake {flavor} at {up.url}, recorded into {record}")
            for label, body in session():
                _report_line(label, post_stream(proxy_url, path, body, agent), provider=True)
    return folder


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
                got = post_stream(proxy_url, "/v1/chat/completions", body, USER_AGENT)
                _report_line(label, got)
            for label, body in claude_session():
                _report_line(label, post_stream(proxy_url, "/v1/messages", body, CLAUDE_UA))
            for label, body in codex_session():
                _report_line(label, post_stream(proxy_url, "/v1/responses", body, CODEX_UA))
    print()
    show_recording(record)
    print()
    print_readable([str(record)])
    print("\nllmp demo: the same harnesses on providers, where a miss costs money\n")
    folder = provider_part(out_dir)
    print()
    print_readable(sorted(str(p) for p in folder.glob("*.jsonl")))
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
