"""write_atomically: every file outside a checkpoint's own publish is written the same way."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from pitstop.errors import SaveError
from pitstop.shell.store import atomic
from pitstop.shell.store.atomic import write_atomically
from pitstop.shell.store.storage import LocalStorage
from storagetrace import Op, OsSpy, durability_problems, recording_local_storage


def test_the_file_appears_with_what_was_written(tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "notes.txt"
    assert write_atomically(target, lambda f: f.write(b"hello")) == target
    assert target.read_bytes() == b"hello"
    assert os.listdir(target.parent) == ["notes.txt"]


def test_the_data_and_the_rename_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = OsSpy(monkeypatch)
    target = tmp_path / "notes.txt"
    write_atomically(target, lambda f: f.write(b"hello"))
    assert spy.problems(target) == []


def test_the_spy_notices_a_missing_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = OsSpy(monkeypatch)
    monkeypatch.setattr(LocalStorage, "sync_file", lambda self, file: None)
    monkeypatch.setattr(LocalStorage, "sync_directory", lambda self: None)
    target = tmp_path / "notes.txt"
    write_atomically(target, lambda f: f.write(b"hello"))
    assert spy.problems(target) == [
        f"{target}: its data was not fsynced before the rename",
        f"{tmp_path}: the directory was not fsynced after the rename",
    ]


def test_large_writes_arrive_whole(tmp_path: Path) -> None:
    # The writer gets a buffered file: a raw write may take fewer bytes than it was given.
    data = os.urandom(3 << 20)
    target = write_atomically(tmp_path / "big.bin", lambda f: f.write(data))
    assert target.read_bytes() == data


def _failing_write(file: BinaryIO) -> None:
    file.write(b"half a file")
    raise OSError(errno.ENOSPC, "disk full")


def test_a_failed_write_names_the_path_and_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "notes.txt"
    target.write_bytes(b"before")
    with pytest.raises(SaveError, match=r"could not write .*notes\.txt: .*disk full") as info:
        write_atomically(target, _failing_write)
    assert str(target) in str(info.value)
    assert ".tmp-" not in str(info.value)  # the user's path, not the temp file's
    assert isinstance(info.value.__cause__, OSError)
    assert target.read_bytes() == b"before"
    assert os.listdir(tmp_path) == ["notes.txt"]  # no temp file left


def test_a_failed_fsync_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: LocalStorage, file: BinaryIO) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(LocalStorage, "sync_file", fail)
    target = tmp_path / "notes.txt"
    with pytest.raises(SaveError, match=r"could not fsync .*notes\.txt: .*injected"):
        write_atomically(target, lambda f: f.write(b"hello"))
    assert os.listdir(tmp_path) == []


def test_files_are_made_like_any_file_the_user_creates(tmp_path: Path) -> None:
    (tmp_path / "probe").touch()
    target = write_atomically(tmp_path / "notes.txt", lambda f: f.write(b"x"))
    assert target.stat().st_mode == (tmp_path / "probe").stat().st_mode


def test_a_path_that_names_no_file_is_refused(tmp_path: Path) -> None:
    for path in (tmp_path / "..", Path("/")):
        with pytest.raises(SaveError, match="does not name a file"):
            write_atomically(path, lambda f: f.write(b"x"))


def test_a_directory_in_the_way_is_a_save_error(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(SaveError, match=r"could not rename .*taken: "):
        write_atomically(tmp_path / "taken", lambda f: f.write(b"x"))
    assert os.listdir(tmp_path) == ["taken"]


def test_it_goes_through_the_publish_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops: list[Op] = []
    monkeypatch.setattr(atomic, "LocalStorage", recording_local_storage(ops))
    write_atomically(tmp_path / "notes.txt", lambda f: f.write(b"hello"))
    assert [op.kind for op in ops] == [
        "create",
        "write",
        "sync_file",
        "close",
        "replace",
        "sync_directory",
    ]
    assert durability_problems(ops) == []


def _directory_fsync_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.fsync`` of a directory descriptor raises EIO; of a file, it works."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "injected directory fsync fault")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_replacement_whose_directory_fsync_fails_keeps_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename took the old file away: taking the new one out too (as before) left
    neither. The new one, complete and fsynced, stays, and the error says so."""
    target = tmp_path / "weights.pt"
    target.write_bytes(b"before")
    _directory_fsync_fails(monkeypatch)
    with pytest.raises(SaveError) as info:
        write_atomically(target, lambda f: f.write(b"after"))
    message = str(info.value)
    assert message.startswith(f"could not fsync the directory of {target}: ")
    assert f"{target} holds the new file, complete and fsynced" in message
    assert target.read_bytes() == b"after"
    assert os.listdir(tmp_path) == ["weights.pt"]


def test_a_new_file_whose_directory_fsync_fails_is_taken_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _directory_fsync_fails(monkeypatch)
    with pytest.raises(SaveError, match="could not fsync the directory of") as info:
        write_atomically(tmp_path / "weights.pt", lambda f: f.write(b"after"))
    assert "holds the new file" not in str(info.value)
    assert os.listdir(tmp_path) == []
