"""Speculative decoding on the real llama-server: `--model-draft`, the same SmolLM2 as its own draft.

Through one mitmdump with the live view's event file on, the real openai
client runs a short conversation.  llama-server puts `draft_n` and
`draft_n_accepted` in each response's `timings`; the recording keeps them,
and the report's acceptance must be Σ draft_n_accepted / Σ draft_n over its
rows, the live events and `--rows` the per-turn counts.  Needs
``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``; skipped without them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmp.live.contract import TURN_TAG
from tests.support.live_checks import analyze
from tests.support.mitm import Mitmdump, read_records
from tests.support.real import LlamaServer, llama_paths, real_server_marks, server_help, supports

openai = pytest.importorskip("openai")

pytestmark = real_server_marks()

QUESTIONS = ["Count from one to ten in words.", "Now from eleven to twenty.", "And back down."]


def draft_args() -> list[str]:
    """`--model-draft MODEL`, and the speculative type where the build needs it named."""
    found = llama_paths()
    assert not isinstance(found, str)
    server, model = found
    args = ["--model-draft", str(model)]
    if supports(str(server), "--spec-type") and "draft-simple" in server_help(str(server)):
        args += ["--spec-type", "draft-simple"]
    return args


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    tmp = tmp_path_factory.mktemp("llama-draft")
    with LlamaServer(ctx=2048, extra_args=draft_args(), log_path=tmp / "llama.log") as server:
        yield server


def test_acceptance_is_the_sum_over_the_rows(llama: LlamaServer, tmp_path: Path) -> None:
    rec, events, rows = tmp_path / "rec.jsonl", tmp_path / "events.txt", tmp_path / "rows.parquet"
    with Mitmdump(llama.url, rec, {"llmp_events": str(events)}, timeout=60) as md:
        md.wait_for_log("llmp: live view on")
        client = openai.OpenAI(base_url=md.url + "/v1", api_key="x", max_retries=0, timeout=120)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
        for i, q in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": q})
            if i == 1:
                stream = client.chat.completions.create(
                    model="smol", messages=messages, max_tokens=32, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
            else:
                r = client.chat.completions.create(
                    model="smol", messages=messages, max_tokens=32, temperature=0
                )
                text = r.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
        md.wait_for_log("conv 1 turn 3:", timeout=30)
        assert md.stop() == 0
        log = md.log_text()

    records = read_records(rec)
    assert len(records) == 3
    timings = [r["response"]["digest"]["usage"]["timings"] for r in records]
    assert all(t.get("draft_n") is not None for t in timings), timings
    drafted = sum(t["draft_n"] for t in timings)
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    assert drafted > 0 and 0 <= accepted <= drafted

    report = analyze(rec)
    [spec] = report["speculative"]
    assert (spec["rows"], spec["draft_n"], spec["draft_n_accepted"]) == (3, drafted, accepted)
    assert spec["acceptance"] == round(accepted / drafted, 4)

    turns = [
        json.loads(line.split(" ", 1)[1])
        for line in events.read_text().splitlines()
        if line.startswith(TURN_TAG + " ")
    ]
    by_id = {r["id"]: t for r, t in zip(records, timings, strict=True)}
    for ev in turns:
        t = by_id[ev["id"]]
        assert (ev["draft_n"], ev["draft_n_accepted"]) == (t["draft_n"], t.get("draft_n_accepted"))
        if t["draft_n"]:
            assert f"({t.get('draft_n_accepted', 0):,} of {t['draft_n']:,})" in log

    duckdb = pytest.importorskip("duckdb")
    pytest.importorskip("pyarrow")
    from llmp.cli import main

    assert main(["analyze", str(rec), "--rows", str(rows)]) == 0
    [(n, a)] = duckdb.sql(
        f"SELECT sum(draft_n), sum(draft_n_accepted) FROM read_parquet('{rows}')"
    ).fetchall()
    assert (n, a) == (drafted, accepted)
