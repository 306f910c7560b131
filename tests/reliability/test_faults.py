"""Suite 3 — a fault at each call site of a save (create, write, fsync, rename, directory
fsync, symlink, removal), as EIO, ENOSPC and EROFS, and a real full filesystem.

Every failed save is a loud SaveError naming the step, the checkpoint and the error; the
previous checkpoint and every pointer are byte-identical to before; nothing is half-published
(no temp file, no new name); and the next save succeeds once the fault is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

import pitstop
from dirtools import save, snapshot
from pitstop.core.naming import TEMP_PREFIX
from pitstop.core.records import Best, Policy
from pitstop.core.saving.schedule import Call
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.storage import LocalStorage

ERRNOS = (errno.EIO, errno.ENOSPC, errno.EROFS)
STEP1, STEP2 = "step_000000000001.pitstop", "step_000000000002.pitstop"


class FaultStorage(LocalStorage):
    """A local directory whose ``fail_at``-th mutating operation fails with ``code``, once.

    A failing write first writes half of what it was given (a short write, as a full disk
    makes); ``sites`` records the name of each operation, in order.
    """

    def __init__(self, root: Path, code: int = errno.EIO) -> None:
        super().__init__(root)
        self.code = code
        self.fail_at: int | None = None
        self.sites: list[str] = []

    def _step(self, site: str) -> bool:
        self.sites.append(site)
        return self.fail_at is not None and len(self.sites) == self.fail_at

    def _raise(self, site: str) -> None:
        raise OSError(self.code, f"{os.strerror(self.code)} (injected at {site})")

    def create_exclusive(self, name: str) -> BinaryIO:
        if self._step("create"):
            self._raise("create")
        file = super().create_exclusive(name)
        storage = self

        class _File:
            def write(self, data: bytes) -> int:
                if storage._step("write"):
                    file.write(bytes(memoryview(data)[: len(data) // 2]))
                    storage._raise("write")
                return file.write(data)

            def __getattr__(self, attr: str) -> object:
                return getattr(file, attr)

        return _File()  # type: ignore[return-value]

    def sync_file(self, file: BinaryIO) -> None:
        if self._step("fsync"):
            self._raise("fsync")
        super().sync_file(file)

    def replace(self, source: str, target: str) -> None:
        if self._step(f"rename to {target}"):
            self._raise("rename")
        super().replace(source, target)

    def sync_directory(self) -> None:
        if self._step("directory fsync"):
            self._raise("directory fsync")
        super().sync_directory()

    def symlink(self, target: str, name: str) -> None:
        if self._step("symlink"):
            self._raise("symlink")
        super().symlink(target, name)

    def remove(self, name: str) -> None:
        if self._step("remove"):
            self._raise("remove")
        super().remove(name)


POLICY = Policy(keep_last=1, best=Best("loss"))


def _sites(tmp_path: Path) -> list[str]:
    storage = FaultStorage(tmp_path / "count")
    with CheckpointDirectory(storage.root, policy=POLICY, storage=storage) as directory:
        save(directory, 1, call=Call.MAYBE, metrics={"loss": 1.0})
        storage.sites.clear()
        save(directory, 2, call=Call.MAYBE, metrics={"loss": 0.5})
    return list(storage.sites)


def _no_temp_files(path: Path) -> None:
    assert not [n for n in os.listdir(path) if n.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("code", ERRNOS, ids=[errno.errorcode[c] for c in ERRNOS])
def test_a_fault_at_each_call_site_is_loud_and_leaves_the_previous_checkpoint(
    tmp_path: Path, code: int
) -> None:
    sites = _sites(tmp_path)
    kinds = {s.split(" to ")[0] for s in sites}
    assert {"create", "write", "fsync", "rename", "directory fsync", "symlink", "remove"} <= kinds
    failed: set[str] = set()
    for fail_at, site in enumerate(sites, start=1):
        path = tmp_path / f"run{fail_at}"
        storage = FaultStorage(path, code)
        with CheckpointDirectory(path, policy=POLICY, storage=storage) as directory:
            save(directory, 1, call=Call.MAYBE, metrics={"loss": 1.0})
            before = snapshot(path)
            storage.sites.clear()
            storage.fail_at = fail_at
            try:
                save(directory, 2, call=Call.MAYBE, metrics={"loss": 0.5})
            except SaveError as error:
                message = str(error)
                for part in ("step 2", STEP2, os.strerror(code)):
                    assert part in message, f"fault at {site}: {part!r} not in {message!r}"
                assert snapshot(path) == before, f"fault at {site} changed the directory"
                fileformat.verify(path / STEP1)
                found = scan(LocalStorage(path), POLICY.best)
                assert [e.step for e in found.catalog] == [1]
                assert found.warnings == ()
                failed.add(site)
            else:  # only retention's deletion may fail quietly: the old file stays, for later
                assert site in {"remove", "directory fsync"}, f"a fault at {site} was lost"
                assert sites[fail_at - 2 if site == "directory fsync" else fail_at - 1] in {
                    "remove",
                    "directory fsync",
                }
            _no_temp_files(path)
            storage.fail_at = None  # the fault is gone: the next save succeeds
            save(directory, 2, call=Call.MAYBE, metrics={"loss": 0.5})
        found = scan(LocalStorage(path), POLICY.best)
        assert found.pointers.last == found.pointers.best == STEP2
        fileformat.verify(path / STEP2)
        shutil.rmtree(path)
    assert len(failed) >= len(set(sites)) - 2


# --- through the Checkpointer, in each mode ---------------------------------------------------


def _save_and_wait(ckpt: pitstop.Checkpointer, step: int) -> None:
    ckpt.save(pitstop.Progress(step=step))
    ckpt.wait()  # a background save's error comes from here


def _full_disk_at(target: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the rename onto ``target`` fail with ENOSPC once; returns a counter of failures."""
    failures: list[int] = []
    real = LocalStorage.replace

    def replace(self: LocalStorage, source: str, name: str) -> None:
        if name == target and not failures:
            failures.append(1)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, source, name)

    monkeypatch.setattr(LocalStorage, "replace", replace)
    return failures


@pytest.mark.parametrize("mode", [False, True, "overlap"], ids=["sync", "async", "overlap"])
@pytest.mark.parametrize("target", ["latest.json", STEP2, "last"])
def test_a_full_disk_at_any_file_names_the_step_and_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str, target: str
) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pitstop.Checkpointer(
        tmp_path,
        model=model,
        state={"opt": opt},
        async_save=mode,  # type: ignore[arg-type]
    ) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        ckpt.wait()
        before = snapshot(tmp_path)
        failures = _full_disk_at(target, monkeypatch)
        with pytest.raises(SaveError) as info:
            _save_and_wait(ckpt, 2)
        assert failures == [1]
        message = str(info.value)
        assert "step 2" in message
        assert STEP2 in message
        assert "No space left" in message
        assert snapshot(tmp_path) == before
        _no_temp_files(tmp_path)
        ckpt.save(pitstop.Progress(step=2))  # the disk has room again
        ckpt.wait()
    assert scan(LocalStorage(tmp_path)).pointers.last == STEP2
    fileformat.verify(tmp_path / STEP2)


# --- a real full filesystem -----------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted at ``tmp_path / "fs"``; skipped where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60, check=True)


def _fill(mount: Path) -> Path:
    """Fill the filesystem with one file; return it."""
    filler = mount / "filler"
    with open(filler, "wb", buffering=0) as file:
        page = bytes(4096)
        try:
            while True:
                file.write(page)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    return filler


def _free_pages(mount: Path) -> int:
    stats = os.statvfs(mount)
    return stats.f_bavail * stats.f_frsize // 4096


def test_a_real_full_filesystem(small_tmpfs: Path) -> None:
    directory = small_tmpfs / "checkpoints"
    model = torch.nn.Linear(40, 40)  # ~6.5 KiB of tensors: a checkpoint takes a few pages
    with pitstop.Checkpointer(directory, model=model, policy=Policy(keep_last=1)) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        filler = _fill(small_tmpfs)
        size = filler.stat().st_size
        failed_at: list[str] = []
        for pages in range(16):
            os.truncate(filler, max(0, size - pages * 4096))
            free = _free_pages(small_tmpfs)
            before = snapshot(directory)
            with torch.no_grad():
                model.weight.add_(1.0)
            try:
                ckpt.save(pitstop.Progress(step=2))
            except SaveError as error:
                message = str(error)
                assert "step 2" in message
                assert STEP2 in message
                assert "No space left" in message
                failed_at.append("latest.json" if "latest.json" in message else "checkpoint")
                assert snapshot(directory) == before, f"{free} free pages: the directory changed"
                _no_temp_files(directory)
                assert scan(LocalStorage(directory)).pointers.last == STEP1
                fileformat.verify(directory / STEP1)
                continue
            break
        else:
            raise AssertionError("the save never fit")
        assert "checkpoint" in failed_at
        assert "latest.json" in failed_at  # the disk filled exactly at latest.json once
        filler.unlink()
        ckpt.save(pitstop.Progress(step=3))
    found = scan(LocalStorage(directory))
    assert found.pointers.last == "step_000000000003.pitstop"
    fileformat.verify(directory / "step_000000000003.pitstop")


def test_a_real_full_filesystem_under_a_sharded_save(small_tmpfs: Path) -> None:
    """A sharded save (FSDP2, DCP) into a real full tmpfs: the SaveError says the disk is full
    and names the file (torch.save's own error, "unexpected pos ...", hides it)."""
    sharded = pytest.importorskip("onerank")
    if sharded.SHARDED_MISSING:
        pytest.skip(sharded.SHARDED_REASON)
    from pitstop.shell.ranks.distributed import Ranks
    from pitstop.shell.sharded.engine import write_sharded

    with sharded.one_rank_group():
        model, optimizer = sharded.sharded_model()
        filler = _fill(small_tmpfs)
        os.truncate(filler, max(0, filler.stat().st_size - 4 * 4096))  # a few pages: not enough
        with pytest.raises(SaveError) as caught:
            write_sharded(small_tmpfs / "temp", model, {"o": optimizer}, ranks=Ranks(0, 1))
    message = str(caught.value)
    assert "no space left on the device (ENOSPC) writing " in message, message
    assert str(small_tmpfs / "temp" / "__0_0.distcp") in message, message
