"""What a recording keeps of a cloud provider's exchange (R34, R35, R37), end to end.

The real mitmdump with the llmp addon, the real `anthropic` and `openai` SDKs, and a
local upstream that answers as Anthropic's and OpenAI's APIs do
(`tests.support.provider_bodies`: their bodies checked by the SDKs' own models,
their response headers, OpenAI's echo of the request, Anthropic's diagnosis).  The
record must say where the request went (`request.upstream`, as mitmproxy resolved it
in reverse mode and in forward mode, with and without CONNECT), keep R34's headers by
their rules, carry R35's `cache` digest, and hold no message text and no account.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmp.apis import api_for
from llmp.format.canonical import hash_bytes
from tests.support.hardening import RawUpstream
from tests.support.mitm import Mitmdump
from tests.support.provider_bodies import (
    ANTHROPIC_REQUEST_ID,
    OPENAI_REQUEST_ID,
    provider_handler,
)
from tests.support.sdk_chain import check_digests, completed, records

pytestmark = pytest.mark.e2e

MARK = "PRVDRQ"
SECRET = "acct-9Xk2"
EPHEMERAL: Any = {"type": "ephemeral"}


def m(what: str) -> str:
    return f"{MARK}-{what} words a person wrote"


def tag(value: str) -> str:
    return "fnv1a:" + hash_bytes(value.encode())


@pytest.fixture(scope="module")
def provider() -> Iterator[RawUpstream]:
    with RawUpstream(provider_handler(m, SECRET)) as up:
        yield up


def _anthropic_calls(client: anthropic.Anthropic) -> None:
    """Claude Code's shape: system blocks and the last block marked, a 1-hour entry,
    thinking, a beta header; once whole, once streamed."""
    kwargs: Any = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.7c2;"},
            {"type": "text", "text": m("system"), "cache_control": {**EPHEMERAL, "ttl": "1h"}},
        ],
        "tools": [
            {
                "name": "Read",
                "description": m("tool"),
                "input_schema": {"type": "object"},
                "cache_control": EPHEMERAL,
            }
        ],
        "messages": [
            {"role": "user", "content": m("question")},
            {"role": "assistant", "content": [{"type": "text", "text": m("answer")}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": m("a")},
                    {"type": "text", "text": m("b"), "cache_control": EPHEMERAL},
                ],
            },
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_headers": {"anthropic-beta": "cache-diagnosis-2026-04-07"},
    }
    msg = client.messages.create(**kwargs)
    assert msg.diagnostics is not None and msg.content[1].text == m("text")
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_text() == m("streamed-text")


def _openai_calls(client: openai.OpenAI) -> None:
    """Codex's shape with GPT-5.6's cache fields, once whole, once streamed; and a chat
    completion whose usage comes only because the request asked for it."""
    kwargs: Any = {
        "model": "gpt-5.6",
        "instructions": m("instructions"),
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": m("input"),
                        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"},
                    }
                ],
            }
        ],
        "reasoning": {"effort": "high"},
        "text": {"verbosity": "low"},
        "prompt_cache_key": m("cache-key"),
        "extra_body": {
            "prompt_cache_options": {
                "mode": "explicit",
                "ttl": "30m",
                "comparison_response_id": "resp_08",
            }
        },
    }
    response = client.responses.create(**kwargs)
    assert response.output_text == m("reply")
    assert completed(client.responses.create(stream=True, **kwargs)).id == "resp_0a1b2c"
    chunks = list(
        client.chat.completions.create(
            model="gpt-5.6",
            messages=[{"role": "user", "content": m("chat-question")}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 2048


def _check_clean(path: Path) -> None:
    text = path.read_text()
    assert MARK not in text, text[max(0, text.find(MARK) - 300) : text.find(MARK) + 100]
    assert SECRET not in text


def _check_anthropic(rec: dict[str, Any], streamed: bool) -> None:
    headers = rec["response"]["headers"]
    assert headers["request-id"] == ANTHROPIC_REQUEST_ID
    assert headers["anthropic-organization-id"] == tag(f"org-{SECRET}")
    assert headers["anthropic-workspace-id"] == tag(f"wrkspc-{SECRET}")
    assert headers["anthropic-ratelimit-tokens-remaining"] == ""
    assert headers["anthropic-ratelimit-requests-reset"] == ""
    assert "cf-ray" not in headers and "set-cookie" not in headers
    assert rec["request"]["headers"]["anthropic-beta"] == "cache-diagnosis-2026-04-07"
    assert rec["request"]["added"] is None
    cache = rec["request"]["digest"]["cache"]
    assert cache["breakpoints"] == [
        {"at": "tools", "index": 0, "block": 0, "ttl": None},
        {"at": "messages", "index": 1, "block": 0, "ttl": "1h"},
        {"at": "messages", "index": 4, "block": 1, "ttl": None},
    ]
    assert cache["blocks"] == [1, 1, 1, 1, 2]
    assert cache["settings"]["thinking"] == tag('{"budget_tokens":1024,"type":"enabled"}')
    usage = rec["response"]["digest"]["usage"]
    assert usage["diagnostics"] == {
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 4096}
    }
    assert usage["usage"]["cache_read_input_tokens"] == 2048
    assert (rec["response"]["stream"] == "sse") is streamed


def _check_openai(rec: dict[str, Any]) -> None:
    headers = rec["response"]["headers"]
    assert headers["x-request-id"] == OPENAI_REQUEST_ID
    assert headers["openai-processing-ms"] == "412" and headers["openai-version"] == "2020-10-01"
    assert headers["openai-organization"] == tag(f"user-{SECRET}")
    assert headers["openai-project"] == tag(f"proj_{SECRET}")
    assert "x-ratelimit-remaining-tokens" not in headers
    cache = rec["request"]["digest"]["cache"]
    if rec["request"]["path"].endswith("/responses"):
        assert cache["breakpoints"] == [{"at": "messages", "index": 1, "block": 0, "ttl": "30m"}]
        assert cache["blocks"] == [1, 1]
        assert cache["key"] == tag(m("cache-key"))
        assert cache["options"] == {"mode": "explicit", "ttl": "30m", "comparison": True}
        assert cache["settings"]["reasoning_effort"] == "high"
        assert cache["settings"]["verbosity"] == "low"
        usage = rec["response"]["digest"]["usage"]
        assert usage["prompt_cache_key"] == tag(m("cache-key"))
        assert usage["prompt_cache_diagnostics"]["reason"] == "tools_changed"
        assert usage["text"] == {"verbosity": "low", "format": {"type": "json_schema"}}
        assert not {"instructions", "tools", "metadata", "user", "prompt"} & set(usage)
    else:
        assert cache["include_usage"] is True
        usage = rec["response"]["digest"]["usage"]["usage"]
        assert usage["cost"] == 0.0042 and usage["cache_discount"] == 0.0011


def test_reverse_mode_through_two_recorders(provider: RawUpstream, tmp_path: Path) -> None:
    """A digest recorder in front of a full one in front of the provider: the full one
    went to `localhost` (its reverse target, while the client's Host said 127.0.0.1),
    the digest one to 127.0.0.1; the digests are those of the full bodies."""
    digest, full = tmp_path / "digest.jsonl", tmp_path / "full.jsonl"
    target = f"http://localhost:{provider.port}"
    with Mitmdump(target, full, {"llmp_body": "full"}, log_path=tmp_path / "full.log") as back:
        with Mitmdump(back.url, digest, {"llmp_body": "digest"}, log_path=tmp_path / "d.log") as md:
            _anthropic_calls(anthropic.Anthropic(base_url=md.url, api_key=SECRET, max_retries=0))
            _openai_calls(openai.OpenAI(base_url=md.url + "/v1", api_key=SECRET, max_retries=0))
            got = records(digest, 5)
            want = records(full, 5)
    assert [r["request"]["upstream"] for r in got] == ["127.0.0.1"] * 5
    assert [r["request"]["upstream"] for r in want] == ["localhost"] * 5
    check_digests(got, want)
    for rec in got:
        assert api_for(rec["request"]["method"], rec["request"]["path"]) is not None
        if rec["request"]["path"].startswith("/v1/messages"):
            _check_anthropic(rec, streamed=rec["id"] == 2)
        else:
            _check_openai(rec)
    _check_clean(digest)
    assert SECRET not in full.read_text()  # full mode keeps text, never an account or a key


def _self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_forward_mode_with_and_without_connect(tmp_path: Path) -> None:
    """Forward mode: the requested host, for plain HTTP (absolute-form) and for HTTPS
    through CONNECT, where mitmproxy answers the TLS itself."""
    cert, key = _self_signed()
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    path = tmp_path / "forward.jsonl"
    with (
        RawUpstream(provider_handler(m, SECRET), tls=server) as https_up,
        RawUpstream(provider_handler(m, SECRET)) as http_up,
        Mitmdump(None, path, {"ssl_insecure": "true"}, mode="regular") as md,
    ):
        trust = ssl.create_default_context(cafile=str(md.confdir / "mitmproxy-ca-cert.pem"))
        # Each SDK with its own HTTP client (the SDK's package), through the proxy.
        a_http = anthropic.DefaultHttpxClient(proxy=md.url, verify=trust, trust_env=False)
        o_http = openai.DefaultHttpxClient(proxy=md.url, verify=trust, trust_env=False)
        with a_http, o_http:
            _anthropic_calls(
                anthropic.Anthropic(
                    base_url=f"https://localhost:{https_up.port}",
                    api_key=SECRET,
                    max_retries=0,
                    http_client=a_http,
                )
            )
            _openai_calls(
                openai.OpenAI(
                    base_url=f"http://localhost:{http_up.port}/v1",
                    api_key=SECRET,
                    max_retries=0,
                    http_client=o_http,
                )
            )
        got = records(path, 5)
    assert [r["request"]["upstream"] for r in got] == ["localhost"] * 5
    assert [r["request"]["path"] for r in got][:2] == ["/v1/messages", "/v1/messages"]
    for rec in got[:2]:
        _check_anthropic(rec, streamed=rec["id"] == 2)
    for rec in got[2:]:
        _check_openai(rec)
    _check_clean(path)
