"""`llmp proxy` end to end: the real console script, real clients, fake upstreams.

Every proxy runs as a subprocess with its output in files (a full pipe would
block mitmproxy's loop). The port comes from the printed `OPENAI_BASE_URL=`
(or `HTTPS_PROXY=`) line, since the proxies listen on port 0.
"""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from llmp.recorder import options as llmp_options
from llmp.recorder import proxy
from tests.support.mitm import Mitmdump, MitmdumpError, read_records
from tests.support.proxy import LLMP, LlmpProxy
from tests.support.upstreams import Upstream

READY = "llmp: recording to"


def run_llmp(args: Sequence[str], cwd: Path, timeout: float = 30.0) -> tuple[int, str, str]:
    """Run `llmp proxy ARGS` to completion; output through files, never a pipe."""
    out_path, err_path = cwd / "run.out", cwd / "run.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        rc = subprocess.run(
            [str(LLMP), "proxy", *args],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            timeout=timeout,
        ).returncode
    return rc, out_path.read_text(), err_path.read_text()


@pytest.fixture(scope="module")
def confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mitmproxy CA for the module: generating it costs a fraction of a second per start."""
    return tmp_path_factory.mktemp("mitmconf")


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


@pytest.fixture
def ollama_up() -> Iterator[Upstream]:
    with Upstream("ollama") as up:
        yield up


def oai(base: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10, **kwargs)


def sse_content(data: list[str]) -> str:
    """The content the upstream streamed, from its own log."""
    text = ""
    for item in data:
        if item == "[DONE]":
            continue
        for choice in json.loads(item).get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
    return text


def assert_private(path: Path) -> None:
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def assert_clean_exit(px: LlmpProxy, rc: int, n: int, rec: Path) -> None:
    assert rc == 0, px.stdout() + px.stderr()
    assert f"llmp: wrote {n} records to {rec}" in px.stdout().splitlines()[-1]
    assert "Traceback" not in px.stdout() + px.stderr()


# -- the proxy in front of llama-server and Ollama ------------------------------


@pytest.mark.e2e
def test_openai_client_digest_mode_sigint(llama: Upstream, tmp_path: Path, confdir: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    args = ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(rec)]
    with LlmpProxy(args, tmp_path, confdir) as px:
        out = px.stdout()
        assert f"OLLAMA_HOST={px.url}\n" in out
        assert px.url.startswith("http://127.0.0.1:") and px.port > 0
        assert f"Recording to {rec} (digest" in out
        assert out.count("OPENAI_BASE_URL=") == 1
        assert READY in out

        client = oai(px.url)
        messages: Any = [{"role": "user", "content": "hi there"}]
        stream = client.chat.completions.create(model="smol", messages=messages, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        plain = client.chat.completions.create(model="smol", messages=messages)
        ups = llama.wait_for_requests(2)
        rc = px.stop(signal.SIGINT)

    assert streamed == llama.reply == sse_content(ups[0].sse_data())
    assert plain.choices[0].message.content == llama.reply
    assert_clean_exit(px, rc, 2, rec)
    assert_private(rec)
    records = read_records(rec)
    assert [r["id"] for r in records] == [1, 2]
    for r, is_stream in zip(records, (True, False), strict=True):
        assert r["request"]["path"] == "/v1/chat/completions"
        assert r["error"] is None
        assert r["response"]["status"] == 200
        assert r["request"]["digest"] is not None and r["response"]["digest"] is not None
        assert r["request"]["body"] is None and r["response"]["body"] is None
        assert "authorization" not in r["request"]["headers"]
        if is_stream:
            assert r["response"]["stream"] == "sse"
            assert r["response"]["chunks"] > 0
        else:
            assert r["response"]["stream"] is None


@pytest.mark.e2e
def test_ollama_client_full_mode_sigterm(
    ollama_up: Upstream, tmp_path: Path, confdir: Path
) -> None:
    rec = tmp_path / "rec.jsonl"
    args = ["--upstream", ollama_up.url, "--listen", "127.0.0.1:0", "--out", str(rec), "--full"]
    args += ["--limit", "2M", "--connect-timeout", "2.5"]
    with LlmpProxy(args, tmp_path, confdir) as px:
        assert "(full bodies" in px.stdout()
        assert "(full mode, limit 2097152 bytes, connect timeout 2.5 s)" in px.stdout()
        client = ollama.Client(host=px.url, timeout=10)
        messages = [{"role": "user", "content": "hi there"}]
        parts = client.chat(model="smol", messages=messages, stream=True)
        streamed = "".join(p.message.content or "" for p in parts)
        plain = client.chat(model="smol", messages=messages)
        ollama_up.wait_for_requests(2)
        rc = px.stop(signal.SIGTERM)

    assert streamed == ollama_up.reply == plain.message.content
    assert_clean_exit(px, rc, 2, rec)
    assert_private(rec)
    records = read_records(rec)
    assert len(records) == 2
    for r, is_stream in zip(records, (True, False), strict=True):
        assert r["request"]["path"] == "/api/chat"
        assert r["response"]["status"] == 200
        assert r["request"]["body"]["messages"] == messages
        assert r["response"]["body"]["message"]["content"] == ollama_up.reply
        assert r["request"]["digest"] is None
        if is_stream:
            assert r["response"]["stream"] == "ndjson"
            assert r["response"]["chunks"] > 0
        else:
            assert r["response"]["stream"] is None


@pytest.mark.e2e
def test_stop_mid_stream_writes_the_exchange(
    llama: Upstream, tmp_path: Path, confdir: Path
) -> None:
    """SIGTERM with a stream in flight: exit 0, and the partial exchange is on file."""
    rec = tmp_path / "rec.jsonl"
    args = ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(rec)]
    got_first = threading.Event()
    errors: list[BaseException] = []

    def client(url: str) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        try:
            with httpx.Client(timeout=30) as c:
                headers = {"x-fake": "hang_midstream,error_after=2"}
                with c.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    for _ in r.iter_raw():
                        got_first.set()
        except httpx.HTTPError as exc:  # the proxy going away cuts the stream
            errors.append(exc)

    with LlmpProxy(args, tmp_path, confdir) as px:
        t = threading.Thread(target=client, args=(px.url,), daemon=True)
        t.start()
        assert got_first.wait(10)
        started = time.monotonic()
        rc = px.stop(signal.SIGTERM)
        assert time.monotonic() - started < 10
        t.join(10)

    assert_clean_exit(px, rc, 1, rec)
    [r] = read_records(rec)
    assert r["error"] == "upstream_reset"
    assert r["response"]["status"] == 200
    assert r["response"]["body_bytes"] > 0


# -- where it listens -------------------------------------------------------------


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on `port`, from /proc/net/tcp (IPv4)."""
    found: list[str] = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        addr_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.append(socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]))
    return found


def _non_loopback_ip() -> str | None:
    candidates: set[str] = set()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent
            candidates.add(s.getsockname()[0])
    except OSError:
        pass
    try:
        candidates.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    for ip in sorted(candidates):
        if not ip.startswith("127.") and ip != "0.0.0.0":
            return ip
    return None


@pytest.mark.e2e
def test_listens_on_loopback_only_by_default(
    llama: Upstream, tmp_path: Path, confdir: Path
) -> None:
    """`--listen 0` gives only the port: the host stays the loopback default."""
    assert proxy.DEFAULT_LISTEN.startswith("127.0.0.1:")
    args = ["--upstream", llama.url, "--listen", "0", "--out", str(tmp_path / "r.jsonl")]
    with LlmpProxy(args, tmp_path, confdir) as px:
        assert px.url.startswith("http://127.0.0.1:")
        assert "WARNING" not in px.stdout()
        if Path("/proc/net/tcp").exists():
            assert _listening_addresses(px.port) == ["127.0.0.1"]
        ip = _non_loopback_ip()
        if ip is not None:
            with pytest.raises(OSError):
                socket.create_connection((ip, px.port), timeout=2).close()
        with httpx.Client(timeout=5) as c:  # loopback itself works
            assert c.get(px.url + "/health").status_code == 200
        assert px.stop() == 0


@pytest.mark.e2e
def test_listen_on_all_interfaces_warns(llama: Upstream, tmp_path: Path, confdir: Path) -> None:
    args = ["--upstream", llama.url, "--listen", "0.0.0.0:0", "--out", str(tmp_path / "r.jsonl")]
    with LlmpProxy(args, tmp_path, confdir) as px:
        warnings = [ln for ln in px.stdout().splitlines() if ln.startswith("WARNING")]
        assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "anyone" in warnings[0]
        assert px.url.startswith("http://127.0.0.1:")  # what a local client uses
        assert px.stop() == 0


# -- forward mode -----------------------------------------------------------------


@pytest.mark.e2e
def test_forward_mode(llama: Upstream, tmp_path: Path, confdir: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    args = ["--forward", "--listen", "127.0.0.1:0", "--out", str(rec)]
    with LlmpProxy(args, tmp_path, confdir) as px:
        out = px.stdout()
        ca = confdir / "mitmproxy-ca-cert.pem"
        assert f"HTTP_PROXY={px.url}\n" in out
        assert "OPENAI_BASE_URL" not in out
        for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
            assert f"{var}={ca}" in out
        assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")

        client = oai(llama.url, http_client=httpx.Client(proxy=px.url, timeout=10))
        reply = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        llama.wait_for_requests(1)
        rc = px.stop()

    assert text == llama.reply
    assert_clean_exit(px, rc, 1, rec)
    [r] = read_records(rec)
    assert r["request"]["path"] == "/v1/chat/completions"
    assert r["response"]["stream"] == "sse" and r["response"]["chunks"] > 0


# -- alongside mitmdump -s addon/llmp_addon.py --------------------------------------


@pytest.mark.e2e
def test_mitmdump_addon_alongside(llama: Upstream, tmp_path: Path, confdir: Path) -> None:
    """Same addon, same option names: both record the same exchange the same way,
    and neither takes the other's file."""
    md_rec, px_rec = tmp_path / "md.jsonl", tmp_path / "px.jsonl"
    md_opts = {"llmp_body": "digest", "llmp_limit": "1048576"}
    px_args = ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(px_rec)]
    px_args += ["--limit", "1M"]
    with (
        Mitmdump(llama.url, md_rec, md_opts, record_option="llmp_file") as md,
        LlmpProxy(px_args, tmp_path / "px", confdir) as px,
    ):
        messages: Any = [{"role": "user", "content": "same question"}]
        for base in (md.url, px.url):
            oai(base).chat.completions.create(model="smol", messages=messages)
        llama.wait_for_requests(2)

        # A second recorder on a file in use is refused, in one line.
        rc, out, err = run_llmp(
            ["--upstream", llama.url, "--listen", "127.0.0.1:0", "--out", str(md_rec)],
            tmp_path,
        )
        assert rc != 0 and out == ""
        assert err.count("\n") == 1 and "in use by another recorder" in err and "--out" in err

        assert px.stop() == 0
        assert md.stop() == 0

    [m] = read_records(md_rec)
    [p] = read_records(px_rec)
    assert m["request"]["digest"] == p["request"]["digest"] is not None
    assert m["response"]["digest"].keys() == p["response"]["digest"].keys()
    for key in ("status", "stream", "chunks"):
        assert m["response"][key] == p["response"][key]


@pytest.mark.e2e
def test_mitmdump_sets_connect_timeout(llama: Upstream, tmp_path: Path) -> None:
    """Every shared option can be given to mitmdump with --set (no float-typed options)."""
    opts = {"llmp_connect_timeout": "5", "llmp_limit": "1048576", "llmp_body": "full"}
    with Mitmdump(llama.url, tmp_path / "md.jsonl", opts, record_option="llmp_file") as md:
        assert "connect timeout 5 s" in md.log_text()
        assert md.stop() == 0


@pytest.mark.e2e
def test_mitmdump_bad_file_stops_with_the_reason(llama: Upstream, tmp_path: Path) -> None:
    """The addon's own check, under mitmdump: it stops at startup and says why."""
    bad = tmp_path / "missing" / "md.jsonl"
    md = Mitmdump(llama.url, bad, record_option="llmp_file", timeout=15)
    with pytest.raises(MitmdumpError):
        md.start()
    log = md.log_text()
    md.close()
    assert md.returncode not in (None, 0)
    assert f"cannot open recording '{bad}'" in log
    assert "RecursionError" not in log and len(log.splitlines()) < 40


# -- bad options ------------------------------------------------------------------

BAD_ARGS: list[tuple[list[str], str]] = [
    ([], "--upstream is required"),
    (["--upstream", "ftp://127.0.0.1:8080"], "http://"),
    (["--upstream", "http://127.0.0.1:8080/v1"], "without a path"),
    (["--upstream", "http://"], "no host"),
    (["--upstream", "http://127.0.0.1:99999"], "not a valid URL"),
    (["--forward", "--upstream", "http://127.0.0.1:8080"], "don't go together"),
    (["--upstream", "127.0.0.1:8080", "--listen", "nonsense"], "HOST:PORT"),
    (["--upstream", "127.0.0.1:8080", "--listen", "127.0.0.1:70000"], "0 to 65535"),
    (["--upstream", "127.0.0.1:8080", "--listen", "example.com:0"], "IP address"),
    (["--upstream", "127.0.0.1:8080", "--listen", "192.0.2.1:0"], "cannot listen"),
    (["--upstream", "127.0.0.1:8080", "--limit", "0"], "--limit"),
    (["--upstream", "127.0.0.1:8080", "--limit", "lots"], "--limit"),
    (["--upstream", "127.0.0.1:8080", "--connect-timeout", "-1"], "--connect-timeout"),
    (["--upstream", "127.0.0.1:8081", "--listen", "127.0.0.1:8081"], "loop"),
    (["--upstream", "127.0.0.1:8080", "--listen", "0", "--out", "/nonexistent/x.jsonl"], "open"),
    (["--upstream", "127.0.0.1:8080", "--listen", "0", "--out", "."], "Is a directory"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("args", "reason"), BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_options_exit_with_one_line(
    args: list[str], reason: str, tmp_path: Path, confdir: Path
) -> None:
    rc, out, err = run_llmp([*args, "--confdir", str(confdir)], tmp_path)
    assert rc != 0
    assert out == ""
    assert err.startswith("llmp proxy: ") and err.count("\n") == 1, err
    assert reason in err
    assert not list(tmp_path.glob("llmp-*.jsonl"))  # no default recording left behind


@pytest.mark.e2e
def test_port_in_use(tmp_path: Path, confdir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out, err = run_llmp(
            [
                "--upstream",
                "127.0.0.1:8080",
                "--listen",
                f"127.0.0.1:{port}",
                "--confdir",
                str(confdir),
            ],
            tmp_path,
        )
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and "cannot listen" in err


# -- flag parsing, in process -------------------------------------------------------


def test_flags_map_onto_the_one_options_table() -> None:
    assert set(proxy.FLAG_FOR_OPTION) == {spec.name for spec in llmp_options.OPTIONS}


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
        ("127.0.0.1:11434", "http://127.0.0.1:11434"),
        ("https://models.example:443", "https://models.example:443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://localhost", "http://localhost"),
    ],
)
def test_parse_upstream(text: str, url: str) -> None:
    assert proxy.parse_upstream(text) == url


@pytest.mark.parametrize(
    ("text", "addr"),
    [
        ("127.0.0.1:8081", ("127.0.0.1", 8081)),
        ("0", ("127.0.0.1", 0)),
        ("localhost:9000", ("127.0.0.1", 9000)),
        ("0.0.0.0:8081", ("0.0.0.0", 8081)),
        ("[::1]:8081", ("::1", 8081)),
    ],
)
def test_parse_listen(text: str, addr: tuple[str, int]) -> None:
    assert proxy.parse_listen(text) == addr


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1 << 20),
        ("32M", 32 << 20),
        ("32MiB", 32 << 20),
        ("64k", 64 << 10),
        ("1G", 1 << 30),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert proxy.parse_size(text) == size


def test_flag_names_in_shared_messages() -> None:
    msg = "recording 'x' is in use by another recorder; choose another file with llmp_file"
    assert proxy._flagify(msg).endswith("with --out")


def test_rotate_flag_sets_the_option_and_run_has_none() -> None:
    from llmp.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["proxy", "--upstream", "127.0.0.1:8080", "--rotate", "daily"])
    assert proxy.build_config(args).settings.rotate == "daily"
    args = parser.parse_args(["proxy", "--upstream", "127.0.0.1:8080"])
    assert proxy.build_config(args).settings.rotate == ""
    with pytest.raises(SystemExit):  # one file per `llmp run`: its report is of that file
        parser.parse_args(["run", "--rotate", "daily", "--", "true"])
