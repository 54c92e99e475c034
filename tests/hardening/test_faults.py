"""Faults, provoked for real through the real mitmdump.

Upstreams that die, reset, send garbage, cut a UTF-8 character, lie about
their Content-Length or compress; clients that hang up anywhere or trickle
their request in; a disk that fills; a path that cannot be written; SIGTERM
and SIGKILL in the middle of traffic. In each case the client gets every byte
upstream sent, the proxy keeps serving, and the recording holds exactly one
whole line per exchange, classified as R13 says.

Most tests share one mitmdump (regular proxy mode, full body mode) and find
their own record by a ``?t=TAG`` on the request path.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmp.apis.openai_chat import message_digest
from tests.support.hardening import (
    RawUpstream,
    abort,
    chunked,
    connect,
    gunzip,
    raw_request,
    records_now,
    recv_all,
    reply_from_ndjson,
    reply_from_record,
    reply_from_sse,
    response_head,
    split_response,
    tagged,
    tmpfs,
    wait_for,
    wait_record,
    whole_lines,
)
from tests.support.mitm import Mitmdump, MitmdumpError, read_records, wait_for_records
from tests.support.upstreams import Exchange, Upstream

pytestmark = pytest.mark.e2e

CHAT = {"llama": "/v1/chat/completions", "ollama": "/api/chat"}


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture(scope="module")
def oll() -> Iterator[Upstream]:
    with Upstream("ollama") as up:
        yield up


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mitmdump, Path]]:
    """One regular-mode mitmdump in full mode, for the tests that only need their own record."""
    path = tmp_path_factory.mktemp("faults") / "shared.jsonl"
    with Mitmdump(None, path, {"llmp_body": "full"}, mode="regular") as proxy:
        yield proxy, path
        assert proxy.running, "the shared proxy died\n" + proxy.log_text()[-3000:]
        # Nothing is left in flight: a SIGINT now writes no extra record.
        before = len(read_records(path))
        assert proxy.stop() == 0
    after = whole_lines(path)
    assert len(after) == before, [r for r in after[before:]]


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _body(flavor: str, text: str = "hello", stream: bool = True) -> dict[str, Any]:
    msgs = [{"role": "user", "content": text}]
    if flavor == "llama":
        return {"model": "m", "stream": stream, "messages": msgs}
    return {"model": "qwen3", "stream": stream, "messages": msgs}


def _stream_raw(
    proxy: Mitmdump, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[bytes, Exception | None]:
    """POST through the proxy; the raw body bytes received, and the error that ended it."""
    got: list[bytes] = []
    with httpx.Client(proxy=proxy.url, trust_env=False, timeout=30) as client:
        try:
            with client.stream("POST", url, json=body, headers=headers) as resp:
                for piece in resp.iter_raw():
                    got.append(piece)
        except httpx.HTTPError as exc:
            return b"".join(got), exc
    return b"".join(got), None


def _exchange(up: Upstream, tag: str) -> Exchange:
    return wait_for(
        lambda: next((e for e in reversed(up.log) if e.path.endswith(f"t={tag}")), None),
        5,
        f"upstream exchange {tag}",
    ).wait()


def _assert_alive(proxy: Mitmdump, up: Upstream) -> None:
    """The proxy still passes a normal exchange."""
    r = httpx.get(up.url + "/v1/models", proxy=proxy.url, trust_env=False, timeout=30)
    assert r.status_code == 200


# ------------------------------------------------------------ upstream faults


@pytest.mark.parametrize("fault", ["die_midstream", "reset_midstream"])
@pytest.mark.parametrize("flavor", ["llama", "ollama"])
def test_upstream_killed_midstream(
    fault: str,
    flavor: str,
    llama: Upstream,
    oll: Upstream,
    shared: tuple[Mitmdump, Path],
) -> None:
    proxy, path = shared
    up = llama if flavor == "llama" else oll
    tag = _tag()
    raw, err = _stream_raw(
        proxy,
        f"{up.url}{CHAT[flavor]}?t={tag}",
        _body(flavor),
        {"x-fake": f"{fault},error_after=4,split"},
    )
    ex = _exchange(up, tag)
    assert isinstance(err, httpx.RemoteProtocolError), err
    assert raw == ex.body  # every byte upstream sent before dying reached the client
    (rec,) = wait_record(path, tagged(tag))
    resp = rec["response"]
    assert rec["error"] == "upstream_reset"
    assert resp["status"] == 200 and resp["body_bytes"] == len(raw)
    assert resp["chunks"] == 4 and resp["bad_chunks"] == 0
    want = reply_from_sse(raw) if flavor == "llama" else reply_from_ndjson(raw)
    assert reply_from_record(rec) == want
    _assert_alive(proxy, llama)


@pytest.mark.parametrize("fault", ["die_midstream", "reset_midstream"])
def test_upstream_killed_inside_content_length_body(
    fault: str, llama: Upstream, shared: tuple[Mitmdump, Path]
) -> None:
    proxy, path = shared
    tag = _tag()
    raw, err = _stream_raw(
        proxy,
        f"{llama.url}/v1/chat/completions?t={tag}",
        _body("llama", stream=False),
        {"x-fake": fault},
    )
    ex = _exchange(llama, tag)
    assert isinstance(err, httpx.RemoteProtocolError), err
    assert raw == ex.body and 0 < len(raw) < len(ex.decoded_body)
    (rec,) = wait_record(path, tagged(tag))
    resp = rec["response"]
    assert rec["error"] == "upstream_reset" and resp["status"] == 200
    assert resp["body_bytes"] == len(raw) and resp["stream"] is None
    assert resp["body"] is None and resp["body_text"] == raw.decode("utf-8", "replace")


@pytest.mark.parametrize("flavor", ["llama", "ollama"])
def test_upstream_garbage_keeps_the_valid_events(
    flavor: str, llama: Upstream, oll: Upstream, shared: tuple[Mitmdump, Path]
) -> None:
    proxy, path = shared
    up = llama if flavor == "llama" else oll
    tag = _tag()
    raw, err = _stream_raw(
        proxy, f"{up.url}{CHAT[flavor]}?t={tag}", _body(flavor), {"x-fake": "garbage,split"}
    )
    ex = _exchange(up, tag)
    assert err is None and raw == ex.body
    (rec,) = wait_record(path, tagged(tag))
    resp = rec["response"]
    assert rec["error"] is None and resp["bad_chunks"] == 1
    if flavor == "llama":
        good = [d for d in ex.sse_data() if d not in ("[DONE]", "not json")]
        assert resp["chunks"] == len(good) + 1
        want = reply_from_sse(raw.replace(b"data: not json\n\n", b""))
    else:
        good = [ln for ln in ex.ndjson_lines() if ln != "not json"]
        assert resp["chunks"] == len(good) + 1
        want = reply_from_ndjson(raw.replace(b"not json\n", b""))
    got = reply_from_record(rec)
    assert got == want and got.content == up.reply and got.reasoning


def _sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _delta(text: str) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": {"content": text}}]}


_SSE_GOOD = [_sse_event(_delta(t)) for t in ("caf\u00e9 ", "na\u00efve ", "\u20ac5 ")]
_SSE_GOOD_TEXT = "caf\u00e9 na\u00efve \u20ac5 "
_ND_GOOD = [
    json.dumps({"message": {"role": "assistant", "content": t}, "done": False}).encode() + b"\n"
    for t in ("caf\u00e9 ", "\u20ac5 ")
]
#: (name, content type, response writes as (pieces, chunked?, ending), expected)
_UTF8_CASES: dict[str, tuple[str, list[bytes], bool, str, dict[str, Any]]] = {
    # The last event's data stops inside a 2-byte character; the stream then ends cleanly.
    "sse_event_cut_in_char": (
        "text/event-stream",
        [*_SSE_GOOD, b'data: {"choices":[{"index":0,"delta":{"content":"caf\xc3'],
        True,
        "keep",
        {"error": None, "chunks": 4, "bad": 1, "content": _SSE_GOOD_TEXT},
    ),
    # Whole events, then the first two bytes of a 3-byte character and nothing else.
    "sse_trailing_partial_char": (
        "text/event-stream",
        [*_SSE_GOOD, b"\xe2\x82"],
        True,
        "keep",
        {"error": None, "chunks": 3, "bad": 0, "content": _SSE_GOOD_TEXT},
    ),
    # The same, but the connection dies right after the cut character.
    "sse_cut_in_char_then_reset": (
        "text/event-stream",
        [*_SSE_GOOD, b'data: {"choices":[{"index":0,"delta":{"content":"\xe2\x82'],
        True,
        "reset",
        {"error": "upstream_reset", "chunks": 4, "bad": 1, "content": _SSE_GOOD_TEXT},
    ),
    # NDJSON: an unterminated last line that stops inside a character.
    "ndjson_last_line_cut_in_char": (
        "application/x-ndjson",
        [*_ND_GOOD, b'{"message":{"role":"assistant","content":"\xf0\x9f\x98'],
        True,
        "keep",
        {"error": None, "chunks": 3, "bad": 1, "content": "caf\u00e9 \u20ac5 "},
    ),
    # Content-Length framing, body ends inside a character.
    "ndjson_content_length": (
        "application/x-ndjson",
        [*_ND_GOOD, b"\xc3"],
        False,
        "close",
        {"error": None, "chunks": 3, "bad": 1, "content": "caf\u00e9 \u20ac5 "},
    ),
}


@pytest.mark.parametrize("case", sorted(_UTF8_CASES))
def test_truncated_utf8_at_the_end_of_the_stream(case: str, shared: tuple[Mitmdump, Path]) -> None:
    proxy, path = shared
    ctype, pieces, is_chunked, ending, want = _UTF8_CASES[case]
    body = b"".join(pieces)
    if is_chunked:
        writes = [response_head(200, ctype), *chunked(pieces, end=ending == "keep")]
    else:
        writes = [response_head(200, ctype, length=len(body)), body]
    route = "/api/chat" if "ndjson" in case else "/v1/chat/completions"
    with RawUpstream(lambda m, t, b: (writes, ending), delay=0.01) as up:
        tag = _tag()
        raw, err = _stream_raw(proxy, f"{up.url}{route}?t={tag}", _body("llama"), {})
        (rec,) = wait_record(path, tagged(tag))
    assert raw == body, (raw, body)
    assert (err is None) is (want["error"] is None), err
    resp = rec["response"]
    assert rec["error"] == want["error"]
    assert resp["body_bytes"] == len(body)
    assert (resp["chunks"], resp["bad_chunks"]) == (want["chunks"], want["bad"])
    assert reply_from_record(rec).content == want["content"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("flavor", ["llama", "ollama"])
def test_content_length_upstream_does_not_honour(
    flavor: str,
    stream: bool,
    llama: Upstream,
    oll: Upstream,
    shared: tuple[Mitmdump, Path],
) -> None:
    proxy, path = shared
    up = llama if flavor == "llama" else oll
    tag = _tag()
    raw, err = _stream_raw(
        proxy,
        f"{up.url}{CHAT[flavor]}?t={tag}",
        _body(flavor, stream=stream),
        {"x-fake": "short_content_length"},
    )
    ex = _exchange(up, tag)
    assert isinstance(err, httpx.RemoteProtocolError), err
    assert raw == ex.body
    (rec,) = wait_record(path, tagged(tag))
    resp = rec["response"]
    assert rec["error"] == "upstream_reset" and resp["status"] == 200
    assert resp["body_bytes"] == len(raw)
    if stream:
        want = reply_from_sse(raw) if flavor == "llama" else reply_from_ndjson(raw)
        assert reply_from_record(rec) == want and want.content == up.reply
    else:
        assert resp["stream"] is None and resp["body"] == json.loads(raw)


@pytest.mark.parametrize("flavor", ["llama", "ollama"])
def test_gzip_stream_recorded_decoded_and_passed_compressed(
    flavor: str, llama: Upstream, oll: Upstream, shared: tuple[Mitmdump, Path]
) -> None:
    proxy, path = shared
    up = llama if flavor == "llama" else oll
    results = {}
    for fault in ("", ",die_midstream,error_after=5"):
        tag = _tag()
        raw, err = _stream_raw(
            proxy,
            f"{up.url}{CHAT[flavor]}?t={tag}",
            _body(flavor),
            {"x-fake": "gzip,split,events=40" + fault, "accept-encoding": "gzip"},
        )
        ex = _exchange(up, tag)
        assert ex.response_header("content-encoding") == "gzip"
        assert raw == ex.body  # passed on compressed, byte for byte
        (rec,) = wait_record(path, tagged(tag))
        plain = gunzip(raw)
        assert plain == ex.decoded_body
        want = reply_from_sse(plain) if flavor == "llama" else reply_from_ndjson(plain)
        assert reply_from_record(rec) == want
        assert rec["response"]["body_bytes"] == len(raw)
        results[fault] = (rec, err, want)
    rec, err, want = results[""]
    assert err is None and rec["error"] is None and rec["response"]["bad_chunks"] == 0
    assert want.content == "".join(f" w{i}" for i in range(40))
    rec, err, want = results[",die_midstream,error_after=5"]
    assert err is not None and rec["error"] == "upstream_reset"
    assert rec["response"]["chunks"] == 5 and rec["response"]["bad_chunks"] == 0


# -------------------------------------------------------------- client faults

_CUTS = ("head", "body", "before_response", "mid_response", "after_response")


def _one_cut_client(
    port: int, target: str, body: bytes, headers: dict[str, str], cut: str, rng: random.Random
) -> dict[str, Any]:
    """Send a request and hang up at ``cut``; report what was sent and received."""
    req = raw_request("POST", target, body, headers)
    head_len = req.index(b"\r\n\r\n") + 4
    reset = rng.random() < 0.5
    sock = connect(port)
    got = b""
    try:
        if cut == "head":
            sock.sendall(req[: rng.randint(1, head_len - 1)])
        elif cut == "body":
            sock.sendall(req[: rng.randint(head_len, len(req) - 1)])
        else:
            sock.sendall(req)
        time.sleep(rng.uniform(0.0, 0.05))
        if cut == "mid_response":
            # at least the head and one event, but never the whole stream
            got = recv_all(sock, rng.randint(300, 2500))
        elif cut == "after_response":
            got = recv_all(sock)
    finally:
        abort(sock, reset)
    return {"cut": cut, "reset": reset, "got": got}


def test_clients_disconnect_at_random_points(
    llama: Upstream, oll: Upstream, tmp_path: Path
) -> None:
    """48 clients (seeded) hang up anywhere: in the head, in the body, before or in the
    response, or after it; with FIN or RST. One record per request that got past its
    head, none for the others, every one classified; the proxy keeps serving and has
    nothing left in flight at shutdown."""
    rng = random.Random(20240905)
    path = tmp_path / "cuts.jsonl"
    plan = [(i, _CUTS[i % len(_CUTS)], "llama" if i % 2 else "ollama") for i in range(48)]
    rng.shuffle(plan)
    results: dict[int, dict[str, Any]] = {}
    with Mitmdump(None, path, {"llmp_body": "full"}, mode="regular") as proxy:

        def run(i: int, cut: str, flavor: str) -> None:
            up = llama if flavor == "llama" else oll
            body = json.dumps(_body(flavor, f"cut {i}")).encode()
            headers = {"Content-Type": "application/json", "x-fake": "events=40,delay_ms=15"}
            if cut == "before_response":
                headers["x-fake"] += ",prefill_ms=400"
            if cut == "after_response":
                headers["Connection"] = "close"
            target = f"{up.url}{CHAT[flavor]}?t=cut{i}"
            results[i] = _one_cut_client(
                proxy.port, target, body, headers, cut, random.Random(f"{rng.random()}")
            )

        for start in range(0, len(plan), 8):  # 8 at a time
            batch = [threading.Thread(target=run, args=p) for p in plan[start : start + 8]]
            for t in batch:
                t.start()
            for t in batch:
                t.join(30)
        expected = sum(1 for _, cut, _ in plan if cut != "head")
        records = wait_for_records(path, expected, timeout=20)
        time.sleep(0.5)  # nothing more should come
        _assert_alive(proxy, llama)
        assert proxy.stop() == 0  # anything still in flight would be written now
    records = whole_lines(path)
    by_tag = {r["request"]["path"].rpartition("t=")[2] or "alive": r for r in records}
    assert len(by_tag) == len(records) == expected + 1  # + the liveness check
    exchanges = {e.path.rsplit("t=", 1)[1]: e for e in [*llama.log, *oll.log] if "t=cut" in e.path}
    wrong_request_phase = []
    for i, cut, _flavor in plan:
        rec = by_tag.get(f"cut{i}")
        if cut == "head":
            assert rec is None, rec  # no request, no exchange: nothing to record
            continue
        assert rec is not None, f"cut{i} ({cut}) has no record"
        got = results[i]["got"]
        resp = rec["response"]
        ex = exchanges.get(f"cut{i}")
        if cut == "body":
            assert ex is None and resp is None  # never went upstream
            if rec["error"] != "client_disconnected":
                wrong_request_phase.append((i, rec["error"]))
        elif cut == "after_response":
            assert ex is not None and rec["error"] is None, rec
            assert (
                split_response(got)[2] == ex.body == b"".join(ex.plain_parts)
            )  # whole stream, untouched
            assert resp["body_bytes"] == len(ex.body)
        else:
            # Hung up before the end: maybe before the proxy even reached upstream.
            assert rec["error"] == "client_disconnected", (i, cut, rec)
            if cut == "mid_response":
                assert resp is not None and split_response(got)[0] == 200
            if resp is not None:
                assert ex is not None and resp["status"] == 200
                assert resp["body_bytes"] <= len(ex.wait(10).body)
    # R13: the client went away before it had the response, whatever the phase.
    assert wrong_request_phase == [], (
        "clients that hung up while sending their request body were recorded as "
        f"{wrong_request_phase}, not client_disconnected"
    )


def test_client_gone_while_sending_its_body_is_client_disconnected(
    llama: Upstream, shared: tuple[Mitmdump, Path]
) -> None:
    proxy, path = shared
    tag = _tag()
    body = json.dumps(_body("llama")).encode()
    req = raw_request(
        "POST", f"{llama.url}/v1/chat/completions?t={tag}", body, {"x-fake": "events=3"}
    )
    sock = connect(proxy.port)
    sock.sendall(req[:-10])
    time.sleep(0.2)
    sock.close()
    (rec,) = wait_record(path, tagged(tag))
    assert rec["response"] is None
    assert rec["error"] == "client_disconnected", rec


def test_openai_sdk_hangs_up_after_done_before_the_chunked_end(
    shared: tuple[Mitmdump, Path],
) -> None:
    """The sync openai SDK closes the connection as soon as it reads ``[DONE]``,
    without reading the chunked terminator. Here the terminator never comes: the
    client still had the whole response, so the record has no error, and every
    event."""
    proxy, path = shared
    events = [*_SSE_GOOD, b"data: [DONE]\n\n"]
    # Every event, then no chunked terminator: the upstream is still "generating".
    writes = [response_head(), *chunked(events, end=False)]
    with RawUpstream(lambda m, t, b: (writes, "keep")) as up:
        tag = _tag()
        with openai.DefaultHttpxClient(proxy=proxy.url, trust_env=False, timeout=30) as http:
            client = openai.OpenAI(
                base_url=up.url + "/v1", api_key="x", max_retries=0, http_client=http
            )
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_query={"t": tag},
            )
            content = "".join(c.choices[0].delta.content or "" for c in stream)
        (rec,) = wait_record(path, tagged(tag))
    assert content == _SSE_GOOD_TEXT
    assert rec["error"] is None
    assert reply_from_record(rec).content == content
    assert rec["response"]["chunks"] == 3 and rec["response"]["bad_chunks"] == 0


# ---------------------------------------------------------------- slow loris


def test_slow_loris_does_not_hold_up_the_others(
    llama: Upstream, shared: tuple[Mitmdump, Path]
) -> None:
    """Six clients trickle their request in one byte at a time (about 3 s each) while
    normal clients keep going; the normal ones are served at full speed, and each slow
    one is recorded when it completes. A seventh stalls in its body and gives up: it
    gets a record too, and one that stalls in its head gets none."""
    proxy, path = shared
    lat: list[float] = []
    slow: dict[str, bytes] = {}
    tags = [_tag() for _ in range(6)]
    stall_body, stall_head = _tag(), _tag()

    def loris(tag: str) -> None:
        body = json.dumps(_body("llama", f"slow {tag}")).encode()
        req = raw_request(
            "POST",
            f"{llama.url}/v1/chat/completions?t={tag}",
            body,
            {"Connection": "close", "Content-Type": "application/json"},
        )
        sock = connect(proxy.port)
        pause = 3.0 / len(req)
        for i in range(len(req)):
            sock.sendall(req[i : i + 1])
            time.sleep(pause)
        slow[tag] = recv_all(sock)
        sock.close()

    def staller(tag: str, in_body: bool) -> None:
        body = json.dumps(_body("llama")).encode()
        req = raw_request("POST", f"{llama.url}/v1/chat/completions?t={tag}", body)
        head_len = req.index(b"\r\n\r\n") + 4
        sock = connect(proxy.port)
        sock.sendall(req[: head_len + 5] if in_body else req[: head_len - 5])
        time.sleep(3.0)
        sock.close()

    threads = [threading.Thread(target=loris, args=(t,)) for t in tags]
    threads += [
        threading.Thread(target=staller, args=(stall_body, True)),
        threading.Thread(target=staller, args=(stall_head, False)),
    ]
    for t in threads:
        t.start()
    with httpx.Client(proxy=proxy.url, trust_env=False, timeout=30) as client:
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            r = client.post(
                f"{llama.url}/v1/chat/completions?t=normal",
                json=_body("llama", stream=False),
            )
            lat.append(time.monotonic() - t0)
            assert r.status_code == 200
    for t in threads:
        t.join(10)
    lat.sort()
    print(f"\nslow loris: {len(lat)} normal exchanges meanwhile, max {lat[-1] * 1000:.0f} ms")
    assert len(lat) >= 20 and lat[-1] < 1.0 and lat[len(lat) // 2] < 0.2
    for tag in tags:
        (rec,) = wait_record(path, tagged(tag))
        ex = _exchange(llama, tag)
        status, _, body = split_response(slow[tag])
        assert status == 200 and body == ex.body
        assert rec["error"] is None and rec["response"]["body_bytes"] == len(ex.body)
        assert rec["request"]["body"]["messages"][0]["content"] == f"slow {tag}"
    (rec,) = wait_record(path, tagged(stall_body))
    assert rec["response"] is None and rec["error"] is not None
    assert not [r for r in whole_lines(path) if tagged(stall_head)(r)]


# ------------------------------------------------------------------ the disk


def test_disk_fills_up(llama: Upstream, tmp_path: Path) -> None:
    """A 256 KiB tmpfs fills; the proxy says STOPPED RECORDING once, at error level,
    keeps passing every byte, and the file holds only whole lines with no gap."""
    with tmpfs(tmp_path / "small", "256k") as small:
        path = small / "rec.jsonl"
        sent: list[tuple[bytes, Exchange]] = []
        with (
            Mitmdump(llama.url, path, {"llmp_body": "full"}) as proxy,
            httpx.Client(timeout=30) as client,
        ):
            for i in range(200):
                tag = _tag()
                body = _body("llama", f"fill {i} " + "x" * 2000)
                r = client.post(
                    f"{proxy.url}/v1/chat/completions?t={tag}",
                    json=body,
                    headers={"x-fake": "events=200,token_chars=24"},
                )
                sent.append((r.content, _exchange(llama, tag)))
                if "STOPPED RECORDING" in proxy.log_text():
                    break
            log = proxy.wait_for_log("STOPPED RECORDING", timeout=10)
            # After the disk is full: traffic still passes, byte for byte.
            for _ in range(20):
                tag = _tag()
                r = client.post(
                    f"{proxy.url}/v1/chat/completions?t={tag}",
                    json=_body("llama"),
                    headers={"x-fake": "events=50"},
                )
                sent.append((r.content, _exchange(llama, tag)))
            r = client.get(proxy.url + "/health")
            assert r.status_code == 200
            assert proxy.stop() == 0
            log = proxy.log_text()
        for content, ex in sent:
            assert content == ex.body
        lines = [ln for ln in log.splitlines() if "STOPPED RECORDING" in ln]
        assert len(lines) == 1, lines
        assert "No space left on device" in lines[0] and str(path) in lines[0]
        assert "Traceback" not in log
        records = whole_lines(path)
        print(f"\ndisk full: {len(records)} records fit, {len(sent)} exchanges passed")
        assert 0 < len(records) < len(sent)
        assert [r["id"] for r in records] == list(range(1, len(records) + 1))


@pytest.mark.parametrize("case", ["directory", "read_only_fs", "parent_is_a_file"])
def test_unwritable_path_is_a_clear_error_at_startup(
    case: str, llama: Upstream, tmp_path: Path
) -> None:
    expected = {
        "directory": "Is a directory",
        "read_only_fs": "Read-only file system",
        "parent_is_a_file": "Not a directory",
    }[case]

    def check(path: Path) -> None:
        proxy = Mitmdump(llama.url, path, timeout=20)
        t0 = time.monotonic()
        with pytest.raises(MitmdumpError):
            proxy.start()
        log = proxy.log_text()
        proxy.close()
        assert time.monotonic() - t0 < 15
        assert proxy.returncode not in (None, 0)
        lines = [ln for ln in log.splitlines() if "cannot open recording" in ln]
        assert len(lines) == 1, log
        assert str(path) in lines[0] and expected in lines[0], lines[0]
        assert "Traceback" not in log, log

    if case == "directory":
        check(tmp_path)
    elif case == "parent_is_a_file":
        (tmp_path / "file").write_text("x")
        check(tmp_path / "file" / "rec.jsonl")
    else:
        with tmpfs(tmp_path / "ro", "64k", readonly=True) as ro:
            check(ro / "rec.jsonl")


# --------------------------------------------------------------- signals


def _user_hash(text: str) -> str:
    return str(message_digest({"role": "user", "content": text})["hash"])


class _Traffic:
    """Clients streaming chats through a reverse proxy in front of Ollama, until stopped.

    Odd workers use ``/api/chat`` (NDJSON), even ones ``/v1/chat/completions`` (SSE).
    Each request has a unique user message; ``finished`` holds the ones whose
    response the client got whole.
    """

    def __init__(self, url: str, workers: int, fake: str) -> None:
        self.url = url
        self.fake = fake
        self.stop = threading.Event()
        self.sent: dict[str, str] = {}  # message hash -> text
        self.finished: dict[str, int] = {}  # message hash -> body bytes received
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(w,)) for w in range(workers)]

    def __enter__(self) -> _Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _run(self, w: int) -> None:
        i = 0
        with httpx.Client(timeout=httpx.Timeout(30, connect=2)) as client:
            while not self.stop.is_set():
                text = f"signal w{w} r{i} {uuid.uuid4().hex}"
                i += 1
                h = _user_hash(text)
                with self.lock:
                    self.sent[h] = text
                path = "/api/chat" if w % 2 else "/v1/chat/completions"
                body = {
                    "model": "qwen3",
                    "stream": True,
                    "messages": [{"role": "user", "content": text}],
                }
                try:
                    with client.stream(
                        "POST", self.url + path, json=body, headers={"x-fake": self.fake}
                    ) as resp:
                        raw = b"".join(resp.iter_raw())
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                ok = raw.endswith(b"data: [DONE]\n\n") or b'"done":true' in raw
                if ok:
                    with self.lock:
                        self.finished[h] = len(raw)

    def snapshot(self) -> tuple[dict[str, str], dict[str, int]]:
        with self.lock:
            return dict(self.sent), dict(self.finished)


def _by_hash(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Records by their last message's hash; a record without a request digest
    must be one the shutdown caught before its request body had all arrived."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        digest = rec["request"]["digest"]
        if digest is None:
            assert rec["error"] in ("client_disconnected", "upstream_reset"), rec
            assert rec["response"] is None, rec
            continue
        h = digest["messages"][-1]["hash"]
        assert h not in out, f"two records for one request: {h}"
        out[h] = rec
    return out


@pytest.mark.slow
def test_sigterm_during_load_loses_no_finished_exchange(oll: Upstream, tmp_path: Path) -> None:
    path = tmp_path / "term.jsonl"
    seen_before = len(oll.log)
    proxy = Mitmdump(oll.url, path).start()
    try:
        with _Traffic(proxy.url, 16, "events=30,delay_ms=15") as traffic:
            wait_for(lambda: len(traffic.finished) >= 60, 30, "60 finished exchanges")
            code = proxy.terminate(timeout=20)
            sent, finished = traffic.snapshot()
    finally:
        proxy.close()
    upstream_hashes = set()
    for ex in oll.log[seen_before:]:
        msgs = json.loads(ex.request_body or b"{}").get("messages") or [{}]
        upstream_hashes.add(_user_hash(str(msgs[-1].get("content"))))
    records = whole_lines(path)
    by_hash = _by_hash(records)
    print(
        f"\nSIGTERM: {len(sent)} requests sent, {len(finished)} finished, "
        f"{len(records)} records, {len(records) - len(finished)} written as in flight"
    )
    assert code == 0, proxy.log_text()[-2000:]
    assert sorted(r["id"] for r in records) == list(range(1, len(records) + 1))
    assert set(by_hash) <= set(sent)
    for h, size in finished.items():
        rec = by_hash.get(h)
        assert rec is not None, f"finished exchange {sent[h]!r} is not in the recording"
        assert rec["error"] is None and rec["response"]["body_bytes"] == size, rec
    # Everything upstream saw through this proxy has its record (in flight ones too).
    ours = upstream_hashes & set(sent)
    assert ours <= set(by_hash)
    for h in set(by_hash) - set(finished):
        assert by_hash[h]["error"] in ("upstream_reset", "client_disconnected", None)


def _after_kill(path: Path) -> tuple[list[dict[str, Any]], bytes]:
    """The whole records of a file a killed recorder left, and its partial last line.

    A partial last line is allowed only as the start of a record: SIGKILL can stop
    one ``write`` of a large line part way (the kernel checks for a fatal signal
    between pages), so the record being written may be cut.
    """
    data = path.read_bytes()
    head, _, tail = data.rpartition(b"\n")
    records = [json.loads(line) for line in head.split(b"\n") if line] if head else []
    assert all(isinstance(r, dict) and r.get("v") == 1 for r in records)
    assert not tail or tail.startswith(b'{"v":1,"id":'), tail[:200]
    return records, tail


def _restart_and_stop(url: str, path: Path) -> None:
    """A new recorder on the file, one exchange, a clean stop."""
    with Mitmdump(url, path) as proxy:
        before = len(records_now(path))
        httpx.get(proxy.url + "/api/version", timeout=30)
        wait_for(lambda: len(records_now(path)) > before, 10, "the restart's record")


@pytest.mark.slow
def test_sigkill_during_load_leaves_only_whole_lines(oll: Upstream, tmp_path: Path) -> None:
    """Kill -9 three times in the middle of traffic with large full-mode records, each
    time restarting on the same file: whole lines only (a record cut in the middle of
    its write may end the file until the next start), each one a real request, none
    twice."""
    path = tmp_path / "kill.jsonl"
    sent_all: dict[str, str] = {}
    killed_at: list[int] = []
    partial = 0
    for round_ in range(3):
        proxy = Mitmdump(oll.url, path, {"llmp_body": "full"}).start()
        try:
            with _Traffic(proxy.url, 12, "events=400,token_chars=64,delay_ms=0") as traffic:
                wait_for(lambda: len(traffic.finished) >= 10, 30, "10 finished exchanges")
                time.sleep(random.Random(round_).uniform(0.0, 0.5))
                proxy.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                proxy.proc.wait(10)  # type: ignore[union-attr]
                sent, _ = traffic.snapshot()
        finally:
            proxy.close()
        sent_all.update(sent)
        killed_at.append(path.stat().st_size)
        records, tail = _after_kill(path)  # after every kill, not just the last
        partial += bool(tail)
        for rec in records:
            body = rec["request"]["body"]
            assert body is None or _user_hash(body["messages"][-1]["content"]) in sent_all
    _restart_and_stop(oll.url, path)
    records = whole_lines(path)
    print(
        f"\nSIGKILL: 3 kills, file sizes {killed_at}, {len(records)} whole records, "
        f"{partial} cut mid-write"
    )
    seen: set[str] = set()
    for rec in records:
        body = rec["request"]["body"]
        if body is None:
            continue
        h = _user_hash(body["messages"][-1]["content"])
        assert h in sent_all and h not in seen
        seen.add(h)


def _kill_mid_write(proxy: Mitmdump, path: Path, timeout: float) -> bool:
    """SIGKILL the proxy while the file does not end with a newline (a write in progress)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proxy.running:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                proxy.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                proxy.proc.wait(10)  # type: ignore[union-attr]
                return not path.read_bytes().endswith(b"\n")
        return False
    finally:
        os.close(fd)


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_record_write(llama: Upstream, tmp_path: Path) -> None:
    """Kill -9 exactly while a 6 MB record is being written: the file may end with the
    start of that record, and the next recorder on the file must leave only whole lines
    (it cuts the dead record off rather than closing it into a bad line)."""
    path = tmp_path / "cut.jsonl"
    caught = False
    for _attempt in range(3):
        proxy = Mitmdump(llama.url, path, {"llmp_body": "full"}).start()
        big = threading.Thread(
            target=_stream_raw_direct,
            args=(proxy.url, "events=6000,token_chars=1000"),
            daemon=True,
        )
        try:
            n = len(_after_kill(path)[0]) if path.exists() else 0
            httpx.get(proxy.url + "/health", timeout=30)
            wait_record(path, lambda r: True, n=n + 1)
            big.start()
            caught = _kill_mid_write(proxy, path, timeout=60)
        finally:
            proxy.close()
            big.join(30)
        if caught:
            break
    if not caught:
        pytest.skip("could not catch the proxy in the middle of a record write")
    records, tail = _after_kill(path)
    print(f"\nSIGKILL mid-write: {len(tail)} bytes of the record were on disk")
    assert records and tail
    _restart_and_stop(llama.url, path)
    kept = path.read_bytes().count(tail[:80])
    assert kept == 0, (
        f"the record cut by the kill ({len(tail)} bytes, {tail[:60]!r}...) was kept "
        "in the file as a bad line, closed with a newline by the next recorder"
    )
    whole_lines(path)


def _stream_raw_direct(url: str, fake: str) -> None:
    body = _body("llama")
    try:
        with httpx.Client(timeout=120) as client:
            client.post(url + "/v1/chat/completions", json=body, headers={"x-fake": fake})
    except httpx.HTTPError:
        pass
