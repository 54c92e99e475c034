"""A small generator of realistic recordings for the analyzer's tests.

Traffic is produced by simulated agents talking to a simulated server whose
cache behaves like llama-server's: a prompt is rendered to pseudo-tokens (4
characters each, plus template tokens), a request reuses the longest common
prefix with its slot's content, and the generated tokens never match the
reply as it is resent (a real llama-server reported `cache_n` equal to the
previous prompt, not more).  An Ollama mode loads models one at a time and
reports its counters in either meaning of `prompt_eval_count`.

Every exchange is recorded in full mode (bodies, number text kept with
`RawFloat`, R2); the digest recording of the same traffic is derived from it
with the recorder's own `request_digest` / `response_digest`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmp.apis import api_for
from llmp.apis.openai_chat import message_text
from llmp.format.canonical import RawFloat, dumps, record_dumps

T0 = 1_788_595_000_000
LLAMA_MODEL = "/models/qwen3-8b-q4_k_m.gguf"


def chunks(text: str) -> list[str]:
    return [text[i : i + 4] for i in range(0, len(text), 4)]


def render(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[str]:
    """A prompt as pseudo-tokens: system messages, then tools, then the rest."""
    toks = ["<bos>"]
    i = 0
    while i < len(messages) and messages[i].get("role") in ("system", "developer"):
        toks += ["<|system|>", *chunks(message_text(messages[i])), "<|end|>"]
        i += 1
    if tools:
        toks += ["<tools>", *chunks(dumps(tools).decode()), "</tools>"]
    for m in messages[i:]:
        toks += [f"<|{m.get('role')}|>", *chunks(message_text(m)), "<|end|>"]
    toks.append("<|assistant|>")
    return toks


def lcp(a: list[str], b: list[str]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Outcome:
    """What the server did with one request."""

    prompt: int
    cache_n: int
    n_gen: int
    prompt_ms: float
    predicted_ms: float
    load_ms: float = 0.0


@dataclass
class LlamaServer:
    """llama-server's slot cache: `np` slots, longest-prefix slot selection."""

    model: str = LLAMA_MODEL
    np: int = 1
    ms_per_token: float = 2.0
    ms_per_gen: float = 15.0
    checkpoint: int = 0  # > 0: reuse only up to a multiple of this (SWA checkpoints)
    swa: bool = False
    """A sliding-window cache without `--swa-full`: after a change it cannot go back, and
    re-reads from 0 (R31), or from its last checkpoint before the change (`swa_every`);
    a prompt that extends the slot's last one reuses it all."""
    swa_every: int = 0
    slots: list[list[str]] = field(default_factory=list)
    _used: list[int] = field(default_factory=list)
    _prompts: list[int] = field(default_factory=list)
    _gen: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.slots = [[] for _ in range(self.np)]
        self._used = [0] * self.np
        self._prompts = [0] * self.np

    def reset(self) -> None:
        """A restart: every slot empty."""
        self.slots = [[] for _ in range(self.np)]

    def keep_head(self, n: int) -> None:
        """The server keeps only the first n tokens of each slot."""
        self.slots = [s[:n] for s in self.slots]

    def serve(self, prompt: list[str], reply_chars: int, model: str | None = None) -> Outcome:
        best = max(range(self.np), key=lambda i: (lcp(self.slots[i], prompt), -self._used[i]))
        cache_n = min(lcp(self.slots[best], prompt), len(prompt) - 1)
        if self.checkpoint:
            cache_n -= cache_n % self.checkpoint
        if self.swa and cache_n < self._prompts[best]:
            cache_n -= cache_n % self.swa_every if self.swa_every else cache_n
        n_gen = max(1, math.ceil(reply_chars / 4))
        g = next(self._gen)
        self.slots[best] = prompt + [f"gen{g}:{i}" for i in range(n_gen)]
        self._used[best] = g + 1
        self._prompts[best] = len(prompt)
        prompt_n = len(prompt) - cache_n
        return Outcome(
            len(prompt),
            cache_n,
            n_gen,
            round(5 + prompt_n * self.ms_per_token, 3),
            round(n_gen * self.ms_per_gen, 3),
        )


@dataclass
class OllamaServer:
    """Ollama: one slot per loaded model, `max_loaded` models at a time."""

    max_loaded: int = 1
    meaning: str = "cached"  # "cached" (0.34 on), "whole" (recent), "evaluated" (old)
    ms_per_token: float = 2.0
    ms_per_gen: float = 15.0
    load_ms: float = 1500.0
    slots: dict[str, list[str]] = field(default_factory=dict)
    _gen: itertools.count = field(default_factory=itertools.count)

    def unload_all(self) -> None:
        self.slots.clear()

    def serve(self, prompt: list[str], reply_chars: int, model: str | None = None) -> Outcome:
        assert model is not None
        load = 12.0
        if model not in self.slots:
            load = self.load_ms
            while len(self.slots) >= self.max_loaded:
                self.slots.pop(next(iter(self.slots)))
            self.slots[model] = []
        else:
            self.slots[model] = self.slots.pop(model)  # most recently used last
        slot = self.slots[model]
        cache_n = min(lcp(slot, prompt), len(prompt) - 1)
        n_gen = max(1, math.ceil(reply_chars / 4))
        g = next(self._gen)
        self.slots[model] = prompt + [f"gen{g}:{i}" for i in range(n_gen)]
        prompt_n = len(prompt) - cache_n
        return Outcome(
            len(prompt),
            cache_n,
            n_gen,
            round(5 + prompt_n * self.ms_per_token, 3),
            round(n_gen * self.ms_per_gen, 3),
            load,
        )


def openai_response(out: Outcome, served: str, reply: dict[str, Any], rid: int) -> dict[str, Any]:
    """A merged llama-server response, in its own key order."""
    return {
        "choices": [{"finish_reason": "stop", "index": 0, "message": reply}],
        "created": 1788595000 + rid,
        "id": f"chatcmpl-{rid:08d}",
        "model": served,
        "system_fingerprint": "b7000-deadbeef",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": out.n_gen,
            "prompt_tokens": out.prompt,
            "total_tokens": out.prompt + out.n_gen,
            "prompt_tokens_details": {"cached_tokens": out.cache_n},
        },
        "timings": {
            "cache_n": out.cache_n,
            "prompt_n": out.prompt - out.cache_n,
            "prompt_ms": RawFloat(repr(out.prompt_ms)),
            "prompt_per_token_ms": RawFloat(repr(out.prompt_ms / max(1, out.prompt - out.cache_n))),
            "predicted_n": out.n_gen,
            "predicted_ms": RawFloat(repr(out.predicted_ms)),
        },
    }


def ollama_response(
    out: Outcome, model: str, reply: dict[str, Any], meaning: str
) -> dict[str, Any]:
    """A merged Ollama /api/chat response (final object), ns durations."""
    body: dict[str, Any] = {
        "model": model,
        "created_at": "2026-08-21T10:00:00.1234Z",
        "message": reply,
        "done": True,
        "done_reason": "stop",
        "total_duration": int((out.load_ms + out.prompt_ms + out.predicted_ms) * 1e6),
        "load_duration": int(out.load_ms * 1e6),
    }
    evaluated = out.prompt - out.cache_n
    if meaning == "evaluated":
        if evaluated:
            body["prompt_eval_count"] = evaluated
    else:
        body["prompt_eval_count"] = out.prompt
    body["prompt_eval_duration"] = int(out.prompt_ms * 1e6)
    body["eval_count"] = out.n_gen
    body["eval_duration"] = int(out.predicted_ms * 1e6)
    if meaning == "cached":
        body["prompt_eval_cached_count"] = out.cache_n
    return body


@dataclass
class Traffic:
    """The exchanges of a recording, as full records in id order."""

    t: int = T0
    think_ms: int = 700
    records: list[dict[str, Any]] = field(default_factory=list)
    next_id: int = 1

    def _record(
        self,
        *,
        method: str,
        path: str,
        ua: str | None,
        body: Any,
        status: int,
        resp_body: Any,
        stream: str | None,
        t_start: int,
        t_first: int | None,
        t_end: int,
        error: str | None = None,
        conn: int = 1,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """`headers`: more request headers, as the recorder keeps them (R32)."""
        kept: dict[str, str] = {"content-type": "application/json"}
        if ua is not None:
            kept["user-agent"] = ua
        kept.update(headers or {})
        req_bytes = len(record_dumps(body)) if body is not None else 0
        response = None
        if status:
            response = {
                "status": status,
                "headers": {
                    "content-type": {
                        "sse": "text/event-stream",
                        "ndjson": "application/x-ndjson",
                    }.get(stream or "", "application/json")
                },
                "stream": stream,
                "chunks": 42 if stream else None,
                "bad_chunks": 0 if stream else None,
                "body_bytes": len(record_dumps(resp_body)) if resp_body is not None else 0,
                "truncated": False,
                "body": resp_body,
                "body_text": None,
                "digest": None,
            }
        rec = {
            "v": 1,
            "id": self.next_id,
            "conn": conn,
            "t_start_ms": t_start,
            "t_first_byte_ms": t_first,
            "t_end_ms": t_end,
            "request": {
                "method": method,
                "path": path,
                "headers": kept,
                "body_bytes": req_bytes,
                "body": body,
                "body_text": None,
                "digest": None,
            },
            "response": response,
            "error": error,
            "tokens": None,
        }
        self.next_id += 1
        self.records.append(rec)
        return rec

    def chat(
        self,
        server: LlamaServer | OllamaServer,
        ua: str | None,
        body: dict[str, Any],
        reply: dict[str, Any],
        *,
        at: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """One chat exchange through the server; the clock moves past it."""
        ollama = isinstance(server, OllamaServer)
        prompt = render(body["messages"], body.get("tools"))
        out = server.serve(prompt, len(message_text(reply)), body.get("model"))
        rid = self.next_id
        if ollama:
            assert isinstance(server, OllamaServer)
            resp = ollama_response(out, body["model"], reply, server.meaning)
            path, stream = "/api/chat", "ndjson"
        else:
            assert isinstance(server, LlamaServer)
            resp = openai_response(out, server.model, reply, rid)
            path, stream = "/v1/chat/completions", "sse"
        t_start = self.t if at is None else at
        t_first = t_start + int(out.load_ms + out.prompt_ms) + 3
        t_end = t_first + int(out.predicted_ms) + 2
        rec = self._record(
            method="POST",
            path=path,
            ua=ua,
            body=body,
            status=200,
            resp_body=resp,
            stream=stream,
            t_start=t_start,
            t_first=t_first,
            t_end=t_end,
            headers=headers,
        )
        if at is None:
            self.t = t_end + self.think_ms
        return rec

    def other(self, method: str, path: str, ua: str | None = None) -> dict[str, Any]:
        """A request that is not chat (the model list, health)."""
        t = self.t
        self.t += 20
        return self._record(
            method=method,
            path=path,
            ua=ua,
            body=None,
            status=200,
            resp_body={"object": "list", "data": [{"id": "qwen"}]},
            stream=None,
            t_start=t,
            t_first=t + 2,
            t_end=t + 3,
        )

    def failed(
        self, ua: str | None, body: dict[str, Any], *, error: str | None, status: int
    ) -> dict[str, Any]:
        """A chat request that errored or got a non-2xx answer."""
        t = self.t
        self.t += 50
        resp = (
            {"error": {"code": status, "message": "boom", "type": "server_error"}}
            if status
            else None
        )
        return self._record(
            method="POST",
            path="/v1/chat/completions",
            ua=ua,
            body=body,
            status=status,
            resp_body=resp,
            stream=None,
            t_start=t,
            t_first=t + 10 if status else None,
            t_end=t + 20,
            error=error,
        )

    # -- output --------------------------------------------------------------

    def full(self) -> list[dict[str, Any]]:
        return self.records

    def digest(self) -> list[dict[str, Any]]:
        """The same traffic as a digest-mode recorder writes it."""
        out = []
        for rec in self.records:
            d = copy.deepcopy(rec)
            req, resp = d["request"], d["response"]
            api = api_for(req["method"], req["path"])
            if api is not None and isinstance(req["body"], dict):
                req["digest"] = api.request_digest(req["body"])
            req["body"] = None
            if resp is not None:
                ok = api is not None and 200 <= resp["status"] < 300 and resp["body"] is not None
                resp["digest"] = api.response_digest(resp["body"]) if ok and api else None
                resp["body"] = None
            out.append(d)
        return out

    def lines(self, mode: str = "digest", order: str = "end") -> list[bytes]:
        """Recording lines; `order="end"` writes each when its exchange ended.

        `mode="mixed"` alternates full and digest records, so a conversation
        is compared across both: only hashes computed from full bodies with
        their number text kept (R2) match the recorder's digests.
        """
        if mode == "mixed":
            full, dig = self.full(), self.digest()
            recs = [f if i % 2 else d for i, (f, d) in enumerate(zip(full, dig, strict=True))]
        else:
            recs = self.digest() if mode == "digest" else self.full()
        if order == "end":
            recs = sorted(recs, key=lambda r: (r["t_end_ms"], r["id"]))
        return [record_dumps(r) + b"\n" for r in recs]

    def write(self, path: Path, mode: str = "digest", order: str = "end") -> Path:
        path.write_bytes(b"".join(self.lines(mode, order)))
        return path


# -- agents ------------------------------------------------------------------


DAY_MS = 86_400_000


def shifted(traffic: Traffic, days: int) -> Traffic:
    """The same traffic `days` later (every clock of every record), for recordings of many days."""
    for rec in traffic.records:
        for key in ("t_start_ms", "t_first_byte_ms", "t_end_ms"):
            if rec[key] is not None:
                rec[key] += days * DAY_MS
    return traffic


def tool(name: str, description: str, **props: Any) -> dict[str, Any]:
    """An OpenAI-style tool definition."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": v} if isinstance(v, str) else v for k, v in props.items()
                },
                "required": list(props),
            },
        },
    }


CODING_TOOLS = [
    tool(
        "read_file",
        "Read a file from the workspace and return its contents with line numbers.",
        path="string",
    ),
    tool(
        "write_file",
        "Write a file in the workspace, replacing its contents entirely.",
        path="string",
        content="string",
    ),
    tool(
        "run",
        "Run a shell command in the workspace and return its output.",
        command="string",
        timeout={"type": "number", "minimum": RawFloat("0.50"), "maximum": RawFloat("6E2")},
    ),
    tool("search", "Search the workspace for a regular expression.", pattern="string"),
]

SYSTEM = (
    "You are a coding agent working in the user's repository. Think step by step, use the "
    "tools to read before you write, keep edits minimal, run the tests after every change, "
    "and explain what you did in one short paragraph at the end. "
) * 6


def text(seed: str, n: int) -> str:
    """Deterministic filler text of n characters."""
    base = f"{seed}: the quick brown fox jumps over the lazy dog while the tests run. "
    return (base * (n // len(base) + 1))[:n]


@dataclass
class Agent:
    """A harness with a system prompt, tools and a growing history."""

    traffic: Traffic
    server: LlamaServer | OllamaServer
    ua: str | None = "opencode/1.0.0"
    model: str = "qwen"
    system: str = SYSTEM
    tools: list[Any] | None = field(default_factory=lambda: list(CODING_TOOLS))
    messages: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = True
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    """Request headers beside the user-agent, as recorded (R32: session values hashed)."""

    def __post_init__(self) -> None:
        if not self.messages and self.system:
            self.messages.append({"role": "system", "content": self.system})

    def body(self, messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": copy.deepcopy(messages or self.messages),
        }
        if self.tools:
            body["tools"] = copy.deepcopy(self.tools)
        body["stream"] = self.stream
        body["temperature"] = RawFloat("0.10")
        body.update(self.params)
        body.update(extra)
        return body

    def send(self, reply: dict[str, Any], **extra: Any) -> dict[str, Any]:
        rec = self.traffic.chat(
            self.server, self.ua, self.body(**extra), reply, headers=self.headers
        )
        self.messages.append(reply)
        return rec

    def turn(self, user: str, answer: str, **extra: Any) -> dict[str, Any]:
        """The user says something; the model answers in text."""
        self.messages.append({"role": "user", "content": user})
        return self.send({"role": "assistant", "content": answer}, **extra)

    def tool_step(
        self, user: str | None, name: str, args: dict[str, Any], result: str
    ) -> dict[str, Any]:
        """The model calls a tool; its result is appended for the next turn."""
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        call_id = f"call_{len(self.messages):04d}"
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": dumps(args).decode()},
                }
            ],
        }
        rec = self.send(reply)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return rec

    def side_call(
        self,
        system: str | None,
        user: str,
        answer: str,
        *,
        model: str | None = None,
        tools: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """A request beside the conversation (title, summary, extraction)."""
        msgs: list[dict[str, Any]] = []
        if system is not None:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": user})
        body: dict[str, Any] = {"model": model or self.model, "messages": msgs, "stream": False}
        if tools and self.tools:
            body["tools"] = copy.deepcopy(self.tools)
        body.update(extra)
        return self.traffic.chat(
            self.server,
            self.ua,
            body,
            {"role": "assistant", "content": answer},
            headers=self.headers,
        )

    def ollama_tool_step(
        self, user: str, name: str, args: dict[str, Any], result: str
    ) -> dict[str, Any]:
        """Ollama-style tool call: object arguments, keeping float text (R2)."""
        self.messages.append({"role": "user", "content": user})
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": name, "arguments": args}}],
        }
        rec = self.send(reply)
        self.messages.append({"role": "tool", "tool_name": name, "content": result})
        return rec


def work(agent: Agent, turns: int, seed: str = "t", size: int = 600) -> list[dict[str, Any]]:
    """A few ordinary agent steps: a request, tool calls, an answer."""
    recs = []
    for i in range(turns):
        if i % 2 == 0:
            recs.append(
                agent.tool_step(
                    text(f"{seed}{i} ask", 200),
                    "read_file",
                    {"path": f"src/{seed}{i}.py"},
                    text(f"{seed}{i} file", size),
                )
            )
        else:
            recs.append(agent.turn(text(f"{seed}{i} ask", 150), text(f"{seed}{i} answer", 300)))
    return recs


# -- scenarios ---------------------------------------------------------------


def clean_chat() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 5)
    return tr


def changed_system() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 3)
    a.messages[0] = {"role": "system", "content": SYSTEM + " Today is 2026-08-21 10:00."}
    work(a, 2, seed="u")
    return tr


def changed_tools() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 3)
    a.tools = [
        *CODING_TOOLS[:2],
        tool("grep", "Search files with grep.", pattern="string"),
        *CODING_TOOLS[2:],
    ]
    work(a, 2, seed="u")
    return tr


def rewritten_history() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 4)
    # The harness re-sends an earlier file read with fresh contents.
    a.messages[3] = {
        "role": "tool",
        "tool_call_id": a.messages[3]["tool_call_id"],
        "content": text("t0 file v2", 600),
    }
    work(a, 1, seed="u")
    return tr


def compaction() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 6, size=1500)
    summary = text("summary of the work so far", 1400)
    a.side_call(
        "You summarise coding sessions.",
        text("the whole conversation flattened", 9000),
        summary,
    )
    a.messages = [
        a.messages[0],
        {"role": "user", "content": "Summary of the conversation so far:\n" + summary},
    ]
    a.messages.append({"role": "assistant", "content": "Understood."})
    work(a, 2, seed="after")
    return tr


def title_side_call() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 3)
    a.side_call(
        "You generate a short title for a conversation.",
        text("t0 ask", 200),
        "Fix the parser",
        max_tokens=32,
    )
    work(a, 2, seed="u")
    return tr


def structured_side_call() -> Traffic:
    tr = Traffic()
    a = Agent(tr, LlamaServer())
    work(a, 3)
    a.side_call(
        "Extract the files mentioned.",
        text("extract", 300),
        '{"files": ["a.py"]}',
        tools=True,
        response_format={"type": "json_object"},
    )
    work(a, 2, seed="u")
    return tr


def two_harnesses() -> Traffic:
    """Two harnesses built on one SDK: same user-agent, different tool sets."""
    tr = Traffic()
    srv = LlamaServer()
    ua = "OpenAI/Python 1.99.0"
    a = Agent(tr, srv, ua=ua, system="You are harness A. " * 40, tools=CODING_TOOLS[:2])
    b = Agent(
        tr,
        srv,
        ua=ua,
        system="You are harness B. " * 40,
        tools=[
            tool("browse", "Open a web page.", url="string"),
            tool("click", "Click.", selector="string"),
        ],
    )
    for i in range(3):
        work(a, 1, seed=f"a{i}")
        work(b, 1, seed=f"b{i}")
    return tr


def subagent() -> Traffic:
    tr = Traffic()
    srv = LlamaServer()
    parent = Agent(tr, srv)
    work(parent, 2)
    child = Agent(
        tr,
        srv,
        system="You are a research subagent. Report findings briefly. " * 8,
        tools=CODING_TOOLS[:1] + CODING_TOOLS[3:],
    )
    work(child, 3, seed="sub")
    work(parent, 2, seed="p")
    return tr


def other_model() -> Traffic:
    """Ollama with one loaded model: another model's request unloads ours."""
    tr = Traffic()
    srv = OllamaServer(max_loaded=1, meaning="cached")
    a = Agent(tr, srv, model="qwen3:8b", ua="continue/1.2")
    work(a, 3)
    b = Agent(tr, srv, model="llama3.2:3b", ua="curl/8.5", tools=None, system="Be brief.")
    b.turn("What is 2+2?", "4")
    work(a, 2, seed="u")
    return tr


def server_reset() -> Traffic:
    tr = Traffic()
    srv = LlamaServer()
    a = Agent(tr, srv)
    work(a, 3)
    srv.reset()
    work(a, 2, seed="u")
    return tr


def head_only() -> Traffic:
    tr = Traffic()
    srv = LlamaServer()
    a = Agent(tr, srv)
    work(a, 4)
    srv.keep_head(200)
    work(a, 2, seed="u")
    return tr


def ollama_meanings(meaning: str) -> Traffic:
    """Ollama native API, counters in one of the meanings; a reload in the middle."""
    tr = Traffic()
    srv = OllamaServer(meaning=meaning)
    a = Agent(tr, srv, model="qwen3:8b", ua="ollama-python/0.6")
    a.ollama_tool_step(
        "Compute the price.",
        "price",
        {"amount": RawFloat("1.50"), "rate": RawFloat("2E-1")},
        "0.30",
    )
    work(a, 2)
    srv.unload_all()  # keep_alive expired
    work(a, 2, seed="u")
    return tr


def weak_model_side_call() -> Traffic:
    """R20: aider's weak model on the same llama-server evicts the main model's slot."""
    tr = Traffic()
    srv = LlamaServer()
    a = Agent(
        tr,
        srv,
        ua="aider/0.86.1",
        model="smol",
        tools=None,
        system="Act as an expert software developer. " * 10,
    )
    # aider's first turn carries example exchanges as user/assistant pairs.
    a.messages += [
        {"role": "user", "content": text("repo map", 800)},
        {
            "role": "assistant",
            "content": "Ok, I won't try and edit those files without asking first.",
        },
    ]
    a.turn(text("add a flag", 200), text("diff", 600))
    a.side_call(
        "You are an expert software engineer that generates concise Git commit messages.",
        text("the diff", 700),
        "feat: add a flag",
        model="smol-weak",
    )
    a.turn(text("now test it", 120), text("tests", 500))
    return tr


def mixed_file(tmp: Path) -> Path:
    """Bad lines, blank lines, other `v`, out-of-order ids and two sessions."""
    first = Traffic()
    a = Agent(first, LlamaServer())
    work(a, 3)
    second = Traffic(t=first.t + 3_600_000)
    b = Agent(second, LlamaServer())
    work(b, 2, seed="s2")
    lines = first.lines("digest")
    lines.reverse()  # out of id order
    lines.insert(1, b"{not json\n")
    lines.insert(2, b"\n")
    lines.insert(3, b'{"v":2,"id":99,"t_start_ms":1}\n')
    lines.insert(4, b"[1,2]\n")
    lines += second.lines("digest")
    path = tmp / "mixed.jsonl"
    path.write_bytes(b"".join(lines))
    return path


SCENARIOS = {
    "clean_chat": clean_chat,
    "changed_system": changed_system,
    "changed_tools": changed_tools,
    "rewritten_history": rewritten_history,
    "compaction": compaction,
    "title_side_call": title_side_call,
    "structured_side_call": structured_side_call,
    "two_harnesses": two_harnesses,
    "subagent": subagent,
    "other_model": other_model,
    "server_reset": server_reset,
    "head_only": head_only,
    "ollama_cached": lambda: ollama_meanings("cached"),
    "ollama_whole": lambda: ollama_meanings("whole"),
    "ollama_evaluated": lambda: ollama_meanings("evaluated"),
    "weak_model_side_call": weak_model_side_call,
}


def analyse(traffic: Traffic, tmp: Path, mode: str = "digest", **kw: Any) -> dict[str, Any]:
    """The report v1 of a traffic's recording, as a dict."""
    from llmp.analysis import analyze

    path = traffic.write(tmp / f"rec-{mode}-{len(list(tmp.iterdir()))}.jsonl", mode)
    result = analyze([str(path)], **kw)
    try:
        return result.report()
    finally:
        result.close()


def rows_by_id(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in report["rows"]}


def value(mv: dict[str, Any] | None) -> Any:
    return None if mv is None else mv["value"]


# -- from real aider traffic (docs/real-harness.md) ----------------------------
#
# aider 0.86.2 against llama-server, as recorded by bench/real_harness.py.  When
# the model makes no edit, aider keeps the chat in `cur_messages`, after the
# files: system, example exchanges, repo map, files, history, then the request
# with a reminder appended (dropped once the request is history).  `/ask` sends
# one message under another system prompt and other scaffolding, with the same
# history; the next code request carries the question and its answer.

AIDER_UA = "OpenAI/Python 2.20.0"  # litellm's SDK, not aider
AIDER_CODE_SYSTEM = (
    "Act as an expert software developer. Take requests for changes to the supplied code. "
    "Always use best practices when coding. Respect and use existing conventions. "
) * 8
AIDER_ASK_SYSTEM = "Act as an expert code analyst. Answer questions about the supplied code. " * 2
AIDER_REMINDER = "\n\nTo suggest changes to a file you MUST return the entire content. " * 12
AIDER_EXAMPLES = [
    {"role": "user", "content": "Change the greeting to be more casual"},
    {"role": "assistant", "content": text("Ok, I will: show_greeting.py", 200)},
    {"role": "user", "content": "I switched to a new code base. Don't consider the above files."},
    {"role": "assistant", "content": "Ok."},
]


def _aider_body(
    system: str, scaffold: list[dict[str, Any]], history: list[dict[str, Any]], request: str
) -> dict[str, Any]:
    return {
        "model": "smol",
        "messages": [
            {"role": "system", "content": system},
            *copy.deepcopy(scaffold),
            *copy.deepcopy(history),
            {"role": "user", "content": request},
        ],
        "stream": True,
        "temperature": 0,
    }


def aider_ask_mode() -> Traffic:
    """Two code turns, an `/ask`, and a code turn again (one conversation)."""
    tr = Traffic()
    srv = LlamaServer()
    code = [
        *AIDER_EXAMPLES,
        {"role": "user", "content": "Here are summaries of some files.\n" + text("map", 900)},
        {"role": "assistant", "content": "Ok, I won't try and edit those files without asking."},
        {"role": "user", "content": "I have *added these files*.\n" + text("hello.py", 1200)},
        {"role": "assistant", "content": "Ok, any changes I propose will be to those files."},
    ]
    ask = [
        {"role": "user", "content": "I am working with you on code.\n" + text("map", 900)},
        {"role": "assistant", "content": "Ok, I won't try and edit those files without asking."},
        {"role": "user", "content": "I have *added these files*, see.\n" + text("hello.py", 1200)},
        {"role": "assistant", "content": "Ok, I will use that as the true contents."},
    ]
    history: list[dict[str, Any]] = []
    for request, answer in (
        ("Add a function greet(name).", text("greet reply", 300)),
        ("Now add a docstring to greet().", text("docstring reply", 300)),
    ):
        body = _aider_body(AIDER_CODE_SYSTEM, code, history, request + AIDER_REMINDER)
        tr.chat(srv, AIDER_UA, body, {"role": "assistant", "content": answer})
        history += [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
    question, answer = "What does hello.py do?", text("it greets", 400)
    tr.chat(
        srv,
        AIDER_UA,
        _aider_body(AIDER_ASK_SYSTEM, ask, history, question),
        {"role": "assistant", "content": answer},
    )
    history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    body = _aider_body(AIDER_CODE_SYSTEM, code, history, "Rename greet to hello." + AIDER_REMINDER)
    tr.chat(srv, AIDER_UA, body, {"role": "assistant", "content": text("rename reply", 300)})
    return tr


def outage_retries() -> Traffic:
    """A llama-server restart while the harness retries (real aider, OpenAI SDK retries):
    the proxy's 502 (`upstream_unreachable`), llama-server's 503 "Loading model", then
    the request that succeeds on an empty cache."""
    tr = Traffic()
    srv = LlamaServer()
    a = Agent(tr, srv, ua=AIDER_UA, model="smol", tools=None)
    a.turn(text("first ask", 300), text("first answer", 400))
    a.turn(text("second ask", 200), text("second answer", 400))
    srv.reset()
    a.messages.append({"role": "user", "content": text("third ask", 200)})
    body = a.body()
    tr.failed(a.ua, body, error="upstream_unreachable", status=0)
    tr.failed(a.ua, body, error=None, status=503)
    a.send({"role": "assistant", "content": text("third answer", 300)})
    a.turn(text("fourth ask", 200), text("fourth answer", 300))
    return tr


class ToolBlindServer(LlamaServer):
    """A llama-server whose chat template ignores `tools` (SmolLM2's does)."""

    def serve(self, prompt: list[str], reply_chars: int, model: str | None = None) -> Outcome:
        if "<tools>" in prompt:
            a, b = prompt.index("<tools>"), prompt.index("</tools>")
            prompt = prompt[:a] + prompt[b + 1 :]
        return super().serve(prompt, reply_chars, model)


def tokenized(traffic: Traffic) -> Traffic:
    """Fill every full record's `tokens` as `llmp analyze --tokenize` would, with this
    module's pseudo-tokenizer (4 characters a token)."""
    from llmp.apis import record_targets

    for rec in traffic.records:
        found = record_targets(rec)
        if found is None:
            continue
        msgs, tools = found
        rec["tokens"] = {
            "messages": {h: len(chunks(t)) for h, t in msgs.items()},
            "tools": {h: len(chunks(t)) for h, t in tools.items()},
        }
    return traffic


def template_drops_tools() -> Traffic:
    """Tools offered on every turn but never rendered, and a rewritten message: the
    prefix and the losses must not count the tools the server never saw."""
    tr = Traffic()
    srv = ToolBlindServer()
    a = Agent(tr, srv, ua="OpenAI/Python 3.57.0", model="smol", system="Be brief. " * 20)
    a.turn(text("first ask", 400), text("first answer", 400))
    a.turn(text("second ask", 400), text("second answer", 400))
    a.messages[3] = {"role": "user", "content": text("second ask, edited", 400)}  # rewritten
    a.turn(text("third ask", 400), text("third answer", 400))
    a.turn(text("fourth ask", 400), text("fourth answer", 400))
    return tokenized(tr)


SCENARIOS["aider_ask_mode"] = aider_ask_mode
SCENARIOS["template_drops_tools"] = template_drops_tools
# outage_retries has skipped records, which SCENARIOS' shared tests do not expect.


# -- Claude Code (/v1/messages) and Codex (/v1/responses), R21-R29 --------------
#
# Modelled on real traffic against llama-server (shared/spec/wire-formats.md):
# Claude Code 2.1.328 and Codex 0.169.0.  The fake server renders each request
# as llama-server does, from what the model sees: system blocks joined into one
# system turn, `cache_control` gone, a string and a one-text-block array alike.

CLAUDE_UA = "claude-cli/2.1.328 (external, sdk-cli)"
CODEX_UA = "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)"
CLAUDE_MODEL = "claude-sonnet-4-5"
CODEX_MODEL = "gpt-5-codex"
EPHEMERAL = {"type": "ephemeral"}
CLAUDE_IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."
CLAUDE_INSTRUCTIONS = (
    "You are an interactive CLI tool that helps users with software engineering tasks. "
    + text("claude instructions", 7200)
)
CODEX_DEVELOPER = "You are Codex, a coding agent based on GPT-5. " + text("codex rules", 6000)
CODEX_ENVIRONMENT = (
    "<environment_context>\n  <cwd>/work/repo</cwd>\n  <approval_policy>never</approval_policy>\n"
    "  <sandbox_mode>workspace-write</sandbox_mode>\n  <shell>bash</shell>\n"
    "</environment_context>"
)


def billing_header(suffix: str = "7c2") -> str:
    """Claude Code's attribution line, the first block of its system prompt."""
    return f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; cc_entrypoint=sdk-cli;"


def anthropic_tool(name: str, description: str, **props: str) -> dict[str, Any]:
    """A Claude Code tool definition: `{name, description, input_schema}`."""
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": {k: {"type": v} for k, v in props.items()},
            "required": list(props),
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    }


CLAUDE_TOOLS = [
    anthropic_tool("Bash", "Executes a given bash command. " + text("bash", 600), command="string"),
    anthropic_tool("Read", "Reads a file from the local filesystem.", file_path="string"),
    anthropic_tool("Edit", "Performs exact string replacements in files.", file_path="string"),
    anthropic_tool("Grep", "A powerful search tool built on ripgrep.", pattern="string"),
]


def codex_tool(name: str, description: str, **props: str) -> dict[str, Any]:
    """A Codex tool definition: `{"type": "function", "name": …}`, not chat's nesting."""
    return {
        "type": "function",
        "name": name,
        "description": description,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": v} for k, v in props.items()},
            "required": list(props),
            "additionalProperties": False,
        },
    }


CODEX_TOOLS = [
    codex_tool("exec_command", "Runs a command in a PTY. " + text("exec", 500), cmd="string"),
    codex_tool("write_stdin", "Writes characters to an exec session.", chars="string"),
    codex_tool("apply_patch", "Apply a patch to files.", input="string"),
    codex_tool("update_plan", "Updates the task plan.", plan="string"),
]


def anthropic_render(body: dict[str, Any]) -> list[str]:
    """An Anthropic request as llama-server's template sees it (pseudo-tokens)."""
    from llmp.apis.anthropic_messages import content_text, strip_cache_control

    toks = ["<bos>"]
    system = body.get("system")
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system or []
    if blocks:
        toks += ["<|system|>", *chunks("".join(b["text"] for b in blocks)), "<|end|>"]
    tools = strip_cache_control(body.get("tools"))
    if tools:
        toks += ["<tools>", *chunks(dumps(tools).decode()), "</tools>"]
    for m in body["messages"]:
        content = strip_cache_control(m["content"])
        toks += [f"<|{m['role']}|>", *chunks(content_text(content)), "<|end|>"]
    toks.append("<|assistant|>")
    return toks


def responses_render(instructions: str | None, items: list[Any], tools: Any) -> list[str]:
    """A Responses prompt (its whole input, stored part included), as pseudo-tokens."""
    from llmp.apis.openai_responses import item_text

    toks = ["<bos>"]
    if instructions:
        toks += ["<|system|>", *chunks(instructions), "<|end|>"]
    if tools:
        toks += ["<tools>", *chunks(dumps(tools).decode()), "</tools>"]
    for item in items:
        role = item.get("role") or item.get("type")
        toks += [f"<|{role}|>", *chunks(item_text(item)), "<|end|>"]
    toks.append("<|assistant|>")
    return toks


def anthropic_message(
    out: Outcome, served: str, content: list[dict[str, Any]], rid: int, stop: str
) -> dict[str, Any]:
    """llama-server's (merged) Message: `input_tokens` is the evaluated part; no timings."""
    return {
        "id": f"chatcmpl-{rid:08d}",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": served,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "cache_read_input_tokens": out.cache_n,
            "input_tokens": out.prompt - out.cache_n,
            "output_tokens": out.n_gen,
        },
    }


def responses_body(
    out: Outcome, served: str, output: list[dict[str, Any]], rid: int, streamed: bool
) -> dict[str, Any]:
    """llama-server's response object: `input_tokens` is the whole prompt; `timings` beside
    `response` on the streamed `response.completed` only (R26 keeps them on the body)."""
    body: dict[str, Any] = {
        "id": f"resp_{rid:032d}",
        "object": "response",
        "created_at": 1788595000 + rid,
        "status": "completed",
        "model": served,
        "output": output,
        "usage": {
            "input_tokens": out.prompt,
            "output_tokens": out.n_gen,
            "total_tokens": out.prompt + out.n_gen,
            "input_tokens_details": {"cached_tokens": out.cache_n},
        },
    }
    if streamed:
        body["timings"] = {
            "cache_n": out.cache_n,
            "prompt_n": out.prompt - out.cache_n,
            "prompt_ms": RawFloat(repr(out.prompt_ms)),
            "predicted_n": out.n_gen,
            "predicted_ms": RawFloat(repr(out.predicted_ms)),
        }
    return body


class NewApiTraffic(Traffic):
    """`Traffic` with the Anthropic and Responses exchanges, and `t_first_event_ms` (R28)."""

    outcomes: dict[int, Outcome]

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.outcomes = {}

    def served(
        self,
        server: LlamaServer,
        ua: str,
        path: str,
        body: dict[str, Any],
        prompt: list[str],
        reply_chars: int,
        respond: Callable[[Outcome, str, int], dict[str, Any]],
    ) -> dict[str, Any]:
        """One exchange the server answered; `respond(outcome, served, rid)` is its body.

        Streamed: a keep-alive comment is the first byte, the first event comes
        when the prefill ended.  Not streamed: no `t_first_event_ms`.
        """
        out = server.serve(prompt, reply_chars)
        rid = self.next_id
        streamed = body.get("stream") is True
        t_start = self.t
        t_event = t_start + int(out.prompt_ms) + 3
        t_end = t_event + int(out.predicted_ms) + 2
        rec = self._record(
            method="POST",
            path=path,
            ua=ua,
            body=body,
            status=200,
            resp_body=respond(out, server.model, rid),
            stream="sse" if streamed else None,
            t_start=t_start,
            t_first=t_start + 1 if streamed else t_event,
            t_end=t_end,
        )
        self._first_event(rec, t_event if streamed else None)
        self.outcomes[rid] = out
        self.t = t_end + self.think_ms
        return rec

    def _first_event(self, rec: dict[str, Any], t: int | None) -> None:
        """Put `t_first_event_ms` beside `t_first_byte_ms`, as the recorder writes it."""
        items = list(rec.items())
        rec.clear()
        for key, value in items:
            rec[key] = value
            if key == "t_first_byte_ms":
                rec["t_first_event_ms"] = t

    def refused(
        self, ua: str, path: str, body: dict[str, Any], n_prompt: int, n_ctx: int
    ) -> dict[str, Any]:
        """llama-server's 400 `exceed_context_size_error`, the same JSON on every endpoint."""
        t = self.t
        self.t += 40
        message = (
            f"request ({n_prompt} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it"
        )
        error = {
            "code": 400,
            "message": message,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": n_prompt,
            "n_ctx": n_ctx,
        }
        rec = self._record(
            method="POST",
            path=path,
            ua=ua,
            body=body,
            status=400,
            resp_body={"error": error},
            stream=None,
            t_start=t,
            t_first=t + 30,
            t_end=t + 31,
        )
        self._first_event(rec, None)
        return rec

    def count_tokens(self, ua: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        """Claude Code's `/v1/messages/count_tokens?beta=true`: not chat (R21)."""
        t = self.t
        self.t += 15
        rec = self._record(
            method="POST",
            path="/v1/messages/count_tokens?beta=true",
            ua=ua,
            body=body,
            status=200,
            resp_body={"input_tokens": tokens},
            stream=None,
            t_start=t,
            t_first=t + 8,
            t_end=t + 9,
        )
        self._first_event(rec, None)
        return rec


@dataclass
class ClaudeAgent:
    """Claude Code over `/v1/messages?beta=true`.

    `messages` holds the history as Claude Code keeps it (text as a string);
    `body()` sends it as Claude Code does: the latest message as a
    one-text-block array, `cache_control` on its last block only, so the
    marker and the block form move on every turn.  A tool result is followed
    by a `role: "system"` reminder entry.
    """

    traffic: NewApiTraffic
    server: LlamaServer
    ua: str = CLAUDE_UA
    model: str = CLAUDE_MODEL
    suffix: str = "7c2"
    instructions: str = CLAUDE_INSTRUCTIONS
    tools: list[dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(CLAUDE_TOOLS))
    messages: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = True
    turns: int = 0

    def system(self) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": billing_header(self.suffix)},
            {"type": "text", "text": CLAUDE_IDENTITY, "cache_control": EPHEMERAL},
            {"type": "text", "text": self.instructions, "cache_control": EPHEMERAL},
        ]

    def body(self, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        msgs = copy.deepcopy(self.messages if messages is None else messages)
        last = msgs[-1]
        if isinstance(last["content"], str):
            last["content"] = [{"type": "text", "text": last["content"]}]
        last["content"][-1]["cache_control"] = EPHEMERAL
        return {
            "model": self.model,
            "messages": msgs,
            "system": self.system(),
            "tools": copy.deepcopy(self.tools),
            "metadata": {"user_id": "user_4f2a_account__session_9c1e"},
            "max_tokens": 32000,
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "stream": self.stream,
        }

    def send(self, content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
        body = self.body()
        from llmp.apis.anthropic_messages import content_text

        rec = self.traffic.served(
            self.server,
            self.ua,
            "/v1/messages?beta=true",
            body,
            anthropic_render(body),
            len(content_text(content)),
            lambda out, served, rid: anthropic_message(out, served, content, rid, stop),
        )
        self.messages.append({"role": "assistant", "content": copy.deepcopy(content)})
        self.turns += 1
        return rec

    @staticmethod
    def thinking(seed: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text(f"{seed} thinking", 160), "signature": ""}

    def turn(self, user: str | None, answer: str) -> dict[str, Any]:
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        content = [self.thinking(answer[:8]), {"type": "text", "text": answer}]
        return self.send(content, "end_turn")

    def tool_step(
        self, user: str | None, name: str, args: dict[str, Any], result: str
    ) -> dict[str, Any]:
        """The model calls a tool; the result comes back as a `tool_result` block, then a
        `role: "system"` reminder entry, as Claude Code sends them."""
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        call_id = f"toolu_{len(self.messages):04d}{self.suffix}"
        content = [
            self.thinking(name),
            {"type": "text", "text": f"I'll use {name}."},
            {"type": "tool_use", "id": call_id, "name": name, "input": args},
        ]
        rec = self.send(content, "tool_use")
        block = {"type": "tool_result", "tool_use_id": call_id, "content": result}
        self.messages.append({"role": "user", "content": [block]})
        self.messages.append(
            {"role": "system", "content": "<system-reminder>Todo list is empty.</system-reminder>"}
        )
        return rec

    def count(self) -> dict[str, Any]:
        """A `/v1/messages/count_tokens` call on the current history (no slot touched)."""
        body = {k: v for k, v in self.body().items() if k in ("model", "messages", "tools")}
        return self.traffic.count_tokens(self.ua, body, len(anthropic_render(body)))


def claude_work(agent: ClaudeAgent, seed: str = "c") -> list[dict[str, Any]]:
    """A request, a tool call, its answer."""
    recs = []
    if not agent.messages:
        task = text(f"{seed} task", 220)
        recs.append(agent.tool_step(task, "Read", {"file_path": "src/app.py"}, text("app", 900)))
    else:
        recs.append(agent.tool_step(text(f"{seed} ask", 160), "Grep", {"pattern": "def "}, "x"))
    recs.append(agent.turn(None, text(f"{seed} answer", 300)))
    return recs


@dataclass
class CodexAgent:
    """Codex over `/v1/responses`: developer and environment items, the whole input
    resent every turn (`store: false`), a `client_metadata` that changes every turn.

    With `stateful`, it keeps responses on the server (`store: true`) and sends
    only the new items with `previous_response_id` after its first turn.
    """

    traffic: NewApiTraffic
    server: LlamaServer
    ua: str = CODEX_UA
    model: str = CODEX_MODEL
    tools: list[dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(CODEX_TOOLS))
    items: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = True
    stateful: bool = False
    sent: int = 0  # items the server holds (stateful)
    last_id: str | None = None
    turns: int = 0

    def __post_init__(self) -> None:
        if not self.items:
            self.items = [
                {
                    "type": "message",
                    "id": "msg_dev0001",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": CODEX_DEVELOPER}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": CODEX_ENVIRONMENT}],
                },
            ]

    def body(self) -> dict[str, Any]:
        new = self.items[self.sent :] if self.stateful and self.last_id else self.items
        body: dict[str, Any] = {
            "model": self.model,
            "input": copy.deepcopy(new),
            "tools": copy.deepcopy(self.tools),
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"summary": "auto"},
            "store": self.stateful,
            "stream": self.stream,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a3c4-session",
            "client_metadata": {
                "turn_id": f"turn-{self.turns:04d}",
                "turn_started_at": str(T0 + 1000 * self.turns),
            },
        }
        if self.stateful and self.last_id:
            body["previous_response_id"] = self.last_id
        return body

    def send(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        from llmp.apis.openai_responses import item_text

        body = self.body()
        prompt = responses_render(None, self.items, self.tools)
        streamed = self.stream
        rec = self.traffic.served(
            self.server,
            self.ua,
            "/v1/responses",
            body,
            prompt,
            sum(len(item_text(i)) for i in output),
            lambda out, served, rid: responses_body(out, served, output, rid, streamed),
        )
        self.items += copy.deepcopy(output)
        self.sent = len(self.items)
        self.last_id = rec["response"]["body"]["id"]
        self.turns += 1
        return rec

    @staticmethod
    def reasoning(seed: str) -> dict[str, Any]:
        return {
            "id": f"rs_{seed}",
            "summary": [],
            "type": "reasoning",
            "content": [{"text": text(f"{seed} reasoning", 140), "type": "reasoning_text"}],
            "encrypted_content": "",
        }

    def ask(self, prompt: str) -> None:
        self.items.append(
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}
        )

    def turn(self, prompt: str | None, answer: str) -> dict[str, Any]:
        if prompt is not None:
            self.ask(prompt)
        message = {
            "type": "message",
            "status": "completed",
            "id": f"msg_{self.turns:04d}",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": answer}],
            "role": "assistant",
        }
        return self.send([self.reasoning(f"t{self.turns}"), message])

    def tool_step(
        self, prompt: str | None, name: str, args: dict[str, Any], result: str
    ) -> dict[str, Any]:
        if prompt is not None:
            self.ask(prompt)
        call = {
            "type": "function_call",
            "status": "completed",
            "arguments": dumps(args).decode(),
            "call_id": f"fc_{self.turns:04d}",
            "name": name,
        }
        rec = self.send([self.reasoning(f"t{self.turns}"), call])
        self.items.append(
            {"type": "function_call_output", "call_id": call["call_id"], "output": result}
        )
        return rec


def codex_work(agent: CodexAgent, seed: str = "x") -> list[dict[str, Any]]:
    """A prompt, a command, its output, the answer."""
    return [
        agent.tool_step(
            text(f"{seed} prompt", 200), "exec_command", {"cmd": "ls"}, text("ls", 400)
        ),
        agent.turn(None, text(f"{seed} answer", 300)),
    ]


def claude_code_session() -> NewApiTraffic:
    """Claude Code: turns, a `count_tokens` call, a 400 for the context retried at once with
    the same body, a summary, and the compacted conversation under a new attribution line."""
    tr = NewApiTraffic()
    srv = LlamaServer(model="/models/qwen3-coder-30b-q4_k_m.gguf")
    a = ClaudeAgent(tr, srv)
    claude_work(a)  # ids 1, 2
    a.count()  # id 3
    claude_work(a, "d")  # ids 4, 5
    a.messages.append({"role": "user", "content": text("huge log", 40000)})
    too_long = a.body()
    tr.refused(a.ua, "/v1/messages?beta=true", too_long, 12410, 8192)  # id 6
    tr.refused(a.ua, "/v1/messages?beta=true", copy.deepcopy(too_long), 12410, 8192)  # id 7
    a.messages.pop()
    summary = text("summary of the conversation", 1500)
    s = ClaudeAgent(
        tr,
        srv,
        instructions="You are a helpful AI assistant tasked with summarizing conversations.",
        tools=[],
        stream=False,
    )
    s.messages = [
        {"role": "user", "content": text("the conversation, flattened", 12000)},
    ]
    body = s.body()
    body.pop("tools")
    tr.served(  # id 8: the summary, a side-call
        srv,
        a.ua,
        "/v1/messages?beta=true",
        body,
        anthropic_render(body),
        len(summary),
        lambda out, served, rid: anthropic_message(
            out, served, [{"type": "text", "text": summary}], rid, "end_turn"
        ),
    )
    # The compacted conversation: a new attribution suffix, the same instructions and tools.
    a.suffix = "119"
    a.messages = [
        {
            "role": "user",
            "content": "This session is being continued from a previous conversation. "
            "Summary:\n" + summary,
        },
    ]
    a.turn(text("continue", 200), text("after answer", 300))  # id 9
    claude_work(a, "e")  # ids 10, 11
    return tr


def claude_code_system_edit() -> NewApiTraffic:
    """Claude Code whose long instructions block changed in its middle between two turns."""
    tr = NewApiTraffic()
    a = ClaudeAgent(tr, LlamaServer())
    claude_work(a)  # ids 1, 2
    half = len(CLAUDE_INSTRUCTIONS) // 2
    a.instructions = (
        CLAUDE_INSTRUCTIONS[:half] + " Use pnpm, not npm. " + CLAUDE_INSTRUCTIONS[half:]
    )
    claude_work(a, "d")  # ids 3, 4
    return tr


def codex_session(stream: bool = True) -> NewApiTraffic:
    """Codex: three turns with a command, its output, reasoning items in between."""
    tr = NewApiTraffic()
    c = CodexAgent(tr, LlamaServer(), stream=stream)
    codex_work(c)  # ids 1, 2
    codex_work(c, "y")  # ids 3, 4
    return tr


def codex_stateful() -> NewApiTraffic:
    """A Responses client that keeps its responses on the server (`previous_response_id`)."""
    tr = NewApiTraffic()
    c = CodexAgent(tr, LlamaServer(), stateful=True, ua="OpenAI/Python 3.57.0")
    c.turn(text("p prompt", 200), text("p answer", 300))  # id 1: a turn
    c.turn(text("p more", 200), text("p answer 2", 300))  # id 2: previous_response_id
    return tr


def both_agents() -> NewApiTraffic:
    """Claude Code and Codex on one llama-server with one slot, taking turns: each
    evicts the other's cache."""
    tr = NewApiTraffic()
    srv = LlamaServer()
    a = ClaudeAgent(tr, srv)
    c = CodexAgent(tr, srv)
    claude_work(a)  # 1, 2
    codex_work(c)  # 3, 4
    claude_work(a, "d")  # 5, 6
    codex_work(c, "y")  # 7, 8
    return tr
