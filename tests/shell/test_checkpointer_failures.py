"""The Checkpointer when something fails part-way: a constructor that fails after locking the
directory releases it. Real files in tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop.shell.directory as directory_module
import pitstop.shell.manager as manager
from pitstop import Checkpointer, Progress
from pitstop.core.naming import LATEST_JSON, LOCK_NAME
from pitstop.shell.directory import CheckpointDirectory
from pitstop.shell.storage import FileKind, LocalStorage


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


class Boom(Exception):
    """The failure injected into a constructor."""


# --- a constructor that fails after the lock was taken ------------------------------------------


def test_a_constructor_that_fails_after_locking_releases_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_saver(**_: Any) -> None:
        assert (tmp_path / LOCK_NAME).exists()  # the directory is locked by now
        raise Boom("the saver could not be made")

    with monkeypatch.context() as patched:
        patched.setattr(manager, "Saver", failing_saver)
        with pytest.raises(Boom, match="the saver could not be made"):
            Checkpointer(tmp_path, model=_model())
    assert not (tmp_path / LOCK_NAME).exists()
    with Checkpointer(tmp_path, model=_model()) as again:  # not DirectoryLocked
        again.save(Progress(step=1))


def test_a_constructor_that_fails_hooking_optimizers_removes_the_hooks_it_made(
    tmp_path: Path,
) -> None:
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(model.parameters(), lr=0.1)

    def refuse(*_: object) -> None:
        raise Boom("no hooks on this optimizer")

    second.register_step_pre_hook = refuse  # type: ignore[method-assign]
    with pytest.raises(Boom, match="no hooks on this optimizer"):
        Checkpointer(
            tmp_path, model=model, state={"first": first, "second": second}, async_save="overlap"
        )
    assert not first._optimizer_step_pre_hooks  # the hook it did add is gone
    assert not (tmp_path / LOCK_NAME).exists()
    with Checkpointer(tmp_path, model=model, state={"first": first}, async_save="overlap"):
        pass


class _FailsAfterScan(LocalStorage):
    """Local storage whose look at latest.json fails once the directory has been scanned."""

    scanned = False

    def kind(self, name: str) -> FileKind:
        if self.scanned and name == LATEST_JSON:
            raise OSError(5, "Input/output error", str(self.path(name)))
        return super().kind(name)


def test_a_directory_whose_open_fails_after_its_scan_is_not_left_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _FailsAfterScan(tmp_path)
    real_scan = directory_module.scan

    def scan_then_fail(*args: Any, **kwargs: Any) -> Any:
        found = real_scan(*args, **kwargs)
        storage.scanned = True
        return found

    with monkeypatch.context() as patched:
        patched.setattr(directory_module, "scan", scan_then_fail)
        with pytest.raises(OSError, match="Input/output error"):
            Checkpointer(tmp_path, model=_model(), storage=storage)
    assert not (tmp_path / LOCK_NAME).exists()
    with CheckpointDirectory(tmp_path):  # not DirectoryLocked
        pass
