"""Scenario traffic by name, and one report's bytes.

What the fast-path, C-writer and `--jobs` tests compare, so they share it.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmp.analysis import analyze
from tests.support import overflow_scenarios as osc
from tests.support import scenarios as sc

TRAFFIC: dict[str, Callable[[], sc.Traffic]] = {
    **sc.SCENARIOS,
    "outage_retries": sc.outage_retries,
    "claude_code_session": sc.claude_code_session,
    "claude_code_system_edit": sc.claude_code_system_edit,
    "codex_session": sc.codex_session,
    "codex_plain": lambda: sc.codex_session(stream=False),
    "codex_stateful": sc.codex_stateful,
    "both_agents": sc.both_agents,
    "ollama_truncating": osc.ollama_truncating,
    "llama_refusing": lambda: osc.llama_refusing()[0],
}


def report_bytes(paths: list[Path], **kw: Any) -> bytes:
    """`llmp analyze --json` of the paths, as bytes (`kw`: `analyze`'s options)."""
    result = analyze([str(p) for p in paths], progress=False, **kw)
    try:
        out = io.BytesIO()
        result.write_json(out)
        return out.getvalue()
    finally:
        result.close()
