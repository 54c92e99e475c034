"""build_record: a Capture becomes a recording v1 record (pure; no proxy)."""

from __future__ import annotations

import gzip
import json

from llmp.apis.openai_chat import OpenAIChat
from llmp.format import canonical
from llmp.recorder.capture import (
    Capture,
    keep_headers,
    keep_request_headers,
    keep_response_headers,
    upstream_host,
)
from llmp.recorder.record import build_record

CHAT_BODY = (
    b'{"model":"smol","stream":true,"temperature":0.70,"top_p":1E0,'
    b'"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}],'
    b'"tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}]}'
)

SSE = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],"model":"m.gguf"}\n\n'
    b":\n\n"
    b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2},'
    b'"timings":{"cache_n":7,"prompt_n":2,"prompt_ms":12.50}}\n\n'
    b"data: [DONE]\n\n"
)


def _cap(**kw: object) -> Capture:
    base: dict[str, object] = dict(
        id=3,
        conn=1,
        t_start_ms=1000,
        method="POST",
        path="/v1/chat/completions",
        request_headers={"content-type": "application/json"},
        request_body=CHAT_BODY,
        request_body_bytes=len(CHAT_BODY),
        status=200,
        response_headers={"content-type": "text/event-stream"},
        t_end_ms=2000,
    )
    base.update(kw)
    cap = Capture(**base)  # type: ignore[arg-type]
    return cap


def _with_pieces(cap: Capture, data: bytes, size: int = 7, limit: int = 1 << 20) -> Capture:
    for i in range(0, len(data), size):
        cap.add_piece(data[i : i + size], limit)
    return cap


def test_keep_headers_only_four_and_joins_repeats() -> None:
    pairs = [
        ("User-Agent", "a"),
        ("Authorization", "Bearer x"),
        ("x-api-key", "k"),
        ("Cookie", "c"),
        ("Content-Type", "application/json"),
        ("Transfer-Encoding", "chunked"),
        ("transfer-encoding", "gzip"),
        ("Proxy-Authorization", "Basic y"),
    ]
    assert keep_headers(pairs) == {
        "user-agent": "a",
        "content-type": "application/json",
        "transfer-encoding": "chunked, gzip",
    }


def _fnv_tag(data: bytes) -> str:
    """R32's `fnv1a:<16 hex>` of a value's bytes."""
    return "fnv1a:" + canonical.hash_bytes(data)


def test_provider_response_headers_r34() -> None:
    """Ids and versions verbatim, accounts hashed, rate limits by name only, nothing else."""
    pairs = [
        ("Request-Id", "req_011CXabc"),
        ("X-Request-Id", "req_8f1e"),
        ("openai-processing-ms", "412"),
        ("OpenAI-Version", "2020-10-01"),
        ("anthropic-organization-id", "org-SECRET-1"),
        ("Anthropic-Workspace-Id", "wrkspc_SECRET-2"),
        ("openai-organization", "user-SECRET-3"),
        ("openai-project", "proj_SECRET-4"),
        ("anthropic-ratelimit-tokens-remaining", "38000"),
        ("Anthropic-Ratelimit-Requests-Reset", "2026-12-01T00:00:00Z"),
        ("anthropic-ratelimit-unified-status", "allowed"),
        ("x-ratelimit-remaining-tokens", "99"),  # OpenAI's: not named, not kept
        ("set-cookie", "__cf_bm=SECRET-5"),
        ("cf-ray", "8f00"),
        ("server", "cloudflare"),
        ("content-type", "application/json"),
    ]
    kept = keep_response_headers(pairs)
    assert kept == {
        "content-type": "application/json",
        "request-id": "req_011CXabc",
        "x-request-id": "req_8f1e",
        "openai-processing-ms": "412",
        "openai-version": "2020-10-01",
        "anthropic-organization-id": _fnv_tag(b"org-SECRET-1"),
        "anthropic-workspace-id": _fnv_tag(b"wrkspc_SECRET-2"),
        "openai-organization": _fnv_tag(b"user-SECRET-3"),
        "openai-project": _fnv_tag(b"proj_SECRET-4"),
        "anthropic-ratelimit-tokens-remaining": "",
        "anthropic-ratelimit-requests-reset": "",
        "anthropic-ratelimit-unified-status": "",
        "server": "cloudflare",
    }
    assert "SECRET" not in json.dumps(kept)
    # The request side keeps none of them: a client's x-request-id is its own.
    assert keep_request_headers(pairs) == {"content-type": "application/json"}


def test_anthropic_beta_kept_verbatim_on_the_request_only() -> None:
    beta = "claude-code-20250219,interleaved-thinking-2025-05-14"
    pairs = [("Anthropic-Beta", beta), ("anthropic-beta", "effort-2025-11-24")]
    assert keep_request_headers(pairs) == {"anthropic-beta": f"{beta}, effort-2025-11-24"}
    assert keep_response_headers(pairs) == {}


def test_upstream_and_added_are_written() -> None:
    rec = build_record(_cap(upstream="API.anthropic.com", added=["diagnostics"]), "digest")
    assert rec["request"]["upstream"] == "API.anthropic.com"  # as mitmproxy resolved it
    assert rec["request"]["added"] == ["diagnostics"]
    rec = build_record(_cap(), "full")
    assert rec["request"]["upstream"] is None and rec["request"]["added"] is None
    keys = list(rec["request"])
    assert keys.index("upstream") == keys.index("path") + 1 and keys[-1] == "added"


def test_upstream_is_the_host_alone() -> None:
    assert upstream_host("api.openai.com") == "api.openai.com"
    assert upstream_host("user:pw@api.openai.com:443") == "api.openai.com"
    assert upstream_host("127.0.0.1:8080") == "127.0.0.1"
    assert upstream_host("::1") == "::1"
    assert upstream_host("[::1]:443") == "::1"
    assert upstream_host("") is None
    for host in ("api.openai.com", "::1", "10.0.0.2"):
        assert upstream_host(upstream_host(host) or "") == upstream_host(host)  # idempotent


def test_full_stream_record() -> None:
    rec = build_record(_with_pieces(_cap(), SSE), "full")
    assert list(rec) == [
        "v",
        "id",
        "conn",
        "t_start_ms",
        "t_first_byte_ms",
        "t_first_event_ms",
        "t_end_ms",
        "request",
        "response",
        "error",
        "tokens",
    ]
    assert rec["v"] == 1 and rec["id"] == 3 and rec["tokens"] is None and rec["error"] is None
    req = rec["request"]
    assert req["digest"] is None and req["body_text"] is None
    assert req["body"]["temperature"].text == "0.70"
    resp = rec["response"]
    assert resp["stream"] == "sse" and resp["chunks"] == 6 and resp["bad_chunks"] == 0
    assert resp["body_bytes"] == len(SSE) and resp["truncated"] is False
    msg = resp["body"]["choices"][0]["message"]
    assert msg["content"] == "Hello" and msg["reasoning_content"] == "think"
    assert resp["body"]["timings"]["prompt_ms"].text == "12.50"
    line = canonical.record_dumps(rec)
    assert b'"temperature":0.70' in line and b'"top_p":1E0' in line and b'"prompt_ms":12.50' in line


def test_digest_and_full_give_the_same_hashes() -> None:
    full = build_record(_with_pieces(_cap(), SSE), "full")
    dig = build_record(_with_pieces(_cap(), SSE), "digest")
    # Round-trip the full record through its JSON line, as a reader would (R2).
    reread = canonical.loads(canonical.record_dumps(full))
    assert OpenAIChat().request_digest(reread["request"]["body"]) == dig["request"]["digest"]
    assert OpenAIChat().response_digest(reread["response"]["body"]) == canonical.loads(
        canonical.record_dumps(dig["response"]["digest"])
    )
    assert dig["request"]["body"] is None and dig["response"]["body"] is None
    line = canonical.record_dumps(dig).decode()
    assert "You are terse" not in line and "Hello" not in line and "think" not in line


def test_digest_drops_non_chat_and_non_2xx() -> None:
    other = build_record(
        _with_pieces(
            _cap(
                path="/v1/models",
                method="GET",
                response_headers={"content-type": "application/json"},
            ),
            b'{"data":[]}',
        ),
        "digest",
    )
    assert other["request"]["digest"] is None and other["response"]["digest"] is None
    err_body = b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}'
    bad = build_record(
        _with_pieces(
            _cap(status=400, response_headers={"content-type": "application/json"}), err_body
        ),
        "digest",
    )
    assert bad["request"]["digest"] is not None
    assert bad["response"]["digest"] is None and bad["response"]["status"] == 400
    full_bad = build_record(
        _with_pieces(
            _cap(status=400, response_headers={"content-type": "application/json"}), err_body
        ),
        "full",
    )
    assert full_bad["response"]["body"]["error"]["type"] == "exceed_context_size_error"


def test_non_json_request_is_body_text_in_full_mode() -> None:
    raw = b'{"messages": [NaN]}'
    rec = build_record(_cap(request_body=raw, request_body_bytes=len(raw), status=None), "full")
    assert rec["request"]["body"] is None and rec["request"]["body_text"] == raw.decode()
    assert rec["response"] is None
    rec = build_record(_cap(request_body=raw, request_body_bytes=len(raw), status=None), "digest")
    assert rec["request"]["digest"] is None and rec["request"]["body_bytes"] == len(raw)


def test_body_too_large_is_not_stored() -> None:
    cap = _cap(request_body=None, request_body_bytes=99, error="body_too_large")
    rec = build_record(_with_pieces(cap, SSE), "full")
    assert rec["error"] == "body_too_large"
    assert rec["request"]["body"] is None and rec["request"]["body_text"] is None
    assert rec["request"]["digest"] is None and rec["request"]["body_bytes"] == 99
    assert rec["response"]["body"]["choices"][0]["message"]["content"] == "Hello"


def test_truncated_stream_keeps_events_within_limit() -> None:
    limit = SSE.index(b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}') + 10
    cap = _with_pieces(_cap(), SSE, size=5, limit=limit)
    assert cap.truncated and cap.response_body_bytes == len(SSE) and cap.stored_bytes == limit
    rec = build_record(cap, "full")
    resp = rec["response"]
    assert resp["truncated"] is True and resp["body_bytes"] == len(SSE)
    assert resp["body"]["choices"][0]["message"]["content"] == "Hel"
    assert resp["chunks"] == 3 and resp["bad_chunks"] == 0


def test_truncated_plain_body_keeps_prefix_as_text() -> None:
    body = json.dumps({"choices": [{"message": {"content": "x" * 100}}]}).encode()
    cap = _with_pieces(
        _cap(response_headers={"content-type": "application/json"}), body, size=50, limit=60
    )
    rec = build_record(cap, "full")
    assert rec["response"]["truncated"] is True
    assert rec["response"]["body"] is None and rec["response"]["body_text"] == body[:60].decode()


def test_gzip_stream_is_decoded_in_our_copy_only() -> None:
    packed = gzip.compress(SSE)
    cap = _with_pieces(_cap(response_encoding="gzip"), packed, size=11)
    rec = build_record(cap, "digest")
    assert rec["response"]["body_bytes"] == len(packed)
    assert rec["response"]["digest"]["output"]["content_chars"] == 5
    assert rec["response"]["chunks"] == 6


def test_sniffs_stream_without_content_type() -> None:
    cap = _with_pieces(_cap(response_headers={}), SSE)
    assert build_record(cap, "digest")["response"]["stream"] == "sse"
    nd = b'{"message":{"role":"assistant","content":"a"},"done":false}\n{"message":{"content":"b"},"done":true,"prompt_eval_count":4}\n'
    cap = _with_pieces(
        _cap(path="/api/chat", response_headers={"content-type": "application/octet-stream"}), nd
    )
    rec = build_record(cap, "digest")
    assert rec["response"]["stream"] == "ndjson" and rec["response"]["chunks"] == 2
    assert rec["response"]["digest"]["usage"]["prompt_eval_count"] == 4


def test_midstream_error_is_kept() -> None:
    sse = (
        b'data: {"choices":[{"index":0,"delta":{"content":"par"}}]}\n\n'
        b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
    )
    rec = build_record(_with_pieces(_cap(), sse), "digest")
    assert rec["response"]["digest"]["usage"]["error"]["message"] == "boom"
    assert rec["response"]["chunks"] == 2


def test_empty_body_all_null_and_first_byte_null() -> None:
    rec = build_record(_cap(status=204, response_headers={}), "full")
    assert rec["t_first_byte_ms"] is None
    assert rec["response"]["body"] is None and rec["response"]["body_text"] is None
    assert rec["response"]["digest"] is None and rec["response"]["body_bytes"] == 0


def test_hangup_after_done_is_not_client_disconnected() -> None:
    # openai-python closes as soon as it reads [DONE], sometimes before the
    # chunked terminator: the client had the whole response.
    cap = _with_pieces(_cap(error="client_disconnected"), SSE)
    assert build_record(cap, "digest")["error"] is None
    cut = SSE[: SSE.index(b"data: [DONE]")]
    cap = _with_pieces(_cap(error="client_disconnected"), cut)
    assert build_record(cap, "digest")["error"] == "client_disconnected"
    # past the limit, the tail still shows the end
    cap = _with_pieces(_cap(error="client_disconnected"), SSE, size=5, limit=40)
    assert cap.truncated and build_record(cap, "digest")["error"] is None


def test_hangup_after_whole_plain_body() -> None:
    body = b'{"choices":[{"message":{"content":"hi"}}]}'
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    cap = _with_pieces(_cap(error="client_disconnected", response_headers=headers), body)
    assert build_record(cap, "digest")["error"] is None
    cap = _with_pieces(_cap(error="client_disconnected", response_headers=headers), body[:10])
    assert build_record(cap, "digest")["error"] == "client_disconnected"


# -- R28: when the first event arrived -------------------------------------------


def _timed(cap: Capture, pieces: list[tuple[float, bytes]], limit: int = 1 << 20) -> Capture:
    """Pieces with the times they arrived (the capture stamps them; here we set them)."""
    for t, piece in pieces:
        cap.add_piece(piece, limit)
        cap.times[-1] = t
    cap.t_first_byte_ms = int(pieces[0][0] * 1000)
    return cap


def test_first_event_after_keep_alive_comments() -> None:
    """llama-server pings `:` every second while it reads the prompt; the first
    event, not the first byte, ends the prefill (R28)."""
    event = SSE.split(b"\n\n", 1)[0] + b"\n\n"
    cap = _timed(
        _cap(),
        [
            (1.0, b":\n\n"),
            (2.0, b":\n\n"),
            (3.5, event[:20]),
            (4.25, event[20:]),
            (5.0, b": x\n\n"),
        ],
    )
    rec = build_record(cap, "digest")
    assert rec["t_first_byte_ms"] == 1000
    assert rec["t_first_event_ms"] == 4250  # the piece that completed the event


def test_first_event_split_across_gzip_pieces() -> None:
    """The decoded copy keeps its pieces apart, so each keeps its time."""
    data = gzip.compress(b":\n\n" * 50 + SSE)
    half = len(data) // 2
    cap = _timed(
        _cap(response_headers={"content-type": "text/event-stream", "content-encoding": "gzip"}),
        [(1.0, data[:10]), (2.0, data[10:half]), (3.0, data[half:])],
    )
    cap.response_encoding = "gzip"
    rec = build_record(cap, "digest")
    assert rec["t_first_event_ms"] in (2000, 3000)
    assert rec["response"]["chunks"] == 6


def test_first_event_null_without_a_stream_or_an_event() -> None:
    plain = _timed(
        _cap(response_headers={"content-type": "application/json"}),
        [(1.0, b'{"choices":[]}')],
    )
    assert build_record(plain, "digest")["t_first_event_ms"] is None
    pings = _timed(_cap(), [(1.0, b":\n\n"), (2.0, b":\n\n")])
    assert build_record(pings, "digest")["t_first_event_ms"] is None
    assert build_record(_cap(status=None), "digest")["t_first_event_ms"] is None


def test_first_event_of_an_ndjson_line_closed_by_the_end() -> None:
    line = b'{"message":{"role":"assistant","content":"hi"},"done":true}'
    cap = _timed(
        _cap(path="/api/chat", response_headers={"content-type": "application/x-ndjson"}),
        [(1.0, line[:10]), (2.5, line[10:])],
    )
    assert build_record(cap, "digest")["t_first_event_ms"] == 2500


# -- R29: a stream that reached its end is complete ------------------------------

ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
    b'"role":"assistant","content":[],"model":"m.gguf","usage":{"input_tokens":5,'
    b'"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":1}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)

RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"r",'
    b'"object":"response","status":"in_progress"}}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"item_id":"msg_1","delta":"Hi"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r",'
    b'"object":"response","status":"completed","model":"m.gguf","output":[{"type":"message",'
    b'"id":"msg_1","role":"assistant","content":[{"type":"output_text","text":"Hi"}]}],'
    b'"usage":{"input_tokens":9,"output_tokens":1,"input_tokens_details":{"cached_tokens":4}}},'
    b'"timings":{"prompt_n":5,"cache_n":4,"prompt_ms":3.5}}\n\n'
)


def test_hangup_after_the_end_event_is_complete_for_every_api() -> None:
    """Codex hangs up right after `response.completed` (R29); the record is whole."""
    for path, stream in (
        ("/v1/messages?beta=true", ANTHROPIC_STREAM),
        ("/v1/responses", RESPONSES_STREAM),
        ("/v1/chat/completions", SSE),
    ):
        cap = _with_pieces(_cap(path=path), stream)
        cap.error = "client_disconnected"
        rec = build_record(cap, "digest")
        assert rec["error"] is None, path
        assert rec["response"]["digest"] is not None
        # A server that fails after the end (a lying Content-Length) is still its failure.
        cap = _with_pieces(_cap(path=path), stream)
        cap.error = "upstream_reset"
        assert build_record(cap, "digest")["error"] == "upstream_reset"


def test_hangup_before_the_end_event_stays_an_error() -> None:
    for path, stream, end in (
        ("/v1/messages", ANTHROPIC_STREAM, b"event: message_stop"),
        ("/v1/responses", RESPONSES_STREAM, b"event: response.completed"),
    ):
        cap = _with_pieces(_cap(path=path), stream[: stream.index(end)])
        cap.error = "client_disconnected"
        rec = build_record(cap, "digest")
        assert rec["error"] == "client_disconnected", path
        assert rec["response"]["chunks"] >= 1


def test_shutdown_after_the_end_event_is_complete() -> None:
    """mitmproxy calls `done` before every streamed flow's `response` hook has run:
    an exchange whose end event was relayed is whole; one cut before it is not."""
    for path, stream, end in (
        ("/v1/messages", ANTHROPIC_STREAM, b"event: message_stop"),
        ("/v1/responses", RESPONSES_STREAM, b"event: response.completed"),
        ("/v1/chat/completions", SSE, b"data: [DONE]"),
    ):
        cap = _with_pieces(_cap(path=path), stream)
        cap.cut_at_shutdown = True
        cap.error = "upstream_reset"
        assert build_record(cap, "digest")["error"] is None, path
        cap = _with_pieces(_cap(path=path), stream[: stream.index(end)])
        cap.cut_at_shutdown = True
        cap.error = "upstream_reset"
        assert build_record(cap, "digest")["error"] == "upstream_reset", path
