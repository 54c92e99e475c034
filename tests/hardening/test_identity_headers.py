"""R32 through the real mitmdump: the identity headers a harness sends are kept
(names verbatim, session values hashed), credentials and every other header never;
both of the analyzer's readers take records that carry them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmp.analysis import analyze
from llmp.analysis.exchange import Digested, Skip, prepare, read_record
from llmp.format.canonical import hash_bytes
from tests.support.mitm import Mitmdump, wait_for_records
from tests.support.upstreams import Upstream

pytestmark = pytest.mark.e2e

SECRET = "s3cr3t-TOKEN-4242"
SESSION = "5e551on-VALUE-0f-a-user"
NAMING = {
    "X-Title": "Kilo Code",
    "HTTP-Referer": "https://kilocode.ai",
    "Originator": "codex_exec",
    "X-App": "cli",
    "X-Stainless-Retry-Count": "0",
}
SESSIONS = (
    "X-Claude-Code-Session-Id",
    "Session-Id",
    "session_id",
    "Thread-Id",
    "X-Codex-Window-Id",
    "X-Session-Id",
    "X-Session-Affinity",
    "X-Affinity",
)
CREDENTIALS = {
    "Authorization": f"Bearer {SECRET}",
    "X-Api-Key": SECRET,
    "Cookie": f"session={SECRET}",
    "X-Other": SECRET,  # any header not named by R32
}


@pytest.fixture(scope="module")
def llama() -> Iterator[Upstream]:
    with Upstream("llama") as up:
        yield up


def _body(question: str) -> dict[str, Any]:
    return {
        "model": "smol",
        "stream": False,
        "messages": [
            {"role": "system", "content": "You are helpful. " * 20},
            {"role": "user", "content": question},
        ],
    }


@pytest.mark.parametrize("mode", ["digest", "full"])
def test_identity_headers_kept_hashed_and_nothing_else(
    llama: Upstream, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / f"{mode}.jsonl"
    with Mitmdump(llama.url, path, {"llmp_body": mode}) as proxy:
        headers = {
            "User-Agent": "python-httpx/0.28.1",
            **NAMING,
            **{name: f"{SESSION}-{i}" for i, name in enumerate(SESSIONS)},
            **CREDENTIALS,
        }
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=_body("what is in the repository"),
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200
        records = wait_for_records(path, 1, timeout=20)
    data = path.read_text()
    assert SECRET not in data and "session=" not in data.lower()
    assert SESSION not in data  # session values only as hashes
    kept = records[0]["request"]["headers"]
    assert {k: kept[k.lower()] for k in NAMING} == NAMING
    for i, name in enumerate(SESSIONS):
        value = f"{SESSION}-{i}".encode()
        assert kept[name.lower()] == "fnv1a:" + hash_bytes(value)
    assert set(kept) == (
        {"user-agent", "content-type", "content-length"}
        | {k.lower() for k in NAMING}
        | {k.lower() for k in SESSIONS}
    )
    if mode == "digest":  # the fast path's typed decode takes it, headers and all
        fast_read = read_record(path.read_bytes().splitlines()[0])
        assert type(fast_read) is Digested
        ex = prepare(fast_read)
        assert not isinstance(ex, Skip) and ex.ua == "Kilo Code (python-httpx/0.28.1)"
        assert dict(ex.sessions)["x-session-id"] == kept["x-session-id"]
    # Both readers take the record, and name the client by its title (R33).
    for fast in (True, False):
        result = analyze([str(path)], fast=fast)
        try:
            report = result.report()
        finally:
            result.close()
        assert report["coverage"]["skipped"]["unparsed"] == 0
        assert [c["client"] for c in report["clients"]] == ["Kilo Code (python-httpx/0.28.1)"]
        assert report["clients"][0]["user_agent"] == "python-httpx/0.28.1"
        assert report["rows"][0]["kind"] == "turn"
