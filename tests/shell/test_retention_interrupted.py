"""A Ctrl-C in a save's retention, or just after it, leaves the save published.

Retention deletes old checkpoints after the new one and its pointers are durable; a Ctrl-C
there is raised from the save call (as ``KeyboardInterrupt``), but the save is done, and the
run must know it: the schedule counts the step as saved (so ``finish()`` at that step moves
``final`` to the same checkpoint instead of writing it again), and a background sharded save
is not published a second time by the next call. Checked in one process: a file save, a
sharded (FSDP2) save, and a background sharded save published by ``wait()``; each with the
Ctrl-C in the retention, and just after the directory carried the save out (on the way back
from the publish, before the caller heard of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.core.naming import checkpoint_name
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.shell.store import publish
from pitstop.shell.store.directory import CheckpointDirectory

AFTER = "after the publish"


@pytest.fixture(params=["retention", AFTER])
def interrupt_retention(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """Once armed (append anything to the list it yields), the next save's retention raises
    KeyboardInterrupt before deleting, and the names it was asked to delete are kept; or
    (``AFTER``) the next publish raises it just after the directory carried the save out,
    pointers and retention included, and the list holds the name retention deleted."""
    armed: list[str] = []
    if request.param == AFTER:
        execute = CheckpointDirectory.execute

        def carried_out(directory: CheckpointDirectory, plan: Any, write: Any) -> list[str]:
            deleted = execute(directory, plan, write)
            if armed and armed[0] == "armed":
                armed[:] = deleted
                raise KeyboardInterrupt
            return deleted

        monkeypatch.setattr(CheckpointDirectory, "execute", carried_out)
        return armed
    original = publish.remove_checkpoint

    def remove(storage: Any, name: str) -> None:
        if armed and armed[0] == "armed":
            armed[0] = name
            raise KeyboardInterrupt
        original(storage, name)

    monkeypatch.setattr(publish, "remove_checkpoint", remove)
    return armed


def test_a_file_save_interrupted_in_its_retention_counts_as_saved(
    tmp_path: Path, interrupt_retention: list[str]
) -> None:
    model = nn.Linear(4, 4)
    policy = pitstop.Policy(keep_last=1)
    with pitstop.Checkpointer(tmp_path, model=model, policy=policy) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        interrupt_retention.append("armed")
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(pitstop.Progress(step=2))
        assert interrupt_retention == [checkpoint_name(1)]  # cut short there
        saved = tmp_path / checkpoint_name(2)
        inode = saved.stat().st_ino
        done = ckpt.finish(pitstop.Progress(step=2))
        assert done is not None
        assert done.path == saved
        assert saved.stat().st_ino == inode, "finish() wrote step 2 again"
        assert (tmp_path / "final").resolve() == saved
        assert [c.step for c in ckpt.checkpoints()] == [2]  # the next retention finished it


def _sharded_save_then_finish(root: Path, armed: list[str], *, async_save: bool) -> None:
    model, optimizer = sharded_model()
    policy = pitstop.Policy(keep_last=1)
    state = {"optimizer": optimizer}
    with pitstop.Checkpointer(
        root, model=model, state=state, policy=policy, async_save=async_save
    ) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        ckpt.wait()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        armed.append("armed")
        if async_save:  # published, and its retention run, by wait()
            ckpt.save(pitstop.Progress(step=2))
            with pytest.raises(KeyboardInterrupt):
                ckpt.wait()
        else:
            with pytest.raises(KeyboardInterrupt):
                ckpt.save(pitstop.Progress(step=2))
        assert armed == [sharded_name(1)]
        manifest = root / sharded_name(2) / MANIFEST_NAME
        inode = manifest.stat().st_ino
        ckpt.wait()  # nothing in flight: no second publish, no error
        done = ckpt.finish(pitstop.Progress(step=2))
        assert done is not None
        assert done.path == root / sharded_name(2)
        assert manifest.stat().st_ino == inode, "finish() wrote step 2 again"
        assert [c.step for c in ckpt.checkpoints()] == [2]


@NEEDS_GLOO
@NEEDS_SHARDED
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "background"])
def test_a_sharded_save_interrupted_in_its_retention_counts_as_saved(
    group: Any, tmp_path: Path, interrupt_retention: list[str], async_save: bool
) -> None:
    _sharded_save_then_finish(tmp_path / "run", interrupt_retention, async_save=async_save)
