"""Where inside a long message it changed (R31's P), and what of it is new, from a
digest's content-defined chunks.

A file pasted into a user message is edited in its middle: a line inserted, or a block
of lines rewritten with as many characters.  The simulated llama-server that can return
to any position (the truth: what `--swa-full` does) reuses everything before the edit;
the sliding-window one without `--swa-full` re-reads from 0.  The split of that loss
between the client (the old content after the edit) and the server (what it re-read
before the edit) must follow the truth in a digest recording as in a full one; without
the chunks (an older recording) the old rule stands.  The real server's run is
tests/real/test_where_inside.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmp.analysis import analyze, loss
from llmp.analysis.causes import SYSTEM_CHANGED
from llmp.analysis.config import Config
from llmp.analysis.exchange import Digested, read_record
from llmp.analysis.loss import Structure
from llmp.apis.base import Counts
from llmp.apis.servers import LLAMA_SERVER, VLLM_CPU, Server
from llmp.format.chunks import size_of
from llmp.format.lines import parse_line
from llmp.format.measure import ESTIMATE
from tests.support import scenarios as sc
from tests.support.scenarios import analyse, rows_by_id, value

EDIT_ROW = 3
TOLERANCE = 0.10
REPLY_2 = "Every seventh one, starting with step_6."
QUESTION_3 = "I added a note; does it break anything?"


def pasted_file(lines: int = 180) -> str:
    return "\n".join(
        f"def step_{i}(values, scale={i % 7}):  # stage {i} of the nightly import"
        for i in range(lines)
    )


INSERT, REPLACE = "insert", "replace"
NOTE = "# TODO: check the scale here"
REWRITTEN = 15
"""Lines a replacement rewrites: some 900 characters, a sixth of what follows them at
the middle of the file, so a charge that took none of it for new would be off by more
than the tolerance."""


def _edit(lines: list[str], where: float, how: str) -> tuple[list[str], int]:
    """The pasted file's lines with one edit `where` of the way down, and the characters
    of new text the edit put there."""
    cut = int(len(lines) * where)
    if how == INSERT:
        return [*lines[:cut], NOTE, *lines[cut:]], len(NOTE) + 1
    new = [line.replace("values, scale=", "weights, fact=") for line in lines]
    new = lines[:cut] + new[cut : cut + REWRITTEN] + lines[cut + REWRITTEN :]
    span = sum(len(line) + 1 for line in lines[cut : cut + REWRITTEN]) - 1
    return new, span


def _traffic(
    server: sc.LlamaServer, where: float = 0.5, how: str = INSERT, text: str | None = None
) -> tuple[sc.Traffic, int, int]:
    """Three turns; the third edits the pasted file (`text`, else `pasted_file()`) at
    `where` of its lines.  Also returns the character at which the message changed, and
    how many of its characters the edit put there."""
    tr = sc.Traffic()
    a = sc.Agent(tr, server, tools=None)
    lines = (text or pasted_file()).split("\n")
    before = "Here is the module I am working on:\n"
    a.turn(before + "\n".join(lines), "It defines 180 import stages.")
    a.turn("Which stage scales by 6?", REPLY_2)
    new_lines, span = _edit(lines, where, how)
    edited = before + "\n".join(new_lines)
    old = a.messages[1]["content"]
    assert (len(edited) == len(old)) == (how == REPLACE)
    a.messages[1] = {"role": "user", "content": edited}
    a.turn(QUESTION_3, "No, it is a comment.")
    changed_at = next(i for i, (x, y) in enumerate(zip(edited, old, strict=False)) if x != y)
    return tr, changed_at, span


def _truth(where: float, how: str = INSERT, text: str | None = None) -> tuple[int, int, int, int]:
    """The server's part (P less what the window cache reused), and the client's (what a
    cache that can go back re-read, less the new content: the new messages and what the
    edit put in), from the servers' counts; where the message changed, and how many of
    its characters the edit put there."""
    swa, _, _ = _traffic(sc.LlamaServer(swa=True), where, how, text)
    full, changed_at, span = _traffic(sc.LlamaServer(), where, how, text)
    a, b = swa.records[EDIT_ROW - 1], full.records[EDIT_ROW - 1]
    reused = b["response"]["body"]["timings"]["cache_n"]
    read = b["response"]["body"]["timings"]["prompt_n"]
    assert a["response"]["body"]["timings"]["cache_n"] == 0  # the window cache went to 0
    # The new messages: the previous reply and the new question (4 characters a token).
    new = sum(len(sc.chunks(t)) for t in (REPLY_2, QUESTION_3))
    return reused, read - new - span // 4, changed_at, span


def _near(got: int, truth: int, what: str) -> None:
    assert abs(got - truth) <= TOLERANCE * truth, f"{what}: {got} vs {truth}"


@pytest.mark.parametrize("mode", ["digest", "full"])
@pytest.mark.parametrize(
    ("how", "where"), [(INSERT, 0.3), (INSERT, 0.5), (INSERT, 0.8), (REPLACE, 0.5)]
)
def test_an_edit_in_a_pasted_file_is_split_as_the_server_did(
    tmp_path: Path, mode: str, how: str, where: float
) -> None:
    server_truth, client_truth, changed_at, span = _truth(where, how)
    tr, _, _ = _traffic(sc.LlamaServer(swa=True), where, how)
    row = rows_by_id(analyse(tr, tmp_path, mode))[EDIT_ROW]
    assert row["break_cause"] == "history_rewritten", row
    lc, le = row["lost_client"], row["lost_external"]
    assert le is not None and le["cause"] == "server_no_rollback", row
    _near(le["tokens"], server_truth, "server part")
    _near(lc["tokens"], client_truth, "client part")
    (changed,) = row["changed"]
    assert changed["within"] == "between"  # both 256-character ends are unchanged
    longest = 4 * size_of(changed["chars_after"])  # a chunk is at most 4 sizes long
    kept, edited = changed["kept_chars"], changed["edited_chars"]
    assert kept <= changed_at < kept + longest
    assert changed_at + span <= kept + edited <= changed_at + span + 2 * longest
    if mode == "full":
        assert changed["offset"] == changed_at


def test_a_same_length_replacement_is_new_content(tmp_path: Path) -> None:
    """The rewritten block grew the message by nothing, yet it is new: charged as old
    content, the client's part would be off by more than the tolerance."""
    _, client_truth, _, span = _truth(0.5, REPLACE)
    assert span // 4 > TOLERANCE * client_truth  # the case tells the two charges apart
    tr, _, _ = _traffic(sc.LlamaServer(swa=True), 0.5, REPLACE)
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    (changed,) = row["changed"]
    assert changed["chars_before"] == changed["chars_after"]
    assert changed["edited_chars"] >= span
    _near(row["lost_client"]["tokens"], client_truth, "client part")


def test_a_checkpoint_inside_the_message_is_no_return_to_the_change(tmp_path: Path) -> None:
    """The window cache restores a checkpoint past the message's start but short of the
    change: that is no sign of a cache that can go back, and what it re-read from the
    checkpoint to the change is still the server's."""
    truth_p, _, _, _ = _truth(0.5)
    tr, _, _ = _traffic(sc.LlamaServer(swa=True, swa_every=1000))
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    reused = value(row["counts"]["reused_tokens"])
    assert 400 < reused == 1000 < truth_p - 500  # inside the pasted file, before the change
    le = row["lost_external"]
    assert le is not None and le["cause"] == "server_no_rollback", row
    _near(le["tokens"], truth_p - reused, "server part")


def test_the_fast_path_reads_the_chunks(tmp_path: Path) -> None:
    """Every line of the digest recording takes the fast path (`FastMsg` declares the
    field), which keeps each message's chunks as the plain path does."""
    tr, _, _ = _traffic(sc.LlamaServer(swa=True))
    path = tr.write(tmp_path / "rec.jsonl", "digest")
    lines = path.read_bytes().splitlines()
    fast = [read_record(line) for line in lines]
    assert all(isinstance(d, Digested) for d in fast)
    plain = [parse_line(line) for line in lines]
    for d, rec in zip(fast, plain, strict=True):
        assert isinstance(d, Digested) and isinstance(rec, dict)
        want = [m["chunks"] for m in rec["request"]["digest"]["messages"]]
        got = [json.loads(msgspec.json.encode(m.chunks)) for m in d.msgs]
        assert got == want
    assert any(c is not None for c in want)


@pytest.mark.parametrize("how", [INSERT, REPLACE])
def test_digest_and_full_charge_alike(tmp_path: Path, how: str) -> None:
    tr, _, _ = _traffic(sc.LlamaServer(swa=True), 0.5, how)
    rows = [rows_by_id(analyse(tr, tmp_path, mode))[EDIT_ROW] for mode in ("digest", "full")]
    for key in ("prefix_tokens", "lost_client", "lost_external", "predicted_reuse"):
        assert rows[0][key] == rows[1][key], key
    for key in ("kept_chars", "edited_chars"):
        assert rows[0]["changed"][0][key] == rows[1]["changed"][0][key], key


@pytest.mark.parametrize("how", [INSERT, REPLACE])
def test_a_server_that_can_go_back_is_not_blamed(tmp_path: Path, how: str) -> None:
    """P lies at or before the change, never past it: a cache that returns to the change
    reuses at least P, and nothing is charged to it."""
    tr, _, _ = _traffic(sc.LlamaServer(), 0.5, how)
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    assert row["lost_external"] is None and row["lost_client"] is not None
    assert row["cause"] == "structural"
    assert row["prefix_tokens"] <= value(row["counts"]["reused_tokens"])


def test_without_chunks_the_old_rule_stands(tmp_path: Path) -> None:
    """A recording made before the chunks reads as before: the change is placed after
    the message's first 256 characters, only what it grew by is new, and the server's
    part is mostly missed."""
    server_truth, _, _, _ = _truth(0.5)
    tr, _, _ = _traffic(sc.LlamaServer(swa=True))
    path = tr.write(tmp_path / "rec.jsonl", "digest")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    stripped = 0
    for rec in lines:
        for m in rec["request"]["digest"]["messages"]:
            stripped += m.pop("chunks", None) is not None
    assert stripped >= 3  # the pasted file, in each of the three turns
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    result = analyze([str(old)])
    try:
        row: dict[str, Any] = rows_by_id(result.report())[EDIT_ROW]
    finally:
        result.close()
    (changed,) = row["changed"]
    assert changed["kept_chars"] == 256
    assert changed["edited_chars"] == len(NOTE) + 1  # what it grew by
    assert row["lost_external"]["cause"] == "server_no_rollback"
    assert row["lost_external"]["tokens"] < 0.5 * server_truth


def test_a_text_too_regular_to_cut_by_content(tmp_path: Path) -> None:
    """Lines all alike give the rolling hash no cut, so only the length limit cuts, and
    every cut after an inserted line moves with it: the chunks never match again.  The
    end of the message is as before (R5's tail), so the span is no measure of the edit:
    only what the message grew by is new, and the client is charged the old text after
    the edit, as the server re-read it."""
    text = "\n".join(["Read before you edit."] * 280)
    server_truth, client_truth, changed_at, _ = _truth(0.5, INSERT, text)
    tr, _, _ = _traffic(sc.LlamaServer(swa=True), 0.5, INSERT, text)
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    (changed,) = row["changed"]
    assert changed["kept_chars"] + changed["edited_chars"] == changed["chars_after"]  # no match
    assert changed["kept_chars"] <= changed_at
    _near(row["lost_client"]["tokens"], client_truth, "client part")
    _near(row["lost_external"]["tokens"], server_truth, "server part")


def _clock_at_the_end(server: Server) -> tuple[Any, Any]:
    """A clock at the end of a 1,000-token system prompt changed (estimated units, P
    placed by its chunks to within 12), but the server's tokenizer packs the system text
    looser than the rest: P scaled by the prompt's overall ratio lands some 300 tokens
    past where the server's own tokens change.  The server reused 640, five blocks."""
    st = Structure((1000, ESTIMATE), (0, ESTIMATE), (200, ESTIMATE), (40, ESTIMATE), linked=True)
    st.prefix, st.within, st.within_slack = 990, 980, 12
    st.break_cause, st.after, st.fresh, st.messages, st.before = SYSTEM_CHANGED, 250, 40, 5, 0
    counts = Counts.server(1240, 8, 640, 600)
    return st, loss.losses(st, counts, None, Config(), server=server)


def test_a_shared_cache_goes_back_to_the_block_before_the_change() -> None:
    """vLLM keeps every whole block of a prompt, so it re-reads from the block before the
    change wherever an estimate put it: reuse short of the estimated P, inside the changed
    message, is the estimate's error, not the server's loss (the real vLLM's clock,
    tests/real/test_vllm.py).  A slot cache that was never seen going back is held to
    the estimate: the same counts charge it."""
    _, shared = _clock_at_the_end(VLLM_CPU)
    assert shared.lost_external is None
    assert shared.lost_client is not None and shared.lost_client.tokens == 600 - 40
    _, slot = _clock_at_the_end(LLAMA_SERVER)
    assert slot.lost_external is not None and slot.lost_external.tokens > 128
