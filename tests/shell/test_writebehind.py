"""Write-behind (pitstop.shell.format.writebehind): a file's written bytes handed to the kernel's
writeback as they come, by a checkpoint file's writer and by the streams DCP writes through.

The kernel's function is replaced by a recorder where a test checks which ranges were handed
over or what an error does; the real one runs on real files where a test checks the bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import zlib
from pathlib import Path

import pytest
import torch

from pitstop.shell.format import fileformat, writebehind
from pitstop.shell.format.writebehind import KICK, WriteBehind
from pitstop.shell.sharded.dcpwrite import CrcFileSystem

MIB = 1 << 20


class Recorder:
    """Stands in for sync_file_range: records ``(fd, start, length)``, returns ``result``
    with ``code`` as errno."""

    def __init__(self, result: int = 0, code: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.result, self.code = result, code

    def __call__(self, fd: int, start: int, length: int, flags: int) -> int:
        assert flags == 2  # SYNC_FILE_RANGE_WRITE alone: start the writeback, never wait
        self.calls.append((fd, start, length))
        ctypes.set_errno(self.code)
        return self.result


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    spy = Recorder()
    monkeypatch.setattr(writebehind, "_SYNC_FILE_RANGE", spy)
    monkeypatch.setattr(writebehind, "AVAILABLE", True)
    return spy


def _covered(calls: list[tuple[int, int, int]]) -> int:
    """The end of the ranges handed over, checked to follow each other from offset 0."""
    end = 0
    for _, start, length in calls:
        assert start == end
        end = start + length
    return end


def test_ranges_are_handed_over_every_few_mib_each_once_and_in_order(recorder: Recorder) -> None:
    behind = WriteBehind(7, "f", every=4)
    for end in (1, 3, 4, 5, 9, 10, 13):
        behind.wrote(end)
    assert recorder.calls == [(7, 0, 4), (7, 4, 5), (7, 9, 4)]


def test_an_io_error_is_raised_naming_the_file(recorder: Recorder) -> None:
    recorder.result, recorder.code = -1, errno.EIO
    behind = WriteBehind(3, "/x/step_000000000001.pitstop", every=1)
    with pytest.raises(OSError, match=r"could not write /x/step_000000000001\.pitstop") as raised:
        behind.wrote(2)
    assert raised.value.errno == errno.EIO


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ESPIPE, errno.ENOSYS])
def test_a_file_system_without_it_turns_it_off_for_that_file(recorder: Recorder, code: int) -> None:
    recorder.result, recorder.code = -1, code
    behind = WriteBehind(3, "f", every=1)
    behind.wrote(2)  # refused: not an error
    assert not behind.active
    behind.wrote(5)
    assert len(recorder.calls) == 1  # never asked again


def test_without_a_descriptor_or_the_function_it_does_nothing(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle = WriteBehind.of(object())
    idle.wrote(10 * KICK)
    assert not idle.active
    monkeypatch.setattr(writebehind, "AVAILABLE", False)  # not Linux
    assert not WriteBehind(3, "f").active
    assert recorder.calls == []


def test_a_checkpoint_file_is_handed_over_as_it_is_written(
    recorder: Recorder, tmp_path: Path
) -> None:
    tree = {"big": torch.randn(3 * MIB // 4 * 2), "small": torch.arange(3)}  # 6 MiB of data
    path = tmp_path / "a.pitstop"
    with path.open("wb") as file:
        written = fileformat.write(file, fileformat.prepare(tree), {})
        fd = file.fileno()
    assert {call[0] for call in recorder.calls} == {fd}
    assert written - KICK < _covered(recorder.calls) <= written
    fileformat.verify(path)


def test_a_dcp_stream_is_handed_over_as_dcp_writes(recorder: Recorder, tmp_path: Path) -> None:
    fs = CrcFileSystem()
    piece = os.urandom(MIB)
    with fs.create_stream(tmp_path / "shard", "wb") as stream:
        for _ in range(5):
            stream.write(piece)
        stream.close()
    assert _covered(recorder.calls) == 4 * MIB  # at 2 MiB and 4 MiB; the fsync does the tail
    assert fs.written(tmp_path) == {"shard": (5 * MIB, zlib.crc32(piece * 5))}


@pytest.mark.skipif(not writebehind.AVAILABLE, reason="sync_file_range is Linux's")
def test_the_real_call_leaves_every_byte_as_written(tmp_path: Path) -> None:
    data = os.urandom(5 * MIB + 123)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        behind = WriteBehind(fd, path, every=MIB)
        position = 0
        for start in range(0, len(data), 300_000):
            position += os.write(fd, data[start : start + 300_000])
            behind.wrote(position)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data  # (a file system that refused it turned it off: the same)


@pytest.mark.parametrize("error", [AttributeError, OSError, TypeError])
def test_a_c_library_without_the_function_leaves_it_idle(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """macOS has no sync_file_range (AttributeError), Windows no CDLL(None) (TypeError)."""

    def cdll(*args: object, **kwargs: object) -> object:
        raise error("no such function")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert writebehind._sync_file_range() is None
