"""docs/team.md, run as written: the systemd unit's command, the month loop and its query.

systemd itself is not here, so the unit's `ExecStart` is expanded the way
systemd expands it (`%h`, `%i`, `${VAR}` from the `EnvironmentFile`) and run
as a process; the loop is run by bash, the query by DuckDB.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import openai
import orjson
import pytest

from llmp.cli import main
from tests.support import scenarios as sc
from tests.support.upstreams import Upstream

DOC = Path(__file__).resolve().parents[2] / "docs" / "team.md"
BIN = Path(sys.executable).parent
_BASE_RE = re.compile(r"OPENAI_BASE_URL=(http://\S+)/v1")


def block(lang: str, after: str) -> str:
    """The first ```lang block after the heading or text `after`, exactly as written."""
    text = DOC.read_text()
    found = re.search(rf"```{lang}\n(.*?)```", text[text.index(after) :], flags=re.S)
    assert found is not None, (lang, after)
    return found.group(1)


def env_file() -> dict[str, str]:
    """The EnvironmentFile of the docs (`KEY=value` lines)."""
    pairs = (line.split("=", 1) for line in block("sh", "~/.config/llmp/gpu1.env").splitlines())
    return {k.strip(): v.strip() for k, v in pairs}


def exec_start(home: Path, instance: str, env: dict[str, str]) -> list[str]:
    """The unit's ExecStart, expanded as systemd would."""
    unit = block("ini", "~/.config/systemd/user/llmp-proxy@.service")
    (line,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    cmd = line.removeprefix("ExecStart=").replace("%h", str(home)).replace("%i", instance)
    cmd = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], cmd)
    return shlex.split(cmd)


@pytest.mark.e2e
def test_the_units_command_records_one_dated_file_per_server(tmp_path: Path) -> None:
    env = env_file()
    assert set(env) == {"UPSTREAM", "LISTEN"}
    with Upstream("llama") as up:
        # The documented listen address is the team's; here, a free loopback port.
        cmd = exec_start(tmp_path, "gpu1", {"UPSTREAM": up.url, "LISTEN": "127.0.0.1:0"})
        assert cmd[0] == f"{tmp_path}/.local/bin/llmp"
        cmd[0] = str(BIN / "llmp")
        (tmp_path / "llmp" / "gpu1").mkdir(parents=True)  # the recipe's mkdir
        out_path = tmp_path / "out.txt"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 30
            while not (m := _BASE_RE.search(out_path.read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()
                time.sleep(0.05)
            client = openai.OpenAI(base_url=f"{m.group(1)}/v1", api_key="team-secret")
            for _ in range(2):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hello team"}]
                )
        finally:
            proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
            assert proc.wait(30) == 0, out_path.read_text()
    today = dt.date.today().isoformat()
    folder = tmp_path / "llmp" / "gpu1"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"llmp-{today}.jsonl", "live.log"])
    records = [orjson.loads(x) for x in (folder / f"llmp-{today}.jsonl").read_bytes().splitlines()]
    assert [r["id"] for r in records] == [1, 2]
    assert (folder / "live.log").read_text().count("\n") >= 2  # one line per request
    text = out_path.read_text()
    assert "hello team" not in (folder / f"llmp-{today}.jsonl").read_text()  # digest mode
    assert "team-secret" not in (folder / f"llmp-{today}.jsonl").read_text() + text


@pytest.mark.e2e
def test_the_month_loop_and_query_sum_lost_seconds_per_server_and_client(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    duckdb = pytest.importorskip("duckdb")
    pytest.importorskip("pyarrow")
    plan = {
        ("gpu1", "2026-11-03"): "changed_system",
        ("gpu1", "2026-11-04"): "title_side_call",
        ("gpu2", "2026-11-03"): "two_harnesses",
        ("gpu2", "2026-12-01"): "server_reset",  # another month: not in the loop's glob
    }
    expected: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0])
    days: dict[tuple[str, str], set[str]] = defaultdict(set)
    for (server, day), name in plan.items():
        folder = tmp_path / "llmp" / server
        folder.mkdir(parents=True, exist_ok=True)
        offset = (dt.date.fromisoformat(day) - dt.date(2026, 11, 1)).days
        path = sc.shifted(sc.SCENARIOS[name](), offset).write(folder / f"llmp-{day}.jsonl")
        if day.startswith("2026-11"):
            assert main(["analyze", str(path), "--json"]) == 0
            for row in orjson.loads(capsys.readouterr().out)["rows"]:
                e = expected[(server, row["client"])]
                for loss in (row["lost_client"], row["lost_external"]):
                    if loss is not None:
                        e[0] += loss["ms"]["value"] if loss["ms"] is not None else 0
                e[1] += row["kind"] == "turn"
                days[(server, row["client"])].add(day)
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    loop = block("sh", "## A month of files")
    done = subprocess.run(["bash", "-euc", loop], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = sorted(p.name for p in (tmp_path / "llmp" / "rows").iterdir())
    assert rows == ["gpu1-llmp-2026-11-03.parquet", "gpu1-llmp-2026-11-04.parquet",
                    "gpu2-llmp-2026-11-03.parquet"]  # fmt: skip
    monkeypatch.chdir(tmp_path / "llmp")  # "run in ~/llmp"
    rel = duckdb.sql(block("sql", "## A month of files"))
    got = [dict(zip(rel.columns, values, strict=True)) for values in rel.fetchall()]
    assert rel.columns == ["machine", "client", "lost_s", "turns", "days"]
    assert [(g["machine"], g["client"]) for g in got] == sorted(expected)
    for g in got:
        ms, turns = expected[(g["machine"], g["client"])][:2]
        assert g["lost_s"] == pytest.approx(round(ms / 1000, 3), abs=1e-9), g
        assert g["turns"] == turns and g["days"] == len(days[(g["machine"], g["client"])]), g
    assert sum(g["lost_s"] for g in got) > 1  # the recordings did lose time
