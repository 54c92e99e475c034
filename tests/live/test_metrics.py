"""`llmp.live.metrics`: the live view's rows as Prometheus metrics, checked against the report.

Each scenario recording is fed to the live view in end order (as the writer
feeds it), which gives each row to its `Metrics`; the output is parsed with prometheus_client's own parser and every number
compared with `llmp analyze` of the same recording.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmp.analysis.exchange import Exchange, prepare
from llmp.format.lines import parse_line
from llmp.live.contract import METRICS_PATH, RESERVED_PREFIX, LiveConfig
from llmp.live.metrics import CONTENT_TYPE, MAX_LABEL_CHARS, OTHER, Metrics
from llmp.live.view import LiveView
from tests.support import scenarios as sc

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
MARK = "MARKER-metrics-Zq3"
Labels = tuple[tuple[str, str], ...]


def live_metrics(traffic: sc.Traffic, **kw: Any) -> tuple[Metrics, list[dict[str, Any]]]:
    """The live view fed the recording in end order, as the writer feeds it; its metrics.

    With `kw` (label bounds), the view's metrics are replaced before the first record.
    """
    view = LiveView(LiveConfig(), say=lambda level, line: None)
    if kw:
        view.metrics = Metrics(view.engine.clients.label, **kw)
    recs = []
    for line in traffic.lines("digest", "end"):
        rec = parse_line(line)
        assert rec is not None
        recs.append(rec)
        view.on_record(rec)
    assert view.close() is not None
    text = view.metrics_text(written=len(recs), failed=0)
    assert text == view.metrics.render()
    return view.metrics, recs


def parsed(metrics: Metrics) -> dict[str, dict[Labels, float]]:
    """Sample name -> labels -> value, as Prometheus's own parser reads the scrape."""
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def served(recs: list[dict[str, Any]]) -> dict[int, str]:
    """The served model of each record (R20), as the analysis reads it."""
    out = {}
    for rec in recs:
        ex = prepare(rec)
        if isinstance(ex, Exchange):
            out[ex.id] = ex.served_model
    return out


def by(rows: list[dict[str, Any]], key: Any, value: Any) -> dict[Labels, float]:
    sums: dict[Labels, float] = defaultdict(float)
    for r in rows:
        for k, v in key(r):
            sums[k] += value(r, v)
    return dict(sums)


def close(got: dict[Labels, float], want: dict[Labels, float]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_number_agrees_with_llmp_analyze(tmp_path: Path, name: str) -> None:
    traffic = sc.SCENARIOS[name]()
    report = sc.analyse(traffic, tmp_path)
    metrics, recs = live_metrics(traffic)
    got = parsed(metrics)
    model = served(recs)
    rows = report["rows"]

    def head(r: dict[str, Any]) -> list[tuple[Labels, None]]:
        return [((("api", r["api"]), ("client", r["client"]), ("model", model[r["id"]])), None)]

    close(got["llmp_requests_total"], by(rows, head, lambda r, _: 1))
    turns = by(rows, head, lambda r, _: r["kind"] == "turn")
    close(got["llmp_turns_total"], turns)
    prefill = by(rows, head, lambda r, _: (sc.value(r["counts"]["prefill_ms"]) or 0) / 1000)
    close(got["llmp_prefill_seconds_total"], prefill)
    assert sum(prefill.values()) == pytest.approx(
        (sc.value(report["time"]["prefill_ms"]) or 0) / 1000
    )

    def losses(r: dict[str, Any]) -> list[tuple[Labels, dict[str, Any]]]:
        return [
            ((("cause", loss["cause"]), ("client", r["client"]), ("model", model[r["id"]])), loss)
            for loss in (r["lost_client"], r["lost_external"])
            if loss is not None
        ]

    lost_s = by(rows, losses, lambda r, loss: (sc.value(loss["ms"]) or 0) / 1000)
    close(got["llmp_lost_prefill_seconds_total"], lost_s)
    close(got["llmp_lost_tokens_total"], by(rows, losses, lambda r, loss: loss["tokens"]))
    # Summed over clients and models: the report's own totals by cause.
    for cause, c in report["time"]["by_cause"].items():
        mine = {k: v for k, v in got["llmp_lost_tokens_total"].items() if ("cause", cause) in k}
        assert sum(mine.values()) == c["tokens"]
        secs = [
            v for k, v in got["llmp_lost_prefill_seconds_total"].items() if ("cause", cause) in k
        ]
        assert sum(secs) == pytest.approx((sc.value(c["ms"]) or 0) / 1000)

    # The histogram: one observation per timed turn.
    timed = [r for r in rows if r["kind"] == "turn" and r["counts"]["prefill_ms"] is not None]
    counts = got["llmp_turn_prefill_seconds_count"]
    assert sum(counts.values()) == len(timed) == report["coverage"]["turns_with_timing"]
    assert sum(got["llmp_turn_prefill_seconds_sum"].values()) == pytest.approx(
        sum(sc.value(r["counts"]["prefill_ms"]) for r in timed) / 1000
    )
    for labels, n in counts.items():
        inf = got["llmp_turn_prefill_seconds_bucket"][tuple(sorted((*labels, ("le", "+Inf"))))]
        assert inf == n

    assert got["llmp_records_written_total"] == {(): report["coverage"]["records"]}
    assert got["llmp_records_failed_total"] == {(): 0}
    assert got["llmp_bad_chunks_total"] == {(): 0}
    assert "llmp_speculative_acceptance" not in got  # no draft model ran


def drafted() -> tuple[sc.Traffic, dict[int, tuple[int, int]]]:
    """A conversation whose responses carry llama-server's draft counts."""
    tr = sc.Traffic()
    sc.work(sc.Agent(tr, sc.LlamaServer()), 5)
    drafts = {}
    for rec in tr.records:
        n, a = 20 + rec["id"], 3 * rec["id"]
        rec["response"]["body"]["timings"].update(draft_n=n, draft_n_accepted=a)
        drafts[rec["id"]] = (n, a)
    return tr, drafts


def test_speculative_acceptance_is_the_reports(tmp_path: Path) -> None:
    traffic, drafts = drafted()
    report = sc.analyse(traffic, tmp_path)
    [spec] = report["speculative"]
    got = parsed(live_metrics(traffic)[0])
    key = (("model", spec["model"]),)
    assert got["llmp_speculative_draft_tokens_total"] == {key: spec["draft_n"]}
    assert got["llmp_speculative_accepted_tokens_total"] == {key: spec["draft_n_accepted"]}
    assert spec["draft_n"] == sum(n for n, _ in drafts.values())
    assert got["llmp_speculative_acceptance"][key] == pytest.approx(
        sum(a for _, a in drafts.values()) / spec["draft_n"]
    )
    assert round(got["llmp_speculative_acceptance"][key], 4) == spec["acceptance"]


def many_clients(n: int, ua: str = "agent-{i}/1.0") -> sc.Traffic:
    tr = sc.Traffic()
    for i in range(n):
        srv = sc.LlamaServer(model=f"/models/m{i % 5}.gguf")
        sc.Agent(tr, srv, ua=ua.format(i=i), system=f"Agent {i} ({MARK}).", tools=None).turn(
            f"question {i} ({MARK})", f"answer {i} ({MARK})"
        )
    return tr


def test_labels_are_bounded_and_the_rest_is_other() -> None:
    metrics, _ = live_metrics(many_clients(12), max_clients=4, max_models=2)
    got = parsed(metrics)
    requests = got["llmp_requests_total"]
    clients = {dict(k)["client"] for k in requests}
    models = {dict(k)["model"] for k in requests}
    assert clients == {"agent-0/1.0", "agent-1/1.0", "agent-2/1.0", "agent-3/1.0", OTHER}
    assert models == {"/models/m0.gguf", "/models/m1.gguf", OTHER}
    assert sum(requests.values()) == 12  # nothing is dropped, only folded
    assert sum(v for k, v in requests.items() if dict(k)["client"] == OTHER) == 8
    hist = {dict(k)["model"] for k in got["llmp_turn_prefill_seconds_count"]}
    assert hist == {"/models/m0.gguf", "/models/m1.gguf", OTHER}


def test_no_message_text_in_any_label() -> None:
    long_ua = "harness/" + "x" * 300 + " {i}"
    metrics, recs = live_metrics(many_clients(3, ua=long_ua))
    text = metrics.render().decode()
    assert MARK not in text
    agents = {r["request"]["headers"]["user-agent"] for r in recs}
    values: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values |= {v for k, v in s.labels.items() if k != "le"}
    for v in values:
        assert len(v) <= MAX_LABEL_CHARS
        # Every label value is an API, a user-agent (cut), a model or a cause: never text.
        assert (
            v in {"openai_chat", OTHER}
            or v.startswith("/models/")
            or any(a.startswith(v.rstrip("…")) for a in agents)
        ), v


def test_a_label_that_gains_its_harness_number_moves_its_counts() -> None:
    """Two harnesses behind one user-agent: the first rows' label gains ` #1` later."""
    tr = sc.Traffic()
    srv = sc.LlamaServer()
    ua = "OpenAI/Python 1.99.0"
    sc.work(sc.Agent(tr, srv, ua=ua, tools=sc.CODING_TOOLS[:2]), 2)
    metrics, _ = live_metrics(tr)
    assert {dict(k)["client"] for k in parsed(metrics)["llmp_requests_total"]} == {ua}
    sc.work(
        sc.Agent(
            tr, srv, ua=ua, system="Other. " * 30, tools=[sc.tool("browse", "Open.", u="string")]
        ),
        1,
        seed="b",
    )
    metrics, _ = live_metrics(tr)
    got = parsed(metrics)["llmp_requests_total"]
    assert {dict(k)["client"]: v for k, v in got.items()} == {f"{ua} #1": 2, f"{ua} #2": 1}


def test_recorder_counts_and_bad_chunks() -> None:
    metrics = Metrics(lambda key: "c")
    metrics.recorder(written=10, failed=2)
    metrics.recorder(written=4, failed=0)  # a smaller total never takes a counter down
    metrics.observe_record({"response": {"bad_chunks": 3}})
    metrics.observe_record({"response": {"bad_chunks": None}})
    metrics.observe_record({"response": None})
    metrics.observe_record({"response": {"bad_chunks": 2}})
    got = parsed(metrics)
    assert got["llmp_records_written_total"] == {(): 10}
    assert got["llmp_records_failed_total"] == {(): 2}
    assert got["llmp_bad_chunks_total"] == {(): 5}
    assert got["llmp_requests_total"] == {}  # declared, no series yet
    assert not math.isnan(got["llmp_bad_chunks_total"][()])


def test_render_is_prometheus_text_on_its_own_registry() -> None:
    from prometheus_client import REGISTRY

    a = Metrics(lambda key: "c")
    b = Metrics(lambda key: "c")
    a.recorder(written=1, failed=0)
    assert parsed(b)["llmp_records_written_total"] == {(): 0}  # registries are not shared
    assert REGISTRY.get_sample_value("llmp_records_written_total") is None
    assert CONTENT_TYPE.startswith("text/plain; version=")  # the text format, not protobuf
    assert METRICS_PATH.startswith(RESERVED_PREFIX)  # answered by the proxy, never forwarded


def test_every_metric_is_documented() -> None:
    metrics, _ = live_metrics(drafted()[0])
    exposed = {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(metrics.render().decode())
        if not f.name.endswith("_created")  # the library's companion of the histogram
    }
    documented = set(re.findall(r"^\| `(llmp_[a-z_]+)` \|", DOC.read_text(), flags=re.M))
    assert exposed == documented
    assert len(exposed) == 12
