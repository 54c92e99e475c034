"""The page being written, and its stylesheet."""

from __future__ import annotations

from importlib import resources

from llmp.analysis.causes import CAUSES as CAUSE_TABLE
from llmp.analysis.html.common import (
    _UNKNOWN_CAUSE,
    _UNKNOWN_COLOUR,
    CAUSES,
)


def _css() -> str:
    """The page's stylesheet, a package data file (`report.css`)."""
    return resources.files("llmp.analysis.html").joinpath("report.css").read_text(encoding="utf-8")


def _cause_css() -> str:
    lines = []
    for cause, colour in [*CAUSES.items(), (_UNKNOWN_CAUSE, _UNKNOWN_COLOUR)]:
        lines.append(f"svg .f-{cause} {{ fill: {colour}; }}")
        lines.append(f".b-{cause} {{ background: {colour}; }}")
        lines.append(f".tri.t-{cause} {{ border-top-color: {colour}; }}")
    # Chip text: white on the dark colours (`Cause.light_text`), near-black on the others
    # (each pair has a WCAG contrast of at least 4.5).
    light = ", ".join(f".chip.b-{c.name}" for c in CAUSE_TABLE if c.light_text)
    lines.append(f"{light} {{ color: #fff; }}")
    return "\n".join(lines)


class _Page:
    """Accumulates the page's HTML."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, *parts: str) -> None:
        self.parts.extend(parts)

    def text(self) -> str:
        return "".join(self.parts)
