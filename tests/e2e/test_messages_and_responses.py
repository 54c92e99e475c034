"""Claude Code's and Codex's APIs end to end: the real mitmdump, the real SDKs, the fake
llama-server's `/v1/messages` and `/v1/responses` (R21-R29).

Most exchanges go through two recorders in a chain, a digest one in front of a
full one, so the same bytes are recorded both ways: the digest recording's
hashes must be the ones computed from the full recording's bodies, and the
full recording's merged reply must be what the SDK assembled.  Then
`llmp analyze` (JSON, HTML, the gate, `--tokenize`) and the live view run on
what was recorded.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmp import cli
from llmp.apis import api_for
from llmp.live.contract import SUMMARY_TAG, TURN_FIELDS, TURN_TAG
from tests.support.live_checks import analyze, check_event, lost, value
from tests.support.mitm import Mitmdump
from tests.support.sdk_chain import (
    CLAUDE_UA,
    CODEX_UA,
    blocks,
    chain,
    check_digests,
    completed,
    plain,
    records,
    user_item,
)
from tests.support.upstreams import LLAMA_MODEL_FILE, Upstream

pytestmark = pytest.mark.e2e

MARK = "MARKER-newapi-8Qx"  # in every message; in no live output
EPHEMERAL: Any = {"type": "ephemeral"}
INSTRUCTIONS = f"You are an interactive CLI tool ({MARK}). " + "Read before you edit. " * 120


def claude_system(instructions: str = INSTRUCTIONS, suffix: str = "7c2") -> Any:
    return [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; "
            "cc_entrypoint=sdk-cli;",
        },
        {"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL},
        {"type": "text", "text": instructions, "cache_control": EPHEMERAL},
    ]


CLAUDE_TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        "cache_control": EPHEMERAL,
    },
]
CODEX_TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "strict": False,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
DEVELOPER: Any = {
    "type": "message",
    "role": "developer",
    "content": [{"type": "input_text", "text": f"You are Codex ({MARK}). " * 60}],
}
ENVIRONMENT: Any = {
    "type": "message",
    "role": "user",
    "content": [{"type": "input_text", "text": "<environment_context>/work</environment_context>"}],
}


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


def upstream_events(up: Upstream, index: int) -> list[dict[str, Any]]:
    return [json.loads(data) for _, data in up.log[index].sse_events()]


# -- the Anthropic SDK ------------------------------------------------------------------------


def test_anthropic_sdk(llama: Upstream, tmp_path: Path) -> None:
    """create and stream, a tool call streamed and not, thinking; count_tokens is not chat."""
    llama.reset_cache()
    first = len(llama.log)
    with chain(llama.url, tmp_path) as (md, digest_path, full_path):
        client = anthropic.Anthropic(
            base_url=md.url,
            api_key="sk-ant-not-recorded",
            max_retries=0,
            timeout=20,
            default_headers={"user-agent": CLAUDE_UA},
        )
        history: list[Any] = [{"role": "user", "content": f"What is the weather in Tokyo? {MARK}"}]
        called: Any = client.beta.messages.create(  # with ?beta=true, as Claude Code sends
            model="qwen3-coder",
            max_tokens=32000,
            system=claude_system(),
            tools=CLAUDE_TOOLS,
            messages=history,
            extra_query={"beta": "true"},
        )
        history += [
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": called.content[-1].id, "content": "25C"}
                ],
            },
        ]
        with client.messages.stream(
            model="qwen3-coder",
            max_tokens=32000,
            system=claude_system(),
            tools=CLAUDE_TOOLS,
            messages=history,
            extra_headers={"x-fake": "delay_ms=250"},  # a keep-alive first, then a wait
        ) as stream:
            streamed_text = "".join(stream.text_stream)
            answered: Any = stream.get_final_message()
        history += [
            {"role": "assistant", "content": [b.model_dump() for b in answered.content]},
            {"role": "user", "content": "And the weather in Oslo?"},
        ]
        with client.messages.stream(
            model="qwen3-coder",
            max_tokens=32000,
            system=claude_system(),
            tools=CLAUDE_TOOLS,
            messages=history,
        ) as stream:
            streamed_call: Any = stream.get_final_message()
        count = client.messages.count_tokens(
            model="qwen3-coder", system=claude_system(), messages=history
        )
        digest, full = records(digest_path, 4), records(full_path, 4)
    assert len(llama.log) == first + 4

    check_digests(digest, full)
    assert [r["request"]["path"] for r in full] == [
        "/v1/messages?beta=true",
        "/v1/messages",
        "/v1/messages",
        "/v1/messages/count_tokens",
    ]
    assert all(r["error"] is None for r in digest + full)
    # The merged replies are what the SDK assembled.
    sdk = [called, answered, streamed_call]
    for rec, msg in zip(full[:3], sdk, strict=True):
        body = plain(rec["response"]["body"])
        assert blocks(body["content"]) == blocks(msg.content), rec["id"]
        assert (body["id"], body["model"], body["stop_reason"]) == (
            msg.id,
            msg.model,
            msg.stop_reason,
        )
    assert [b.type for b in called.content] == ["thinking", "tool_use"]
    assert called.content[-1].input == {"city": "Tokyo"}
    assert [b.type for b in answered.content] == ["thinking", "text"]
    assert streamed_text == answered.content[1].text
    assert [b.type for b in streamed_call.content] == ["thinking", "tool_use"]
    assert full[2]["response"]["body"]["content"][1]["input"] == {"city": "Tokyo"}
    # The counters, verbatim: what the SDK read, what upstream sent.
    for rec, msg in zip(digest[:3], sdk, strict=True):
        usage = plain(rec["response"]["digest"]["usage"])
        assert usage["usage"] == msg.usage.model_dump(exclude_none=True)
        assert list(usage["usage"]) == ["cache_read_input_tokens", "input_tokens", "output_tokens"]
        assert "timings" not in usage and usage["model"] == LLAMA_MODEL_FILE
    assert json.loads(llama.log[first].body)["usage"] == plain(
        digest[0]["response"]["digest"]["usage"]["usage"]
    )
    events = upstream_events(llama, first + 1)
    assert digest[1]["response"]["digest"]["usage"]["usage"] == {
        **events[0]["message"]["usage"],
        **events[-2]["usage"],
    }
    # The prefill as the proxy saw it: from the first event, after the keep-alive (R28).
    plain_rec, delayed, undelayed = digest[0], digest[1], digest[2]
    assert plain_rec["t_first_event_ms"] is None  # not streamed
    assert delayed["t_first_byte_ms"] + 150 <= delayed["t_first_event_ms"] <= delayed["t_end_ms"]
    assert undelayed["t_first_event_ms"] is not None
    assert delayed["response"]["stream"] == "sse" and plain_rec["response"]["stream"] is None
    # count_tokens: recorded, not chat.
    tok = full[3]
    assert tok["response"]["body"] == {"input_tokens": count.input_tokens}
    assert digest[3]["request"]["body"] is None and digest[3]["response"]["body"] is None
    assert b"sk-ant-not-recorded" not in digest_path.read_bytes() + full_path.read_bytes()

    report = analyze(digest_path)
    assert report["coverage"]["paths"] == {"/v1/messages/count_tokens": 1}
    assert report["coverage"]["skipped"]["not_chat"] == 1
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in (1, 2, 3)] == ["anthropic_messages"] * 3
    assert [rows[i]["turn"] for i in (1, 2, 3)] == [1, 2, 3]
    assert rows[1]["counts"]["prefill_ms"] is None  # no timings, not streamed
    wait = delayed["t_first_event_ms"] - delayed["t_start_ms"]
    assert rows[2]["counts"]["prefill_ms"] == {"value": wait, "source": "proxy"}
    for i, msg in zip((1, 2, 3), sdk, strict=True):
        c = rows[i]["counts"]
        assert value(c["reused_tokens"]) == msg.usage.cache_read_input_tokens
        assert value(c["evaluated_tokens"]) == msg.usage.input_tokens
    assert value(rows[3]["counts"]["reused_tokens"]) > 0 and rows[3]["cause"] is None
    assert facts(report) == facts(analyze(full_path))  # timed by each proxy's own clock


def facts(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What a report says of each row, but for the times (each recorder has its own clock)."""
    return [
        (
            *(r[k] for k in ("id", "api", "kind", "conversation", "turn", "linked_to")),
            *(r["counts"][k] for k in ("prompt_tokens", "reused_tokens", "evaluated_tokens")),
            *(r[k] for k in ("break_cause", "cause", "composition")),
        )
        for r in report["rows"]
    ]


# -- the OpenAI SDK's Responses ---------------------------------------------------------------


def test_openai_responses_sdk(llama: Upstream, tmp_path: Path) -> None:
    """responses.create streamed and not, a function call and its output across turns."""
    llama.reset_cache()
    first = len(llama.log)
    with chain(llama.url, tmp_path) as (md, digest_path, full_path):
        client = openai.OpenAI(
            base_url=md.url + "/v1",
            api_key="sk-not-recorded",
            max_retries=0,
            timeout=20,
            default_headers={"user-agent": CODEX_UA},
        )
        items: list[Any] = [DEVELOPER, ENVIRONMENT, user_item(f"The weather in Tokyo? {MARK}")]
        called = completed(
            client.responses.create(
                model="gpt-5-codex",
                input=items,
                tools=CODEX_TOOLS,
                store=False,
                stream=True,
                extra_headers={"x-fake": "delay_ms=250"},
            )
        )
        call = called.output[-1]
        assert call.type == "function_call"
        items += [o.model_dump(exclude_none=True) for o in called.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "25C"})
        answered: Any = client.responses.create(
            model="gpt-5-codex", input=items, tools=CODEX_TOOLS, store=False
        )
        items += [o.model_dump(exclude_none=True) for o in answered.output]
        items.append(user_item("Thanks."))
        last = completed(
            client.responses.create(
                model="gpt-5-codex", input=items, tools=CODEX_TOOLS, store=False, stream=True
            )
        )
        digest, full = records(digest_path, 3), records(full_path, 3)
    assert len(llama.log) == first + 3

    check_digests(digest, full)
    sdk = [called, answered, last]
    for rec, resp in zip(full, sdk, strict=True):
        body = plain(rec["response"]["body"])
        assert blocks(body["output"]) == blocks(resp.output), rec["id"]
        assert body["id"] == resp.id and body["model"] == resp.model == LLAMA_MODEL_FILE
    assert [o.type for o in called.output] == ["reasoning", "function_call"]
    assert [o.type for o in answered.output] == ["reasoning", "message"]
    for rec, resp in zip(digest, sdk, strict=True):
        usage = plain(rec["response"]["digest"]["usage"])
        assert resp.usage is not None
        assert usage["usage"] == resp.usage.model_dump(exclude_none=True)
        assert usage["usage"]["input_tokens_details"] == {
            "cached_tokens": resp.usage.input_tokens_details.cached_tokens
        }
    # timings beside `response` on the streamed response.completed only, kept on the body.
    end_event = upstream_events(llama, first)[-1]
    assert end_event["type"] == "response.completed"
    assert plain(digest[0]["response"]["digest"]["usage"]["timings"]) == end_event["timings"]
    assert "timings" not in digest[1]["response"]["digest"]["usage"]
    assert digest[0]["t_first_byte_ms"] + 150 <= digest[0]["t_first_event_ms"]
    assert digest[1]["t_first_event_ms"] is None

    report = analyze(digest_path)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in (1, 2, 3)] == ["openai_responses"] * 3
    assert [(rows[i]["conversation"], rows[i]["turn"]) for i in (1, 2, 3)] == [
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    assert all(rows[i]["break_cause"] is None and rows[i]["cause"] is None for i in (2, 3))
    assert rows[1]["counts"]["prefill_ms"] == {
        "value": end_event["timings"]["prompt_ms"],
        "source": "server",
    }
    assert rows[2]["counts"]["prefill_ms"] is None  # not streamed: no timings
    for i, resp in zip((1, 2, 3), sdk, strict=True):
        c = rows[i]["counts"]
        assert resp.usage is not None
        cached = resp.usage.input_tokens_details.cached_tokens
        assert value(c["reused_tokens"]) == cached
        assert value(c["evaluated_tokens"]) == resp.usage.input_tokens - cached
    assert value(rows[3]["counts"]["reused_tokens"]) > 0
    assert report["clients"][0]["client"] == CODEX_UA
    assert report["tools"][0]["name"] == "get_weather" and report["tools"][0]["called"] == 1


# -- a hang-up right after the end event (R29) ------------------------------------------------


ANTHROPIC_BODY: Any = {
    "model": "claude",
    "max_tokens": 64,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
}
RESPONSES_BODY: Any = {"model": "gpt-5-codex", "input": "hello", "stream": True, "store": False}


def hang_up(url: str, path: str, body: Any, fake: str, after: bytes) -> bytes:
    """Stream a request and close the connection as soon as `after` arrived."""
    seen = b""
    with httpx.Client(base_url=url, timeout=20) as client:
        with client.stream("POST", path, json=body, headers={"x-fake": fake}) as r:
            assert r.status_code == 200
            for piece in r.iter_raw():
                seen += piece
                if after in seen:
                    break
    return seen


@pytest.mark.parametrize(
    ("path", "body", "end"),
    [
        ("/v1/messages", ANTHROPIC_BODY, b"event: message_stop"),
        ("/v1/responses", RESPONSES_BODY, b"event: response.completed"),
    ],
)
def test_a_hang_up_after_the_end_event_is_no_error(
    llama: Upstream, tmp_path: Path, path: str, body: Any, end: bytes
) -> None:
    """Upstream keeps the response open after its end event (`hang_midstream` after every
    event), as llama-server had when Codex hung up; the client hangs up on the end event.
    Cut before the end, the same hang-up is `client_disconnected`."""
    rec = tmp_path / "rec.jsonl"
    with Mitmdump(llama.url, rec, {"llmp_body": "full"}) as md:
        whole = hang_up(md.url, path, body, "hang_midstream,error_after=1000,hang_s=30", end)
        first = records(rec, 1)[0]
        cut = hang_up(md.url, path, body, "delay_ms=300", b"event: ")
        second = records(rec, 2)[1]
    assert end in whole and end not in cut
    assert llama.log[-2].outcome != "complete"  # the end came, the response never closed
    assert first["error"] is None
    assert first["response"]["status"] == 200 and first["response"]["stream"] == "sse"
    api = api_for("POST", path)
    assert api is not None
    merged = first["response"]["body"]
    if path == "/v1/messages":
        assert merged["content"][-1]["text"] == "Hello from fake llama"
    else:
        assert merged["status"] == "completed" and merged["output"][-1]["type"] == "message"
    assert second["error"] == "client_disconnected"
    report = analyze(rec)
    assert [r["id"] for r in report["rows"]] == [1]
    assert report["coverage"]["skipped"]["error"] == 1


# -- the session: analyze, the HTML page, the gate, --tokenize, the live view ---------------


def _session(md: Mitmdump) -> None:
    """Claude Code: three turns, the third with a changed instructions block; then Codex:
    three turns.  Both through the real SDKs."""
    claude = anthropic.Anthropic(
        base_url=md.url,
        api_key="x",
        max_retries=0,
        timeout=20,
        default_headers={"user-agent": CLAUDE_UA},
    )
    history: list[Any] = [{"role": "user", "content": f"Read app.py please ({MARK})."}]
    edited = INSTRUCTIONS[:400] + " Use pnpm, not npm. " + INSTRUCTIONS[400:]
    for n, instructions in enumerate((INSTRUCTIONS, INSTRUCTIONS, edited)):
        with claude.beta.messages.stream(
            model="qwen3-coder",
            max_tokens=32000,
            system=claude_system(instructions),
            tools=CLAUDE_TOOLS,
            messages=history,
        ) as stream:
            msg: Any = stream.get_final_message()
        history += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in msg.content],
            },
            {"role": "user", "content": f"Next step {n} ({MARK})."},
        ]
    codex = openai.OpenAI(
        base_url=md.url + "/v1",
        api_key="x",
        max_retries=0,
        timeout=20,
        default_headers={"user-agent": CODEX_UA},
    )
    items: list[Any] = [DEVELOPER, ENVIRONMENT, user_item(f"List the files ({MARK}).")]
    for n in range(3):
        done = completed(
            codex.responses.create(
                model="gpt-5-codex", input=items, tools=CODEX_TOOLS, store=False, stream=True
            )
        )
        items += [o.model_dump(exclude_none=True) for o in done.output]
        items.append(user_item(f"Go on {n} ({MARK})."))


def test_session_analysis_and_live_view(
    llama: Upstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events, table = tmp_path / "events.txt", tmp_path / "turns.csv"
    live = {
        "llmp_live_warn_tokens": "100",
        "llmp_live_warn_ms": "600000",
        "llmp_events": str(events),
        "llmp_events_csv": str(table),
    }
    llama.reset_cache()
    with chain(llama.url, tmp_path, live) as (md, digest_path, full_path):
        md.wait_for_log("llmp: live view on")
        _session(md)
        md.wait_for_log(f"{CODEX_UA} conv 2 turn 3:")
        summary = httpx.get(md.url + "/_llmp/summary", timeout=10)
        digest, full = records(digest_path, 6), records(full_path, 6)
        assert md.stop() == 0
        log = md.log_text()
    check_digests(digest, full)

    # --json: both APIs, the break on Claude's third turn.
    assert cli.main(["analyze", "--json", str(digest_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in report["rows"]}
    assert [rows[i]["api"] for i in range(1, 7)] == ["anthropic_messages"] * 3 + [
        "openai_responses"
    ] * 3
    assert [(rows[i]["conversation"], rows[i]["turn"]) for i in range(1, 7)] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 1),
        (2, 2),
        (2, 3),
    ]
    assert rows[3]["break_cause"] == "system_changed" and rows[3]["cause"] == "structural"
    (where,) = rows[3]["changed"]
    assert (where["index"], where["role"]) == (2, "system")  # the instructions block
    for i in (2, 5, 6):
        assert rows[i]["break_cause"] is None and rows[i]["cause"] is None
    assert [c["client"] for c in report["clients"]] == [CLAUDE_UA, CODEX_UA]
    kinds = [f["kind"] for f in report["findings"]]
    assert "prefix_break" in kinds and "volatile_head" not in kinds

    # --html: a "what changed" block for the broken Anthropic turn, no text.
    page = tmp_path / "report.html"
    assert cli.main(["analyze", "--html", str(page), str(full_path)]) == 0
    html = page.read_text()
    assert '<h2 id="changes">What changed</h2>' in html
    assert 'class="change"' in html and 'data-row="3"' in html
    assert "request #3 compared with request #2" in html
    assert MARK not in html and "pnpm" not in html

    # --fail-on: the system change fails the gate; the Codex part alone would not.
    capsys.readouterr()
    assert cli.main(["analyze", "--fail-on", "prefix_break", str(digest_path)]) == 1
    codex_only = tmp_path / "codex.jsonl"
    codex_only.write_bytes(b"".join(digest_path.read_bytes().splitlines(keepends=True)[3:]))
    assert cli.main(["analyze", "--fail-on", "prefix_break", str(codex_only)]) == 0
    capsys.readouterr()

    # --tokenize: the fake's /tokenize counts every message and tool of both APIs.
    assert cli.main(["analyze", "--tokenize", llama.url, "--json", str(full_path)]) == 0
    tokenized = json.loads(capsys.readouterr().out)
    enriched = records(full_path, 6)
    for rec in enriched:
        api = api_for(rec["request"]["method"], rec["request"]["path"])
        assert api is not None
        texts, tools = api.count_targets(rec["request"]["body"])
        want = {h: math.ceil(len(t) / 4) for h, t in texts.items()}
        assert rec["tokens"]["messages"] == want, rec["id"]
        assert rec["tokens"]["tools"] == {h: math.ceil(len(t) / 4) for h, t in tools.items()}
        hashes = {m["hash"] for m in api.request_digest(rec["request"]["body"])["messages"]}
        assert set(want) == hashes
    header = full[0]["request"]["body"]["system"][0]["text"]  # R22: a system block alone
    assert math.ceil(len(header) / 4) in enriched[0]["tokens"]["messages"].values()
    env_text = ENVIRONMENT["content"][0]["text"]  # R25: an item's input_text
    assert math.ceil(len(env_text) / 4) in enriched[3]["tokens"]["messages"].values()
    trows = {r["id"]: r for r in tokenized["rows"]}
    assert trows[1]["composition"]["system"]["source"] == "tokenizer"
    assert trows[4]["composition"]["system"]["source"] == "tokenizer"

    # The live view: a line per request, one warning, the summary, the event files.
    for row in report["rows"]:
        c = row["counts"]
        ua = CLAUDE_UA if row["api"] == "anthropic_messages" else CODEX_UA
        head = f"{ua} conv {row['conversation']} turn {row['turn']}: "
        assert f"{head}{value(c['prompt_tokens']):,} prompt tokens" in log, (head, log)
    warnings = [line for line in log.splitlines() if "llmp: warning:" in line]
    assert len(warnings) == 1, warnings
    assert f"{CLAUDE_UA} conv 1 turn 3:" in warnings[0]
    assert f"lost {lost(rows[3]):,} tokens" in warnings[0]
    assert MARK not in log

    assert summary.status_code == 200 and MARK not in summary.text
    s = summary.json()
    assert (s["turns"], s["conversations"], s["warnings"]) == (6, 2, 1)
    assert s["lost_tokens"] == report["time"]["lost_tokens"]
    assert s["prefill_ms"] == value(report["time"]["prefill_ms"])
    assert [c["client"] for c in s["clients"]] == [CLAUDE_UA, CODEX_UA]

    lines = events.read_text().splitlines()
    assert MARK not in events.read_text() and MARK not in table.read_text()
    assert [ln.split(" ", 1)[0] for ln in lines] == [TURN_TAG] * 6 + [SUMMARY_TAG]
    turns = [json.loads(ln.split(" ", 1)[1]) for ln in lines[:-1]]
    for ev in turns:
        check_event(ev, rows[ev["id"]])
        assert ev["warn"] == (ev["id"] == 3)
    with table.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == TURN_FIELDS
        table_rows = list(reader)
    assert [int(r["id"]) for r in table_rows] == [1, 2, 3, 4, 5, 6]
    for r, ev in zip(table_rows, turns, strict=True):
        assert float(r["prefill_ms"]) == ev["prefill_ms"]
        assert r["client"] == ev["client"]
