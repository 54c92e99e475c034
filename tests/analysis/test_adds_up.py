"""R38: in every report the findings, the rows, the causes and the totals are the same
tokens and milliseconds, in the JSON and in the readable report.

Checked on every scenario recording the tests build (each in digest and full mode),
and on traffic hypothesis generates: agents that change their system prompt, their
tools or their history, side-calls, server restarts, new conversations whose prompt
differs only in its head.  `llmp demo`'s own recording is checked in tests/demo.
"""

from __future__ import annotations

import functools
import html
import inspect
import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmp.analysis import analyze
from llmp.analysis.command import explain
from llmp.analysis.config import Config
from tests.support import overflow_scenarios as osc
from tests.support import scenarios as sc
from tests.support.adds_up import problems, readable_problems
from tests.support.words import slips


def _makers() -> dict[str, Callable[[], sc.Traffic]]:
    """Every scenario the tests build: the named ones, the Claude Code and Codex traffic,
    and the context overflows."""
    makers: dict[str, Callable[[], sc.Traffic]] = dict(sc.SCENARIOS)
    for name, fn in vars(sc).items():
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != sc.__name__:
            continue
        sig = inspect.signature(fn)
        if sig.return_annotation in ("NewApiTraffic", "Traffic") and not sig.parameters:
            makers.setdefault(name, fn)
    for meaning in ("cached", "whole"):
        for how in ("messages", "runner"):
            makers[f"ollama_truncating_{meaning}_{how}"] = functools.partial(
                osc.ollama_truncating, meaning=meaning, how=how
            )
    makers["llama_refusing"] = lambda: osc.llama_refusing()[0]
    return makers


MAKERS = _makers()


def check(path: Path, cfg: Config | None = None, *, words: bool = True) -> None:
    """The report of one recording adds up, as data and as a person reads it, and its
    words count right (the readable report and the HTML page's text)."""
    result = analyze([str(path)], cfg)
    try:
        report = result.report()
    finally:
        result.close()
    assert problems(report) == []
    out = io.StringIO()
    page = path.with_suffix(".html")
    explain([str(path)], cfg, out=out, html=page if words else None)
    assert readable_problems(out.getvalue(), report) == []
    if words:
        assert slips(out.getvalue()) == []
        assert slips(html_text(page.read_text("utf-8"))) == []


def html_text(page: str) -> str:
    """What a person reads on the page: its text, tooltips included, without markup."""
    page = re.sub(r"<(style|script)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ¦ ", page))  # elements apart: no phrase spans two


def test_every_scenario_is_checked() -> None:
    assert len(MAKERS) >= 25
    assert {"changed_system", "claude_code_session", "llama_refusing"} <= set(MAKERS)


@pytest.mark.parametrize("mode", ["digest", "full"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_scenario_adds_up(tmp_path: Path, name: str, mode: str) -> None:
    path = MAKERS[name]().write(tmp_path / f"{name}.jsonl", mode)
    check(path)


def test_small_losses_stay_in_findings(tmp_path: Path) -> None:
    """A threshold above every loss makes the findings minor, never drops them."""
    path = sc.changed_system().write(tmp_path / "rec.jsonl", "digest")
    check(path, Config(min_lost_tokens=10**9))


def test_the_volatile_head_is_charged_on_its_row(tmp_path: Path) -> None:
    """R38's case in point: a new conversation that re-read a system prompt the server
    held, only because its head changed, is charged on its row as `system_changed`."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    sc.work(sc.Agent(tr, srv), 2)
    b = sc.Agent(tr, srv, system="Session 2f. " + sc.SYSTEM[12:])
    sc.work(b, 1, seed="b")
    path = tr.write(tmp_path / "rec.jsonl", "digest")
    result = analyze([str(path)])
    try:
        report = result.report()
    finally:
        result.close()
    first = next(r for r in report["rows"] if r["conversation"] == 2)
    assert first["new_conversation"] and first["turn"] == 1
    loss = first["lost_client"]
    assert loss is not None and loss["cause"] == "system_changed" and loss["tokens"] > 0
    (f,) = [f for f in report["findings"] if f["kind"] == "volatile_head"]
    assert f["rows"] == [first["id"]] and f["lost_tokens"] == loss["tokens"]
    assert report["time"]["lost_tokens"] == loss["tokens"]
    assert problems(report) == []


# -- generated traffic ------------------------------------------------------------

_STEPS = st.sampled_from(
    ["work", "work", "work", "title", "clock", "tools", "rewrite", "reset", "head", "fresh"]
)


def _generated(steps: list[str], np: int, checkpoint: int) -> sc.Traffic:
    tr = sc.Traffic()
    srv = sc.LlamaServer(np=np, checkpoint=checkpoint)
    agents = [sc.Agent(tr, srv)]
    for i, step in enumerate(steps):
        a = agents[i % len(agents)]
        seed = f"s{i}"
        if step == "work":
            sc.work(a, 1, seed=seed)
        elif step == "title":
            a.side_call("Write a title.", sc.text(seed, 120), "A title", max_tokens=16)
        elif step == "clock":
            a.messages[0] = {"role": "system", "content": sc.SYSTEM + f" It is 10:{i:02d}."}
            sc.work(a, 1, seed=seed)
        elif step == "tools":
            a.tools = [*(a.tools or []), sc.tool(f"t{i}", "Another tool.", x="string")]
            sc.work(a, 1, seed=seed)
        elif step == "rewrite" and len(a.messages) > 3:
            a.messages[2] = {**a.messages[2], "content": sc.text(seed + " edited", 180)}
            sc.work(a, 1, seed=seed)
        elif step == "reset":
            srv.reset()
        elif step == "head":
            srv.keep_head(120)
        elif step == "fresh":
            # A new conversation whose system prompt differs only in its head.
            agents.append(sc.Agent(tr, srv, system=f"Session {i:03d}. " + sc.SYSTEM[13:]))
            sc.work(agents[-1], 1, seed=seed)
    sc.work(agents[0], 1, seed="last")
    return tr


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=st.lists(_STEPS, min_size=1, max_size=12),
    np=st.integers(min_value=1, max_value=2),
    checkpoint=st.sampled_from([0, 0, 64]),
    mode=st.sampled_from(["digest", "full"]),
)
def test_generated_traffic_adds_up(
    tmp_path: Path, steps: list[str], np: int, checkpoint: int, mode: str
) -> None:
    tr = _generated(steps, np, checkpoint)
    path = tr.write(tmp_path / f"gen-{len(list(tmp_path.iterdir()))}.jsonl", mode)
    check(path, words=False)
