"""A sharded checkpoint directory through CheckpointDirectory, in one process (no DCP needed).

The shards are stand-in files written into the temp directory the directory names; the
layout lists them with their checksums, as write_sharded's would. Checked: the publish makes
a listed, verifiable directory and moves the pointers only then; retention deletes old
directories (never a pointer target); a pointer phase that fails leaves the directory as it
was (the new directory gone); a save over a directory of the same step replaces it whole;
the next writer removes a dead writer's temp directory. A replacement failing at any of its
steps (an injected OSError or Ctrl-C) leaves the old checkpoint or the new one under its name,
and what a writer that died mid-replacement left aside is put back, never deleted whole; a
temp directory a failed save could not remove never blocks the next save of its step.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pitstop.core.metadata import entry_meta
from pitstop.core.naming import aside_name
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, Policy, Progress
from pitstop.core.saving.plan import SavePlan, plan_save
from pitstop.core.saving.schedule import Call, ScheduleState, decide_save
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardedLayout, sharded_name
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, scan, verify_any
from pitstop.shell.store.sharddir import file_table, write_manifest
from pitstop.shell.store.storage import LocalStorage
from storagetrace import StuckLeftovers


def stage_sharded(
    directory: CheckpointDirectory, step: int, content: bytes = b""
) -> tuple[SavePlan, CheckpointEntry, ShardedLayout, str]:
    """Plan a sharded save of ``step`` and write its stand-in shards into a temp directory of
    its own; the plan, its entry, the layout and the temp directory's name."""
    progress = Progress(step=step)
    decision = decide_save(
        directory.policy,
        ScheduleState(timer_start=0.0),
        directory.pointers,
        call=Call.MANUAL,
        progress=progress,
        now=0.0,
    )
    plan = plan_save(
        directory.catalog,
        directory.pointers,
        decision,
        progress=progress,
        policy=directory.policy,
        sharded=True,
    )
    entry = plan.entry
    assert entry is not NO_CHECKPOINT
    name = directory.sharded_temp(entry)
    temp = directory.path / name
    temp.mkdir()
    (temp / "__0_0.distcp").write_bytes(content or f"shards of step {step}".encode())
    layout = ShardedLayout(
        world_size=1,
        dcp_version="test",
        files=file_table(temp, ["__0_0.distcp"], 0),
        values=(),
    )
    return plan, entry, layout, name


def save_sharded(directory: CheckpointDirectory, step: int, content: bytes = b"") -> SavePlan:
    plan, entry, layout, temp = stage_sharded(directory, step, content)
    directory.publish_sharded(plan, entry, layout, {"step": torch.tensor(step)}, {}, temp=temp)
    return plan


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[CheckpointDirectory]:
    opened = CheckpointDirectory(tmp_path / "checkpoints", policy=Policy(keep_last=2))
    opened.path.mkdir()
    opened.open()
    yield opened
    opened.close()


def test_a_published_directory_is_listed_verified_and_pointed_to(
    directory: CheckpointDirectory,
) -> None:
    save_sharded(directory, 2)
    name = sharded_name(2)
    (entry,) = scan(directory.storage).catalog
    assert (entry.name, entry.sharded) == (name, True)
    assert os.readlink(directory.path / "last") == name
    assert not [p for p in directory.path.iterdir() if p.name.startswith(".tmp-")]
    verify_any(directory.path / name)
    assert fileformat.load(directory.path / name / MANIFEST_NAME)["step"].item() == 2
    (directory.path / name / "__0_0.distcp").write_bytes(b"shards of step 3")
    with pytest.raises(CheckpointCorrupt, match=r"__0_0\.distcp fails its checksum"):
        verify_any(directory.path / name)


def test_retention_deletes_old_directories_and_keeps_the_pointer_targets(
    directory: CheckpointDirectory,
) -> None:
    for step in (2, 4, 6):
        save_sharded(directory, step)
    assert [e.name for e in scan(directory.storage).catalog] == [sharded_name(4), sharded_name(6)]
    assert not (directory.path / sharded_name(2)).exists()
    assert os.readlink(directory.path / "last") == sharded_name(6)


class NoPointers(LocalStorage):
    """Symlinks fail with EIO (a real failure, not a filesystem without symlinks)."""

    def symlink(self, target: str, name: str) -> None:
        raise OSError(errno.EIO, "injected", name)


def test_a_failed_pointer_phase_removes_the_new_directory(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints"
    path.mkdir()
    with CheckpointDirectory(path) as first:
        save_sharded(first, 2)
    broken = CheckpointDirectory(path, storage=NoPointers(path))
    with broken, pytest.raises(SaveError, match="could not save step 4"):
        save_sharded(broken, 4)
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == [
        "last",
        "latest.json",
        sharded_name(2),
    ]
    assert [e.name for e in scan(LocalStorage(path)).catalog] == [sharded_name(2)]


def test_a_save_over_a_directory_of_the_same_step_replaces_it_whole(
    directory: CheckpointDirectory,
) -> None:
    save_sharded(directory, 4, b"first timeline")
    save_sharded(directory, 2)
    plan = save_sharded(directory, 4, b"second timeline")
    assert plan.replaces
    assert (directory.path / sharded_name(4) / "__0_0.distcp").read_bytes() == b"second timeline"
    verify_any(directory.path / sharded_name(4))
    assert sorted(p.name for p in directory.path.iterdir() if p.name.startswith(".tmp-")) == []


def test_the_next_writer_removes_a_dead_writers_temp_directory(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints"
    dead = path / f".tmp-deadbeef-{sharded_name(2)}"
    dead.mkdir(parents=True)
    (dead / "__0_0.distcp").write_bytes(b"half")
    lone = path / sharded_name(4)  # a checkpoint's name, no manifest: never listed
    lone.mkdir()
    with CheckpointDirectory(path) as opened:
        assert list(opened.catalog) == []
    assert not dead.exists()
    assert sharded_name(4) in scan(LocalStorage(path)).unreadable


# --- a replacement (the same step saved again) under injected faults ---------------------------

OS_OPS = ("replace", "fsync", "unlink", "rmdir", "symlink")


class OsFaults:
    """Counts each ``os.replace`` / ``fsync`` / ``unlink`` / ``rmdir`` / ``symlink`` once
    ``armed``, and makes the ``fail_at``-th raise ``error`` (once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int, error: BaseException) -> None:
        self.calls: list[str] = []
        self.fail_at, self.error, self.armed = fail_at, error, False
        for op in OS_OPS:
            monkeypatch.setattr(os, op, self._wrap(op, getattr(os, op)))

    def _wrap(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **options: Any) -> Any:
            if self.armed:
                self.calls.append(op)
                if len(self.calls) == self.fail_at:
                    raise self.error
            return real(*args, **options)

        return call


def _replace_under_fault(
    path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int, error: BaseException
) -> tuple[OsFaults, CheckpointDirectory, BaseException | None]:
    """Steps 4 and 2 saved; step 4 saved again, its publish failing at ``fail_at``."""
    path.mkdir()
    directory = CheckpointDirectory(path, policy=Policy(keep_last=3))
    directory.open()
    save_sharded(directory, 4, b"first timeline")
    save_sharded(directory, 2)
    faults = OsFaults(monkeypatch, fail_at, error)
    plan, entry, layout, temp = stage_sharded(directory, 4, b"second timeline")
    faults.armed = True
    raised = None
    try:
        directory.publish_sharded(plan, entry, layout, {"step": torch.tensor(4)}, {}, temp=temp)
    except (SaveError, KeyboardInterrupt) as exc:
        raised = exc
    finally:
        faults.armed = False
    return faults, directory, raised


def _publish_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    with monkeypatch.context() as patch:
        faults, directory, raised = _replace_under_fault(
            tmp_path / "count", patch, 0, AssertionError()
        )
        directory.close()
    assert raised is None
    assert {"replace", "fsync", "unlink", "symlink"} <= set(faults.calls)
    return len(faults.calls)


def _held(path: Path) -> bytes:
    """The shards under step 4's real name: complete, every byte verified."""
    verify_any(path / sharded_name(4))
    return (path / sharded_name(4) / "__0_0.distcp").read_bytes()


@pytest.mark.parametrize(
    "error", [OSError(errno.EIO, "injected fault"), KeyboardInterrupt()], ids=["EIO", "Ctrl-C"]
)
def test_a_replacement_failing_at_any_step_keeps_the_old_checkpoint_or_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """Before, the old directory was moved to a temp name first: a failure after that (the
    rename of the new one, the parent's fsync, an interrupt) left it there, with nothing under
    its name, and the next open deleted it as a dead writer's leftover."""
    total = _publish_ops(tmp_path, monkeypatch)
    assert total >= 12  # manifest, move aside, rename, fsync, old removed, pointers
    held = set()
    for fail_at in range(1, total + 1):
        path = tmp_path / f"run{fail_at}"
        with monkeypatch.context() as patch:
            faults, directory, raised = _replace_under_fault(path, patch, fail_at, error)
        where = f"fault at {faults.calls[fail_at - 1]} (op {fail_at})"
        try:
            content = _held(path)
            held.add(content)
            assert content in {b"first timeline", b"second timeline"}, where
            if isinstance(raised, SaveError):
                assert str(path / sharded_name(4)) in str(raised), where
            # The writer's catalog is what is on disk; every pointer names a checkpoint there.
            found = scan(LocalStorage(path))
            assert found.catalog == directory.catalog, where
            assert found.pointers.targets() <= {e.name for e in found.catalog}, where
            assert os.readlink(path / "last") == directory.pointers.last, where
            assert found.catalog.get(sharded_name(4)) != NO_CHECKPOINT, where
        finally:
            directory.close()
        # No later open deletes it, nor leaves a temp name.
        with CheckpointDirectory(path) as reopened:
            assert _held(path) == content, where
            assert sharded_name(4) in reopened.catalog, where
        assert not [p for p in path.iterdir() if p.name.startswith(".tmp-")], where
    assert held == {b"first timeline", b"second timeline"}  # both outcomes were reached


class _FailsOnce:
    """``os.replace`` (or ``os.fsync``) raising ``error`` once, at the call ``matches``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, op: str, error: BaseException) -> None:
        self.matches: Callable[..., bool] = lambda *args: False
        real = getattr(os, op)

        def call(*args: Any, **options: Any) -> Any:
            if self.matches(*args):
                self.matches = lambda *args: False
                raise error
            return real(*args, **options)

        monkeypatch.setattr(os, op, call)


def test_a_replacement_whose_new_directory_cannot_be_renamed_puts_the_old_one_back(
    directory: CheckpointDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_sharded(directory, 4, b"first timeline")
    before = scan(directory.storage)
    fails = _FailsOnce(monkeypatch, "replace", OSError(errno.EIO, "injected fault"))
    name = directory.path / sharded_name(4)
    fails.matches = lambda source, target: Path(target) == name and ".old-" not in str(source)
    with pytest.raises(SaveError) as raised:
        save_sharded(directory, 4, b"second timeline")
    assert _held(directory.path) == b"first timeline"
    message = str(raised.value)
    assert f"could not rename the new {name} into place: [Errno 5] injected fault" in message
    assert f"{name} holds the old checkpoint again, as before" in message
    assert scan(directory.storage).catalog == before.catalog == directory.catalog
    assert not [p for p in directory.path.iterdir() if p.name.startswith(".tmp-")]


def test_a_replacement_whose_parent_fsync_fails_keeps_the_new_one_and_the_catalog_knows(
    directory: CheckpointDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_sharded(directory, 4, b"first timeline")
    old = directory.catalog.get(sharded_name(4))
    renamed = []
    spied = os.replace

    def replace(source: Any, target: Any, **options: Any) -> None:
        spied(source, target, **options)
        renamed.append(Path(target).name)

    monkeypatch.setattr(os, "replace", replace)
    fails = _FailsOnce(monkeypatch, "fsync", OSError(errno.EIO, "injected fault"))
    parent = os.stat(directory.path).st_ino
    fails.matches = lambda fd: renamed[-1:] == [sharded_name(4)] and os.fstat(fd).st_ino == parent
    with pytest.raises(SaveError) as raised:
        save_sharded(directory, 4, b"second timeline")
    assert _held(directory.path) == b"second timeline"
    found = scan(directory.storage)
    assert found.catalog == directory.catalog
    name = directory.path / sharded_name(4)
    assert f"could not fsync the directory of {name}: " in str(raised.value)
    assert f"{name} holds the new checkpoint, complete" in str(raised.value)
    assert found.catalog.get(sharded_name(4)).seq == old.seq + 1  # type: ignore[union-attr]
    assert not [p for p in directory.path.iterdir() if p.name.startswith(".tmp-")]


def _left_by_a_dead_writer(path: Path, new_in_place: bool) -> Path:
    """Step 4 published (the first timeline), then what a writer killed while replacing it
    leaves: the old one moved aside, and the new one under its temp name or in place."""
    path.mkdir()
    with CheckpointDirectory(path) as first:
        save_sharded(first, 4, b"first timeline")
        _, entry, layout, name = stage_sharded(first, 4, b"second timeline")
        temp = path / name
        write_manifest(temp, layout, entry_meta(entry))
    aside = path / aside_name(sharded_name(4), "deadbeef")
    (path / sharded_name(4)).rename(aside)
    if new_in_place:
        temp.rename(path / sharded_name(4))
    return aside


@pytest.mark.parametrize("new_in_place", [False, True], ids=["new-in-temp", "new-in-place"])
def test_what_a_writer_that_died_mid_replacement_left_is_settled_and_never_deleted_whole(
    tmp_path: Path, new_in_place: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the next open deleted the old directory moved aside as a dead writer's temp
    directory, though nothing was under its name: the checkpoint was lost."""
    path = tmp_path / "checkpoints"
    aside = _left_by_a_dead_writer(path, new_in_place)
    with CheckpointDirectory(path) as reopened:
        assert [e.name for e in reopened.catalog] == [sharded_name(4)]
    assert _held(path) == (b"second timeline" if new_in_place else b"first timeline")
    assert not [p for p in path.iterdir() if p.name.startswith(".tmp-")]
    said = "removing" if new_in_place else "putting"
    assert any(r.getMessage().startswith(f"{said} {aside}") for r in caplog.records)


def test_a_checkpoint_left_aside_whose_name_holds_no_checkpoint_is_left_alone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoints"
    aside = _left_by_a_dead_writer(path, new_in_place=True)
    (path / sharded_name(4) / MANIFEST_NAME).unlink()  # no checkpoint now
    with CheckpointDirectory(path) as reopened:
        assert list(reopened.catalog) == []
    verify_any(aside)  # still whole, for a person to put back
    (aside / MANIFEST_NAME).unlink()  # now half removed: it goes
    with CheckpointDirectory(path):
        pass
    assert not aside.exists()


@pytest.mark.parametrize("leftover", ["temp directory", "old one aside"])
def test_a_directory_a_failed_sharded_save_could_not_remove_never_blocks_the_next_save(
    directory: CheckpointDirectory, monkeypatch: pytest.MonkeyPatch, leftover: str
) -> None:
    """Before, the temp directory (and the aside one) carried only the run id: once a failed
    save could not remove it, every later save of that step in the run failed (its temp
    directory existed already, or the old one could not be moved aside onto it)."""
    save_sharded(directory, 4, b"first timeline")
    save_sharded(directory, 2)
    with monkeypatch.context() as patch:
        if leftover == "temp directory":  # the manifest cannot be published
            StuckLeftovers(patch, MANIFEST_NAME)
            with pytest.raises(SaveError, match="injected fault"):
                save_sharded(directory, 4, b"second timeline")
        else:  # published; only the old one moved aside cannot be removed
            StuckLeftovers(patch)
            save_sharded(directory, 4, b"second timeline")
    left = [p.name for p in directory.path.iterdir() if p.name.startswith(".tmp-")]
    assert len(left) == 1, left
    assert (".old-" in left[0]) == (leftover == "old one aside")
    save_sharded(directory, 4, b"third timeline")
    assert _held(directory.path) == b"third timeline"
    assert scan(directory.storage).catalog == directory.catalog
    directory.close()
    with CheckpointDirectory(directory.path) as reopened:  # removes what was left
        assert sharded_name(4) in reopened.catalog
    assert not [p for p in directory.path.iterdir() if p.name.startswith(".tmp-")]
    assert _held(directory.path) == b"third timeline"
