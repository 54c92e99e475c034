"""Real Claude Code's requests (the captures in tests/fixtures/harness, text scrambled, every
byte's structure kept) sent again to the fake Anthropic API through the real mitmdump: llmp
charges exactly the misses the provider's own cache rules made, and no other.

The captured bodies are replayed byte for byte, each with Claude Code's own headers but its
credentials, but for one thing the scrambling hid: the billing line's own prefix
(`x-anthropic-billing-header:`), which the provider (and so the fake) knows by its text, is
put back.  The fake keeps its truth of every request (what it read, wrote and left), and
every row's loss is checked against it: no false loss, and no missed one.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmp.demo.fakes import Decision
from tests.support.adds_up import problems
from tests.support.provider_session import recorder, report
from tests.support.replay import load_capture
from tests.support.scramble import scramble_text
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness"
KEEP = ("user-agent", "content-type", "anthropic-beta", "anthropic-version", "x-app",
        "x-claude-code-session-id", "x-stainless-retry-count", "accept")  # fmt: skip
BILLING = "x-anthropic-billing-header:"
SCRAMBLED = scramble_text(BILLING).encode()


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("anthropic-api") as up:
        yield up


@pytest.mark.parametrize("name", ["claude-2", "claude-5", "claude-7"])
def test_replayed_claude_code_has_no_false_loss(fake: Upstream, tmp_path: Path, name: str) -> None:
    sent = [
        e
        for e in load_capture(FIXTURES / f"{name}.jsonl.gz")
        if e.method == "POST" and e.path_only == "/v1/messages"
    ]
    rec = tmp_path / "rec.jsonl"
    with recorder(fake, rec) as md:
        ca = str(md.confdir / "mitmproxy-ca-cert.pem")
        verify = ssl.create_default_context(cafile=ca)
        with httpx.Client(proxy=md.url, verify=verify, timeout=30) as http:
            for e in sent:
                headers = {k: v for k, v in e.request_headers if k.lower() in KEEP}
                headers["x-api-key"] = "sk-ant-replay-secret"
                body = e.request_body.replace(SCRAMBLED, BILLING.encode())
                r = http.post("https://api.anthropic.com" + e.path, content=body, headers=headers)
                assert r.status_code == 200, r.text
        rep = report(rec, len(sent))
    truth = [e.cache for e in fake.log if e.path.split("?")[0] == "/v1/messages"]
    assert len(truth) == len(sent) and all(isinstance(d, Decision) for d in truth)
    decided = {i + 1: d for i, d in enumerate(truth) if isinstance(d, Decision)}
    assert [r["server"] for r in rep["rows"]] == ["anthropic"] * len(sent)
    for row in rep["rows"]:
        d = decided[row["id"]]
        assert row["cache_read_tokens"] == d.read and row["uncached_tokens"] == d.uncached
        loss = row["lost_client"] or row["lost_external"]
        linked = row["linked_to"]
        if linked is None:
            continue  # compared with nothing
        if row["new_conversation"] or row["compaction"]:
            # A new start after /compact, under a new billing line: the provider read the
            # tools and system prompt it held, and nothing is charged.
            assert d.read > 0 and loss is None, (row["id"], d.read, loss)
            continue
        miss = decided[linked].cached - d.read
        if miss > 0:
            assert loss is not None and loss["tokens"] == miss, (row["id"], loss, miss)
        else:
            assert loss is None, (row["id"], loss)
    # Claude Code's billing line changes (cc_version's suffix) are never a cause here.
    assert all(
        f["evidence"].get("break_cause") != "system_changed"
        for f in rep["findings"]
        if f["kind"] == "prefix_break"
    )
    assert not [f for f in rep["findings"] if f["kind"] == "volatile_head"]
    assert problems(rep) == []
    assert b"sk-ant-replay-secret" not in rec.read_bytes()
