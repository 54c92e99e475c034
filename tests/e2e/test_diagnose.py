"""The opt-in provider diagnosis (R37) end to end: the real mitmdump, the real SDKs.

The SDKs talk to their own default hosts (`https://api.anthropic.com`,
`https://api.openai.com/v1`) through mitmdump as a forward proxy, trusting its CA, as
`llmp run` has Claude Code and Codex do.  The recorder sees the provider's host;
only the last hop goes to the fake llama-server's `/v1/messages` and
`/v1/responses`, by a test-only script loaded after it (tests/support/redirect_addon.py).
The fakes' log holds the bytes the "provider" received.
"""

from __future__ import annotations

import gzip
import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmp.apis.providers import facts
from tests.support.mitm import Mitmdump, read_records, wait_for_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

REDIRECT = Path(__file__).resolve().parents[1] / "support" / "redirect_addon.py"
BETA = facts()["anthropic"]["diagnosis_beta"]
SYSTEM: Any = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.7c2; cch=1;"},
    {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
]


@pytest.fixture
def fake() -> Iterator[Upstream]:
    with Upstream("llama", n_ctx=32768) as up:
        yield up


def forward(fake: Upstream, rec: Path, diagnose: bool, body: str = "digest") -> Mitmdump:
    """mitmdump as a forward proxy with the recorder, the providers' hosts sent to `fake`."""
    where = f"127.0.0.1:{fake.port}"
    env = {
        **os.environ,
        "LLMP_TEST_REDIRECT": f"api.anthropic.com={where},api.openai.com={where}",
    }
    options = {"llmp_diagnose": str(diagnose).lower(), "llmp_body": body, "llmp_live": "false"}
    return Mitmdump(None, rec, options, mode="regular", extra_args=["-s", str(REDIRECT)], env=env)


class Sent:
    """The request bodies and headers as the client's HTTP library sent them."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.betas: list[str | None] = []

    def __call__(self, request: Any) -> None:
        self.bodies.append(request.read())
        self.betas.append(request.headers.get("anthropic-beta"))


def proxied(md: Mitmdump, sent: Sent) -> dict[str, Any]:
    """Each SDK's own HTTP client's settings: through the proxy, trusting its CA."""
    ca = ssl.create_default_context(cafile=str(md.confdir / "mitmproxy-ca-cert.pem"))
    return {"proxy": md.url, "verify": ca, "event_hooks": {"request": [sent]}}


def claude(md: Mitmdump, sent: Sent) -> anthropic.Anthropic:
    http = anthropic.DefaultHttpxClient(**proxied(md, sent))
    return anthropic.Anthropic(api_key="sk-ant-secret-1", http_client=http)


def gpt(md: Mitmdump, sent: Sent, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, http_client=openai.DefaultHttpxClient(**proxied(md, sent)))


def say(
    client: anthropic.Anthropic, history: list[Any], text: str, stream: bool
) -> tuple[str, list[Any]]:
    """One turn: the reply's id, and the history with the turn and its reply."""
    messages = [*history, {"role": "user", "content": text}]
    kwargs: Any = {"model": "claude-sonnet-5", "max_tokens": 64, "system": SYSTEM}
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(messages=messages, **kwargs)
    text = "".join(b.text for b in msg.content if b.type == "text")
    reply = {"role": "assistant", "content": [{"type": "text", "text": text}]}
    return msg.id, [*messages, reply]


def received(fake: Upstream, path: str) -> list[Any]:
    return [e for e in fake.log if e.path.split("?")[0] == path]


def test_anthropic_is_asked_with_the_conversations_previous_message(
    fake: Upstream, tmp_path: Path
) -> None:
    rec = tmp_path / "rec.jsonl"
    sent = Sent()
    with forward(fake, rec, diagnose=True, body="full") as md:
        client = claude(md, sent)
        id1, conv = say(client, [], "read calc.py", stream=True)
        id_other, other = say(client, [], "something else", stream=False)
        id2, conv = say(client, conv, "and the tests?", stream=False)
        id3, conv = say(client, conv, "write one", stream=True)
        say(client, other, "go on", stream=True)
        records = wait_for_records(rec, 5)
        assert "llmp: diagnosis on (llmp_diagnose)" in md.log_text()
    got = received(fake, "/v1/messages")
    assert len(got) == 5
    asked = [e.request_json["diagnostics"] for e in got]
    assert asked == [
        {"previous_message_id": None},
        {"previous_message_id": None},
        {"previous_message_id": id1},
        {"previous_message_id": id2},
        {"previous_message_id": id_other},
    ]
    assert len({id1, id2, id3, id_other}) == 4
    for e, body, beta in zip(got, sent.bodies, sent.betas, strict=True):
        # The provider got the client's bytes with the field spliced in, the beta value
        # appended to the client's own list, and a Content-Length that fits.
        assert body != e.request_body and b'"diagnostics"' not in body
        spliced = e.request_body.replace(
            b',"diagnostics":'
            + json.dumps(e.request_json["diagnostics"], separators=(",", ":")).encode(),
            b"",
        )
        assert spliced == body
        assert e.request_header("anthropic-beta") == (f"{beta},{BETA}" if beta else BETA)
        assert e.request_header("content-length") == str(len(e.request_body))
    for r, body in zip(records, sent.bodies, strict=True):
        req = r["request"]
        assert req["added"] == ["diagnostics", "anthropic-beta"]
        assert req["upstream"] == "api.anthropic.com"
        assert req["body"] == json.loads(body)  # the record is of the client's request
        assert req["body_bytes"] == len(body)
        assert r["response"]["status"] == 200 and r["error"] is None
    text = rec.read_text()
    assert "sk-ant-secret-1" not in text and "x-api-key" not in text


def test_without_the_option_not_one_byte_changes(fake: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    sent = Sent()
    with forward(fake, rec, diagnose=False) as md:
        client = claude(md, sent)
        _, conv = say(client, [], "hi", stream=True)
        say(client, conv, "again", stream=False)
        oai = gpt(md, sent, "sk-secret-2")
        turn = oai.responses.create(model="gpt-5.6", input="hi", max_output_tokens=32)
        oai.responses.create(
            model="gpt-5.6",
            input=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": turn.output_text},
                {"role": "user", "content": "again"},
            ],
            max_output_tokens=32,
        )
        records = wait_for_records(rec, 4)
        assert "diagnosis on" not in md.log_text()
    got = [e for e in fake.log if e.method == "POST"]
    assert [e.request_body for e in got] == sent.bodies
    assert [e.request_header("anthropic-beta") for e in got] == sent.betas
    assert all(r["request"]["added"] is None for r in records)
    assert [r["request"]["upstream"] for r in records] == ["api.anthropic.com"] * 2 + [
        "api.openai.com"
    ] * 2


def responses_turn(
    client: openai.OpenAI, model: str, history: list[Any], text: str, stream: bool
) -> tuple[str, list[Any]]:
    items = [*history, {"type": "message", "role": "user", "content": text}]
    if stream:
        rid, reply = "", ""
        for ev in client.responses.create(model=model, input=items, stream=True, store=False):
            if ev.type == "response.completed":
                rid, reply = ev.response.id, ev.response.output_text
    else:
        r = client.responses.create(model=model, input=items, store=False)
        rid, reply = r.id, r.output_text
    return rid, [*items, {"type": "message", "role": "assistant", "content": reply}]


def test_openai_explicit_generation_compares_with_the_previous_response(
    fake: Upstream, tmp_path: Path
) -> None:
    rec = tmp_path / "rec.jsonl"
    sent = Sent()
    with forward(fake, rec, diagnose=True) as md:
        client = gpt(md, sent, "sk-secret-3")
        id1, conv = responses_turn(client, "gpt-5.6", [], "read calc.py", stream=True)
        id2, conv = responses_turn(client, "gpt-5.6", conv, "and tests?", stream=False)
        responses_turn(client, "gpt-5.6", conv, "write one", stream=True)
        # The generation before has no diagnosis: its requests go as they were sent.
        _, old = responses_turn(client, "gpt-5.5", [], "hello", stream=False)
        responses_turn(client, "gpt-5.5", old, "again", stream=True)
        records = wait_for_records(rec, 5)
    got = received(fake, "/v1/responses")
    asked = [
        (e.request_json.get("prompt_cache_options") or {}).get("comparison_response_id")
        for e in got
    ]
    assert asked == [None, id1, id2, None, None]
    assert [e.request_body for e in got[3:]] == sent.bodies[3:]
    assert got[0].request_body == sent.bodies[0]
    assert [r["request"]["added"] for r in records] == [
        None,
        ["prompt_cache_options.comparison_response_id"],
        ["prompt_cache_options.comparison_response_id"],
        None,
        None,
    ]
    for r, body in zip(records, sent.bodies, strict=True):
        assert r["request"]["body_bytes"] == len(body)
    assert "sk-secret-3" not in rec.read_text()


def test_never_toward_a_local_server(fake: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    sent = Sent()
    with Mitmdump(fake.url, rec, {"llmp_diagnose": "true", "llmp_live": "false"}) as md:
        client = anthropic.Anthropic(
            api_key="x",
            base_url=md.url,
            http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [sent]}),
        )
        _, conv = say(client, [], "hi", stream=False)
        say(client, conv, "again", stream=True)
        oai = openai.OpenAI(
            api_key="x",
            base_url=md.url + "/v1",
            http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent]}),
        )
        responses_turn(oai, "gpt-5.6", [], "hi", stream=False)
        records = wait_for_records(rec, 3)
    got = [e for e in fake.log if e.method == "POST"]
    assert [e.request_body for e in got] == sent.bodies
    assert [r["request"]["added"] for r in read_records(rec)] == [None] * 3
    assert {r["request"]["upstream"] for r in records} == {"127.0.0.1"}


def test_a_compressed_body_is_changed_and_compressed_again(fake: Upstream, tmp_path: Path) -> None:
    """Claude Code may gzip its request bodies: the field goes into the decoded JSON."""
    rec = tmp_path / "rec.jsonl"
    sent = Sent()
    body = json.dumps(
        {
            "model": "claude-sonnet-5",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    with forward(fake, rec, diagnose=True) as md, httpx.Client(**proxied(md, sent)) as http:
        http.post(
            "https://api.anthropic.com/v1/messages",
            content=gzip.compress(body),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        records = wait_for_records(rec, 1)
    (e,) = received(fake, "/v1/messages")
    assert e.request_header("content-encoding") == "gzip"
    assert e.request_header("content-length") == str(len(e.request_body))
    got = gzip.decompress(e.request_body)
    assert got == body[:-1] + b',"diagnostics":{"previous_message_id":null}}'
    assert records[0]["request"]["added"] == ["diagnostics", "anthropic-beta"]
    assert records[0]["request"]["body_bytes"] == len(sent.bodies[0])
