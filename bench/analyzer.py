"""Benchmark: `llmp analyze --json` next to a bare orjson parse of the same recording.

    .venv/bin/python bench/analyzer.py               # ~1 GB recording, ~3 min on 2 cores
    .venv/bin/python bench/analyzer.py --quick       # ~100 MB, under a minute
    .venv/bin/python bench/analyzer.py --size-mb 300 --repeat 5
    .venv/bin/python bench/analyzer.py --file my.jsonl   # any recording (generated if absent)

What it does (issue 3, "Benchmark"; the reading is in ``docs/performance.md``):

1. Generates, once, a digest recording of realistic agent traffic and caches
   it under ``bench/out/`` (gitignored). Several agents run interleaved
   against a simulated llama-server with four slots: opencode-like tool loops
   with a title side-call per conversation, a subagent and compactions, an
   aider-like chat with a weak-model commit-message side-call, two harnesses
   on one SDK user-agent with different tool sets, a Cline-like agent with a
   very large system prompt, and a health monitor. Histories grow to a couple
   of hundred messages; system prompts change now and then; the response
   digests carry llama-server's ``usage`` and ``timings`` from the simulated
   cache. Message, tool and response digests come from the recorder's own
   functions (``llmp.apis.digest``), the request digest is assembled from them in
   ``request_digest``'s key order (checked against ``request_digest`` on a
   sample), records are laid out as ``llmp.recorder.record.build_record`` lays them
   out and written with ``llmp.format.canonical.record_dumps`` (orjson) when each
   exchange *ends*, so ids are slightly out of order as in a real recording.
2. Cuts prefixes of it (by default 1/4, 1/2 and 3/4) at line boundaries.
3. For each size, in alternating order and ``--repeat`` times, runs in a
   fresh subprocess each: a bare parse (``for line in f: orjson.loads(line)``)
   and ``.venv/bin/llmp analyze --json FILE > /dev/null``. Each child's CPU
   time and peak RSS come from ``os.wait4`` in a small launcher process (that
   child only); its RSS is also polled from ``/proc`` to show how it evolves.
4. Prints the figures side by side and the verdict for both targets: speed
   (issue 14: analyze at >= 0.6x the bare parse's speed to land, 1.0x the goal,
   best CPU time of the repeats) and memory (peak RSS does not grow with the file).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from llmp.apis.openai_chat import OpenAIChat, message_digest, tool_digest
from llmp.format.canonical import hash_value, record_dumps

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"
VENV_BIN = Path(sys.executable).parent
LLMP = VENV_BIN / "llmp"

GEN_VERSION = 3  # bump when the generated traffic changes: cached files are keyed by it
T0 = 1_788_595_000_000  # 2026-09-05, Unix ms
CHAT_PATH = "/v1/chat/completions"
MAIN_MODEL = "qwen3-coder-30b-a3b"
WEAK_MODEL = "qwen2.5-coder-1.5b"
CHECK_EVERY = 997  # every so many chat requests, compare with request_digest()

PARSE_SRC = """\
import sys
import orjson
with open(sys.argv[1], "rb") as f:
    for line in f:
        orjson.loads(line)
"""

# ============================================================ traffic model


class Text:
    """Deterministic filler text: unique per call, cheap to slice."""

    def __init__(self, rng: random.Random, size: int = 1 << 21) -> None:
        words = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
            for _ in range(3000)
        ]
        words += ["def", "return", "self", "import", "{", "}", "(", ")", "\n", "    ", "=", "."]
        parts: list[str] = []
        n = 0
        while n < size:
            w = rng.choice(words)
            parts.append(w)
            n += len(w) + 1
        self.corpus = " ".join(parts)
        self.rng = rng
        self.counter = itertools.count(1)

    def __call__(self, n: int) -> str:
        tag = f"[{next(self.counter)}] "
        n = max(0, n - len(tag))
        if n >= len(self.corpus):
            return tag + (self.corpus * (n // len(self.corpus) + 1))[:n]
        off = self.rng.randrange(0, len(self.corpus) - n)
        return tag + self.corpus[off : off + n]


def tool_def(text: Text, name: str, desc_chars: int, params: Sequence[str]) -> dict[str, Any]:
    """An OpenAI-style tool definition with a description of about desc_chars."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": text(desc_chars),
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": text(60)} for p in params},
                "required": list(params[:1]),
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
    }


class ToolSet:
    """A tools array as sent, with its digests computed once."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.raw = tools
        self.names = [t["function"]["name"] for t in tools]
        self.digests = [tool_digest(t) for t in tools]
        self.hash = hash_value(tools) if tools else None  # request_digest()'s tools_hash
        self.tokens = sum(d["chars"] for d in self.digests) // 4 + 8 * len(tools)


def est_tokens(chars: int) -> int:
    return (chars + 3) // 4 + 4  # text plus the template's role markers


class Conv:
    """A conversation's history as the client resends it, with digests kept.

    `blocks` is what the simulated server's cache sees: the system messages,
    a block for the tools array, then the other messages; `cum` its token
    prefix sums. A rewrite (new system prompt, compaction) makes a new Conv,
    so "same list object" means "same prefix" for the cache's fast path.
    """

    def __init__(self, system: list[dict[str, Any]], tools: ToolSet) -> None:
        self.raw: list[dict[str, Any]] = []
        self.dig: list[Mapping[str, Any]] = []
        self.blocks: list[str] = []
        self.cum: list[int] = [1]  # <bos>
        self.tools = tools
        for m in system:
            self._append(m, message_digest(m))
        self.blocks.append(f"tools:{tools.hash}")
        self.cum.append(self.cum[-1] + tools.tokens)
        self.chars = 0  # non-system text, to decide on compaction

    def _append(self, m: dict[str, Any], d: Mapping[str, Any]) -> None:
        self.raw.append(m)
        self.dig.append(d)
        self.blocks.append(d["hash"])
        self.cum.append(self.cum[-1] + est_tokens(d["chars"]))

    def add(self, m: dict[str, Any]) -> None:
        d = message_digest(m)
        self._append(m, d)
        self.chars += d["chars"]

    def _n_sys(self) -> int:
        n = 0
        for m in self.raw:
            if m["role"] != "system":
                break
            n += 1
        return n

    def with_system(self, system: list[dict[str, Any]]) -> Conv:
        """The same history under another system prompt."""
        new = Conv(system, self.tools)
        for m in self.raw[self._n_sys() :]:
            new.add(m)
        return new


@dataclass
class Call:
    """One exchange an agent wants made."""

    ua: str
    model: str
    conv: Conv | None  # None for a request that is not chat
    reply: dict[str, Any] | None
    think_ms: int  # the client's pause after the exchange ends
    stream: bool = True
    params: dict[str, Any] = field(default_factory=dict)
    method: str = "POST"
    path: str = CHAT_PATH
    error: str | None = None
    status: int = 200
    conn: int = 0


class Slots:
    """llama-server's slot cache: longest-prefix slot choice, LRU on ties.

    A slot remembers the blocks of the last prompt it served; the reply it
    generated never matches the reply as the client resends it, so the next
    turn reuses exactly the previous prompt (what a real llama-server reports).
    """

    def __init__(self, n: int, ms_per_prompt_token: float, ms_per_gen_token: float) -> None:
        self.slots: list[tuple[list[str], int] | None] = [None] * n
        self.used = [0] * n
        self.clock = 0
        self.pp = ms_per_prompt_token
        self.tg = ms_per_gen_token

    @staticmethod
    def _lcp(slot: tuple[list[str], int] | None, blocks: list[str], n: int) -> int:
        if slot is None:
            return 0
        sb, sn = slot
        if sb is blocks:
            return min(sn, n)
        m = min(sn, n)
        i = 0
        while i < m and sb[i] == blocks[i]:
            i += 1
        return i

    def serve(self, conv: Conv, gen_tokens: int) -> tuple[int, int, float, float]:
        """(prompt tokens, cache_n, prompt_ms, predicted_ms) of a request."""
        blocks, n = conv.blocks, len(conv.blocks)
        best, best_lcp = 0, -1
        for i, slot in enumerate(self.slots):
            c = self._lcp(slot, blocks, n)
            if c > best_lcp or (c == best_lcp and self.used[i] < self.used[best]):
                best, best_lcp = i, c
        prompt = conv.cum[n] + 2  # + the assistant header
        cache_n = conv.cum[best_lcp] if best_lcp > 0 else 0
        cache_n = min(cache_n, prompt - 1)
        self.slots[best] = (blocks, n)
        self.clock += 1
        self.used[best] = self.clock
        prompt_n = prompt - cache_n
        return (
            prompt,
            cache_n,
            round(3.0 + prompt_n * self.pp, 3),
            round(gen_tokens * self.tg, 3),
        )


class Agents:
    """The simulated clients; each agent is a generator of Calls."""

    def __init__(self, rng: random.Random, text: Text) -> None:
        self.rng = rng
        self.text = text
        self.call_ids = itertools.count(1)
        self.conns = itertools.count(1)
        t = text
        self.opencode_tools = ToolSet(
            [
                tool_def(t, "bash", 9000, ["command", "timeout", "description"]),
                tool_def(t, "edit", 2200, ["filePath", "oldString", "newString", "replaceAll"]),
                tool_def(t, "webfetch", 1400, ["url", "format", "timeout"]),
                tool_def(t, "glob", 700, ["pattern", "path"]),
                tool_def(t, "grep", 900, ["pattern", "path", "include"]),
                tool_def(t, "list", 500, ["path", "ignore"]),
                tool_def(t, "read", 1300, ["filePath", "offset", "limit"]),
                tool_def(t, "write", 900, ["filePath", "content"]),
                tool_def(t, "todowrite", 7000, ["todos"]),
                tool_def(t, "todoread", 300, []),
                tool_def(t, "task", 3500, ["description", "prompt", "subagent_type"]),
            ]
        )
        # The subagent gets a subset: it stays with its parent's client.
        self.subagent_tools = ToolSet(
            [
                x
                for x in self.opencode_tools.raw
                if x["function"]["name"] in ("bash", "glob", "grep", "list", "read")
            ]
        )
        self.research_tools = ToolSet(
            [
                tool_def(t, "web_search", 600, ["query", "max_results"]),
                tool_def(t, "fetch_url", 500, ["url"]),
                tool_def(t, "save_note", 300, ["title", "body"]),
            ]
        )
        self.data_tools = ToolSet(
            [
                tool_def(t, "run_python", 900, ["code"]),
                tool_def(t, "run_sql", 700, ["query", "database"]),
                tool_def(t, "plot", 500, ["spec"]),
                tool_def(t, "describe_table", 400, ["table"]),
            ]
        )
        self.no_tools = ToolSet([])
        self.opencode_system = t(9500)
        self.subagent_system = t(3000)
        self.aider_system = t(5200)
        self.cline_system = (t(38000), t(36500))  # act mode, plan mode
        self.research_system = t(2200)
        self.data_system = t(1800)

    # -- pieces -------------------------------------------------------------

    def sys_msg(self, body: str, env: str = "") -> dict[str, Any]:
        return {"role": "system", "content": body + env}

    def env(self, day: int) -> str:
        return f"\n<env>\n  Working directory: /home/dev/project\n  Today's date: day {day}\n</env>"

    def tool_call(self, name: str, arg_chars: int) -> dict[str, Any]:
        return {
            "id": "".join(
                self.rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
                for _ in range(32)
            ),
            "type": "function",
            "function": {
                "name": name,
                "arguments": orjson.dumps({"arg": self.text(arg_chars)}).decode(),
            },
        }

    def result_chars(self, name: str) -> int:
        r = self.rng
        if name in ("read", "fetch_url", "webfetch"):
            return int(r.lognormvariate(8.0, 0.8))  # median ~3 KB, tail to ~30 KB
        if name in ("bash", "run_python", "run_sql"):
            return int(r.lognormvariate(6.8, 1.0))
        return int(r.lognormvariate(6.2, 0.7))

    def tool_step(
        self,
        conv: Conv,
        ua: str,
        model: str,
        tools: Sequence[str],
        conn: int,
        params: dict[str, Any],
        text_before: bool = False,
    ) -> Iterator[Call]:
        """The model calls one to three tools; their results join the history."""
        r = self.rng
        k = 1 if r.random() < 0.8 else r.randint(2, 3)
        calls = [self.tool_call(r.choice(tools), r.randint(30, 400)) for _ in range(k)]
        reply = {
            "role": "assistant",
            "content": self.text(r.randint(40, 400)) if text_before else "",
            "tool_calls": calls,
        }
        tool_ms = int(r.lognormvariate(6.0, 1.2))  # ~400 ms median, long tail
        yield Call(ua, model, conv, reply, tool_ms, params=params, conn=conn)
        conv.add(reply)
        for c in calls:
            conv.add(
                {
                    "role": "tool",
                    "tool_call_id": c["id"],
                    "content": self.text(self.result_chars(c["function"]["name"])),
                }
            )

    def answer(
        self, conv: Conv, ua: str, model: str, conn: int, params: dict[str, Any], think_ms: int
    ) -> Iterator[Call]:
        reply = {"role": "assistant", "content": self.text(int(self.rng.lognormvariate(6.8, 0.7)))}
        yield Call(ua, model, conv, reply, think_ms, params=params, conn=conn)
        conv.add(reply)

    def user_think(self) -> int:
        return int(self.rng.lognormvariate(10.3, 0.9))  # ~30 s median

    def oneshot(
        self,
        ua: str,
        model: str,
        system: str | None,
        user_chars: int,
        reply_chars: int,
        conn: int,
        params: dict[str, Any],
        tools: ToolSet | None = None,
    ) -> Call:
        msgs = [self.sys_msg(system)] if system is not None else []
        conv = Conv(msgs, tools or self.no_tools)
        conv.add({"role": "user", "content": self.text(user_chars)})
        reply = {"role": "assistant", "content": self.text(reply_chars)}
        return Call(ua, model, conv, reply, 0, stream=False, params=params, conn=conn)

    # -- agents -------------------------------------------------------------

    def opencode(self, ua: str, day: list[int]) -> Iterator[Call]:
        """Tool loops with follow-ups, a title side-call, subagents, compaction."""
        r = self.rng
        conn = next(self.conns)
        params = {"temperature": 0.55, "top_p": 1, "max_tokens": 32000}
        yield Call(ua, MAIN_MODEL, None, None, 50, method="GET", path="/v1/models", conn=conn)
        while True:
            system = [self.sys_msg(self.opencode_system, self.env(day[0]))]
            conv = Conv(system, self.opencode_tools)
            first = self.text(int(r.lognormvariate(6.0, 0.9)))
            conv.add({"role": "user", "content": first})
            title = self.oneshot(
                ua,
                MAIN_MODEL,
                "You are a title generator. " * 20,
                len(first),
                40,
                conn,
                {"temperature": 0.5, "max_tokens": 64},
            )
            title.think_ms = 5
            yield title
            for _task in range(r.randint(1, 7)):
                for step in range(int(r.lognormvariate(2.6, 0.8)) + 1):
                    if r.random() < 0.04 and step > 0:
                        yield from self.subagent(ua, conv, conn, day)
                        continue
                    yield from self.tool_step(
                        conv,
                        ua,
                        MAIN_MODEL,
                        self.opencode_tools.names[:8],
                        conn,
                        params,
                        text_before=r.random() < 0.3,
                    )
                    if conv.chars > 200_000:  # near the context: compact
                        summary_src = min(conv.chars, 150_000)
                        s = self.oneshot(
                            ua,
                            MAIN_MODEL,
                            "You summarise coding sessions. " * 30,
                            summary_src,
                            3000,
                            conn,
                            {"temperature": 0.5, "max_tokens": 32000},
                        )
                        s.think_ms = 20
                        yield s
                        summary = self.text(3000)
                        conv = Conv(system, self.opencode_tools)
                        conv.add({"role": "user", "content": "Summary so far:\n" + summary})
                        conv.add({"role": "assistant", "content": "Understood, continuing."})
                        conv.add({"role": "user", "content": "Continue."})
                if r.random() < 0.04:  # the harness refreshed its environment block
                    day[0] += 1
                    system = [self.sys_msg(self.opencode_system, self.env(day[0]))]
                    conv = conv.with_system(system)
                yield from self.answer(conv, ua, MAIN_MODEL, conn, params, self.user_think())
                conv.add({"role": "user", "content": self.text(int(r.lognormvariate(5.5, 1.0)))})
            # the user starts a new session after a pause
            yield Call(
                ua,
                MAIN_MODEL,
                None,
                None,
                int(r.lognormvariate(12.5, 1.0)),
                method="GET",
                path="/v1/models",
                conn=conn,
            )
            if r.random() < 0.3:
                conn = next(self.conns)

    def subagent(self, ua: str, parent: Conv, conn: int, day: list[int]) -> Iterator[Call]:
        r = self.rng
        params = {"temperature": 0.55, "top_p": 1, "max_tokens": 32000}
        # The parent's task call, then the subagent's own loop, then the result.
        call = self.tool_call("task", 600)
        reply = {"role": "assistant", "content": "", "tool_calls": [call]}
        yield Call(ua, MAIN_MODEL, parent, reply, 20, params=params, conn=conn)
        parent.add(reply)
        sub = Conv([self.sys_msg(self.subagent_system, self.env(day[0]))], self.subagent_tools)
        sub.add({"role": "user", "content": self.text(800)})
        for _ in range(r.randint(3, 25)):
            yield from self.tool_step(sub, ua, MAIN_MODEL, self.subagent_tools.names, conn, params)
        yield from self.answer(sub, ua, MAIN_MODEL, conn, params, 30)
        parent.add({"role": "tool", "tool_call_id": call["id"], "content": self.text(2500)})

    def aider(self) -> Iterator[Call]:
        """Chat without tools; edits; a weak-model commit message after each edit."""
        r = self.rng
        ua = "aider/0.86.1"
        conn = next(self.conns)
        params = {"temperature": 0}
        while True:
            conv = Conv([self.sys_msg(self.aider_system)], self.no_tools)
            conv.add({"role": "user", "content": self.text(int(r.lognormvariate(8.8, 0.5)))})
            conv.add(
                {
                    "role": "assistant",
                    "content": "Ok, I won't try and edit those files without asking first.",
                }
            )
            for _ in range(r.randint(3, 40)):
                conv.add({"role": "user", "content": self.text(int(r.lognormvariate(5.8, 0.8)))})
                reply = {"role": "assistant", "content": self.text(int(r.lognormvariate(7.8, 0.6)))}
                yield Call(ua, MAIN_MODEL, conv, reply, 200, params=params, conn=conn)
                conv.add(reply)
                if r.random() < 0.6:
                    c = self.oneshot(
                        ua,
                        WEAK_MODEL,
                        "You are an expert software engineer that generates concise Git "
                        "commit messages. " * 5,
                        int(r.lognormvariate(7.5, 0.6)),
                        70,
                        conn,
                        {"temperature": 0},
                    )
                    c.think_ms = self.user_think()
                    yield c
                else:
                    yield Call(
                        ua,
                        MAIN_MODEL,
                        None,
                        None,
                        self.user_think(),
                        method="GET",
                        path="/v1/models",
                        conn=conn,
                    )
            yield Call(
                ua,
                MAIN_MODEL,
                None,
                None,
                int(r.lognormvariate(12.0, 1.0)),
                method="GET",
                path="/v1/models",
                conn=conn,
            )

    def sdk_harness(self, which: str) -> Iterator[Call]:
        """Two harnesses on one SDK user-agent, told apart by their tool sets."""
        r = self.rng
        ua = "OpenAI/Python 1.99.9"
        tools, system = (
            (self.research_tools, self.research_system)
            if which == "research"
            else (self.data_tools, self.data_system)
        )
        conn = next(self.conns)
        params = {"temperature": 0.2, "stream_options": {"include_usage": True}}
        while True:
            conv = Conv([self.sys_msg(system)], tools)
            conv.add({"role": "user", "content": self.text(int(r.lognormvariate(6.5, 0.8)))})
            for _ in range(int(r.lognormvariate(2.8, 0.6)) + 2):
                yield from self.tool_step(conv, ua, MAIN_MODEL, tools.names, conn, params)
            yield from self.answer(conv, ua, MAIN_MODEL, conn, params, 100)
            c = self.oneshot(
                ua,
                MAIN_MODEL,
                "Extract the key facts as JSON.",
                3000,
                400,
                conn,
                {"temperature": 0, "response_format": {"type": "json_object"}},
            )
            c.think_ms = int(r.lognormvariate(12.5, 1.0))  # run by hand, now and then
            yield c

    def cline(self) -> Iterator[Call]:
        """A very large system prompt with tools in it; environment details in user turns.

        Switching between plan and act mode swaps the system prompt mid-conversation.
        """
        r = self.rng
        ua = "Cline/3.30.0"
        conn = next(self.conns)
        params = {"temperature": 0, "stream_options": {"include_usage": True}}
        mode = 0
        while True:
            conv = Conv([self.sys_msg(self.cline_system[mode])], self.no_tools)
            conv.add({"role": "user", "content": self.text(int(r.lognormvariate(7.5, 0.6)))})
            for _ in range(int(r.lognormvariate(3.0, 0.7)) + 1):
                reply = {"role": "assistant", "content": self.text(int(r.lognormvariate(6.5, 0.6)))}
                yield Call(
                    ua,
                    MAIN_MODEL,
                    conv,
                    reply,
                    int(r.lognormvariate(6.5, 1.0)),
                    params=params,
                    conn=conn,
                )
                conv.add(reply)
                conv.add({"role": "user", "content": self.text(self.result_chars("read") + 600)})
                if conv.chars > 250_000:
                    break
                if r.random() < 0.03:
                    mode = 1 - mode
                    conv = conv.with_system([self.sys_msg(self.cline_system[mode])])
            yield from self.answer(
                conv, ua, MAIN_MODEL, conn, params, int(r.lognormvariate(12.0, 1.0))
            )

    def monitor(self) -> Iterator[Call]:
        conn = next(self.conns)
        while True:
            yield Call(
                "curl/8.5.0",
                MAIN_MODEL,
                None,
                None,
                60_000,
                method="GET",
                path="/health",
                conn=conn,
            )


# ============================================================ records


def request_part(call: Call, digest: dict[str, Any] | None, body_bytes: int) -> dict[str, Any]:
    if call.method == "POST":  # as httpx and node send them, filtered by the recorder
        headers = {
            "content-type": "application/json",
            "user-agent": call.ua,
            "content-length": str(body_bytes),
        }
    else:
        headers = {"user-agent": call.ua}
    return {
        "method": call.method,
        "path": call.path,
        "headers": headers,
        "body_bytes": body_bytes,
        "body": None,
        "body_text": None,
        "digest": digest,
    }


def chat_digest(call: Call) -> dict[str, Any]:
    """The request digest, assembled in request_digest()'s key order."""
    conv = call.conv
    assert conv is not None
    p = call.params
    return {
        "model": call.model,
        "params": {
            "max_tokens": p.get("max_tokens"),
            "response_format": "response_format" in p,
            "grammar": False,
            "stream": call.stream,
        },
        "messages": conv.dig,
        "tools": conv.tools.digests,
        "tools_hash": conv.tools.hash,
    }


def chat_body(call: Call) -> dict[str, Any]:
    """The body the client sent (for the sampled check only)."""
    conv = call.conv
    assert conv is not None
    body: dict[str, Any] = {"model": call.model, "messages": conv.raw}
    if conv.tools.raw:
        body["tools"] = conv.tools.raw
    body["stream"] = call.stream
    body.update(call.params)
    return body


@dataclass
class GenStats:
    records: int = 0
    bytes: int = 0
    chat: int = 0
    side_calls: int = 0
    not_chat: int = 0
    errors: int = 0
    out_of_order: int = 0
    msgs_total: int = 0
    msgs_max: int = 0
    msgs_hist: dict[str, int] = field(default_factory=dict)
    checked: int = 0
    user_agents: list[str] = field(default_factory=list)
    t_span_h: float = 0.0
    gen_seconds: float = 0.0


def generate(path: Path, size_bytes: int, seed: int) -> GenStats:
    """Write a digest recording of about size_bytes to path."""
    t_begin = time.perf_counter()
    rng = random.Random(seed)
    text = Text(random.Random(seed + 1))
    ag = Agents(rng, text)
    day = [1]
    agents: list[Iterator[Call]] = [
        ag.opencode("opencode/0.15.8", day),
        ag.opencode("opencode/0.15.8", day),  # a second terminal: same client
        ag.aider(),
        ag.sdk_harness("research"),
        ag.sdk_harness("data"),
        ag.cline(),
        ag.monitor(),
    ]
    servers = {MAIN_MODEL: Slots(4, 0.9, 22.0), WEAK_MODEL: Slots(1, 0.15, 6.0)}
    queue: list[tuple[int, int]] = [(T0 + i * 1500, i) for i in range(len(agents))]
    heapq.heapify(queue)
    pending: list[tuple[int, int, bytes]] = []  # (t_end, id, line): written when it ends
    st = GenStats(
        user_agents=sorted(
            {
                "opencode/0.15.8",
                "aider/0.86.1",
                "OpenAI/Python 1.99.9",
                "Cline/3.30.0",
                "curl/8.5.0",
            }
        )
    )
    next_id = 1
    max_written = 0
    n_chat = 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb", buffering=1 << 20) as out:

        def flush(until: int) -> None:
            nonlocal max_written
            while pending and pending[0][0] <= until:
                _, rid, line = heapq.heappop(pending)
                if rid < max_written:
                    st.out_of_order += 1
                max_written = max(max_written, rid)
                out.write(line)
                st.bytes += len(line)
                st.records += 1

        while st.bytes < size_bytes:
            t_start, who = heapq.heappop(queue)
            flush(t_start)
            call = next(agents[who])
            rid = next_id
            next_id += 1
            conv = call.conv
            response: dict[str, Any] | None
            error: str | None = None
            if conv is None:  # not chat: bodies are dropped in digest mode
                t_first = t_start + 2
                t_end = t_start + 3
                response = {
                    "status": 200,
                    "headers": {"content-type": "application/json", "content-length": "96"},
                    "stream": None,
                    "chunks": None,
                    "bad_chunks": None,
                    "body_bytes": 96,
                    "truncated": False,
                    "body": None,
                    "body_text": None,
                    "digest": None,
                }
                request = request_part(call, None, 0)
                st.not_chat += 1
            else:
                n_chat += 1
                digest = chat_digest(call)
                if n_chat % CHECK_EVERY == 1:
                    want = OpenAIChat().request_digest(chat_body(call))
                    if record_dumps(want) != record_dumps(digest):
                        raise AssertionError(f"request digest of record {rid} differs")
                    st.checked += 1
                nm = len(conv.dig)
                st.msgs_total += nm
                st.msgs_max = max(st.msgs_max, nm)
                bucket = (
                    "1-9"
                    if nm < 10
                    else "10-49"
                    if nm < 50
                    else "50-99"
                    if nm < 100
                    else "100-199"
                    if nm < 200
                    else "200+"
                )
                st.msgs_hist[bucket] = st.msgs_hist.get(bucket, 0) + 1
                if nm <= 2 or not call.stream:
                    st.side_calls += 1
                reply = call.reply or {"role": "assistant", "content": ""}
                rd = OpenAIChat().response_digest({"choices": [{"message": reply}]})
                assert rd is not None
                out_chars = rd["output"]["content_chars"] + sum(
                    len(c["function"]["arguments"]) + 40 for c in reply.get("tool_calls") or []
                )
                gen = max(1, out_chars // 4)
                prompt, cache_n, prompt_ms, predicted_ms = servers[call.model].serve(conv, gen)
                t_first = t_start + int(prompt_ms) + 4
                t_end = t_first + int(predicted_ms) + 3
                body_bytes = sum(d["chars"] for d in conv.dig) + 70 * nm + 400
                body_bytes += sum(d["chars"] for d in conv.tools.digests)
                status = 200
                if rng.random() < 0.002:  # the user pressed Esc mid-stream
                    error = "client_disconnected"
                    t_end = t_first + int(predicted_ms * rng.random()) + 3
                elif rng.random() < 0.001:
                    status = 400  # context exceeded: answered before any prefill
                    t_first, t_end = t_start + 30, t_start + 31
                st.errors += error is not None or status != 200
                timings = {
                    "cache_n": cache_n,
                    "prompt_n": prompt - cache_n,
                    "prompt_ms": prompt_ms,
                    "prompt_per_token_ms": round(prompt_ms / (prompt - cache_n), 6),
                    "prompt_per_second": round(1000.0 * (prompt - cache_n) / prompt_ms, 6),
                    "predicted_n": gen,
                    "predicted_ms": predicted_ms,
                    "predicted_per_token_ms": round(predicted_ms / gen, 6),
                    "predicted_per_second": round(1000.0 * gen / predicted_ms, 6),
                }
                merged: dict[str, Any] = {
                    "choices": [
                        {
                            "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop",
                            "index": 0,
                            "message": reply,
                        }
                    ],
                    "created": t_start // 1000,
                    "id": f"chatcmpl-{rid:010d}",
                    "model": call.model,
                    "system_fingerprint": "b7210-5c0d9e6f",
                    "object": "chat.completion.chunk" if call.stream else "chat.completion",
                    "usage": {
                        "completion_tokens": gen,
                        "prompt_tokens": prompt,
                        "total_tokens": prompt + gen,
                        "prompt_tokens_details": {"cached_tokens": cache_n},
                    },
                    "timings": timings,
                }
                if error is not None:  # cut short: no usage, no timings
                    del merged["usage"], merged["timings"]
                chunks = gen + 3 if call.stream else None
                resp_bytes = (chunks or 1) * 190 + 600
                response = {
                    "status": status,
                    "headers": {
                        "content-type": "text/event-stream"
                        if call.stream and status == 200
                        else "application/json",
                        "transfer-encoding": "chunked",
                    },
                    "stream": "sse" if call.stream and status == 200 else None,
                    "chunks": chunks if status == 200 else None,
                    "bad_chunks": 0 if call.stream and status == 200 else None,
                    "body_bytes": resp_bytes if status == 200 else 161,
                    "truncated": False,
                    "body": None,
                    "body_text": None,
                    "digest": OpenAIChat().response_digest(merged) if status == 200 else None,
                }
                request = request_part(call, digest, body_bytes)
            rec = {
                "v": 1,
                "id": rid,
                "conn": call.conn,
                "t_start_ms": t_start,
                "t_first_byte_ms": t_first,
                "t_end_ms": t_end,
                "request": request,
                "response": response,
                "error": error,
                "tokens": None,
            }
            heapq.heappush(pending, (t_end, rid, record_dumps(rec) + b"\n"))
            heapq.heappush(queue, (t_end + call.think_ms, who))
        flush(1 << 62)
    os.replace(tmp, path)
    st.chat = n_chat
    st.t_span_h = (heapq.nsmallest(1, queue)[0][0] - T0) / 3_600_000
    st.gen_seconds = time.perf_counter() - t_begin
    return st


def cut_prefix(src: Path, dst: Path, size: int) -> int:
    """Copy the first lines of src, about size bytes, to dst; records copied."""
    n = 0
    done = 0
    with open(src, "rb") as f, open(dst, "wb", buffering=1 << 20) as out:
        for line in f:
            if done >= size:
                break
            out.write(line)
            done += len(line)
            n += 1
    return n


# ============================================================ measurement


@dataclass
class Sample:
    wall: float
    user: float
    sys: float
    maxrss_kb: int
    curve_kb: list[int] = field(default_factory=list)  # RSS at 10 %, 20 % ... of the run

    @property
    def cpu(self) -> float:
        return self.user + self.sys


# The children are started by a small launcher process, not by this one: on
# Linux a child's peak RSS (ru_maxrss) starts from the RSS of the process it
# was forked from, and this one holds the generator's state.  The launcher
# is a bare Python (~10 MB, below anything it measures), spawns the command
# with stdout on /dev/null, polls its RSS from /proc, and reports the
# command's own wait4() figures.
LAUNCH_SRC = """\
import json, os, sys, threading, time
argv = sys.argv[1:]
null = os.open(os.devnull, os.O_WRONLY)
samples = []
t0 = time.perf_counter()
pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, null, 1)])
stop = threading.Event()
def watch():
    while not stop.is_set():
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        samples.append((time.perf_counter() - t0, int(line.split()[1])))
                        break
        except OSError:
            pass
        stop.wait(0.02)
th = threading.Thread(target=watch, daemon=True)
th.start()
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
stop.set()
th.join()
print(json.dumps({"status": os.waitstatus_to_exitcode(status), "wall": wall,
    "user": ru.ru_utime, "sys": ru.ru_stime, "maxrss_kb": ru.ru_maxrss, "samples": samples}))
"""


def run_child(argv: Sequence[str], launcher: str = LAUNCH_SRC) -> Sample:
    """Run argv with stdout to /dev/null: its wall and CPU time and peak RSS."""
    err_path = OUT_DIR / "child-stderr.txt"
    with open(err_path, "wb") as err:
        out = subprocess.run(
            [sys.executable, "-c", launcher, *argv], stdout=subprocess.PIPE, stderr=err
        )
    try:
        res = json.loads(out.stdout)
    except ValueError:
        res = {"status": out.returncode}
    if out.returncode != 0 or res["status"] != 0:
        msg = err_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(argv)} failed ({res['status']}):\n{msg}")
    wall = res["wall"]
    samples: list[tuple[float, int]] = res["samples"]
    curve: list[int] = []
    for k in range(1, 11):
        below = [kb for ts, kb in samples if ts <= wall * k / 10]
        curve.append(max(below) if below else 0)
    return Sample(wall, res["user"], res["sys"], res["maxrss_kb"], curve)


def parse_argv(path: Path) -> list[str]:
    return [sys.executable, "-c", PARSE_SRC, str(path)]


def analyze_argv(path: Path) -> list[str]:
    return [str(LLMP), "analyze", "--json", str(path)]


def warm(path: Path) -> None:
    """Read the file once so every run finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:9]]  # guest time is in user already
    idle = parts[3] + parts[4]
    return (sum(parts) - idle) / os.sysconf("SC_CLK_TCK")


# ============================================================ report


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def best(samples: list[Sample], attr: str) -> float:
    return min(float(getattr(s, attr)) for s in samples)


def machine_info() -> list[str]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import llmp

    fnv = "fnv-c" if _has_fnv_c() else "pure-Python FNV"
    return [
        f"code: {git_state()}",
        f"machine: {os.cpu_count()} cores ({model or platform.machine()}), "
        f"load average {os.getloadavg()[0]:.1f} at start",
        f"Python {platform.python_version()} ({sys.executable}), orjson {orjson.__version__}, "
        f"llmp {getattr(llmp, '__version__', '?')} ({fnv})",
    ]


def git_state() -> str:
    """The commit measured, and whether the analyzer's code differs from it.

    Named from the `llmp` package this process imports (as the `llmp` it runs
    does, `PYTHONPATH` first), not from this bench's own checkout: a tree given by
    `PYTHONPATH` is what is measured."""
    import llmp

    pkg = Path(llmp.__file__).resolve().parent
    try:
        top = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        head = subprocess.run(
            ["git", "-C", top, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", top, "status", "--porcelain", "--", str(pkg)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return f"llmp from {pkg} (not a git checkout)"
    where = "" if Path(top).resolve() == REPO_DIR.resolve() else f" in {top}"
    if not changed:
        return f"llmp at {head}{where}"
    return f"llmp at {head}{where} + {len(changed)} uncommitted files under {pkg.name}"


def _has_fnv_c() -> bool:
    try:
        import fnv_c  # noqa: F401
    except Exception:
        return False
    return True


def load_or_generate(path: Path, size_mb: int, seed: int, regenerate: bool) -> GenStats:
    """The recording's statistics, generating it first when needed."""
    meta_path = path.with_name(path.name + ".meta.json")
    if regenerate or not path.exists():
        print(f"generating {path} ({size_mb} MB) ...", flush=True)
        st = generate(path, size_mb * 1_000_000, seed)
        meta_path.write_text(json.dumps(asdict(st), indent=1))
        print(f"  generated in {st.gen_seconds:.1f} s")
        return st
    if meta_path.exists():
        return GenStats(**json.loads(meta_path.read_text()))
    st = GenStats()  # someone else's recording: what a line count can tell
    with open(path, "rb") as f:
        for line in f:
            st.records += 1
            st.bytes += len(line)
    return st


def describe(path: Path, st: GenStats) -> None:
    size = path.stat().st_size
    print(f"recording: {path}")
    print(
        f"  {mb(size)}, {st.records:,} records, "
        f"mean {size / max(1, st.records) / 1000:.1f} KB per record"
    )
    if not st.chat:
        return
    hist = ", ".join(f"{k}: {v:,}" for k, v in st.msgs_hist.items())
    print(
        f"  {st.chat:,} chat requests ({st.side_calls:,} of them one-off side-calls), "
        f"{st.not_chat:,} not chat, {st.errors:,} errors; "
        f"{st.out_of_order:,} lines written before a smaller id"
    )
    print(f"  messages per chat request: mean {st.msgs_total / st.chat:.0f}, max {st.msgs_max}")
    print(f"    ({hist})")
    print(
        f"  {len(st.user_agents)} user-agents, {st.t_span_h:.0f} h of traffic; "
        f"request digests checked against request_digest(): {st.checked}"
    )


def prefixes(
    path: Path, st: GenStats, fractions: list[float], regenerate: bool
) -> list[tuple[float, Path, int]]:
    """(fraction, file, records) for each size measured; the prefixes are cached."""
    size = path.stat().st_size
    files: list[tuple[float, Path, int]] = []
    for frac in fractions:
        if frac >= 1.0:
            files.append((1.0, path, st.records))
            continue
        part = OUT_DIR / f"{path.stem}.part{round(frac * 100)}.jsonl"
        count = part.with_name(part.name + ".n")
        if regenerate or not part.exists() or not count.exists():
            count.write_text(str(cut_prefix(path, part, int(size * frac))))
        files.append((frac, part, int(count.read_text())))
    return files


def sanity(path: Path) -> None:
    """One untimed run that keeps the report: what the analyzer made of the traffic."""
    report_path = OUT_DIR / "analyzer-report.json"
    with open(report_path, "wb") as out:
        subprocess.run(analyze_argv(path), stdout=out, check=True)
    rep = orjson.loads(report_path.read_bytes())
    cov, tm = rep["coverage"], rep["time"]
    kinds: dict[str, int] = {}
    causes: dict[str, int] = {}
    for r in rep["rows"]:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        c = r["cause"] or r["break_cause"]
        if c:
            causes[c] = causes.get(c, 0) + 1
    prefill = (tm["prefill_ms"] or {}).get("value") or 0
    lost = (tm["lost_ms"] or {}).get("value") or 0
    print(f"the analyzer's report on {path.name} (kept in {report_path}):")
    print(
        f"  {len(rep['rows']):,} rows {kinds}, {cov['conversations']:,} conversations, "
        f"bad lines {cov['bad_lines']}; turns with a loss by cause {causes}"
    )
    print(f"  clients {[c['client'] for c in rep['clients']]}")
    print(
        f"  {len(rep['findings'])} findings {sorted({f['kind'] for f in rep['findings']})}; "
        f"prefill {prefill / 3.6e6:,.1f} h, lost {lost / 3.6e6:,.1f} h"
    )


def startup() -> tuple[Sample, Sample]:
    """The fixed cost of each command: on an empty file, best of 3."""
    empty = OUT_DIR / "empty.jsonl"
    empty.write_bytes(b"")
    runs = [(run_child(parse_argv(empty)), run_child(analyze_argv(empty))) for _ in range(3)]
    parse = min((r[0] for r in runs), key=lambda s: s.cpu)
    analyze = min((r[1] for r in runs), key=lambda s: s.cpu)
    floor = run_child(["/bin/true"]).maxrss_kb / 1024
    print(
        f"startup (empty file, best of 3): bare parse {parse.cpu:.2f} s CPU, "
        f"{parse.maxrss_kb / 1024:.0f} MB; llmp analyze --json {analyze.cpu:.2f} s CPU, "
        f"{analyze.maxrss_kb / 1024:.0f} MB (the launcher's floor: {floor:.0f} MB)"
    )
    return parse, analyze


Results = dict[float, dict[str, list[Sample]]]


def measure(files: list[tuple[float, Path, int]], repeat: int) -> tuple[Results, float]:
    """Every run, and the share of the machine's CPU other processes took meanwhile."""
    results: Results = {}
    busy0, ours0, t0 = busy_seconds(), os.times(), time.perf_counter()
    for frac, fpath, _ in files:
        warm(fpath)
        res = results[frac] = {"parse": [], "analyze": []}
        for i in range(repeat):
            order = ("parse", "analyze") if i % 2 == 0 else ("analyze", "parse")
            for what in order:
                res[what].append(
                    run_child(parse_argv(fpath) if what == "parse" else analyze_argv(fpath))
                )
            print(f"  {fpath.name}: run {i + 1}/{repeat} done", flush=True)
    phase, busy1, ours1 = time.perf_counter() - t0, busy_seconds(), os.times()
    ours = sum(ours1[:4]) - sum(ours0[:4])  # this process and its waited-for children
    other = max(0.0, busy1 - busy0 - ours) / (phase * (os.cpu_count() or 1))
    return results, other


def peak_mb(samples: list[Sample]) -> float:
    return max(s.maxrss_kb for s in samples) / 1024


def table(files: list[tuple[float, Path, int]], results: Results, repeat: int) -> None:
    print()
    print(
        f"{'file':>9} {'records':>8} | {'bare orjson parse':^26} | {'llmp analyze --json':^26} |"
        f" {'speed ratio':^11} | {'peak RSS':^17}"
    )
    print(
        f"{'':>9} {'':>8} | {'CPU s':>7} {'wall s':>7} {'MB/s':>8}  | {'CPU s':>7} {'wall s':>7} "
        f"{'MB/s':>8}  | {'CPU':>5} {'wall':>5} | {'parse':>7} {'analyze':>8}"
    )
    for frac, fpath, n in files:
        size_mb = fpath.stat().st_size / 1e6
        p, a = results[frac]["parse"], results[frac]["analyze"]
        pc, pw, ac, aw = best(p, "cpu"), best(p, "wall"), best(a, "cpu"), best(a, "wall")
        print(
            f"{mb(size_mb * 1e6):>9} {n:>8,} | {pc:7.2f} {pw:7.2f} {size_mb / pc:8.0f}  | "
            f"{ac:7.2f} {aw:7.2f} {size_mb / ac:8.0f}  | {pc / ac:5.2f} {pw / aw:5.2f} | "
            f"{peak_mb(p):5.0f}MB {peak_mb(a):6.0f}MB"
        )
    print(
        f"(best of {repeat}, each run a fresh process; speed ratio = parse time / analyze time; "
        f"peak RSS = the largest of the runs, from wait4)"
    )
    print("analyze's RSS over each run, MB at 10 %, 20 % ... 100 % of its time (largest run):")
    for frac, fpath, _ in files:
        curve = max(results[frac]["analyze"], key=lambda s: s.maxrss_kb).curve_kb
        print(f"  {mb(fpath.stat().st_size):>9}: " + " ".join(f"{kb / 1024:4.0f}" for kb in curve))


SPEED_FLOOR = 0.6
"""Issue 14: the speed ratio to land; `SPEED_GOAL` is the one aimed at."""
SPEED_GOAL = 1.0


def verdicts(
    files: list[tuple[float, Path, int]], results: Results, empty_rss_kb: int
) -> dict[str, Any]:
    """Print and return the verdict for both targets (speed: issue 14; memory: issue 3)."""
    full = results[1.0]
    path = files[-1][1]
    pc, ac = best(full["parse"], "cpu"), best(full["analyze"], "cpu")
    pw, aw = best(full["parse"], "wall"), best(full["analyze"], "wall")
    ratio = pc / ac
    speed_ok = ratio >= SPEED_FLOOR
    print()
    print(
        f"target 1, analyze at >= {SPEED_FLOOR}x the bare parse's speed (goal {SPEED_GOAL}x): "
        f"{ratio:.2f}x by CPU time ({pw / aw:.2f}x by wall time) on "
        f"{mb(path.stat().st_size)} -> {'MET' if speed_ok else 'MISSED'}"
        f"{', goal met' if ratio >= SPEED_GOAL else ''}"
    )
    # Memory: the peak above what an empty run needs (the imports), per size.
    # If it were proportional to the file, it would grow by the file's ratio
    # between the two largest sizes; bounded means it stops growing.
    base = empty_rss_kb / 1024
    data = [(p.stat().st_size, n, peak_mb(results[f]["analyze"]) - base) for f, p, n in files]
    print(
        "target 2, peak memory bounded, not growing with the file: peak RSS above an empty "
        f"run's {base:.0f} MB: " + ", ".join(f"{d:.1f} MB at {mb(size)}" for size, _, d in data)
    )
    verdict = "MISSED"
    if len(data) < 2:
        verdict = "NOT SHOWN: give at least two sizes (--fractions)"
    else:
        (s0, n0, d0), (s1, n1, d1) = data[-2], data[-1]
        grew = d1 - d0
        per_k = grew * 1024 / max(1, n1 - n0) * 1000
        linear = d0 * (s1 / s0 - 1)  # what a footprint proportional to the file would add
        share = grew / linear if linear > 0 else 0.0
        print(
            f"  from {mb(s0)} to {mb(s1)} ({n1 - n0:+,} records) it grew by {grew:+.1f} MB "
            f"({per_k:+.0f} KB per 1000 records), {share:.0%} of a growth linear in the file"
        )
        if grew <= 0.5:  # within the noise of ru_maxrss between runs
            verdict = "MET: flat between the two largest sizes"
        elif share <= 0.25:
            verdict = (
                f"MET IN PRACTICE: bounded up to a residual growth of {per_k:.0f} KB per 1000 "
                "records"
            )
        elif s1 >= 1e9:
            verdict = "MISSED: it grows with the file"
        else:
            verdict = "NOT SHOWN at this size: it still grows; the bound shows on larger files"
    print(f"  -> {verdict}")
    return {
        "speed_ratio_cpu": ratio,
        "speed_ratio_wall": pw / aw,
        "speed_met": speed_ok,
        "rss_above_empty_mb": [[size, n, d] for size, n, d in data],
        "memory": verdict,
    }


# ============================================================ --jobs (issue 14)


def proxy_files(src: Path, n: int) -> list[Path]:
    """The recording as `n` proxies' files, one after the other (cached beside it).

    Ids are cut into `n` ranges, each renumbered from 1 as a proxy process
    numbers its records: `n` sessions, one per file (R16, R17).
    """
    dsts = [OUT_DIR / f"{src.stem}.proxy{k + 1}of{n}.jsonl" for k in range(n)]
    if all(d.exists() and d.stat().st_mtime >= src.stat().st_mtime for d in dsts):
        return dsts
    with open(src, "rb") as f:
        total = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
    per = -(-total // n)
    id_re = re.compile(rb'\{"v":1,"id":(\d+),')
    outs = [open(d, "wb", buffering=1 << 20) for d in dsts]
    try:
        with open(src, "rb") as f:
            for line in f:
                m = id_re.match(line)
                assert m is not None, "a line not written the recorder's way"
                rid = int(m.group(1))
                k = min((rid - 1) // per, n - 1)
                outs[k].write(b'{"v":1,"id":%d,' % (rid - k * per) + line[m.end() :])
    finally:
        for out in outs:
            out.close()
    return dsts


# The launcher for `--jobs`: worker processes are not the command's children (a
# forkserver's), so wait4() on the command leaves them out.  As a child subreaper
# (Linux prctl), the launcher inherits whatever the command leaves behind, reaps
# it, and adds its CPU time: the whole tree's.
TREE_LAUNCH_SRC = LAUNCH_SRC.replace(
    "argv = sys.argv[1:]\n",
    "argv = sys.argv[1:]\nimport ctypes\nctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n",
).replace(
    "wall = time.perf_counter() - t0\n",
    "wall = time.perf_counter() - t0\n"
    "class _Sum:\n"
    "    ru_utime = ru.ru_utime\n"
    "    ru_stime = ru.ru_stime\n"
    "    ru_maxrss = ru.ru_maxrss\n"
    "while True:\n"
    "    try:\n"
    "        _, _, r = os.wait4(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "    _Sum.ru_utime += r.ru_utime\n"
    "    _Sum.ru_stime += r.ru_stime\n"
    "ru = _Sum\n",
)
assert TREE_LAUNCH_SRC.count("prctl") == 1 and TREE_LAUNCH_SRC.count("ru = _Sum") == 1


def jobs_figure(src: Path, jobs: int, repeat: int, n_files: int = 4) -> dict[str, Any]:
    """`llmp analyze --json --jobs 1` and `--jobs N` on the recording cut into proxies'
    files, alternated: wall and CPU time (the workers' included), and whether the two
    reports are the same bytes."""
    paths = proxy_files(src, n_files)
    for p in paths:
        warm(p)

    def argv(j: int) -> list[str]:
        return [str(LLMP), "analyze", "--json", "--jobs", str(j), *map(str, paths)]

    reports = []
    for j in (1, jobs):
        out = OUT_DIR / f"jobs{j}-report.json"
        with open(out, "wb") as f:
            subprocess.run(argv(j), stdout=f, check=True)
        reports.append(out.read_bytes())
    same = reports[0] == reports[1]
    runs: dict[int, list[tuple[Sample, float]]] = {1: [], jobs: []}
    for r in range(repeat):
        for j in (1, jobs) if r % 2 == 0 else (jobs, 1):
            busy0, wall0 = busy_seconds(), time.perf_counter()
            s = run_child(argv(j), TREE_LAUNCH_SRC)
            busy = busy_seconds() - busy0
            wall = time.perf_counter() - wall0
            cores = os.cpu_count() or 1
            runs[j].append((s, max(0.0, busy - s.cpu) / (wall * cores)))
    size = sum(p.stat().st_size for p in paths)
    print(f"\n--jobs: {mb(size)} as {n_files} proxies' files, one session each, {repeat} runs each")
    print(f"{'':>10} {'wall s':>8} {'CPU s':>8} {'peak MB':>8} {'MB/s':>7}  other load")
    for j, samples in runs.items():
        w = min(s.wall for s, _ in samples)
        c = min(s.cpu for s, _ in samples)
        rss = max(s.maxrss_kb for s, _ in samples) / 1024
        other = max(o for _, o in samples)
        print(
            f"{'--jobs ' + str(j):>10} {w:8.2f} {c:8.2f} {rss:8.0f} {size / w / 1e6:7.0f}"
            f"  {other * 100:.0f} %"
        )
    w1 = min(s.wall for s, _ in runs[1])
    wn = min(s.wall for s, _ in runs[jobs])
    print(f"--jobs {jobs}: {w1 / wn:.2f}x the wall speed of --jobs 1; reports the same: {same}")
    return {
        "files": [str(p) for p in paths],
        "same": same,
        "runs": {str(j): [{**asdict(s), "other": o} for s, o in v] for j, v in runs.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--size-mb", type=int, default=1024, help="recording size (default 1024)")
    ap.add_argument("--quick", action="store_true", help="~100 MB and 2 repeats: a smoke run")
    ap.add_argument("--file", type=Path, help="the recording to use (generated there if absent)")
    ap.add_argument("--repeat", type=int, help="runs per measurement, best kept (default 3)")
    ap.add_argument(
        "--fractions",
        default="0.25,0.5,0.75,1",
        help="prefixes of the file to measure, for the memory target (default 0.25,0.5,0.75,1)",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--regenerate", action="store_true", help="ignore a cached recording")
    ap.add_argument("--json", type=Path, help="also write the raw samples here")
    ap.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="only the --jobs figure: --jobs 1 against --jobs N on the recording cut into "
        "4 proxies' files",
    )
    args = ap.parse_args(argv)
    size_mb = 100 if args.quick and args.size_mb == 1024 else args.size_mb
    repeat = args.repeat or (2 if args.quick else 3)
    fractions = sorted({float(x) for x in args.fractions.split(",") if 0 < float(x) < 1})
    fractions.append(1.0)
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    print("\n".join(machine_info()))
    if not LLMP.exists():
        print(f"no {LLMP}: install llmp into this venv (pip install -e .)", file=sys.stderr)
        return 2
    path = args.file or OUT_DIR / f"analyzer-v{GEN_VERSION}-{size_mb}MB-s{args.seed}.jsonl"
    st = load_or_generate(path, size_mb, args.seed, args.regenerate)
    describe(path, st)
    if args.jobs is not None:
        figure = jobs_figure(path, args.jobs, repeat)
        if args.json:
            args.json.write_text(json.dumps(figure, indent=1))
        return 0 if figure["same"] else 1
    files = prefixes(path, st, fractions, args.regenerate)
    sanity(files[0][1])
    start = startup()
    results, other = measure(files, repeat)
    table(files, results, repeat)
    print(
        f"other processes used {other * 100:.0f} % of the machine's CPU during the runs "
        f"(load average now {os.getloadavg()[0]:.1f})"
        + ("; wall times are disturbed, CPU times are the figure to read" if other > 0.05 else "")
    )
    verdict = verdicts(files, results, start[1].maxrss_kb)
    if args.json:
        raw = {
            "file": str(path),
            "gen": asdict(st),
            "files": [(frac, str(p), n) for frac, p, n in files],
            "other_cpu_share": other,
            "startup": {"parse": asdict(start[0]), "analyze": asdict(start[1])},
            "runs": {
                str(frac): {k: [asdict(s) for s in v] for k, v in res.items()}
                for frac, res in results.items()
            },
            "verdict": verdict,
        }
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
