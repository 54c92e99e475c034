"""R32/R33: what a harness says about itself, and structure without it.

Scenarios in the style of tests/support/scenarios.py: agents on the simulated
llama-server, recorded as the recorder writes them (session values hashed).
The header names are R32's; the client names and values are made up, so the
rules are checked as rules, not as one harness's habits.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis.html import render_html
from llmp.analysis.identity import client_name, conflicts, is_retry, sessions_of
from llmp.live.view import LiveConfig, LiveView
from llmp.recorder.capture import keep_request_headers
from tests.support import scenarios as sc

MODES = ("digest", "full")


def _session(header: str, value: str) -> dict[str, str]:
    return keep_request_headers([(header, value)])


def _rows(tr: sc.Traffic, tmp: Path, mode: str, **kw: Any) -> dict[int, dict[str, Any]]:
    return sc.rows_by_id(sc.analyse(tr, tmp, mode, **kw))


def test_identity_rules_are_pure() -> None:
    assert client_name("python-httpx/0.28.1", {"x-title": "Kilo Code"}) == (
        "Kilo Code (python-httpx/0.28.1)"
    )
    assert client_name("OpenAI/Python 2.20.0", {"originator": "my_bot"}) == (
        "my_bot (OpenAI/Python 2.20.0)"
    )
    # A program's own user-agent is its name already.
    assert client_name("codex_exec/0.171.0", {"originator": "codex_exec"}) == "codex_exec/0.171.0"
    assert client_name(None, {"x-title": "T"}) == "T"
    assert client_name("node-fetch", {}) == "node-fetch"
    assert is_retry({"x-stainless-retry-count": "2"})
    assert not is_retry({"x-stainless-retry-count": "0"})
    assert not is_retry({"x-stainless-retry-count": "x"})
    a = sessions_of({"x-session-id": "fnv1a:1", "x-codex-window-id": "fnv1a:w"})
    assert a == (("x-session-id", "fnv1a:1"),)  # a Codex window is no session (compaction)
    assert conflicts(a, (("x-session-id", "fnv1a:2"),))
    assert not conflicts(a, (("x-session-id", "fnv1a:1"), ("x-affinity", "fnv1a:9")))
    assert not conflicts(a, (("x-affinity", "fnv1a:9"),))  # other headers: no say
    assert not conflicts(a, ())


def _two_runs(headers: tuple[dict[str, str], dict[str, str]] | None) -> sc.Traffic:
    """Two runs of one agent, interleaved on one slot: the same system prompt, tools
    and first request, then each its own question."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua="myagent/2.0", headers=headers[0] if headers else {})
    b = sc.Agent(tr, srv, ua="myagent/2.0", headers=headers[1] if headers else {})
    first = sc.text("look at the repository", 300)
    answer = sc.text("the repository holds", 200)
    a.turn(first, answer)
    b.turn(first, answer)
    for i in range(3):
        a.turn(sc.text(f"question A{i}", 400), sc.text(f"answer A{i}", 300))
        b.turn(sc.text(f"question B{i}", 400), sc.text(f"answer B{i}", 300))
    return tr


@pytest.mark.parametrize("mode", MODES)
def test_session_header_tells_two_runs_apart(tmp_path: Path, mode: str) -> None:
    tr = _two_runs((_session("x-session-id", "s-one"), _session("x-session-id", "s-two")))
    report = sc.analyse(tr, tmp_path, mode)
    rows = sc.rows_by_id(report)
    assert report["coverage"]["conversations"] == 2
    a_ids, b_ids = [1, 3, 5, 7], [2, 4, 6, 8]
    assert len({rows[i]["conversation"] for i in a_ids}) == 1
    assert len({rows[i]["conversation"] for i in b_ids}) == 1
    assert rows[1]["conversation"] != rows[2]["conversation"]
    for ids in (a_ids, b_ids):
        for prev, cur in itertools.pairwise(ids):
            assert rows[cur]["linked_to"] == prev  # each run's turns link within it
            assert rows[cur]["break_cause"] is None
    # Each evicts the other on the one slot: the other conversation's doing.
    lost = [rows[i] for i in a_ids[1:] + b_ids[1:] if rows[i]["lost_external"]]
    assert lost and all(r["cause"] == "other_conversation" for r in lost)
    assert all(r["lost_client"] is None for r in rows.values())
    assert "history_rewritten" not in report["time"]["by_cause"]


def test_one_session_value_does_not_force_one_conversation(tmp_path: Path) -> None:
    """A subagent that sends its parent's session value is still its own conversation."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    same = _session("session_id", "parent")
    parent = sc.Agent(tr, srv, ua="someharness/1", headers=same)
    sc.work(parent, 2)
    child = sc.Agent(tr, srv, ua="someharness/1", headers=same, system="You are a subagent. " * 30)
    sc.work(child, 2, seed="c")
    report = sc.analyse(tr, tmp_path)
    assert report["coverage"]["conversations"] == 2


def test_different_session_values_are_never_one_conversation(tmp_path: Path) -> None:
    """Even when the second run continues the first one's messages exactly."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua="harness-z/3", headers=_session("x-affinity", "one"))
    a.turn(sc.text("q1", 200), sc.text("a1", 200))
    b = sc.Agent(
        tr,
        srv,
        ua="harness-z/3",
        headers=_session("x-affinity", "two"),
        messages=[dict(m) for m in a.messages],
    )
    b.turn(sc.text("q2", 200), sc.text("a2", 200))
    rows = _rows(tr, tmp_path, "digest")
    assert rows[2]["kind"] == "turn"
    assert rows[2]["conversation"] != rows[1]["conversation"]
    assert rows[2]["linked_to"] is None


@pytest.mark.parametrize("mode", MODES)
def test_retry_links_to_its_original(tmp_path: Path, mode: str) -> None:
    """Two runs with the same start: the SDK's retry of one run's request follows that
    request, not the other run's with the same messages."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua="OpenAI/Python 2.20.0")
    sc.work(a, 2)
    body = a.body()
    tr.chat(srv, a.ua, body, {"role": "assistant", "content": "x" * 80})  # 3
    tr.chat(  # 4: the same request again, marked as a retry
        srv,
        a.ua,
        body,
        {"role": "assistant", "content": "x" * 80},
        headers={"x-stainless-retry-count": "1"},
    )
    rows = _rows(tr, tmp_path, mode)
    assert (rows[4]["kind"], rows[4]["linked_to"]) == ("turn", 3)
    assert rows[4]["conversation"] == rows[3]["conversation"] == rows[1]["conversation"]
    assert rows[4]["lost_client"] is None


@pytest.mark.parametrize("mode", MODES)
def test_title_labels_a_generic_user_agent(tmp_path: Path, mode: str) -> None:
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    kilo = sc.Agent(tr, srv, ua="python-httpx/0.28.1", headers={"x-title": "Kilo Code"})
    other = sc.Agent(tr, srv, ua="python-httpx/0.28.1", system="Another program. " * 30, tools=None)
    sc.work(kilo, 2)
    other.turn(sc.text("hello", 100), sc.text("hi", 100))
    report = sc.analyse(tr, tmp_path, mode)
    clients = {c["client"]: c for c in report["clients"]}
    assert set(clients) == {"Kilo Code (python-httpx/0.28.1)", "python-httpx/0.28.1"}
    assert clients["Kilo Code (python-httpx/0.28.1)"]["user_agent"] == "python-httpx/0.28.1"
    rows = sc.rows_by_id(report)
    assert rows[1]["client"] == "Kilo Code (python-httpx/0.28.1)"
    assert rows[3]["client"] == "python-httpx/0.28.1"


def _two_agents_one_ua() -> sc.Traffic:
    """Two plain chat agents behind one SDK user-agent, no headers: the second one's
    first request has every mark of a one-off side-call of the first."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    ua = "python-httpx/0.27.0"
    a = sc.Agent(tr, srv, ua=ua, tools=None, system="You are a poet. " * 40)
    b = sc.Agent(tr, srv, ua=ua, tools=None, system="You translate into French. " * 30)
    a.turn(sc.text("a poem about rain", 200), sc.text("rain poem", 400))  # 1
    b.turn(sc.text("translate this text", 200), sc.text("traduction", 400))  # 2
    for i in range(3):
        a.turn(sc.text(f"another poem {i}", 200), sc.text(f"poem {i}", 400))
        b.turn(sc.text(f"translate {i}", 200), sc.text(f"traduction {i}", 400))
    return tr


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_request_a_later_one_continues_starts_a_conversation(
    tmp_path: Path, mode: str, jobs: int
) -> None:
    report = sc.analyse(_two_agents_one_ua(), tmp_path, mode, jobs=jobs)
    rows = sc.rows_by_id(report)
    assert report["coverage"]["conversations"] == 2
    assert all(r["kind"] == "turn" for r in rows.values())
    assert (rows[2]["conversation"], rows[2]["turn"]) == (2, 1)
    for cur, prev in ((4, 2), (6, 4), (8, 6), (3, 1), (5, 3)):
        assert rows[cur]["linked_to"] == prev
    # What B's first request took from A's cache is another conversation's doing.
    assert rows[3]["side_calls_between"] == [] and rows[3]["other_conversations_between"] == [2]
    assert rows[3]["cause"] == "other_conversation"
    assert "side_call" not in report["time"]["by_cause"]
    assert not [f for f in report["findings"] if f["kind"] == "side_call_on_conversation_model"]


def test_a_side_call_nobody_continues_stays_one(tmp_path: Path) -> None:
    rows = _rows(sc.title_side_call(), tmp_path, "digest")
    assert any(r["kind"] == "side_call" for r in rows.values())


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_two_runs_without_headers_are_told_apart_by_what_each_continues(
    tmp_path: Path, mode: str, jobs: int
) -> None:
    """The same two runs, no session header: the same start, then each run's turns
    continue its own line; neither is charged for rewriting the other's history."""
    report = sc.analyse(_two_runs(None), tmp_path, mode, jobs=jobs)
    rows = sc.rows_by_id(report)
    assert report["coverage"]["conversations"] == 2
    a_ids, b_ids = [3, 5, 7], [4, 6, 8]
    assert len({rows[i]["conversation"] for i in a_ids}) == 1
    assert len({rows[i]["conversation"] for i in b_ids}) == 1
    assert rows[3]["conversation"] != rows[4]["conversation"]
    for ids in (a_ids, b_ids):
        for prev, cur in itertools.pairwise(ids):
            assert rows[cur]["linked_to"] == prev
    assert all(r["break_cause"] is None and r["lost_client"] is None for r in rows.values())
    assert "history_rewritten" not in report["time"]["by_cause"]
    lost = [rows[i] for i in a_ids[1:] + b_ids[1:] if rows[i]["lost_external"]]
    assert lost and all(r["cause"] == "other_conversation" for r in lost)


def test_a_rewrite_nobody_goes_back_on_stays_one_conversation(tmp_path: Path) -> None:
    report = sc.analyse(sc.rewritten_history(), tmp_path)
    assert report["coverage"]["conversations"] == 1
    assert "history_rewritten" in report["time"]["by_cause"]


def test_two_first_turns_held_at_once_both_come_out(tmp_path: Path) -> None:
    """Two clients' first one-off-looking turns in a row: the first one held back for
    its client's next move is not lost when the second one is held."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    a = sc.Agent(tr, srv, ua="client-a/1", tools=None, system="")
    b = sc.Agent(tr, srv, ua="client-b/1", tools=None)
    a.turn(sc.text("hello there", 80), sc.text("hi", 100))
    b.turn(sc.text("good morning", 80), sc.text("morning", 100))
    for jobs in (1, 2):
        report = sc.analyse(tr, tmp_path, jobs=jobs)
        assert [r["id"] for r in report["rows"]] == [1, 2]
        assert report["coverage"]["analysed"] == 2


def test_live_view_metrics_and_page_name_the_harness(tmp_path: Path) -> None:
    """The name a generic user-agent gets from `x-title` is the client in the live
    view's lines, in `/_llmp/metrics` and on the HTML page."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    kilo = sc.Agent(tr, srv, ua="python-httpx/0.28.1", headers={"x-title": "Kilo Code"})
    sc.work(kilo, 3)
    name = "Kilo Code (python-httpx/0.28.1)"
    view = LiveView(LiveConfig(), body="digest")
    for line in tr.lines("digest", "end"):
        view.on_record(orjson.loads(line))
    metrics = view.metrics_text(written=3, failed=0).decode()
    view.close()
    assert f'client="{name}"' in metrics
    page = render_html(sc.analyse(tr, tmp_path))
    assert name in page
