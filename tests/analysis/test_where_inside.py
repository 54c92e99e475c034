"""Where inside a long message it changed (R31's P), from a digest's prefix hashes.

A file pasted into a user message is edited in its middle.  The simulated llama-server
that can return to any position (the truth: what `--swa-full` does) reuses everything
before the edit; the sliding-window one without `--swa-full` re-reads from 0.  The
split of that loss between the client and the server must follow the truth in a
digest recording as in a full one; without the prefix hashes (an older recording) the
old rule stands.  The real server's run is tests/real/test_where_inside.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmp.analysis import analyze
from llmp.analysis.exchange import Digested, read_record
from llmp.format.lines import parse_line
from llmp.format.prefixes import step_of
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


def _traffic(server: sc.LlamaServer, where: float = 0.5) -> tuple[sc.Traffic, int]:
    """Three turns; the third edits the pasted file at `where` of its lines.  Also
    returns the character at which the message changed."""
    tr = sc.Traffic()
    a = sc.Agent(tr, server, tools=None)
    lines = pasted_file().split("\n")
    before = "Here is the module I am working on:\n"
    a.turn(before + "\n".join(lines), "It defines 180 import stages.")
    a.turn("Which stage scales by 6?", REPLY_2)
    cut = int(len(lines) * where)
    edited = before + "\n".join([*lines[:cut], "# TODO: check the scale here", *lines[cut:]])
    old = a.messages[1]["content"]
    a.messages[1] = {"role": "user", "content": edited}
    a.turn(QUESTION_3, "No, it is a comment.")
    changed_at = next(i for i, (x, y) in enumerate(zip(edited, old, strict=False)) if x != y)
    return tr, changed_at


def _truth(where: float) -> tuple[int, int, int]:
    """The server's part (P less what the window cache reused), and the client's (what a
    cache that can go back re-read, less the new messages), from the servers' counts;
    and where the message changed."""
    swa, _ = _traffic(sc.LlamaServer(swa=True), where)
    full, changed_at = _traffic(sc.LlamaServer(), where)
    a, b = swa.records[EDIT_ROW - 1], full.records[EDIT_ROW - 1]
    reused = b["response"]["body"]["timings"]["cache_n"]
    read = b["response"]["body"]["timings"]["prompt_n"]
    assert a["response"]["body"]["timings"]["cache_n"] == 0  # the window cache went to 0
    # The new messages: the previous reply and the new question (4 characters a token).
    new = sum(len(sc.chunks(t)) for t in (REPLY_2, QUESTION_3))
    return reused, read - new, changed_at


def _near(got: int, truth: int, what: str) -> None:
    assert abs(got - truth) <= TOLERANCE * truth, f"{what}: {got} vs {truth}"


@pytest.mark.parametrize("mode", ["digest", "full"])
@pytest.mark.parametrize("where", [0.3, 0.5, 0.8])
def test_an_edit_in_a_pasted_file_is_split_as_the_server_did(
    tmp_path: Path, mode: str, where: float
) -> None:
    server_truth, client_truth, changed_at = _truth(where)
    tr, _ = _traffic(sc.LlamaServer(swa=True), where)
    row = rows_by_id(analyse(tr, tmp_path, mode))[EDIT_ROW]
    assert row["break_cause"] == "history_rewritten", row
    lc, le = row["lost_client"], row["lost_external"]
    assert le is not None and le["cause"] == "server_no_rollback", row
    _near(le["tokens"], server_truth, "server part")
    _near(lc["tokens"], client_truth, "client part")
    (changed,) = row["changed"]
    assert changed["within"] == "between"  # both 256-character ends are unchanged
    step = step_of(changed["chars_after"])
    assert changed["kept_chars"] <= changed_at < changed["kept_chars"] + step
    if mode == "full":
        assert changed["offset"] == changed_at


def test_a_checkpoint_inside_the_message_is_no_return_to_the_change(tmp_path: Path) -> None:
    """The window cache restores a checkpoint past the message's start but short of the
    change: that is no sign of a cache that can go back, and what it re-read from the
    checkpoint to the change is still the server's."""
    truth_p, _, _ = _truth(0.5)
    tr, _ = _traffic(sc.LlamaServer(swa=True, swa_every=1000))
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    reused = value(row["counts"]["reused_tokens"])
    assert 400 < reused == 1000 < truth_p - 500  # inside the pasted file, before the change
    le = row["lost_external"]
    assert le is not None and le["cause"] == "server_no_rollback", row
    _near(le["tokens"], truth_p - reused, "server part")


def test_the_fast_path_reads_the_prefixes(tmp_path: Path) -> None:
    """Every line of the digest recording takes the fast path (`FastMsg` declares the
    field), which keeps each message's prefixes as the plain path does."""
    tr, _ = _traffic(sc.LlamaServer(swa=True))
    path = tr.write(tmp_path / "rec.jsonl", "digest")
    lines = path.read_bytes().splitlines()
    fast = [read_record(line) for line in lines]
    assert all(isinstance(d, Digested) for d in fast)
    plain = [parse_line(line) for line in lines]
    for d, rec in zip(fast, plain, strict=True):
        assert isinstance(d, Digested) and isinstance(rec, dict)
        want = [m["prefixes"] for m in rec["request"]["digest"]["messages"]]
        assert [m.prefixes for m in d.msgs] == want
    assert any(p is not None for p in want)


def test_digest_and_full_charge_alike(tmp_path: Path) -> None:
    tr, _ = _traffic(sc.LlamaServer(swa=True))
    rows = [rows_by_id(analyse(tr, tmp_path, mode))[EDIT_ROW] for mode in ("digest", "full")]
    for key in ("prefix_tokens", "lost_client", "lost_external", "predicted_reuse"):
        assert rows[0][key] == rows[1][key], key
    assert rows[0]["changed"][0]["kept_chars"] == rows[1]["changed"][0]["kept_chars"]


def test_a_server_that_can_go_back_is_not_blamed(tmp_path: Path) -> None:
    """P lies at or before the change, never past it: a cache that returns to the change
    reuses at least P, and nothing is charged to it."""
    tr, _ = _traffic(sc.LlamaServer())
    row = rows_by_id(analyse(tr, tmp_path, "digest"))[EDIT_ROW]
    assert row["lost_external"] is None and row["lost_client"] is not None
    assert row["cause"] == "structural"
    assert row["prefix_tokens"] <= value(row["counts"]["reused_tokens"])


def test_without_prefix_hashes_the_old_rule_stands(tmp_path: Path) -> None:
    """A recording made before the prefix hashes reads as before: the change is placed
    after the message's first 256 characters, and the server's part is mostly missed."""
    server_truth, _, _ = _truth(0.5)
    tr, _ = _traffic(sc.LlamaServer(swa=True))
    path = tr.write(tmp_path / "rec.jsonl", "digest")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    stripped = 0
    for rec in lines:
        for m in rec["request"]["digest"]["messages"]:
            stripped += m.pop("prefixes", None) is not None
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
    assert row["lost_external"]["cause"] == "server_no_rollback"
    assert row["lost_external"]["tokens"] < 0.5 * server_truth
