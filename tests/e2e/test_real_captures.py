"""Real harness traffic, replayed through the real mitmdump with the llmp addon.

The fixtures (``tests/fixtures/harness/*.jsonl.gz``) are real captures of
Claude Code, Codex, opencode, Qwen Code and aider against a real
llama-server (``/work/harness``), with their text scrambled by
``tests/support/scramble.py`` (lengths, equalities, ids, counters and piece
boundaries kept). ``tests/support/replay.py`` serves the captured responses
piece by piece and drives the captured requests through mitmdump as the
harness did: concurrent title calls on their own connections, Codex hanging
up right after ``response.completed``, a killed opencode mid-stream.

Each fixture is replayed in full and in digest mode and analysed with
``llmp analyze --json``. The checks compare with the capture itself: one
record per exchange, the errors the harness caused and no others, every
row's reused and evaluated tokens equal to the server's own counters
(``timings``, or the API's usage), the digests equal to those of the full
bodies, the same verdicts in both modes; then the facts known from the
captures (docs/real-harness.md, "Five harnesses, replayed").
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.replay import (
    Captured,
    Replay,
    analyze_json,
    check_digests,
    check_replay,
    check_report,
    compare_reports,
    load_capture,
    replay,
    server_counters,
)
from tests.support.scramble import JsonScrambler, scramble_stream, scramble_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness"
NAMES = (
    "aider-1",
    "claude-2",
    "claude-5",
    "claude-7",
    "codex-1",
    "codex-3",
    "opencode-1",
    "opencode-2-head",
    "opencode-3",
    "qwen-3",
)
MODES = ("full", "digest")
e2e = pytest.mark.e2e


@dataclass
class Outcome:
    """One fixture replayed in both modes, and the two reports."""

    exchanges: list[Captured]
    replays: dict[str, Replay]
    reports: dict[str, dict[str, Any]]

    def rows(self, mode: str) -> dict[int, dict[str, Any]]:
        return {row["id"]: row for row in self.reports[mode]["rows"]}

    def findings(self, mode: str, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.reports[mode]["findings"] if f["kind"] == kind]

    def exchange(self, seq: int) -> Captured:
        return next(ex for ex in self.exchanges if ex.seq == seq)


class Outcomes:
    """Replays each fixture once, on first use."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._done: dict[str, Outcome] = {}

    def __getitem__(self, name: str) -> Outcome:
        if name not in self._done:
            exchanges = load_capture(FIXTURES / f"{name}.jsonl.gz")
            reps = {
                mode: replay(exchanges, self.out, mode=mode, name=name, time_scale=0.001)
                for mode in MODES
            }
            reports = {mode: analyze_json([rep.recording]) for mode, rep in reps.items()}
            self._done[name] = Outcome(exchanges, reps, reports)
        return self._done[name]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcomes]:
    yield Outcomes(tmp_path_factory.mktemp("real-captures"))


def _value(mv: Any) -> Any:
    return mv["value"] if isinstance(mv, dict) else None


# -- the fixtures themselves -------------------------------------------------------------------


def test_the_fixtures_are_small_and_scrambled() -> None:
    files = sorted(FIXTURES.glob("*.jsonl.gz"))
    assert sorted(p.name for p in files) == sorted(f"{n}.jsonl.gz" for n in NAMES)
    assert sum(p.stat().st_size for p in files) < 3 * 1024 * 1024
    text = "".join(gzip.open(p, "rt", encoding="utf-8").read() for p in files)
    exchanges = [ex for p in files for ex in load_capture(p)]
    bodies = [ex.request_json() for ex in exchanges]
    for phrase in (
        "You are Claude Code",
        "Claude Agent SDK",
        "Codex CLI",
        "title generator",
        "Qwen Code",
        "expert software developer",
        "calc.py",
        "Output token limit hit",
    ):
        assert phrase not in text
    # and what the analysis reads is still there
    assert "claude-cli/2.1.197 (external, cli)" in text  # headers are kept
    assert all(b"exceed_context_size_error" in ex.body for ex in exchanges if ex.status == 400)
    assert {"smollm2"} == {b["model"] for b in bodies if isinstance(b, dict) and "model" in b}


def test_scrambling_keeps_structure_and_tool_arguments() -> None:
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": "Be brief. 42"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "read",
                                "arguments": '{"path": "a.py", "n": 1e5, "ok": true}',
                            },
                        }
                    ],
                },
            ],
            "tools": [{"type": "function", "function": {"name": "read", "description": "Read"}}],
            "max_tokens": 256,
        }
    )
    out = json.loads(JsonScrambler().scramble(body))
    assert len(json.dumps(out)) == len(body)
    assert out["model"] == "smollm2" and out["max_tokens"] == 256
    assert out["messages"][0]["content"] == scramble_text("Be brief. 42") != "Be brief. 42"
    call = out["messages"][1]["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"]["name"] == "read"
    args = json.loads(call["function"]["arguments"])
    assert args == {"path": scramble_text("a.py"), "n": 1e5, "ok": True}
    assert out["tools"][0]["function"]["description"] == scramble_text("Read")
    # partial_json split across events: the value is scrambled, the key kept
    events = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"input_json_delta","partial_json":"{\\"comm"}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"input_json_delta","partial_json":"and\\": \\"ls -la\\"}"}}\n\n'
    )
    scrambled = scramble_stream(events)
    assert len(scrambled) == len(events)
    parts = [
        json.loads(line[len("data: ") :])["delta"]["partial_json"]
        for line in scrambled.decode().splitlines()
        if line.startswith("data: ")
    ]
    assert json.loads("".join(parts)) == {"command": scramble_text("ls -la")}


# -- every fixture: records, counters, digests ---------------------------------------------------


@e2e
@pytest.mark.parametrize("name", NAMES)
def test_one_record_per_exchange(outcomes: Outcomes, name: str) -> None:
    """No exchange lost or duplicated, the harness's hang-ups where it hung up, and every
    byte relayed to the client as the server sent it."""
    o = outcomes[name]
    for mode in MODES:
        assert check_replay(o.replays[mode]) == []


@e2e
@pytest.mark.parametrize("name", NAMES)
def test_counts_equal_the_servers(outcomes: Outcomes, name: str) -> None:
    o = outcomes[name]
    measured = [ex for ex in o.exchanges if server_counters(ex) is not None]
    assert measured, "the capture has server counters"
    for mode in MODES:
        assert check_report(o.exchanges, o.reports[mode]) == []


@e2e
@pytest.mark.parametrize("name", NAMES)
def test_digest_mode_hashes_as_full_mode(outcomes: Outcomes, name: str) -> None:
    o = outcomes[name]
    assert check_digests(o.replays["full"], o.replays["digest"]) == []
    assert compare_reports(o.reports["full"], o.reports["digest"]) == []


# -- what each harness did ------------------------------------------------------------------------


@e2e
def test_claude_code_compaction_changes_the_attribution_line(outcomes: Outcomes) -> None:
    """claude-5: `-c -p /compact`, then a turn whose first system block (the cc_version
    suffix) changed: nothing of the prompt could be reused (cache_read 25 of 3554)."""
    o = outcomes["claude-5"]
    first = o.exchange(2).request_json()["system"][0]["text"]
    after = o.exchange(4).request_json()["system"][0]["text"]
    assert first != after and len(first) == len(after) < 100
    assert server_counters(o.exchange(4)) is not None
    for mode in MODES:
        assert o.reports[mode]["coverage"]["paths"] == {"/": 2}
        (vh,) = o.findings(mode, "volatile_head")
        assert vh["rows"] == [4] and vh["confidence"] == "high" and vh["lost_tokens"] > 2000
        advice = vh["evidence"]["advice"]
        assert advice["harness"] == "Claude Code"
        assert "CLAUDE_CODE_ATTRIBUTION_HEADER" in advice["text"]


@e2e
def test_claude_code_without_the_attribution_line(outcomes: Outcomes) -> None:
    """claude-2 (CLAUDE_CODE_ATTRIBUTION_HEADER=0): two system blocks, every turn reused
    the previous prompt, no volatile_head and no loss."""
    o = outcomes["claude-2"]
    assert len(o.exchange(2).request_json()["system"]) == 2
    for mode in MODES:
        rows = o.rows(mode)
        assert [r["kind"] for r in rows.values()] == ["turn"] * 4
        assert [r["linked_to"] for r in rows.values()] == [None, 2, 3, 4]
        assert o.findings(mode, "volatile_head") == []
        assert all(r["cause"] is None for r in rows.values())


@e2e
def test_claude_code_title_calls(outcomes: Outcomes) -> None:
    """claude-7 (the TUI): the title call runs beside the first turn and again beside the
    turn after /compact, on another connection; the compaction changed the attribution
    line, so the title call had nothing left to evict (cache_read 25 either way)."""
    o = outcomes["claude-7"]
    assert o.exchange(2).conn != o.exchange(3).conn
    assert o.exchange(8).conn != o.exchange(9).conn
    # they overlapped in the capture, and in the replay both reached the upstream
    assert o.exchange(3).t_start < (o.exchange(2).t_end or 0)
    for mode in MODES:
        rows = o.rows(mode)
        assert (rows[2]["kind"], rows[2]["side_call_shape"]) == ("side_call", "oneshot")
        assert (rows[8]["kind"], rows[8]["side_call_shape"]) == ("side_call", "structured")
        assert rows[3]["kind"] == "turn" and rows[3]["turn"] == 1
        assert rows[9]["side_calls_between"] == [8]
        assert rows[9]["lost_external"] is None  # the volatile head, not the title call
        (vh,) = o.findings(mode, "volatile_head")
        assert vh["rows"] == [9]
        assert "CLAUDE_CODE_ATTRIBUTION_HEADER" in vh["evidence"]["advice"]["text"]
        assert [rows[i]["linked_to"] for i in (10, 11, 12)] == [9, 10, 11]


@e2e
def test_codex_hangs_up_after_response_completed(outcomes: Outcomes) -> None:
    """codex-1: both exchanges end in mitmproxy's `Client disconnected.` right after
    `response.completed`; the replay client hung up there and the records are complete."""
    o = outcomes["codex-1"]
    assert all(ex.hung_up and ex.stream_complete for ex in o.exchanges)
    for mode in MODES:
        assert [s.outcome for s in o.replays[mode].served] == ["client_gone", "client_gone"]
        assert [r["error"] for r in o.replays[mode].records] == [None, None]
        rows = o.rows(mode)
        assert [rows[i]["kind"] for i in (1, 2)] == ["turn", "turn"]
        assert rows[2]["linked_to"] == 1 and rows[2]["cause"] is None


@e2e
def test_codex_compaction_is_a_summarise_side_call(outcomes: Outcomes) -> None:
    o = outcomes["codex-3"]
    meta = dict(o.exchange(2).request_headers)["x-codex-turn-metadata"]
    assert json.loads(meta)["request_kind"] == "compaction"
    for mode in MODES:
        rows = o.rows(mode)
        assert (rows[2]["kind"], rows[2]["side_call_shape"]) == ("side_call", "summarise")


@e2e
def test_codex_turn_after_compaction_continues_the_conversation(outcomes: Outcomes) -> None:
    """codex-3 #3 resends #1's whole prompt with every item `id` renewed (the server
    reused 4583 of #1's 4586 tokens); R30 leaves the `id` out of an item's hash."""
    for mode in MODES:
        rows = outcomes["codex-3"].rows(mode)
        assert (rows[3]["conversation"], rows[3]["linked_to"]) == (1, 1)
        assert not rows[3]["new_conversation"]


@e2e
def test_opencode_title_call_comes_first(outcomes: Outcomes) -> None:
    o = outcomes["opencode-1"]
    for mode in MODES:
        rows = o.rows(mode)
        assert (rows[1]["kind"], rows[1]["side_call_shape"]) == ("side_call", "oneshot")
        assert (rows[2]["conversation"], rows[2]["turn"]) == (1, 1)
        assert (rows[3]["conversation"], rows[3]["turn"], rows[3]["linked_to"]) == (1, 2, 2)
        assert o.reports[mode]["coverage"]["conversations"] == 1


@e2e
def test_opencode_compaction_loop_is_refused_for_context(outcomes: Outcomes) -> None:
    """opencode-2 (server -c 2048), first 12 exchanges: a title call, then the main
    request refused with llama-server's 400, a compaction call, the retry refused, ..."""
    o = outcomes["opencode-2-head"]
    refused = [ex.seq for ex in o.exchanges if ex.status == 400]
    assert refused == [2, 4, 6, 8, 10, 12]
    report = o.reports["full"]
    assert report["coverage"]["context_exceeded"] == 6
    assert report["coverage"]["skipped"]["non_2xx"] == 6
    found = o.findings("full", "context_overflow")
    assert found and all(f["confidence"] == "high" for f in found)
    assert sorted(i for f in found for i in f["evidence"]["refused_ids"]) == refused
    assert {f["evidence"]["n_ctx"] for f in found} == {2048}
    rows = o.rows("full")
    assert all(rows[i]["kind"] == "side_call" for i in (3, 5, 7, 9, 11))


@e2e
def test_opencode_refusals_make_one_finding(outcomes: Outcomes) -> None:
    o = outcomes["opencode-2-head"]
    assert len(o.findings("full", "context_overflow")) == 1
    # The title call came first, and the next thing the client sent was refused for its
    # context: that refused request (tools, another system prompt) still decides it.
    for mode in MODES:
        first = o.rows(mode)[1]
        assert (first["kind"], first["side_call_shape"]) == ("side_call", "oneshot"), mode
    assert o.reports["digest"]["coverage"]["context_exceeded"] == 6


@e2e
def test_qwen_code_compression_call(outcomes: Outcomes) -> None:
    """qwen-3 #3: non-streamed, no tools, another system prompt: a summarise side-call;
    the turn after it found its prompt in llama's RAM cache (8830 reused)."""
    o = outcomes["qwen-3"]
    assert "tools" not in o.exchange(3).request_json()
    for mode in MODES:
        rows = o.rows(mode)
        assert (rows[3]["kind"], rows[3]["side_call_shape"]) == ("side_call", "summarise")
        assert _value(rows[4]["counts"]["reused_tokens"]) == 8830
        assert rows[4]["lost_external"] is None


@e2e
def test_qwen_code_memory_extraction_is_a_side_call(outcomes: Outcomes) -> None:
    o = outcomes["qwen-3"]
    rows = o.rows("full")
    assert [rows[i]["kind"] for i in (2, 5)] == ["side_call", "side_call"]
    assert rows[4]["linked_to"] == 1
    assert o.findings("full", "prefix_break") == []


@e2e
def test_aider_restored_history(outcomes: Outcomes) -> None:
    """aider-1: `--restore-chat-history` puts the earlier turn before the files message;
    the server reused 412 of 745 tokens, and the break is the client's."""
    o = outcomes["aider-1"]
    for mode in MODES:
        rows = o.rows(mode)
        assert rows[2]["linked_to"] == 1
        assert rows[2]["break_cause"] == "history_rewritten"
        assert rows[2]["cause"] == "structural" and rows[2]["lost_external"] is None


@e2e
@pytest.mark.parametrize("name", ["claude-7", "codex-1", "opencode-1", "qwen-3"])
def test_no_context_overflow_without_a_refusal(outcomes: Outcomes, name: str) -> None:
    assert outcomes[name].findings("full", "context_overflow") == []


@e2e
def test_claude_code_compaction_request_has_no_server_loss(outcomes: Outcomes) -> None:
    """claude-7 #7 reused 3520 tokens, everything before the first message Claude Code
    dropped; the server lost nothing on its own."""
    rows = outcomes["claude-7"].rows("full")
    assert rows[7]["break_cause"] == "history_rewritten"
    assert rows[7]["lost_external"] is None


@e2e
def test_opencode_summaries_are_not_a_prefix_break(outcomes: Outcomes) -> None:
    """opencode-3: each continuation resends the new summary, which is new content."""
    assert outcomes["opencode-3"].findings("full", "prefix_break") == []


@e2e
def test_opencode_compactions_are_compactions(outcomes: Outcomes) -> None:
    """opencode-3: its compaction agent summarises beside the conversation, and the next
    turn continues from that summary, resent as an assistant message: a compaction, not
    a rewritten history charged to the client."""
    for mode in MODES:
        rows = outcomes["opencode-3"].rows(mode)
        compacted = [r for r in rows.values() if r["kind"] == "turn" and r["compaction"]]
        assert compacted, mode
        for r in compacted:
            assert r["lost_client"] is None
            summary = rows[r["id"] - 1]
            assert summary["kind"] == "side_call", (mode, r["id"])
