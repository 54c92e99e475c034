"""Real Codex's requests (the captures in tests/fixtures/harness, text scrambled, every
byte's structure kept) sent again to the fake OpenAI API through the real mitmdump: llmp
charges exactly the misses the provider's own cache rules made, and no other.

The captures are of Codex 0.171.0 (`codex exec`, then `codex exec resume --last`) in front
of a local llama-server: codex-1 two turns of one session; codex-3 a turn, Codex's own
compaction request (no tools, `request_kind: "compaction"`) and the turn after it, which
resends the first turn's prompt with every item id renewed.  Each body is replayed byte for
byte to `https://api.openai.com/v1/responses`, with Codex's own headers but a test
credential (the capture dropped Codex's), but for one thing: the model.

**The model is mapped.**  Codex named the local server's model, `smollm2`, which no
provider serves and no price list knows; that name is replaced, in the body and in the
`x-codex-turn-metadata` header (everywhere Codex named it, and nowhere else: the text is
scrambled, so the name occurs in no prompt), by one model of each of OpenAI's two cache
generations: `gpt-5.5` (automatic caching on routed machines, 128-token steps, no write
fee) and `gpt-5.6` (Codex sends no breakpoints, so the implicit mode writes at the end of
each prompt, counts are exact and writes are billed).  Both are in the fake's `MODELS` and
priced by genai-prices.

The fake keeps its truth of every request (what it read, wrote and left for a later one),
and every row's loss is checked against it: no false loss, and no missed one.  So a miss
exists to be found, the `evicted` runs drop every entry of the session (the provider's own
eviction) before the last request; the other runs leave the cache alone.  On `gpt-5.6`
the recorder asks for the provider's own diagnosis (R37), and it agrees with llmp.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmp.analysis.causes import PROVIDER_EVICTED
from llmp.apis.providers import openai_cache, openai_explicit
from llmp.demo.fakes.openai_api import OpenAIAPI
from tests.support.adds_up import problems
from tests.support.provider_session import recorder, report
from tests.support.provider_truth import charged, decisions, diagnosed_against_linked
from tests.support.replay import load_capture
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness"
KEEP = ("user-agent", "content-type", "accept", "accept-encoding", "originator",
        "session-id", "thread-id", "x-client-request-id", "x-codex-beta-features",
        "x-codex-window-id", "x-codex-turn-metadata")  # fmt: skip
CAPTURED_MODEL = b"smollm2"
SECRET = "sk-proj-codex-replay-secret"


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("openai-api") as up:
        yield up


@pytest.mark.parametrize("evicted", [False, True], ids=["kept", "evicted"])
@pytest.mark.parametrize("model", ["gpt-5.5", "gpt-5.6"])
@pytest.mark.parametrize("name", ["codex-1", "codex-3"])
def test_replayed_codex_has_no_false_loss(
    fake: Upstream, tmp_path: Path, name: str, model: str, evicted: bool
) -> None:
    sent = [
        e
        for e in load_capture(FIXTURES / f"{name}.jsonl.gz")
        if e.method == "POST" and e.path_only == "/v1/responses"
    ]
    assert len(sent) >= 2
    assert all(e.request_body.startswith(b'{"model":"' + CAPTURED_MODEL + b'"') for e in sent)
    rec = tmp_path / "rec.jsonl"
    api = OpenAIAPI.of(fake)
    diagnose = openai_explicit(model)  # the provider's own diagnosis, where it gives one
    with recorder(fake, rec, diagnose=diagnose) as md:
        verify = ssl.create_default_context(cafile=str(md.confdir / "mitmproxy-ca-cert.pem"))
        with httpx.Client(proxy=md.url, verify=verify, timeout=30) as http:
            for i, e in enumerate(sent):
                if evicted and i == len(sent) - 1:
                    assert api.cache.evict() > 0
                headers = {
                    k: v.replace(CAPTURED_MODEL.decode(), model)
                    for k, v in e.request_headers
                    if k.lower() in KEEP
                }
                headers["authorization"] = f"Bearer {SECRET}"
                body = e.request_body.replace(CAPTURED_MODEL, model.encode())
                r = http.post("https://api.openai.com" + e.path, content=body, headers=headers)
                assert r.status_code == 200, r.text
                assert b"response.completed" in r.content
        rep = report(rec, len(sent))
    rows = rep["rows"]
    assert [r["server"] for r in rows] == ["openai"] * len(sent)
    # What Codex said each request was (R33): its compaction request is a side-call.
    kinds = [json.loads(dict(e.request_headers)["x-codex-turn-metadata"]) for e in sent]
    assert [r["kind"] for r in rows] == [
        "side_call" if k["request_kind"] == "compaction" else "turn" for k in kinds
    ]
    assert {r["model"] for r in rows} == {model}
    # A side-call (Codex's compaction request) is never charged on a provider; the only
    # miss is the eviction's, and Codex changed nothing the cache keys on: the provider's.
    lost = charged(rows, fake, openai_cache(model).granule_tokens)
    assert len(lost) == (1 if evicted else 0)
    decided = decisions(fake)
    for row in lost:
        assert row["lost_external"] is not None
        assert row["lost_external"]["cause"] == PROVIDER_EVICTED
        d, before = decided[row["id"]], decided[row["linked_to"]]
        assert d.lost == "evicted" and d.lost_tokens == before.reusable
    # The session's key is Codex's conversation id, one for the whole session.
    assert len({d.key for d in decided.values()}) == 1
    assert rep["cost"] is not None and rep["cost"]["total_usd"] > 0
    assert rep["cost"]["unpriced_models"] == []
    if diagnose:
        # Each turn was compared with the turn llmp links it to (codex-3's last turn with
        # the first, not with the compaction request between them), and the provider's
        # word agrees with llmp's wherever either saw a miss.
        diagnosed_against_linked(rows, fake)
        for row in rows:
            if row["kind"] == "turn" and row["linked_to"] is not None:
                assert row["provider_reason"] == "none"  # Codex's prefix was the same
        agreement = rep["provider_agreement"]
        assert agreement is not None and agreement["disagreed"] == []
        assert agreement["compared"] == len(lost)
    assert problems(rep) == []
    assert SECRET.encode() not in rec.read_bytes()
