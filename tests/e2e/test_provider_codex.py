"""Real Codex (npm `@openai/codex`, skipped, saying why, without it) on the fake OpenAI API,
recorded as `llmp run -- codex` records it with an API key (forward mode to
`api.openai.com`, its WebSocket refused so its turns come over HTTP): one session of three
turns (`codex exec`, then `codex exec resume --last` twice) under one `prompt_cache_key`,
and no loss the provider's own cache did not make: before the last run the fake drops
every entry, and that turn's miss, and only that one, is charged, to the provider.

The model is `gpt-5.6`, of OpenAI's explicit generation: Codex sends no breakpoints, so
the implicit mode writes at the end of each prompt, counts are exact, and the provider
gives its own diagnosis, which the recorder asks for (`llmp run --diagnose`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmp.analysis import analyze
from llmp.analysis.causes import PROVIDER_EVICTED
from llmp.apis.providers import openai_cache
from llmp.demo.fakes.openai_api import OpenAIAPI
from llmp.format.canonical import tagged_text
from llmp.recorder import harness
from tests.e2e.test_run_providers import (
    OPENAI_KEY,
    chat_records,
    codex_env,
    forward_mitmdump,
    no_secrets,
    project,
    run,
)
from tests.support.adds_up import problems
from tests.support.mitm import read_records
from tests.support.provider_truth import charged, decisions, diagnosed_against_linked, posts
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

MODEL = "gpt-5.6"
EVICT: list[str] = []
"""Between two runs: the provider drops every entry (its own eviction)."""
TURNS = (
    ["What does calc.py do?"],
    ["resume", "--last", "And in one word?"],
    EVICT,
    ["resume", "--last", "And in two words?"],
)


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("openai-api") as up:
        yield up


def test_codex_on_openai_keeps_one_cache_key_and_has_no_false_loss(
    fake: Upstream, tmp_path: Path
) -> None:
    env, codex_home = codex_env(tmp_path)
    env["CODEX_API_KEY"] = OPENAI_KEY
    exec_ = ["codex", "exec", "--skip-git-repo-check", "-m", MODEL]
    plan = harness.plan_for(exec_, env, lambda p: None)
    assert plan is not None and not plan.reverse and plan.allow_hosts == ("api.openai.com",)
    rec = tmp_path / "rec.jsonl"
    work = project(tmp_path)
    api = OpenAIAPI.of(fake)
    with forward_mitmdump(plan, fake, rec, {"llmp_diagnose": "true"}) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        child = harness.child_env(plan, env, md.url, ca)
        runs = []
        for tail in TURNS:
            if tail is EVICT:
                assert api.cache.evict() > 0
                continue
            runs.append(run(harness.command_for(plan, [*exec_, *tail], md.url), child, work))
    for done in runs:
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    sent = posts(fake)
    records = chat_records(rec, "/v1/responses")
    assert len(sent) == len(records) == len(read_records(rec)) >= 3
    # Only the last request found an entry gone: it came after the eviction.
    evicted = [d.lost for d in decisions(fake).values()]
    assert evicted[-1] == "evicted" and "evicted" not in evicted[:-1]
    assert {r["request"]["upstream"] for r in records} == {"api.openai.com"}
    assert all(e.request_header("authorization") == f"Bearer {OPENAI_KEY}" for e in sent)
    # One prompt_cache_key for the whole session, the resumed run's too; the digest keeps
    # it hashed (R35), the same on every request.
    keys = {e.request_json.get("prompt_cache_key") for e in sent}
    assert len(keys) == 1 and None not in keys
    (key,) = keys
    assert {r["request"]["digest"]["cache"]["key"] for r in records} == {tagged_text(key)}
    assert key not in rec.read_text()
    result = analyze([str(rec)])
    try:
        rep = result.report()
    finally:
        result.close()
    rows = rep["rows"]
    assert [r["server"] for r in rows] == ["openai"] * len(records)
    turns = [r for r in rows if r["kind"] == "turn"]
    assert len(turns) >= 3 and len({r["conversation"] for r in turns}) == 1
    assert all(r["linked_to"] is not None for r in turns[1:])  # the resumed runs continued
    # Codex kept its prefix: only the turn after the eviction lost, and to the provider.
    lost = charged(rows, fake, openai_cache(MODEL).granule_tokens)
    assert [r["id"] for r in lost] == [turns[-1]["id"]]
    assert lost[0]["lost_external"]["cause"] == PROVIDER_EVICTED
    # The provider's own diagnosis: each later turn compared with the turn before it.
    diagnosed_against_linked(rows, fake)
    # It says the last turn's prompt was the same (`cache_hit`): the entry was gone.
    assert turns[-1]["provider_reason"] == "none"
    assert rep["provider_agreement"] == {"compared": 1, "agreed": 1, "disagreed": []}
    assert rep["cost"] is not None and rep["cost"]["total_usd"] > 0
    assert rep["cost"]["unpriced_models"] == []
    assert problems(rep) == []
    no_secrets(rec, OPENAI_KEY)
    # Codex's own files hold no trace of the recorder.
    assert not (codex_home / "config.toml").exists()
