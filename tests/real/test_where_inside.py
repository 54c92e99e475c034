"""Where inside a long message it changed (R31's P), and what of it is new, from a
digest's content-defined chunks, held against the real llama-server.

Gemma 3 270M has a sliding-window cache: without ``--swa-full`` llama-server cannot go
back into it, and after a change re-reads from 0 or from a context checkpoint; with
``--swa-full`` it re-reads from where the prompt changed, which is the truth for P and so
for how the loss splits between the client (the old prompt from P on, less what the edit
put in) and the server (P less what it reused).  A file pasted into a user message is
edited in its middle: a digest knows neither end of the message changed, and only its
chunks say where in between, and where the edit ends (docs/analysis.md §7, "Where P
is").

One conversation, the same on both servers (``-np 1 --cache-ram 0``):

1. a system prompt, and a user message with a pasted file (module A);
2. an appended turn;
3. a second pasted file (module B);
4. module B edited in its middle: a later user message changed;
5. an appended turn;
6. module A edited two thirds of the way down: the first user message changed, and
   the history after it resent;
7. an appended turn;
8. four functions in the middle of module B rewritten with as many characters: the
   message grew by nothing, and some 300 tokens of it are new;
9. an appended turn.

Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL_SWA`` (``eval
"$(../shared/tools/real-llama-server --env)"``); skipped without them.  Some 20 000
tokens of prefill on the two servers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real import LlamaServer, real_server_marks, swa_model
from tests.support.real_cases import Case, record, rules, tokens, turn

pytestmark = real_server_marks()

TOLERANCE = 0.10
SYSTEM = "You are a careful reviewer of Python code for a small data team.\n" + rules(6)
EDIT_B, EDIT_A, REWRITE_B = 4, 6, 8
EDITS = (EDIT_B, EDIT_A, REWRITE_B)
APPENDED = (2, 3, 5, 7, 9)


def module(name: str, functions: int) -> str:
    """A Python module as a user pastes it: some 60 characters a line."""
    out = [f'"""The {name} stage of the nightly import."""', "", "import math", ""]
    for i in range(functions):
        out += [
            f"def {name}_step_{i}(values, scale={i % 7 + 1}):",
            f'    """Scale the {name} values of batch {i} and drop the empty ones."""',
            f"    kept = [v * scale for v in values if v is not None]  # batch {i}",
            f"    return [round(math.sqrt(abs(v)), {i % 4 + 1}) for v in kept]",
            "",
        ]
    return "\n".join(out)


def edited(text: str, at: float) -> str:
    """The same text with one default changed (`scale=3` to `scale=9`), `at` of the way
    down: as long as before, so the message grew by nothing."""
    lines = text.split("\n")
    i = next(k for k in range(int(len(lines) * at), len(lines)) if "scale=" in lines[k])
    digit = lines[i][lines[i].index("scale=") + 6]
    lines[i] = lines[i].replace(f"scale={digit}", "scale=8" if digit == "9" else "scale=9", 1)
    out = "\n".join(lines)
    assert len(out) == len(text) and out != text
    return out


SAME_LENGTH = (
    ("values", "totals"), ("scale", "ratio"), ("kept", "held"), ("batch", "group"),
    ("empty", "blank"), ("sqrt", "log2"),
)  # fmt: skip


def rewritten(text: str, at: float, functions: int = 4) -> str:
    """The same text with `functions` functions from `at` of the way down rewritten word
    for word, each word by one as long: the text keeps its length."""
    lines = text.split("\n")
    i = next(k for k in range(int(len(lines) * at), len(lines)) if lines[k].startswith("def "))
    block = "\n".join(lines[i : i + 5 * functions])
    for a, b in SAME_LENGTH:
        block = block.replace(a, b)
    out = "\n".join([*lines[:i], block, *lines[i + 5 * functions :]])
    assert len(out) == len(text) and out != text
    return out


def edit_span(old: str, new: str) -> str:
    """What an edit put in: the new text between the first and the last character that
    differ from the old one."""
    n = min(len(old), len(new))
    a = next((i for i in range(n) if old[i] != new[i]), n)
    b = next((i for i in range(n - a) if old[-1 - i] != new[-1 - i]), n - a)
    return new[a : len(new) - b]


MODULE_A, MODULE_B = module("ingest", 36), module("export", 30)


def _drive(server: LlamaServer) -> Any:
    def drive(client: Any, case: Case) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Here is module A:\n" + MODULE_A},
        ]
        new: dict[int, list[str]] = {}
        put: dict[int, str] = {}  # what each edit put in

        def step(rid: int, user: str) -> None:
            reply = turn(client, messages)
            messages.extend(
                ({"role": "assistant", "content": reply}, {"role": "user", "content": user})
            )
            new[rid + 1] = [reply, user]

        step(1, "What does it do?")
        step(2, "And here is module B:\n" + MODULE_B)
        step(3, "Which of the two is slower?")
        b = messages[5]["content"]
        messages[5] = {"role": "user", "content": b.replace(MODULE_B, edited(MODULE_B, 0.5))}
        put[EDIT_B] = edit_span(b, messages[5]["content"])
        step(4, "I changed a scale in B. Does it still work?")  # 4: B edited
        step(5, "Thanks.")
        a = messages[1]["content"]
        messages[1] = {"role": "user", "content": a.replace(MODULE_A, edited(MODULE_A, 2 / 3))}
        put[EDIT_A] = edit_span(a, messages[1]["content"])
        step(6, "And one in A.")  # 6: A edited
        step(7, "Fine.")
        b = messages[5]["content"]
        messages[5] = {"role": "user", "content": rewritten(b, 0.5)}
        put[REWRITE_B] = edit_span(b, messages[5]["content"])
        step(8, "I rewrote four functions of B.")  # 8: B rewritten, as long as before
        turn(client, messages)  # 9
        case.new = {rid: tokens(server, texts) for rid, texts in new.items()}
        case.notes["put"] = {rid: tokens(server, [text]) for rid, text in put.items()}
        case.notes["put_chars"] = {rid: len(text) for rid, text in put.items()}

    return drive


def _case(tmp: Path, name: str, *extra: str) -> Iterator[Case]:
    found = swa_model()
    if isinstance(found, str):
        pytest.skip(found)
    with LlamaServer(ctx=8192, model=found, extra_args=extra, log_path=tmp / "llama.log") as srv:
        yield record(srv, tmp, name, _drive(srv))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    yield from _case(tmp_path_factory.mktemp("gemma"), "gemma")


@pytest.fixture(scope="module")
def gemma_full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    yield from _case(tmp_path_factory.mktemp("gemma-full"), "gemma-full", "--swa-full")


def _truth(run: Case, full: Case, rid: int) -> tuple[int, int, str]:
    """(client's part, server's part) as the --swa-full run shows them, and a summary.

    The client's part is what the --swa-full server re-read less the new content: the
    new messages, and what the edit put in (as the server tokenizes it alone)."""
    t, f = run.timings(rid), full.timings(rid)
    change = f["cache_n"]  # where the --swa-full server found the change: P
    server = change - t["cache_n"]
    put = full.notes["put"][rid]
    client = f["prompt_n"] - full.new[rid] - put
    return (
        client,
        server,
        f"row {rid}: P {change} (swa-full cache_n), reused {t['cache_n']}, read {t['prompt_n']} "
        f"(swa-full read {f['prompt_n']}), new {full.new[rid]}, put in {put}: "
        f"client {client}, server {server}",
    )


@pytest.mark.parametrize("mode", ["digest", "tokenized"])
@pytest.mark.parametrize("rid", EDITS)
def test_an_edit_inside_a_pasted_file_is_split_as_the_server_did(
    gemma: Case, gemma_full: Case, rid: int, mode: str
) -> None:
    client, server, detail = _truth(gemma, gemma_full, rid)
    assert server > 300 and client > 300, detail  # the change lies well inside the prompt
    row = gemma.row(rid, mode)
    assert row["break_cause"] == "history_rewritten", row
    (changed,) = row["changed"]
    assert changed["within"] == "between", changed  # both 256-character ends unchanged
    lc, le = row["lost_client"], row["lost_external"]
    assert le is not None and le["cause"] == "server_no_rollback", (row, detail)
    assert lc is not None, (row, detail)
    got = f"llmp: client {lc['tokens']}, server {le['tokens']}; {detail}"
    assert abs(le["tokens"] - server) <= TOLERANCE * server, got
    assert abs(lc["tokens"] - client) <= TOLERANCE * client, got
    for loss in (lc, le):  # the server's counts and its tokenizer, no estimate
        assert loss["ms"]["source"] in ("server", "tokenizer"), (loss, detail)
    assert changed["edited_chars"] >= gemma.notes["put_chars"][rid], (changed, detail)


def test_a_same_length_rewrite_tells_the_charges_apart(gemma: Case, gemma_full: Case) -> None:
    """The rewritten functions are new content though the message grew by nothing: had
    they been charged as old content, the client's part would be off by more than the
    tolerance."""
    client, _, detail = _truth(gemma, gemma_full, REWRITE_B)
    assert gemma_full.notes["put"][REWRITE_B] > TOLERANCE * client, detail
    (changed,) = gemma.row(REWRITE_B)["changed"]
    assert changed["chars_before"] == changed["chars_after"], changed


@pytest.mark.parametrize("mode", ["digest", "tokenized"])
def test_a_cache_that_can_go_back_has_no_server_part(gemma_full: Case, mode: str) -> None:
    """P lies at or before the change: the --swa-full server reused at least P, and
    nothing of its re-read is the server's."""
    for rid in EDITS:
        row = gemma_full.row(rid, mode)
        assert row["lost_external"] is None and row["cause"] == "structural", row
        assert row["prefix_tokens"] <= gemma_full.timings(rid)["cache_n"], row


@pytest.mark.parametrize("mode", ["digest", "tokenized"])
def test_appended_turns_lose_nothing(gemma: Case, mode: str) -> None:
    for rid in APPENDED:
        row = gemma.row(rid, mode)
        assert row["break_cause"] is None and row["lost_client"] is None, row
        assert row["lost_external"] is None, row


def test_the_digest_recording_holds_no_text(gemma: Case) -> None:
    """The chunks are numbers and hex digits: nothing of the pasted files is in the file."""
    text = Path(gemma.notes["digest_path"]).read_text()
    for needle in ("ingest_step", "export_step", "math.sqrt", "nightly import"):
        assert needle not in text
    levels = [
        level
        for line in gemma.digest.values()
        for m in line["request"]["digest"]["messages"]
        for level in m.get("chunks") or []
    ]
    assert levels and all(set(lv) == {"size", "ends", "hashes"} for lv in levels)
    assert all(set(lv["hashes"]) <= set("0123456789abcdef") for lv in levels)
