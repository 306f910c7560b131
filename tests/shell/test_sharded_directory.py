"""A sharded checkpoint directory through CheckpointDirectory, in one process (no DCP needed).

The shards are stand-in files written into the temp directory the directory names; the
layout lists them with their checksums, as write_sharded's would. Checked: the publish makes
a listed, verifiable directory and moves the pointers only then; retention deletes old
directories (never a pointer target); a pointer phase that fails leaves the directory as it
was (the new directory gone); a save over a directory of the same step replaces it whole;
the next writer removes a dead writer's temp directory.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pitstop.core.plan import SavePlan, plan_save
from pitstop.core.records import NO_CHECKPOINT, Policy, Progress
from pitstop.core.schedule import Call, ScheduleState, decide_save
from pitstop.core.sharded import MANIFEST_NAME, ShardedLayout, sharded_name
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell import fileformat
from pitstop.shell.directory import CheckpointDirectory, scan, verify_any
from pitstop.shell.sharddir import file_table
from pitstop.shell.storage import LocalStorage


def save_sharded(directory: CheckpointDirectory, step: int, content: bytes = b"") -> SavePlan:
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
    temp = directory.path / directory.sharded_temp(entry)
    temp.mkdir()
    (temp / "__0_0.distcp").write_bytes(content or f"shards of step {step}".encode())
    layout = ShardedLayout(
        world_size=1,
        dcp_version="test",
        files=file_table(temp, ["__0_0.distcp"], 0),
        values=(),
    )
    directory.publish_sharded(plan, entry, layout, {"step": torch.tensor(step)}, {})
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
