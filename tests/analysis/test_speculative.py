"""What speculative decoding kept: `timings.draft_n` / `draft_n_accepted` per served model.

llama-server reports both in `timings` when a draft model runs; the recording
keeps them verbatim and the report sums them per served model (the additive
`speculative`, docs/analysis.md §9), the readable report and the HTML page
show the acceptance, `--rows` carries each row's counts.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from llmp.analysis import analyze
from llmp.analysis.exchange import draft_counts
from llmp.analysis.html import render_html
from llmp.analysis.render import render
from llmp.cli import main
from tests.support import scenarios as sc

BIG = "/models/qwen3-8b-q4_k_m.gguf"
SMALL = "/models/qwen3-1.7b-q8_0.gguf"


def drafted_traffic() -> tuple[sc.Traffic, dict[int, tuple[int, int | None]]]:
    """Two llama-servers (two served models); most responses carry draft counts."""
    tr = sc.Traffic()
    a = sc.Agent(tr, sc.LlamaServer(model=BIG), ua="opencode/1.0.0")
    b = sc.Agent(tr, sc.LlamaServer(model=SMALL), ua="aider/0.86.1", tools=None, system="Brief.")
    sc.work(a, 4)
    b.turn("What is 2+2?", "4")
    a.side_call("Write a title.", "Title this", "A title")
    b.turn("And 3+3?", "6")
    drafts: dict[int, tuple[int, int | None]] = {}
    for rec in tr.records:
        timings = rec["response"]["body"]["timings"]
        rid = rec["id"]
        if rid == 2:
            continue  # a response without a draft (the draft model was not used)
        n = 10 * rid + 7
        accepted: int | None = None if rid == 3 else (7 * rid) % n  # id 3: draft_n alone
        timings["draft_n"] = n
        if accepted is not None:
            timings["draft_n_accepted"] = accepted
        drafts[rid] = (n, accepted)
    return tr, drafts


def expected(
    report: dict[str, Any], drafts: dict[int, tuple[int, int | None]]
) -> list[dict[str, Any]]:
    """Σ draft_n_accepted / Σ draft_n over each served model's rows, from the records."""
    served = served_models(report)
    sums: dict[str, list[int]] = {}
    for rid, (n, acc) in drafts.items():
        s = sums.setdefault(served[rid], [0, 0, 0])
        s[0] += 1
        s[1] += n
        s[2] += acc or 0
    return [
        {"model": m, "rows": r, "draft_n": n, "draft_n_accepted": a, "acceptance": round(a / n, 4)}
        for m, (r, n, a) in sorted(sums.items())
    ]


def served_models(report: dict[str, Any]) -> dict[int, str]:
    # Both agents ask for "qwen": the served model is the server's file (R20).
    return {r["id"]: (SMALL if r["client"] == "aider/0.86.1" else BIG) for r in report["rows"]}


@pytest.mark.parametrize("mode", ["digest", "full", "mixed"])
def test_the_report_sums_drafts_per_served_model(tmp_path: Path, mode: str) -> None:
    tr, drafts = drafted_traffic()
    report = sc.analyse(tr, tmp_path, mode)
    assert len(report["rows"]) == 7
    spec = report["speculative"]
    assert spec == expected(report, drafts)
    assert [s["model"] for s in spec] == sorted([BIG, SMALL])
    by_model = {s["model"]: s["rows"] for s in spec}
    assert by_model == {BIG: 4, SMALL: 2}  # id 2 had no draft; the side-call (id 6) counts
    # Rows keep the spec's fields only: the counts are not a row field.
    assert all("draft_n" not in r and "draft_n" not in r["counts"] for r in report["rows"])


def test_no_draft_no_speculative(tmp_path: Path) -> None:
    report = sc.analyse(sc.clean_chat(), tmp_path)
    assert report["speculative"] == []
    out = io.StringIO()
    header = {k: v for k, v in report.items() if k != "rows"}
    render(Console(file=out, width=120), header, {}, lambda k: str(k), 1)
    assert "Speculative" not in out.getvalue()
    assert "Draft accepted" not in render_html(report)


def test_draft_counts_read_only_whole_non_negative_counts() -> None:
    assert draft_counts({"timings": {"draft_n": 12, "draft_n_accepted": 9}}) == (12, 9)
    assert draft_counts({"timings": {"draft_n": 12}}) == (12, None)
    assert draft_counts({"timings": {"draft_n_accepted": 9}}) == (None, None)
    assert draft_counts({"timings": {"draft_n": -1, "draft_n_accepted": 0}}) == (None, None)
    assert draft_counts({"timings": {"draft_n": 4.5}}) == (None, None)
    assert draft_counts({"timings": {"draft_n": True}}) == (None, None)
    assert draft_counts({"timings": None}) == (None, None)
    assert draft_counts(None) == (None, None)


def test_readable_report_and_html_show_the_acceptance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tr, _ = drafted_traffic()
    rec = tr.write(tmp_path / "rec.jsonl")
    assert main(["analyze", str(rec), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    spec = {s["model"]: s for s in report["speculative"]}
    big, small = spec[BIG], spec[SMALL]
    html = tmp_path / "r.html"
    assert main(["analyze", str(rec), "--html", str(html)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Speculative decoding:" in out
    for s, name in ((big, "qwen3-8b-q4_k_m.gguf"), (small, "qwen3-1.7b-q8_0.gguf")):
        text = (
            f"{name}: {s['draft_n_accepted']:,} of {s['draft_n']:,} drafted tokens accepted "
            f"({s['acceptance']:.0%})"
        )
        assert text in out
    page = html.read_text()
    drafted = big["draft_n"] + small["draft_n"]
    accepted = big["draft_n_accepted"] + small["draft_n_accepted"]
    assert "Draft accepted" in page and f"{accepted / drafted:.0%}" in page
    assert f"{accepted:,} of {drafted:,} drafted tokens" in page
    assert f"{small['draft_n_accepted']:,} of {small['draft_n']:,} drafted tokens accepted" in page


def test_rows_table_carries_each_rows_draft(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    duckdb = pytest.importorskip("duckdb")
    tr, drafts = drafted_traffic()
    rec = tr.write(tmp_path / "rec.jsonl")
    out = tmp_path / "rows.parquet"
    result = analyze([str(rec)], rows=True)
    try:
        from llmp.analysis.table import write_table

        write_table(result, out)
    finally:
        result.close()
    got = duckdb.sql(f"SELECT id, draft_n, draft_n_accepted FROM '{out}' ORDER BY id").fetchall()
    assert got == [(i, *drafts.get(i, (None, None))) for i in range(1, 8)]
    # Acceptance from the table, as a team would query it, equals the report's.
    [model_rows] = duckdb.sql(
        f"SELECT sum(draft_n_accepted) / sum(draft_n) FROM '{out}' WHERE client = 'aider/0.86.1'"
    ).fetchall()
    small = next(s for s in sc.analyse(tr, tmp_path)["speculative"] if s["model"] == SMALL)
    assert round(model_rows[0], 4) == small["acceptance"]
