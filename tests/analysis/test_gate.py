"""`llmp analyze --fail-on KIND[,KIND...] [--min-lost-ms N]`: the CI gate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis.findings import KINDS
from llmp.analysis.gate import offending, parse_kinds, reason
from llmp.cli import main
from tests.support import overflow_scenarios as osc
from tests.support import scenarios as sc

LLMP = Path(sys.executable).with_name("llmp")


def record(tmp_path: Path, traffic: sc.Traffic, name: str, mode: str = "digest") -> str:
    return str(traffic.write(tmp_path / f"{name}.jsonl", mode))


def broken_every_turn() -> sc.Traffic:
    """A harness that puts the time in its system prompt: every turn breaks the prefix."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer(), ua="aider/0.86.1")
    for i in range(4):
        a.messages[0] = {"role": "system", "content": sc.SYSTEM + f" Time: 10:0{i}."}
        sc.work(a, 1, seed=f"s{i}")
    return tr


def test_fails_on_a_prefix_break(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, broken_every_turn(), "broken")
    assert main(["analyze", path, "--fail-on", "prefix_break"]) == 1
    cap = capsys.readouterr()
    assert "Findings" in cap.out  # the readable report is still printed
    lines = cap.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("llmp: FAIL prefix_break (system_changed) aider/0.86.1: 3 turns, ")
    assert lines[0].endswith(" s lost")


def test_passes_on_clean_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.clean_chat(), "clean")
    assert main(["analyze", path, "--fail-on", "prefix_break,side_call_on_conversation_model"]) == 0
    cap = capsys.readouterr()
    assert cap.err == "llmp: PASS no prefix_break, side_call_on_conversation_model finding\n"
    assert "No findings" in cap.out


def test_json_is_printed_and_the_gate_still_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = record(tmp_path, broken_every_turn(), "broken")
    assert main(["analyze", path, "--json", "--fail-on", "prefix_break"]) == 1
    cap = capsys.readouterr()
    rep = orjson.loads(cap.out)
    assert [f["kind"] for f in rep["findings"]] == ["prefix_break"]
    assert cap.err.count("llmp: FAIL") == 1


def test_only_listed_kinds_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, sc.title_side_call(), "title")
    assert main(["analyze", path, "--fail-on", "prefix_break"]) == 0
    assert main(["analyze", path, "--fail-on", "prefix_break", "--fail-on", "unused_tool"]) == 0
    assert main(["analyze", path, "--fail-on", "side_call_on_conversation_model"]) == 1
    err = capsys.readouterr().err
    assert "llmp: FAIL side_call_on_conversation_model /models/" not in err  # a file name
    assert "llmp: FAIL side_call_on_conversation_model qwen3-8b-q4_k_m.gguf: 1 turn, " in err


def test_min_lost_ms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, broken_every_turn(), "broken")
    assert main(["analyze", path, "--json"]) == 0
    f = orjson.loads(capsys.readouterr().out)["findings"][0]
    ms = f["lost_ms"]["value"]
    assert main(["analyze", path, "--fail-on", "prefix_break", "--min-lost-ms", str(ms)]) == 1
    over = str(ms + 1)
    assert main(["analyze", path, "--fail-on", "prefix_break", "--min-lost-ms", over]) == 0
    assert capsys.readouterr().err.endswith(f"with lost_ms >= {float(over):g}\n")


def test_findings_without_lost_ms_fail_whatever_the_threshold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = record(tmp_path, sc.clean_chat(), "clean")
    args = ["analyze", path, "--large-system-tokens", "100", "--fail-on", "large_system_prompt"]
    assert main([*args, "--min-lost-ms", "1e9"]) == 1
    err = capsys.readouterr().err
    assert err == "llmp: FAIL large_system_prompt opencode/1.0.0: 347 tokens (threshold 100)\n"


def test_context_overflow_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path, osc.ollama_truncating(), "ollama", "full")
    assert main(["analyze", path, "--fail-on", "context_overflow", "--min-lost-ms", "5000"]) == 1
    err = capsys.readouterr().err
    assert (
        "llmp: FAIL context_overflow qwen3:8b: 6 turns over the context (6 cut silently), " in err
    )
    assert err.rstrip().endswith("num_ctx 2,048")
    tr, _, _ = osc.llama_refusing()
    path = record(tmp_path, tr, "llama", "full")
    assert main(["analyze", path, "--fail-on", "context_overflow"]) == 1
    err = capsys.readouterr().err
    assert "2 turns over the context (2 refused), n_ctx " in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--fail-on", "prefix_brake"], "unknown finding kind prefix_brake in --fail-on"),
        (["--fail-on", "prefix_break,nope,x"], "unknown finding kinds nope, x in --fail-on"),
        (["--fail-on", ","], "--fail-on needs at least one kind"),
        (["--min-lost-ms", "5"], "--min-lost-ms only applies with --fail-on"),
        (["--fail-on", "prefix_break", "--min-lost-ms", "-1"], "must be 0 or more"),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    path = record(tmp_path, broken_every_turn(), "broken")
    assert main(["analyze", path, *args]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # nothing analysed
    assert cap.err.startswith("llmp analyze: ") and words in cap.err
    if "kind" in words:
        assert "valid kinds: " + ", ".join(KINDS) in cap.err


def test_parse_and_reason() -> None:
    assert parse_kinds(["prefix_break, unused_tool", "prefix_break", "bogus"]) == (
        ["prefix_break", "unused_tool"],
        ["bogus"],
    )
    untimed: dict[str, Any] = {
        "kind": "side_call_on_conversation_model",
        "model": "qwen",
        "client": None,
        "rows": [3],
        "lost_tokens": 900,
        "lost_ms": None,
        "evidence": {},
    }
    assert offending([untimed], ["side_call_on_conversation_model"], 1e9) == [untimed]
    assert reason(untimed) == (
        "llmp: FAIL side_call_on_conversation_model qwen: 1 turn, "
        "900 tokens re-processed (not timed)"
    )


def test_console_script_exit_codes(tmp_path: Path) -> None:
    """The installed `llmp` script, as a CI job runs it."""
    assert LLMP.exists(), LLMP
    broken = record(tmp_path, broken_every_turn(), "broken")
    clean = record(tmp_path, sc.clean_chat(), "clean")
    env = {**os.environ, "NO_COLOR": "1"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(LLMP), "analyze", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )

    bad = run(broken, "--fail-on", "prefix_break")
    assert bad.returncode == 1, bad.stderr
    assert "llmp: FAIL prefix_break (system_changed) aider/0.86.1" in bad.stderr
    assert "Findings" in bad.stdout
    good = run(clean, "--fail-on", "prefix_break", "--json")
    assert good.returncode == 0, good.stderr
    assert orjson.loads(good.stdout)["v"] == 1
    usage = run(clean, "--fail-on", "prefix-break")
    assert usage.returncode == 2 and "valid kinds" in usage.stderr


# -- the recipe in docs/ci-gate.md, run as written --------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "ci-gate.md"


def doc_block(lang: str, first_line: str) -> str:
    """The fenced block of the doc in `lang` that starts with `first_line`."""
    text = DOC.read_text(encoding="utf-8")
    for block in text.split(f"```{lang}\n")[1:]:
        body = block.split("```\n", 1)[0]
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no {lang} block starting with {first_line!r} in {DOC}")


@pytest.mark.e2e
def test_the_documented_recipe(tmp_path: Path) -> None:
    """docs/ci-gate.md's script and session, against the bundled fake llama-server."""
    if shutil.which("curl") is None or shutil.which("bash") is None:
        pytest.skip("the recipe needs bash and curl")
    script = tmp_path / "llmp-gate.sh"
    script.write_text(doc_block("bash", "#!/usr/bin/env bash\n# llmp-gate.sh"))
    session = doc_block("python", "# ci/session.py")
    (tmp_path / "session.py").write_text(session)
    stamped = session.replace(
        '    messages[0] = {"role": "system", "content": system}',
        '    messages[0] = {"role": "system", "content": system + time.ctime() + str(step)}',
    ).replace("import json, os", "import json, os, time")
    assert stamped != session
    (tmp_path / "stamped.py").write_text(stamped)
    env = {
        **os.environ,
        "PATH": f"{LLMP.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "NO_COLOR": "1",
    }

    def gate(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script), sys.executable, f"{name}.py"],
            cwd=tmp_path,
            env={**env, "LLMP_GATE_DIR": f"out-{name}"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    good = gate("session")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "llmp: PASS no prefix_break, context_overflow finding" in good.stderr
    bad = gate("stamped")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "llmp: FAIL prefix_break (system_changed) myharness/1.0: 2 turns, " in bad.stderr
    for name in ("session", "stamped"):
        out = tmp_path / f"out-{name}"
        assert (out / "session.jsonl").stat().st_size > 0
        assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
