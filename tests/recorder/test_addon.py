"""The addon's hooks in process (mitmproxy's `taddons`), where a real proxy's timing
cannot be forced: what a hook does once shutdown has begun.

mitmproxy runs `done` first and tears the connections down after it, and its
hooks still fire then (mitmproxy-notes.md). A request whose `request` hook comes
after `done` must not reach the server: its record, if it has one, was already
written as in flight.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from mitmproxy import flow as mflow
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.test import taddons, tflow

from llmp.recorder.addon import Recorder


def _chat() -> tflow.http.HTTPFlow:
    f = tflow.tflow()
    f.request.method, f.request.path = "POST", "/v1/chat/completions"
    f.request.content = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    return f


def test_a_request_that_completes_after_done_is_killed_not_forwarded(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"

    async def check() -> None:
        rec = Recorder()
        with taddons.context(Proxyserver(), rec) as tctx:
            tctx.configure(rec, llmp_file=str(path))
            rec.running()
            before = _chat()  # its head arrived before shutdown, its body after
            rec.requestheaders(before)
            finished = _chat()  # a whole exchange before shutdown
            rec.requestheaders(finished)
            await rec.request(finished)
            rec.responseheaders(finished)
            rec.response(finished)
            rec.done()

            await rec.request(before)
            assert before.error is not None and before.error.msg == mflow.Error.KILLED_MESSAGE
            rec.error(before)  # mitmproxy's error hook for the kill: nothing more is written

            after = _chat()  # a request that began after shutdown
            rec.requestheaders(after)
            assert after.error is not None and after.error.msg == mflow.Error.KILLED_MESSAGE
            await rec.request(after)
            rec.error(after)
            assert rec._last_id == 2

    asyncio.run(check())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [1, 2]
    by_id = {r["id"]: r for r in records}
    assert by_id[1]["error"] == "upstream_reset" and by_id[1]["request"]["digest"] is None
    assert by_id[2]["error"] is None and by_id[2]["request"]["digest"] is not None


def test_a_request_before_done_is_not_killed(tmp_path: Path) -> None:
    async def check() -> None:
        rec = Recorder()
        with taddons.context(Proxyserver(), rec) as tctx:
            tctx.configure(rec, llmp_file=str(tmp_path / "r.jsonl"))
            rec.running()
            f = _chat()
            rec.requestheaders(f)
            await rec.request(f)
            assert f.error is None and f.live
            rec.done()

    asyncio.run(check())
