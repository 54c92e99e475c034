"""Thresholds of the analysis: named defaults, each a command-line option.

One table drives the dataclass defaults, the CLI options and their help, so
the three cannot drift apart.  `docs/analysis.md` explains each value.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmp.analysis.cost import Prices


@dataclass(frozen=True, slots=True)
class Config:
    """Every threshold the verdicts depend on."""

    reuse_tolerance_tokens: int = 32
    estimate_margin: float = 0.10
    empty_reuse_tokens: int = 32
    head_share: float = 0.5
    compaction_ratio: float = 0.5
    link_overlap: float = 0.5
    side_call_max_tokens: int = 256
    summarise_min_tokens: int = 2048
    probe_max_tokens: int = 1
    ollama_evaluated_share: float = 0.4
    min_lost_tokens: int = 256
    volatile_head_chars: int = 512
    side_call_lookahead: int = 32
    unused_tool_min_offered: int = 20
    large_tool_tokens: int = 1000
    large_system_tokens: int = 4096
    max_conversations: int = 512
    overflow_share: float = 0.6
    overflow_share_tokenizer: float = 0.9
    overflow_min_tokens: int = 128
    # Not options: memory bounds of the engine.
    between_window: int = 65_536
    summary_wrap_chars: int = 2000
    summary_min_chars: int = 500
    # `--prices FILE` (its own option, read by the command): None is genai-prices' list.
    prices: Prices | None = None

    def pricing(self) -> Prices:
        """The prices rows on a provider are priced at (R36)."""
        from llmp.analysis.cost import default_prices  # here: the live view imports Config

        return self.prices or default_prices()


# (field, option, help)
OPTIONS: list[tuple[str, str, str]] = [
    (
        "reuse_tolerance_tokens",
        "--reuse-tolerance",
        "a reuse deficit at or below this many tokens is not a loss",
    ),
    (
        "estimate_margin",
        "--estimate-margin",
        "extra tolerance, as a share of the prefix, when it was scaled from estimates",
    ),
    (
        "empty_reuse_tokens",
        "--empty-reuse",
        "reuse at or below this many tokens counts as an empty cache",
    ),
    (
        "head_share",
        "--head-share",
        "reuse below this share of the prefix counts as head-only",
    ),
    (
        "compaction_ratio",
        "--compaction-ratio",
        "history shrunk to this share or less is a compaction",
    ),
    (
        "link_overlap",
        "--link-overlap",
        "share of a turn's history that must reappear to link past a broken start",
    ),
    (
        "side_call_max_tokens",
        "--side-call-max-tokens",
        "a max_tokens this small marks a side-call",
    ),
    (
        "summarise_min_tokens",
        "--summarise-tokens",
        "a one-off prompt this large is a summarise side-call",
    ),
    (
        "probe_max_tokens",
        "--probe-max-tokens",
        "a one-off request with max_tokens this small is a stateless probe",
    ),
    (
        "ollama_evaluated_share",
        "--ollama-evaluated-share",
        "below this share of the estimate, Ollama's prompt_eval_count is the evaluated part",
    ),
    (
        "min_lost_tokens",
        "--min-lost-tokens",
        "loss findings smaller than this are minor: kept, summed, never failing --fail-on",
    ),
    (
        "volatile_head_chars",
        "--volatile-head-chars",
        "a changed leading system block (or edit) this short makes a volatile head",
    ),
    (
        "side_call_lookahead",
        "--side-call-lookahead",
        "records to wait for a client's next request before a first one-off turn is final "
        "(a side-call that comes first); 0: never wait",
    ),
    (
        "unused_tool_min_offered",
        "--unused-tool-offered",
        "offers without a call before a tool is reported unused",
    ),
    (
        "large_tool_tokens",
        "--large-tool-tokens",
        "a tool schema this large is reported",
    ),
    (
        "large_system_tokens",
        "--large-system-tokens",
        "a system prompt this large is reported",
    ),
    (
        "max_conversations",
        "--max-conversations",
        "conversations kept per session for linking",
    ),
    (
        "overflow_share",
        "--overflow-share",
        "a server prompt count below this share of the estimated prompt is a context overflow",
    ),
    (
        "overflow_share_tokenizer",
        "--overflow-share-tokenizer",
        "the same share when the prompt was counted by the tokenizer (--tokenize)",
    ),
    (
        "overflow_min_tokens",
        "--overflow-min-tokens",
        "a context overflow must drop at least this many tokens",
    ),
]


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add one option per threshold, defaulting to the dataclass value."""
    group = parser.add_argument_group("thresholds (see docs/analysis.md)")
    defaults = Config()
    types = {f.name: f.type for f in fields(Config)}
    for name, option, text in OPTIONS:
        value = getattr(defaults, name)
        kind: Any = float if types[name] in (float, "float") else int
        group.add_argument(
            option,
            dest=f"cfg_{name}",
            type=kind,
            default=value,
            metavar="N",
            help=f"{text} (default {value})",
        )


def from_args(args: argparse.Namespace) -> Config:
    """The Config the parsed options describe."""
    values = {
        name: getattr(args, f"cfg_{name}") for name, _, _ in OPTIONS if hasattr(args, f"cfg_{name}")
    }
    return Config(**values)
