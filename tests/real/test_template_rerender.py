"""A chat template that renders earlier replies otherwise once a new user message arrives,
held against the same run on a server that keeps them as they were.

Qwen 3.x and Gemma 4 drop the reasoning of the assistant turns before the latest user
message (llama.cpp #21912): in an agent's tool loop the replies since the user last
spoke carry a ``<think>`` block, and the next user message renders them without it, so
the server's cache diverges where the first of them starts.  The tiny models here have
no such template, so SmolLM2 runs with one that behaves so
(``tests/fixtures/templates/drops_reasoning.jinja``, ChatML like SmolLM2's own, which
supports ``preserve_thinking``).  llama-server then keeps the reasoning by default
(``--reasoning-preserve``, recent builds): that run is the truth, with nothing lost;
``--no-reasoning-preserve`` is the run that re-reads the replies.

The conversation (``-np 1 --cache-ram 0``): a system prompt and a pasted log; a reply
that calls a tool and the tool's result; then the user speaks again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live_checks import analyze_text
from tests.support.real import LlamaServer, real_server_marks, supports
from tests.support.real_cases import Case, log_lines, record, rules, turn

pytestmark = real_server_marks()

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "templates" / "drops_reasoning.jinja"
USER_AGAIN = 3
"""The record of the request that adds the user's next message."""


def _drive(client: Any, case: Case) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful operations agent.\n" + rules(10)},
        {"role": "user", "content": "Read the log and find the errors.\n" + log_lines(10)},
    ]
    reply = turn(client, messages)
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages += [
        {"role": "assistant", "content": reply, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": log_lines(8, 30)},
    ]
    reply = turn(client, messages)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thanks. Which of them matters most?"},
    ]
    turn(client, messages)


def _case(tmp: Path, name: str, *extra: str) -> Iterator[Case]:
    args = ["--chat-template-file", str(TEMPLATE), *extra]
    with LlamaServer(ctx=8192, extra_args=args, log_path=tmp / "llama.log") as server:
        if not supports(str(server.server), "--no-reasoning-preserve"):
            pytest.skip("this llama-server has no --reasoning-preserve")
        yield record(server, tmp, name, _drive)


@pytest.fixture(scope="module")
def drops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    yield from _case(tmp_path_factory.mktemp("drops"), "drops", "--no-reasoning-preserve")


@pytest.fixture(scope="module")
def keeps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    yield from _case(tmp_path_factory.mktemp("keeps"), "keeps", "--reasoning-preserve")


@pytest.mark.parametrize("mode", ["digest", "full", "tokenized"])
def test_the_template_is_named_where_the_server_re_read_the_replies(
    drops: Case, keeps: Case, mode: str
) -> None:
    before, after = drops.timings(USER_AGAIN - 1), drops.timings(USER_AGAIN)
    previous_prompt = before["cache_n"] + before["prompt_n"]
    # The server's own counts: it went back to where the first reply of the loop starts.
    assert after["cache_n"] < previous_prompt - 100, (before, after)
    truth = keeps.timings(USER_AGAIN)
    assert truth["cache_n"] >= previous_prompt, truth  # the same run, reasoning kept

    row = drops.row(USER_AGAIN, mode)
    assert row["break_cause"] is None and row["linked_to"] == USER_AGAIN - 1
    assert row["lost_client"] is None
    ext = row["lost_external"]
    assert ext is not None and ext["cause"] == "server_template", row
    assert ext["tokens"] == previous_prompt - after["cache_n"]
    assert row["cause"] == "server_reset"
    (finding,) = [f for f in drops.reports[mode]["findings"] if f["kind"] == "server_cache_loss"]
    assert finding["evidence"]["kind"] == "server_template"

    kept = keeps.row(USER_AGAIN, mode)
    assert kept["lost_external"] is None and kept["lost_client"] is None, kept
    assert "server_template" not in keeps.reports[mode]["time"]["by_cause"]


def test_the_readable_report_names_the_flag(drops: Case) -> None:
    out = analyze_text(drops.notes["digest_path"])
    assert "--reasoning-preserve" in out and "preserve_thinking" in out, out
