"""The finished analysis, apart from `analyze` which makes it.

`Analysis` lives here rather than in the package's `__init__` so that
`parallel`, which builds one, need not import the package that imports it:
no import cycle, even inside a function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, Any

from llmp.analysis.changes import Changes
from llmp.analysis.engine import Engine
from llmp.analysis.reader import ReadStats

__all__ = ["PLAIN_ENV", "Analysis", "fast_default"]


PLAIN_ENV = "LLMP_ANALYZE_PLAIN"
"""Set to 1 to read every line the plain way (orjson, dicts): the reference the fast
path is tested against (docs/analysis.md §12)."""


def fast_default() -> bool:
    """Whether digest lines are read the fast way: unless `LLMP_ANALYZE_PLAIN=1`."""
    return os.environ.get(PLAIN_ENV, "") in ("", "0")


@dataclass
class Analysis:
    """A finished analysis: the engine's totals and the reader's counts."""

    engine: Engine
    stats: ReadStats
    changes: Changes | None = None
    """The "what changed" diffs, when `analyze` was asked for them."""
    paths: list[str] = field(default_factory=list)
    """The recordings as given: `Row.recording` indexes them."""

    def rows(self) -> list[dict[str, Any]]:
        """The rows as report dicts, from the kept rows (`analyze(..., keep=True)`)."""
        assert self.engine.kept is not None
        label = self.engine.clients.label
        return [row.as_json(label(row.client)) for row in self.engine.kept]

    def change_list(self) -> list[dict[str, Any]]:
        """The collected diffs, with the final client labels."""
        assert self.changes is not None
        return self.changes.result(self.engine.clients.label)

    def header(self) -> dict[str, Any]:
        """The report v1 without `rows`."""
        return self.engine.header(self.stats)

    def report(self) -> dict[str, Any]:
        """The whole report v1 as a dict (small recordings and tests)."""
        import orjson

        out = self.header()
        out["rows"] = [orjson.loads(line) for line in self.engine.row_lines()]
        return out

    def write_json(self, out: IO[bytes]) -> None:
        self.engine.write_json(out, self.stats)

    def close(self) -> None:
        self.engine.close()
