"""A real agent harness (aider) recorded in front of the real llama-server, analysed,
and every verdict checked against the server's own counters (bench/real_harness.py).

Needs ``LLMP_LLAMA_SERVER`` and ``LLMP_LLAMA_MODEL``, and aider: ``LLMP_AIDER``
naming an aider executable, the cached venv that
``.venv/bin/python bench/real_harness.py --setup-only`` installs, or one on PATH.
Nothing is installed here.  About three minutes on two cores.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.real import llama_paths

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "real_harness", REPO / "bench" / "real_harness.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_harness"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _bench()
_LLAMA = llama_paths()
_AIDER = bench.find_aider()

pytestmark = [
    pytest.mark.real_server,
    pytest.mark.e2e,
    pytest.mark.skipif(isinstance(_LLAMA, str), reason=str(_LLAMA)),
    pytest.mark.skipif(
        _AIDER is None,
        reason=f"no aider: set {bench.AIDER_ENV} or run bench/real_harness.py --setup-only",
    ),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    out = tmp_path_factory.mktemp("real-harness")
    assert _AIDER is not None
    res = bench.run(out, _AIDER)
    print(bench.summary(res))
    yield res


def _rows(res: Any) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in res.report["rows"]}


def _models(res: Any) -> dict[int, str | None]:
    out: dict[int, str | None] = {}
    for rec in bench.read_records(res.recording):
        body = rec["request"].get("body")
        out[rec["id"]] = body.get("model") if isinstance(body, dict) else None
    return out


def test_every_verdict_agrees_with_the_server(result: Any) -> None:
    failed = [c for c in result.checks if not c.ok]
    assert result.checks and not failed, bench.summary(result)


def test_the_scenario_happened(result: Any) -> None:
    """The traffic has what the checks are meant to cover."""
    steps = {s.kind for s in result.steps}
    assert {"say", "cmd", "edit", "restart", "outage"} <= steps
    cov = result.report["coverage"]
    assert cov["turns"] >= 7 and cov["conversations"] == 1
    assert cov["skipped"]["error"] + cov["skipped"]["non_2xx"] >= 1  # the outage's retries
    # The recording was enriched: compositions are tokenizer counts.
    assert all(r["composition"]["system"]["source"] == "tokenizer" for r in result.report["rows"])


def test_weak_model_calls_are_side_calls_that_evict(result: Any) -> None:
    rows = _rows(result)
    models = _models(result)
    weak = [i for i, m in models.items() if m == bench.WEAK_MODEL and i in rows]
    assert weak and all(rows[i]["kind"] == "side_call" for i in weak)
    # The turn after the /commit call: its cache collapsed, blamed on the side-call.
    after = [r for r in rows.values() if r["kind"] == "turn" and r["side_calls_between"]]
    assert after
    for r in after:
        truth = result.truths[r["id"]]
        assert truth.lost and truth.lost > 100
        assert r["lost_external"]["cause"] == "side_call"
        assert r["cause"] in ("side_call", "structural")


def test_ask_mode_and_outage(result: Any) -> None:
    rows = _rows(result)
    turns = [r for r in rows.values() if r["kind"] == "turn"]
    # /ask and the turn after it: the client changed its system prompt, in one conversation.
    changed = [r for r in turns if r["break_cause"] == "system_changed"]
    assert len(changed) == 2 and all(r["cause"] == "structural" for r in changed)
    assert all(r["lost_external"] is None for r in changed)
    # The server restarted under aider's retries: the next turn's loss is the server's.
    reset = [r for r in turns if r["cause"] == "server_reset"]
    assert len(reset) == 1
    assert reset[0]["lost_external"]["cause"] == "server_empty"
