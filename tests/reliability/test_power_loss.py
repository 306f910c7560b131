"""Suite 2 — simulated power loss (SQLite's crash-test VFS, ALICE/CrashMonkey).

Real saves run through ``CrashStorage`` (tests/reliability/crashsim.py), which logs every write,
fsync and directory operation. A crash state keeps what was durable and drops, keeps, tears
(512 B) or garbles each pending operation; it is written into a real directory and checked with
the real readers: every checkpoint-named file reads and verifies (nothing was published before
it was durable), every pointer on disk names a file that exists (no pointer moved before its
target was durable), every pointer the scan reports names one of them, resume returns a step at
least as new as the newest save that returned, with that step's own tensors, and the directory
takes the next save. Random states (500 by default, 5000 under ``-m slow``) and every reordering
within each fsync epoch of a small save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from dirtools import save, state_at
from pitstop.core.naming import LATEST_JSON, TEMP_PREFIX
from pitstop.core.records import NO_CHECKPOINT, Best, PointerName, Policy
from pitstop.core.saving.schedule import Call
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, choose_resume, scan
from pitstop.shell.store.storage import LocalStorage
from reliability.crashsim import CrashStorage, Event, crash_state, epochs, materialize, reorderings

POLICY = Policy(keep_last=2, best=Best("loss"))
LOSSES = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: 0.8}


def _run(root: Path, steps: list[int]) -> tuple[list[Event], list[tuple[int, int]]]:
    """Save ``steps`` through a CrashStorage; return its events and (event count, step) after
    each save returned."""
    storage = CrashStorage(root)
    committed = []
    with CheckpointDirectory(root, policy=POLICY, storage=storage) as directory:
        for step in steps:
            plan = save(directory, step, call=Call.MANUAL, metrics={"loss": LOSSES[step]})
            assert plan.entry is not NO_CHECKPOINT
            committed.append((len(storage.events), step))
    return storage.events, committed


def _same_tree(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_tree, a, b))
    return bool(a == b)


def _pointed_at(path: Path, name: str) -> list[str]:
    """The checkpoint names the pointer entry ``name`` holds on disk (a symlink's target, or
    latest.json's pointers when it parses)."""
    entry = path / name
    if entry.is_symlink():
        return [os.readlink(entry)]
    if name != LATEST_JSON or not entry.is_file():
        return []
    try:
        pointers = json.loads(entry.read_bytes())["pointers"]
    except (ValueError, KeyError, TypeError):
        return []  # a torn latest.json: ignored by every reader (tested there)
    return [t for t in pointers.values() if isinstance(t, str)]


def check_after_crash(path: Path, newest_committed: int | None, *, next_save: bool) -> int | None:
    """Every guarantee a crash must leave; returns the step resume restores (None: fresh)."""
    storage = LocalStorage(path)
    found = scan(storage, POLICY.best)
    assert not found.unreadable, f"a checkpoint was published before it was durable: {found}"
    for entry in found.catalog:
        fileformat.verify(storage.path(entry.name))
    for pointer in PointerName:
        target = found.pointers.target(pointer)
        assert target is NO_CHECKPOINT or target in found.catalog
    for name in (*(p.value for p in PointerName), LATEST_JSON):  # as on disk, unreconciled
        for target in _pointed_at(path, name):
            assert (path / target).is_file(), f"{name} moved to {target} before it was durable"
    choice = choose_resume(storage, found, PointerName.LAST, POLICY.best)
    assert not choice.skipped
    if choice.entry is NO_CHECKPOINT:
        assert newest_committed is None, f"step {newest_committed} returned, then was lost"
        restored = None
    else:
        restored = choice.entry.step
        assert newest_committed is None or restored >= newest_committed
        assert choice.path is not None
        assert _same_tree(fileformat.load(choice.path), state_at(restored))
    if next_save:  # the directory takes the next save, and dead writers' temp files go
        with CheckpointDirectory(path, policy=POLICY) as directory:
            assert not [n for n in storage.names() if n.startswith(TEMP_PREFIX)]
            save(directory, 9, call=Call.MAYBE, metrics={"loss": 0.0})
        after = choose_resume(storage, scan(storage, POLICY.best), PointerName.LAST)
        assert after.entry is not NO_CHECKPOINT
        assert after.entry.step == 9
    return restored


def _newest_committed(committed: list[tuple[int, int]], k: int) -> int | None:
    done = [step for end, step in committed if end <= k]
    return max(done) if done else None


@pytest.mark.parametrize(
    "states",
    [pytest.param(500, id="500"), pytest.param(5000, id="5000", marks=pytest.mark.slow)],
)
def test_random_crash_states(tmp_path: Path, states: int) -> None:
    events, committed = _run(tmp_path / "live", [1, 2, 3, 4, 5])
    rng = random.Random(11)
    restored_steps: set[int | None] = set()
    for case in range(states):
        k = rng.randint(0, len(events))
        state = crash_state(events, k, rng)
        where = materialize(state, tmp_path / f"crash{case}")
        try:
            restored_steps.add(
                check_after_crash(where, _newest_committed(committed, k), next_save=case % 10 == 0)
            )
        except AssertionError as error:
            raise AssertionError(f"crash state {case} (before event {k}): {error}") from error
        shutil.rmtree(where)
    assert {None, 1, 2, 3, 4, 5} <= restored_steps  # crashes landed across the whole run


def test_every_reordering_within_each_fsync_epoch_of_a_small_save(tmp_path: Path) -> None:
    events, committed = _run(tmp_path / "live", [1, 2])
    spans = epochs(events)
    assert len(spans) >= 5  # data, rename, pointers, latest.json, deletion
    count = 0
    for k0, k1 in spans:
        for state in reorderings(events, k0, k1):
            where = materialize(state, tmp_path / f"order{count}")
            try:
                check_after_crash(where, _newest_committed(committed, k0), next_save=False)
            except AssertionError as error:
                raise AssertionError(
                    f"epoch [{k0}, {k1}), state {state.keys()}: {error}"
                ) from error
            shutil.rmtree(where)
            count += 1
    assert count >= 50
