"""Publishing under injected faults: every failed step leaves the directory as it was."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import BinaryIO

import pytest

from dirtools import save, snapshot
from pitstop.core.records import Best, Policy
from pitstop.core.saving.schedule import Call
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.storage import LocalStorage
from storagetrace import StuckLeftovers


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


FAULTY_OPS = (
    "create_exclusive",
    "write",
    "sync_file",
    "replace",
    "sync_directory",
    "symlink",
    "remove",
)


class FaultyStorage(LocalStorage):
    """A local directory whose ``fail_at``-th mutating operation raises EIO (once)."""

    def __init__(self, root: Path, fail_at: int | None = None) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.ops: list[str] = []

    def _step(self, op: str) -> None:
        self.ops.append(op)
        if self.fail_at is not None and len(self.ops) == self.fail_at:
            raise OSError(errno.EIO, f"injected fault in {op}")

    def create_exclusive(self, name: str) -> BinaryIO:
        self._step("create_exclusive")
        file = super().create_exclusive(name)
        storage = self

        class _File:  # a file whose write() is a step too
            def write(self, data: bytes) -> int:
                storage._step("write")
                return file.write(data)

            def __getattr__(self, attr: str) -> object:
                return getattr(file, attr)

        return _File()  # type: ignore[return-value]

    def sync_file(self, file: BinaryIO) -> None:
        self._step("sync_file")
        super().sync_file(file)

    def replace(self, source: str, target: str) -> None:
        self._step("replace")
        super().replace(source, target)

    def sync_directory(self) -> None:
        self._step("sync_directory")
        super().sync_directory()

    def symlink(self, target: str, name: str) -> None:
        self._step("symlink")
        super().symlink(target, name)

    def remove(self, name: str) -> None:
        self._step("remove")
        super().remove(name)


def _directory(path: Path, storage: FaultyStorage) -> CheckpointDirectory:
    directory = CheckpointDirectory(path, policy=Policy(keep_last=1), storage=storage)
    directory.open()
    return directory


def _count_ops(tmp_path: Path) -> int:
    storage = FaultyStorage(tmp_path / "count")
    with _directory(tmp_path / "count", storage) as directory:
        save(directory, 1, metrics={"loss": 1.0})
        storage.ops.clear()
        save(directory, 2, metrics={"loss": 0.5})
    assert set(storage.ops) <= set(FAULTY_OPS)
    return len(storage.ops)


def test_a_fault_at_every_step_leaves_the_previous_checkpoint_and_pointers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    total = _count_ops(tmp_path)
    assert total >= 15  # the whole sequence: file, three symlinks, latest.json, deletion
    outcomes = {"failed": 0, "published": 0}
    for fail_at in range(1, total + 1):
        path = tmp_path / f"run{fail_at}"
        storage = FaultyStorage(path)
        directory = _directory(path, storage)
        save(directory, 1, metrics={"loss": 1.0})
        before = snapshot(path)
        storage.ops.clear()
        storage.fail_at = fail_at
        try:
            save(directory, 2, metrics={"loss": 0.5})
        except SaveError as exc:
            outcomes["failed"] += 1
            message = str(exc)
            assert "injected fault" in message
            assert snapshot(path) == before, f"fault at op {fail_at} ({storage.ops[-1]})"
            fileformat.verify(path / "step_000000000001.pitstop")
            found = scan(LocalStorage(path))
            assert [e.step for e in found.catalog] == [1]
            assert found.warnings == ()
        else:
            # Only a failed deletion lets the save through: the old file stays for next time.
            outcomes["published"] += 1
            assert storage.ops[fail_at - 1] in {"remove", "sync_directory"}
            found = scan(LocalStorage(path))
            assert found.pointers.last == "step_000000000002.pitstop"
            fileformat.verify(path / "step_000000000002.pitstop")
        finally:
            directory.close()
        assert not [n for n in os.listdir(path) if n.startswith(".tmp-")]
    assert outcomes["failed"] >= total - 2


def test_a_failed_publish_of_a_replacement_keeps_the_old_file(tmp_path: Path) -> None:
    storage = FaultyStorage(tmp_path)
    with _directory(tmp_path, storage) as directory:
        save(directory, 5)
        before = snapshot(tmp_path)
        storage.ops.clear()
        storage.fail_at = 3  # create, write..., the file's fsync or its first write
        with pytest.raises(SaveError, match=r"step_000000000005\.pitstop"):
            save(directory, 5)
        assert snapshot(tmp_path) == before


class FailsAfterReplacing(LocalStorage):
    """A local directory whose directory fsync right after a rename onto ``name`` raises
    ``error`` (once): the moment a replacement has taken the old file's place."""

    def __init__(self, root: Path, name: str, error: BaseException) -> None:
        super().__init__(root)
        self.name, self.error = name, error
        self.renamed: str | None = None
        self.armed = False

    def replace(self, source: str, target: str) -> None:
        super().replace(source, target)
        self.renamed = target

    def sync_directory(self) -> None:
        if self.armed and self.renamed == self.name:
            self.armed = False
            raise self.error
        super().sync_directory()


@pytest.mark.parametrize(
    "error", [OSError(errno.EIO, "injected fault"), KeyboardInterrupt()], ids=["EIO", "Ctrl-C"]
)
def test_a_replacement_whose_directory_fsync_fails_stays_and_the_directory_knows_it(
    tmp_path: Path, error: BaseException
) -> None:
    """Before, the undo removed the step's file: the rename had already taken the old one, so
    the directory held neither, and `last` named a missing file."""
    name = "step_000000000005.pitstop"
    storage = FailsAfterReplacing(tmp_path, name, error)
    with _directory(tmp_path, storage) as directory:
        save(directory, 4)
        save(directory, 5)
        old = fileformat.read_manifest(tmp_path / name).meta["seq"]
        storage.armed = True
        expected = SaveError if isinstance(error, OSError) else KeyboardInterrupt
        with pytest.raises(expected) as raised:
            save(directory, 5, tree={"weights": {"raw": {}}, "step": "again"})
        if expected is SaveError:
            message = str(raised.value)
            assert f"could not fsync the directory of {tmp_path / name}: " in message
            assert f"{tmp_path / name} holds the new file, complete and fsynced" in message
        # The new checkpoint is in place, whole; nothing names a missing file.
        fileformat.verify(tmp_path / name)
        assert fileformat.load(tmp_path / name)["step"] == "again"
        found = scan(LocalStorage(tmp_path))
        assert [e.name for e in found.catalog] == [name]
        assert found.pointers.targets() == {name}
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
        # The directory's own view is what is on disk: the next save numbers after it.
        assert directory.catalog == found.catalog
        assert directory.catalog.get(name).seq == old + 1  # type: ignore[union-attr]
        save(directory, 6)
    found = scan(LocalStorage(tmp_path))
    assert [(e.step, e.seq) for e in found.catalog] == [(6, old + 2)]  # keep_last=1
    assert found.warnings == ()


class FillsUp(LocalStorage):
    """A local directory whose rename onto ``name`` fails with EIO, after which the disk is
    full — nothing can be created (ENOSPC), renames and removals still work — until
    ``healed`` (``interrupt``: the first creation after the fault raises KeyboardInterrupt):
    a disk failing in the middle of a save's pointer phase."""

    def __init__(self, root: Path, name: str, interrupt: bool = False) -> None:
        super().__init__(root)
        self.name, self.interrupt = name, interrupt
        self.armed = self.full = False

    def _create(self) -> None:
        if self.full and self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        if self.full:
            raise OSError(errno.ENOSPC, "no space left on device")

    def create_exclusive(self, name: str) -> BinaryIO:
        self._create()
        return super().create_exclusive(name)

    def symlink(self, target: str, name: str) -> None:
        self._create()
        super().symlink(target, name)

    def replace(self, source: str, target: str) -> None:
        if self.armed and target == self.name:
            self.armed, self.full = False, True
            raise OSError(errno.EIO, "injected fault")
        super().replace(source, target)

    def healed(self) -> None:
        self.full = False


def _dangling(path: Path) -> list[str]:
    """Every pointer on disk (symlink or latest.json entry) that names a missing file."""
    found = [p for p in ("last", "best", "final") if (path / p).is_symlink()]
    dangling = [p for p in found if not (path / os.readlink(path / p)).is_file()]
    latest = json.loads((path / "latest.json").read_text())
    return dangling + [
        f"latest.json:{p}"
        for p, target in latest["pointers"].items()
        if target is not None and not (path / target).is_file()
    ]


@pytest.mark.parametrize("fails_at", ["best", "latest.json"])
@pytest.mark.parametrize("interrupt", [False, True], ids=["ENOSPC", "Ctrl-C"])
def test_a_rollback_that_cannot_put_the_pointers_back_keeps_the_new_file(
    tmp_path: Path, fails_at: str, interrupt: bool
) -> None:
    """Before, the rollback removed the new file even when restoring the pointers failed:
    `last` (already moved) named a deleted file."""
    storage = FillsUp(tmp_path, fails_at, interrupt=interrupt)
    policy = Policy(keep_last=None, best=Best("loss"))
    new = tmp_path / "step_000000000002.pitstop"
    with CheckpointDirectory(tmp_path, policy=policy, storage=storage) as directory:
        save(directory, 1, call=Call.MAYBE, metrics={"loss": 1.0})
        storage.armed = True
        with pytest.raises(KeyboardInterrupt if interrupt else SaveError) as raised:
            save(directory, 2, call=Call.MAYBE, metrics={"loss": 0.5})
        assert _dangling(tmp_path) == []
        fileformat.verify(new)
        if not interrupt:
            message = str(raised.value)
            assert "injected fault" in message
            assert "the pointers could not be put back (" in message
            assert "no space left on device" in message
            assert f"so {new} stays: it is complete and durable" in message
        found = scan(LocalStorage(tmp_path))
        assert [e.step for e in found.catalog] == [1, 2]
        assert [(e.name, e.seq) for e in directory.catalog] == [
            (e.name, e.seq) for e in found.catalog
        ]
        storage.healed()
        save(directory, 3, call=Call.MAYBE, metrics={"loss": 0.25})
    found = scan(LocalStorage(tmp_path))
    assert [(e.step, e.seq) for e in found.catalog] == [(1, 1), (2, 2), (3, 3)]
    assert (found.pointers.last, found.pointers.best) == (_name(3), _name(3))
    assert found.warnings == ()


def test_a_filesystem_without_symlinks_keeps_pointers_in_latest_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class NoSymlinks(LocalStorage):
        def symlink(self, target: str, name: str) -> None:
            raise OSError(errno.EPERM, "symlinks not supported")

    directory = CheckpointDirectory(tmp_path, storage=NoSymlinks(tmp_path))
    with directory, caplog.at_level(logging.WARNING, logger="pitstop"):
        save(directory, 3)
    assert not (tmp_path / "last").exists()
    found = scan(LocalStorage(tmp_path))
    assert found.pointers.last == "step_000000000003.pitstop"
    assert "symlinks unsupported" in caplog.text


def test_a_failed_first_save_leaves_an_empty_directory_empty(tmp_path: Path) -> None:
    """The rollback of a first save restores "no pointers" — it writes no latest.json."""
    probe = FaultyStorage(tmp_path / "count")
    with _directory(tmp_path / "count", probe) as directory:
        save(directory, 1)
    total = len(probe.ops)
    for fail_at in range(1, total + 1):
        path = tmp_path / f"run{fail_at}"
        storage = FaultyStorage(path, fail_at=fail_at)
        with _directory(path, storage) as directory:
            try:
                save(directory, 1)
            except SaveError as error:
                message = str(error)
                assert "step 1" in message
                assert snapshot(path) == {}, f"fault at op {fail_at} ({storage.ops[-1]})"
            else:
                assert storage.ops[fail_at - 1] in {"remove", "sync_directory"}


@pytest.mark.parametrize("onto", [_name(2), "last", "latest.json"])
def test_a_temp_file_a_failed_save_could_not_remove_never_blocks_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, onto: str
) -> None:
    """Before, a temp name carried only the run id: once a failed save could not remove its
    temp file (the checkpoint's, a pointer's, latest.json's), every later save of that name in
    the run failed with EEXIST, until the directory was opened again."""
    directory = CheckpointDirectory(tmp_path, policy=Policy(keep_last=2))
    with directory:
        save(directory, 1)
        stuck = StuckLeftovers(monkeypatch, onto)
        with pytest.raises(SaveError, match="injected fault"):
            save(directory, 2)
        stuck.armed = False
        left = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
        assert [n for n in left if n.endswith(f"-{onto}")], left
        save(directory, 2, tree={"weights": {"raw": {}}, "step": "again"})
        assert fileformat.load(tmp_path / _name(2))["step"] == "again"
        assert scan(LocalStorage(tmp_path)).pointers.last == _name(2)
    with CheckpointDirectory(tmp_path):  # the next open still removes what was left
        pass
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    fileformat.verify(tmp_path / _name(2))
