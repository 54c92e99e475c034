"""`llmp analyze --rows FILE`: the report's rows as a table for DuckDB, Polars, Spark.

One column per row field (docs/table.md): a measured value `{value, source}`
becomes `<name>` and `<name>_source`, a loss `lost_client` becomes
`lost_client_cause`, `_tokens`, `_ms`, `_ms_source`; lists stay lists
(Parquet list columns, JSON text in CSV); `changed` is JSON text.  Beside the
report's fields: `recording`, the file each row came from (R17 reads several
as one), and `draft_n`, `draft_n_accepted` (speculative decoding, §9).

Rows are read back from the engine's spill file and written in batches, so
memory holds one batch, never the rows.  Parquet needs pyarrow (the `table`
extra); CSV needs nothing.
"""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from llmp.analysis.rows import COMPOSITION, join_spilled, spill_extra
from llmp.apis.base import FIELDS

if TYPE_CHECKING:
    from llmp.analysis.result import Analysis

SCHEMA_VERSION = 1
"""The table's version, in the Parquet metadata as `schema_version` (docs/table.md).
Adding a column keeps it; removing or re-typing one bumps it."""

BATCH_ROWS = 8192
FORMATS = (".parquet", ".csv")
PYARROW_MISSING = (
    "--rows {path} needs pyarrow for Parquet: pip install 'llmp[table]' (or write .csv)"
)

# Column types: str, int, float, bool, ids (a list of row ids), json (JSON text).
STR, INT, FLOAT, BOOL, IDS, JSON = "str", "int", "float", "bool", "ids", "json"

_LOSS = ("lost_client", "lost_external")
_IDS = ("side_calls_between", "other_conversations_between", "other_domains_between")


def _columns() -> tuple[tuple[str, str], ...]:
    cols: list[tuple[str, str]] = [
        ("recording", STR),
        ("id", INT),
        ("api", STR),
        ("model", STR),
        ("client", STR),
        ("t_start_ms", INT),
        ("kind", STR),
        ("side_call_shape", STR),
        ("session", INT),
        ("conversation", INT),
        ("turn", INT),
    ]
    for name in FIELDS:
        cols += [(name, FLOAT if name.endswith("_ms") else INT), (f"{name}_source", STR)]
    for part in COMPOSITION:
        cols += [(f"composition_{part}", INT), (f"composition_{part}_source", STR)]
    cols += [
        ("linked_to", INT),
        ("new_conversation", BOOL),
        ("prefix_tokens", INT),
        ("break_cause", STR),
        ("compaction", BOOL),
        ("predicted_reuse", FLOAT),
        ("observed_reuse", FLOAT),
        ("cause", STR),
    ]
    for loss in _LOSS:
        cols += [
            (f"{loss}_cause", STR),
            (f"{loss}_tokens", INT),
            (f"{loss}_ms", FLOAT),
            (f"{loss}_ms_source", STR),
        ]
    cols += [(name, IDS) for name in _IDS]
    cols += [
        ("loss_measured", BOOL),
        ("changed", JSON),
        ("draft_n", INT),
        ("draft_n_accepted", INT),
        # R34-R37 (additive): the server, the cache split, the cost, the provider's word.
        ("server", STR),
        ("cache_read_tokens", INT),
        ("cache_write_tokens", INT),
        ("uncached_tokens", INT),
        ("cost_usd", FLOAT),
        ("provider_reason", STR),
        ("lost_client_usd", FLOAT),
        ("lost_external_usd", FLOAT),
    ]
    return tuple(cols)


COLUMNS: tuple[tuple[str, str], ...] = _columns()
"""The table's columns and their types, in order (docs/table.md lists them)."""
NAMES = tuple(name for name, _ in COLUMNS)


def _int(v: Any) -> int | None:
    """A count as an integer: JSON may spell an integral count as a float."""
    if v is None or type(v) is int:
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise ValueError(f"not an integer: {v!r}")


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def flat(
    row: dict[str, Any],
    recording: str,
    draft_n: int | None = None,
    draft_n_accepted: int | None = None,
) -> dict[str, Any]:
    """One report row (as `--json` prints it) as one table row, typed as COLUMNS says."""
    out: dict[str, Any] = {"recording": recording}
    for key in ("id", "api", "model", "client", "t_start_ms", "kind", "side_call_shape"):
        out[key] = row[key]
    for key in ("session", "conversation", "turn"):
        out[key] = _int(row[key])
    counts = row["counts"]
    for name in FIELDS:
        mv = counts[name]
        value = None if mv is None else mv["value"]
        out[name] = _float(value) if name.endswith("_ms") else _int(value)
        out[f"{name}_source"] = None if mv is None else mv["source"]
    comp = row["composition"]
    for part in COMPOSITION:
        mv = comp[part]
        out[f"composition_{part}"] = _int(mv["value"])
        out[f"composition_{part}_source"] = mv["source"]
    out["linked_to"] = row["linked_to"]
    out["new_conversation"] = row["new_conversation"]
    out["prefix_tokens"] = _int(row["prefix_tokens"])
    out["break_cause"] = row["break_cause"]
    out["compaction"] = row["compaction"]
    out["predicted_reuse"] = _float(row["predicted_reuse"])
    out["observed_reuse"] = _float(row["observed_reuse"])
    out["cause"] = row["cause"]
    for loss in _LOSS:
        lv = row[loss]
        ms = None if lv is None else lv["ms"]
        out[f"{loss}_cause"] = None if lv is None else lv["cause"]
        out[f"{loss}_tokens"] = None if lv is None else _int(lv["tokens"])
        out[f"{loss}_ms"] = None if ms is None else _float(ms["value"])
        out[f"{loss}_ms_source"] = None if ms is None else ms["source"]
        out[f"{loss}_usd"] = None if lv is None else _float(lv.get("usd"))
    for name in _IDS:
        out[name] = list(row[name])
    out["loss_measured"] = row["loss_measured"]
    changed = row.get("changed")
    out["changed"] = None if changed is None else orjson.dumps(changed).decode()
    out["draft_n"] = draft_n
    out["draft_n_accepted"] = draft_n_accepted
    out["server"] = row.get("server")
    for name in ("cache_read_tokens", "cache_write_tokens", "uncached_tokens"):
        out[name] = _int(row.get(name))
    out["cost_usd"] = _float(row.get("cost_usd"))
    out["provider_reason"] = row.get("provider_reason")
    return out


def table_rows(analysis: Analysis) -> Iterator[dict[str, Any]]:
    """The analysis's rows as table rows, streamed from the spill file (`rows=True`)."""
    engine = analysis.engine
    spill = engine.spill
    if spill is None:
        raise ValueError("the analysis kept no rows: analyze(..., rows=True)")
    labels = [orjson.dumps(label) for label in engine.clients.labels()]
    names = analysis.paths or ["-"]
    for line in spill.lines():
        source, draft_n, accepted = spill_extra(line)
        row = orjson.loads(join_spilled(line, labels))
        yield flat(row, names[source] if source < len(names) else str(source), draft_n, accepted)


# -- writers -------------------------------------------------------------------


def table_format(path: str | Path) -> str | None:
    """`.parquet` or `.csv` from the file name; None for anything else."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in FORMATS else None


def pyarrow_missing() -> bool:
    """Whether Parquet cannot be written here (pyarrow not installed)."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return True
    return False


def arrow_schema() -> Any:
    """The Parquet schema, with `schema_version` in its metadata."""
    import pyarrow as pa

    types = {
        STR: pa.string(),
        INT: pa.int64(),
        FLOAT: pa.float64(),
        BOOL: pa.bool_(),
        IDS: pa.list_(pa.int64()),
        JSON: pa.string(),
    }
    return pa.schema(
        [pa.field(name, types[kind]) for name, kind in COLUMNS],
        metadata={"schema_version": str(SCHEMA_VERSION), "generator": "llmp analyze --rows"},
    )


def _batches(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_parquet(fd: int, rows: Iterable[dict[str, Any]]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    n = 0
    with os.fdopen(fd, "wb") as out, pq.ParquetWriter(out, schema, compression="zstd") as writer:
        for batch in _batches(rows):
            writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def csv_cell(kind: str, value: Any) -> Any:
    """Empty for null, `true`/`false`, lists as JSON text: what a CSV reader infers back."""
    if value is None:
        return ""
    if kind == BOOL:
        return "true" if value else "false"
    if kind == IDS:
        return orjson.dumps(value).decode()
    return value


def _write_csv(fd: int, rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    out: IO[str]
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(NAMES)
        for batch in _batches(rows):
            w.writerows([csv_cell(kind, row[name]) for name, kind in COLUMNS] for row in batch)
            n += len(batch)
    return n


_WRITERS: dict[str, Callable[[int, Iterable[dict[str, Any]]], int]] = {
    ".parquet": _write_parquet,
    ".csv": _write_csv,
}


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write table rows to `path` (its suffix says the format); the number written.

    The file appears whole or not at all: it is written beside its place and
    renamed into it.  Raises ValueError for an unknown suffix, ImportError
    when Parquet is asked for without pyarrow, OSError when it cannot be written.
    """
    target = Path(path)
    fmt = table_format(target)
    if fmt is None:
        raise ValueError(f"--rows {target}: the name must end in .parquet or .csv")
    if fmt == ".parquet" and pyarrow_missing():
        raise ImportError(PYARROW_MISSING.format(path=target))
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        n = _WRITERS[fmt](fd, rows)
        os.chmod(tmp, 0o666 & ~_umask())  # as any new file: mkstemp's 0600 is for the temp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_table(analysis: Analysis, path: str | Path) -> int:
    """The analysis's rows (`analyze(..., rows=True)`) as a table at `path`."""
    return write_rows(table_rows(analysis), path)


__all__ = [
    "COLUMNS",
    "NAMES",
    "SCHEMA_VERSION",
    "arrow_schema",
    "flat",
    "pyarrow_missing",
    "table_format",
    "table_rows",
    "write_rows",
    "write_table",
]
