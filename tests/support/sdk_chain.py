"""Claude Code's and Codex's APIs through two recorders in a chain (digest, then full).

Shared by the e2e tests (fake llama-server) and the real-server ones.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmp.apis import api_for
from llmp.format import canonical
from tests.support.mitm import Mitmdump, wait_for_records

CLAUDE_UA = "claude-cli/2.1.328 (external, sdk-cli)"


CODEX_UA = "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)"


def user_item(text: str) -> Any:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@contextlib.contextmanager
def chain(
    upstream: str, tmp: Path, front: dict[str, str] | None = None
) -> Iterator[tuple[Mitmdump, Path, Path]]:
    """A digest recorder in front of a full recorder in front of the fake: each exchange is
    recorded both ways from the same bytes."""
    digest, full = tmp / "digest.jsonl", tmp / "full.jsonl"
    with Mitmdump(upstream, full, {"llmp_body": "full"}, log_path=tmp / "full.log") as back:
        # Its upstream is the other recorder: its token counts would be records there.
        opts = {"llmp_body": "digest", "llmp_tokenize": "false", **(front or {})}
        with Mitmdump(back.url, digest, opts, log_path=tmp / "digest.log") as md:
            yield md, digest, full


def records(path: Path, n: int) -> list[dict[str, Any]]:
    """The recording's records by id, read keeping number text (R2)."""
    wait_for_records(path, n)
    recs = [canonical.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["id"])


def plain(value: Any) -> Any:
    """A canonical value as plain JSON (numbers as Python numbers)."""
    return json.loads(canonical.dumps(value))


def check_digests(digest: list[dict[str, Any]], full: list[dict[str, Any]]) -> None:
    """The digest records' hashes and counters are those of the full records' bodies."""
    assert [d["id"] for d in digest] == [f["id"] for f in full]
    for d, f in zip(digest, full, strict=True):
        req, resp = d["request"], d["response"]
        assert req["path"] == f["request"]["path"]
        api = api_for(req["method"], req["path"])
        if api is None:
            assert req["digest"] is None and resp["digest"] is None
            continue
        assert req["body"] is None and resp["body"] is None  # no text in a digest record
        assert plain(req["digest"]) == plain(api.request_digest(f["request"]["body"]))
        if resp["status"] == 200:
            assert plain(resp["digest"]) == plain(api.response_digest(f["response"]["body"]))
        for key in ("t_first_byte_ms", "t_first_event_ms"):
            assert (d[key] is None) == (f[key] is None), (d["id"], key)


def blocks(content: Any) -> list[dict[str, Any]]:
    """Content blocks without null fields (the SDK's models add some)."""
    return [
        {k: v for k, v in b.items() if v is not None}
        for b in (x if isinstance(x, dict) else x.model_dump() for x in content)
    ]


def completed(stream: Any) -> Any:
    """The response of a `responses.create(stream=True)` stream's `response.completed`."""
    (response,) = [e.response for e in stream if e.type == "response.completed"]
    return response
