"""A Ctrl-C in the last instants of a save call, once the save is out of the call's hands.

A synchronous save interrupted just after it was published, and a background save interrupted
just after it was handed to the writer thread: the interrupt reaches the caller, and the save
counts — it is not ended a second time (which raised an IllegalTransition over the interrupt,
or killed the writer thread when it published), and its step is not written again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pitstop
from pitstop import Checkpointer, Progress
from pitstop.core.session import Event, Phase
from pitstop.shell.session import SaveSession
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage
from tinyrun import same, train_step, trained, weights
from writergate import TIMEOUT


def _steps(directory: Path) -> list[int]:
    return [e.step for e in scan(LocalStorage(directory)).catalog]


def _within_timeout(call: Callable[[], object]) -> None:
    """Run ``call`` on a helper thread: a call that would wait for a writer thread that died
    fails the test instead of hanging it."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            failed.append(exc)

    helper = threading.Thread(target=run, daemon=True)
    helper.start()
    helper.join(TIMEOUT)
    assert not helper.is_alive(), f"{call} still waits after {TIMEOUT}s"
    if failed:
        raise failed[0]


def test_a_ctrl_c_just_after_a_synchronous_save_was_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    real = SaveSession.event
    interrupts = [KeyboardInterrupt()]

    def event(self: SaveSession, happened: Event) -> None:
        real(self, happened)
        if happened is Event.PUBLISHED and interrupts:
            raise interrupts.pop()

    monkeypatch.setattr(SaveSession, "event", event)
    with Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        at_save = weights(model)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(Progress(step=1))
        assert ckpt._session.state.phase is Phase.IDLE
        path = tmp_path / "step_000000000001.pitstop"
        written = path.stat().st_ino
        ckpt.finish(Progress(step=1))  # saved already: not written again
        assert path.stat().st_ino == written
    assert _steps(tmp_path) == [1]
    assert same(dict(pitstop.load(path)["weights"]["raw"]), at_save)


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_a_ctrl_c_just_after_a_background_save_was_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str
) -> None:
    model, optimizer = trained()
    real = SaveSession.hand_over
    interrupts = [KeyboardInterrupt()]

    def hand_over(self: SaveSession, *args: Any) -> None:
        real(self, *args)
        if interrupts:
            raise interrupts.pop()

    monkeypatch.setattr(SaveSession, "hand_over", hand_over)
    ckpt = Checkpointer(
        tmp_path,
        model=model,
        state={"optimizer": optimizer},
        async_save=mode,  # type: ignore[arg-type]
    )
    try:
        at_save = weights(model)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(Progress(step=1))
        train_step(model, optimizer)  # overlap mode: the hook copies, or waits for the copy
        _within_timeout(ckpt.wait)
        path = tmp_path / "step_000000000001.pitstop"
        written = path.stat().st_ino
        _within_timeout(lambda: ckpt.finish(Progress(step=1)))  # saved already
        assert path.stat().st_ino == written
        after = weights(model)
        second = ckpt.save(Progress(step=2))  # the writer thread writes on
        _within_timeout(ckpt.wait)
        assert second.published
    finally:
        _within_timeout(ckpt.close)
    assert _steps(tmp_path) == [1, 2]
    assert same(dict(pitstop.load(path)["weights"]["raw"]), at_save)
    assert same(dict(pitstop.load(second.path)["weights"]["raw"]), after)
