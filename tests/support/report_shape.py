"""The report v1's shape, checked by every test that reads a whole report."""

from __future__ import annotations

from typing import Any

from llmp.analysis.causes import BY_NAME
from llmp.analysis.findings import sort_key

TOP = [
    "v",
    "window",
    "coverage",
    "servers",
    "time",
    "composition",
    "clients",
    "tools",
    "findings",
    "speculative",  # additive to v1: speculative decoding per served model (docs/analysis.md §9)
    "cost",  # additive (R36): what a provider's rows cost; null on a local server
    "provider_agreement",  # additive (R37): llmp's causes against the provider's diagnosis
    "rows",
]


ROW = [
    "id", "api", "model", "client", "t_start_ms", "kind", "side_call_shape", "session",
    "conversation", "turn", "counts", "composition", "linked_to", "new_conversation",
    "prefix_tokens", "break_cause", "compaction", "predicted_reuse", "observed_reuse", "cause",
    "lost_client", "lost_external", "side_calls_between", "other_conversations_between",
    "other_domains_between", "loss_measured",
    "changed",  # additive to v1: where each changed message changed (docs/analysis.md §7)
    # additive (R34-R37): the server, the cache split, the cost, the provider's diagnosis
    "server", "cache_read_tokens", "cache_write_tokens", "uncached_tokens", "cost_usd",
    "provider_reason",
]  # fmt: skip


COUNTS = [
    "prompt_tokens",
    "completion_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "prefill_ms",
    "decode_ms",
    "load_ms",
]


FINDING = [
    "kind",
    "model",
    "client",
    "rows",
    "lost_tokens",
    "lost_ms",
    "context_tokens",
    "confidence",
    "evidence",
]


SOURCES = {"server", "tokenizer", "proxy", "estimate"}


def is_mv(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"value", "source"} and x["source"] in SOURCES


def check_shape(rep: dict[str, Any]) -> None:
    assert list(rep) == TOP
    assert rep["v"] == 1
    assert set(rep["window"]) == {"start_ms", "end_ms", "days"}
    cov = rep["coverage"]
    # The spec's fields in its order, then the additive ones (docs/analysis.md).
    assert list(cov) == [
        "records", "analysed", "skipped", "paths", "bad_lines",
        "turns", "conversations", "turns_with_reuse", "turns_with_timing",
        "context_exceeded", "previous_response",  # additive (docs/analysis.md §2)
    ]  # fmt: skip
    assert list(cov["skipped"]) == ["not_chat", "error", "non_2xx", "unparsed"]
    for s in rep["servers"]:
        assert set(s) == {"api", "server", "fields"}
        assert s["api"] in ("openai_chat", "ollama_chat", "anthropic_messages", "openai_responses")
        assert all(f in COUNTS for f in s["fields"])
    t = rep["time"]
    assert list(t) == ["prefill_ms", "lost_ms", "lost_tokens", "by_cause"]
    for key in ("prefill_ms", "lost_ms"):
        assert t[key] is None or is_mv(t[key])
    for cause, c in t["by_cause"].items():
        assert cause in BY_NAME
        assert set(c) == {"tokens", "ms", "rows", "usd"} and (c["ms"] is None or is_mv(c["ms"]))
    assert list(rep["composition"]) == ["system", "tools", "history", "new_content"]
    for c in rep["clients"]:
        assert list(c) == ["client", "user_agent", "requests", "conversations", "tools"]
    for tl in rep["tools"]:
        assert list(tl) == ["client", "name", "schema_tokens", "offered", "called"]
    for f in rep["findings"]:
        assert list(f)[: len(FINDING)] == FINDING
        assert f["confidence"] in ("high", "medium", "low")
        assert f["lost_ms"] is None or is_mv(f["lost_ms"])
    assert rep["findings"] == sorted(rep["findings"], key=sort_key)
    for r in rep["rows"]:
        assert list(r) == ROW
        assert r["kind"] in ("turn", "side_call", "stateless")
        assert list(r["counts"]) == COUNTS
        assert all(v is None or is_mv(v) for v in r["counts"].values())
        assert list(r["composition"]) == ["system", "tools", "history", "new_content"]
        assert all(is_mv(v) for v in r["composition"].values())
        for key in ("lost_client", "lost_external"):
            assert r[key] is None or (set(r[key]) == {"cause", "tokens", "ms", "usd"})
        assert (r["side_call_shape"] is None) == (r["kind"] != "side_call")
        assert (r["conversation"] is None) == (r["kind"] != "turn")
