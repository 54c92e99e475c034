"""Reading this process's own memory as the builder child reads the proxy's."""

from __future__ import annotations

import os

import pytest

from llmp.recorder import peer_memory

pytestmark = pytest.mark.skipif(not peer_memory.supported(), reason="process_vm_readv is Linux's")


def _spans(buffers: list[bytes]) -> list[tuple[int, int]]:
    return [(peer_memory.address_of(b), len(b)) for b in buffers]


def test_reads_the_bytes_where_they_lie() -> None:
    buffers = [os.urandom(n) for n in (1, 0, 4096, 300_000, 7)]
    got = peer_memory.read_spans(os.getpid(), _spans(buffers))
    assert bytes(got) == b"".join(buffers)


def test_more_spans_than_one_call_takes() -> None:
    buffers = [os.urandom(1 + i % 50) for i in range(2500)]  # > IOV_MAX: several calls
    assert bytes(peer_memory.read_spans(os.getpid(), _spans(buffers))) == b"".join(buffers)


def test_nothing_to_read() -> None:
    assert peer_memory.read_spans(os.getpid(), []) == bytearray()
    assert peer_memory.read_spans(os.getpid(), _spans([b""])) == bytearray()


def test_an_unmapped_span_is_an_error() -> None:
    with pytest.raises(OSError):
        peer_memory.read_spans(os.getpid(), [(1, 10)])


def test_only_bytes_objects_have_an_address() -> None:
    with pytest.raises(TypeError):
        peer_memory.address_of(bytearray(b"abc"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("done", "left"),
    [
        (0, [(100, 5), (200, 3)]),
        (2, [(102, 3), (200, 3)]),
        (5, [(200, 3)]),
        (6, [(201, 2)]),
        (8, []),
    ],
)
def test_a_read_that_stops_part_way_goes_on_from_there(
    done: int, left: list[tuple[int, int]]
) -> None:
    assert peer_memory._skip([(100, 5), (200, 3)], done) == left
