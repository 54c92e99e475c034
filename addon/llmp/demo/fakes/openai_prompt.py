"""How the fake OpenAI API sees a request: its prompt, the settings that change the
prefix, the cache policy of its model's generation, and the diagnosis against an
earlier response.  Pure functions; the rules are documented in ``openai_api``.

The rendering is the fakes' own template, deterministic and prefix-stable, one
``Segment`` per unit a client can mark (a content part) or that the API keeps whole
(the tools, an instruction, a function call):

- ``<|tools|>`` + the tools' canonical JSON, when there are tools;
- Responses: ``<|instructions|>…<|end|>`` (a string) or the instruction items; the
  stored conversation of ``previous_response_id``; then each ``input`` item;
- a message: ``<|role|>`` + its parts' text (a non-text part: its canonical JSON,
  without ``prompt_cache_breakpoint``) + ``<|end|>\\n``, one segment per part (the first
  holds the role tag, the last the end tag);
- ``<|function_call|>{call_id,name,arguments}``, ``<|function_call_output|>call_id:output``,
  ``<|compaction|>encrypted_content``, any other item ``<|type|>`` + its canonical JSON
  without ``id`` and ``status`` (R30: an item's id is not its identity);
- Chat: a message's ``tool_calls`` as ``<|tool_calls|>`` + their canonical JSON; a tool
  message is ``<|tool:call_id|>…``.

Each segment is ``ceil(chars / 4)`` tokens (``model.count_tokens``).  The model, the
service tier, ``parallel_tool_calls``, the text format, the reasoning effort and the
verbosity are not tokens: they are the entry's namespace, so changing one misses from
the first token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmp.apis.providers import OPENAI, facts, openai_cache
from llmp.demo.fakes.model import common_prefix
from llmp.demo.fakes.provider_cache import Policy, Prompt, Segment

Marker = Callable[[dict[str, Any]], str | None]
"""Reads a content part's breakpoint: its ttl name, or None. Raises ``BadRequest``."""

_TEXT_PARTS = ("input_text", "output_text", "text")
_NOT_IDENTITY = ("id", "status", "prompt_cache_breakpoint", "cache_control")
DEFAULT_EFFORT = "medium"
DEFAULT_VERBOSITY = "medium"
DEFAULT_FORMAT: dict[str, Any] = {"type": "text"}


class BadRequest(Exception):
    """A request the API refuses with 400: ``message`` and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def canon(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces, raw UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _without(d: dict[str, Any], drop: tuple[str, ...] = _NOT_IDENTITY) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in drop}


# ------------------------------------------------------------------- the prompt


def part_text(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    return canon(_without(part))


def message_segments(
    role: str, content: Any, marker: Marker, kind: str = "message"
) -> list[Segment]:
    """A message: one segment per content part, the role tag in the first, the end in the last."""
    head, tail = f"<|{role}|>", "<|end|>\n"
    if not isinstance(content, list):
        text = content if isinstance(content, str) else ""
        return [Segment(head + text + tail, kind)]
    parts = [p for p in content if isinstance(p, dict)]
    if not parts:
        return [Segment(head + tail, kind)]
    last = len(parts) - 1
    return [
        Segment(
            (head if i == 0 else "") + part_text(p) + (tail if i == last else ""),
            kind,
            marker(p),
        )
        for i, p in enumerate(parts)
    ]


def tools_segments(tools: Any) -> list[Segment]:
    if isinstance(tools, list) and tools:
        return [Segment("<|tools|>" + canon(tools) + "\n", "tools")]
    return []


def item_segments(item: Any, marker: Marker) -> list[Segment]:
    """A Responses input item."""
    if not isinstance(item, dict):
        return []
    kind = item.get("type")
    if "role" in item and kind in (None, "message"):
        return message_segments(str(item["role"]), item.get("content"), marker)
    if kind == "function_call":
        call = {k: item[k] for k in ("call_id", "name", "arguments", "namespace") if k in item}
        return [Segment("<|function_call|>" + canon(call) + "\n", "function_call")]
    if kind == "function_call_output":
        out = item.get("output")
        if isinstance(out, list):
            text = "".join(part_text(p) for p in out if isinstance(p, dict))
        else:
            text = out if isinstance(out, str) else canon(out)
        call_id = item.get("call_id")
        return [Segment(f"<|function_call_output|>{call_id}:{text}\n", "function_call_output")]
    if kind == "compaction":
        return [Segment(f"<|compaction|>{item.get('encrypted_content') or ''}\n", "compaction")]
    return [Segment(f"<|{kind}|>" + canon(_without(item)) + "\n", str(kind))]


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input``: a string is one user message; a list is its items."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return [i for i in value if isinstance(i, dict)] if isinstance(value, list) else []


def responses_prompt(body: dict[str, Any], history: list[dict[str, Any]], marker: Marker) -> Prompt:
    """A Responses request's prompt: tools, instructions, the stored conversation, ``input``."""
    segs = tools_segments(body.get("tools"))
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        segs.append(Segment("<|instructions|>" + instructions + "<|end|>\n", "instructions"))
    elif isinstance(instructions, list):
        for item in instructions:
            segs += item_segments(item, marker)
    for item in [*history, *input_items(body.get("input"))]:
        segs += item_segments(item, marker)
    return Prompt(segs)


def chat_prompt(body: dict[str, Any], marker: Marker) -> Prompt:
    """A Chat Completions request's prompt: tools, then each message."""
    segs = tools_segments(body.get("tools"))
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role"))
        if role == "tool":
            role = f"tool:{m.get('tool_call_id')}"
        segs += message_segments(role, m.get("content"), marker)
        if m.get("tool_calls"):
            segs.append(Segment("<|tool_calls|>" + canon(m["tool_calls"]) + "\n", "tool_calls"))
    return Prompt(segs)


# ----------------------------------------------------------------- the settings


@dataclass(frozen=True, slots=True)
class Settings:
    """What, besides the prompt's text, decides which entries a request may read."""

    model: str
    key: str | None
    service_tier: str
    tools: str
    text_format: str
    reasoning_effort: str
    verbosity: str

    @property
    def namespace(self) -> str:
        """Everything but the cache key (the key is kept beside it)."""
        return canon(
            {
                "model": self.model,
                "service_tier": self.service_tier,
                "tools": self.tools,
                "text_format": self.text_format,
                "reasoning_effort": self.reasoning_effort,
                "verbosity": self.verbosity,
            }
        )


def service_tier(requested: Any) -> str:
    """The tier a request runs at: ``auto`` and unset are ``default``; ``fast`` is
    ``priority`` (the SDK: "The response will show service_tier=priority")."""
    if requested in (None, "auto"):
        return "default"
    if requested == "fast":
        return "priority"
    return str(requested)


def _tools_setting(tools: Any, parallel: Any) -> str:
    return canon({"tools": tools or [], "parallel_tool_calls": parallel is not False})


def responses_settings(body: dict[str, Any]) -> Settings:
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    assert isinstance(text, dict) and isinstance(reasoning, dict)
    return Settings(
        model=str(body.get("model")),
        key=_key(body.get("prompt_cache_key")),
        service_tier=service_tier(body.get("service_tier")),
        tools=_tools_setting(body.get("tools"), body.get("parallel_tool_calls")),
        text_format=canon(text.get("format") or DEFAULT_FORMAT),
        reasoning_effort=str(reasoning.get("effort") or DEFAULT_EFFORT),
        verbosity=str(text.get("verbosity") or DEFAULT_VERBOSITY),
    )


def chat_settings(body: dict[str, Any]) -> Settings:
    return Settings(
        model=str(body.get("model")),
        key=_key(body.get("prompt_cache_key")),
        service_tier=service_tier(body.get("service_tier")),
        tools=_tools_setting(body.get("tools"), body.get("parallel_tool_calls")),
        text_format=canon(body.get("response_format") or DEFAULT_FORMAT),
        reasoning_effort=str(body.get("reasoning_effort") or DEFAULT_EFFORT),
        verbosity=str(body.get("verbosity") or DEFAULT_VERBOSITY),
    )


def _key(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# ------------------------------------------------------------------- the policy


def explicit_ttls() -> dict[str, int]:
    table: dict[str, int] = facts()[OPENAI]["explicit"]["ttl_seconds"]
    return table


def breakpoint_marker(request_ttl: str) -> Marker:
    """Reads ``prompt_cache_breakpoint: {"mode": "explicit", "ttl"?}`` on a content part."""
    ttls = explicit_ttls()

    def marker(part: dict[str, Any]) -> str | None:
        bp = part.get("prompt_cache_breakpoint")
        if bp is None:
            return None
        if not isinstance(bp, dict) or bp.get("mode") != "explicit":
            raise BadRequest(
                "Invalid value for 'prompt_cache_breakpoint.mode': expected 'explicit'.",
                "prompt_cache_breakpoint.mode",
            )
        ttl = bp.get("ttl", request_ttl)
        if ttl not in ttls:
            raise BadRequest(
                f"Invalid value for 'prompt_cache_breakpoint.ttl': {ttl!r}. "
                f"Supported values are: {', '.join(map(repr, ttls))}.",
                "prompt_cache_breakpoint.ttl",
            )
        return str(ttl)

    return marker


def no_marker(part: dict[str, Any]) -> str | None:
    """Before GPT-5.6 a breakpoint is only more JSON the API ignores."""
    return None


@dataclass(frozen=True, slots=True)
class CachePlan:
    """The policy for one request, how to read its breakpoints, and what to echo."""

    policy: Policy
    marker: Marker
    retention: str
    options: dict[str, Any] | None
    """The ``prompt_cache_options`` applied (GPT-5.6 and later), as echoed."""


def cache_plan(model: str, body: dict[str, Any], default_retention: str) -> CachePlan:
    """The cache rules of the request's model, with the request's own options."""
    o = facts()[OPENAI]
    retention = body.get("prompt_cache_retention") or default_retention
    retentions: dict[str, int] = o["retention_seconds"]
    if retention not in retentions:
        raise BadRequest(
            f"Invalid value for 'prompt_cache_retention': {retention!r}. "
            f"Supported values are: {', '.join(map(repr, retentions))}.",
            "prompt_cache_retention",
        )
    c = openai_cache(model)
    if not c.explicit:
        policy = Policy(True, c.minimum_tokens, c.granule_tokens, str(retention), retentions)
        return CachePlan(policy, no_marker, str(retention), None)
    e = o["explicit"]
    raw = body.get("prompt_cache_options")
    opts: dict[str, Any] = raw if isinstance(raw, dict) else {}
    mode = opts.get("mode", "implicit")
    if mode not in ("implicit", "explicit"):
        raise BadRequest(
            f"Invalid value for 'prompt_cache_options.mode': {mode!r}. "
            "Supported values are: 'implicit' and 'explicit'.",
            "prompt_cache_options.mode",
        )
    ttl = opts.get("ttl", e["default_ttl"])
    ttls = explicit_ttls()
    if ttl not in ttls:
        raise BadRequest(
            f"Invalid value for 'prompt_cache_options.ttl': {ttl!r}. "
            f"Supported values are: {', '.join(map(repr, ttls))}.",
            "prompt_cache_options.ttl",
        )
    implicit = mode == "implicit"
    max_bp = int(e["max_breakpoints"])
    policy = Policy(
        False,
        c.minimum_tokens,
        c.granule_tokens,
        str(ttl),
        ttls,
        end_write=implicit,
        max_marked=max_bp - 1 if implicit else max_bp,
    )
    echo = {"mode": mode, "ttl": ttl, "comparison_response_id": opts.get("comparison_response_id")}
    return CachePlan(policy, breakpoint_marker(str(ttl)), str(retention), echo)


# ---------------------------------------------------------------- the diagnosis

#: The settings a diagnosis compares, in the order it names them.
_SETTING_REASONS = (
    ("model", "model_changed"),
    ("key", "prompt_cache_key_changed"),
    ("service_tier", "service_tier_changed"),
    ("tools", "tools_changed"),
    ("text_format", "text_format_changed"),
    ("reasoning_effort", "reasoning_effort_changed"),
    ("verbosity", "verbosity_changed"),
)


@dataclass(frozen=True, slots=True)
class Record:
    """A response's request, kept by its id for later diagnoses."""

    settings: Settings
    prompt: Prompt
    reusable: int
    """The prefix it left for a later request (what it read, wrote or kept alive)."""


def diagnose(new: Record, old: Record | None, unavailable: bool) -> dict[str, Any]:
    """``prompt_cache_diagnostics`` for ``new`` against the comparison response ``old``.

    A request comparison, never a cache lookup: the same prefix gives ``cache_hit`` even
    when the entry has expired since."""
    if old is None:
        return {"type": "comparison_response_not_found"}
    if unavailable:
        return {"type": "unavailable"}
    for name, reason in _SETTING_REASONS:
        if getattr(new.settings, name) != getattr(old.settings, name):
            return _miss(reason, new.prompt.tokens, old.reusable)
    if old.reusable == 0:
        return {"type": "unavailable"}
    shared = common_prefix(new.prompt.text, old.prompt.text)
    if old.prompt.tokens_at(shared) >= old.reusable:
        return {"type": "cache_hit"}
    first = new.prompt.segment_index(shared)
    compacted = any(s.kind == "compaction" for s in new.prompt.segments[first:])
    reason = "context_compacted" if compacted else "input_changed"
    return _miss(reason, new.prompt.tokens - new.prompt.tokens_at(shared), old.reusable)


def _miss(reason: str, missed: int, reusable: int) -> dict[str, Any]:
    return {
        "type": "cache_miss",
        "reason": reason,
        "cache_missed_tokens": missed,
        "comparison_reusable_tokens": reusable,
    }
