"""R37's agreement: llmp's cause against the provider's own diagnosis, row by row."""

from __future__ import annotations

from llmp.analysis.report import Agreement
from llmp.analysis.rows import Loss, Row
from llmp.apis.base import Counts


def row(rid: int, kind: str, linked: int | None, reason: str, lost: Loss | None = None) -> Row:
    comp = ((0, "estimate"),) * 4
    return Row(
        id=rid, api="openai_responses", model="gpt-5.6", client=0, t_start_ms=rid, kind=kind,
        side_call_shape="summarise" if kind == "side_call" else None, session=1,
        conversation=1 if kind == "turn" else None, turn=rid, counts=Counts(),
        composition=comp, linked_to=linked, lost_external=lost, server="openai",
        provider_reason=reason,
    )  # fmt: skip


def test_rows_llmp_compared_with_nothing_are_not_compared() -> None:
    """Codex's compaction request (a side-call, sent without its tools) is told
    `tools_changed` against the turn before it; llmp compared it with nothing, so there
    is no cause to disagree with.  A linked turn's miss the provider names still counts."""
    a = Agreement()
    a.add(row(1, "turn", None, "comparison_response_not_found"))
    a.add(row(2, "side_call", None, "tools_changed"))
    a.add(row(3, "turn", None, "input_changed"))  # a first turn, by llmp's linking
    assert a.report() == {"compared": 0, "agreed": 0, "disagreed": []}
    evicted = Loss("provider_evicted", 9560, None)
    a.add(row(4, "turn", 1, "none", evicted))
    a.add(row(5, "turn", 4, "tools_changed"))  # a miss llmp did not see: disagreed
    a.add(row(6, "turn", 5, "none"))  # nothing missed on either side
    assert a.report() == {
        "compared": 2,
        "agreed": 1,
        "disagreed": [{"row": 5, "llmp": None, "provider": "tools_changed"}],
    }
