"""The Checkpointer when something fails part-way: a constructor that fails after locking the
directory releases it; a component whose own state_dict() / load_state_dict() raises is named
in a pitstop error, chained to what it raised; a call after close() names itself. Real files in
tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop.shell.opening as opening
import pitstop.shell.store.directory as directory_module
from pitstop import Checkpointer, IncompatibleCheckpoint, PitstopError, Progress, SaveError
from pitstop.core.naming import LATEST_JSON, LOCK_NAME
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import FileKind, LocalStorage


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
        patched.setattr(opening, "Saver", failing_saver)
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


# --- a component's own state_dict() / load_state_dict() that raises -----------------------------


class Scheduler:
    """A component that raises from state_dict() after ``saves`` calls, or from
    load_state_dict() (always, and so its own put-back fails too) when ``loads`` is False."""

    def __init__(self, value: int = 0, *, saves: int | None = None, loads: bool = True) -> None:
        self.value, self.saves, self.loads = value, saves, loads

    def state_dict(self) -> dict[str, int]:
        if self.saves is not None:
            if self.saves <= 0:
                raise RuntimeError("lr_lambda is a closure")
            self.saves -= 1
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not self.loads:
            raise KeyError("last_epoch")
        self.value = state["value"]


class Judges(Scheduler):
    """A component whose own compatibility judge raises."""

    def state_differences(self, stored: object) -> list[str]:
        raise ValueError("cannot judge")


@pytest.mark.parametrize("async_save", [False, True, "overlap"])
@pytest.mark.parametrize("per_rank", [False, True], ids=["replicated", "per-rank"])
def test_a_component_whose_state_dict_raises_fails_the_save_naming_it(
    tmp_path: Path, async_save: bool | str, per_rank: bool
) -> None:
    model = _model()
    scheduler = Scheduler(saves=0)
    state = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "scheduler": scheduler}
    names = ["scheduler"] if per_rank else []
    with Checkpointer(
        tmp_path, model=model, state=state, async_save=async_save, per_rank=names
    ) as ckpt:
        with pytest.raises(SaveError) as caught:
            ckpt.save(Progress(step=1))
        assert (
            str(caught.value) == "component 'scheduler': state_dict failed: lr_lambda is a closure"
        )
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert ckpt.checkpoints() == []
        scheduler.saves = None  # fixed: the next save is written
        assert ckpt.save(Progress(step=1)).step == 1


def _saved(tmp_path: Path, **state: Any) -> nn.Module:
    model = _model()
    with Checkpointer(tmp_path, model=model, state=state or {"scheduler": Scheduler(7)}) as ckpt:
        ckpt.save(Progress(step=2))
    return model


@pytest.mark.parametrize(
    ("saves", "message"),
    [
        (0, "step_000000000002.pitstop: component 'scheduler': state_dict failed: lr_lambda is"),
        (1, "step_000000000002.pitstop: component 'scheduler': state_dict failed: lr_lambda is"),
    ],
    ids=["while compared", "while snapshotted"],
)
def test_a_component_whose_state_dict_raises_fails_the_resume_naming_it(
    tmp_path: Path, saves: int, message: str
) -> None:
    _saved(tmp_path)
    model = _model()
    with torch.no_grad():
        model.weight.fill_(0.5)
    scheduler = Scheduler(1, saves=saves)
    with Checkpointer(tmp_path, model=model, state={"scheduler": scheduler}) as ckpt:
        with pytest.raises(IncompatibleCheckpoint) as caught:
            ckpt.resume()
        assert len(caught.value.differences) == 1
        assert caught.value.differences[0].startswith(message)
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert ckpt.resumed_from is None
    assert torch.equal(model.weight, torch.full_like(model.weight, 0.5))  # untouched
    assert scheduler.value == 1


def test_a_deferred_component_whose_load_raises_is_named_and_not_registered(
    tmp_path: Path,
) -> None:
    _saved(tmp_path)
    with Checkpointer(tmp_path, model=_model()) as ckpt:
        ckpt.resume()
        broken = Scheduler(1, loads=False)  # its put-back raises too: logged, not raised
        with pytest.raises(IncompatibleCheckpoint) as caught:
            ckpt.register("scheduler", broken)
        assert caught.value.differences == (
            "component 'scheduler': load_state_dict failed: 'last_epoch'",
        )
        assert isinstance(caught.value.__cause__, KeyError)
        fixed = Scheduler(1)
        ckpt.register("scheduler", fixed)  # not registered before: this one is restored
        assert fixed.value == 7


@pytest.mark.parametrize(
    ("component", "message"),
    [
        (Scheduler(1, saves=0), "component 'scheduler': state_dict failed: lr_lambda is a closure"),
        (Judges(1), "component 'scheduler': state_differences failed: cannot judge"),
    ],
    ids=["state_dict", "its own judge"],
)
def test_a_deferred_component_whose_own_code_raises_while_checked_is_named(
    tmp_path: Path, component: Scheduler, message: str
) -> None:
    _saved(tmp_path)
    with Checkpointer(tmp_path, model=_model()) as ckpt:
        ckpt.resume()
        with pytest.raises(IncompatibleCheckpoint) as caught:
            ckpt.register("scheduler", component)
        assert caught.value.differences == (message,)
        assert component.value == 1


# --- calls after close() --------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize(
    ("call", "make"),
    [
        ("save", lambda c: c.save(Progress(step=2))),
        ("maybe_save", lambda c: c.maybe_save(Progress(step=2), stop=True)),
        ("finish", lambda c: c.finish(Progress(step=2))),
        ("resume", lambda c: c.resume()),
        ("register", lambda c: c.register("scheduler", Scheduler())),
        ("wait", lambda c: c.wait()),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_call_on_a_closed_checkpointer_is_refused_naming_the_call(
    tmp_path: Path, async_save: bool, call: str, make: Any
) -> None:
    ckpt = Checkpointer(tmp_path, model=_model(), async_save=async_save)
    ckpt.save(Progress(step=1))
    ckpt.close()
    with pytest.raises(PitstopError) as caught:
        make(ckpt)
    assert str(caught.value) == (
        f"{call}(): the Checkpointer of {tmp_path} is closed; make a new Checkpointer on it "
        "(and resume()) to go on"
    )
    assert [c.step for c in ckpt.checkpoints()] == [1]  # listing still works; nothing written
    ckpt.close()  # still idempotent
