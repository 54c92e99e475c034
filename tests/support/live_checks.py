"""Checks shared by the live view's end-to-end tests: an event against its report row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from llmp.live.contract import TURN_FIELDS

LLMP = Path(sys.executable).parent / "llmp"


def analyze(path: Path) -> dict[str, Any]:
    """`llmp analyze --json` of a recording, as a user would run it."""
    out = subprocess.run(
        [str(LLMP), "analyze", "--json", str(path)], capture_output=True, check=True, timeout=60
    )
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def analyze_text(path: Path) -> str:
    """`llmp analyze` of a recording: the readable report, as a user reads it."""
    out = subprocess.run(
        [str(LLMP), "analyze", str(path)], capture_output=True, check=True, timeout=60, text=True
    )
    return out.stdout


def value(mv: dict[str, Any] | None) -> Any:
    """The number of a measured value of the report, or None."""
    return None if mv is None else mv["value"]


def lost(row: dict[str, Any]) -> int:
    """The tokens a report row lost, both sides together."""
    return sum(row[k]["tokens"] for k in ("lost_client", "lost_external") if row[k])


def check_event(ev: dict[str, Any], row: dict[str, Any]) -> None:
    """An LLMP_TURN event says what the report's row for the same id says."""
    assert list(ev) == list(TURN_FIELDS) and ev["v"] == 1
    c = row["counts"]
    assert (ev["kind"], ev["conversation"], ev["turn"]) == (
        row["kind"],
        row["conversation"],
        row["turn"],
    )
    assert ev["cause"] == row["cause"] and ev["client"] == row["client"]
    assert ev["prompt_tokens"] == value(c["prompt_tokens"])
    assert ev["reused_tokens"] == value(c["reused_tokens"])
    assert ev["prefill_ms"] == value(c["prefill_ms"])
    assert ev["reuse"] == row["observed_reuse"]
    for part in ("lost_client", "lost_external"):
        loss = row[part]
        assert ev[f"{part}_tokens"] == (loss and loss["tokens"])
        assert ev[f"{part}_cause"] == (loss and loss["cause"])
        assert ev[f"{part}_ms"] == (loss and value(loss["ms"]))
    if row["kind"] == "turn":
        assert ev["lost_tokens"] == lost(row)


def chat(
    client: httpx.Client, messages: list[dict[str, Any]], *, fake: str = "", **extra: Any
) -> dict[str, Any]:
    """One chat request to the fake llama-server (`fake`: its `x-fake` modes); the assistant
    message to resend."""
    body = {"model": "smol", "messages": messages, **extra}
    headers = {"x-fake": fake} if fake else {}
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            text = "".join(
                (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                for line in r.iter_lines()
                if line.startswith("data: {")
            )
        return {"role": "assistant", "content": text}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
