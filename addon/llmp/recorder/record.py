"""Turn a `Capture` into a recording v1 record (a plain dict).

This is the expensive part of recording (decompressing, parsing, merging,
hashing), so it runs in the builder child (`llmp.recorder.builder`), or on
the writer's thread without one, never on the client's path.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from llmp.apis import ChatApi, api_for
from llmp.format import canonical
from llmp.format.schema import CLIENT_DISCONNECTED, FULL, RECORD_VERSION, UPSTREAM_RESET
from llmp.recorder.capture import Capture
from llmp.recorder.stream import StreamCapture, sniff_stream

log = logging.getLogger("llmp")
_GENERIC_TYPES = ("", "application/octet-stream", "text/plain", "binary/octet-stream")


def _decoder(encoding: str | None) -> Any:
    """An incremental decompressor for a content-encoding, or None for identity."""
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return None
    if enc in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if enc == "deflate":
        return zlib.decompressobj()
    if enc == "br":
        import brotli  # mitmproxy depends on it

        return brotli.Decompressor()
    if enc == "zstd":
        import zstandard  # mitmproxy depends on it

        return zstandard.ZstdDecompressor().decompressobj()
    raise ValueError(f"unsupported content-encoding {encoding!r}")


def decoded_pieces(pieces: Iterable[bytes], encoding: str | None) -> Iterator[bytes]:
    """The pieces with their content-encoding removed, one out per piece in (empty when
    the decoder holds it back), the decoder's last bytes added to the last one; stops
    quietly at corrupt data."""
    dec = _decoder(encoding)
    if dec is None:
        yield from pieces
        return
    out: bytes | None = None
    try:
        for piece in pieces:
            if out is not None:
                yield out
            out = dec.process(piece) if hasattr(dec, "process") else dec.decompress(piece)
        flush = getattr(dec, "flush", None)
        tail = flush() if flush is not None else b""
        if out is not None or tail:
            yield (out or b"") + (tail or b"")
    except Exception:
        if out:
            yield out


def _media_type(headers: dict[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _store_body(data: bytes, mode: str, digest_fn: Any) -> dict[str, Any]:
    """The body / body_text / digest triple for a complete, non-streamed body."""
    out: dict[str, Any] = {"body": None, "body_text": None, "digest": None}
    if not data:
        return out
    if mode == FULL:
        try:
            out["body"] = canonical.loads(data)
        except canonical.NotJSON:
            out["body_text"] = data.decode("utf-8", "replace")
        return out
    if digest_fn is None:
        return out
    try:
        parsed = canonical.loads(data)
    except canonical.NotJSON:
        return out
    out["digest"] = digest_fn(parsed)
    return out


def _object_digest(fn: Any) -> Any:
    """A digest function that takes any parsed body: None unless it is an object."""
    return lambda body: fn(body) if isinstance(body, dict) else None


def _request_part(
    cap: Capture, mode: str, api: ChatApi | None
) -> tuple[dict[str, Any], bytes | None]:
    """The record's request, and its decoded body (None when it was too large)."""
    part: dict[str, Any] = {
        "method": cap.method,
        "path": cap.path,
        "upstream": cap.upstream,  # R34
        "headers": cap.request_headers,
        "body_bytes": cap.request_body_bytes,
        "body": None,
        "body_text": None,
        "digest": None,
        "added": cap.added,  # R37: what the opt-in diagnosis added, else null
    }
    if cap.request_body is None:  # too large: forwarded, not stored (R12)
        return part, None
    try:
        data = b"".join(decoded_pieces([cap.request_body], cap.request_encoding))
    except ValueError:
        data = cap.request_body
    if mode != FULL and api is not None:
        # The digest only: messages sent before are looked up, not parsed again.
        part["digest"] = api.request_digest_bytes(data) if data else None
        return part, data
    part.update(_store_body(data, mode, None))
    return part, data


def _response_part(
    cap: Capture, mode: str, api: ChatApi | None
) -> tuple[dict[str, Any] | None, int | None]:
    """The response part, and when its first stream event arrived (R28)."""
    if cap.status is None:
        return None, None
    part: dict[str, Any] = {
        "status": cap.status,
        "headers": cap.response_headers,
        "stream": None,
        "chunks": None,
        "bad_chunks": None,
        "body_bytes": cap.response_body_bytes,
        "truncated": cap.truncated,
        "body": None,
        "body_text": None,
        "digest": None,
    }
    try:
        data_pieces = list(decoded_pieces(cap.pieces, cap.response_encoding))
    except ValueError:  # unknown encoding: keep what we can say, no body
        return part, None
    media = _media_type(cap.response_headers)
    if media in _GENERIC_TYPES:  # missing or generic: sniff, but only chat responses (R8)
        kind = sniff_stream(None, _head(data_pieces)) if api is not None else None
    else:
        kind = sniff_stream(media, b"")
    digest_api = api if api is not None and 200 <= cap.status < 300 else None
    if kind is None:
        data = b"".join(data_pieces)
        if _cut_after_the_end(cap) and _plain_complete(cap):
            cap.error = None
        if cap.truncated:
            if mode == FULL and data:
                part["body_text"] = data.decode("utf-8", "replace")
            return part, None
        digest = None if digest_api is None else _object_digest(digest_api.response_digest)
        part.update(_store_body(data, mode, digest))
        return part, None
    # The capture already applied the limit to what it kept; parse all of it.
    stream = StreamCapture(kind, sum(map(len, data_pieces)) + 1, api)
    first_event: float | None = None
    times = cap.times if len(cap.times) == len(data_pieces) else [None] * len(data_pieces)
    for at, (piece, t) in enumerate(zip(data_pieces, times, strict=True)):
        stream.feed(piece)
        if stream.events:
            first_event = t  # the piece that completed the first event (R28)
            # The rest in one piece: the parsers give the same events for any
            # split, and one call costs less than one per event.
            stream.feed(b"".join(data_pieces[at + 1 :]))
            break
    if cap.truncated:
        stream.truncated = True
    stream.close()
    if first_event is None and stream.events and times:
        first_event = times[-1]  # an NDJSON line the end of the body closed
    merged = stream.merged()
    if _cut_after_the_end(cap) and _stream_complete(cap, kind, stream.done_seen):
        cap.error = None  # the end event was relayed: the client had everything (R29)
    part["stream"] = kind
    part["chunks"] = stream.chunks
    part["bad_chunks"] = stream.bad_chunks
    if mode == FULL:
        if merged is not None:
            part["body"] = merged
        elif data_pieces:
            part["body_text"] = b"".join(data_pieces).decode("utf-8", "replace")
    elif digest_api is not None and merged is not None:
        part["digest"] = digest_api.response_digest(merged)
    return part, None if first_event is None else int(first_event * 1000)


_AFTER_THE_END = frozenset((CLIENT_DISCONNECTED,))
"""The client's hang-up or reset after the end event: no error then (R29).  A server
that fails after it (a body shorter than its Content-Length) stays `upstream_reset`:
the client's HTTP library saw a broken response too.  A shutdown that finds the
exchange in flight after its end event was relayed is no error either: mitmproxy
calls `done` before it has run every streamed flow's `response` hook."""


def _cut_after_the_end(cap: Capture) -> bool:
    """Was the exchange cut in a way that is no error once the response was whole?"""
    return cap.error in _AFTER_THE_END or (cap.cut_at_shutdown and cap.error == UPSTREAM_RESET)


def _stream_complete(cap: Capture, kind: str, done_seen: bool) -> bool:
    """Did the client get the stream's own end event before the connection went?

    Clients such as openai-python close the connection as soon as they read
    `data: [DONE]`, and real Codex right after `response.completed`,
    sometimes before the chunked terminator arrives; they had the whole
    response, so that is no `client_disconnected` (R29).
    """
    if done_seen and not cap.truncated:
        return True
    if kind == "sse" and not cap.response_encoding:
        return cap.tail.rstrip(b"\r\n").endswith(b"data: [DONE]")
    return False


def _plain_complete(cap: Capture) -> bool:
    length = cap.response_headers.get("content-length", "")
    return length.isdigit() and int(length) == cap.response_body_bytes > 0


def _head(pieces: list[bytes], size: int = 65536) -> bytes:
    head = b""
    for piece in pieces:
        head += piece[: size - len(head)]
        if len(head) >= size:
            break
    return head


def _token_counts(
    cap: Capture,
    api: ChatApi | None,
    request: dict[str, Any],
    response: dict[str, Any] | None,
    data: bytes | None,
    counter: Any,
    headers: dict[str, str],
) -> dict[str, Any] | None:
    """The upstream tokenizer's counts of a chat request's messages (`recorder.tokens`),
    asked only of a server its response shows to have one (R35)."""
    if counter is None or api is None or cap.tokenize is None or not data or response is None:
        return None
    if cap.status is None or not 200 <= cap.status < 300:
        return None
    body = request["body"]
    if body is None:
        try:
            body = canonical.loads(data)
        except canonical.NotJSON:
            return None
    top = response["body"]
    if not isinstance(top, dict):
        digest = response["digest"]
        top = digest.get("usage") if isinstance(digest, dict) else None  # all but `choices`
    top = top if isinstance(top, dict) else None
    shape = counter.shape(cap.tokenize, api.name, headers, top)  # tokens.tokenizer_shape
    counts: dict[str, Any] | None = counter.counts(cap.tokenize, api, body, shape)
    return counts


def _all_response_headers(cap: Capture) -> dict[str, str]:
    """Every response header (names lower-case), before `settle` keeps only R15's and the
    server's: a provider is also told by a header only it sends (R34)."""
    fields = cap.response_fields
    if fields is None:
        return cap.response_headers
    out: dict[str, str] = {}
    for name, value in fields:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def build_record(cap: Capture, mode: str, counter: Any = None) -> dict[str, Any]:
    """The recording v1 record for one finished exchange.

    `counter` (a `recorder.tokens.RecordTokens`, in the builder child) fills `tokens`.
    """
    asking = counter is not None and cap.tokenize is not None
    headers = _all_response_headers(cap) if asking else {}
    cap.settle()  # what the client's path left raw: headers, counts (`Capture.settle`)
    api = api_for(cap.method, cap.path)
    request, data = _request_part(cap, mode, api)
    response, first_event = _response_part(cap, mode, api)  # may clear the error (R29)
    tokens = _token_counts(cap, api, request, response, data, counter, headers)
    return {
        "v": RECORD_VERSION,
        "id": cap.id,
        "conn": cap.conn,
        "t_start_ms": cap.t_start_ms,
        "t_first_byte_ms": cap.t_first_byte_ms,
        "t_first_event_ms": first_event,
        "t_end_ms": cap.t_end_ms if cap.t_end_ms is not None else cap.t_start_ms,
        "request": request,
        "response": response,
        "error": cap.error,
        "tokens": tokens,
    }


def fallback_record(cap: Capture, mode: str) -> dict[str, Any]:
    """A record without bodies, for when building the real one failed: never lose an exchange."""
    cap.settle()  # the counts come from the pieces dropped here
    stripped = dataclasses.replace(cap, request_body=None, pieces=[], times=[], stored_bytes=0)
    return build_record(stripped, mode)


def build_line(cap: Capture, mode: str, counter: Any = None) -> bytes:
    """The record's JSON line; without bodies when building the real one failed."""
    try:
        return canonical.record_dumps(build_record(cap, mode, counter)) + b"\n"
    except Exception:
        log.exception("llmp: could not build record %s; writing it without bodies", cap.id)
        return canonical.record_dumps(fallback_record(cap, mode)) + b"\n"
