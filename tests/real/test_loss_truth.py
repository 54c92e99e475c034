"""The analyzer's charge against the real llama-server's own counters.

Each case drives a short conversation through the real ``openai`` client and
two real recorders in a chain (full mode in front, digest mode behind it, so
both recordings hold the same exchanges), to a real llama-server with one slot
and no host-memory prompt cache (``-np 1 --cache-ram 0``).  Each case is
analysed three ways with ``llmp analyze --json`` (``MODES``: the digest
recording, the full one, and the full one after ``--tokenize``), and every
charge is checked against what the server says it did: it re-processed
``timings.prompt_n`` tokens in ``timings.prompt_ms``; of those, the genuinely
new messages (measured with the server's ``/tokenize``) would have been
processed anyway, so what a break cost is ``prompt_n - new`` (docs/analysis.md
§7), at the row's own rate ``prompt_ms / prompt_n``.

1. a clock in a long system prompt changes on turn 3, at its top and at its end;
2. a title call on the one slot between two turns (a side-call eviction);
3. the tools array reordered, with a template that renders tools before the
   system text (``tests/support/tools_first.jinja``);
4. a harness that cuts its system prompt and tools after the server refused a
   prompt for its context, as Qwen Code does (``-c 2048``,
   ``tests/support/tools_after_system.jinja``).

Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``
(``eval "$(../shared/tools/real-llama-server --env)"``); skipped without them.
About 18 000 tokens of prefill: some 90 s of it at 200 tokens/s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real import LlamaServer, real_server_marks
from tests.support.real_cases import (
    MAX_TOKENS,
    MODEL,
    MODES,
    Case,
    log_lines,
    post,
    record,
    rules,
    tokens,
    turn,
)

openai = pytest.importorskip("openai")

pytestmark = real_server_marks()

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TOLERANCE = 0.10
"""A charge is right when it is within this share of what the server says it cost."""

# -- the texts -----------------------------------------------------------------


def _tool(name: str, what: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": (
                f"{what} The path is relative to the root of the repository; the tool fails "
                "when the path leaves the repository or names a directory. It returns the "
                "result as plain text, with a short note when the output was cut."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "the file, from the root"},
                    "limit": {"type": "integer", "description": "at most this many lines"},
                },
                "required": ["path"],
            },
        },
    }


TOOLS = [
    _tool("read_file", "Read a file and return its lines, numbered from one."),
    _tool("write_file", "Write the given text to a file, replacing what it held."),
    _tool("list_directory", "List the entries of a directory, one a line."),
    _tool("search_text", "Search the files for a regular expression and return the hits."),
    _tool("run_tests", "Run the test suite of the package that holds the file."),
]

INTRO = "You are a careful assistant for the operations team of a small web service.\n"
CLOCK_BEFORE = "09:58:12 on Friday 2025-03-14"
CLOCK_AFTER = "14:03:40 on Friday 2025-03-14"  # same length; differs from its first character
USER_1 = log_lines(10)
USER_2 = (
    "Which of these requests failed, and in which region? Keep in mind that the gateway "
    "retries a failed request once, after about a second, and that the retry is logged "
    "as a separate line with its own request number."
)
USER_3 = "Thanks. Which dashboard should I open first?"

# -- driving the server ----------------------------------------------------------


def _summary(case: Case, rid: int, loss: dict[str, Any] | None) -> str:
    t = case.timings(rid)
    new = case.new[rid]
    truth = t["prompt_n"] - new
    charged = loss["tokens"] if loss else None
    ratio = f"{charged / truth:.3f}" if charged is not None and truth > 0 else "-"
    return (
        f"{case.name} row {rid}: cache_n {t['cache_n']} prompt_n {t['prompt_n']} "
        f"prompt_ms {t['prompt_ms']:.0f} ({t['prompt_n'] / t['prompt_ms'] * 1000:.0f} tok/s) "
        f"new {new} truth {truth} charged {charged} ratio {ratio}"
    )


# -- the checks -----------------------------------------------------------------


def _check_charge(
    case: Case,
    rid: int,
    loss: dict[str, Any] | None,
    tolerance: float = TOLERANCE,
    source: str = "server",
) -> None:
    """`loss` is what the server re-processed less the new content, at the row's rate."""
    t = case.timings(rid)
    truth = t["prompt_n"] - case.new[rid]
    detail = _summary(case, rid, loss)
    assert truth > 200, detail  # the case must cost something measurable
    assert loss is not None, detail
    assert abs(loss["tokens"] - truth) <= tolerance * truth, detail
    ms = loss["ms"]
    assert ms is not None and ms["source"] == source, detail
    want = truth * t["prompt_ms"] / t["prompt_n"]
    assert abs(ms["value"] - want) <= tolerance * want, f"{detail}: ms {ms['value']} vs {want:.0f}"


def _balanced(case: Case, rid: int, mode: str) -> None:
    """charged + new + external = evaluated, as the server counted it (within the tolerance)."""
    row = case.row(rid, mode)
    t = case.timings(rid)
    charged = sum((row[k] or {}).get("tokens", 0) for k in ("lost_client", "lost_external"))
    evaluated = t["prompt_n"]
    assert row["counts"]["evaluated_tokens"] == {"value": evaluated, "source": "server"}
    assert row["counts"]["reused_tokens"] == {"value": t["cache_n"], "source": "server"}
    assert abs(charged + case.new[rid] - evaluated) <= TOLERANCE * evaluated, _summary(
        case, rid, row["lost_client"] or row["lost_external"]
    )


def _clean_continuation(case: Case, rid: int, before: int, mode: str) -> None:
    """A clean turn: the server reused the turn before's whole prompt, nothing is charged."""
    row = case.row(rid, mode)
    assert row["kind"] == "turn" and row["linked_to"] == before
    assert row["break_cause"] is None
    assert row["lost_client"] is None and row["lost_external"] is None
    assert row["cause"] is None
    prev = case.timings(before)
    assert case.timings(rid)["cache_n"] >= prev["cache_n"] + prev["prompt_n"] - 2


# -- the servers and the cases ---------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """SmolLM2's own template (it leaves tools out), 8k context, one slot."""
    tmp = tmp_path_factory.mktemp("plain")
    with LlamaServer(ctx=8192, log_path=tmp / "llama-server.log") as server:
        yield server


def _clock_system(where: str, clock: str) -> str:
    if where == "top":
        return f"{INTRO}Current time: {clock}\n{rules(30)}"
    return f"{INTRO}{rules(30)}\nCurrent time: {clock}"


def _clock_case(server: LlamaServer, tmp: Path, where: str) -> Case:
    def drive(client: Any, case: Case) -> None:
        system = _clock_system(where, CLOCK_BEFORE)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": USER_1},
        ]
        reply_1 = turn(client, messages)  # 1
        messages += [{"role": "assistant", "content": reply_1}, {"role": "user", "content": USER_2}]
        reply_2 = turn(client, messages)  # 2
        changed = _clock_system(where, CLOCK_AFTER)
        messages[0] = {"role": "system", "content": changed}
        messages += [{"role": "assistant", "content": reply_2}, {"role": "user", "content": USER_3}]
        turn(client, messages)  # 3: the clock moved
        case.new = {
            2: tokens(server, [reply_1, USER_2]),
            3: tokens(server, [reply_2, USER_3]),
        }
        case.notes["system_tokens"] = tokens(server, [system])
        case.notes["clock_offset"] = changed.index(CLOCK_AFTER)
        case.notes["system"] = changed

    return record(server, tmp, f"clock-{where}", drive)


@pytest.fixture(scope="module", params=["top", "end"])
def clock(
    request: pytest.FixtureRequest, plain: LlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> Case:
    where = str(request.param)
    return _clock_case(plain, tmp_path_factory.mktemp(f"clock-{where}"), where)


@pytest.fixture(scope="module")
def side_call(plain: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Case:
    server = plain
    system = INTRO + rules(12, start=40)

    def drive(client: Any, case: Case) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": USER_1},
        ]
        reply_1 = turn(client, messages)  # 1
        messages += [{"role": "assistant", "content": reply_1}, {"role": "user", "content": USER_2}]
        reply_2 = turn(client, messages)  # 2
        title = client.chat.completions.create(  # 3: a title call, on the one slot
            model=MODEL,
            messages=[
                {"role": "system", "content": "Write a title of at most five words."},
                {"role": "user", "content": USER_2},
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        case.notes["title"] = title.choices[0].message.content
        messages += [{"role": "assistant", "content": reply_2}, {"role": "user", "content": USER_3}]
        turn(client, messages)  # 4: the slot holds the title call now
        case.new = {
            2: tokens(server, [reply_1, USER_2]),
            4: tokens(server, [reply_2, USER_3]),
        }

    return record(server, tmp_path_factory.mktemp("side-call"), "side-call", drive)


@pytest.fixture(scope="module")
def reordered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    tmp = tmp_path_factory.mktemp("reordered")
    template = SUPPORT / "tools_first.jinja"
    args = ["--jinja", "--chat-template-file", str(template)]
    system = INTRO + rules(12, start=80)
    with LlamaServer(ctx=8192, extra_args=args, log_path=tmp / "llama-server.log") as server:
        probe = [{"role": "system", "content": system}, {"role": "user", "content": USER_3}]
        rendered = post(server.url + "/apply-template", {"messages": probe, "tools": TOOLS})

        def drive(client: Any, case: Case) -> None:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": system},
                {"role": "user", "content": USER_1},
            ]
            reply_1 = turn(client, messages, TOOLS)  # 1
            messages += [
                {"role": "assistant", "content": reply_1},
                {"role": "user", "content": USER_2},
            ]
            reply_2 = turn(client, messages, TOOLS)  # 2
            messages += [
                {"role": "assistant", "content": reply_2},
                {"role": "user", "content": USER_3},
            ]
            turn(client, messages, TOOLS[::-1])  # 3: the same tools, in another order
            case.new = {
                2: tokens(server, [reply_1, USER_2]),
                3: tokens(server, [reply_2, USER_3]),
            }
            case.notes["rendered"] = rendered["prompt"]
            case.notes["system"] = system

        yield record(server, tmp, "reordered", drive)


@pytest.fixture(scope="module")
def context_cut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    tmp = tmp_path_factory.mktemp("context-cut")
    template = SUPPORT / "tools_after_system.jinja"
    args = ["--jinja", "--chat-template-file", str(template)]
    system = INTRO + rules(10, start=120)
    short_system = system[: len(system) // 3]  # the harness keeps the head of its prompt
    tools, fewer = TOOLS[:4], TOOLS[:2]
    with LlamaServer(ctx=2048, extra_args=args, log_path=tmp / "llama-server.log") as server:

        def drive(client: Any, case: Case) -> None:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": system},
                {"role": "user", "content": USER_1},
            ]
            reply_1 = turn(client, messages, tools)  # 1
            # The message that overflows is a pasted log, as a tool result often is.
            messages += [
                {"role": "assistant", "content": reply_1},
                {"role": "user", "content": log_lines(10, minute=30)},
            ]
            with pytest.raises(openai.BadRequestError) as info:  # 2: too long for -c 2048
                turn(client, messages, tools)
            case.notes["refusal"] = {"status": info.value.status_code, "body": info.value.body}
            messages[0] = {"role": "system", "content": short_system}
            turn(client, messages, fewer)  # 3: the harness cut its prompt and tools
            case.new = {3: tokens(server, [reply_1, messages[3]["content"]])}

        yield record(server, tmp, "context-cut", drive)


# -- 1. a clock in the system prompt -----------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_clock_in_system_prompt_is_charged_what_the_server_reprocessed(
    clock: Case, mode: str
) -> None:
    where = clock.name.removeprefix("clock-")
    assert clock.notes["system_tokens"] >= 2000
    _clean_continuation(clock, 2, 1, mode)
    t3 = clock.timings(3)
    if where == "top":  # the server could keep only the line above the clock
        assert t3["cache_n"] < 64
    else:  # it kept the whole system text before the clock, and none of the history
        assert t3["cache_n"] >= clock.notes["system_tokens"] - 32
    row = clock.row(3, mode)
    assert row["linked_to"] == 2
    assert row["break_cause"] == "system_changed"
    assert row["cause"] == "structural"
    assert row["lost_external"] is None
    assert row["lost_client"]["cause"] == "system_changed"
    _check_charge(clock, 3, row["lost_client"])
    _balanced(clock, 3, mode)
    changed = row["changed"]
    assert changed and changed[0]["index"] == 0 and changed[0]["role"] == "system"
    assert changed[0]["within"] == ("first_256" if where == "top" else "last_256")
    assert changed[0]["chars_before"] == changed[0]["chars_after"]
    print(_summary(clock, 3, row["lost_client"]), mode)


def test_clock_offset_in_full_mode(clock: Case) -> None:
    """Only full mode knows the character; both modes charge alike."""
    assert clock.row(3, "full")["lost_client"] == clock.row(3, "digest")["lost_client"]
    assert clock.row(3, "digest")["changed"][0]["offset"] is None
    full = clock.row(3, "full")["changed"][0]
    assert full["offset"] == clock.notes["clock_offset"]
    assert full["context"] is not None and CLOCK_AFTER[:8] in full["context"]
    assert full["was"] is not None and CLOCK_BEFORE[:8] in full["was"]


# -- 2. a side-call eviction -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_side_call_eviction_is_charged_what_the_server_reprocessed(
    side_call: Case, mode: str
) -> None:
    _clean_continuation(side_call, 2, 1, mode)
    t2, t4 = side_call.timings(2), side_call.timings(4)
    assert t4["cache_n"] < 0.1 * (t2["cache_n"] + t2["prompt_n"])  # the slot was taken
    title = side_call.row(3, mode)
    assert title["kind"] == "side_call" and title["side_call_shape"] == "oneshot"
    row = side_call.row(4, mode)
    assert row["kind"] == "turn" and row["linked_to"] == 2
    assert row["side_calls_between"] == [3]
    assert row["break_cause"] is None and row["lost_client"] is None
    assert row["cause"] == "side_call"
    assert row["lost_external"]["cause"] == "side_call"
    _check_charge(side_call, 4, row["lost_external"])
    _balanced(side_call, 4, mode)
    kinds = {f["kind"] for f in side_call.reports[mode]["findings"]}
    assert "side_call_on_conversation_model" in kinds
    print(_summary(side_call, 4, row["lost_external"]), mode)


# -- 3. reordered tools ------------------------------------------------------------------


def test_template_renders_tools_before_the_system_text(reordered: Case) -> None:
    prompt = reordered.notes["rendered"]
    first_tool = prompt.index('"name": "read_file"')
    assert first_tool < prompt.index(reordered.notes["system"][:60])
    assert all(f'"name": "{t["function"]["name"]}"' in prompt for t in TOOLS)


@pytest.mark.parametrize("mode", MODES)
def test_reordered_tools_are_the_clients_charge(reordered: Case, mode: str) -> None:
    _clean_continuation(reordered, 2, 1, mode)
    t3 = reordered.timings(3)
    assert t3["cache_n"] < 64  # the tools come first: the system text was read again too
    row = reordered.row(3, mode)
    assert row["linked_to"] == 2
    assert row["break_cause"] == "tools_changed"
    assert row["cause"] == "structural"
    assert row["lost_external"] is None  # no server_* loss: the template moved the break
    assert row["lost_client"]["cause"] == "tools_changed"
    _check_charge(reordered, 3, row["lost_client"])
    _balanced(reordered, 3, mode)
    kinds = {f["kind"] for f in reordered.reports[mode]["findings"]}
    assert "server_cache_loss" not in kinds
    print(_summary(reordered, 3, row["lost_client"]), mode)


# -- 4. a harness's cut after a context error ----------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_context_error_refused_by_the_server(context_cut: Case, mode: str) -> None:
    refusal = context_cut.notes["refusal"]
    assert refusal["status"] == 400
    error = context_cut.full[2]["response"]["body"]["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] > 2048
    assert context_cut.digest[2]["response"]["status"] == 400
    report = context_cut.reports[mode]
    assert report["coverage"]["context_exceeded"] == 1
    assert report["coverage"]["skipped"]["non_2xx"] == 1
    assert [
        f["evidence"]["refused_ids"] for f in report["findings"] if f["kind"] == "context_overflow"
    ] == [[2]]


@pytest.mark.parametrize("mode", MODES)
def test_cut_after_context_error_is_charged_what_the_server_reprocessed(
    context_cut: Case, mode: str
) -> None:
    t3 = context_cut.timings(3)
    assert t3["cache_n"] > 100  # the head of the system prompt was kept
    row = context_cut.row(3, mode)
    assert row["linked_to"] == 1
    assert row["break_cause"] == "system_changed"
    assert row["cause"] == "structural"
    assert row["lost_external"] is None
    if mode == "digest":
        # A digest keeps no error body, so the refused prompt's server count (which
        # measures the new content exactly in full mode) is gone; the new content is
        # the recorder's own count of each message with the server's tokenizer
        # (llmp_tokenize), and the figure says it rests on that.
        _check_charge(context_cut, 3, row["lost_client"], source="tokenizer")
    else:
        _check_charge(context_cut, 3, row["lost_client"])
        _balanced(context_cut, 3, mode)
    changed = row["changed"][0]
    assert changed["index"] == 0 and changed["chars_after"] < changed["chars_before"]


@pytest.mark.parametrize("mode", MODES)
def test_cut_after_context_error_advice(context_cut: Case, mode: str) -> None:
    breaks = [
        f
        for f in context_cut.reports[mode]["findings"]
        if f["kind"] == "prefix_break" and f["evidence"]["break_cause"] == "system_changed"
    ]
    assert len(breaks) == 1
    advice = breaks[0]["evidence"].get("advice")
    assert advice is not None, breaks[0]
    assert "context" in advice["text"] and "llama-server -c" in advice["text"]
    assert advice["confidence"] == "high"  # the prompt shrank
