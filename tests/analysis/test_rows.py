"""A row's fields come in the report's order, whatever values it holds."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from llmp.cli import main
from tests.support import scenarios as sc

ROW_KEYS = [
    "id", "api", "model", "client", "t_start_ms", "kind", "side_call_shape", "session",
    "conversation", "turn", "counts", "composition", "linked_to", "new_conversation",
    "prefix_tokens", "break_cause", "compaction", "predicted_reuse", "observed_reuse",
    "cause", "lost_client", "lost_external", "side_calls_between",
    "other_conversations_between", "other_domains_between", "loss_measured", "changed",
    "server", "cache_read_tokens", "cache_write_tokens", "uncached_tokens", "cost_usd",
    "provider_reason",
]  # fmt: skip
COUNT_KEYS = [
    "prompt_tokens", "completion_tokens", "reused_tokens", "evaluated_tokens",
    "prefill_ms", "decode_ms", "load_ms",
]  # fmt: skip


def test_every_row_has_the_report_fields_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Side-calls, turns that lose their cache and turns that do not: rows where
    # different fields are null.
    path = sc.title_side_call().write(tmp_path / "r.jsonl", "digest")
    assert main(["analyze", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    rows = orjson.loads(out)["rows"]
    assert len({r["kind"] for r in rows}) > 1
    assert any(r["linked_to"] is None for r in rows) and any(r["linked_to"] for r in rows)
    for row in rows:
        assert list(row) == ROW_KEYS
        assert list(row["counts"]) == COUNT_KEYS
        assert list(row["composition"]) == ["system", "tools", "history", "new_content"]
