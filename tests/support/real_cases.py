"""Driving the real llama-server through two real recorders, for the truth tests.

A `Case` is one conversation driven by the real ``openai`` client through two
recorders in a chain (full mode in front, digest mode behind it, so both
recordings hold the same exchanges), analysed three ways (`MODES`): the digest
recording, the full one, and the full one after ``--tokenize``.  Shared by the
tests that hold llmp's charges against the server's own counters
(tests/real/test_loss_truth.py, tests/real/test_server_losses.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import openai

from llmp.cli import main
from tests.support.mitm import Mitmdump, read_records
from tests.support.real import LlamaServer


class Served(Protocol):
    """A real server the cases drive: llama-server (`real.LlamaServer`) or vLLM
    (`real_vllm.VllmServer`)."""

    @property
    def url(self) -> str: ...


MODEL = "smol"
MAX_TOKENS = 8
MODES = ("digest", "full", "tokenized")
"""The analyses of each case: the digest recording, the full one, and the full one
after ``--tokenize`` (the server's token counts instead of the ⌈chars / 4⌉ estimate)."""

_TOPICS = (
    "deployments", "backups", "alerts", "access requests", "billing", "log retention",
    "releases", "incidents", "certificates", "capacity", "on-call handover", "audits",
)  # fmt: skip


def rules(n: int, start: int = 0) -> str:
    """A long, stable block of instructions (about 70 tokens a rule)."""
    out = []
    for i in range(start, start + n):
        topic = _TOPICS[i % len(_TOPICS)]
        out.append(
            f"Rule {i + 1} ({topic}): when a question is about {topic}, first restate what "
            f"the operator asked, then check the {topic} runbook, name the owner of the "
            f"{topic} service, say which dashboard shows its state, and end with one concrete "
            f"next step. Never guess a number that the {topic} ledger does not show."
        )
    return "\n".join(out)


def log_lines(n: int, minute: int = 0) -> str:
    """A pasted log, as a user message carries it (about 35 tokens a line)."""
    lines = [
        f"2025-03-14T09:{minute + i:02d}:00Z api-gateway request {1000 + 37 * i} took "
        f"{120 + 13 * i} ms, status {503 if i % 5 == 4 else 200}, region eu-west-{1 + i % 3}"
        for i in range(n)
    ]
    return "Here is the gateway log of this morning:\n" + "\n".join(lines)


def turn(
    client: Any,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> str:
    """One streamed turn, as an agent sends it; the reply's text."""
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )
    text = ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return text


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def tokens(server: LlamaServer, texts: list[str]) -> int:
    """The server's own token count of these texts, without special tokens."""
    return sum(
        len(post(server.url + "/tokenize", {"content": t, "add_special": False})["tokens"])
        for t in texts
    )


def analyze(path: Path, *options: str) -> dict[str, Any]:
    """``llmp analyze --json [OPTIONS] PATH``, parsed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["analyze", *options, str(path), "--json"]) == 0, err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@dataclass
class Case:
    """One conversation, recorded in both modes and analysed (MODES)."""

    name: str
    digest: dict[int, dict[str, Any]] = field(default_factory=dict)
    full: dict[int, dict[str, Any]] = field(default_factory=dict)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # by MODES
    new: dict[int, int] = field(default_factory=dict)
    """Per record id: the server's tokens of the messages no earlier turn had sent."""
    notes: dict[str, Any] = field(default_factory=dict)

    def row(self, rid: int, mode: str = "digest") -> dict[str, Any]:
        rows = {r["id"]: r for r in self.reports[mode]["rows"]}
        return rows[rid]

    def timings(self, rid: int) -> dict[str, Any]:
        """The server's counters for one exchange, as the digest recording kept them."""
        timings: dict[str, Any] = self.digest[rid]["response"]["digest"]["usage"]["timings"]
        return timings


def record(server: Served, tmp: Path, name: str, drive: Callable[[Any, Case], None]) -> Case:
    """Drive a conversation through ``full -> digest -> the server``; analyse it (MODES)."""
    case = Case(name)
    full_path, digest_path = tmp / f"{name}-full.jsonl", tmp / f"{name}-digest.jsonl"
    inner = Mitmdump(
        server.url,
        digest_path,
        {"llmp_body": "digest", "llmp_tokenize": "true"},
        log_path=tmp / f"{name}-digest.log",
    )
    with inner:
        outer = Mitmdump(
            inner.url,
            full_path,
            # Its upstream is the other recorder: its token counts would be records there.
            {"llmp_body": "full", "llmp_tokenize": "false"},
            log_path=tmp / f"{name}-full.log",
        )
        with outer:
            client = openai.OpenAI(
                base_url=outer.url + "/v1", api_key="x", max_retries=0, timeout=600
            )
            try:
                drive(client, case)
            finally:
                client.close()
            outer.stop()  # SIGINT: records of finished exchanges are written
        inner.stop()
    case.notes["digest_path"], case.notes["full_path"] = digest_path, full_path
    case.full = {r["id"]: r for r in read_records(full_path)}
    case.digest = {r["id"]: r for r in read_records(digest_path)}
    assert sorted(case.full) == sorted(case.digest)
    # The full recording once more, with the server's own token counts (R18).
    tokenized = tmp / f"{name}-tokenized.jsonl"
    shutil.copyfile(full_path, tokenized)
    case.reports = {
        "digest": analyze(digest_path),
        "full": analyze(full_path),
        "tokenized": analyze(tokenized, "--tokenize", server.url),
    }
    return case
