"""The analysis of Claude Code (`/v1/messages`) and Codex (`/v1/responses`) traffic.

Each scenario is built by `tests/support/scenarios.py` from the bodies those
agents really send and the responses llama-server really gives (R21-R29), and
analysed from its digest and from its full recording: the rows must carry the
fake server's own counters, link one conversation across turns whose markers
and block forms moved, and name what broke where something did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmp.analysis.findings import VOLATILE_HEAD
from llmp.apis import api_for
from tests.support import scenarios as sc
from tests.support.scenarios import analyse, rows_by_id, value


@pytest.fixture(params=["digest", "full"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def findings(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["kind"] == kind]


def check_counts(report: dict[str, Any], traffic: sc.NewApiTraffic) -> None:
    """Every row's counters are the fake server's, with source `server`."""
    rows = report["rows"]
    assert {r["id"] for r in rows} == set(traffic.outcomes)
    for row in rows:
        out = traffic.outcomes[row["id"]]
        c = row["counts"]
        for key, want in (
            ("prompt_tokens", out.prompt),
            ("reused_tokens", out.cache_n),
            ("evaluated_tokens", out.prompt - out.cache_n),
            ("completion_tokens", out.n_gen),
        ):
            assert c[key] == {"value": want, "source": "server"}, (row["id"], key)


def check_prefill(report: dict[str, Any], traffic: sc.NewApiTraffic) -> None:
    """/v1/messages has no timings: a streamed row's prefill is the proxy's, from the first
    event (R28), not from the keep-alive's first byte; Responses streams carry `timings`."""
    records = {r["id"]: r for r in traffic.records}
    for row in report["rows"]:
        rec = records[row["id"]]
        pre = row["counts"]["prefill_ms"]
        streamed = rec["response"]["stream"] == "sse"
        if not streamed:
            assert pre is None, row["id"]
        elif row["api"] == "anthropic_messages":
            wait = rec["t_first_event_ms"] - rec["t_start_ms"]
            assert rec["t_first_byte_ms"] - rec["t_start_ms"] < wait
            assert pre == {"value": wait, "source": "proxy"}, row["id"]
        else:
            out = traffic.outcomes[row["id"]]
            assert pre == {"value": out.prompt_ms, "source": "server"}, row["id"]


def one_conversation(report: dict[str, Any], ids: list[int]) -> None:
    rows = rows_by_id(report)
    turns = [rows[i] for i in ids]
    assert all(r["kind"] == "turn" and r["conversation"] == 1 for r in turns)
    assert [r["turn"] for r in turns] == list(range(1, len(ids) + 1))
    assert [r["linked_to"] for r in turns] == [None, *ids[:-1]]


def clean(row: dict[str, Any]) -> None:
    """Nothing changed and nothing was lost."""
    assert row["break_cause"] is None and not row["new_conversation"], row
    assert row["lost_client"] is None and row["lost_external"] is None and row["cause"] is None
    assert row["changed"] is None


# -- Claude Code ------------------------------------------------------------------------------


def test_claude_code_bodies_are_what_claude_code_sends() -> None:
    """The scenario really moves the markers and the block forms the analysis must ignore."""
    tr = sc.claude_code_session()
    bodies = {r["id"]: r["request"]["body"] for r in tr.records}
    first, second = bodies[1], bodies[2]
    assert [r["request"]["path"] for r in tr.records].count("/v1/messages?beta=true") == 10
    assert first["system"][0] == {"type": "text", "text": sc.billing_header("7c2")}
    assert [b.get("cache_control") for b in first["system"]] == [None, sc.EPHEMERAL, sc.EPHEMERAL]
    # The latest user message: one text block with the marker, then a plain string.
    assert first["messages"][0]["content"][0]["cache_control"] == sc.EPHEMERAL
    assert isinstance(second["messages"][0]["content"], str)
    assert [b["type"] for b in second["messages"][1]["content"]] == [
        "thinking",
        "text",
        "tool_use",
    ]
    assert second["messages"][2]["content"][0]["type"] == "tool_result"
    # The reminder after it, a `role: "system"` entry: last, with the marker; then a string.
    reminder = second["messages"][3]
    assert reminder["role"] == "system"
    assert reminder["content"][0]["cache_control"] == sc.EPHEMERAL
    assert isinstance(bodies[4]["messages"][3]["content"], str)
    # The 400 was retried at once with the same body.
    assert bodies[6] == bodies[7] and tr.records[6]["response"]["status"] == 400
    assert bodies[9]["system"][0]["text"] == sc.billing_header("119")
    assert bodies[9]["system"][1:] == bodies[5]["system"][1:]


def test_claude_code_session(tmp_path: Path, mode: str) -> None:
    tr = sc.claude_code_session()
    rep = analyse(tr, tmp_path, mode)
    rows = rows_by_id(rep)
    assert sorted(rows) == [1, 2, 4, 5, 8, 9, 10, 11]
    assert {r["api"] for r in rep["rows"]} == {"anthropic_messages"}
    assert all(r["model"] == sc.CLAUDE_MODEL for r in rep["rows"])
    check_counts(rep, tr)
    check_prefill(rep, tr)
    # One conversation, across moving markers, string/block changes and the compaction.
    one_conversation(rep, [1, 2, 4, 5, 9, 10, 11])
    for i in (2, 4, 5, 10, 11):
        clean(rows[i])
        assert rows[i]["observed_reuse"] is not None and rows[i]["observed_reuse"] > 0.8
    assert rows[8]["kind"] == "side_call" and rows[8]["side_call_shape"] == "summarise"
    # The compaction: a new attribution line, a summary for history. The summary is a new
    # start, charged nothing; the new attribution line made the server re-read the system
    # prompt and tools behind it, charged on the row (R38) and sized into `volatile_head`.
    compacted = rows[9]
    assert compacted["compaction"] and compacted["break_cause"] == "system_changed"
    assert compacted["lost_external"] is None
    volatile = compacted["lost_client"]
    assert volatile is not None and volatile["cause"] == "system_changed"
    assert volatile["tokens"] > 0

    cov = rep["coverage"]
    assert cov["records"] == 11 and cov["analysed"] == 8
    assert cov["skipped"] == {"not_chat": 1, "error": 0, "non_2xx": 2, "unparsed": 0}
    assert cov["paths"] == {"/v1/messages/count_tokens": 1}
    assert cov["context_exceeded"] == 2 and cov["previous_response"] == 0
    assert (cov["turns"], cov["conversations"], cov["turns_with_timing"]) == (7, 1, 7)
    assert rep["servers"] == [
        {
            "api": "anthropic_messages",
            "server": "unknown",
            "fields": ["prompt_tokens", "completion_tokens", "reused_tokens", "evaluated_tokens"],
        }
    ]
    assert value(rep["time"]["prefill_ms"]) == sum(
        value(r["counts"]["prefill_ms"]) for r in rep["rows"] if r["counts"]["prefill_ms"]
    )
    assert rep["time"]["lost_tokens"] == volatile["tokens"]
    assert list(rep["time"]["by_cause"]) == ["system_changed"]
    (head,) = [f for f in rep["findings"] if f["kind"] == "volatile_head"]
    assert head["rows"] == [9] and head["lost_tokens"] == volatile["tokens"]

    # The retried 400: once per record, one context finding; the full body says why.
    (ctx,) = findings(rep, "context_overflow")
    ev = ctx["evidence"]
    assert ev["refused"] == 2 and ev["refused_ids"] == [6, 7]
    if mode == "full":
        assert ev["refused_from"] == "body" and ev["n_ctx"] == 8192
        assert ev["sent"] == {"value": 12410, "source": "server"}
        assert ctx["confidence"] == "high" and ctx["context_tokens"] == 8192
    else:  # digest mode keeps no error body: only the status and the prompt's size
        assert ev["refused_from"] == "status" and ev["n_ctx"] is None
        assert ev["sent"]["source"] == "estimate" and ev["sent"]["value"] > 10000
        assert ctx["confidence"] == "low"

    # The volatile head: only the attribution line changed; the rest was read again.
    (vol,) = findings(rep, VOLATILE_HEAD)
    assert vol["rows"] == [9] and vol["client"] == sc.CLAUDE_UA
    assert vol["model"] == tr.records[8]["response"]["body"]["model"]
    assert vol["confidence"] == "high"
    evaluated = value(compacted["counts"]["evaluated_tokens"])
    assert 0.7 * evaluated < vol["lost_tokens"] <= evaluated
    ms = value(vol["lost_ms"])
    assert ms == pytest.approx(
        vol["lost_tokens"] * value(compacted["counts"]["prefill_ms"]) / evaluated, rel=1e-3
    )
    ve = vol["evidence"]
    assert (ve["conversations"], ve["compactions"]) == (0, 1)
    assert ve["changed"] == {"index": 0, "role": "system", "within": "first_256"}
    tip = ve["advice"]
    assert tip["harness"] == "Claude Code" and tip["confidence"] == "high"
    assert "CLAUDE_CODE_ATTRIBUTION_HEADER" in tip["text"]
    assert tip["because"] == (
        "the changed text is the attribution line"  # the text is in the full record
        if mode == "full"
        else "Claude Code's first system block, a short one, changed"
    )
    assert not findings(rep, "prefix_break")

    (client,) = rep["clients"]
    assert client["client"] == client["user_agent"] == sc.CLAUDE_UA
    assert (client["requests"], client["conversations"]) == (8, 1)
    assert client["tools"] == ["Bash", "Read", "Edit", "Grep"]
    tools = {t["name"]: t for t in rep["tools"]}
    assert {n: (t["offered"], t["called"]) for n, t in tools.items()} == {
        "Bash": (7, 0),
        "Read": (7, 1),
        "Edit": (7, 0),
        "Grep": (7, 2),
    }


def test_full_and_digest_agree(tmp_path: Path) -> None:
    """The same traffic gives the same rows from full bodies as from the recorder's digests."""
    for build in (sc.claude_code_session, sc.claude_code_system_edit, sc.codex_session):
        tr = build()
        full, digest = analyse(tr, tmp_path, "full"), analyse(tr, tmp_path, "digest")
        for f, d in zip(full["rows"], digest["rows"], strict=True):
            for where in f["changed"] or []:  # only full mode has the text around a change
                for key in ("offset", "context", "was"):
                    where[key] = None
            assert f == d


def test_a_moved_marker_is_no_change(tmp_path: Path) -> None:
    """The digest ignores `cache_control` and the string/block form (R22): the messages of
    a turn hash as they did when the previous turn sent them."""
    tr = sc.claude_code_session()
    digests = {
        r["id"]: api_for("POST", r["request"]["path"]).request_digest(  # type: ignore[union-attr]
            r["request"]["body"]
        )
        for r in tr.records
        if r["id"] in (1, 2, 4)
    }
    one, two, four = (digests[i]["messages"] for i in (1, 2, 4))
    assert [m["hash"] for m in two[: len(one)]] == [m["hash"] for m in one]
    assert [m["hash"] for m in four[: len(two)]] == [m["hash"] for m in two]
    assert [m["role"] for m in two] == ["system"] * 3 + ["user", "assistant", "user", "system"]


def test_claude_code_system_block_changed(tmp_path: Path, mode: str) -> None:
    """A line added in the middle of the long instructions: a prefix break, naming block 2."""
    tr = sc.claude_code_system_edit()
    rep = analyse(tr, tmp_path, mode)
    rows = rows_by_id(rep)
    check_counts(rep, tr)
    one_conversation(rep, [1, 2, 3, 4])
    clean(rows[2])
    clean(rows[4])
    broken = rows[3]
    assert broken["break_cause"] == "system_changed" and broken["cause"] == "structural"
    lost = broken["lost_client"]
    evaluated = value(broken["counts"]["evaluated_tokens"])
    assert lost["cause"] == "system_changed" and 0.8 * evaluated < lost["tokens"] < evaluated
    (where,) = broken["changed"]
    assert (where["index"], where["role"], where["within"]) == (2, "system", "between")
    assert where["chars_after"] - where["chars_before"] == len(" Use pnpm, not npm. ")

    (brk,) = findings(rep, "prefix_break")
    assert brk["rows"] == [3] and brk["client"] == sc.CLAUDE_UA
    assert brk["lost_tokens"] == lost["tokens"]
    (changed,) = brk["evidence"]["changed"]
    assert (changed["index"], changed["role"], changed["within"], changed["rows"]) == (
        2,
        "system",
        "between",
        1,
    )
    if mode == "full":
        assert "Use pnpm, not npm." in changed["context"]
        assert "Use pnpm" not in changed["was"]
        assert changed["offset"] == len(sc.CLAUDE_INSTRUCTIONS) // 2
    else:
        assert "offset" not in changed and "context" not in changed  # no text in a digest
    assert brk["evidence"]["advice"]["harness"] == "Claude Code"
    assert not findings(rep, VOLATILE_HEAD)  # block 2 is no head


# -- Codex ------------------------------------------------------------------------------------


def test_codex_bodies_are_what_codex_sends() -> None:
    tr = sc.codex_session()
    bodies = [r["request"]["body"] for r in tr.records]
    assert all(r["request"]["path"] == "/v1/responses" for r in tr.records)
    assert all("instructions" not in b and b["store"] is False for b in bodies)
    assert bodies[0]["input"][0]["role"] == "developer"
    assert "<environment_context>" in bodies[0]["input"][1]["content"][0]["text"]
    assert bodies[0]["tools"][0]["type"] == "function" and "name" in bodies[0]["tools"][0]
    kinds = [i.get("type") for i in bodies[3]["input"]]
    assert kinds.count("function_call") == 2 and kinds.count("function_call_output") == 2
    assert kinds.count("reasoning") == 3
    metadata = [b["client_metadata"]["turn_id"] for b in bodies]
    assert len(set(metadata)) == 4  # changes every turn


@pytest.mark.parametrize("stream", [True, False])
def test_codex_session(tmp_path: Path, mode: str, stream: bool) -> None:
    tr = sc.codex_session(stream=stream)
    rep = analyse(tr, tmp_path, mode)
    rows = rows_by_id(rep)
    assert {r["api"] for r in rep["rows"]} == {"openai_responses"}
    check_counts(rep, tr)
    check_prefill(rep, tr)
    one_conversation(rep, [1, 2, 3, 4])
    for i in (2, 3, 4):
        clean(rows[i])
    assert rep["findings"] == []
    assert rep["coverage"]["turns_with_timing"] == (4 if stream else 0)
    fields = ["prompt_tokens", "completion_tokens", "reused_tokens", "evaluated_tokens"]
    if stream:
        fields += ["prefill_ms", "decode_ms"]
    server = "llama-server" if stream else "unknown"  # its timings name it, when streamed
    assert rep["servers"] == [{"api": "openai_responses", "server": server, "fields": fields}]
    (client,) = rep["clients"]
    assert client["client"] == sc.CODEX_UA and client["conversations"] == 1
    assert client["tools"] == ["exec_command", "write_stdin", "apply_patch", "update_plan"]
    called = {t["name"]: t["called"] for t in rep["tools"]}
    assert called == {"exec_command": 2, "write_stdin": 0, "apply_patch": 0, "update_plan": 0}


def test_previous_response_id_is_stateless(tmp_path: Path, mode: str) -> None:
    """The second request carries only its new items: it cannot be compared by its messages."""
    tr = sc.codex_stateful()
    assert tr.records[1]["request"]["body"]["previous_response_id"] == "resp_" + "1".zfill(32)
    assert len(tr.records[1]["request"]["body"]["input"]) == 1
    rep = analyse(tr, tmp_path, mode)
    rows = rows_by_id(rep)
    check_counts(rep, tr)
    assert rows[1]["kind"] == "turn" and rows[1]["conversation"] == 1
    stored = rows[2]
    assert stored["kind"] == "stateless"
    assert stored["conversation"] is None and stored["linked_to"] is None
    assert stored["lost_client"] is None and stored["lost_external"] is None
    cov = rep["coverage"]
    assert cov["previous_response"] == 1
    assert (cov["turns"], cov["conversations"], cov["analysed"]) == (1, 1, 2)
    assert value(rep["time"]["prefill_ms"]) == sum(
        tr.outcomes[i].prompt_ms for i in (1, 2)
    )  # its time still counts


def test_both_agents_on_one_slot(tmp_path: Path, mode: str) -> None:
    """Claude Code and Codex take turns on a one-slot server: each evicts the other."""
    tr = sc.both_agents()
    rep = analyse(tr, tmp_path, mode)
    rows = rows_by_id(rep)
    check_counts(rep, tr)
    check_prefill(rep, tr)
    assert [rows[i]["api"] for i in range(1, 9)] == ["anthropic_messages"] * 2 + [
        "openai_responses"
    ] * 2 + ["anthropic_messages"] * 2 + ["openai_responses"] * 2
    assert [rows[i]["conversation"] for i in range(1, 9)] == [1, 1, 2, 2, 1, 1, 2, 2]
    for i in (5, 7):
        assert rows[i]["cause"] == "other_conversation" and rows[i]["break_cause"] is None
        assert rows[i]["other_conversations_between"] == [i - 2, i - 1]
        assert rows[i]["lost_external"]["cause"] == "other_conversation"
    for i in (2, 4, 6, 8):
        clean(rows[i])
    (ev,) = findings(rep, "other_conversation_eviction")
    assert ev["rows"] == [5, 7]
    assert ev["evidence"]["clients"] == [sc.CLAUDE_UA, sc.CODEX_UA]
    assert [c["client"] for c in rep["clients"]] == [sc.CLAUDE_UA, sc.CODEX_UA]
    # One entry per API and server: llama-server's timings (on /v1/responses) name the
    # server of the model both APIs share from the first row that carries them.
    assert sorted({s["api"] for s in rep["servers"]}) == ["anthropic_messages", "openai_responses"]
    assert {s["server"] for s in rep["servers"] if s["api"] == "openai_responses"} == {
        "llama-server"
    }
