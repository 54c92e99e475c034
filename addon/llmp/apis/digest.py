"""Digests: what the analysis needs from a chat body, without its text (R4, R5).

The recorder writes these in digest mode; the analyzer computes the very same
digests from full-mode bodies, so both kinds of recording hash alike.
"""

from __future__ import annotations

from typing import Any

from llmp.apis.chat import OLLAMA_CHAT
from llmp.format.canonical import EMPTY_HASH, dumps, hash_bytes, hash_text

EDGE_CHARS = 256  # head/tail window, in Unicode scalar values

__all__ = [
    "is_set",
    "message_digest",
    "message_name",
    "message_text",
    "request_digest",
    "response_digest",
    "tool_call_refs",
    "tool_digest",
]


def is_set(value: Any) -> bool:
    """The spec's "set": present, not null, and not an empty string."""
    return value is not None and value != ""


def _nonempty_list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) and value else None


def message_name(msg: dict[str, Any]) -> Any:
    """`name`, or Ollama's `tool_name`."""
    name = msg.get("name")
    return name if name is not None else msg.get("tool_name")


def content_text(content: Any) -> str:
    """The text of a content value: a string, or the joined text parts of an array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def message_text(msg: dict[str, Any]) -> str:
    """R5: the content's text, then the canonical JSON of any tool calls."""
    text = content_text(msg.get("content"))
    calls = _nonempty_list(msg.get("tool_calls"))
    if calls is not None:
        text += dumps(calls).decode("utf-8")
    return text


def tool_call_refs(calls: Any) -> list[dict[str, Any]]:
    """`[{id, name}]` for each tool call; `id` is null when the server gave none."""
    if not isinstance(calls, list):
        return []
    refs: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, dict):
            refs.append({"id": None, "name": None})
            continue
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            name = call.get("name")
        refs.append({"id": call.get("id"), "name": name})
    return refs


def _edge_hashes(text: str) -> tuple[str, str]:
    if not text:
        return EMPTY_HASH, EMPTY_HASH
    if len(text) <= EDGE_CHARS:
        whole = hash_text(text)
        return whole, whole
    return hash_text(text[:EDGE_CHARS]), hash_text(text[-EDGE_CHARS:])


def message_digest(msg: Any) -> dict[str, Any]:
    """One message's digest: identity hash, size and edge hashes, no text (R4, R5)."""
    if not isinstance(msg, dict):
        msg = {}
    role = msg.get("role")
    calls = _nonempty_list(msg.get("tool_calls"))
    name = message_name(msg)
    identity = [role, msg.get("content"), calls, name, msg.get("tool_call_id")]
    text = message_text(msg)
    head, tail = _edge_hashes(text)
    return {
        "role": role,
        "hash": hash_bytes(dumps(identity)),
        "chars": len(text),
        "head": head,
        "tail": tail,
        "tool_calls": tool_call_refs(calls),
        "tool_call_id": msg.get("tool_call_id"),
        "name": name,
    }


def tool_digest(tool: Any) -> dict[str, Any]:
    """A tool definition's name, and hash and size of its canonical JSON."""
    canon = dumps(tool)
    name = None
    if isinstance(tool, dict):
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            name = tool.get("name")
    return {"name": name, "hash": hash_bytes(canon), "chars": len(canon.decode("utf-8"))}


def _max_tokens(body: dict[str, Any]) -> int | None:
    options = body.get("options")
    candidates = [
        body.get("max_tokens"),
        body.get("max_completion_tokens"),
        body.get("n_predict"),
        options.get("num_predict") if isinstance(options, dict) else None,
    ]
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
    return None


def _response_format(body: dict[str, Any]) -> bool:
    fmt = body.get("response_format")
    if is_set(fmt):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if kind != "text":
            return True
    return is_set(body.get("format"))


def request_digest(body: Any, api: str) -> dict[str, Any] | None:
    """The request digest of a chat body; `None` when the body is not an object."""
    if not isinstance(body, dict):
        return None
    stream = body.get("stream")
    if not isinstance(stream, bool):
        stream = api == OLLAMA_CHAT
    messages = body.get("messages")
    tools = body.get("tools")
    tool_list = tools if isinstance(tools, list) else []
    model = body.get("model")
    return {
        "model": model if isinstance(model, str) else None,
        "params": {
            "max_tokens": _max_tokens(body),
            "response_format": _response_format(body),
            "grammar": is_set(body.get("grammar")) or is_set(body.get("json_schema")),
            "stream": stream,
        },
        "messages": [message_digest(m) for m in messages] if isinstance(messages, list) else [],
        "tools": [tool_digest(t) for t in tool_list],
        "tools_hash": hash_bytes(dumps(tool_list)) if tool_list else None,
    }


def reply_message(body: dict[str, Any]) -> dict[str, Any] | None:
    """The reply: `choices[0].message`, or Ollama's `message`."""
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        if isinstance(msg, dict):
            return msg
    msg = body.get("message")
    return msg if isinstance(msg, dict) else None


def response_digest(body: Any) -> dict[str, Any] | None:
    """The response digest: the server's counters verbatim, and the reply's sizes."""
    if not isinstance(body, dict):
        return None
    usage = {k: v for k, v in body.items() if k not in ("choices", "message")}
    reply = reply_message(body) or {}
    reasoning = 0
    for key in ("reasoning_content", "reasoning", "thinking"):
        value = reply.get(key)
        if isinstance(value, str):
            reasoning = len(value)
            break
    return {
        "usage": usage,
        "output": {
            "content_chars": len(content_text(reply.get("content"))),
            "reasoning_chars": reasoning,
            "tool_calls": tool_call_refs(reply.get("tool_calls")),
        },
    }
