"""The docs name only what exists: paths, modules, commands and their flags.

What counts as "named", in README.md and docs/*.md:

- Only text in code: inline code spans (`...`) and fenced blocks. Prose is
  free to say "the reader" or "a recording"; code is a claim someone may paste.
- A **path** is a word with a `/` whose first part is a folder of the
  repository (`addon/`, `tests/`, `bench/`, `docs/`, `.ci/`, or one under
  `addon/llmp/`), or a bare `*.md` name.  It must exist relative to the
  repository, `addon/`, `addon/llmp/` (the docs say `analysis/loss.py`),
  `tests/` or `docs/`; a bare `*.md` may also be one of the spec's pages in
  `../shared/spec/`.  A bare `test_x.py` (or `test_x.py::test_y`) must be a
  file somewhere under `tests/`.  A bare `calc.py` is a user's file, not a claim.  Words with placeholders (`<`, `{`,
  `*`, `$`, `...`, `…`), URLs, absolute paths, `../shared` files and the
  run-time files llmp writes (`*.jsonl`, `*.html`, `*.csv` ...) are not paths
  in this repository and are skipped.  A pattern (`tests/hardening/test_*.py`)
  must match at least one file.
- A **module** is a dotted `llmp.x.y` word: the longest prefix that is a module
  must exist, and a remainder must be an attribute of it.
- A **command** is a line (or a code span) starting with `llmp SUB`,
  `python`/`.venv/bin/python` plus a `bench/` or `.ci/` script, or
  `bash .ci/...`; what follows `--` is the wrapped command's.  The subcommand or script must exist, and each `--flag` on
  the line must be one its argparse parser knows (`llmp`: the parser objects;
  scripts: their `--help`, and their first subcommand's `--help`; shell
  scripts: the flag must appear in the script's text).

And docs/architecture.md's tree lists every module under addon/llmp (each
.py and .c file) and nothing that does not exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASES = [ROOT, ROOT / "addon" / "llmp", ROOT / "addon", ROOT / "tests", ROOT / "docs"]
SPEC = ROOT.parent / "shared" / "spec"
"""The contract beside the repository: the docs cite `rulings.md` and its siblings."""


OUTPUTS = (".jsonl", ".json", ".html", ".csv", ".parquet", ".log", ".txt", ".gguf", ".so")
PLACEHOLDER = re.compile(r"[<>{}*$…]|\.\.\.|://|^~")
PATH_WORD = re.compile(r"^[\w.\-/]+$")
MODULE_WORD = re.compile(r"^llmp(\.\w+)+$")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


FENCE_TAGGED = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
IGNORED = {p.strip("/") for p in (ROOT / ".gitignore").read_text().split() if "*" not in p}
"""What the runs write (`bench/out/`): named in the docs before it exists."""


def code_of(text: str) -> list[tuple[str, bool]]:
    """The code in a markdown text, each line or span with whether it may be a command.

    Blocks tagged json, toml or yaml are data (`"model": "llmp/smollm2"`) and
    skipped.  A fenced block tagged `text` is a program's output: its paths count, its
    lines are no commands (`llmp recorder benchmark` is a heading it prints).
    """
    out: list[tuple[str, bool]] = []
    for tag, block in FENCE_TAGGED.findall(text):
        if tag.strip() in ("json", "jsonc", "toml", "yaml"):
            continue  # a config or a record: its strings are names, not our paths
        out.extend((line, tag.strip() != "text") for line in block.splitlines())
    out.extend((span, True) for span in SPAN.findall(FENCE.sub("", text)))
    return out


def _words(code: str) -> list[str]:
    return [w.strip("\"'(),:;[]") for w in code.split()]


def is_path(word: str) -> bool:
    if not word or PLACEHOLDER.search(word) or not PATH_WORD.match(word):
        return False
    if word.startswith(("/", "-", "../")) or word.endswith(OUTPUTS) or "=" in word:
        return False
    if word.startswith("llmp.") or re.match(r"^\d", word):
        return False
    if "/" in word:
        first = word.split("/", 1)[0]
        # `text/event-stream`, `/v1/chat/completions`, `owner/name`: only words
        # under a folder the repository has are paths.
        return any((base / first).exists() for base in BASES) or first in KNOWN_ROOTS
    # A bare name: the docs' own pages and the spec's; a user's `calc.py` is not ours.
    return word.endswith(".md") and word.count(".") == 1


KNOWN_ROOTS = {"addon", "tests", "bench", "docs", ".ci", "analysis", "apis", "format"}


def path_exists(word: str) -> bool:
    word = word.rstrip("/")
    if word in IGNORED:
        return True
    if any((base / word).exists() for base in BASES):
        return True
    return "/" not in word and (SPEC / word).exists()


def module_exists(word: str) -> bool:
    parts = word.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found and end == len(parts):
            return True  # not imported: `llmp.__main__` would run
        if found:
            obj: object = importlib.import_module(name)
            for attr in parts[end:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


@cache
def llmp_flags(sub: str) -> frozenset[str] | None:
    from llmp.cli import build_parser

    parser = build_parser([sub])
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and sub in action.choices:
            return frozenset(action.choices[sub]._option_string_actions)
    return None


@cache
def script_flags(script: str, sub: str | None) -> frozenset[str]:
    path = ROOT / script
    if path.suffix != ".py":
        return frozenset(FLAG.findall(path.read_text()))
    flags: set[str] = set()
    for extra in ([], [sub] if sub else []):
        if extra == [] and sub is None and flags:
            continue
        run = subprocess.run(
            [sys.executable, str(path), *extra, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        if run.returncode == 0:
            flags.update(FLAG.findall(run.stdout))
    return frozenset(flags)


def command_problem(line: str) -> str | None:
    """What is wrong with a command line, or None (also for lines that are no command).

    Each command of `a && b | c; d` is checked (the README's `bash .ci/setup &&
    .venv/bin/llmp demo`); what follows a redirection is a file, not a command.
    """
    line = line.strip().removeprefix("$ ")
    for part in re.split(r"\s(?:\|\||\||&&|;)\s", line):
        problem = _one_command(re.split(r"\s(?:>|2>|>>)\s", part)[0])
        if problem:
            return problem
    return None


def _one_command(line: str) -> str | None:
    line = line.strip()
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]  # LLMP_X=1 llmp ...
    if not words:
        return None
    if "--" in words:
        words = words[: words.index("--")]  # what follows is the wrapped command's
    if not words:
        return None
    flags = [f for w in words for f in FLAG.findall(w.split("=", 1)[0]) if w.startswith("--")]
    if words[0] in ("llmp", ".venv/bin/llmp") and len(words) > 1:
        if not re.match(r"^[a-z][a-z-]*$", words[1]):
            return None  # `llmp --help`, or output (`llmp analyze: wrote ...`)
        known = llmp_flags(words[1])
        if known is None:
            return f"no subcommand `llmp {words[1]}`"
        bad = [f for f in flags if f not in known]
        return f"`llmp {words[1]}` has no {bad}" if bad else None
    if re.match(r"^(\S*/)?python3?$", words[0]) and len(words) > 1:
        words = words[1:]
        if words[0] == "-m":
            return None  # pytest, pip ...: their own tools
        runner = "python"
    elif words[0] == "bash" and len(words) > 1:
        words = words[1:]
        runner = "bash"
    else:
        return None
    script = words[0]
    if not script.startswith(("bench/", ".ci/")) or PLACEHOLDER.search(script):
        return None
    if not (ROOT / script).is_file():
        return f"no script {script}"
    sub = words[1] if len(words) > 1 and re.match(r"^[a-z][\w-]*$", words[1]) else None
    known = script_flags(script, sub if runner == "python" else None)
    bad = [f for f in flags if f not in known]
    return f"{script} has no {bad}" if bad else None


def glob_problem(word: str) -> str | None:
    """A path pattern (`tests/hardening/test_*.py`) must match some file."""
    if "*" not in word or not is_path(word.replace("*", "x")):
        return None
    if any(any(base.glob(word)) for base in BASES):
        return None
    return f"pattern {word} matches nothing"


TEST_FILE = re.compile(r"^(test_\w+\.py)(?:::\w+)?$")


def missing_test_file(word: str) -> str | None:
    """A bare `test_x.py` (or `test_x.py::test_y`) names a file somewhere under tests/."""
    m = TEST_FILE.match(word)
    if m is None or any((ROOT / "tests").rglob(m.group(1))):
        return None
    return f"test file {m.group(1)}"


def problems(doc: Path) -> list[str]:
    found: list[str] = []
    for code, command in code_of(doc.read_text()):
        for word in _words(code):
            if problem := glob_problem(word) or missing_test_file(word):
                found.append(problem)
            elif MODULE_WORD.match(word):
                if not module_exists(word):
                    found.append(f"module {word}")
            elif is_path(word) and not path_exists(word):
                found.append(f"path {word}")
        problem = command_problem(code) if command else None
        if problem:
            found.append(f"command `{code.strip()}`: {problem}")
    return sorted(set(found))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_names_only_what_exists(doc: Path) -> None:
    assert problems(doc) == []


def test_the_checks_can_fail() -> None:
    """Each rule rejects a made-up name (else the test above would prove nothing)."""
    assert not path_exists("tests/test_hardening_faults.py")
    assert missing_test_file("test_hardening_privacy.py::test_x")
    assert missing_test_file("test_privacy.py::test_x") is None
    assert glob_problem("tests/test_hardening_*.py") and not glob_problem("tests/*/test_*.py")
    assert path_exists("tests/hardening/") and path_exists("analysis/loss.py")
    assert is_path("tests/test_hardening_faults.py") and not is_path("text/event-stream")
    assert not module_exists("llmp.analysis.nowhere") and module_exists("llmp.analysis.loss")
    assert command_problem("llmp analyze --no-such-flag x.jsonl")
    assert command_problem("llmp analyze --json x.jsonl") is None
    assert command_problem("llmp nowhere")
    assert command_problem(".venv/bin/python bench/nowhere.py")
    assert command_problem("bash .ci/nowhere")
    assert command_problem("bash .ci/setup && .venv/bin/llmp nowhere")


TREE_LINE = re.compile(r"^(\s*)([\w.\-]+/?)(?:\s|$)")


def tree_files() -> set[str]:
    """The files docs/architecture.md's tree names under addon/llmp, by indentation."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = next(b for b in FENCE.findall(text) if "llmp_addon.py" in b)
    stack: list[tuple[int, str]] = []
    named: set[str] = set()
    for line in block.splitlines():
        m = TREE_LINE.match(line)
        if not m:
            continue
        depth, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = "/".join([*(s[1].rstrip("/") for s in stack), name.rstrip("/")])
        if name.endswith("/"):
            stack.append((depth, name))
        else:
            named.add(path)
    return {p.removeprefix("addon/llmp/") for p in named if p.startswith("addon/llmp/")}


def test_architecture_tree_lists_every_module() -> None:
    base = ROOT / "addon" / "llmp"
    real = {
        str(p.relative_to(base))
        for p in [*base.rglob("*.py"), *base.rglob("*.c")]
        if "__pycache__" not in p.parts
    }
    listed = tree_files()
    assert sorted(real - listed) == [], "modules missing from docs/architecture.md's tree"
    missing = sorted(p for p in listed if not (base / p).exists())
    assert missing == [], "the tree names files that do not exist"
