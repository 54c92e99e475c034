"""The `llmp` console script: one entry, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand registers itself."""
    parser = argparse.ArgumentParser(
        prog="llmp",
        description="Record local LLM agent traffic and explain where the prefill time went.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from llmp.analysis import command as analyze_command
    from llmp.demo import command as demo
    from llmp.recorder import proxy, run

    demo.register(sub)
    proxy.register(sub)
    run.register(sub)
    analyze_command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("llmp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
