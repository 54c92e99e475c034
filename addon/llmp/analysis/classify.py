"""Is a request a turn, a side-call or stateless, and what shape (§5)?

Decided from what came before the request only, so the same decision is made
live in the recorder and after the fact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmp.analysis.linking import (
    CONTINUATION,
    OVERLAP,
    PREFIX,
    Conversation,
    Link,
    carries_reply,
)

if TYPE_CHECKING:
    from llmp.analysis.config import Config
    from llmp.analysis.exchange import Exchange

TURN = "turn"
SIDE_CALL = "side_call"
STATELESS = "stateless"

STRUCTURED = "structured"
SUMMARISE = "summarise"
ONESHOT = "oneshot"
SHAPES = (SUMMARISE, STRUCTURED, ONESHOT)


def is_probe(ex: Exchange, cfg: Config) -> bool:
    """Nothing a later request could build on by its messages: none, a probe, or a
    Responses request that continues a stored prompt (`previous_response_id`)."""
    if not ex.hashes or ex.stored_prompt:
        return True
    return (
        ex.max_tokens is not None
        and ex.max_tokens <= cfg.probe_max_tokens
        and not ex.has_model_msgs
        and not ex.tools.names
    )


def side_call_marker(ex: Exchange, ref: Conversation, cfg: Config) -> str | None:
    """Why this request is a side-call of `ref`, or None when it is not."""
    last = ref.last
    if ex.structured and not last.structured:
        return STRUCTURED
    if ex.tools.names:
        return None  # with tools, only structured output makes a side-call
    if last.has_tools:
        return "no_tools"
    if (
        ex.max_tokens is not None
        and ex.max_tokens <= cfg.side_call_max_tokens
        and (last.max_tokens is None or last.max_tokens > cfg.side_call_max_tokens)
    ):
        return "max_tokens"
    if not ex.has_model_msgs and (
        ex.requested_model != last.requested_model or ex.hashes[: ex.n_sys] != last.sys
    ):
        return "one_off"
    return None


def _works_on_the_history(ex: Exchange, link: Link | None, ref: Conversation) -> bool:
    """A request that resends the conversation's history under another system prompt,
    with tools that leave some of the conversation's out: a side-call that works on the
    history (Qwen Code's memory extraction after every turn), not a turn of the
    conversation and not a subagent (which starts from its own first message).

    The history is the start of the last turn's messages after the system prompt: at
    least two of them, or its only one and the reply to it (Qwen Code 0.24.4 puts its
    context and the prompt in one user message). Not always all of them: 0.24.4's
    prompt suggestion (the turn's whole prompt and one more user message, a turn here)
    can come between a turn and its memory extraction, which does not resend that
    message. The tools: 0.15.10 sent a subset of the turn's, 0.24.4 sends 3 of the 10
    it has with `-p` and 3 others. Another system prompt with every tool of the
    conversation stays a turn, and so does a system prompt that keeps the first 256
    characters of the conversation's (a harness that cut its prompt and tools after a
    context error)."""
    if link is None or link.conv is not ref or link.mode not in (CONTINUATION, PREFIX):
        return False
    last = ref.last
    if not ex.n_sys or not last.sys or ex.edges(0)[1] == last.edges(0)[1]:
        return False  # the same system prompt, or one that keeps its start (cut, edited)
    if link.k < 2 and not (link.k == len(last.rest) and carries_reply(ex, last.out_chars)):
        return False  # the first user message alone is what a title call resends
    names = ex.tools.names
    if not names:
        return False
    # A damaged digest's name may be any JSON value: only strings name a tool.
    before = {n for t in last.tool_digests if t is not None and type(n := t.name) is str}
    return not before <= names


def keeps_the_conversation(ex: Exchange, link: Link | None, ref: Conversation) -> bool:
    """On a cloud provider the text format is one of the conversation's cache settings
    (R35: `text.format`, Chat's `response_format`): a structured request that continues
    the conversation's last turn whole, with its system prompt, tools and model, is the
    conversation's next turn with a setting changed, not a side-call.  A side-call that
    asks for JSON about the history (Gemini CLI's next-speaker check) sends it without
    the tools, or to another model."""
    if ex.provider is None or link is None or link.conv is not ref or link.mode != CONTINUATION:
        return False
    last = ref.last
    return (
        ex.hashes[: ex.n_sys] == last.sys
        and ex.tools.hash == last.tools_hash
        and ex.requested_model == last.requested_model
    )


def classify(
    ex: Exchange,
    link: Link | None,
    ref: Conversation | None,
    prompt_tokens: int,
    cfg: Config,
) -> tuple[str, str | None]:
    """(kind, side_call_shape) of a request."""
    if is_probe(ex, cfg):
        return STATELESS, None
    if ref is None:
        return TURN, None
    if _works_on_the_history(ex, link, ref):
        return SIDE_CALL, SUMMARISE
    marker = side_call_marker(ex, ref, cfg)
    if marker is None:
        return TURN, None
    if marker == STRUCTURED:
        if keeps_the_conversation(ex, link, ref):
            return TURN, None
        return SIDE_CALL, STRUCTURED
    # A title call resends the first user message; a history is more than that.
    carries_history = link is not None and (
        link.mode == OVERLAP or (link.mode in (CONTINUATION, PREFIX) and link.k >= 2)
    )
    if carries_history or ex.has_model_msgs or prompt_tokens >= cfg.summarise_min_tokens:
        return SIDE_CALL, SUMMARISE
    return SIDE_CALL, ONESHOT
