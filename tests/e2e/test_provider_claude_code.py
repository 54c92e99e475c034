"""Real Claude Code (npm `@anthropic-ai/claude-code`, skipped, saying why, without it) on
the fake Anthropic API, recorded as `llmp run -- claude` records it (forward mode to
`api.anthropic.com`): its own breakpoints and time-to-live in the record, one session of
two turns (`-p`, then `-c -p`), and no loss the provider's own cache did not make.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmp.analysis import analyze
from llmp.demo.fakes import Decision
from llmp.recorder import harness
from tests.e2e.test_run_providers import (
    ANTHROPIC_KEY,
    CLAUDE_PACKAGE,
    chat_records,
    claude_env,
    forward_mitmdump,
    no_secrets,
    project,
    run,
)
from tests.support.adds_up import problems
from tests.support.harnesses import harness_bin
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("anthropic-api") as up:
        yield up


def test_claude_code_on_anthropic_has_its_own_breakpoints_and_no_false_loss(
    fake: Upstream, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    claude = harness_bin("claude", CLAUDE_PACKAGE, home)
    env = claude_env(home, claude.parent)
    plan = harness.plan_for(["claude"], env, lambda p: None)
    assert plan is not None and not plan.reverse
    rec = tmp_path / "rec.jsonl"
    work = project(tmp_path)
    with forward_mitmdump(plan, fake, rec, {}) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        child = harness.child_env(plan, env, md.url, ca)
        first = run(["claude", "-p", "What does calc.py do?"], child, work)
        second = run(["claude", "-c", "-p", "And how would you test it?"], child, work)
    got = [e for e in fake.log if e.path.split("?")[0] == "/v1/messages"]
    assert len(got) >= 2, f"{first.stdout}\n{first.stderr}\n{second.stdout}\n{second.stderr}"
    records = chat_records(rec, "/v1/messages")
    assert len(records) == len(got)
    # Its own breakpoints, as it placed them: on system blocks and on its last message.
    caches = [r["request"]["digest"]["cache"] for r in records]
    assert all(c is not None and c["breakpoints"] for c in caches)
    assert any(b["at"] == "messages" for c in caches for b in c["breakpoints"])
    ttls = {b["ttl"] for c in caches for b in c["breakpoints"]}
    assert ttls <= {None, "5m", "1h"}  # its own time-to-live, whatever it chose
    result = analyze([str(rec)])
    try:
        rep = result.report()
    finally:
        result.close()
    truth = [e.cache for e in got]
    assert all(isinstance(d, Decision) for d in truth)
    by_id = {r["id"]: r for r in rep["rows"]}
    chat_ids = [r["id"] for r in records]
    decided = dict(zip(chat_ids, truth, strict=True))
    turns = [r for r in rep["rows"] if r["kind"] == "turn"]
    assert turns and all(r["server"] == "anthropic" for r in rep["rows"])
    for row in turns:
        d = decided[row["id"]]
        assert isinstance(d, Decision)
        assert row["cache_read_tokens"] == d.read
        linked = row["linked_to"]
        loss = row["lost_client"] or row["lost_external"]
        if linked is None or row["new_conversation"] or row["compaction"]:
            continue
        before = decided[linked]
        assert isinstance(before, Decision)
        miss = before.cached - d.read
        assert (loss["tokens"] if loss else 0) == max(0, miss), (row["id"], loss, miss)
    # The second run continued the first: one conversation carries both prompts' turns.
    main_turns = [r for r in turns if r["conversation"] == turns[-1]["conversation"]]
    assert len(main_turns) >= 2
    assert by_id[main_turns[-1]["id"]]["linked_to"] is not None
    assert rep["cost"] is not None and rep["cost"]["total_usd"] > 0
    # The provider's own diagnosis names no change llmp did not see, and none it read.
    assert rep["provider_agreement"]["disagreed"] == []
    assert problems(rep) == []
    no_secrets(rec, ANTHROPIC_KEY)
