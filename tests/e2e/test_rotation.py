"""`llmp_rotate=daily` through the real mitmdump: midnight loses no exchange in flight.

The proxy, the recorder, the builder child and the files are real; only the
local date is the test's (`tests/support/fake_clock.py`), so midnight comes
when the test writes the next day into a file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from llmp.cli import main
from tests.support.mitm import DEFAULT_SCRIPT, Mitmdump
from tests.support.upstreams import REPLY_TEXT, Upstream

CLOCK = Path(__file__).resolve().parents[1] / "support" / "fake_clock.py"
pytestmark = pytest.mark.e2e


@pytest.fixture
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def test_midnight_through_mitmdump(
    llama: Upstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    day = tmp_path / "day.txt"
    day.write_text("2026-12-01")
    proxy = Mitmdump(
        llama.url,
        tmp_path / "team.jsonl",
        {"llmp_rotate": "daily"},
        script=None,
        extra_args=["-s", str(CLOCK), "-s", str(DEFAULT_SCRIPT)],
        env={**os.environ, "LLMP_TEST_DAY": str(day)},
    )
    history: list[Any] = [{"role": "user", "content": "count to three"}]
    with proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
        first = client.chat.completions.create(model="m", messages=history)
        history.append({"role": "assistant", "content": first.choices[0].message.content})
        history.append({"role": "user", "content": "and on"})
        # Its record is written by the writer thread, after the client has its answer:
        # wait for it, or a busy machine could write it after the midnight below.
        deadline = time.monotonic() + 20
        day1 = tmp_path / "team-2026-12-01.jsonl"
        while not (day1.exists() and day1.read_bytes().endswith(b"\n")):
            assert time.monotonic() < deadline, "the first record was never written"
            time.sleep(0.01)
        # A stream starts before midnight and ends after it.  (The fake llama-server
        # has one slot, as a small real one has: a second stream would wait for it.)
        started = threading.Event()
        text = ""

        def stream() -> None:
            nonlocal text
            chunks: Any = client.chat.completions.create(
                model="m",
                messages=history,
                stream=True,
                extra_headers={"x-fake": "delay_ms=300"},
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                    started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(20)
        midnight_ms = time.time() * 1000
        day.write_text("2026-12-02")  # midnight, with the stream mid-way
        thread.join(60)
        assert not thread.is_alive()
        last = client.chat.completions.create(model="m", messages=history)
        assert proxy.stop() == 0
        log = proxy.log_text()
    assert text == REPLY_TEXT["llama"]  # the client got every byte
    assert last.choices[0].message.content == REPLY_TEXT["llama"]

    one, two = tmp_path / "team-2026-12-01.jsonl", tmp_path / "team-2026-12-02.jsonl"
    assert sorted(p.name for p in tmp_path.glob("team*")) == [one.name, two.name]
    before, after = lines(one), lines(two)
    assert [r["id"] for r in before] == [1]
    assert [r["id"] for r in after] == [2, 3]  # every exchange, once
    crossed = after[0]  # whole: begun before the switch, ended after it
    assert crossed["error"] is None and crossed["response"]["status"] == 200
    assert crossed["t_start_ms"] < midnight_ms < crossed["t_end_ms"]
    assert crossed["response"]["digest"]["output"]["content_chars"] == len(REPLY_TEXT["llama"])
    assert crossed["response"]["chunks"] >= 4
    assert f"llmp: recording to {one}" in log
    assert f"llmp: recording to {two} from now on (a new day)" in log

    # Read together, the two files are one session: the conversation goes on.
    assert main(["analyze", str(one), str(two), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in report["rows"]}
    assert {r["session"] for r in rows.values()} == {1}
    assert rows[3]["conversation"] == rows[1]["conversation"]
    assert rows[3]["linked_to"] is not None
