"""A sharded resume compares the run with the chosen checkpoint in the round that agrees its
checks (pitstop.shell.sharded.choice): a fault there is raised as itself, before anything live
is touched, with the checkpoint's files closed. One process as a 1-rank gloo job."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.shell import resuming

pytestmark = [NEEDS_GLOO, NEEDS_SHARDED]


def _open_files(directory: Path) -> list[str]:
    """The files of ``directory`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_a_fault_comparing_the_chosen_checkpoint_is_raised_with_nothing_touched(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # the run moved on: a resume would put the saved values back
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a fault comparing the run")

    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        with monkeypatch.context() as patched:
            patched.setattr(resuming, "differences", broken)
            with pytest.raises(RuntimeError, match="a fault comparing the run"):
                again.resume()
        assert [f for f in _open_files(root) if f.endswith(".distcp")] == []  # closed
        after = model.state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items())
        assert again.resume().step == 2  # and the same checkpoint resumes once it compares


def test_rank_0_s_schedule_moves_on_without_a_round_only_once_the_copy_succeeded(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy (the last step that can fail) fails: the resume raises and the first save is
    still refused (the directory held checkpoints at open), rank 0's schedule unmoved though
    worked out in the apply's round. It succeeds: that schedule is kept, and the run saves
    on."""
    from pitstop.shell.sharded import rawread

    root = tmp_path / "checkpoints"
    model, optimizer = sharded_model()
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=2))
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        schedule = again._saver.schedule
        with monkeypatch.context() as patched:

            def broken(self: Any) -> None:
                self.close()
                raise OSError("the disk failed while copying")

            patched.setattr(rawread.Checked, "copy", broken)
            with pytest.raises(OSError, match="the disk failed while copying"):
                again.resume()
        assert again._saver.schedule is schedule
        with pytest.raises(pitstop.SaveError, match="step 2"):
            again.save(pitstop.Progress(step=3))
        assert again.resume().step == 2
        assert again._saver.schedule is not schedule
        assert again.save(pitstop.Progress(step=3)).step == 3
