"""`GET /_llmp/metrics` through the real mitmdump: Prometheus text that agrees with `llmp analyze`.

A scripted agent, driven by the real `openai` client, talks to the fake
llama-server through the proxy: turns, a changed system prompt (a cold
prefill charged to the client) and a request the server refuses.  The scrape
is parsed with prometheus_client's own parser and every family compared with
the report of the same recording.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_checks import analyze, value
from tests.support.mitm import Mitmdump, read_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

MARK = "MARKER-m3Tr"  # in every message; must be in no label or value
UA = "opencode/1.0.0"
SYSTEM = f"You are an agent ({MARK}). Work carefully. " * 40


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(text: str) -> Samples:
    """name → labels → value, as Prometheus would read the text (`_created` left out)."""
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(
        v for labels, v in samples[name].items() if set(match.items()) <= set(dict(labels).items())
    )


def test_the_scrape_agrees_with_the_report(llama: Upstream, tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    llama.reset_cache()
    with Mitmdump(llama.url, rec) as md:
        md.wait_for_log("llmp: live view on")
        client = openai.OpenAI(
            base_url=f"{md.url}/v1",
            api_key="k",
            max_retries=0,
            default_headers={"user-agent": UA},
        )
        history: list[Any] = [{"role": "system", "content": SYSTEM}]
        for n in range(1, 5):
            if n == 3:  # a clock in the system prompt: the cache is read again
                history[0] = {"role": "system", "content": SYSTEM + " Now: 10:42."}
            history.append({"role": "user", "content": f"step {n} ({MARK})"})
            reply = client.chat.completions.create(model="m", messages=history)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="m", messages=history, extra_headers={"x-fake": "status=400"}
            )
        md.wait_for_log("conv 1 turn 4:")
        with httpx.Client(base_url=md.url, timeout=10) as web:
            before = len(llama.log)
            for _ in range(200):  # the refused request's record is written after its line
                scraped = web.get("/_llmp/metrics")
                got = scrape(scraped.text)
                if total(got, "llmp_records_written_total") == 5:
                    break
                time.sleep(0.02)
            wrong = web.post("/_llmp/metrics")
            time.sleep(0.1)
            assert len(llama.log) == before  # answered by the proxy, never forwarded
        assert md.stop() == 0

    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=")
    assert scraped.headers["cache-control"] == "no-store"
    assert wrong.status_code == 405
    assert MARK not in scraped.text

    records = read_records(rec)
    report = analyze(rec)
    rows = report["rows"]
    assert len(records) == 5
    assert got["llmp_records_written_total"] == {(): 5.0}
    assert got["llmp_records_failed_total"] == {(): 0.0}
    # The same rows, under the report's client label and the served model.
    clients = {r["client"] for r in rows}
    assert {dict(k)["client"] for k in got["llmp_requests_total"]} == clients
    assert total(got, "llmp_requests_total") == len(rows)
    assert total(got, "llmp_turns_total") == sum(r["kind"] == "turn" for r in rows)
    assert total(got, "llmp_prefill_seconds_total") == pytest.approx(
        value(report["time"]["prefill_ms"]) / 1000
    )
    by_cause = report["time"]["by_cause"]
    assert by_cause, "the changed system prompt must cost something"
    for cause, c in by_cause.items():
        assert total(got, "llmp_lost_tokens_total", cause=cause) == c["tokens"]
        assert total(got, "llmp_lost_prefill_seconds_total", cause=cause) == pytest.approx(
            (value(c["ms"]) or 0) / 1000
        )
    timed = sum(r["kind"] == "turn" and r["counts"]["prefill_ms"] is not None for r in rows)
    assert total(got, "llmp_turn_prefill_seconds_count") == timed > 0


def test_metrics_with_the_live_view_off(llama: Upstream, tmp_path: Path) -> None:
    with Mitmdump(llama.url, tmp_path / "rec.jsonl", {"llmp_live": "false"}) as md:
        with httpx.Client(base_url=md.url, timeout=10) as web:
            off = web.get("/_llmp/metrics")
            other = web.get("/_llmp/nothing")
        md.stop()
    assert off.status_code == 404 and "live view is off" in off.json()["error"]
    assert other.status_code == 404 and "/_llmp/metrics" in other.json()["error"]
    assert read_records(tmp_path / "rec.jsonl", strict=False) == []
