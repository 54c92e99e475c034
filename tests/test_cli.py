"""The console script imports only the subcommand it runs, and still lists them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmp.cli import COMMANDS, build_parser, main

_PROBE = """
import sys
from llmp.cli import build_parser, main
mode, prefixes, *argv = sys.argv[1:]
code = 0
if mode == "run":
    code = main(argv)
else:
    build_parser(argv).parse_args(argv)
print(",".join(sorted(m for m in sys.modules if m.startswith(tuple(prefixes.split(","))))), code)
"""


def _probe(argv: list[str], prefixes: tuple[str, ...], run: bool = False) -> tuple[set[str], str]:
    """The modules under `prefixes` loaded once the command line is parsed (or, with
    `run`, once the command has run), and the exit code."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "run" if run else "parse", ",".join(prefixes), *argv],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[-1]
    modules, code = out.rsplit(" ", 1)
    return set(modules.split(",")) - {""}, code


def _loaded(*argv: str) -> set[str]:
    return _probe(list(argv), ("llmp.demo", "llmp.recorder"))[0]


def test_analyze_imports_neither_the_demo_nor_the_recorder() -> None:
    assert _loaded("analyze", "--json", "some.jsonl") == set()


def test_analyze_in_one_process_imports_no_process_pool(tmp_path: Path) -> None:
    """`--jobs` alone needs multiprocessing: a one-process run does not pay its import."""
    rec = tmp_path / "empty.jsonl"
    rec.write_bytes(b"")
    pool = ("multiprocessing", "concurrent.futures", "llmp.analysis.parallel", "mitmproxy")
    modules, code = _probe(["analyze", "--json", str(rec)], pool, run=True)
    assert (modules, code) == (set(), "0")


def test_a_recorder_subcommand_imports_the_recorder() -> None:
    assert "llmp.recorder.proxy" in _loaded("proxy", "--upstream", "http://127.0.0.1:1")


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listing = capsys.readouterr().out
    for name in COMMANDS:
        assert f"    {name} " in listing


def test_an_unknown_subcommand_names_them_all(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["anlyze", "x.jsonl"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'anlyze'" in err
    for name in COMMANDS:
        assert repr(name) in err


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "--json", "--min-lost-ms", "5", "a.jsonl", "b.jsonl"],
        ["proxy", "--upstream", "http://127.0.0.1:8080"],
        ["run", "--upstream", "http://127.0.0.1:8080", "--", "true"],
        ["demo", "--out", "/tmp/x"],
    ],
)
def test_one_subcommand_parses_as_the_whole_parser_does(argv: list[str]) -> None:
    whole = vars(build_parser().parse_args(argv))
    alone = vars(build_parser(argv).parse_args(argv))
    assert alone == whole
