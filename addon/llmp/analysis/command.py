"""`llmp analyze RECORDING... [--json]`: the command line of the analyzer."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from llmp.analysis import analyze
from llmp.analysis.config import add_options, from_args


def register(subparsers: Any) -> None:
    """Add the `analyze` subcommand to the `llmp` parser."""
    p = subparsers.add_parser(
        "analyze",
        help="explain where the prefill time of a recording went",
        description="Read one or more llmp recordings (or - for stdin) and report how much "
        "prefill time was lost re-processing tokens the server could have reused, why, and "
        "what to change.",
    )
    p.add_argument(
        "recordings", nargs="+", metavar="RECORDING", help="recording file, or - for stdin"
    )
    p.add_argument("--json", action="store_true", help="print the report v1 as JSON")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show progress on stderr (default: when stderr is a terminal)",
    )
    add_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Analyse and print; the exit code."""
    for path in args.recordings:
        if path != "-" and not os.path.isfile(path):
            print(f"llmp analyze: {path}: no such file", file=sys.stderr)
            return 2
    cfg = from_args(args)
    try:
        result = analyze(args.recordings, cfg, progress=args.progress, rows=args.json)
    except OSError as exc:
        print(f"llmp analyze: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            out = getattr(sys.stdout, "buffer", None)
            if out is not None:
                sys.stdout.flush()
                result.write_json(out)
                out.flush()
            else:  # a text-only stdout (an embedding host)
                import io

                buf = io.BytesIO()
                result.write_json(buf)
                sys.stdout.write(buf.getvalue().decode("utf-8"))
        else:
            from rich.console import Console

            from llmp.analysis.render import render

            engine = result.engine
            console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 110)
            render(
                console,
                result.header(),
                engine.totals.convs,
                engine.clients.label,
                result.stats.sessions,
                engine.totals.side_calls,
                engine.totals.stateless,
            )
    finally:
        result.close()
    return 0
