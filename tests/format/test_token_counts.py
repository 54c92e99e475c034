"""`--tokenize`: counts from a server's /tokenize, spliced into the recording in place.

A tiny stdlib HTTP server in a thread plays llama-server's `/tokenize` (one
token per started 3 bytes of UTF-8), and records what it was asked.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.apis import openai_chat as digest
from llmp.apis import record_targets
from llmp.format import canonical
from llmp.format import token_counts as tokenize
from llmp.format.token_counts import TokenizeError, normalize_url

ROOT = Path(__file__).resolve().parents[2]


def enrich_file(path: Path, url: str, **kwargs: Any) -> tokenize.EnrichResult:
    """The enrichment as `llmp analyze --tokenize` runs it: targets from the API modules."""
    return tokenize.enrich_file(path, url, targets=record_targets, **kwargs)


count_targets = digest.OpenAIChat().count_targets


def fake_count(text: str) -> int:
    """The fake server's tokenizer: one token per started 3 bytes."""
    return -(-len(text.encode("utf-8")) // 3)


# --------------------------------------------------------------------------- fake server


class _QuietServer(http.server.ThreadingHTTPServer):
    """A fake tokenizer whose client may hang up first (a timeout under test): its
    handler's write then fails, which is no error of the test's (socketserver would
    print the traceback into the test run's output)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeServer:
    """`POST /tokenize` like llama-server, with switchable misbehaviour."""

    def __init__(self) -> None:
        self.status = 200  # answer every request with this status
        self.fail_first = 0  # answer the first N requests with 503
        self.sleep = 0.0  # hold each answer this long (interrupted by close)
        self.raw_body: bytes | None = None  # answer 200 with this body instead
        self.vllm = False  # take vLLM's request shape ({"prompt"}), refuse llama-server's
        self.payloads: list[dict[str, Any]] = []
        self.got_request = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                data = self.rfile.read(length)
                if self.path != "/tokenize" or server.status == 404:
                    self._send(404, b"404 page not found")
                    return
                payload = json.loads(data)
                with server._lock:
                    server.payloads.append(payload)
                    n = len(server.payloads)
                server.got_request.set()
                if server.sleep:
                    server._release.wait(server.sleep)
                if n <= server.fail_first:
                    self._send(503, b'{"error":{"code":503,"message":"Loading model"}}')
                    return
                if server.status != 200:
                    self._send(server.status, b'{"error":"nope"}')
                    return
                if server.raw_body is not None:
                    self._send(200, server.raw_body)
                    return
                if server.vllm:
                    if "prompt" not in payload:  # vLLM's validation error, shortened
                        self._send(400, b'{"error":{"message":"body.prompt: Field required"}}')
                        return
                    n = fake_count(payload["prompt"])
                    reply = {"count": n, "max_model_len": 4096, "tokens": list(range(n))}
                    self._send(200, json.dumps(reply).encode())
                    return
                tokens = list(range(fake_count(payload["content"])))
                self._send(200, json.dumps({"tokens": tokens}).encode())

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def contents(self) -> list[str]:
        with self._lock:
            key = "prompt" if self.vllm else "content"
            return [p[key] for p in self.payloads if key in p]

    def close(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- recordings

TOOL_READ = (
    '{"type":"function","function":{"name":"read_file","description":"Read a file \\u00e9",'
    '"parameters":{"type":"object","properties":{"path":{"type":"string"},'
    '"temperature":{"type":"number","default":0.70,"maximum":1E5}}}}}'
)
TOOL_WRITE = '{"type":"function","function":{"name":"write_file","parameters":{}}}'


def record_line(
    rid: int,
    body: Any,
    *,
    digest_value: Any = None,
    path: str = "/v1/chat/completions",
) -> bytes:
    """A record laid out as the recorder writes it: compact, `"tokens":null` last."""
    record = {
        "v": 1,
        "id": rid,
        "conn": 1,
        "t_start_ms": 1_788_595_135_000 + rid,
        "t_first_byte_ms": None,
        "t_end_ms": 1_788_595_136_000 + rid,
        "request": {
            "method": "POST",
            "path": path,
            "headers": {"content-type": "application/json"},
            "body_bytes": 100,
            "body": body,
            "body_text": None,
            "digest": digest_value,
        },
        "response": None,
        "error": None,
        "tokens": None,
    }
    return canonical.record_dumps(record)


class Fixture:
    """A recording with every kind of line; enriched lines are (prefix, old tokens, suffix)."""

    def __init__(self, directory: Path) -> None:
        body_a = canonical.loads(
            '{"model":"m","temperature":0.70,"messages":['
            '{"role":"system","content":"You are a careful coding agent."},'
            '{"role":"user","content":"Fix the bug in main.py please"}],'
            f'"tools":[{TOOL_READ}]}}'
        )
        line_a = record_line(1, body_a)
        assert line_a.endswith(b',"tokens":null}')
        digest_body = digest.OpenAIChat().request_digest(body_a)
        line_digest = record_line(2, None, digest_value=digest_body)
        # Hand-written: odd spacing, `tokens` first and already set, escapes,
        # number text, a "tokens" key inside a string and inside the body.
        b_prefix = b'{ "v" : 1 , "tokens" : '
        b_old = b'{"messages":{"old":5},"tools":{}}'
        b_suffix = (
            b' , "id":3,"conn":1,"t_start_ms":1788595135003,"t_first_byte_ms":null,'
            b'"t_end_ms":1788595136003,"request":{"method":"POST","path":"/v1/chat/completions",'
            b'"headers":{},"body_bytes":1,"body":{"model":"m","top_p":1E5,"tokens":[1,2],'
            b'"messages":[{"role":"system","content":"You are a careful coding agent."},'
            b'{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 \\"tokens\\": {x} \\/ 0.70"},'
            b'{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",'
            b'"function":{"name":"read_file","arguments":"{\\"path\\":\\"main.py\\"}"}}]},'
            b'{"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"x = 1.50"},'
            b'{"type":"image_url","image_url":{"url":"data:"}}]}],'
            b'"tools":[' + TOOL_READ.encode() + b"," + TOOL_WRITE.encode() + b"]},"
            b'"body_text":null,"digest":null},"response":null,"error":null }   '
        )
        body_c = canonical.loads(
            '{"messages":[{"role":"user","content":""},'
            '{"role":"system","content":"You are a careful coding agent."},'
            '{"role":"user","content":"Fix the bug in main.py please"}]}'
        )
        line_c = record_line(4, body_c)
        line_other = record_line(5, None, path="/v1/models")
        body_d = canonical.loads(
            '{"messages":[{"role":"user","content":"last line, no newline, no tokens key"}]}'
        )
        line_d = record_line(6, body_d)
        assert line_d.endswith(b',"tokens":null}')
        line_d = line_d[: -len(b',"tokens":null}')] + b"}"

        # (bytes, enriched as (prefix, old value, suffix) or None)
        self.lines: list[tuple[bytes, tuple[bytes, bytes, bytes] | None]] = [
            (line_a + b"\n", (line_a[:-5], b"null", b"}\n")),
            (line_digest + b"\n", None),
            (b"{nope\n", None),
            (b"\n", None),
            (b_prefix + b_old + b_suffix + b"\n", (b_prefix, b_old, b_suffix + b"\n")),
            (b"   \n", None),
            (line_c + b"\r\n", (line_c[:-5], b"null", b"}\r\n")),
            (line_other + b"\n", None),
            (b'{"v":2,"id":7}\n', None),
            (line_d, (line_d[:-1], b"", b"}")),
        ]
        self.path = directory / "rec.jsonl"
        self.path.write_bytes(self.original)
        os.chmod(self.path, 0o600)

    @property
    def original(self) -> bytes:
        return b"".join(line for line, _ in self.lines)

    def expected_tokens(self, line: bytes) -> dict[str, dict[str, int]]:
        """Computed straight from the digest functions, not from `count_targets`."""
        body = canonical.loads(line)["request"]["body"]
        messages: dict[str, int] = {}
        for msg in body["messages"]:
            text = digest.message_text(msg)
            messages[digest.message_digest(msg)["hash"]] = fake_count(text) if text else 0
        tools: dict[str, int] = {}
        for tool in body.get("tools", []):
            tools[digest.tool_digest(tool)["hash"]] = fake_count(canonical.dumps(tool).decode())
        return {"messages": messages, "tools": tools}

    def expected_texts(self) -> set[str]:
        texts: set[str] = set()
        for line, plan in self.lines:
            if plan is None:
                continue
            body = canonical.loads(line)["request"]["body"]
            texts.update(digest.message_text(m) for m in body["messages"])
            texts.update(canonical.dumps(t).decode() for t in body.get("tools", []))
        texts.discard("")
        return texts


@pytest.fixture
def fixture(tmp_path: Path) -> Fixture:
    return Fixture(tmp_path)


def check_enriched(fx: Fixture, new: bytes) -> None:
    """Untouched lines byte for byte; enriched lines differ only in the `tokens` value."""
    new_lines = new.splitlines(keepends=True)
    assert len(new_lines) == len(fx.lines)
    for (old, plan), got in zip(fx.lines, new_lines, strict=True):
        if plan is None:
            assert got == old
            continue
        prefix, old_value, suffix = plan
        assert got.startswith(prefix) and got.endswith(suffix), got
        middle = got[len(prefix) : len(got) - len(suffix)]
        if not old_value:  # the key was missing: appended as the last member
            assert middle.startswith(b',"tokens":')
            middle = middle[len(b',"tokens":') :]
        assert json.loads(middle) == fx.expected_tokens(old)
        assert json.loads(got)["tokens"] == fx.expected_tokens(old)


# --------------------------------------------------------------------------- behaviour


def test_counts_match_server_and_other_bytes_unchanged(
    fixture: Fixture, server: FakeServer
) -> None:
    result = enrich_file(fixture.path, server.url + "/v1/", concurrency=3, progress=False)
    check_enriched(fixture, fixture.path.read_bytes())

    contents = server.contents()
    assert Counter(contents).most_common(1)[0][1] == 1, "a text was requested twice"
    assert set(contents) == fixture.expected_texts()
    assert "" not in contents
    for payload in server.payloads:
        assert payload["add_special"] is False
        assert payload["parse_special"] is True
        assert payload["with_pieces"] is False
    # Number text and escapes survive into what is counted (R2).
    tool_text = canonical.dumps(canonical.loads(TOOL_READ)).decode()
    assert '"default":0.70,"maximum":1E5' in tool_text and tool_text in contents
    assert 'café 😀 "tokens": {x} / 0.70' in contents

    assert result.records_enriched == 4
    assert result.skipped_digest_records == 1
    assert result.skipped_other_records == 1
    assert result.bad_lines == 2  # `{nope` and the v2 record
    assert result.distinct_texts == len(fixture.expected_texts())
    assert result.requests == len(contents) and result.retries == 0
    assert result.url == server.url
    assert stat_mode(fixture.path) == 0o600
    assert sorted(os.listdir(fixture.path.parent)) == ["rec.jsonl"]


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_rerun_overwrites_and_is_stable(fixture: Fixture, server: FakeServer) -> None:
    enrich_file(fixture.path, server.url, progress=False)
    first = fixture.path.read_bytes()
    enrich_file(fixture.path, server.url, progress=False)
    assert fixture.path.read_bytes() == first


def test_mode_kept_and_named_temp_fallback(
    fixture: Fixture, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenize, "_USE_O_TMPFILE", False)
    os.chmod(fixture.path, 0o640)
    enrich_file(fixture.path, server.url, progress=False)
    check_enriched(fixture, fixture.path.read_bytes())
    assert stat_mode(fixture.path) == 0o640
    assert sorted(os.listdir(fixture.path.parent)) == ["rec.jsonl"]


def test_symlink_target_is_rewritten(fixture: Fixture, server: FakeServer) -> None:
    link = fixture.path.parent / "link.jsonl"
    link.symlink_to(fixture.path.name)
    enrich_file(link, server.url, progress=False)
    assert link.is_symlink()
    check_enriched(fixture, fixture.path.read_bytes())


def test_count_targets_matches_digests() -> None:
    body = canonical.loads(
        '{"messages":[{"role":"user","content":"hi"},{"role":"user","content":"hi"},'
        '{"role":"assistant","content":"","tool_calls":[{"id":"a","function":'
        '{"name":"f","arguments":"{}"}}]},"junk"],'
        f'"tools":[{TOOL_READ},{TOOL_READ}]}}'
    )
    messages, tools = count_targets(body)
    msgs = body["messages"]
    assert messages == {
        digest.message_digest(msgs[0])["hash"]: "hi",
        digest.message_digest(msgs[2])["hash"]: digest.message_text(msgs[2]),
        digest.message_digest("junk")["hash"]: "",
    }
    tool = body["tools"][0]
    assert tools == {digest.tool_digest(tool)["hash"]: canonical.dumps(tool).decode()}


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
        (" http://127.0.0.1:8080/v1/ ", "http://127.0.0.1:8080"),
        ("http://h:1/tokenize", "http://h:1"),
        ("localhost:8080", "http://localhost:8080"),
        ("https://h/llama/v1", "https://h/llama"),
    ],
)
def test_normalize_url(given: str, base: str) -> None:
    assert normalize_url(given) == base


@pytest.mark.parametrize("bad", ["", "ftp://h/x", "http://"])
def test_normalize_url_rejects(bad: str) -> None:
    with pytest.raises(TokenizeError):
        normalize_url(bad)


# --------------------------------------------------------------------------- splicing


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"a":1,"tokens":null}\n', b'{"a":1,"tokens":V}\n'),
        (
            b'{"tokens":{"x":[1,{"y":"}"}]},"a":"\\"tokens\\":1"}',
            b'{"tokens":V,"a":"\\"tokens\\":1"}',
        ),
        (
            b' { "b" : {"tokens":1} , "tokens" : 7 } \r\n',
            b' { "b" : {"tokens":1} , "tokens" : V } \r\n',
        ),
        (b'{"\\u0074okens":true,"z":-1.5E+3}', b'{"\\u0074okens":V,"z":-1.5E+3}'),
        (b'{"a":[1,2,"]"]}\n', b'{"a":[1,2,"]"],"tokens":V}\n'),
        (b"{}", b'{"tokens":V}'),
        (b'{"s":"\\\\","tokens":"\\\\\\""}', b'{"s":"\\\\","tokens":V}'),
    ],
)
def test_splice_tokens(line: bytes, expected: bytes) -> None:
    assert tokenize._splice_tokens(line, b"V") == expected


def test_repeated_tokens_key_falls_back_to_reserialising() -> None:
    line = b'{"v":1,"tokens":1,"x":0.70,"tokens":2}\n'
    with pytest.raises(tokenize._ScanError):
        tokenize._splice_tokens(line, b"V")
    tokens = {"messages": {"h": 3}, "tools": {}}
    out = tokenize._rewrite_line(line, canonical.record_dumps(tokens), tokens)
    assert out == b'{"v":1,"tokens":{"messages":{"h":3},"tools":{}},"x":0.70}\n'


# --------------------------------------------------------------------------- failures


def assert_untouched(fx: Fixture) -> None:
    assert fx.path.read_bytes() == fx.original
    assert sorted(os.listdir(fx.path.parent)) == ["rec.jsonl"]
    assert stat_mode(fx.path) == 0o600


def test_server_without_tokenize_endpoint(fixture: Fixture, server: FakeServer) -> None:
    server.status = 404
    with pytest.raises(TokenizeError, match="no tokenize endpoint") as info:
        enrich_file(fixture.path, server.url, progress=False)
    message = str(info.value)
    assert "Ollama" in message and "llama-server" in message and "\n" not in message
    assert_untouched(fixture)


def test_server_down(fixture: Fixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TokenizeError, match="cannot connect to") as info:
        enrich_file(fixture.path, url, progress=False, retries=3, backoff=1.0)
    assert url in str(info.value)
    assert time.monotonic() - started < 2, "a refused connection must fail fast"
    assert_untouched(fixture)


def test_digest_only_recording(tmp_path: Path, server: FakeServer) -> None:
    body = canonical.loads('{"messages":[{"role":"user","content":"hi"}]}')
    path = tmp_path / "rec.jsonl"
    data = record_line(1, None, digest_value=digest.OpenAIChat().request_digest(body)) + b"\n"
    path.write_bytes(data)
    with pytest.raises(TokenizeError, match="nothing to count") as info:
        enrich_file(path, server.url, progress=False)
    assert "llmp_body=full" in str(info.value)
    assert path.read_bytes() == data
    assert server.payloads == []
    assert os.listdir(tmp_path) == ["rec.jsonl"]


def test_missing_file(tmp_path: Path, server: FakeServer) -> None:
    with pytest.raises(TokenizeError, match="no such recording"):
        enrich_file(tmp_path / "absent.jsonl", server.url, progress=False)
    assert os.listdir(tmp_path) == []


def test_file_locked_by_a_recorder(fixture: Fixture, server: FakeServer) -> None:
    with open(fixture.path, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(TokenizeError, match="in use by a running recorder"):
            enrich_file(fixture.path, server.url, progress=False)
    assert_untouched(fixture)
    assert server.payloads == []


def test_transient_503_is_retried(fixture: Fixture, server: FakeServer) -> None:
    server.fail_first = 2
    result = enrich_file(fixture.path, server.url, progress=False, backoff=0.01)
    check_enriched(fixture, fixture.path.read_bytes())
    assert result.retries == 2
    assert result.requests == result.distinct_texts + 2


def test_persistent_503_gives_up(fixture: Fixture, server: FakeServer) -> None:
    server.status = 503
    with pytest.raises(TokenizeError, match="kept failing after 3 attempts"):
        enrich_file(fixture.path, server.url, progress=False, retries=2, backoff=0.01)
    assert len(server.payloads) == 3
    assert_untouched(fixture)


def test_not_a_llama_server_reply(fixture: Fixture, server: FakeServer) -> None:
    server.raw_body = b"<html>hello</html>"
    with pytest.raises(TokenizeError, match="did not answer like a /tokenize"):
        enrich_file(fixture.path, server.url, progress=False)
    assert_untouched(fixture)


def test_client_error_is_not_retried(fixture: Fixture, server: FakeServer) -> None:
    """Asked once in llama-server's shape and once in vLLM's, then the error."""
    server.status = 400
    with pytest.raises(TokenizeError, match="HTTP 400"):
        enrich_file(fixture.path, server.url, progress=False, backoff=0.01)
    assert [sorted(p) for p in server.payloads] == [
        ["add_special", "content", "parse_special", "with_pieces"],
        ["add_special_tokens", "prompt"],
    ]
    assert_untouched(fixture)


def test_a_vllm_tokenizer_is_asked_in_its_own_shape(fixture: Fixture, server: FakeServer) -> None:
    """vLLM's (and SGLang's) /tokenize refuses llama-server's request: the first text
    finds that out, and every text is then sent as a prompt, without special tokens."""
    server.vllm = True
    result = enrich_file(fixture.path, server.url, concurrency=3, progress=False)
    check_enriched(fixture, fixture.path.read_bytes())
    first, *rest = server.payloads
    assert "content" in first and "prompt" not in first  # llama-server's, refused
    assert all(p["add_special_tokens"] is False and "model" not in p for p in rest)
    assert set(server.contents()) == fixture.expected_texts()
    assert result.requests == len(fixture.expected_texts()) + 1


def test_keyboard_interrupt_in_a_worker(
    fixture: Fixture, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_post = tokenize.Tokenizer._post
    calls: list[int] = []

    def post(self: Any, payload: bytes) -> httpx.Response:
        calls.append(1)
        if len(calls) == 3:  # past the probe: inside a worker thread
            raise KeyboardInterrupt
        return real_post(self, payload)

    monkeypatch.setattr(tokenize.Tokenizer, "_post", post)
    with pytest.raises(KeyboardInterrupt):
        enrich_file(fixture.path, server.url, concurrency=2, progress=False)
    assert_untouched(fixture)


@pytest.mark.parametrize("o_tmpfile", [True, False])
def test_keyboard_interrupt_while_writing(
    fixture: Fixture, server: FakeServer, monkeypatch: pytest.MonkeyPatch, o_tmpfile: bool
) -> None:
    monkeypatch.setattr(tokenize, "_USE_O_TMPFILE", o_tmpfile and tokenize._USE_O_TMPFILE)
    real = tokenize._rewrite_line
    calls: list[int] = []

    def rewrite(line: bytes, value: bytes, tokens: dict[str, Any]) -> bytes:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(line, value, tokens)

    monkeypatch.setattr(tokenize, "_rewrite_line", rewrite)
    with pytest.raises(KeyboardInterrupt):
        enrich_file(fixture.path, server.url, progress=False)
    assert_untouched(fixture)


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from llmp.apis import record_targets
    from llmp.format import token_counts as tokenize
    if sys.argv[3] == "stall-write":
        real = tokenize._rewrite_line
        def rewrite(line, value, tokens):
            Path(sys.argv[4]).write_text("writing")
            time.sleep(30)
            return real(line, value, tokens)
        tokenize._rewrite_line = rewrite
    tokenize.enrich_file(Path(sys.argv[1]), sys.argv[2], targets=record_targets, progress=False)
    """
)


def run_child(fx: Fixture, url: str, mode: str, flag: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(fx.path), url, mode, str(flag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"child ended early: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("child never got there")
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_while_counting(
    fixture: Fixture, server: FakeServer, tmp_path_factory: pytest.TempPathFactory, sig: int
) -> None:
    server.sleep = 20
    flag = tmp_path_factory.mktemp("flag") / "flag"
    proc = run_child(fixture, server.url, "count", flag)
    wait_for(server.got_request.is_set, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=10)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert_untouched(fixture)


@pytest.mark.skipif(not tokenize._USE_O_TMPFILE, reason="needs O_TMPFILE")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_while_writing(
    fixture: Fixture, server: FakeServer, tmp_path_factory: pytest.TempPathFactory, sig: int
) -> None:
    flag = tmp_path_factory.mktemp("flag") / "flag"
    proc = run_child(fixture, server.url, "stall-write", flag)
    wait_for(flag.exists, proc)
    proc.send_signal(sig)
    proc.communicate(timeout=10)
    assert_untouched(fixture)


# --------------------------------------------------------------------------- real server


SERVER_FLAGS = ("-c", "2048", "-np", "1")


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = os.environ.get("LLMP_LLAMA_SERVER")
    model = os.environ.get("LLMP_LLAMA_MODEL")
    if not binary or not model:
        pytest.skip(
            "LLMP_LLAMA_SERVER and LLMP_LLAMA_MODEL are not set "
            '(eval "$(../shared/tools/real-llama-server --env)")'
        )
    if not shutil.which(binary) and not os.access(binary, os.X_OK):
        pytest.skip(f"LLMP_LLAMA_SERVER={binary} is not executable")
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "wb") as sink:  # a pipe could fill up and stall the server
        proc = subprocess.Popen(
            [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("llama-server not healthy within 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.real_server
def test_counts_equal_real_llama_server(tmp_path: Path, llama_server: str) -> None:
    body = canonical.loads(
        json.dumps(
            {
                "model": "smol",
                "messages": [
                    {"role": "system", "content": "You are a helpful coding assistant."},
                    {"role": "user", "content": "def f(x):\n    return x ** 2  # carré, 平方"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "read_file", "arguments": '{"path":"a.py"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "x = 1<|im_end|>"},
                    {"role": "user", "content": ""},
                ],
            }
        )[:-1]
        + f',"tools":[{TOOL_READ}]}}'
    )
    path = tmp_path / "rec.jsonl"
    path.write_bytes(record_line(1, body) + b"\n" + record_line(2, body) + b"\n")
    result = enrich_file(path, llama_server + "/v1", progress=False)
    assert result.records_enriched == 2

    def real_count(text: str) -> int:
        reply = httpx.post(
            llama_server + "/tokenize",
            json={"content": text, "add_special": False, "parse_special": True},
            timeout=30,
        )
        reply.raise_for_status()
        return len(reply.json()["tokens"])

    messages, tools = count_targets(body)
    expected = {
        "messages": {h: real_count(t) if t else 0 for h, t in messages.items()},
        "tools": {h: real_count(t) for h, t in tools.items()},
    }
    assert all(n > 0 for n in expected["tools"].values())
    for line in path.read_bytes().splitlines():
        assert json.loads(line)["tokens"] == expected


def test_progress_bar_runs(fixture: Fixture, server: FakeServer) -> None:
    enrich_file(fixture.path, server.url, progress=True)
    check_enriched(fixture, fixture.path.read_bytes())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    members=st.dictionaries(st.sampled_from(["v", "id", "tokens", "request", "x"]), json_values),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
    ascii_only=st.booleans(),
    ending=st.sampled_from(["", "\n", "\r\n", " \n"]),
)
def test_splice_matches_parse(
    members: dict[str, Any], separators: tuple[str, str], ascii_only: bool, ending: str
) -> None:
    line = (json.dumps(members, separators=separators, ensure_ascii=ascii_only) + ending).encode()
    out = tokenize._splice_tokens(line, b'{"messages":{},"tools":{}}')
    assert json.loads(out) == {**members, "tokens": {"messages": {}, "tools": {}}}
    if "tokens" in members:
        old = json.dumps(members["tokens"], separators=separators, ensure_ascii=ascii_only)
        assert len(out) - len(line) == len(b'{"messages":{},"tools":{}}') - len(old.encode())
    assert out.endswith(ending.encode())
