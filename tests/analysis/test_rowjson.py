"""The C row writer (`_rowjson.c`) gives `Row.spill_line`'s bytes, or its error.

`rows.spill_line` is what the report's spill calls: the C writer where it was
built, which hands back to the Python writer every row it cannot write itself.
So the two must agree on every row, ordinary or not: the same bytes, or the same
exception type.  Ordinary rows (the types the engine makes) must be written by
the C writer itself, or the comparison would only test the fallback.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmp.analysis import analyze, report, rows
from llmp.analysis.rows import Loss, Row
from llmp.apis.base import Counts
from tests.support import scenarios as sc
from tests.support.traffic import TRAFFIC, report_bytes

try:
    from llmp.analysis import _rowjson
except ImportError:  # pragma: no cover - reported by test_the_c_writer_is_built
    _rowjson = None  # type: ignore[assignment]


def c_line(row: Row) -> bytes | None:
    assert _rowjson is not None
    return _rowjson.spill_line(row)


def outcome(write: Callable[[Row], bytes], row: Row) -> tuple[str, Any]:
    try:
        return "bytes", write(row)
    except Exception as e:  # the error's type is what is compared
        return "error", type(e)


def test_the_c_writer_is_built() -> None:
    # setup builds it (pyproject: ext-modules); without a C compiler the install still
    # works, on the Python writer, and this test says so.
    assert _rowjson is not None, "llmp.analysis._rowjson was not built (no C compiler?)"
    assert rows.spill_line is not Row.spill_line


# -- values of every kind -----------------------------------------------------

EDGE_FLOATS = [
    0.0, -0.0, 1e-4, -1e-4, math.nextafter(1e-4, 0), math.nextafter(1e-4, 1),
    1e16, math.nextafter(1e16, 0), -math.nextafter(1e16, 0), 1e15, math.nextafter(1e15, 0),
    999999999999999.0, 9007199254740993.0, 0.1, 1 / 3, 2.5, 123.0, -7.0, 5e-324,
    sys.float_info.max, math.inf, -math.inf, math.nan, 1e-5, 1.5e-7, 1e22, 12345.678,
]  # fmt: skip

floats = st.floats() | st.sampled_from(EDGE_FLOATS) | st.floats(min_value=1e-6, max_value=1e17)
ints = st.integers(-(2**63), 2**63 - 1) | st.integers(-(2**70), 2**70) | st.integers(-5, 5)
texts = (
    st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=12)
    | st.text(max_size=8)
    | st.sampled_from(["turn", "side_call", 'a"b', "a\\b", "\x00", "\x7f", "é", "\ud800", ""])
)


class Str(str):
    pass


odd = st.sampled_from([Str("x"), (1, 2), {"k": [1, 2.5]}, b"bytes", object(), True])
scalars = st.none() | st.booleans() | ints | floats | texts
values = scalars | st.lists(scalars, max_size=4) | odd
mvs = st.none() | st.tuples(ints | floats, texts) | st.tuples(values, values, values) | odd
losses = st.none() | st.builds(Loss, values, values, mvs)
counts = st.builds(Counts, mvs, mvs, mvs, mvs, mvs, mvs, mvs)
compositions = st.tuples(mvs, mvs, mvs, mvs) | st.tuples(mvs, mvs) | odd
markers = ints | st.sampled_from([True, None, 1.5, Str("1")])
changed = st.none() | st.lists(st.dictionaries(texts, values, max_size=3), max_size=2)


@st.composite
def any_rows(draw: Any) -> Row:  # Any: every field takes values of any type here
    """Rows with any value in any field: what the Python writer would be handed."""
    row = Row(
        id=draw(markers), api=draw(texts | odd), model=draw(texts | odd), client=draw(markers),
        t_start_ms=draw(values), kind=draw(values), side_call_shape=draw(values),
        session=draw(values), conversation=draw(values), turn=draw(values), counts=draw(counts),
        composition=draw(compositions),
    )  # fmt: skip
    for name in (
        "linked_to", "new_conversation", "prefix_tokens", "break_cause", "compaction",
        "predicted_reuse", "observed_reuse", "cause", "side_calls_between",
        "other_conversations_between", "other_domains_between", "loss_measured",
    ):  # fmt: skip
        setattr(row, name, draw(values))
    row.lost_client, row.lost_external = draw(losses), draw(losses)
    row.changed = draw(changed)
    row.recording = draw(markers)
    row.draft_n, row.draft_n_accepted = draw(st.none() | markers), draw(st.none() | markers)
    return row


plain_mv = st.tuples(
    st.integers(0, 10**9) | st.floats(0, 1e9), st.sampled_from(["server", "estimate"])
)


changes = st.none() | st.lists(
    st.fixed_dictionaries(
        {"index": st.integers(0, 300), "role": st.sampled_from(["user", "system"])},
        optional={"within": st.text(max_size=6), "chars_before": st.integers(0, 10**6)},
    ),
    min_size=1,
    max_size=2,
)


@st.composite
def ordinary_rows(draw: st.DrawFn) -> Row:
    """Rows of the types the engine makes."""
    opt_mv = st.none() | plain_mv
    loss = st.none() | st.builds(
        Loss, st.sampled_from(["side_call", "structural"]), st.integers(0, 10**6), opt_mv
    )
    row = Row(
        id=draw(st.integers(1, 2**40)), api=draw(st.sampled_from(["openai_chat", "ollama_chat"])),
        model=draw(st.text(alphabet="qwen3-.:_/0123456789", max_size=20)),
        client=draw(st.integers(0, 9)), t_start_ms=draw(st.integers(0, 2**45)),
        kind=draw(st.sampled_from(["turn", "side_call"])),
        side_call_shape=draw(st.none() | st.sampled_from(["oneshot", "summarise"])),
        session=draw(st.integers(1, 9)), conversation=draw(st.none() | st.integers(1, 10**5)),
        turn=draw(st.none() | st.integers(1, 10**4)),
        counts=Counts(*[draw(opt_mv) for _ in range(7)]),  # type: ignore[arg-type]  # 7 MVs
        composition=(draw(plain_mv), draw(plain_mv), draw(plain_mv), draw(plain_mv)),
        linked_to=draw(st.none() | st.integers(1, 10**6)), new_conversation=draw(st.booleans()),
        prefix_tokens=draw(st.none() | st.integers(0, 10**6)),
        break_cause=draw(st.none() | st.sampled_from(["tools", "system"])),
        compaction=draw(st.booleans()), predicted_reuse=draw(st.none() | st.floats(0, 1)),
        observed_reuse=draw(st.none() | st.floats(0, 1)),
        cause=draw(st.none() | st.just("other_conversation")),
        lost_client=draw(loss), lost_external=draw(loss),
        side_calls_between=draw(st.lists(st.integers(1, 10**6), max_size=3)),
        other_conversations_between=draw(st.lists(st.integers(1, 10**6), max_size=3)),
        other_domains_between=draw(st.lists(st.integers(1, 10**6), max_size=3)),
        loss_measured=draw(st.booleans()), changed=draw(changes),
    )  # fmt: skip
    row.recording = draw(st.integers(0, 3))
    row.draft_n, row.draft_n_accepted = (
        draw(st.none() | st.integers(0, 99)),
        draw(st.none() | st.integers(0, 99)),
    )
    return row


@settings(max_examples=3000, deadline=None)
@given(any_rows())
def test_any_row_writes_as_the_python_writer(row: Row) -> None:
    assert outcome(rows.spill_line, row) == outcome(Row.spill_line, row)


@settings(max_examples=1500, deadline=None)
@given(ordinary_rows())
def test_ordinary_rows_are_written_in_c(row: Row) -> None:
    line = c_line(row)
    assert line is not None
    assert line == row.spill_line()


@settings(max_examples=3000, deadline=None)
@given(st.floats() | st.sampled_from(EDGE_FLOATS))
def test_floats_are_orjson_s(x: float) -> None:
    row = Row(
        id=1,
        api="a",
        model="m",
        client=0,
        t_start_ms=0,
        kind="turn",
        side_call_shape=None,
        session=1,
        conversation=None,
        turn=None,
        counts=Counts(),
        composition=((x, "estimate"),) * 4,
    )
    row.predicted_reuse = x
    assert c_line(row) == row.spill_line()
    assert orjson.dumps(x) in (c_line(row) or b"")


# -- the class as the C writer finds it ------------------------------------------


def small_fields() -> dict[str, Any]:
    return {
        "id": 7,
        "api": "openai_chat",
        "model": "m",
        "client": 1,
        "t_start_ms": 100,
        "kind": "turn",
        "side_call_shape": None,
        "session": 1,
        "conversation": 2,
        "turn": 3,
        "counts": Counts(),
        "composition": ((1, "server"),) * 4,
    }


def small_row() -> Row:
    return Row(**small_fields())


def test_a_subclass_is_read_through_its_own_attributes() -> None:
    class Loud(Row):
        __slots__ = ()

        @property
        def kind(self) -> str:  # a data descriptor over the slot
            return "LOUD"

        @kind.setter
        def kind(self, value: str) -> None:
            pass

    row = Loud(**small_fields())
    assert rows.spill_line(row) == Row.spill_line(row)
    assert b'"kind":"LOUD"' in rows.spill_line(row)
    assert rows.spill_line(small_row()) == small_row().spill_line()  # and Row again after it


def test_a_changed_class_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    row = small_row()
    before = rows.spill_line(row)
    monkeypatch.setattr(Row, "kind", property(lambda self: "patched"), raising=True)
    assert rows.spill_line(row) == Row.spill_line(row)
    assert b'"kind":"patched"' in rows.spill_line(row)
    monkeypatch.undo()
    assert rows.spill_line(row) == before


def test_an_unset_field_is_the_python_writer_s_error() -> None:
    row = small_row()
    del row.kind
    assert c_line(row) is None
    with pytest.raises(AttributeError):
        rows.spill_line(row)


def test_a_long_row_grows_the_buffer() -> None:
    row = small_row()
    row.side_calls_between = list(range(5000))
    row.changed = [{"index": i, "role": "user", "within": "x" * 50} for i in range(200)]
    line = c_line(row)
    assert line is not None and len(line) > 4096
    assert line == row.spill_line()


# -- whole reports -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_every_scenario_s_report_is_the_python_writer_s(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = TRAFFIC[name]().write(tmp_path / "rec.jsonl", "digest")
    with_c = report_bytes([path])
    monkeypatch.setattr(report, "spill_line", Row.spill_line)
    assert report_bytes([path]) == with_c
    kept = analyze([str(path)], progress=False, keep=True)
    try:
        assert kept.engine.kept
        for row in kept.engine.kept:
            assert c_line(row) == row.spill_line()  # every row by C itself
    finally:
        kept.close()


def test_a_mixed_recording_s_rows(tmp_path: Path) -> None:
    path = sc.title_side_call().write(tmp_path / "r.jsonl", "mixed")
    kept = analyze([str(path)], progress=False, keep=True)
    try:
        assert kept.engine.kept is not None and len(kept.engine.kept) > 2
        for row in kept.engine.kept:
            assert c_line(row) == row.spill_line()
    finally:
        kept.close()


# -- a build that does not fit Row is refused ---------------------------------


class _StaleBuild:
    """A `_rowjson` build that names its fields differently from `Row`'s: what an old .so is."""

    def __init__(self, **names: tuple[str, ...]) -> None:
        assert _rowjson is not None
        self.calls = 0
        for attr in ("WRITES", "MARKER", "COUNTS", "LOSS"):
            setattr(self, attr, names.get(attr, getattr(_rowjson, attr)))

    def spill_line(self, row: Row) -> bytes | None:
        self.calls += 1
        return c_line(row)


def test_the_built_writer_fits_row() -> None:
    assert _rowjson is not None
    assert rows.c_writer_fits(_rowjson)
    fitting = _StaleBuild()
    assert rows.writer(fitting) is not Row.spill_line
    rows.writer(fitting)(small_row())
    assert fitting.calls == 1


@pytest.mark.parametrize(
    "names",
    [
        {"WRITES": ("id", "api", "model", "client", "t_start_ms")},  # a field missing
        {"WRITES": ("id", "model", "api", "client", *rows._TAIL)},  # two fields swapped
        {"MARKER": ("client", "recording", "draft_n")},
        {"COUNTS": ("prompt_tokens", "completion_tokens")},
        {"LOSS": ("cause", "tokens")},
        {"WRITES": ()},  # a build from before the names were exported
    ],
)
def test_a_stale_build_is_refused_for_the_python_writer(names: dict[str, tuple[str, ...]]) -> None:
    stale = _StaleBuild(**names)
    assert not rows.c_writer_fits(stale)
    write = rows.writer(stale)
    assert write is Row.spill_line
    row = small_row()
    assert write(row) == c_line(row) == row.spill_line()
    assert stale.calls == 0
