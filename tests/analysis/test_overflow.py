"""Context overflow: prompts the server cut silently, or refused for its context."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from llmp.analysis import Config, Engine
from llmp.analysis.overflow import refusal_of
from llmp.analysis.render import readable_findings, sentence
from llmp.apis.ollama_chat import OllamaChat
from llmp.apis.openai_chat import OpenAIChat
from llmp.cli import main
from tests.support import overflow_scenarios as osc
from tests.support import scenarios as sc
from tests.support.report_shape import check_shape
from tests.support.scenarios import analyse, rows_by_id


def overflow(rep: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in rep["findings"] if f["kind"] == "context_overflow"]


def only_overflow(rep: dict[str, Any]) -> dict[str, Any]:
    found = overflow(rep)
    assert len(found) == 1, rep["findings"]
    return found[0]


def cut_rows(rep: dict[str, Any]) -> list[int]:
    """Rows whose server count is below what was sent (what the simulation cut)."""
    out = []
    for r in rep["rows"]:
        sent = sum(v["value"] for v in r["composition"].values())
        prompt = r["counts"]["prompt_tokens"]["value"]
        if prompt < sent:
            out.append(r["id"])
    return out


# -- not found where there is none -----------------------------------------------


@pytest.mark.parametrize("mode", ["full", "digest"])
@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_no_overflow_in_scenarios_without_it(tmp_path: Path, name: str, mode: str) -> None:
    rep = analyse(sc.SCENARIOS[name](), tmp_path, mode)
    assert overflow(rep) == []
    assert rep["coverage"]["context_exceeded"] == 0


@pytest.mark.parametrize("mode", ["full", "digest"])
def test_other_400s_are_not_context_refusals(tmp_path: Path, mode: str) -> None:
    """A 400 that says something else, or one followed by a larger accepted prompt."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    sc.work(a, 2)
    tr.failed(a.ua, a.body(), error=None, status=400)  # "boom", server_error
    sc.work(a, 2, seed="u")  # the conversation goes on, larger than the refused request
    rep = analyse(tr, tmp_path, mode)
    assert rep["coverage"]["skipped"]["non_2xx"] == 1
    assert rep["coverage"]["context_exceeded"] == 0
    assert overflow(rep) == []


# -- Ollama cuts silently ---------------------------------------------------------


@pytest.mark.parametrize("how", ["messages", "runner"])
@pytest.mark.parametrize("meaning", ["cached", "whole"])
def test_ollama_silent_truncation_full(tmp_path: Path, meaning: str, how: str) -> None:
    rep = analyse(osc.ollama_truncating(meaning=meaning, how=how), tmp_path, "full")
    check_shape(rep)
    f = only_overflow(rep)
    cut = cut_rows(rep)
    assert f["model"] == "qwen3:8b" and f["client"] is None
    # Every row found was cut; only the first cut, hardly over the limit, is missed.
    assert set(f["rows"]) <= set(cut) and len(f["rows"]) >= len(cut) - 1
    assert f["lost_tokens"] is None and f["lost_ms"] is None
    assert f["context_tokens"] == 2048
    assert f["confidence"] == "high"
    ev = f["evidence"]
    assert ev["n_ctx"] == 2048 and ev["n_ctx_source"] == "request"
    assert ev["truncated"] == ev["turns"] == len(f["rows"]) and ev["refused"] == 0
    assert ev["reported"] <= 2048 < ev["sent"]["value"]
    assert ev["sent"]["source"] == "estimate" and ev["dropped"]["source"] == "estimate"
    assert rep["coverage"]["context_exceeded"] == 0
    # The cut rows' lost cache is the cut's doing, not the server's: the loss stays in a
    # finding (R38), whose evidence counts the turns after a cut and whose confidence
    # drops to low when a cut explains every one of them.
    for other in rep["findings"]:
        if other["kind"] == "server_cache_loss":
            after_cut = set(other["rows"]) & set(f["rows"])
            assert other["evidence"].get("after_cut", 0) >= len(after_cut)
            if set(other["rows"]) <= set(f["rows"]):
                assert other["confidence"] == "low"


def test_ollama_digest_has_no_num_ctx(tmp_path: Path) -> None:
    """Digests keep no `options`: same rows, no n_ctx, medium confidence."""
    tr = osc.ollama_truncating(meaning="whole")
    full = only_overflow(analyse(tr, tmp_path, "full"))
    dig = only_overflow(analyse(tr, tmp_path, "digest"))
    assert dig["rows"] == full["rows"]
    assert dig["evidence"]["n_ctx"] is None and dig["context_tokens"] is None
    assert dig["confidence"] == "medium"


def test_ollama_without_num_ctx_in_the_request(tmp_path: Path) -> None:
    f = only_overflow(analyse(osc.ollama_truncating(in_request=False), tmp_path, "full"))
    assert f["evidence"]["n_ctx"] is None and f["evidence"]["n_ctx_source"] is None
    assert f["confidence"] == "medium"


def test_tokenizer_counts_make_it_certain(tmp_path: Path) -> None:
    tr = osc.ollama_truncating(in_request=False)
    for rec in tr.records:
        d = OllamaChat().request_digest(rec["request"]["body"])
        assert d is not None
        rec["tokens"] = {
            "messages": {m["hash"]: -(-m["chars"] // 4) for m in d["messages"]},
            "tools": {t["hash"]: -(-t["chars"] // 4) for t in d["tools"]},
        }
    f = only_overflow(analyse(tr, tmp_path, "full"))
    assert f["confidence"] == "high"
    assert f["evidence"]["sent"]["source"] == "tokenizer"


def test_thresholds_are_options(tmp_path: Path) -> None:
    tr = osc.ollama_truncating(how="runner", in_request=False)
    base = only_overflow(analyse(tr, tmp_path, "full"))
    # A looser share and margin also take the first cut, hardly over the limit.
    cfg = Config(overflow_share=0.99, overflow_min_tokens=16)
    loose = only_overflow(analyse(tr, tmp_path, "full", cfg=cfg))
    assert set(loose["rows"]) == set(base["rows"]) | {4}
    # Without the "far below" rule, the count that stops growing still shows it.
    cfg = Config(overflow_share=0.0, overflow_min_tokens=10**6)
    strict = only_overflow(analyse(tr, tmp_path, "full", cfg=cfg))
    assert set(strict["rows"]) <= set(base["rows"]) and strict["rows"]


def test_a_growing_conversation_below_the_context_is_not_cut(tmp_path: Path) -> None:
    tr = osc.ollama_truncating(num_ctx=100_000)
    assert overflow(analyse(tr, tmp_path, "full")) == []


# -- llama-server refuses ------------------------------------------------------------


def test_llama_refusal_full(tmp_path: Path) -> None:
    tr, n_ctx, refused = osc.llama_refusing()
    rep = analyse(tr, tmp_path, "full")
    check_shape(rep)
    cov = rep["coverage"]
    # Counted under the spec's non_2xx, and again, additively, as context_exceeded.
    assert cov["skipped"]["non_2xx"] == 2 and cov["context_exceeded"] == 2
    assert cov["records"] == cov["analysed"] + sum(cov["skipped"].values())
    f = only_overflow(rep)
    assert f["rows"] == [] and f["model"] == sc.LLAMA_MODEL
    assert f["confidence"] == "high" and f["context_tokens"] == n_ctx
    ev = f["evidence"]
    assert ev["n_ctx"] == n_ctx and ev["n_ctx_source"] == "error"
    assert ev["refused"] == 2 and ev["refused_ids"] == refused and ev["refused_from"] == "body"
    assert ev["truncated"] == 0 and ev["dropped"] is None and ev["reported"] is None
    assert ev["sent"]["source"] == "server" and ev["sent"]["value"] > n_ctx


def test_llama_refusal_digest(tmp_path: Path) -> None:
    """Digest mode keeps no error body: recognised from the status and size, low confidence."""
    tr, _, refused = osc.llama_refusing()
    rep = analyse(tr, tmp_path, "digest")
    check_shape(rep)
    assert rep["coverage"]["context_exceeded"] == 2
    f = only_overflow(rep)
    assert f["confidence"] == "low" and f["context_tokens"] is None
    ev = f["evidence"]
    assert ev["refused_ids"] == refused and ev["refused_from"] == "status"
    assert ev["n_ctx"] is None and ev["sent"]["source"] == "estimate"


def test_llama_refusal_mixed(tmp_path: Path) -> None:
    tr, n_ctx, refused = osc.llama_refusing()
    f = only_overflow(analyse(tr, tmp_path, "mixed"))
    assert f["evidence"]["refused_ids"] == refused
    assert f["evidence"]["n_ctx"] == n_ctx and f["confidence"] == "high"


def test_the_turn_after_a_refusal_is_undetermined_not_a_server_reset(tmp_path: Path) -> None:
    tr, _, refused = osc.llama_refusing()
    rep = analyse(tr, tmp_path, "full")
    assert "server_cache_loss" not in [f["kind"] for f in rep["findings"]]
    after = rows_by_id(rep)[refused[-1] + 1]
    assert after["kind"] == "turn"


# -- recognising the error ----------------------------------------------------------


def _rec(status: int, body: Any = None, text: str | None = None) -> dict[str, Any]:
    return {
        "v": 1,
        "id": 1,
        "t_start_ms": 1,
        "tokens": None,
        "request": {
            "method": "POST",
            "path": "/v1/chat/completions",
            "digest": None,
            "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]},
        },
        "response": {"status": status, "body": body, "body_text": text, "digest": None},
    }


def refusal(status: int, body: Any = None, text: str | None = None) -> Any:
    rec = _rec(status, body, text)
    return refusal_of(rec, rec["request"], rec["response"], OpenAIChat(), status)


def test_recognised_errors() -> None:
    llama = osc.context_error(9000, 8192)
    r = refusal(400, llama)
    assert r is not None and r.said and (r.n_ctx, r.n_prompt) == (8192, 9000)
    assert r.model == "m" and r.sent == (100, "estimate")
    # Older builds: only the message says the numbers.
    bare = copy.deepcopy(llama)
    del bare["error"]["n_ctx"], bare["error"]["n_prompt_tokens"]
    r = refusal(400, bare)
    assert r is not None and (r.n_ctx, r.n_prompt) == (8192, 9000)
    vllm = {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you "
        "requested 5000 tokens (4900 in the messages, 100 in the completion).",
        "type": "BadRequestError",
    }
    r = refusal(400, vllm)
    assert r is not None and (r.n_ctx, r.n_prompt) == (4096, 5000)
    openai = {"error": {"code": "context_length_exceeded", "message": "too long"}}
    assert refusal(400, openai) is not None
    # SGLang, its two wordings (the input alone; the input with the completion's tokens).
    for message, sizes in (
        ("The input (9000 tokens) is longer than the model's context length (8192 tokens).",
         (8192, 9000)),
        ("Requested token count exceeds the model's maximum context length of 8192 tokens. You "
         "requested a total of 9100 tokens: 9000 tokens from the input messages and 100 tokens "
         "for the completion.", (8192, 9000)),
    ):  # fmt: skip
        r = refusal(400, {"object": "error", "message": message, "type": "BadRequestError"})
        assert r is not None and (r.n_ctx, r.n_prompt) == sizes, message
    r = refusal(400, None, "request (20 tokens) exceeds the available context size (16 tokens)")
    assert r is not None and (r.n_ctx, r.n_prompt) == (16, 20)


def test_not_context_errors() -> None:
    assert refusal(400, {"error": {"code": 400, "message": "boom", "type": "server_error"}}) is None
    assert refusal(500, osc.context_error(9000, 8192)) is None  # not a refusal
    assert refusal(404, None) is None  # digest mode: only a plain 400 can be one
    assert refusal(422, {"detail": [{"msg": "field required"}]}) is None
    r = refusal(400, None)  # digest mode: the status alone
    assert r is not None and not r.said and r.n_ctx is None


@pytest.mark.parametrize(
    "body",
    [[], "str", 3, {"error": None}, {"error": [1]}, {"error": {"n_ctx": "x", "message": 5}}],
)
def test_damaged_error_bodies_never_raise(body: Any) -> None:
    refusal(400, body)
    rec = _rec(400, body)
    rec["request"]["body"] = {"messages": "not a list", "tools": [None, 3]}
    refusal_of(rec, rec["request"], rec["response"], OpenAIChat(), 400)
    rec["request"] = {"digest": {"messages": [None, {"chars": "x", "hash": 3}]}}
    refusal_of(rec, rec["request"], rec["response"], OpenAIChat(), 400)


# -- live use of the engine ------------------------------------------------------------


def test_header_is_the_same_every_time_and_status_refusals_can_be_disproved() -> None:
    """A live host asks for the header mid-session: it must not change the verdict."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer())
    sc.work(a, 2)
    tr.failed(a.ua, a.body(), error=None, status=400)
    engine = Engine(spill=False)
    digest = tr.digest()
    for rec in digest:
        engine.feed(1, rec)
    first = engine.header()
    assert first == engine.header()
    assert first["coverage"]["context_exceeded"] == 1  # nothing larger accepted yet
    # The conversation goes on with a larger prompt: the 400 was not the context.
    sc.work(a, 1, seed="u")
    engine.feed(1, tr.digest()[-1])
    later = engine.header()
    assert later["coverage"]["context_exceeded"] == 0 and overflow(later) == []


# -- words ---------------------------------------------------------------------------


def test_sentences(tmp_path: Path) -> None:
    f = only_overflow(analyse(osc.ollama_truncating(), tmp_path, "full"))
    what, fix = sentence(f)
    n = len(f["rows"])
    assert what.startswith(f"qwen3:8b silently dropped the start of {n} prompts")
    assert "(num_ctx 2,048)" in what and "no error said so" in what
    assert "options.num_ctx" in fix and "compact" in fix
    tr, n_ctx, _ = osc.llama_refusing()
    f = only_overflow(analyse(tr, tmp_path, "full"))
    what, fix = sentence(f)
    assert what.startswith("qwen3-8b-q4_k_m.gguf refused 2 requests longer than its context")
    assert f"(n_ctx {n_ctx:,})" in what and "-c" in fix
    f = only_overflow(analyse(tr, tmp_path, "digest"))
    what, fix = sentence(f)
    assert "HTTP 400" in what and "--full" in fix


def test_readable_report_puts_it_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = analyse(osc.ollama_truncating(), tmp_path, "full")
    assert readable_findings(rep["findings"])[0][1] == sentence(only_overflow(rep))[0]
    path = osc.ollama_truncating().write(tmp_path / "o.jsonl", "full")
    assert main(["analyze", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1. [high] qwen3:8b silently dropped the start of" in out
    assert "the server-side losses of those turns come from the cut" in out
    tr, _, _ = osc.llama_refusing()
    path = tr.write(tmp_path / "l.jsonl", "full")
    assert main(["analyze", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Skipped: 2 non 2xx (2 refused: prompt longer than the context)." in out
