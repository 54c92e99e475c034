"""A row's fields come in the report's order, whatever values it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.analysis.rows import Loss, Row
from llmp.apis.base import Counts
from llmp.cli import main
from llmp.format.measure import ESTIMATE, SERVER
from tests.support import scenarios as sc

ROW_KEYS = [
    "id", "api", "model", "client", "t_start_ms", "kind", "side_call_shape", "session",
    "conversation", "turn", "counts", "composition", "linked_to", "new_conversation",
    "prefix_tokens", "break_cause", "compaction", "predicted_reuse", "observed_reuse",
    "cause", "lost_client", "lost_external", "side_calls_between",
    "other_conversations_between", "other_domains_between", "loss_measured", "changed",
]  # fmt: skip
COUNT_KEYS = [
    "prompt_tokens", "completion_tokens", "reused_tokens", "evaluated_tokens",
    "prefill_ms", "decode_ms", "load_ms",
]  # fmt: skip


def test_every_row_has_the_report_fields_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Side-calls, turns that lose their cache and turns that do not: rows where
    # different fields are null.
    path = sc.title_side_call().write(tmp_path / "r.jsonl", "digest")
    assert main(["analyze", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    rows = orjson.loads(out)["rows"]
    assert len({r["kind"] for r in rows}) > 1
    assert any(r["linked_to"] is None for r in rows) and any(r["linked_to"] for r in rows)
    for row in rows:
        assert list(row) == ROW_KEYS
        assert list(row["counts"]) == COUNT_KEYS
        assert list(row["composition"]) == ["system", "tools", "history", "new_content"]


SMALL = st.one_of(st.integers(0, 10**9), st.floats(0, 1e9))
NUMBERS = st.one_of(
    *[SMALL] * 12,  # most numbers small: rows with one large one among them
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e15, max_value=1e17),
    st.floats(min_value=-1e17, max_value=-1e15),
    st.sampled_from([0, 0.0, -0.0, 1e16, -1e16, 9999999999999998.0, 2**63, 2**64 - 1, 2**64]),
)
MVS = st.one_of(st.none(), st.tuples(NUMBERS, st.sampled_from([SERVER, ESTIMATE])))
LOSSES = st.one_of(st.none(), st.builds(Loss, st.sampled_from(["a", "b"]), NUMBERS, MVS))


def _text(row: Row, how: str) -> bytes | str:
    """The row's text, or the error that writing it raised."""
    try:
        return row.tail_json() if how == "fast" else orjson.dumps(row.tail())
    except TypeError as e:  # orjson: an integer past 64 bits
        return str(e)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(MVS, min_size=7, max_size=7),
    st.lists(st.tuples(NUMBERS, st.sampled_from([SERVER, ESTIMATE])), min_size=4, max_size=4),
    st.one_of(st.none(), NUMBERS),
    st.one_of(st.none(), NUMBERS),
    LOSSES,
    LOSSES,
    st.one_of(st.none(), st.just([{"index": 1, "role": "user\x00\u2028", "within": "x"}])),
)
def test_row_text_is_orjsons(
    counts: list[Any],
    comp: list[Any],
    prefix: Any,
    reuse: Any,
    lost: Loss | None,
    external: Loss | None,
    changed: list[dict[str, Any]] | None,
) -> None:
    """`Row.tail_json` (msgspec, when every number is small) writes the bytes orjson
    writes, or fails as orjson does: floats from 1e16 on, integers past 64 bits, NaN."""
    row = Row(
        7, "openai_chat", "m", 0, 1788596356721, "turn", None, 1, 2, 3,
        Counts(*counts), (comp[0], comp[1], comp[2], comp[3]),
        5, False, prefix, None, False, reuse, reuse, None, lost, external,
        [1, 2], [], [3], True, changed,
    )  # fmt: skip
    assert _text(row, "fast") == _text(row, "plain")


LARGE: list[Any] = [1e16, -1e16, 1.5e300, float("nan"), 2**64, -(2**63) - 1]


@pytest.mark.parametrize("value", LARGE, ids=repr)
@pytest.mark.parametrize("where", range(18))
def test_one_large_number_is_written_as_orjson_writes_it(where: int, value: Any) -> None:
    """Each number of a row, alone too large for msgspec's text, takes orjson's."""
    nums: list[Any] = [1, 2, 3, 4, 5.5, 6.5, 7.5, 8, 9, 10, 11, 12, 0.5, 0.25, 13, 14.5, 15, 16.5]
    nums[where] = value
    mvs: list[Any] = [(n, SERVER) for n in nums[:7]]
    counts = Counts(*mvs)
    comp = [(n, ESTIMATE) for n in nums[7:11]]
    row = Row(
        7, "openai_chat", "m", 0, 1788596356721, "turn", None, 1, 2, 3,
        counts, (comp[0], comp[1], comp[2], comp[3]),
        5, False, nums[11], None, False, nums[12], nums[13], None,
        Loss("a", nums[14], (nums[15], SERVER)), Loss("b", nums[16], (nums[17], SERVER)),
        [1, 2], [], [3], True, None,
    )  # fmt: skip
    assert _text(row, "fast") == _text(row, "plain")
