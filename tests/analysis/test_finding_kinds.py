"""Every finding kind is one complete class, and the registry is the only list of them."""

from __future__ import annotations

from typing import Any

import pytest

from llmp.analysis import findings
from llmp.analysis.config import Config
from llmp.analysis.findings import BY_KIND, KINDS, FindingKind, Findings
from llmp.analysis.findings.base import Label, Tools
from llmp.analysis.gate import parse_kinds, reason
from llmp.analysis.render import sentence


def a_finding(kind: str, **evidence: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "model": "models/qwen3-8b.gguf",
        "client": "aider/0.86.1",
        "rows": [3, 5],
        "lost_tokens": 1200,
        "lost_ms": {"value": 2500, "source": "server"},
        "context_tokens": 700,
        "confidence": "high",
        "evidence": evidence,
    }


def test_kinds_are_derived_from_the_tuple() -> None:
    assert KINDS == tuple(k.name for k in Findings.kinds)
    assert len(set(KINDS)) == len(KINDS)
    assert BY_KIND == {k.name: k for k in Findings.kinds}
    # The spec's kinds first, in the order `--fail-on` has always listed them.
    assert KINDS[:5] == (
        "side_call_on_conversation_model",
        "prefix_break",
        "server_cache_loss",
        "other_conversation_eviction",
        "other_model_eviction",
    )
    # Each kind's name constant is its class's.
    for kind in Findings.kinds:
        constant = kind.name.upper().replace(
            "SIDE_CALL_ON_CONVERSATION_MODEL", "SIDE_CALL_ON_MODEL"
        )
        assert getattr(findings, constant) == kind.name


@pytest.mark.parametrize("kind", Findings.kinds, ids=lambda k: k.name)
def test_every_kind_has_a_build_a_sentence_and_a_gate_line(kind: type[FindingKind]) -> None:
    assert issubclass(kind, FindingKind) and kind.name
    # Abstract methods left out (build, sentence) would refuse to instantiate.
    instance = kind(Config())
    assert instance.build(lambda key: f"client {key}", {}) == []  # nothing collected, nothing found
    f = a_finding(kind.name, tool="grep", offered=40, truncated=2, turns=2, break_cause="x")
    what, fix = kind.sentence(f)
    assert what and what != f"{kind.name}: 2.5 s lost (1,200 tokens)."  # not the fallback
    assert isinstance(fix, str)
    assert sentence(f) == (what, fix)  # the readable report reads the class
    line = reason(f)
    assert line.startswith(f"llmp: FAIL {kind.name}")
    assert line.endswith(kind.gate_size(f))
    detail = kind.gate_detail(f)
    assert (f"{kind.name} ({detail}) " in line) == bool(detail)


def test_the_gate_lines_of_the_context_kinds() -> None:
    tool = a_finding("unused_tool", tool="grep", offered=1)
    assert (
        reason(tool)
        == "llmp: FAIL unused_tool (grep) aider/0.86.1: offered in 1 request, never called"
    )
    system = a_finding("large_system_prompt", system_tokens=9000, threshold=4000)
    assert reason(system) == (
        "llmp: FAIL large_system_prompt aider/0.86.1: 9,000 tokens (threshold 4,000)"
    )
    cut = {
        **a_finding("context_overflow", truncated=2, refused=1, turns=3, n_ctx=4096),
        "client": None,
    }
    assert reason(cut) == (
        "llmp: FAIL context_overflow qwen3-8b.gguf: 3 turns over the context "
        "(2 cut silently, 1 refused), n_ctx 4,096"
    )


class _Rogue(FindingKind):
    """A kind that builds a finding under a name the registry does not hold."""

    name = "prefix_break"

    def build(self, label: Label, tools: Tools) -> list[dict[str, Any]]:
        return [a_finding("not_a_kind")]

    @classmethod
    def sentence(cls, f: dict[str, Any]) -> tuple[str, str]:
        return ("", "")


def test_a_finding_outside_the_registry_cannot_be_built() -> None:
    found = Findings(Config())
    assert found.build(lambda key: "c", {}) == []
    found.each = (*found.each, _Rogue(Config()))
    with pytest.raises(AssertionError, match="prefix_break"):
        found.build(lambda key: "c", {})
    assert parse_kinds(["not_a_kind"]) == ([], ["not_a_kind"])
    # A report from elsewhere with an unknown kind still reads, as its loss.
    assert sentence(a_finding("not_a_kind")) == ("not_a_kind: 2.5 s lost (1,200 tokens).", "")


def test_only_the_kinds_that_read_a_hook_are_fed_it() -> None:
    found = Findings(Config())
    assert [k.name for k in found._row] == [
        "context_overflow",
        "provider_evicted",
        "unread_cache_writes",
    ]
    assert [k.name for k in found._turn] == ["large_system_prompt"]
    assert {k.name for k in found._refused} == {"prefix_break", "context_overflow"}
    assert "unused_tool" not in {k.name for k in found._linked}


def test_a_server_finding_gives_the_fix_of_the_latest_word_on_the_server() -> None:
    """A vLLM's build may show only after its loss (its 128-token blocks learned later):
    the finding names the server its last linked turn was told to be."""
    from llmp.analysis.findings.server import ServerCacheLoss
    from llmp.analysis.loss import Between
    from llmp.analysis.rows import Loss, Row
    from llmp.apis.base import Counts

    def row(rid: int, server: str, lost: Loss | None) -> Row:
        comp = ((0, "estimate"),) * 4
        return Row(
            id=rid, api="openai_chat", model="smol", client=0, t_start_ms=rid, kind="turn",
            side_call_shape=None, session=1, conversation=1, turn=rid, counts=Counts(),
            composition=comp, linked_to=rid - 1, lost_external=lost, served="smol",
            server=server,
        )  # fmt: skip

    kind = ServerCacheLoss(Config())
    capacity = Loss("server_capacity", 5000, (9000.0, "proxy"))
    kind.linked(row(2, "vLLM", capacity), Between([], [3], [], []), False)
    kind.linked(row(4, "vLLM (CPU)", None), Between([], [], [], []), False)
    (f,) = kind.build(lambda key: "client", {})
    assert f["evidence"]["server"] == "vLLM (CPU)"
    assert "VLLM_CPU_KVCACHE_SPACE" in sentence(f)[1]
