"""The recorder's options: one table for the mitmdump addon and `llmp proxy`.

Validation lives here, in plain Python, so both front ends reject the same
values with the same one-line reason.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024
BODY_MODES = ("digest", "full")


@dataclass(frozen=True)
class OptionSpec:
    """One option: its mitmproxy name, type, default and help text."""

    name: str
    type: type
    default: Any
    help: str


def default_file(today: _dt.date | None = None) -> str:
    """`llmp-<date>.jsonl` in the current directory."""
    day = today or _dt.date.today()
    return f"llmp-{day.isoformat()}.jsonl"


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "llmp_file",
        str,
        "",
        "Path of the llmp recording, appended to. Empty means llmp-<date>.jsonl.",
    ),
    OptionSpec("llmp_body", str, "digest", "Body mode: 'digest' (hashes and counts) or 'full'."),
    OptionSpec("llmp_limit", int, 32 * MIB, "Recording limit per body, in bytes."),
    OptionSpec(
        "llmp_connect_timeout",
        str,  # mitmproxy options have no float type; parsed by validate()
        "10",
        "Seconds to wait for the upstream connection before recording a timeout.",
    ),
)


class OptionError(ValueError):
    """A bad option value; the message is the one-line reason shown to the user."""


@dataclass(frozen=True)
class Settings:
    """Validated recorder settings."""

    file: str
    body: str
    limit: int
    connect_timeout: float


def validate(values: dict[str, Any]) -> Settings:
    """Check every option and return the settings, or raise `OptionError`."""
    body = str(values.get("llmp_body", "digest")).strip().lower()
    if body not in BODY_MODES:
        raise OptionError(f"llmp_body must be 'digest' or 'full', not {values.get('llmp_body')!r}")
    limit = values.get("llmp_limit", 32 * MIB)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise OptionError(f"llmp_limit must be a positive number of bytes, not {limit!r}")
    raw_timeout = values.get("llmp_connect_timeout", "10")
    try:
        timeout = float(raw_timeout)
    except (TypeError, ValueError):
        timeout = float("nan")
    if isinstance(raw_timeout, bool) or not timeout > 0:
        raise OptionError(
            f"llmp_connect_timeout must be a positive number of seconds, not {raw_timeout!r}"
        )
    if timeout > 3600:
        raise OptionError(f"llmp_connect_timeout must be at most 3600 seconds, not {timeout!r}")
    path = str(values.get("llmp_file") or "").strip() or default_file()
    return Settings(file=path, body=body, limit=int(limit), connect_timeout=float(timeout))
