"""The ``x-fake`` modes: the faults and quirks a test can ask of a fake, per request.

Also the bytes every flavour shares for them (the keep-alive comment, the
non-JSON event).
"""

from __future__ import annotations

MIDSTREAM_ERROR_MESSAGE = "fake upstream: error while generating"
PING = b":\n\n"
GARBAGE_SSE = b"data: not json\n\n"
GARBAGE_NDJSON = b"not json\n"

#: Every ``x-fake`` mode, with what it does. Values are given as ``name=value``.
MODES: dict[str, str] = {
    "midstream_error": "after error_after events, send the server's error event/line; "
    "llama: clean chunked end, no [DONE]; ollama: {'error':…} line, no done line",
    "die_midstream": "after error_after events, close the socket (FIN) without the terminator",
    "reset_midstream": "like die_midstream but with a TCP RST (SO_LINGER 0)",
    "hang_midstream": "after error_after events, send nothing more until hang_s or close()",
    "error_after": "=N events (pings not counted) before a *_midstream fault; default 3",
    "die_before_head": "read the request, close the connection without a response",
    "hang_before_head": "read the request, send nothing until hang_s or close()",
    "hang_after_head": "send the response head, then nothing until hang_s or close()",
    "hang_s": "=SECONDS for the hang_* modes; default 120 (close() ends hangs early)",
    "context_error": "HTTP 400 exceed_context_size_error JSON (llama), even for streams",
    "status": "=N: answer HTTP N with the flavor's error JSON",
    "slow": "sleep 50 ms between writes",
    "delay_ms": "=N: sleep N ms between writes",
    "prefill_ms": "=N: sleep N ms after the head, before the first event",
    "garbage": "a non-JSON event (data: not json / a 'not json' line) as the 3rd data event",
    "short_content_length": "send the whole body at once with Content-Length 100 too big, close",
    "gzip": "gzip the body (sync-flushed per event) if the request accepts gzip",
    "big_response": "many small content deltas (events=N, default 2000)",
    "events": "=N content deltas in place of the reply text",
    "token_chars": "=N: pad each big_response/events delta to N characters",
    "split": "write every event as two chunks, cut in the middle byte",
    "no_ping": "no ':' keep-alive comments (llama: chat, messages, responses)",
    "no_reasoning": "no reasoning/thinking deltas",
    "old_build": "older llama/ollama quirks: arguments:'' repeated in tool fragments, "
    "content null beside tool calls, no cached_tokens, no pings; ollama: no "
    "prompt_eval_cached_count and prompt_eval_count = evaluated part only; llama "
    "/v1/messages: no cache_read_input_tokens, input_tokens = whole prompt; llama "
    "/v1/responses: no input_tokens_details, no timings",
    "cache_miss": "report no cached prompt tokens for this request; cloud fakes: this "
    "request reads nothing (anthropic-api: the entries stay, its breakpoints write)",
    "evict": "anthropic-api: before this request looks, drop every cached entry, or "
    "=POSITION only those at that block position (the provider's own eviction)",
    "diagnosis_pending": "anthropic-api: diagnostics not ready yet ({'cache_miss_reason': null})",
    "overflow": "cloud fakes, OpenAI before GPT-5.6: this request overflows to another machine",
    "diagnosis_unavailable": "cloud fakes: a diagnosis asked for answers 'unavailable'",
    "draft": "=PERCENT: llama timings gain draft_n (2 per generated token) and "
    "draft_n_accepted (PERCENT of them, default 75), as with --model-draft",
    "close": "answer with Connection: close and close the connection afterwards",
    "no_content_type": "omit the Content-Type response header",
    "content_type": "=VALUE: use this Content-Type instead",
    "header": "=NAME:VALUE: add this response header (a cloud provider's, to pose as one)",
}

FAULT_ENDINGS = {
    "midstream_error": "error",
    "die_midstream": "die",
    "reset_midstream": "reset",
    "hang_midstream": "hang",
}


def parse_fake(value: str) -> dict[str, str]:
    """``"slow,delay_ms=5"`` -> ``{"slow": "", "delay_ms": "5"}``."""
    modes: dict[str, str] = {}
    for part in value.split(","):
        name, _, arg = part.strip().partition("=")
        if name:
            modes[name.strip().lower()] = arg.strip()
    return modes
