"""The recording file: 0600, exclusive lock, whole lines, never blocking the caller (R14)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from llmp.recorder.capture import Capture
from llmp.recorder.writer import RecordingError, RecordingFile, RecordWriter


def _cap(i: int) -> Capture:
    return Capture(id=i, conn=1, t_start_ms=1, method="GET", path="/health", status=200, t_end_ms=2)


def test_new_file_is_0600_and_lines_are_whole(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    writer = RecordWriter(RecordingFile(str(path)), "digest")
    for i in range(1, 51):
        writer.submit(_cap(i))
    writer.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    ids = [orjson.loads(line)["id"] for line in lines[:-1]]
    assert ids == list(range(1, 51))
    assert writer.written == 50


def test_second_writer_refuses_clearly(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    first = RecordingFile(str(path))
    with pytest.raises(RecordingError, match="in use by another recorder"):
        RecordingFile(str(path))
    # also from another process
    code = (
        "import sys; from llmp.recorder.writer import RecordingFile, RecordingError\n"
        f"try:\n    RecordingFile({str(path)!r})\nexcept RecordingError as e:\n    print(e); sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 3 and "in use" in proc.stdout
    first.close()
    RecordingFile(str(path)).close()


def test_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="cannot open recording"):
        RecordingFile(str(tmp_path / "missing-dir" / "rec.jsonl"))


def test_partial_last_line_from_elsewhere_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b'{"v":1,"id":1}\n{"v":1,"id"')
    writer = RecordWriter(RecordingFile(str(path)), "digest")
    writer.submit(_cap(7))
    writer.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == b'{"v":1,"id"'
    assert orjson.loads(lines[2])["id"] == 7


def test_write_failure_leaves_no_partial_line_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rec.jsonl"
    rf = RecordingFile(str(path))
    writer = RecordWriter(rf, "digest")
    writer.submit(_cap(1))
    real_write = os.write
    calls = {"n": 0}

    def flaky(fd: int, data: object) -> int:
        if fd == rf.fd:
            calls["n"] += 1
            if calls["n"] >= 2:
                written = real_write(fd, bytes(data)[:5])  # type: ignore[call-overload]
                assert written == 5
                raise OSError(28, "No space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]

    import llmp.recorder.writer as w

    writer.close()
    rf2 = RecordingFile(str(path))
    writer2 = RecordWriter(rf2, "digest")
    rf = rf2
    w.os.write = flaky
    try:
        writer2.submit(_cap(2))
        writer2.submit(_cap(3))
        writer2.submit(_cap(4))
        writer2.close()
    finally:
        w.os.write = real_write
    data = path.read_bytes()
    assert data.endswith(b"\n")
    ids = [orjson.loads(line)["id"] for line in data.splitlines()]
    assert ids == [1, 2]
    assert writer2.failed == "No space left on device" and writer2.lost == 2
    assert "STOPPED RECORDING" in caplog.text


def test_record_cut_short_by_a_kill_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    whole = b'{"v":1,"id":1,"conn":1}\n'
    path.write_bytes(whole + b'{"v":1,"id":2,"conn":1,"request":{"body":"' + b"x" * 200_000)
    writer = RecordWriter(RecordingFile(str(path)), "digest")
    writer.submit(_cap(3))
    writer.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[0] + b"\n" == whole
    assert orjson.loads(lines[1])["id"] == 3 and lines[2] == b""


def test_records_are_built_in_a_child_that_can_die(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    writer = RecordWriter(RecordingFile(str(path)), "digest")
    builder = writer._builder
    assert builder is not None and builder.proc.poll() is None
    writer.submit(_cap(1))
    for _ in range(200):  # wait until the first record went through the child
        if writer.written == 1:
            break
        import time

        time.sleep(0.01)
    builder.proc.kill()
    builder.proc.wait()
    writer.submit(_cap(2))  # the child is gone: built in-thread instead
    writer.submit(_cap(3))
    writer.close()
    ids = [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()]
    assert ids == [1, 2, 3]
    assert writer._builder is None


def test_child_builder_exits_with_the_writer(tmp_path: Path) -> None:
    writer = RecordWriter(RecordingFile(str(tmp_path / "rec.jsonl")), "full")
    builder = writer._builder
    assert builder is not None
    writer.close()
    assert builder.proc.returncode == 0
