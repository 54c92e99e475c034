"""Hostile or damaged records never make the analyzer raise."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmp.analysis import Engine, analyze
from llmp.format.lines import parse_line
from tests.support import scenarios as sc

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)

BASE = [parse_line(line) for line in sc.compaction().lines("digest", "id")]
BASE += [parse_line(line) for line in sc.ollama_meanings("evaluated").lines("full", "id")][:3]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    value[path[0]] = replace(value[path[0]], path[1:], new)
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.lists(JSON, min_size=1, max_size=4))
def test_damaged_records_never_raise(rnd: random.Random, values: list[Any]) -> None:
    recs = copy.deepcopy(BASE)
    for new in values:
        i = rnd.randrange(len(recs))
        candidates = [p for p in paths(recs[i]) if p and p[0] not in ("v", "id", "t_start_ms")]
        recs[i] = replace(recs[i], rnd.choice(candidates), new)
    engine = Engine(spill=False)
    for n, rec in enumerate(recs):
        assert rec is not None
        engine.feed(1 + n // 6, rec)
    header = engine.header()
    orjson.dumps(header)


def test_garbage_file(tmp_path: Path) -> None:
    rnd = random.Random(3)
    lines = [
        bytes(rnd.randrange(256) for _ in range(rnd.randrange(80))) + b"\n" for _ in range(200)
    ]
    lines += sc.clean_chat().lines("digest")
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(b"".join(lines))
    result = analyze([str(path)])
    rep = result.report()
    result.close()
    assert rep["coverage"]["analysed"] == 5
    assert rep["coverage"]["bad_lines"] >= 190


def test_a_failed_request_whose_role_is_a_list_is_skipped() -> None:
    """A failed chat request's system prompt is read for what the client does next
    (`exchange._probe`): a damaged role there (an unhashable list, as Hypothesis
    once found) ends the system prompt instead of raising."""
    first, second = copy.deepcopy(BASE[:2])
    assert first is not None and second is not None
    first["error"] = "upstream_reset"
    first["request"]["digest"]["messages"][0]["role"] = ["system"]
    engine = Engine(spill=False)
    assert engine.feed(1, first) is None  # skipped, not raised
    assert engine.feed(1, second) is not None
    assert engine.totals.records == 2
