"""The analysis package's facade (`llmp.analysis.__init__`, which runs the engine) is
never the way its own modules reach each other: no import cycle goes through it."""

from __future__ import annotations

import ast
from pathlib import Path

import llmp.analysis

PACKAGE = Path(llmp.analysis.__file__).parent


def _facade_imports(path: Path) -> list[str]:
    """The names a module takes from the package itself (`from llmp.analysis import x`,
    `import llmp.analysis`), at any depth of the file (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "llmp.analysis":
            found += [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "llmp.analysis"]
    return found


def test_no_finding_module_imports_through_the_facade() -> None:
    modules = sorted((PACKAGE / "findings").glob("*.py"))
    assert len(modules) >= 8
    offenders = {p.name: names for p in modules if (names := _facade_imports(p))}
    assert offenders == {}


def test_no_module_the_facade_loads_imports_it_back() -> None:
    """Every module of the package but the command line (`command.py` calls `analyze`,
    the facade's own function, and the facade never imports it)."""
    offenders = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name == "__init__.py" and p.parent == PACKAGE:
            continue
        names = _facade_imports(p)
        if p.name == "command.py" and p.parent == PACKAGE:
            names = [n for n in names if n not in ("analyze", "Analysis")]
        if names:
            offenders[str(p.relative_to(PACKAGE))] = names
    assert offenders == {}
    assert "command" not in (PACKAGE / "__init__.py").read_text("utf-8")
