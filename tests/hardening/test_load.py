"""Load: 32 concurrent streamed chats through one real mitmdump, for a bounded run.

Mixed SSE (llama-server flavor, through the ``openai`` SDK and raw ``httpx``) and
NDJSON (Ollama flavor, through the ``ollama`` SDK and raw ``httpx``), with tool
calls and reasoning, in full body mode so that every record can be compared
with what its client assembled. One mitmdump in regular (forward) proxy mode
serves both upstreams.

Every request carries a unique tag in its last user message; records and
upstream exchanges are matched to requests by that tag, so a lost, doubled or
mixed-up record is found, not just counted.

The run lasts ``LLMP_LOAD_SECONDS`` seconds (default 60). The proxy's RSS is
sampled every half second; the figures are printed (run with ``-s``) and are
written down in docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from llmp.analysis.config import Config as AnalysisConfig
from tests.support.hardening import (
    TOOLS,
    Reply,
    RssSampler,
    load_seconds,
    reply_from_ndjson,
    reply_from_record,
    reply_from_sse,
    whole_lines,
)
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.upstreams import Exchange, Upstream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKERS = 32
KINDS = ("openai", "ollama", "httpx_sse", "httpx_ndjson")
TAG_RE = re.compile(r"L\d{2}x\d{5}[a-z]{6}")
#: Allowed RSS growth of the proxy between the first and the last third of the run.
RSS_GROWTH_PCT = 20.0


@dataclass
class Done:
    """One finished request, as its client saw it."""

    tag: str
    kind: str
    tool: bool
    reply: Reply
    raw: bytes | None  # the bytes httpx received (raw clients only)


def _plan(rng: random.Random, tag: str) -> tuple[list[dict[str, Any]], bool, str]:
    """Messages, whether tools are offered, and the x-fake modes for one request."""
    tool = rng.random() < 0.3
    delay = rng.choice([0, 2, 5, 10])
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a load-test assistant."},
        {"role": "user", "content": "earlier question"},
        {"role": "assistant", "content": "earlier answer"},
    ]
    if tool:
        history.append({"role": "user", "content": f"{tag}: what is the weather in Tokyo?"})
        return history, True, f"delay_ms={delay}"
    events = rng.randint(3, 60)
    width = rng.choice([0, 8, 24])
    history.append({"role": "user", "content": f"{tag}: tell me something"})
    return history, False, f"events={events},token_chars={width},delay_ms={delay}"


def _openai(proxy: str, base: str, messages: list[Any], tool: bool, fake: str) -> Reply:
    with openai.DefaultHttpxClient(proxy=proxy, trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, http_client=http)
        extra: dict[str, Any] = {"tools": TOOLS} if tool else {}
        stream = client.chat.completions.create(
            model="smol",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-fake": fake},
            **extra,
        )
        reply = Reply()
        tools: dict[int, list[Any]] = {}
        for chunk in stream:
            reply.rid = chunk.id
            if chunk.usage is not None:
                reply.counters["usage"] = chunk.usage.model_dump(exclude_none=True)
            for choice in chunk.choices:
                d = choice.delta
                reply.content += d.content or ""
                reply.reasoning += (d.model_extra or {}).get("reasoning_content") or ""
                for tc in d.tool_calls or []:
                    slot = tools.setdefault(tc.index, [None, None, ""])
                    slot[0] = slot[0] or tc.id
                    if tc.function is not None:
                        slot[1] = slot[1] or tc.function.name
                        slot[2] += tc.function.arguments or ""
                if choice.finish_reason:
                    reply.finish = choice.finish_reason
        reply.tools = [(a, b, c) for _, (a, b, c) in sorted(tools.items())]
        return reply


def _ollama(proxy: str, base: str, messages: list[Any], tool: bool, fake: str) -> Reply:
    reply = Reply()
    with ollama.Client(host=base, proxy=proxy, trust_env=False, headers={"x-fake": fake}) as client:
        for part in client.chat(
            model="qwen3", messages=messages, tools=TOOLS if tool else None, stream=True, think=True
        ):
            reply.content += part.message.content or ""
            reply.reasoning += part.message.thinking or ""
            for tc in part.message.tool_calls or []:
                args = json.dumps(dict(tc.function.arguments), sort_keys=True)
                reply.tools.append((None, tc.function.name, args))
            if part.done:
                reply.finish = part.done_reason
                reply.counters = {
                    "prompt_eval_count": part.prompt_eval_count,
                    "eval_count": part.eval_count,
                    "eval_duration": part.eval_duration,
                }
    return reply


def _raw(client: httpx.Client, url: str, body: dict[str, Any], fake: str) -> tuple[bytes, Reply]:
    with client.stream("POST", url, json=body, headers={"x-fake": fake}) as resp:
        resp.raise_for_status()
        raw = b"".join(resp.iter_raw())
    if url.endswith("/api/chat"):
        return raw, reply_from_ndjson(raw)
    return raw, reply_from_sse(raw)


def _worker(
    w: int,
    proxy: str,
    llama: Upstream,
    oll: Upstream,
    deadline: float,
    done: list[Done],
    errors: list[str],
    lock: threading.Lock,
) -> None:
    rng = random.Random(f"load-{w}")
    kind = KINDS[w % len(KINDS)]
    # Half the raw workers keep one connection, the other half open one per request.
    keep = w % 8 < 4
    shared = httpx.Client(proxy=proxy, trust_env=False, timeout=60) if keep else None
    i = 0
    try:
        while time.monotonic() < deadline:
            tag = f"L{w:02d}x{i:05d}" + "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)
            )
            i += 1
            messages, tool, fake = _plan(rng, tag)
            raw: bytes | None = None
            try:
                if kind == "openai":
                    reply = _openai(proxy, llama.url, messages, tool, fake)
                elif kind == "ollama":
                    reply = _ollama(proxy, oll.url, messages, tool, fake)
                else:
                    client = shared or httpx.Client(proxy=proxy, trust_env=False, timeout=60)
                    try:
                        if kind == "httpx_sse":
                            body = {"model": "m", "stream": True, "messages": messages}
                            if tool:
                                body["tools"] = TOOLS
                            url = llama.url + "/v1/chat/completions"
                        else:
                            body = {"model": "qwen3", "messages": messages, "think": True}
                            if tool:
                                body["tools"] = TOOLS
                            url = oll.url + "/api/chat"
                        raw, reply = _raw(client, url, body, fake)
                    finally:
                        if shared is None:
                            client.close()
            except Exception:
                with lock:
                    errors.append(f"{tag} ({kind}): {traceback.format_exc()}")
                continue
            with lock:
                done.append(Done(tag, kind, tool, reply, raw))
    finally:
        if shared is not None:
            shared.close()


def _tag_of(text: bytes | str) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    tags = set(TAG_RE.findall(text))
    assert len(tags) == 1, f"expected one tag in {text[:300]!r}"
    return tags.pop()


def _events(ex: Exchange, stream: str) -> int:
    if stream == "ndjson":
        return len(ex.ndjson_lines())
    return len([d for d in ex.sse_data() if d != "[DONE]"])


#: A second addon, for the test only: every 2 s, after a full collection, it logs
#: the proxy's live Python objects by type, the recorder's in-flight captures and
#: its client connections, as one JSON line.
CENSUS_ADDON = """
import asyncio, gc, json, logging
from collections import Counter
from mitmproxy import ctx

class Census:
    def running(self):
        self.task = asyncio.get_running_loop().create_task(self.loop())

    async def loop(self):
        while True:
            await asyncio.sleep(2)
            logging.info("llmp-census %s", json.dumps(self.census()))

    def census(self):
        # A function of its own: the list of every object must not outlive it, or
        # each census would keep the previous one (and all it saw) alive.
        rec = ctx.master.addons.get("recorder")
        gc.collect()
        objects = gc.get_objects()
        types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
        total = len(objects)
        del objects
        return {
            "objects": total,
            "inflight": len(getattr(rec, "_inflight", ())),
            "conns": len(getattr(rec, "_conns", ())),
            "types": {k: v for k, v in types.items() if v >= 20},
        }

addons = [Census()]
"""
CENSUS_RE = re.compile(r"llmp-census (\{.*\})")
#: Objects the proxy keeps one of per exchange *by design*, up to a fixed number:
#: the live view's engine remembers the last ``between_window`` rows (what ran in
#: between two turns of a conversation).
BOUNDED = {"llmp.analysis.linking.RingEntry": AnalysisConfig().between_window}


def _census(proxy: Mitmdump, after: int = 0, timeout: float = 10) -> dict[str, Any]:
    """The first census logged after the ``after``-th one."""
    deadline = time.monotonic() + timeout
    while True:
        lines = CENSUS_RE.findall(proxy.log_text())
        if len(lines) > after:
            census: dict[str, Any] = json.loads(lines[after])
            return census
        if time.monotonic() > deadline:
            raise TimeoutError("no census line from the proxy")
        time.sleep(0.2)


def _growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Live objects gained per type between two censuses (types of 20 or more)."""
    b, a = before["types"], after["types"]
    return {t: a.get(t, 0) - b.get(t, 0) for t in set(a) | set(b) if a.get(t, 0) != b.get(t, 0)}


def _warm_up(proxy: str, llama: Upstream, oll: Upstream) -> None:
    """One exchange of each kind, so that lazy imports and caches exist before the baseline."""
    rng = random.Random("warm-up")
    for i, kind in enumerate(KINDS * 2):
        messages, tool, fake = _plan(rng, f"W{i:02d}x00000warmup")
        if kind == "openai":
            _openai(proxy, llama.url, messages, tool, fake)
        elif kind == "ollama":
            _ollama(proxy, oll.url, messages, tool, fake)
        else:
            url = (
                llama.url + "/v1/chat/completions" if kind == "httpx_sse" else oll.url + "/api/chat"
            )
            with httpx.Client(proxy=proxy, trust_env=False, timeout=60) as client:
                _raw(client, url, {"model": "m", "stream": True, "messages": messages}, fake)


def test_32_concurrent_streams_one_record_each_and_flat_memory(tmp_path: Path) -> None:
    seconds = load_seconds(60.0)
    rec_path = tmp_path / "load.jsonl"
    census = tmp_path / "census.py"
    census.write_text(CENSUS_ADDON)
    done: list[Done] = []
    errors: list[str] = []
    lock = threading.Lock()
    with (
        Upstream("llama") as llama,
        Upstream("ollama") as oll,
        Mitmdump(
            None, rec_path, {"llmp_body": "full"}, mode="regular", extra_args=["-s", str(census)]
        ) as proxy,
    ):
        _warm_up(proxy.url, llama, oll)
        warm = len(llama.log) + len(oll.log)
        wait_for_records(rec_path, warm, timeout=30)
        n_census = len(CENSUS_RE.findall(proxy.log_text()))
        before = _census(proxy, n_census, timeout=10)
        sampler = RssSampler(proxy.pid, 0.5).start()
        t0 = time.monotonic()
        deadline = t0 + seconds
        threads = [
            threading.Thread(
                target=_worker,
                args=(w, proxy.url, llama, oll, deadline, done, errors, lock),
                name=f"load-{w}",
            )
            for w in range(WORKERS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 120)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a load worker hung"
        sampler.stop()
        wait_for_records(rec_path, warm + len(done), timeout=60)
        n_census = len(CENSUS_RE.findall(proxy.log_text()))
        after = _census(proxy, n_census + 1, timeout=15)  # a whole census period later
        upstream_log = list(llama.log) + list(oll.log)
        proxy.stop()
        assert proxy.returncode == 0, proxy.log_text()[-3000:]

    assert errors == [], f"{len(errors)} client errors, first: {errors[0]}"
    records = whole_lines(rec_path)
    records = [
        r for r in records if "warmup" not in r["request"]["body"]["messages"][-1]["content"]
    ]
    upstream_log = [e for e in upstream_log if b"warmup" not in e.request_body]
    n = len(done)
    kinds = Counter(d.kind for d in done)
    mem = sampler.summary()
    print(
        f"\nload: {seconds:.0f} s, {WORKERS} workers, {n} exchanges "
        f"({n / elapsed:.1f}/s; {dict(kinds)}; "
        f"{sum(d.tool for d in done)} with tool calls), {len(records)} records, "
        f"recording {rec_path.stat().st_size / 1e6:.1f} MB"
    )
    print(
        "load: proxy RSS MiB: start {start_mib:.1f}, first third median "
        "{first_third_median_mib:.1f}, last third median {last_third_median_mib:.1f}, "
        "peak {peak_mib:.1f}; growth {growth_mib:+.1f} MiB ({growth_pct:+.1f}%), "
        "{samples:.0f} samples".format(**mem)
    )
    series = [kb for _, kb in sampler.samples]
    step = max(1, len(series) // 12)
    print("load: RSS MiB over the run: " + " ".join(f"{kb / 1024:.1f}" for kb in series[::step]))
    growth = _growth(before, after)
    bounded = sum(growth.get(t, 0) for t in BOUNDED)
    top = sorted(growth.items(), key=lambda kv: -kv[1])[:4]
    print(
        f"load: live objects in the proxy, idle: {before['objects']} before, "
        f"{after['objects']} after ({after['objects'] - before['objects']:+d}, of which "
        f"{bounded:+d} in bounded rings); in flight after: {after['inflight']}, "
        f"connections: {after['conns']}; most grown: {top}"
    )
    assert n >= WORKERS * 5, f"only {n} exchanges in {seconds} s"

    # Exactly one record per exchange: ids 1..n, one record per tag, nothing else.
    assert sorted(r["id"] for r in records) == list(range(warm + 1, warm + n + 1))
    by_tag: dict[str, dict[str, Any]] = {}
    for rec in records:
        body = rec["request"]["body"]
        tag = _tag_of(body["messages"][-1]["content"])
        assert tag not in by_tag, f"two records for {tag}"
        by_tag[tag] = rec
    assert set(by_tag) == {d.tag for d in done}
    exchanges: dict[str, Exchange] = {}
    for ex in upstream_log:
        tag = _tag_of(ex.request_body)
        assert tag not in exchanges, f"upstream saw {tag} twice"
        exchanges[tag] = ex
    assert set(exchanges) == set(by_tag)

    # None mixed up: every record holds what its own client assembled.
    conns: set[int] = set()
    for d in done:
        rec, ex = by_tag[d.tag], exchanges[d.tag]
        resp = rec["response"]
        stream = "ndjson" if d.kind in ("ollama", "httpx_ndjson") else "sse"
        # (the sync openai SDK hangs up right after "[DONE]", maybe before the chunked
        # terminator: that is no client_disconnected, see test_hardening_faults.py)
        assert rec["error"] is None, (d.kind, rec)
        assert resp["status"] == 200 and resp["stream"] == stream and not resp["truncated"]
        assert resp["body_bytes"] == len(ex.body)
        assert resp["chunks"] == _events(ex, stream) and resp["bad_chunks"] == 0
        assert rec["request"]["body"] == json.loads(ex.request_body)
        assert rec["t_start_ms"] <= rec["t_first_byte_ms"] <= rec["t_end_ms"]
        conns.add(rec["conn"])
        got = reply_from_record(rec)
        want = d.reply
        if d.kind == "ollama":  # the SDK's model drops tool call ids
            got.tools = [(None, name, args) for _, name, args in got.tools]
        assert got == want, f"{d.tag} ({d.kind}): record {got} != client {want}"
        assert bool(want.tools) is d.tool
        assert want.reasoning, d.tag
        if d.raw is not None:
            assert d.raw == ex.body, d.tag
    assert len(conns) > WORKERS  # some clients opened a connection per request

    # Memory stays flat: nothing is held per exchange once it is written ...
    assert after["inflight"] == 0 and after["conns"] == 0, after
    for kind, cap in BOUNDED.items():
        assert after["types"].get(kind, 0) <= cap, (kind, cap)
    unbounded = {t: g for t, g in growth.items() if t not in BOUNDED}
    assert all(g < 500 for g in unbounded.values()), top
    assert after["objects"] - before["objects"] - bounded < 1000, top
    # ... and the resident size levels off.
    assert mem["growth_pct"] < RSS_GROWTH_PCT, mem
