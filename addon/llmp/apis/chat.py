"""Which requests are chat requests (R6)."""

from __future__ import annotations

from typing import Literal

Api = Literal["openai_chat", "ollama_chat", "other"]

OPENAI_CHAT: Api = "openai_chat"
OLLAMA_CHAT: Api = "ollama_chat"
OTHER: Api = "other"


def strip_query(path: str) -> str:
    """The path without its query string or fragment."""
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    return path


def chat_api(method: str, path: str) -> Api:
    """Classify a request by method and path, as R6 says."""
    if method.upper() != "POST":
        return OTHER
    bare = strip_query(path)
    if bare in ("/v1/chat/completions", "/chat/completions") or bare.endswith(
        "/v1/chat/completions"
    ):
        return OPENAI_CHAT
    if bare == "/api/chat":
        return OLLAMA_CHAT
    return OTHER
