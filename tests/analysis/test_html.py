"""`llmp analyze --html`: the page's structure, its privacy, and a real headless Chromium."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis import analyze
from llmp.analysis.causes import WORDS as CAUSE_WORDS
from llmp.analysis.changes import MAX_CHANGES
from llmp.analysis.html import CAUSES, MAX_BARS, is_break, write_html
from llmp.cli import main
from tests.support import scenarios as sc
from tests.support.html_checks import (
    Tree,
    check_self_contained,
    check_structure,
    collect_changes,
)
from tests.support.scenarios import (
    CODING_TOOLS,
    SYSTEM,
    Agent,
    LlamaServer,
    Traffic,
    text,
    tool,
    work,
)

# Text that only ever appears inside message contents or tool definitions.
MARKERS = (
    "MARKER-SYSTEM-7f3a",
    "MARKER-USER-91c2",
    "MARKER-REPLY-55d0",
    "MARKER-TOOLRESULT-2be4",
    "MARKER-TOOLDESC-0b1e",
    "quick brown fox",  # scenarios.text() filler
    "You are a coding agent",  # scenarios.SYSTEM
)

# -- recordings ----------------------------------------------------------------


def tour(tr: Traffic | None = None) -> Traffic:
    """Two clients on one llama-server, with every client break and two external losses."""
    tr = tr or Traffic()
    srv = LlamaServer()
    tools = [
        tool("read_file", "MARKER-TOOLDESC-0b1e Read a file.", path="string"),
        *CODING_TOOLS[1:],
    ]
    a = Agent(tr, srv, system=SYSTEM + " MARKER-SYSTEM-7f3a", tools=tools)
    a.turn("MARKER-USER-91c2 " + text("ask", 300), "MARKER-REPLY-55d0 " + text("answer", 300))
    a.tool_step(text("look", 100), "read_file", {"path": "a.py"}, "MARKER-TOOLRESULT-2be4 ")
    work(a, 2)
    a.side_call(
        "You generate a short title for a conversation.",
        text("t0 ask", 200),
        "Fix the parser",
        max_tokens=32,
    )
    work(a, 2, seed="u")  # side_call
    a.messages[0] = {"role": "system", "content": SYSTEM + " Today is 2026-08-21."}
    work(a, 2, seed="v")  # system_changed
    b = Agent(tr, srv, ua="aider/0.86.1", system="Act as an expert developer. " * 30)
    work(b, 3, seed="b")
    b.tools = [
        *CODING_TOOLS[:2],
        tool("grep", "Search with grep.", pattern="string"),
        *CODING_TOOLS[2:],
    ]
    work(b, 2, seed="c")  # tools_changed
    b.messages[3] = {
        "role": "tool",
        "tool_call_id": b.messages[3]["tool_call_id"],
        "content": text("b0 file v2", 600),
    }
    work(b, 2, seed="d")  # history_rewritten
    srv.reset()
    work(b, 2, seed="e")  # server_empty
    work(a, 2, seed="w")  # other_conversation: b evicted a's prompt
    return tr


def report_of(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The report exactly as `llmp analyze --json` prints it."""
    capsys.readouterr()
    assert main(["analyze", str(path), "--json"]) == 0
    rep: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return rep


def page(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    traffic: Traffic,
    mode: str = "digest",
    name: str = "page",
    **kw: Any,
) -> tuple[Path, dict[str, Any], list[dict[str, Any]], str]:
    rec = traffic.write(tmp_path / f"{name}-{mode}.jsonl", mode)
    rep = report_of(rec, capsys)
    changes = collect_changes([str(rec)], rep, **kw)
    out = tmp_path / f"{name}-{mode}.html"
    write_html(rep, out, changes=changes, title="llmp test page")
    return out, rep, changes, out.read_text(encoding="utf-8")


# -- parsing the page ----------------------------------------------------------


# -- the page ------------------------------------------------------------------


def test_page_structure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, rep, changes, source = page(tmp_path, capsys, tour())
    assert set(rep["time"]["by_cause"]) == {
        "side_call",
        "system_changed",
        "other_conversation",
        "tools_changed",
        "history_rewritten",
        "server_empty",
    }
    tree = Tree(source)
    assert tree.decl == ["DOCTYPE html"]
    check_self_contained(tree, source)
    check_structure(tree, rep, changes)
    assert tree.root.find("title")[0].all_text() == "llmp test page"


def test_no_message_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Full, digest and mixed recordings of the same traffic give the same page, without text."""
    pages = {}
    for mode in ("full", "digest", "mixed"):
        rec = tour().write(tmp_path / f"{mode}.jsonl", mode)
        if mode == "full":
            raw = rec.read_text()
            assert all(m in raw for m in MARKERS), "the recording does hold the markers"
        _, _, _, source = page(tmp_path, capsys, tour(), mode)
        for marker in MARKERS:
            assert marker not in source, (mode, marker)
        pages[mode] = source
    # Full mode knows at which character a message changed and what the text looks like:
    # the page shows the offset and a surer advice, never the text.
    full = pages["full"]
    assert "at character" in full and "at character" not in pages["digest"]
    for mode, source in pages.items():
        source = re.sub(r" \(at character [\d,]+\)|, at character [\d,]+", "", source)
        pages[mode] = re.sub(r" \((high|medium|low) confidence: [^)]*\)", "", source)
    assert pages["full"] == pages["digest"] == pages["mixed"]


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_scenario(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every scenario of the analyzer's tests draws a complete page (full mode: the worst case)."""
    _, rep, changes, source = page(tmp_path, capsys, sc.SCENARIOS[name](), "full")
    tree = Tree(source)
    check_self_contained(tree, source)
    check_structure(tree, rep, changes)
    assert all(c["found"] for c in changes)
    for marker in MARKERS:
        assert marker not in source


def test_what_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, changes, source = page(tmp_path, capsys, tour())
    by_cause = {c["break_cause"] or c["cause"]: c for c in changes}
    assert all(c["found"] for c in changes)

    sysc = by_cause["system_changed"]
    assert sysc["broke_at"] == {"part": "system", "index": 0}
    ops = [o["op"] for o in sysc["messages"]]
    assert ops[0] == "changed" and sysc["messages"][0]["after"]["role"] == "system"
    assert set(ops[1:]) <= {"kept", "added"} and ops[-1] == "added"
    assert sysc["tools"]["before"] == sysc["tools"]["after"]

    tools = by_cause["tools_changed"]
    assert tools["broke_at"] == {"part": "tools", "index": None}
    assert tools["tools"]["added"] == ["grep"] and not tools["tools"]["removed"]
    assert (tools["tools"]["count_before"], tools["tools"]["count_after"]) == (4, 5)
    assert {o["op"] for o in tools["messages"]} == {"kept", "added"}

    hist = by_cause["history_rewritten"]
    assert hist["broke_at"] == {"part": "history", "index": 3}
    changed = [o for o in hist["messages"] if o["op"] == "changed"]
    assert len(changed) == 1 and changed[0]["after"]["role"] == "tool"
    assert changed[0]["before"]["hash"] != changed[0]["after"]["hash"]
    assert changed[0]["before"]["index"] == changed[0]["after"]["index"] == 3

    side = by_cause["side_call"]
    assert side["broke_at"] == {"part": None, "index": None}
    assert side["between"]["side_calls"] and side["break_cause"] is None
    assert {o["op"] for o in side["messages"]} == {"kept", "added"}

    # The page shows each diff: the first broken line is marked, tools get their line.
    tree = Tree(source)
    blocks = {int(b.attrs["data-row"]): b for b in tree.root.find("section", "change")}
    block = blocks[sysc["id"]]
    first = block.find("tr", "first")
    assert len(first) == 1 and "changed" in first[0].classes and "system" in first[0].all_text()
    short = sysc["messages"][0]["after"]["hash"][:8]
    assert short in first[0].all_text()
    tline = blocks[tools["id"]].find("tr", "tools")
    assert len(tline) == 1 and "first" in tline[0].classes and "+grep" in tline[0].all_text()
    assert "Broke at the tools block" in blocks[tools["id"]].all_text()
    assert "Broke at message 3, in the history" in blocks[hist["id"]].all_text()
    assert "1 side-call" in blocks[side["id"]].all_text()
    # Long unchanged runs are folded.
    assert any(block.find("tr", "skip") for block in blocks.values())


def test_compaction_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, rep, changes, source = page(tmp_path, capsys, sc.compaction())
    (c,) = changes
    assert c["compaction"] and c["break_cause"] == "history_rewritten"
    ops = [o["op"] for o in c["messages"]]
    assert "removed" in ops and ops[0] == "kept"
    assert "a compaction: not charged to the client" in source
    check_structure(Tree(source), rep, changes)


def test_limit_and_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two sessions with the same ids keep their diffs apart; `limit` keeps the largest losses."""
    first = sc.changed_system()
    second = Traffic(t=first.t + 3_600_000)
    a = Agent(second, LlamaServer())
    work(a, 3)
    a.messages[0] = {"role": "system", "content": SYSTEM + " Now."}
    work(a, 2, seed="u")
    rec = tmp_path / "two.jsonl"
    rec.write_bytes(b"".join(first.lines() + second.lines()))
    rep = report_of(rec, capsys)
    changes = collect_changes([str(rec)], rep)
    assert [(c["session"], c["id"]) for c in changes] == [(1, 4), (2, 4)]
    assert changes[0]["messages"] != changes[1]["messages"]
    out = tmp_path / "two.html"
    write_html(rep, out, changes=changes)
    tree = Tree(out.read_text())
    check_structure(tree, rep, changes)
    assert {b.attrs["id"] for b in tree.root.find("section", "change")} == {
        "change-s1-4",
        "change-s2-4",
    }

    top = collect_changes([str(rec)], rep, limit=1)
    assert len(top) == 1
    lost = {(r["session"], r["id"]): r["lost_client"]["tokens"] for r in rep["rows"] if is_break(r)}
    assert lost[(top[0]["session"], top[0]["id"])] == max(lost.values())
    write_html(rep, out, changes=top)
    assert "Showing 1 of 2 turns" in out.read_text()


def test_escaping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Client and tool names come from traffic: they are text, never markup."""
    tr = Traffic()
    evil_ua = '<script>alert("ua")</script>'
    evil_tool = '"><img src=x onerror=alert(1)>'
    a = Agent(
        tr,
        LlamaServer(),
        ua=evil_ua,
        tools=[tool(evil_tool, "A tool.", x="string"), *CODING_TOOLS[:1]],
    )
    work(a, 3)
    a.messages[0] = {"role": "system", "content": SYSTEM + " changed"}
    work(a, 2, seed="u")
    _, rep, changes, source = page(tmp_path, capsys, tr)
    tree = Tree(source)
    check_self_contained(tree, source)
    assert not {"script", "img"} & set(tree.tags)
    text_all = tree.root.all_text()
    assert evil_ua in text_all and evil_tool in text_all
    assert [d.attrs["data-client"] for d in tree.root.find("div", "client")] == [evil_ua]
    check_structure(tree, rep, changes)


def test_without_changes_and_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = sc.changed_system().write(tmp_path / "r.jsonl")
    rep = report_of(rec, capsys)
    out = tmp_path / "a.html"
    write_html(rep, out)  # no diffs collected
    source = out.read_text()
    assert "the diffs were not collected" in source.replace("\n", " ")
    assert not Tree(source).root.find("section", "change")

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    rep = report_of(empty, capsys)
    assert collect_changes([str(empty)], rep) == []
    write_html(rep, out, changes=[])
    tree = Tree(out.read_text())
    assert "The recording holds no records." in tree.root.all_text()
    assert not tree.root.find("g", "turn")

    # Standard input is read once, and the diffs come from that one pass.
    rec_stdin = sc.changed_system().lines("digest")
    result = analyze(["-"], rows=False, changes=MAX_CHANGES, stdin=io.BytesIO(b"".join(rec_stdin)))
    from_stdin = result.change_list()
    result.close()
    assert from_stdin and from_stdin == collect_changes([str(rec)])


def synthetic_report(conversations: int, turns_each: int) -> dict[str, Any]:
    """A report v1 with many turns, for the page's limits (no recording needed)."""
    rows = []
    rid = 0
    for conv in range(1, conversations + 1):
        for turn in range(1, turns_each + 1):
            rid += 1
            lost = (
                {"cause": "side_call", "tokens": 100, "ms": {"value": 20.0, "source": "server"}}
                if turn % 7 == 0
                else None
            )
            rows.append(
                {
                    "id": rid,
                    "client": "c",
                    "model": "m",
                    "kind": "turn",
                    "session": 1,
                    "conversation": conv,
                    "turn": turn,
                    "t_start_ms": sc.T0 + rid,
                    "counts": {
                        "prompt_tokens": {"value": 10 * turn, "source": "server"},
                        "reused_tokens": {"value": 10 * turn - 10, "source": "server"},
                        "evaluated_tokens": {"value": 10, "source": "server"},
                        "prefill_ms": {"value": 5.0, "source": "server"},
                    },
                    "linked_to": rid - 1 if turn > 1 else None,
                    "break_cause": None,
                    "lost_client": None,
                    "lost_external": lost,
                }
            )
    return {
        "v": 1,
        "window": {"start_ms": sc.T0, "end_ms": sc.T0 + rid, "days": 0.0},
        "coverage": {"records": rid, "analysed": rid, "turns": rid, "conversations": conversations},
        "time": {
            "prefill_ms": {"value": 5.0 * rid, "source": "server"},
            "lost_ms": None,
            "lost_tokens": 0,
            "by_cause": {},
        },
        "clients": [
            {"client": "c", "user_agent": "c", "requests": rid, "conversations": 1, "tools": []}
        ],
        "tools": [],
        "findings": [],
        "rows": rows,
    }


def test_long_conversation_is_bucketed(tmp_path: Path) -> None:
    rep = synthetic_report(1, 1000)
    out = tmp_path / "long.html"
    write_html(rep, out, changes=[])
    bars = Tree(out.read_text()).root.find("g", "turn")
    assert len(bars) <= MAX_BARS
    assert int(bars[0].attrs["data-turn"]) == 1 and int(bars[-1].attrs["data-last-turn"]) == 1000
    assert "Each bar sums 3 consecutive turns." in out.read_text()


def test_many_conversations_are_listed(tmp_path: Path) -> None:
    from llmp.analysis.html import MAX_CHARTS

    rep = synthetic_report(MAX_CHARTS + 5, 8)
    out = tmp_path / "many.html"
    write_html(rep, out, changes=[])
    tree = Tree(out.read_text())
    assert len(tree.root.find("svg", "timeline")) == MAX_CHARTS
    assert "5 more conversations" in tree.root.all_text()


def test_cause_colours_are_distinct() -> None:
    colours = [c.lower() for c in CAUSES.values()]
    assert len(set(colours)) == len(colours)
    assert set(CAUSES) == set(CAUSE_WORDS)


# -- a real headless Chromium ----------------------------------------------------

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)"
)

CONSOLE = re.compile(r":CONSOLE[(:]|Uncaught|Content Security Policy|Refused to")


def chromium(page_path: Path, tmp: Path, *extra: str) -> tuple[str, list[str]]:
    """Load the page in headless Chromium; its DOM after load and its console messages.

    Chromium writes every console message (and every uncaught exception) to
    stderr as `INFO:CONSOLE...` with --enable-logging=stderr.
    """
    assert CHROMIUM is not None
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp)
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,2000",
        "--dump-dom",
        *extra,
        page_path.resolve().as_uri(),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines() if CONSOLE.search(line)]
    return proc.stdout, console


@needs_chromium
def test_chromium_sees_console_errors(tmp_path: Path) -> None:
    """The harness itself: a broken page is caught (so a clean result means something)."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>bad</title></head><body>'
        '<p id="p">before</p><script>document.getElementById("p").textContent = "after";'
        "console.error('boom'); missingFunction();</script></body></html>"
    )
    dom, console = chromium(bad, tmp_path)
    assert '<p id="p">after</p>' in dom, "the DOM is dumped after scripts ran"
    assert any("boom" in line for line in console)
    assert any("Uncaught ReferenceError" in line for line in console)


@needs_chromium
def test_chromium_renders_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, rep, changes, _ = page(tmp_path, capsys, tour(), "full")
    shot = tmp_path / "shot.png"
    dom, console = chromium(out, tmp_path, f"--screenshot={shot}")
    assert console == [], console
    # The DOM the browser built has every chart element.
    tree = Tree(dom)
    check_structure(tree, rep, changes)
    for marker in MARKERS:
        assert marker not in dom
    # A real screenshot: a PNG of the window's size, not blank.
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 2000)
    assert len(data) > 50_000, "a page with charts compresses to more than a blank one"
    keep = os.environ.get("LLMP_HTML_SCREENSHOT")
    if keep:  # for a person to look at
        shutil.copy(shot, keep)
