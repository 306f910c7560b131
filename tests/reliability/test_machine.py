"""Suite 7 — a state machine over a real checkpoint directory on a fault-injecting,
power-losing storage: save (with or without a fault at any operation), crash (a power loss at
any point of the last action, tests/reliability/crashsim.py), corrupt (a byte of any
checkpoint), prune (retention by hand, as ``pitstop prune`` does it), resume.

The model is plain: which checkpoint files exist on disk, which of them were corrupted, the
save sequence number and contents each was written with, and the newest save that returned.
After every step, resume must return exactly the present, uncorrupted checkpoint with the
highest sequence number — with its own contents — and never one older than the newest save
that returned (unless that one was corrupted since, or a crash came before it returned).

It drives the real ``Checkpointer`` (``storage=`` the crash-logging, fault-injecting storage):
each save is ``Checkpointer.save``, each check is ``Checkpointer.resume()`` into a live model
whose weights hold the step they were saved at.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pitstop
from dirtools import snapshot
from pitstop.core.naming import NOT_A_CHECKPOINT, EntryKind, checkpoint_name, classify, parse_name
from pitstop.core.records import Best, PointerName, Pointers, Policy, Progress
from pitstop.core.saving.retention import plan_retention
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import choose_resume, scan
from pitstop.shell.store.publish import delete_checkpoints
from pitstop.shell.store.storage import LocalStorage
from reliability.crashsim import CrashStorage, crash_state, materialize

POLICY = Policy(keep_last=2, best=Best("loss"))


class Faults:
    """Raise ``code`` at the ``at``-th storage operation from now (once)."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.code = errno.EIO
        self.count = 0

    def arm(self, at: int, code: int) -> None:
        self.at, self.code, self.count = at, code, 0

    def __call__(self, op: str, name: str) -> None:
        self.count += 1
        if self.at is not None and self.count == self.at:
            self.at = None
            raise OSError(self.code, f"{os.strerror(self.code)} (injected at {op} {name})")


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="pitstop-machine-"))
        self.lives = 0
        self.step = 0
        self.written: dict[str, int] = {}  # checkpoint name -> step its save wrote (unique)
        self.corrupted: set[str] = set()
        self.floor: tuple[int, str] | None = None  # (seq, name) of the newest save that returned
        self.rng = random.Random(0)

    # --- plumbing ---------------------------------------------------------------------------

    def _open(self, path: Path) -> None:
        self.path = path
        self.faults = Faults()
        self.storage = CrashStorage(path, fail=self.faults)
        self.model = torch.nn.Linear(3, 2, bias=False)
        self.ckpt = pitstop.Checkpointer(
            path, model=self.model, policy=POLICY, storage=self.storage, overwrite=True
        )
        self.span = (0, 0)
        self.floor_before = self.floor

    def _reopen(self, path: Path) -> None:
        self.ckpt.close()
        self._open(path)

    def _seq(self, name: str) -> int:
        return fileformat.read_manifest(self.path / name).meta["seq"]  # type: ignore[return-value]

    def teardown(self) -> None:
        self.ckpt.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @initialize()
    def start(self) -> None:
        self._open(self.root / "live0")

    # --- rules ------------------------------------------------------------------------------

    @rule(
        advance=st.integers(1, 3),
        loss=st.floats(0.0, 1.0),
        fault=st.none() | st.tuples(st.integers(1, 30), st.sampled_from([5, 28, 30])),
    )
    def save(self, advance: int, loss: float, fault: tuple[int, int] | None) -> None:
        step = self.step + advance
        name = checkpoint_name(step)
        with torch.no_grad():
            self.model.weight.fill_(float(step))  # the state says which save wrote it
        if fault is not None:
            self.faults.arm(*fault)
        start = len(self.storage.events)
        self.floor_before = self.floor
        before = self._published()
        try:
            saved = self.ckpt.save(Progress(step=step), metrics={"loss": loss})
        except SaveError as error:
            message = str(error)
            assert fault is not None, f"a save failed with no fault: {message}"
            assert f"step {step}" in message
            assert name in message
            assert self._published() == before, "a failed save changed what was published"
        else:
            assert saved is not None
            assert saved.path.name == name
            self.floor = (saved.seq, name)
        finally:
            self.faults.at = None
            self.span = (start, len(self.storage.events))
        self.written[name] = step
        self.corrupted.discard(name)  # a file of that name was (or was not) replaced
        self.step = step

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        start, end = self.span
        events = self.storage.events
        k = data.draw(st.integers(max(0, start), len(events)), label="crash before event")
        seed = data.draw(st.integers(0, 2**32 - 1), label="fates")
        state = crash_state(
            events,
            k,
            random.Random(seed),
            baseline=(self.storage.base_names, self.storage.base_data),
        )
        self.lives += 1
        where = materialize(state, self.root / f"live{self.lives}")
        if k < end:  # the crash came before the last action returned
            self.floor = self.floor_before
        self._reopen(where)
        self._forget_rewritten()

    @precondition(lambda self: bool(self._present() - self.corrupted))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        # (a file corrupted once is left alone: a second flip of the same bit would heal it)
        name = data.draw(st.sampled_from(sorted(self._present() - self.corrupted)), label="file")
        path = self.path / name
        contents = bytearray(path.read_bytes())
        offset = data.draw(st.integers(0, len(contents) - 1), label="offset")
        contents[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        path.write_bytes(bytes(contents))
        self.corrupted.add(name)
        if self.floor is not None and self.floor[1] == name:
            self.floor = None  # the newest save is gone; anything older may be resumed
        self._reopen(self.path)  # what is on disk now is the durable baseline

    @rule(keep=st.integers(1, 2))
    def prune(self, keep: int) -> None:
        storage = LocalStorage(self.path)
        found = scan(storage, POLICY.best)
        before = choose_resume(storage, found, PointerName.LAST, POLICY.best)
        retention = plan_retention(found.catalog, found.pointers, Policy(keep_last=keep))
        delete = [n for n in retention.delete if n != getattr(before.entry, "name", None)]
        delete_checkpoints(self.storage, delete)
        if self.floor is not None and self.floor[1] in delete:
            self.floor = None
        self._reopen(self.path)

    # --- what must be true ------------------------------------------------------------------

    def _published(self) -> tuple[dict[str, tuple[str, str]], Pointers]:
        """Every checkpoint file (by digest) and temp file, and the pointers as reconciled.

        (A rollback republishes the pointers as the directory reconciled them when it was
        opened; pointers it found stale are repaired, not restored byte for byte.)
        """
        files = {
            name: digest
            for name, digest in snapshot(self.path).items()
            if classify(name) in {EntryKind.CHECKPOINT, EntryKind.TEMP}
        }
        return files, scan(LocalStorage(self.path), POLICY.best).pointers

    def _present(self) -> set[str]:
        return {n for n in os.listdir(self.path) if parse_name(n) is not NOT_A_CHECKPOINT}

    def _forget_rewritten(self) -> None:
        for name in list(self.corrupted):
            if not (self.path / name).exists():
                self.corrupted.discard(name)

    @invariant()
    def resume_returns_the_newest_uncorrupted_checkpoint(self) -> None:
        valid = {}
        for name in self._present() - self.corrupted:
            fileformat.verify(self.path / name)  # nothing half-written under a final name
            valid[name] = self._seq(name)
        with torch.no_grad():
            self.model.weight.fill_(-1.0)
        progress = self.ckpt.resume()
        if not valid:
            assert self.ckpt.resumed_from is None, f"resumed {self.ckpt.resumed_from}"
            assert progress == Progress()
            assert self.floor is None, f"the save of {self.floor} returned, then was lost"
            return
        newest = max(valid, key=lambda n: (valid[n], n))
        assert self.ckpt.resumed_from is not None
        chose = self.ckpt.resumed_from.name
        assert chose == newest, f"resume chose {chose}, not {newest}"
        if self.floor is not None:
            assert valid[newest] >= self.floor[0], f"{self.floor} returned, resume gives {newest}"
        step = self.written.get(newest)
        assert step is not None
        assert progress.step == step
        assert torch.equal(self.model.weight, torch.full((2, 3), float(step)))


TestDirectoryMachine = DirectoryMachine.TestCase
TestDirectoryMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


class TestDirectoryMachineThorough(DirectoryMachine.TestCase):  # type: ignore[name-defined,misc]
    pytestmark = pytest.mark.slow
    settings = settings(max_examples=400, stateful_step_count=30, deadline=None)
