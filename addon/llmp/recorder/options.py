"""The recorder's options: one table for the mitmdump addon and `llmp proxy`.

Validation lives here, in plain Python, so both front ends reject the same
values with the same one-line reason.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from typing import Any

from llmp.format.schema import BODY_MODES, DIGEST
from llmp.live.contract import WARN_MS, WARN_TOKENS

MIB = 1024 * 1024
LIMIT = 32 * MIB
"""The default recording limit per body (R12)."""
ROTATIONS = ("", "daily")
CONNECT_TIMEOUT = "10"
"""The default connect timeout, in seconds (R13): a string, as mitmproxy options have no float."""


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
    OptionSpec("llmp_body", str, DIGEST, "Body mode: 'digest' (hashes and counts) or 'full'."),
    OptionSpec(
        "llmp_rotate",
        str,
        "",
        "'daily': a new recording file each local day (its date in the name); empty: one file.",
    ),
    OptionSpec("llmp_limit", int, LIMIT, "Recording limit per body, in bytes."),
    OptionSpec(
        "llmp_tokenize",
        bool,
        True,
        "Count each new chat message once with the upstream's /tokenize (llama-server), off "
        "the client's path, into the record's `tokens`; false: never ask.",
    ),
    OptionSpec(
        "llmp_diagnose",
        bool,
        False,
        "Ask a cloud provider for its own cache diagnosis (R37): add Anthropic's "
        "`diagnostics` (and its beta value), or OpenAI's "
        "`prompt_cache_options.comparison_response_id`, naming the conversation's previous "
        "response. Off: every byte goes upstream as the client sent it.",
    ),
    OptionSpec(
        "llmp_refuse_websockets",
        bool,
        False,
        "Answer a WebSocket upgrade to a chat API's path with 426 Upgrade Required, so a "
        "client that can (Codex) sends its turns over HTTP, which the recorder reads.",
    ),
    OptionSpec(
        "llmp_connect_timeout",
        str,  # mitmproxy options have no float type; parsed by validate()
        CONNECT_TIMEOUT,
        "Seconds to wait for the upstream connection before recording a timeout.",
    ),
    OptionSpec(
        "llmp_live",
        bool,
        True,
        "Live view: a log line per chat request, a warning when a turn loses its cache, "
        "and GET /_llmp/summary.",
    ),
    OptionSpec(
        "llmp_live_warn_ms",
        int,
        WARN_MS,
        "Warn when a turn re-processed more than this many ms of prefill it could have reused.",
    ),
    OptionSpec(
        "llmp_live_warn_tokens",
        int,
        WARN_TOKENS,
        "Warn when a turn re-processed more than this many tokens it could have reused.",
    ),
    OptionSpec(
        "llmp_live_log",
        str,
        "",
        "Write the live view's per-request lines to this file instead of the terminal.",
    ),
    OptionSpec(
        "llmp_events",
        str,
        "",
        "Append the live event stream (LLMP_TURN / LLMP_SUMMARY lines) to this file.",
    ),
    OptionSpec(
        "llmp_events_csv",
        str,
        "",
        "Append one CSV row per analysed chat request (with a header row) to this file.",
    ),
)


class OptionError(ValueError):
    """A bad option value; the message is the one-line reason shown to the user."""


DEFAULTS: dict[str, Any] = {spec.name: spec.default for spec in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """Validated recorder settings (`validate` makes them; the defaults are in `OPTIONS`)."""

    file: str
    body: str
    rotate: str
    limit: int
    tokenize: bool
    diagnose: bool
    refuse_websockets: bool
    connect_timeout: float
    live: bool
    live_warn_ms: int
    live_warn_tokens: int
    live_log: str
    events: str
    events_csv: str


def validate(values: dict[str, Any]) -> Settings:
    """Check every option and return the settings, or raise `OptionError`.

    A missing value takes its default from `OPTIONS`.
    """
    values = {**DEFAULTS, **values}
    body = str(values["llmp_body"]).strip().lower()
    if body not in BODY_MODES:
        raise OptionError(f"llmp_body must be 'digest' or 'full', not {values.get('llmp_body')!r}")
    rotate = str(values["llmp_rotate"] or "").strip().lower()
    if rotate not in ROTATIONS:
        raise OptionError(f"llmp_rotate must be 'daily' or empty, not {values['llmp_rotate']!r}")
    limit = values["llmp_limit"]
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise OptionError(f"llmp_limit must be a positive number of bytes, not {limit!r}")
    raw_timeout = values["llmp_connect_timeout"]
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
    tokenize = values["llmp_tokenize"]
    if not isinstance(tokenize, bool):
        raise OptionError(f"llmp_tokenize must be true or false, not {tokenize!r}")
    flags: dict[str, bool] = {}
    for name in ("llmp_diagnose", "llmp_refuse_websockets"):
        value = values[name]
        if not isinstance(value, bool):
            raise OptionError(f"{name} must be true or false, not {value!r}")
        flags[name] = value
    live = values["llmp_live"]
    if not isinstance(live, bool):
        raise OptionError(f"llmp_live must be true or false, not {live!r}")
    warn: dict[str, int] = {}
    for name in ("llmp_live_warn_ms", "llmp_live_warn_tokens"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OptionError(f"{name} must be a whole number, 0 or more, not {value!r}")
        warn[name] = value
    events = str(values.get("llmp_events") or "").strip()
    events_csv = str(values.get("llmp_events_csv") or "").strip()
    live_log = str(values.get("llmp_live_log") or "").strip()
    if (events or events_csv or live_log) and not live:
        raise OptionError(
            "llmp_events, llmp_events_csv and llmp_live_log need the live view, "
            "which llmp_live turns off"
        )
    _distinct(
        {
            "llmp_file": path,
            "llmp_events": events,
            "llmp_events_csv": events_csv,
            "llmp_live_log": live_log,
        }
    )
    return Settings(
        file=path,
        body=body,
        rotate=rotate,
        limit=int(limit),
        tokenize=tokenize,
        diagnose=flags["llmp_diagnose"],
        refuse_websockets=flags["llmp_refuse_websockets"],
        connect_timeout=float(timeout),
        live=live,
        live_warn_ms=warn["llmp_live_warn_ms"],
        live_warn_tokens=warn["llmp_live_warn_tokens"],
        live_log=live_log,
        events=events,
        events_csv=events_csv,
    )


def as_values(settings: Settings) -> dict[str, Any]:
    """The option values that give these settings (each option `llmp_X` is field `X`)."""
    return {spec.name: getattr(settings, spec.name.removeprefix("llmp_")) for spec in OPTIONS}


def _distinct(paths: dict[str, str]) -> None:
    """The recording, the event files and the live log must be different files."""
    seen: dict[str, str] = {}
    for name, path in paths.items():
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise OptionError(f"{name} and {seen[real]} name the same file {path!r}")
        seen[real] = name
