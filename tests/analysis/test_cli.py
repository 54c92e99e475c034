"""`llmp analyze` through the console script's entry point."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import orjson
import pytest

from llmp.cli import main
from tests.support import scenarios as sc


def record(tmp_path: Path, traffic: sc.Traffic, mode: str = "digest") -> str:
    return str(traffic.write(tmp_path / f"{mode}.jsonl", mode))


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.title_side_call())
    assert main(["analyze", path, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    rep = orjson.loads(out)
    assert rep["v"] == 1 and len(rep["rows"]) == 6
    assert rep["findings"][0]["kind"] == "side_call_on_conversation_model"
    assert rep["rows"][4]["client"] == "opencode/1.0.0"


def test_readable_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.weak_model_side_call())
    assert main(["analyze", path]) == 0
    out = capsys.readouterr().out
    assert "3 chat requests analysed: 2 turns in 1 conversation, 1 side-call." in out
    assert "Prefill took" in out and "went to re-processing" in out
    assert "side-calls evicted the cache" in out  # the loss by cause
    assert (
        "aider/0.86.1's one-off (title, commit message) side-calls ran on qwen3-8b-q4_k_m.gguf"
        in out
    )
    # The side-calls asked for the weak model, which the conversation's server answered:
    # the fix is aider's own.
    flat = " ".join(out.split())
    assert "Fix: aider: The side-calls ask for another model name" in flat
    assert "--weak-model" in flat and "(high confidence:" in flat
    assert "aider/0.86.1: 3 requests, 1 conversation, 0 tools" in out


def test_readable_report_names_each_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = {
        "changed_system": "changed its system prompt",
        "changed_tools": "changed its tool definitions",
        "rewritten_history": "rewrote earlier messages",
        "two_harnesses": "other conversations",
        "other_model": "Requests to llama3.2:3b ran between turns on qwen3:8b",
        "server_reset": "lost its whole cache",
        "head_only": "kept only the start of the prompt",
    }
    for name, words in expected.items():
        path = record(tmp_path, sc.SCENARIOS[name]())
        assert main(["analyze", path]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert words in out, (name, out)


def test_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"".join(sc.clean_chat().lines("digest"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["analyze", "-", "--json"]) == 0
    rep = orjson.loads(capsys.readouterr().out)
    assert rep["coverage"]["analysed"] == 5


def test_several_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = record(tmp_path, sc.clean_chat(), "digest")
    later = sc.Traffic(t=sc.T0 + 86_400_000)
    sc.work(sc.Agent(later, sc.LlamaServer()), 2)
    b = str(later.write(tmp_path / "later.jsonl"))
    assert main(["analyze", b, a, "--json"]) == 0
    rep = orjson.loads(capsys.readouterr().out)
    assert [r["session"] for r in rep["rows"]] == [1] * 5 + [2] * 2
    assert rep["window"]["days"] == pytest.approx(1.0, abs=0.01)


def test_threshold_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.changed_system())
    assert main(["analyze", path, "--json", "--min-lost-tokens", "100000"]) == 0
    rep = orjson.loads(capsys.readouterr().out)
    # Every charged token stays in a finding (R38); under the threshold it is minor.
    assert rep["findings"] and all(f["minor"] for f in rep["findings"])
    assert sum(f["lost_tokens"] for f in rep["findings"]) == rep["time"]["lost_tokens"]
    assert main(["analyze", path, "--json"]) == 0
    assert not any(f["minor"] for f in orjson.loads(capsys.readouterr().out)["findings"])
    assert main(["analyze", path, "--json", "--large-system-tokens", "100"]) == 0
    kinds = [f["kind"] for f in orjson.loads(capsys.readouterr().out)["findings"]]
    assert "large_system_prompt" in kinds and "prefix_break" in kinds


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_empty_recording_reads_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"")
    assert main(["analyze", str(path)]) == 0
    assert "no records" in capsys.readouterr().out
