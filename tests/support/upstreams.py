"""The fake model servers live in the package (`llmp.demo.fakes`) so `llmp demo` can use them."""

from llmp.demo.fakes import (
    LLAMA_MODEL_FILE,
    MIDSTREAM_ERROR_MESSAGE,
    MODES,
    PING,
    REPLY_TEXT,
    TOOL_ARGS,
    BlackHole,
    ClosedPort,
    Exchange,
    Upstream,
    count_tokens,
    prompt_text,
)

__all__ = [
    "LLAMA_MODEL_FILE",
    "MIDSTREAM_ERROR_MESSAGE",
    "MODES",
    "PING",
    "REPLY_TEXT",
    "TOOL_ARGS",
    "BlackHole",
    "ClosedPort",
    "Exchange",
    "Upstream",
    "count_tokens",
    "prompt_text",
]
