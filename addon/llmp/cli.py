"""The `llmp` console script: one entry, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _demo(sub: Any) -> None:
    from llmp.demo import command

    command.register(sub)


def _proxy(sub: Any) -> None:
    from llmp.recorder import proxy

    proxy.register(sub)


def _run(sub: Any) -> None:
    from llmp.recorder import run

    run.register(sub)


def _analyze(sub: Any) -> None:
    from llmp.analysis import command

    command.register(sub)


COMMANDS: dict[str, Callable[[Any], None]] = {
    "demo": _demo,
    "proxy": _proxy,
    "run": _run,
    "analyze": _analyze,
}
"""Each subcommand and what registers it (importing its module), in `llmp --help`'s order."""


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand a command line runs (its first word), or None: none, or unknown."""
    for arg in argv:
        if arg.startswith("-"):
            return None  # `-h` before any subcommand: the whole listing
        return arg if arg in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line; each subcommand registers itself.

    Given the `argv` that will be parsed, only the subcommand it runs is
    imported: the others' modules (the demo, the recorder with asyncio and ssl)
    cost ~60 ms of an `analyze`'s start.  Without a subcommand (`llmp --help`,
    a typo) every one is registered, so the listing and the error name them all.
    """
    parser = argparse.ArgumentParser(
        prog="llmp",
        description="Record local LLM agent traffic and explain where the prefill time went.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen(argv) if argv is not None else None
    for name, register in COMMANDS.items():
        if chosen is None or name == chosen:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand and return its exit code."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(args_in)
    args = parser.parse_args(args_in)
    handler = args.handler
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("llmp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
