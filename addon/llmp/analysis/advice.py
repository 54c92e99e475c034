"""What to do about a finding, for the harness that caused it.

A finding says what happened; its `evidence.advice` (additive) says what a
user of that harness can do today.  The harness is recognised from what the
recording holds: the user-agent, sizes and positions of the change, which
requests ran in between, and, in full mode only, the text around the
change.  Each advice says how sure it is (docs/analysis.md §10).
"""

from __future__ import annotations

import re
from typing import Any

from llmp.analysis.loss import FIRST_256, LAST_256
from llmp.apis.servers import SGLANG, VLLM, VLLM_CPU, VLLM_OR_SGLANG

HIGH, MEDIUM, LOW = "high", "medium", "low"

CLAUDE_CODE = "Claude Code"
AIDER = "aider"

_CLAUDE_UA = re.compile(r"^claude-cli/", re.I)
_CODEX_UA = re.compile(r"^codex", re.I)
_QWEN_UA = re.compile(r"qwen", re.I)
_OPENCODE_UA = re.compile(r"opencode", re.I)
# A clock or a date: 2026-08-21, 10:00, "Today is", weekday names.
_CLOCKISH = re.compile(
    r"\d{4}-\d\d-\d\d|\d{1,2}:\d\d|\btoday\b|\bdate\b|\b(mon|tues|wednes|thurs|fri|satur|sun)day\b",
    re.I,
)
SMALL_EDIT_CHARS = 200
"""A change of at most this many characters in a long system message is an edit."""


def _advice(harness: str | None, text: str, confidence: str, why: str) -> dict[str, Any]:
    return {"harness": harness, "text": text, "confidence": confidence, "because": why}


def harness_of(label: str | None) -> str | None:
    """The harness a client label names, as far as its user-agent tells."""
    if not label:
        return None
    if _CLAUDE_UA.search(label):
        return CLAUDE_CODE
    if _CODEX_UA.search(label):
        return "Codex"
    if _QWEN_UA.search(label):
        return "Qwen Code"
    if _OPENCODE_UA.search(label):
        return "opencode"
    if label.lower().startswith("aider"):
        return AIDER
    return None


def attribution_header(where: dict[str, Any] | None, label: str | None) -> dict[str, Any] | None:
    """Claude Code's first system block, `x-anthropic-billing-header: cc_version=…`."""
    if where is None or where.get("index") != 0 or where.get("role") != "system":
        return None
    context = where.get("context") or ""
    short = max(where.get("chars_before") or 0, where.get("chars_after") or 0) <= 200
    text = (
        "Turn off Claude Code's attribution line, which changes at the very top of its "
        'system prompt: add "CLAUDE_CODE_ATTRIBUTION_HEADER": "0" to the "env" block of '
        "~/.claude/settings.json (or export CLAUDE_CODE_ATTRIBUTION_HEADER=0)."
    )
    if "billing-header" in context or "cc_version" in context:
        return _advice(CLAUDE_CODE, text, HIGH, "the changed text is the attribution line")
    if harness_of(label) == CLAUDE_CODE and short:
        return _advice(
            CLAUDE_CODE, text, HIGH, "Claude Code's first system block, a short one, changed"
        )
    return None


def volatile_block(where: dict[str, Any] | None, label: str | None) -> dict[str, Any] | None:
    """A date, a clock or an environment block inside a long system prompt."""
    if where is None or where.get("role") not in ("system", "developer"):
        return None
    before, after = where.get("chars_before") or 0, where.get("chars_after") or 0
    context = " ".join(filter(None, (where.get("context"), where.get("was"))))
    within = where.get("within")
    place = {
        FIRST_256: "near its start",
        LAST_256: "near its end",
    }.get(str(within), "in its middle")
    if within == LAST_256:
        # Already after the stable instructions: saying "move it after them" would send
        # the user to where the text already is.
        text = (
            f"The system prompt changes {place} from one request to the next (a date, a clock "
            "or an environment block). It already comes after the stable instructions, so a "
            "server that can roll its cache back keeps them; the history after it is still "
            "read again every time: move that part into the latest user message, so that "
            "everything before it stays reusable."
        )
    else:
        text = (
            f"The system prompt changes {place} from one request to the next (a date, a clock "
            "or an environment block): move that part after the stable instructions, or into "
            "the latest user message, so that everything before it stays reusable."
        )
    who = harness_of(label)
    if abs(after - before) > SMALL_EDIT_CHARS or max(before, after) <= 2 * SMALL_EDIT_CHARS:
        return None  # a rewrite, or a short message: no volatile block in a stable prompt
    if context and _CLOCKISH.search(context):
        return _advice(who, text, HIGH, "the changed text looks like a date or a time")
    return _advice(who, text, MEDIUM, "a few characters of a long system prompt changed")


_VLLM_CONTEXT = "vLLM: --max-model-len, which its KV cache must hold"
_SHARED_CONTEXT = {
    VLLM.name: _VLLM_CONTEXT,
    VLLM_CPU.name: _VLLM_CONTEXT,
    SGLANG.name: "SGLang: --context-length",
    VLLM_OR_SGLANG.name: "vLLM: --max-model-len; SGLang: --context-length",
}


def shared_context_setting(server: str | None) -> str | None:
    """Where vLLM or SGLang (by `Server.name`) sets its context; None for another server,
    whose advice names llama-server's -c."""
    return _SHARED_CONTEXT.get(server or "")


def cut_after_context_error(
    shrank: bool, label: str | None, server: str | None = None
) -> dict[str, Any]:
    """A harness that cut its prompt and tools after the server refused a long prompt."""
    who = harness_of(label)
    setting = shared_context_setting(server)
    if setting is None:
        setting = (
            "llama-server -c, or --override-kv llama.context_length=int:N for a model trained short"
        )
    text = (
        "The harness cut its system prompt or tools after the server refused a prompt for its "
        f"context size, and the cut re-processed the whole prompt: raise the server's context "
        f"({setting}), or set the harness's own context limit below the server's so it never "
        "hits it."
    )
    return _advice(
        who,
        text,
        HIGH if shrank else MEDIUM,
        "a context error came just before the change"
        + (" and the prompt shrank" if shrank else ""),
    )


def weak_model_side_calls(requested: set[str], conversation_models: set[str]) -> dict[str, Any]:
    """aider's weak model (commit messages, summaries) on the conversation's one slot."""
    others = sorted(requested - conversation_models)
    confident = bool(others)
    text = (
        "The side-calls ask for another model name"
        + (f" ({', '.join(others)})" if others else "")
        + " but the same server answers them in the same slot: give that model its own slot "
        "(llama-server -np 2 with -c doubled) or its own server (aider: --weak-model pointing "
        "at another server, or --weak-model set to the main model with a second slot)."
    )
    return _advice(
        AIDER if confident else None,
        text,
        HIGH if confident else MEDIUM,
        "side-calls named another model and were served by the conversation's model",
    )
