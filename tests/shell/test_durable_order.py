"""The durable-publish order, as the storage sees it: fsync, rename, fsync the directory.

A whole save goes through ``CheckpointDirectory.execute`` on a recording Storage: it publishes
a checkpoint file, moves ``last`` and ``best`` (symlinks) and ``latest.json``, and deletes the
old checkpoint by retention. The trace must be exactly the publish sequence, and the checker
must notice any one fsync that is missing or comes after its rename. (The same sequence for a
single file, through ``write_atomically``, is tested in test_atomic.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dirtools import save
from pitstop.core.records import Best, Policy
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import LocalStorage
from storagetrace import (
    Op,
    RecordingStorage,
    durability_problems,
    final_name,
    phases,
)

STEP_1 = "step_000000000001.pitstop"
STEP_2 = "step_000000000002.pitstop"

# The publish sequence of one save (docs/guarantees.md), step by step.
EXPECTED = [
    # The checkpoint file: temp, data, fsync, close, rename, directory fsync.
    ("create", STEP_2),
    ("write", STEP_2),
    ("sync_file", STEP_2),
    ("close", STEP_2),
    ("replace", STEP_2),
    ("sync_directory", ""),
    # Only then the pointers: each symlink under a temp name, renamed over the old one...
    ("symlink", "last"),
    ("replace", "last"),
    ("symlink", "best"),
    ("replace", "best"),
    # ... and latest.json, published like a checkpoint; its directory fsync covers the links.
    ("create", "latest.json"),
    ("write", "latest.json"),
    ("sync_file", "latest.json"),
    ("close", "latest.json"),
    ("replace", "latest.json"),
    ("sync_directory", ""),
    # Deletions last, once everything above is durable.
    ("remove", STEP_1),
    ("sync_directory", ""),
]

# Each fsync the guarantees need, as the recording storage names it: the file's own fsync
# (by its temp name's final name) and the directory fsync after a rename (by the entry).
SYNCS = {
    "checkpoint file": ("sync_file", STEP_2),
    "directory after the checkpoint's rename": ("sync_directory", STEP_2),
    "latest.json file": ("sync_file", "latest.json"),
    "directory after the pointers' renames": ("sync_directory", "latest.json"),
}


def _second_save(tmp_path: Path, storage: RecordingStorage) -> list[Op]:
    """Save steps 1 and 2 (step 2 better, keep_last=1); return the trace of the second."""
    directory = CheckpointDirectory(
        tmp_path, policy=Policy(keep_last=1, best=Best("loss")), storage=storage
    )
    with directory:
        save(directory, 1, metrics={"loss": 1.0})
        storage.ops.clear()
        save(directory, 2, metrics={"loss": 0.5})
        return list(storage.ops)


def test_a_save_follows_the_publish_sequence_exactly(tmp_path: Path) -> None:
    ops = _second_save(tmp_path, RecordingStorage(LocalStorage(tmp_path)))
    assert durability_problems(ops) == []
    assert phases(ops) == EXPECTED
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "last",
        "latest.json",
        STEP_2,
    ]


@pytest.mark.parametrize("sync", list(SYNCS), ids=list(SYNCS))
def test_the_checker_notices_each_missing_fsync_of_a_real_save(tmp_path: Path, sync: str) -> None:
    kind, name = SYNCS[sync]
    dropped: list[Op] = []

    def drop(op: Op) -> bool:
        if op.kind == kind and final_name(op.name) == name:
            dropped.append(op)
            return True
        return False

    storage = RecordingStorage(LocalStorage(tmp_path), drop=drop)
    directory = CheckpointDirectory(
        tmp_path, policy=Policy(keep_last=1, best=Best("loss")), storage=storage
    )
    with directory:
        save(directory, 1, metrics={"loss": 1.0})
        dropped.clear()
        storage.ops.clear()
        save(directory, 2, metrics={"loss": 0.5})
    assert len(dropped) == 1, f"the save should fsync {sync} exactly once: {dropped}"
    assert durability_problems(storage.ops) != []


def _clean_trace(tmp_path: Path) -> list[Op]:
    ops = _second_save(tmp_path, RecordingStorage(LocalStorage(tmp_path)))
    assert durability_problems(ops) == []
    return ops


def _guarded_syncs(ops: list[Op]) -> list[int]:
    """Indices of the syncs the guarantees need: all of them before the first deletion."""
    first_delete = next(i for i, op in enumerate(ops) if op == Op("remove", STEP_1))
    return [i for i, op in enumerate(ops[:first_delete]) if op.kind.startswith("sync_")]


def test_the_checker_notices_any_sync_removed_from_the_trace(tmp_path: Path) -> None:
    ops = _clean_trace(tmp_path)
    indices = _guarded_syncs(ops)
    assert len(indices) == 4  # the four fsyncs of SYNCS
    for index in indices:
        broken = ops[:index] + ops[index + 1 :]
        assert durability_problems(broken) != [], f"without {ops[index]}"


def test_the_checker_notices_any_sync_moved_after_its_rename(tmp_path: Path) -> None:
    ops = _clean_trace(tmp_path)
    for index in _guarded_syncs(ops):
        rename = next(i for i in range(index + 1, len(ops)) if ops[i].kind in {"replace", "remove"})
        broken = [*ops[:index], *ops[index + 1 : rename + 1], ops[index], *ops[rename + 1 :]]
        assert durability_problems(broken) != [], f"{ops[index]} moved after {ops[rename]}"


@pytest.mark.parametrize(
    ("trace", "problem"),
    [
        (
            [Op("create", "t"), Op("write", "t"), Op("close", "t"), Op("replace", "t", "f")],
            "f renamed into place before its data was fsynced",
        ),
        (
            [Op("create", "t"), Op("write", "t"), Op("sync_file", "t"), Op("replace", "t", "f")],
            "f renamed into place while still open",
        ),
        (
            [Op("create", "t"), Op("sync_file", "t"), Op("close", "t"), Op("replace", "t", "f")],
            "the rename of f was never made durable",
        ),
        (
            [Op("replace", "a", STEP_2), Op("symlink", "b", STEP_2), Op("replace", "b", "last")],
            f"pointer last moved before the rename of {STEP_2} was durable",
        ),
        (
            [Op("replace", "b", "last"), Op("remove", STEP_1), Op("sync_directory")],
            f"{STEP_1} deleted before the rename of last was durable",
        ),
        (
            [Op("remove", STEP_1), Op("replace", "b", "last"), Op("sync_directory")],
            f"pointer last moved after {STEP_1} was deleted",
        ),
    ],
)
def test_the_checker_names_what_is_wrong(trace: list[Op], problem: str) -> None:
    assert problem in durability_problems(trace)
