"""The main job: `llmp demo` records a scripted session through the real mitmdump and explains it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from llmp.analysis import analyze as analyze_files
from tests.support.adds_up import problems, readable_problems
from tests.support.live_checks import analyze, value
from tests.support.real import llama_paths
from tests.support.words import slips

pytestmark = pytest.mark.e2e

PROVIDER_PART = "llmp demo: the same harnesses on providers"


def assert_provider_part(folder: Path, out: str) -> None:
    """The provider part: four turns on each fake provider, priced, each provider's one miss
    charged to the client's change with its dollars, and the readable report money first."""
    paths = [folder / "anthropic-api.jsonl", folder / "openai-api.jsonl"]
    for path in paths:
        data = path.read_bytes()
        assert len(data.splitlines()) == 4 and b"demo-key-not-recorded" not in data
    result = analyze_files([str(p) for p in paths])
    try:
        report = result.report()
    finally:
        result.close()
    rows = report["rows"]
    assert [r["server"] for r in rows] == ["anthropic"] * 4 + ["openai"] * 4
    assert all(r["cost_usd"] and r["cost_usd"] > 0 for r in rows)
    # Each file numbers its own records: the rows' places say which turn is which.
    losses = [(n, r["lost_client"]["cause"]) for n, r in enumerate(rows) if r["lost_client"]]
    assert losses == [(2, "tools_changed"), (6, "cache_key_changed")]
    for n in (2, 6):
        before, row = rows[n - 1], rows[n]
        left = before["cache_read_tokens"] + before["cache_write_tokens"]
        if row["server"] == "openai":  # automatic caching: the whole prompt was left
            left = before["cache_read_tokens"] + before["uncached_tokens"]
        assert row["lost_client"]["tokens"] == left - row["cache_read_tokens"]
        assert row["lost_client"]["usd"] > 0
    assert all(r["lost_external"] is None for r in rows)
    assert report["cost"]["total_usd"] > report["cost"]["lost_usd"] > 0
    assert problems(report) == []
    report_text = out[out.index("llmp analyze") :]
    assert report_text.index(" spent, ") < report_text.index("Prefill took")  # money first
    assert "prompt_cache_key" in report_text and "tool definitions changed" in report_text
    assert readable_problems(report_text, report) == []
    assert slips(report_text) == []


def test_demo_with_the_bundled_fake_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMP_LLAMA")}
    llmp = Path(sys.executable).with_name("llmp")
    proc = subprocess.run(
        [str(llmp), "demo", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, _, paid = proc.stdout.partition(PROVIDER_PART)
    assert paid, proc.stdout
    records = [orjson.loads(line) for line in (tmp_path / "demo.jsonl").read_bytes().splitlines()]
    assert [r["id"] for r in records] == list(range(1, 13))
    assert [r["request"]["path"] for r in records] == ["/v1/chat/completions"] * 6 + [
        "/v1/messages?beta=true"
    ] * 3 + ["/v1/responses"] * 3
    assert all(r["error"] is None and r["response"]["stream"] == "sse" for r in records)
    assert all(r["request"]["digest"] is not None for r in records)  # digest mode: no text
    assert b"demo-key-not-recorded" not in (tmp_path / "demo.jsonl").read_bytes()
    assert "bundled fake llama-server" in out
    assert "side-calls evicted the cache" in out
    assert "system prompt changed" in out
    # The Claude-Code-like part: its attribution line changed after /compact.
    assert "claude 3: after /compact, a new attribution line" in out
    assert "system prompt differed only in its head" in out
    assert "CLAUDE_CODE_ATTRIBUTION_HEADER" in out
    # The Codex-like part: a clean conversation.
    assert "codex 3: continues" in out

    report = analyze(tmp_path / "demo.jsonl")
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in range(1, 13)] == ["openai_chat"] * 6 + [
        "anthropic_messages"
    ] * 3 + ["openai_responses"] * 3
    assert [rows[i]["cause"] for i in (4, 5)] == ["side_call", "structural"]
    assert rows[8]["linked_to"] == 7 and rows[8]["cause"] is None
    assert rows[9]["new_conversation"] and rows[9]["linked_to"] == 8
    (head,) = [f for f in report["findings"] if f["kind"] == "volatile_head"]
    assert head["rows"] == [9] and head["client"].startswith("claude-cli/")
    assert head["evidence"]["changed"]["index"] == 0
    # R38: the attribution line's cost is charged on its row, and everything adds up.
    assert rows[9]["lost_client"]["cause"] == "system_changed"
    assert head["lost_tokens"] == rows[9]["lost_client"]["tokens"]
    assert problems(report) == []
    assert readable_problems(out, report) == []
    assert slips(out) == []
    codex = [rows[i] for i in (10, 11, 12)]
    assert len({r["conversation"] for r in codex}) == 1
    assert [r["turn"] for r in codex] == [1, 2, 3]
    assert all(r["cause"] is None and r["break_cause"] is None for r in codex)
    assert all(r["observed_reuse"] > 0.9 for r in codex[1:])
    assert_provider_part(tmp_path / "provider", paid)


@pytest.mark.real_server
@pytest.mark.skipif(isinstance(llama_paths(), str), reason=str(llama_paths()))
def test_demo_with_the_real_llama_server(tmp_path: Path) -> None:
    """The same session against the real llama-server: its own counters, the same verdicts."""
    llmp = Path(sys.executable).with_name("llmp")
    proc = subprocess.run(
        [str(llmp), "demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, _, paid = proc.stdout.partition(PROVIDER_PART)
    assert paid, proc.stdout
    assert_provider_part(tmp_path / "provider", paid)
    assert "real llama-server" in out and "CLAUDE_CODE_ATTRIBUTION_HEADER" in out
    report = analyze(tmp_path / "demo.jsonl")
    rows = {r["id"]: r for r in report["rows"]}
    assert len(rows) == 12 and all(r["counts"]["reused_tokens"] for r in rows.values())
    assert rows[5]["break_cause"] == "system_changed"
    (head,) = [f for f in report["findings"] if f["kind"] == "volatile_head"]
    assert head["rows"] == [9] and head["lost_tokens"] > 0
    assert problems(report) == [] and readable_problems(out, report) == []
    assert value(rows[9]["counts"]["reused_tokens"]) < 0.1 * value(
        rows[9]["counts"]["prompt_tokens"]
    )
    codex = [rows[i] for i in (10, 11, 12)]
    assert len({r["conversation"] for r in codex}) == 1
    assert all(r["cause"] is None and r["break_cause"] is None for r in codex)
    assert all(r["counts"]["prefill_ms"]["source"] == "server" for r in codex)
