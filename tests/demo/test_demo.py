"""The main job: `llmp demo` records a scripted session through the real mitmdump and explains it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.e2e


def test_demo_with_the_bundled_fake_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMP_LLAMA")}
    llmp = Path(sys.executable).with_name("llmp")
    proc = subprocess.run(
        [str(llmp), "demo", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [orjson.loads(line) for line in (tmp_path / "demo.jsonl").read_bytes().splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["error"] is None and r["response"]["stream"] == "sse" for r in records)
    assert all(r["request"]["digest"] is not None for r in records)  # digest mode: no text
    assert b"demo-key-not-recorded" not in (tmp_path / "demo.jsonl").read_bytes()
    out = proc.stdout
    assert "bundled fake llama-server" in out
    assert "side-calls evicted the cache" in out
    assert "system prompt changed" in out
