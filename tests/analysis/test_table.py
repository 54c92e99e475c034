"""`llmp analyze --rows`: the report's rows as Parquet and CSV, read back by DuckDB.

The table must say what the report says, field by field: each test reads the
file with the real DuckDB (or the CSV with Python's csv), rebuilds the
report's nested row from the flat columns, and compares it with the report
of the same run.  The DuckDB recipe of docs/table.md is run as written.
"""

from __future__ import annotations

import csv
import datetime as dt
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmp.analysis import analyze
from llmp.analysis import table as tbl
from llmp.apis.base import FIELDS
from llmp.cli import main
from tests.support import scenarios as sc

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

DOC = Path(__file__).resolve().parents[2] / "docs" / "table.md"
SOME = ["clean_chat", "changed_tools", "title_side_call", "two_harnesses", "server_reset",
        "ollama_evaluated", "other_model", "compaction"]  # fmt: skip


def duck_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a Parquet file as DuckDB reads it, by column name."""
    rel = duckdb.sql(f"SELECT * FROM read_parquet('{path}')")
    return [dict(zip(rel.columns, values, strict=True)) for values in rel.fetchall()]


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """A table row rebuilt as the report's row (the inverse of `table.flat`)."""

    def mv(name: str) -> dict[str, Any] | None:
        value = flat[name]
        return None if value is None else {"value": value, "source": flat[f"{name}_source"]}

    def loss(name: str) -> dict[str, Any] | None:
        if flat[f"{name}_cause"] is None:
            return None
        return {
            "cause": flat[f"{name}_cause"],
            "tokens": flat[f"{name}_tokens"],
            "ms": mv(f"{name}_ms"),
            "usd": flat[f"{name}_usd"],
        }

    keys = ["id", "api", "model", "client", "t_start_ms", "kind", "side_call_shape", "session",
            "conversation", "turn"]  # fmt: skip
    row = {k: flat[k] for k in keys}
    row["counts"] = {name: mv(name) for name in FIELDS}
    row["composition"] = {
        p: mv(f"composition_{p}") for p in ("system", "tools", "history", "new_content")
    }
    for k in ("linked_to", "new_conversation", "prefix_tokens", "break_cause", "compaction",
              "predicted_reuse", "observed_reuse", "cause"):  # fmt: skip
        row[k] = flat[k]
    row["lost_client"] = loss("lost_client")
    row["lost_external"] = loss("lost_external")
    for k in ("side_calls_between", "other_conversations_between", "other_domains_between",
              "loss_measured"):  # fmt: skip
        row[k] = flat[k]
    row["changed"] = None if flat["changed"] is None else orjson.loads(flat["changed"])
    for k in ("server", "cache_read_tokens", "cache_write_tokens", "uncached_tokens", "cost_usd",
              "provider_reason"):  # fmt: skip
        row[k] = flat[k]
    return row


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON kind (a bool is not a number, a number not a string)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)):
        return isinstance(b, (int, float)) and a == b
    return type(a) is type(b) and a == b


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["analyze", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- A1: the rows, field by field --------------------------------------------------


@pytest.mark.parametrize("name", SOME)
@pytest.mark.parametrize("mode", ["digest", "full"])
def test_parquet_rows_read_back_in_duckdb_equal_the_reports_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, mode: str
) -> None:
    rec = sc.SCENARIOS[name]().write(tmp_path / "rec.jsonl", mode)
    out = tmp_path / "rows.parquet"
    code, stdout, err = run_cli([str(rec), "--json", "--rows", str(out)], capsys)
    assert code == 0, err
    report = orjson.loads(stdout)
    got = duck_rows(out)
    assert len(got) == len(report["rows"]) > 0
    assert f"wrote {out} ({len(got):,} rows)" in err
    for flat, row in zip(got, report["rows"], strict=True):
        assert same(nested(flat), row), (name, row["id"])
        assert flat["recording"] == str(rec)
        assert flat["draft_n"] is None and flat["draft_n_accepted"] is None


def test_the_schema_is_the_documented_one(tmp_path: Path) -> None:
    rec = sc.title_side_call().write(tmp_path / "rec.jsonl")
    out = tmp_path / "rows.parquet"
    assert main(["analyze", str(rec), "--rows", str(out)]) == 0
    described = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{out}')").fetchall()
    assert [c[0] for c in described] == list(tbl.NAMES)
    duck_type = {"str": "VARCHAR", "json": "VARCHAR", "int": "BIGINT", "float": "DOUBLE",
                 "bool": "BOOLEAN", "ids": "BIGINT[]"}  # fmt: skip
    assert [c[1] for c in described] == [duck_type[k] for _, k in tbl.COLUMNS]
    meta = dict(
        duckdb.sql(
            f"SELECT key::VARCHAR, value::VARCHAR FROM parquet_kv_metadata('{out}')"
        ).fetchall()
    )
    assert meta["schema_version"] == str(tbl.SCHEMA_VERSION) == "1"
    # docs/table.md lists every column, in order.
    documented = re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \|", DOC.read_text(), flags=re.M)
    assert [n for pair in documented for n in pair if n] == list(tbl.NAMES)


def test_rows_stream_to_the_file_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    monkeypatch.setattr(tbl, "BATCH_ROWS", 4)
    rec = sc.two_harnesses().write(tmp_path / "rec.jsonl")
    result = analyze([str(rec)], rows=True)
    try:
        report = result.report()
        n = tbl.write_table(result, tmp_path / "rows.parquet")
    finally:
        result.close()
    assert n == len(report["rows"]) == 6
    assert pq.ParquetFile(tmp_path / "rows.parquet").metadata.num_row_groups == 2  # 4 + 2
    assert [r["id"] for r in duck_rows(tmp_path / "rows.parquet")] == [
        r["id"] for r in report["rows"]
    ]


def test_csv_rows_equal_the_reports_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = sc.rewritten_history().write(tmp_path / "rec.jsonl", "full")
    out = tmp_path / "rows.csv"
    code, stdout, err = run_cli([str(rec), "--json", "--rows", str(out)], capsys)
    assert code == 0, err
    report = orjson.loads(stdout)
    with open(out, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == tbl.NAMES
        cells = list(reader)
    kinds = dict(tbl.COLUMNS)

    def typed(name: str, cell: str) -> Any:
        kind = kinds[name]
        if cell == "":
            return [] if kind == "ids" else None
        if kind == "int":
            return int(cell)
        if kind == "float":
            return float(cell)
        if kind == "bool":
            assert cell in ("true", "false")
            return cell == "true"
        if kind == "ids":
            return orjson.loads(cell)
        return cell

    assert len(cells) == len(report["rows"])
    assert any(row["changed"] for row in report["rows"])  # the JSON-text column is exercised
    for cell, row in zip(cells, report["rows"], strict=True):
        flat = {k: typed(k, v) for k, v in cell.items()}
        assert same(nested(flat), row), row["id"]


def test_several_files_name_each_rows_recording(tmp_path: Path) -> None:
    """One recording split into two files (R17): one session, each row naming its own file."""
    tr = sc.changed_system()
    lines = tr.lines("digest")
    by_id = {orjson.loads(line)["id"]: line for line in lines}
    first = tmp_path / "part-1.jsonl"
    second = tmp_path / "part-2.jsonl"
    # The first file out of id order: the window reorders it; with a window of
    # one line it cannot, and the reader starts again in exact mode.
    first.write_bytes(b"".join(by_id[i] for i in sorted(by_id, reverse=True) if i <= 3))
    second.write_bytes(b"".join(by_id[i] for i in sorted(by_id) if i > 3))
    for window in (None, 1):  # the streaming window, and exact mode
        result = analyze([str(second), str(first)], rows=True, window_lines=window)
        try:
            report = result.report()
            flat = list(tbl.table_rows(result))
            exact = result.stats.exact
        finally:
            result.close()
        assert {r["session"] for r in report["rows"]} == {1}
        assert [f["recording"] for f in flat] == [
            str(first) if r["id"] <= 3 else str(second) for r in report["rows"]
        ]
        assert all(same(nested(f), r) for f, r in zip(flat, report["rows"], strict=True))
        assert exact == (window == 1)  # with one line of window, the exact pass gave the rows


def test_rows_with_the_readable_report_and_html_from_one_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = sc.title_side_call().write(tmp_path / "rec.jsonl")
    html, out = tmp_path / "r.html", tmp_path / "rows.parquet"
    code, stdout, err = run_cli([str(rec), "--html", str(html), "--rows", str(out)], capsys)
    assert code == 0, err
    assert "Prefill took" in stdout and html.is_file()
    code, stdout, _ = run_cli([str(rec), "--json"], capsys)
    assert code == 0
    rows = orjson.loads(stdout)["rows"]
    assert all(same(nested(f), r) for f, r in zip(duck_rows(out), rows, strict=True))
    assert len(duck_rows(out)) == len(rows) == 6


def test_bad_rows_options_exit_2_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = str(sc.clean_chat().write(tmp_path / "rec.jsonl"))
    code, out, err = run_cli([rec, "--rows", str(tmp_path / "rows.json")], capsys)
    assert (code, out) == (2, "")
    assert (
        err
        == f"llmp analyze: --rows {tmp_path / 'rows.json'}: the name must end in .parquet or .csv\n"
    )
    code, _, err = run_cli([rec, "--rows", str(tmp_path / "no" / "rows.csv")], capsys)
    assert code == 2 and "no such directory" in err
    monkeypatch.setattr(tbl, "pyarrow_missing", lambda: True)
    code, out, err = run_cli([rec, "--rows", str(tmp_path / "rows.parquet")], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "pip install 'llmp[table]'" in err
    code, _, err = run_cli([rec, "--rows", str(tmp_path / "rows.csv")], capsys)
    assert code == 0 and (tmp_path / "rows.csv").is_file()  # CSV needs no pyarrow
    assert not (tmp_path / "rows.parquet").exists()
    assert not list(tmp_path.glob(".rows*"))  # no temporary file left behind


# -- A2: the DuckDB recipe of docs/table.md ----------------------------------------


def recipe_sql() -> str:
    """The SQL block under "Recipe: lost seconds per client per day", exactly as written."""
    text = DOC.read_text()
    section = text[text.index("## Recipe: lost seconds per client per day") :]
    found = re.search(r"```sql\n(.*?)```", section, flags=re.S)
    assert found is not None
    return found.group(1)


def test_the_docs_duckdb_recipe_sums_lost_seconds_per_client_per_day(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several recordings over three days; day 1 has two, from different clients.
    plan = [("changed_system", 0), ("title_side_call", 1), ("two_harnesses", 1),
            ("server_reset", 2), ("other_model", 2)]  # fmt: skip
    (tmp_path / "rows").mkdir()
    expected: dict[tuple[str, dt.date], list[float]] = defaultdict(lambda: [0.0, 0, 0, 0])
    recordings: dict[tuple[str, dt.date], set[str]] = defaultdict(set)
    for name, day in plan:
        rec = sc.shifted(sc.SCENARIOS[name](), day).write(tmp_path / f"{name}.jsonl")
        code, stdout, err = run_cli(
            [str(rec), "--json", "--rows", str(tmp_path / "rows" / f"{name}.parquet")], capsys
        )
        assert code == 0, err
        for row in orjson.loads(stdout)["rows"]:
            when = dt.datetime.fromtimestamp(row["t_start_ms"] / 1000, dt.UTC).date()
            key = (row["client"], when)
            e = expected[key]
            for loss in (row["lost_client"], row["lost_external"]):
                if loss is not None:
                    e[0] += loss["ms"]["value"] if loss["ms"] is not None else 0
                    e[1] += loss["tokens"]
            e[2] += row["kind"] == "turn"
            recordings[key].add(str(rec))
    monkeypatch.chdir(tmp_path)  # the recipe reads rows/*.parquet from where it runs
    rel = duckdb.sql(recipe_sql())
    got = [dict(zip(rel.columns, values, strict=True)) for values in rel.fetchall()]
    assert rel.columns == ["client", "day", "lost_s", "lost_tokens", "turns", "recordings"]
    assert [(g["client"], g["day"]) for g in got] == sorted(expected, key=lambda k: (k[1], k[0]))
    assert len({g["day"] for g in got}) == 3
    for g in got:
        ms, tokens, turns, _ = expected[(g["client"], g["day"])]
        assert g["lost_s"] == pytest.approx(round(ms / 1000, 3), abs=1e-9), g
        assert (g["lost_tokens"], g["turns"]) == (tokens, turns), g
        assert g["recordings"] == len(recordings[(g["client"], g["day"])])
    assert sum(g["lost_s"] for g in got) > 1  # the recordings did lose time


def test_flat_rejects_a_fractional_count() -> None:
    """A count is an integer column: a fractional one is an error, never silently rounded."""
    with pytest.raises(ValueError, match="not an integer"):
        tbl._int(2.5)
    assert tbl._int(3.0) == 3 and type(tbl._int(3.0)) is int and tbl._int(None) is None
