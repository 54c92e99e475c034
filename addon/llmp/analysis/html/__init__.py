"""`llmp analyze --html FILE`: the report v1 drawn as one self-contained page.

The page is built from the report v1 (the dict `llmp analyze --json` prints)
and, for the "what changed" diffs, from the message digests collected during
the same pass (`llmp.analysis.changes`).  It holds no message text, ever: only roles,
sizes, short hashes, tool names, client and model names.  It needs no
network: inline CSS, hand-drawn inline SVG, no script, no external font, and
a Content-Security-Policy that forbids loading anything.

Everything that comes from traffic (client names, tool names, models) is
escaped with `html.escape`.  See docs/html-report.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmp.analysis.html.common import (
    CAUSES,
    MAX_BARS,
    MAX_CHARTS,
    _e,
    _obj_or_none,
    _rows,
    _when,
    is_break,
)
from llmp.analysis.html.diffs import _changes
from llmp.analysis.html.page import _cause_css, _css, _Page
from llmp.analysis.html.sections import _clients, _findings, _header, _loss_by_cause
from llmp.analysis.html.timeline import _timeline

__all__ = ["CAUSES", "MAX_BARS", "MAX_CHARTS", "is_break", "render_html", "write_html"]


def render_html(
    report: dict[str, Any],
    changes: list[dict[str, Any]] | None = None,
    *,
    title: str | None = None,
) -> str:
    """The whole page as a string (see `write_html`)."""
    window = _obj_or_none(report, "window")
    if title is None:
        start = window.get("start_ms") if window else None
        title = "llmp analyze" + (f": {_when(start)}" if window else "")
    rows = _rows(report)
    p = _Page()
    p.add(
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">\n",
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        '<meta name="color-scheme" content="light">\n',
        '<meta name="generator" content="llmp analyze --html">\n',
        f"<title>{_e(title)}</title>\n<style>\n{_css()}\n{_cause_css()}</style>\n</head>\n<body>\n",
        "<main>\n",
    )
    _header(p, report, rows, title)
    _loss_by_cause(p, report)
    _findings(p, report)
    _timeline(p, report, rows, changes)
    _clients(p, report)
    _changes(p, rows, changes)
    p.add(
        "<footer>Made by <code>llmp analyze --html</code> from the report v1. The page holds "
        "no message text: only roles, sizes, hashes, tool, client and model names.</footer>\n",
        "</main>\n</body>\n</html>\n",
    )
    return p.text()


def write_html(
    report: dict[str, Any],
    out: Path,
    *,
    changes: list[dict[str, Any]] | None = None,
    title: str | None = None,
) -> None:
    """Write the page for `report` (the report v1 as `llmp analyze --json`
    prints it, parsed) to `out`; `changes` (`Analysis.change_list()` of an
    `analyze(..., changes=N)`) adds the "what changed" diffs."""
    Path(out).write_text(render_html(report, changes, title=title), encoding="utf-8")
