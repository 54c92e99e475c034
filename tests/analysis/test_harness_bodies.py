"""The newest harness versions' traffic, trimmed from real runs (docs/real-harness.md).

The bodies are in tests/fixtures/harness-bodies/ (texts cut short, paths replaced,
the server's own counters kept beside them for reference). They are replayed here
through the scenario generator's simulated llama-server (one slot), so the
counters the analyzer reads follow the bodies, in full and digest recordings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import scenarios as sc
from tests.support.scenarios import analyse, rows_by_id

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-bodies"


@pytest.fixture(params=["digest", "full"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return doc


def _tool_names(body: dict[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in body["tools"]}


def _replay(doc: dict[str, Any], part: str) -> sc.Traffic:
    tr = sc.Traffic()
    server = sc.LlamaServer()
    for x in doc[part]:
        tr.chat(server, doc["user_agent"], x["request"], x["reply"])
    return tr


def test_qwen_code_0_24_print_mode_memory_extraction(tmp_path: Path, mode: str) -> None:
    """`qwen "…"` 0.24.4: after the turn, the managed-memory extraction resends the one
    user message (context and prompt in one) and the reply under its own system prompt,
    with 6 tools of which 3 are not among the turn's 10 (0.15.10 sent a subset). A
    summarise side-call, not a turn whose system prompt changed."""
    doc = _load("qwen-code-0.24.4.json")
    turn, memory = (x["request"] for x in doc["print"])
    assert memory["messages"][0] != turn["messages"][0]
    assert memory["messages"][1:-1] == [*turn["messages"][1:], doc["print"][0]["reply"]]
    assert len(turn["messages"]) == 2  # system, one user message
    assert _tool_names(memory) - _tool_names(turn) == {"write_file", "edit", "run_shell_command"}
    rep = analyse(_replay(doc, "print"), tmp_path, mode)
    r = rows_by_id(rep)
    assert r[1]["kind"] == "turn" and r[2]["kind"] == "side_call", r[2]
    assert r[2]["side_call_shape"] == "summarise" and r[2]["break_cause"] is None
    assert rep["time"]["lost_tokens"] == 0
    assert not any(f["kind"] == "prefix_break" for f in rep["findings"]), rep["findings"]


def test_qwen_code_0_24_interactive_session(tmp_path: Path, mode: str) -> None:
    """The TUI, three prompts. After the second and third turns a prompt suggestion
    (same system prompt and tools, the whole prompt and "[SUGGESTION MODE: …]") comes
    before the memory extraction, which then resends the history without it. Every
    memory extraction is a side-call; the turns after them lost their prefix to it."""
    doc = _load("qwen-code-0.24.4.json")
    reqs = [x["request"] for x in doc["interactive"]]
    suggestion = reqs[3]["messages"][-1]["content"][0]["text"]
    assert suggestion.startswith("[SUGGESTION MODE:")
    assert reqs[4]["messages"][1:-1] == reqs[3]["messages"][1:-1]  # the history, not the hint
    assert _tool_names(reqs[4]) < _tool_names(reqs[3])
    rep = analyse(_replay(doc, "interactive"), tmp_path, mode)
    r = rows_by_id(rep)
    for memory_id in (2, 5, 8):
        assert r[memory_id]["kind"] == "side_call", r[memory_id]
        assert r[memory_id]["side_call_shape"] == "summarise"
    for turn_id, after in ((3, 2), (6, 5)):
        row = r[turn_id]
        assert row["kind"] == "turn" and row["conversation"] == 1, row
        assert row["side_calls_between"] == [after]
        assert row["lost_external"] is not None and row["lost_external"]["cause"] == "side_call"
        assert row["lost_client"] is None
    assert rep["coverage"]["conversations"] == 1
    assert set(rep["time"]["by_cause"]) <= {"side_call"}, rep["time"]["by_cause"]
    assert not any(f["kind"] == "prefix_break" for f in rep["findings"]), rep["findings"]


def test_another_system_prompt_with_all_the_tools_stays_a_turn(tmp_path: Path, mode: str) -> None:
    """The rule above needs the request to leave some of the conversation's tools out:
    the whole history under another system prompt with every tool (and one more) is a
    turn whose system prompt changed."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    sc.work(a, 2)
    a.messages[0] = {"role": "system", "content": "You are another agent now. " * 30}
    a.tools = [*sc.CODING_TOOLS, sc.tool("edit", "Edit a file in place.", path="string")]
    sc.work(a, 1, seed="u")
    r = rows_by_id(analyse(tr, tmp_path, mode))
    assert r[3]["kind"] == "turn" and r[3]["conversation"] == 1 and r[3]["linked_to"] == 2
    assert r[3]["break_cause"] == "system_changed", r[3]


def test_a_cut_system_prompt_with_fewer_tools_stays_a_turn(tmp_path: Path, mode: str) -> None:
    """After a context error a harness resends the history under the start of its system
    prompt with fewer tools: a turn that changed its system prompt and tools, not a
    side-call, though the history is one user message and the reply."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    a.turn(sc.text("ask", 300), sc.text("answer", 200))
    a.messages[0] = {"role": "system", "content": sc.SYSTEM[: len(sc.SYSTEM) // 3]}
    a.tools = sc.CODING_TOOLS[:2]
    a.turn(sc.text("log", 900), sc.text("answer 2", 200))
    r = rows_by_id(analyse(tr, tmp_path, mode))
    assert r[2]["kind"] == "turn" and r[2]["linked_to"] == 1, r[2]
