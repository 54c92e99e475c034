"""`llmp analyze RECORDING... [--json] [--tokenize URL] [--html FILE] [--rows FILE] [--prices FILE]
[--fail-on K]`.

The command line of the analyzer.  In order, it:

1. checks every option (a bad one exits 2 before anything is read or written);
2. with `--tokenize URL`, enriches each recording in place with the server's
   token counts (`llmp.format.token_counts.enrich_file`), one summary line each on stderr;
3. analyses, and prints the readable report or, with `--json`, the report v1;
4. with `--html FILE`, writes the page as well, and with `--rows FILE` the rows
   as a Parquet or CSV table (docs/table.md), both from the same pass;
5. with `--fail-on`, exits 1 when a listed finding is present (docs/ci-gate.md).

Exit codes: 0 done (and the gate passed), 1 the gate failed, 2 a usage,
input or output error (one line on stderr: `llmp analyze: …`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import IO, Any

from llmp.analysis import Analysis, analyze
from llmp.analysis.changes import MAX_CHANGES
from llmp.analysis.config import Config, add_options, from_args
from llmp.analysis.findings import KINDS

STDIN = "-"


def register(subparsers: Any) -> None:
    """Add the `analyze` subcommand to the `llmp` parser."""
    p = subparsers.add_parser(
        "analyze",
        help="explain where the prefill time of a recording went",
        description="Read one or more llmp recordings (or - for stdin) and report how much "
        "prefill time was lost re-processing tokens the server could have reused, why, and "
        "what to change.",
        epilog="Exit codes: 0 done (gate passed), 1 --fail-on found a listed finding, "
        "2 bad option, unreadable input, or a --tokenize / --html failure.",
    )
    p.add_argument(
        "recordings", nargs="+", metavar="RECORDING", help="recording file, or - for stdin"
    )
    p.add_argument("--json", action="store_true", help="print the report v1 as JSON")
    p.add_argument(
        "--tokenize",
        metavar="URL",
        help="first fill each recording's token counts from this server's /tokenize "
        "(llama-server, vLLM or SGLang; rewrites the files in place, atomically; full "
        "recordings only; not for stdin)",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write the report as a self-contained web page to FILE; the readable "
        "report (or --json) is still printed",
    )
    p.add_argument(
        "--rows",
        metavar="FILE",
        help="also write the report's rows as a table to FILE.parquet (needs pyarrow: "
        "pip install 'llmp[table]') or FILE.csv, one column per row field, for DuckDB, "
        "Polars or Spark (docs/table.md); the readable report (or --json) is still printed",
    )
    p.add_argument(
        "--prices",
        metavar="FILE",
        help="price these models at your own rates (a TOML table per model, US dollars per "
        'million tokens; docs/analysis.md, "Prices") instead of genai-prices\' list',
    )
    gate = p.add_argument_group("CI gate (see docs/ci-gate.md)")
    gate.add_argument(
        "--fail-on",
        action="append",
        metavar="KIND[,KIND...]",
        help="exit 1, with one line per finding on stderr, when a finding of a listed kind "
        f"is present; kinds: {', '.join(KINDS)}",
    )
    gate.add_argument(
        "--min-lost-ms",
        type=float,
        metavar="N",
        help="with --fail-on: only loss findings with lost_ms >= N fail (default 0: any); "
        "findings without a lost_ms (untimed losses, context findings) fail when present",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show progress on stderr (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--jobs",
        default="1",
        metavar="N",
        help="analyse sessions in up to N processes (auto: one per core), the same report "
        "as one process; --html runs in one process (default 1; docs/analysis.md, "
        '"Parallel analysis")',
    )
    add_options(p)
    p.set_defaults(handler=run)


def _fail(message: str) -> int:
    print(f"llmp analyze: {message}", file=sys.stderr)
    return 2


def parse_jobs(text: str) -> int | None:
    """`--jobs`: a count of 1 or more, or `auto` (the machine's cores); None if neither.

    Here, not in `parallel`: one process never imports multiprocessing (~20 ms of
    every start)."""
    if text == "auto":
        return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        return None
    return n if n >= 1 else None


def run(args: argparse.Namespace) -> int:
    """Check, enrich, analyse, print, write, gate; the exit code."""
    paths: list[str] = args.recordings
    for path in paths:
        if path != STDIN and not os.path.isfile(path):
            return _fail(f"{path}: no such file")

    from llmp.analysis.gate import offending, parse_kinds, reason

    jobs = parse_jobs(args.jobs)
    if jobs is None:
        return _fail(f"--jobs must be a whole number of 1 or more, or auto, not {args.jobs!r}")

    kinds: list[str] = []
    if args.fail_on is not None:
        kinds, unknown = parse_kinds(args.fail_on)
        if unknown:
            return _fail(
                f"unknown finding kind{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)} in --fail-on; valid kinds: {', '.join(KINDS)}"
            )
        if not kinds:
            return _fail(f"--fail-on needs at least one kind; valid kinds: {', '.join(KINDS)}")
    min_lost_ms = args.min_lost_ms
    if min_lost_ms is not None:
        if args.fail_on is None:
            return _fail("--min-lost-ms only applies with --fail-on")
        if not min_lost_ms >= 0:  # also rejects nan
            return _fail(f"--min-lost-ms must be 0 or more, not {min_lost_ms:g}")
    html: Path | None = None
    if args.html is not None:
        html = Path(args.html)
        if html.is_dir():
            return _fail(f"--html {html}: is a directory")
        if not html.resolve().parent.is_dir():
            return _fail(f"--html {html}: no such directory {html.resolve().parent}")
    table: Path | None = None
    if args.rows is not None:
        from llmp.analysis.table import PYARROW_MISSING, pyarrow_missing, table_format

        table = Path(args.rows)
        fmt = table_format(table)
        if fmt is None:
            return _fail(f"--rows {table}: the name must end in .parquet or .csv")
        if table.is_dir():
            return _fail(f"--rows {table}: is a directory")
        if not table.resolve().parent.is_dir():
            return _fail(f"--rows {table}: no such directory {table.resolve().parent}")
        if fmt == ".parquet" and pyarrow_missing():
            return _fail(PYARROW_MISSING.format(path=table))
    prices = None
    if args.prices is not None:
        from llmp.analysis.cost import Prices, PricesFileError

        try:
            prices = Prices.from_file(args.prices)
        except PricesFileError as exc:
            return _fail(str(exc))
    if args.tokenize is not None:
        if STDIN in paths:
            return _fail(
                "--tokenize rewrites the recording in place and cannot rewrite standard "
                "input; save it to a file and pass the file"
            )
        status = _tokenize(paths, args.tokenize, args.progress)
        if status:
            return status

    cfg = dataclasses.replace(from_args(args), prices=prices)
    try:
        result = analyze(
            paths,
            cfg,
            progress=args.progress,
            rows=args.json or table is not None,
            summaries=not args.json,
            keep=html is not None,
            changes=MAX_CHANGES if html is not None else None,
            jobs=jobs,
        )
    except OSError as exc:
        return _fail(str(exc))
    try:
        header = result.header()
        if args.json:
            _print_json(result, header)
        else:
            _print_readable(result, header)
        if html is not None:
            status = _write_html(result, header, html)
            if status:
                return status
        if table is not None:
            status = _write_rows(result, table)
            if status:
                return status
    finally:
        result.close()

    if args.fail_on is None:
        return 0
    bad = offending(header["findings"], kinds, min_lost_ms or 0.0)
    sys.stdout.flush()
    for f in bad:
        print(reason(f), file=sys.stderr)
    if bad:
        return 1
    print(
        f"llmp: PASS no {', '.join(kinds)} finding"
        + (f" with lost_ms >= {min_lost_ms:g}" if min_lost_ms else ""),
        file=sys.stderr,
    )
    return 0


def _tokenize(paths: list[str], url: str, progress: bool | None) -> int:
    """Enrich each distinct file in place; 0, or 2 after the first failure."""
    from llmp.apis import record_targets
    from llmp.format.token_counts import TokenizeError, enrich_file

    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        try:
            result = enrich_file(Path(path), url, targets=record_targets, progress=progress)
        except TokenizeError as exc:
            return _fail(str(exc))
        print(f"llmp analyze: {result.summary()}", file=sys.stderr)
    return 0


def _print_json(result: Analysis, header: dict[str, Any]) -> None:
    from llmp.analysis.report import spilled_blocks, write_report

    engine = result.engine
    spill = engine.spill
    assert spill is not None

    def write(out: IO[bytes]) -> None:
        write_report(out, header, spilled_blocks(spill, engine.clients.labels()))

    out = getattr(sys.stdout, "buffer", None)
    if out is not None:
        sys.stdout.flush()
        write(out)
        out.flush()
    else:  # a text-only stdout (an embedding host)
        import io

        buf = io.BytesIO()
        write(buf)
        sys.stdout.write(buf.getvalue().decode("utf-8"))


def print_readable(paths: list[str], cfg: Config | None = None) -> None:
    """Analyse the recordings and print the readable report (what `llmp analyze` prints)."""
    explain(paths, cfg)


def explain(
    paths: list[str],
    cfg: Config | None = None,
    *,
    out: IO[str] | None = None,
    html: Path | None = None,
) -> None:
    """The readable report of the recordings to `out` (stdout), and the page to `html`,
    from one pass (`llmp demo` and `llmp run` call this)."""
    result = analyze(
        paths,
        cfg,
        progress=False,
        rows=False,
        keep=html is not None,
        changes=MAX_CHANGES if html is not None else None,
    )
    try:
        header = result.header()
        _print_readable(result, header, out)
        if html is not None:
            _write_html(result, header, html)
    finally:
        result.close()


def _print_readable(result: Analysis, header: dict[str, Any], out: IO[str] | None = None) -> None:
    from rich.console import Console

    from llmp.analysis.render import render

    engine = result.engine
    stream = out if out is not None else sys.stdout
    console = Console(file=stream, width=None if stream.isatty() else 110)
    render(
        console,
        header,
        engine.totals.convs,
        engine.clients.label,
        result.stats.sessions,
        engine.totals.side_calls,
        engine.totals.stateless,
    )


def _write_rows(result: Analysis, out: Path) -> int:
    """The rows as a table, streamed from the pass's spill file."""
    from llmp.analysis.table import write_table

    try:
        n = write_table(result, out)
    except OSError as exc:
        return _fail(f"--rows {out}: {exc.strerror or exc}")
    print(f"llmp analyze: wrote {out} ({n:,} rows)", file=sys.stderr)
    return 0


def _write_html(result: Analysis, header: dict[str, Any], out: Path) -> int:
    """The page, with the what-changed diffs collected in the same pass."""
    from llmp.analysis.html import write_html

    report = dict(header)
    report["rows"] = result.rows()
    try:
        write_html(report, out, changes=result.change_list())
    except OSError as exc:
        return _fail(f"--html {out}: {exc.strerror or exc}")
    print(f"llmp analyze: wrote {out}", file=sys.stderr)
    return 0
