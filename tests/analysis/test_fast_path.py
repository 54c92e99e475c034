"""The fast path (digest lines decoded into typed structs) gives the plain path's report.

`analyze(..., fast=False)` (or `LLMP_ANALYZE_PLAIN=1`) reads every line the plain way:
orjson into dicts, number text kept for full bodies (R2).  The fast path must make the
same report of every recording, byte for byte, and the same readable report, rows and
"what changed" diffs; lines it cannot read exactly as the plain path does go the plain
way (`exchange.read_record`).
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmp.analysis import PLAIN_ENV, analyze, exchange, fast_default
from llmp.analysis.changes import MAX_CHANGES
from llmp.analysis.command import explain
from llmp.analysis.exchange import Digested, read_record
from llmp.format.canonical import record_dumps
from llmp.format.fastread import Histories, decode_digest, decode_llama_digest
from tests.support import scenarios as sc
from tests.support.traffic import TRAFFIC, report_bytes

# Every traffic the scenarios build: the shared ones, the Anthropic and Responses
# ones (R21-R29), and those with skipped records, refusals and cut prompts.
MODES = ("digest", "full", "mixed")


def page_parts(paths: list[Path], fast: bool) -> tuple[Any, ...]:
    """What `--html` draws: the header, the kept rows and the "what changed" diffs."""
    result = analyze(
        [str(p) for p in paths],
        progress=False,
        rows=False,
        keep=True,
        changes=MAX_CHANGES,
        fast=fast,
    )
    try:
        return result.header(), result.rows(), result.change_list()
    finally:
        result.close()


def readable(paths: list[Path], monkeypatch: pytest.MonkeyPatch, fast: bool) -> str:
    """The readable report (`explain` reads the switch from the environment)."""
    monkeypatch.setenv(PLAIN_ENV, "0" if fast else "1")
    assert fast_default() is fast
    out = io.StringIO()
    explain([str(p) for p in paths], out=out)
    return out.getvalue()


def fast_lines(path: Path) -> int:
    """How many lines of a file the fast path takes."""
    return sum(isinstance(read_record(line), Digested) for line in path.read_bytes().splitlines())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_fast_path_gives_the_plain_report(name: str, mode: str, tmp_path: Path) -> None:
    path = TRAFFIC[name]().write(tmp_path / "rec.jsonl", mode)
    taken = fast_lines(path)
    lines = len(path.read_bytes().splitlines())
    if mode == "full":
        assert taken == sum(b'"body":null' in line for line in path.read_bytes().splitlines())
    elif mode == "digest":
        assert taken >= lines // 2  # every line, bar errors and refusals
    else:
        assert taken > 0
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)
    assert page_parts([path], fast=True) == page_parts([path], fast=False)


def test_response_server_header_read_alike(tmp_path: Path) -> None:
    """A response's `server` header (kept by the recorder) leaves the fast path open, and
    both paths read it alike: llama-server's changes nothing, a shared cache's does."""
    plain = sc.both_agents().write(tmp_path / "plain.jsonl", "digest")
    reports = {}
    for server in ("llama.cpp", "uvicorn"):
        lines = []
        for line in plain.read_bytes().splitlines():
            rec = orjson.loads(line)
            if isinstance(rec.get("response"), dict):
                rec["response"]["headers"]["server"] = server
            lines.append(record_dumps(rec) + b"\n")
        served = tmp_path / f"{server}.jsonl"
        served.write_bytes(b"".join(lines))
        assert f'"server":"{server}"'.encode() in served.read_bytes()
        assert fast_lines(served) == fast_lines(plain) > 0
        reports[server] = report_bytes([served], fast=True)
        assert reports[server] == report_bytes([served], fast=False)

    # llama-server's header changes no verdict: only the server the report names (which
    # its timings already named where it sent them).
    def unnamed(report: bytes) -> Any:
        rep = orjson.loads(report)
        del rep["servers"]
        for row in rep["rows"]:
            row["server"] = None
        return rep

    assert unnamed(reports["llama.cpp"]) == unnamed(report_bytes([plain], fast=True))
    # Two agents evict each other from one slot; a shared cache has no slot to lose.
    assert b"other_conversation" in reports["llama.cpp"]
    assert b"server_capacity" in reports["uvicorn"]


def test_readable_report_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = sc.both_agents().write(tmp_path / "rec.jsonl", "mixed")
    fast = readable([path], monkeypatch, True)
    assert fast == readable([path], monkeypatch, False)
    assert "claude-cli" in fast


def test_several_files_and_sessions(tmp_path: Path) -> None:
    """Two proxies' files, out of order, with bad lines, and a session per restart."""
    paths = [
        sc.mixed_file(tmp_path),
        sc.two_harnesses().write(tmp_path / "b.jsonl", "digest"),
        sc.compaction().write(tmp_path / "c.jsonl", "mixed"),
    ]
    assert report_bytes(paths, fast=True) == report_bytes(paths, fast=False)


# -- damaged lines: the fast path refuses what it cannot read as the plain path does --

BASE = [orjson.loads(line) for line in sc.title_side_call().lines("digest", "id")]
BASE += [orjson.loads(line) for line in sc.claude_code_session().lines("digest", "id")]

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63, 2**64 - 1, -(2**63), 2**64, 0, -1, 1, 200, 400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["", "system", "assistant", "tool", "POST", "/v1/chat/completions"]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["hash", "name", "role", "chars", "x"]), st.integers(0, 9)),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _damage(rec: dict[str, Any], rnd: random.Random, new: Any) -> None:
    """Replace, add or remove one value somewhere in the record."""
    path = rnd.choice([p for p in _paths(rec) if p])
    parent: Any = rec
    for key in path[:-1]:
        parent = parent[key]
    how = rnd.random()
    if isinstance(parent, dict) and how < 0.15:
        del parent[path[-1]]
    elif isinstance(parent, dict) and how < 0.3:
        parent["extra"] = new
    else:
        parent[path[-1]] = new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.lists(VALUES, min_size=1, max_size=5))
def test_damaged_lines_read_alike(rnd: random.Random, values: list[Any]) -> None:
    recs = copy.deepcopy(BASE)
    for new in values:
        _damage(recs[rnd.randrange(len(recs))], rnd, new)
    # json, not orjson: it writes integers past 64 bits (orjson reads them as floats)
    lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in recs]
    fd, name = tempfile.mkstemp(prefix="llmp-fast-", suffix=".jsonl")
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(lines))
        assert report_bytes([path], fast=True) == report_bytes([path], fast=False)
    finally:
        path.unlink()


@pytest.mark.parametrize("levels", [1, 1019, 1020, 1021, 1022, 1030])
@pytest.mark.parametrize("where", ["usage", "headers", "extra"])
def test_nesting_at_orjson_limit(levels: int, where: str, tmp_path: Path) -> None:
    """orjson refuses a line nested deeper than 1024, msgspec does not: a line nested
    near that depth is read (or called a bad line) alike."""
    deep = b"[" * levels + b"1" + b"]" * levels
    lines = []
    for line in sc.clean_chat().lines("digest", "id"):
        rec = orjson.loads(line)
        digest = (rec["response"] or {}).get("digest")
        if where == "usage" and digest is not None:
            digest["usage"]["deep"] = "DEEP"
        elif where == "headers":
            rec["request"]["headers"]["x-deep"] = "DEEP"
        else:
            rec["deep"] = "DEEP"
        lines.append(record_dumps(rec).replace(b'"DEEP"', deep) + b"\n")
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b"".join(lines))
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)


def _messages_text(line: bytes) -> bytes:
    return orjson.dumps(orjson.loads(line)["request"]["digest"]["messages"])


def _known_end(line: bytes, prev: bytes) -> int:
    """Where the messages `line` shares with `prev` end (at its `,` or `]`)."""
    p = line.index(b'"messages":') + len(b'"messages":')
    stem = _messages_text(prev)[:-1]
    assert line.startswith(stem, p) and line[p + len(stem) : p + len(stem) + 2] == b",{"
    return p + len(stem)


CUT_EDITS: dict[str, Callable[[bytes, int], bytes]] = {
    "none": lambda line, end: line,
    # the known messages, then not a list of message digests as they were
    "trailing_comma": lambda line, end: line[:end] + b",]" + line[line.index(b"]", end) + 1 :],
    "space": lambda line, end: line[:end] + b", " + line[end + 1 :],
    "number": lambda line, end: line[:end] + b",1" + line[end:],
    "closed_early": lambda line, end: line[:end] + b"]" + line[line.index(b"]", end) + 1 :],
    "only_known": lambda line, end: line[:end] + line[line.index(b"]", end) :],
    # a second `messages` key: the last one is the value
    "twice": lambda line, end: line.replace(b'"tools_hash"', b'"messages":[],"tools_hash"', 1),
    "twice_same": lambda line, end: line.replace(
        b'"tools_hash"', b'"messages":' + _messages_text(line) + b',"tools_hash"', 1
    ),
    "tokens": lambda line, end: line.replace(b'"tokens":null', b'"tokens":{"messages":{}}'),
    "tokens_and_twice": lambda line, end: line.replace(
        b'"tokens":null', b'"tokens":{"messages":{},"messages":{}}'
    ),
}


@pytest.mark.parametrize("edit", sorted(CUT_EDITS))
def test_cut_history_reads_alike(edit: str, tmp_path: Path) -> None:
    """A line whose messages begin with the previous request's is decoded without them
    (`Histories.cut`); a line that only looks so is read as the plain path reads it."""
    lines = list(sc.clean_chat().lines("digest", "id"))
    end = _known_end(lines[3], lines[2])
    lines[3] = CUT_EDITS[edit](lines[3], end)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(lines))
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)
    if edit in ("none", "only_known"):  # and it was cut
        histories = Histories()
        prev = decode_digest(lines[2])
        assert prev is not None and prev.request.digest is not None
        assert histories.decode(prev.request.digest.messages) is not None
        assert histories.cut(lines[3]) is not None


USAGE_FIELDS = [
    ("model",),
    ("usage",),
    ("usage", "prompt_tokens"),
    ("usage", "completion_tokens"),
    ("usage", "prompt_tokens_details"),
    ("usage", "prompt_tokens_details", "cached_tokens"),
    ("usage", "cached_tokens"),
    ("timings",),
    ("timings", "cache_n"),
    ("timings", "prompt_n"),
    ("timings", "prompt_ms"),
    ("timings", "predicted_n"),
    ("timings", "predicted_ms"),
    ("timings", "draft_n"),
    ("timings", "draft_n_accepted"),
    ("other",),
]
USAGE_VALUES: list[Any] = [None, -1, 0, 7, 7.0, -0.0, 2.5, 2**64, True, "x", {}, [], "DELETE"]


@pytest.mark.parametrize("field", USAGE_FIELDS, ids=".".join)
def test_usage_read_typed_alike(field: tuple[str, ...], tmp_path: Path) -> None:
    """llama-server's `usage` and `timings` are read typed (`fastread.LlamaTop`) when
    every field has its type, else as dicts: the same counters either way."""
    for i, value in enumerate(USAGE_VALUES):
        lines = []
        for line in sc.clean_chat().lines("digest", "id"):
            rec = orjson.loads(line)
            top = (rec["response"] or {}).get("digest", {}).get("usage")
            if isinstance(top, dict):
                top.setdefault("timings", {}).update(draft_n=12, draft_n_accepted=9)
                parent = top
                for key in field[:-1]:
                    parent = parent.setdefault(key, {})
                    if not isinstance(parent, dict):
                        break
                else:
                    if value == "DELETE":
                        parent.pop(field[-1], None)
                    else:
                        parent[field[-1]] = value
            lines.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
        path = tmp_path / f"usage{i}.jsonl"
        path.write_bytes(b"".join(lines))
        assert report_bytes([path], fast=True) == report_bytes([path], fast=False), value


def test_usage_typed_in_the_line_pass_alike(tmp_path: Path) -> None:
    """llama-server's `usage` is read in the line's own decode (`decode_llama_digest`)
    until a line's usage is another shape: lines that alternate between the two, and
    llama-server's fields under an API that reads `usage` as a dict (Anthropic's path),
    give the plain report."""
    lines = []
    for i, line in enumerate(sc.clean_chat().lines("digest", "id")):
        rec = orjson.loads(line)
        top = (rec["response"] or {}).get("digest", {}).get("usage")
        if isinstance(top, dict):
            if i % 3 == 1:  # after a line of llama-server's usage: tried typed first
                rec["request"]["path"] = "/v1/messages"
            elif i % 3 == 2:
                top["other"] = 1  # not llama-server's: the line is decoded again
        lines.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
    path = tmp_path / "mixed-usage.jsonl"
    path.write_bytes(b"".join(lines))
    assert fast_lines(path) == len(lines)
    for line in lines:
        got = read_record(line)
        assert isinstance(got, Digested)
        if b'"/v1/messages"' in line:  # the dict Anthropic's counters read
            assert type(got.top) is dict
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)


def test_another_servers_usage_is_not_decoded_twice_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a line whose usage is not llama-server's, the next lines are decoded
    with `usage` raw first: a recording of Ollama's API tries the typed decode once."""
    path = TRAFFIC["ollama_truncating"]().write(tmp_path / "rec.jsonl", "digest")
    lines = path.read_bytes().splitlines()
    tried: list[bytes] = []

    def counting(line: bytes) -> Any:
        tried.append(line)
        return decode_llama_digest(line)

    monkeypatch.setattr(exchange, "decode_llama_digest", counting)
    monkeypatch.setattr(exchange._USAGE, "typed", True)
    got = [read_record(line) for line in lines]
    assert sum(isinstance(g, Digested) for g in got) >= 10
    assert len(tried) <= 2, len(tried)


# -- R34, R35, R37: the provider fields stay on the fast path and read alike -----------

PROVIDER_HEADERS = {
    "request-id": "req_011CX",
    "anthropic-organization-id": "fnv1a:0123456789abcdef",
    "anthropic-ratelimit-tokens-remaining": "",
    "anthropic-ratelimit-unified-5h-utilization": "",
    "openai-processing-ms": "412",
}


def _provider_lines(path: Path) -> list[bytes]:
    lines = []
    for i, line in enumerate(path.read_bytes().splitlines()):
        rec = orjson.loads(line)
        rec["request"]["upstream"] = "api.anthropic.com"
        rec["request"]["added"] = ["diagnostics"] if i % 2 else None
        rec["request"]["headers"]["anthropic-beta"] = "cache-diagnosis-2026-04-07"
        if isinstance(rec.get("response"), dict):
            rec["response"]["headers"].update(PROVIDER_HEADERS)
        lines.append(record_dumps(rec) + b"\n")
    return lines


def _new_fields(d: Any) -> tuple[Any, ...]:
    req, resp = d.request, d.response
    cache = req.digest.cache if req.digest is not None else None
    return req.upstream, req.added, req.headers, resp.headers if resp else None, cache


def test_provider_fields_read_alike(tmp_path: Path) -> None:
    """`request.upstream`, `request.added`, R34's response headers (rate limits by name,
    a set no struct lists) and R35's `cache` leave every line on the fast path, and the
    plain path carries the same values."""
    plain = sc.both_agents().write(tmp_path / "plain.jsonl", "digest")
    lines = _provider_lines(plain)
    path = tmp_path / "provider.jsonl"
    path.write_bytes(b"".join(lines))
    assert fast_lines(path) == fast_lines(plain) > 0
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)
    caches = 0
    for line in lines:
        fast = read_record(line)
        if not isinstance(fast, Digested):
            continue
        slow = exchange.digested(orjson.loads(line))
        assert isinstance(slow, Digested)
        if fast.api is None:
            continue
        assert _new_fields(fast.rec) == _new_fields(slow.rec)
        assert fast.rec.request.upstream == "api.anthropic.com"
        assert fast.rec.response is not None and fast.rec.response.headers is not None
        assert fast.rec.response.headers["anthropic-ratelimit-tokens-remaining"] == ""
        cache = fast.rec.request.digest.cache if fast.rec.request.digest else None
        assert cache is not None and cache.blocks is not None
        assert len(cache.blocks) == len(fast.msgs)
        caches += 1
    assert caches >= 5


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("request", "upstream"), 7),
        (("request", "added"), ["diagnostics", 3]),
        (("request", "added"), "diagnostics"),
        (("response", "headers", "request-id"), 12),
        (("request", "digest", "cache", "blocks"), [1, "2"]),
        (("request", "digest", "cache", "blocks"), [1, 2**64]),
        (("request", "digest", "cache", "settings"), {"thinking": {"type": "x"}}),
        (("request", "digest", "cache", "breakpoints"), [{"at": "tools", "index": 0}]),
        (("request", "digest", "cache", "options"), {"mode": "explicit", "extra": 1}),
        (("request", "digest", "cache", "extra"), 1),
        (("request", "digest", "cache"), "none"),
    ],
)
def test_odd_provider_values_read_alike(where: tuple[str, ...], value: Any, tmp_path: Path) -> None:
    """A value of another type sends the line the plain way, which reads it as absent."""
    plain = sc.claude_code_session().write(tmp_path / "plain.jsonl", "digest")
    lines = []
    for line in plain.read_bytes().splitlines():
        rec = orjson.loads(line)
        parent = rec
        for key in where[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent[where[-1]] = value
        lines.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"".join(lines))
    assert report_bytes([path], fast=True) == report_bytes([path], fast=False)
    went_plain = 0
    for line in lines:
        got = read_record(line)
        if isinstance(got, Digested) or got is None:
            continue
        slow = exchange.digested(got)
        if isinstance(slow, Digested) and slow.api is not None:
            went_plain += 1
            upstream, added, _, response_headers, cache = _new_fields(slow.rec)
            assert value not in (upstream, added, cache)  # read as absent
            assert response_headers is None or "request-id" not in response_headers
    assert went_plain > 0


@pytest.mark.parametrize("number", [b"1.50", b"-0", b"2E3", b"123456789012345678901234567890"])
def test_full_and_digest_records_give_the_same_cache(number: bytes, tmp_path: Path) -> None:
    """A full record's `cache` is computed from its body, numbers kept as text (R2); it
    reads as the digest record of the same request reads, on the fast path or not."""
    from llmp.apis import api_for
    from llmp.format import canonical
    from llmp.format.lines import parse_line

    path = sc.claude_code_session().write(tmp_path / "full.jsonl", "full")
    compared = 0
    for line in path.read_bytes().splitlines():
        rec = canonical.loads(line)
        req = rec["request"]
        api = api_for(req["method"], req["path"])
        if api is None or not isinstance(req["body"], dict) or rec["error"] is not None:
            continue
        req["body"]["speed"] = canonical.loads(number)
        req["body"]["prompt_cache_retention"] = canonical.loads(number)
        full_line = canonical.record_dumps(rec)
        req["digest"], req["body"] = api.request_digest(req["body"]), None
        resp = rec["response"]
        if resp is None or resp["body"] is None or resp["status"] != 200:
            continue
        resp["digest"], resp["body"] = api.response_digest(resp["body"]), None
        digest_line = canonical.record_dumps(rec)
        full = exchange.digested(parse_line(full_line) or {})
        got = read_record(digest_line)
        digest = got if isinstance(got, Digested) else exchange.digested(got or {})
        assert isinstance(full, Digested) and isinstance(digest, Digested)
        assert full.rec.request.digest is not None and digest.rec.request.digest is not None
        cache = full.rec.request.digest.cache
        assert cache is not None and cache.settings is not None
        assert cache == digest.rec.request.digest.cache
        compared += 1
    assert compared >= 3
