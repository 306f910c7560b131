"""The save session when the loop's side goes wrong: a Ctrl-C in close() or in the overlap
mode's optimizer hook, and a writer thread that cannot start.

Every interleaving is the one the test names: the writer is held at a gate or inside its
write by an event the test sets, and a KeyboardInterrupt is raised where the test puts it
(from the session's condition variable, as a real Ctrl-C interrupts ``Condition.wait``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
import pitstop.shell.session as session_module
from pitstop import Checkpointer, Progress
from pitstop.core.session import Phase, SaveStatus
from pitstop.errors import DirectoryLocked, SaveError
from pitstop.shell.state.staging import StagingPool
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage
from tinyrun import same, train_step, trained, weights
from writergate import TIMEOUT, WriterGate


def _steps(directory: Path) -> list[int]:
    return [e.step for e in scan(LocalStorage(directory)).catalog]


# --- a Ctrl-C in close() while the writer writes -------------------------------------------


class BlockedWrite:
    """The writer, inside its write, waits until :meth:`let_go`."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.go = threading.Event()

    def let_go(self) -> None:
        self.go.set()


@pytest.fixture
def blocked_write(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[Checkpointer], BlockedWrite]]:
    blocks: list[BlockedWrite] = []

    def block(ckpt: Checkpointer) -> BlockedWrite:
        blocked = BlockedWrite()
        real = ckpt._directory.execute

        def execute(plan: Any, write: Any) -> list[str]:
            blocked.writing.set()
            assert blocked.go.wait(TIMEOUT), "the test never let the writer go"
            return real(plan, write)

        monkeypatch.setattr(ckpt._directory, "execute", execute)
        blocks.append(blocked)
        return blocked

    yield block
    for blocked in blocks:
        blocked.let_go()  # never leave a writer waiting


class Interrupted(threading.Condition):
    """A session's condition variable whose first ``interrupts`` waits on thread ``name``
    raise KeyboardInterrupt, as a Ctrl-C does; ``blocked`` is set at that thread's next wait."""

    def __init__(self, name: str, interrupts: int, blocked: threading.Event) -> None:
        super().__init__()
        self.name, self.interrupts, self.blocked = name, interrupts, blocked

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread().name == self.name:
            if self.interrupts:
                self.interrupts -= 1
                raise KeyboardInterrupt
            self.blocked.set()
        return super().wait(timeout)


def _interrupt(ckpt: Checkpointer, name: str, interrupts: int, blocked: threading.Event) -> None:
    """Ctrl-C for thread ``name``'s next waits in ``ckpt``'s session (swapped in while no
    thread holds or waits on the session's condition: the writer is inside its write)."""
    ckpt._session._cond = Interrupted(name, interrupts, blocked)


def _locked(ckpt: Checkpointer, directory: Path) -> bool:
    """Whether ``ckpt`` still holds ``directory``'s lock, so that no other writer can open it."""
    try:
        other = Checkpointer(directory, model=nn.Linear(1, 1))
    except DirectoryLocked:
        return ckpt._directory._lock.held
    other.close()
    return False


ENDS: dict[str, Callable[[Checkpointer], object]] = {
    "close": lambda c: c.close(),
    "finalizer": lambda c: c._finalizer(),  # a Checkpointer dropped, or left open at exit
}


@pytest.mark.parametrize("end", list(ENDS))
def test_a_ctrl_c_in_close_keeps_the_lock_until_the_writer_has_finished(
    tmp_path: Path, blocked_write: Callable[[Checkpointer], BlockedWrite], end: str
) -> None:
    model, optimizer = trained()
    ckpt = Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}, async_save=True)
    blocked = blocked_write(ckpt)
    saved = ckpt.save(Progress(step=1))
    assert blocked.writing.wait(TIMEOUT)
    waiting = threading.Event()  # close() waits again, or has ended
    _interrupt(ckpt, "closer", 1, waiting)
    raised: list[BaseException] = []

    def closer() -> None:
        try:
            ENDS[end](ckpt)
        except BaseException as exc:  # the KeyboardInterrupt, handed to the test
            raised.append(exc)
        finally:
            waiting.set()

    thread = threading.Thread(target=closer, name="closer")
    thread.start()
    try:
        assert waiting.wait(TIMEOUT)
        assert _locked(ckpt, tmp_path), "the lock was released while the writer was writing"
        assert thread.is_alive()  # the interrupt waits for the writer
        assert not raised
        assert saved.status is SaveStatus.PENDING
    finally:
        blocked.let_go()
        thread.join(TIMEOUT)
    assert [type(e) for e in raised] == [KeyboardInterrupt]  # raised once the writer is done
    assert saved.published
    assert not _locked(ckpt, tmp_path)
    ckpt.close()  # a second close() is safe: nothing left to do
    assert _steps(tmp_path) == [1]
    with Checkpointer(tmp_path, model=model) as again:
        assert again.resume() == Progress(step=1)


def test_a_second_ctrl_c_stops_the_wait_and_the_directory_stays_locked_until_close(
    tmp_path: Path, blocked_write: Callable[[Checkpointer], BlockedWrite]
) -> None:
    model, optimizer = trained()
    ckpt = Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}, async_save=True)
    blocked = blocked_write(ckpt)
    saved = ckpt.save(Progress(step=1))
    assert blocked.writing.wait(TIMEOUT)
    _interrupt(ckpt, threading.current_thread().name, 2, threading.Event())
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.close()  # the user insists: raised at once, the save still in flight
        assert _locked(ckpt, tmp_path), "the lock was released while the writer was writing"
        assert saved.status is SaveStatus.PENDING
    finally:
        blocked.let_go()
    ckpt.close()  # waits for the writer, then releases the lock
    assert saved.published
    assert not _locked(ckpt, tmp_path)
    ckpt.close()
    assert _steps(tmp_path) == [1]


# --- a writer thread that cannot start ------------------------------------------------------


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_a_writer_thread_that_cannot_start_fails_the_save_and_the_next_one_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str
) -> None:
    model, optimizer = trained()
    real = threading.Thread.start
    refusals = [RuntimeError("can't start new thread")]

    def start(self: threading.Thread) -> None:
        if self.name == "pitstop-writer" and refusals:  # the first writer only
            raise refusals.pop()
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with Checkpointer(
        tmp_path,
        model=model,
        state={"optimizer": optimizer},
        async_save=mode,  # type: ignore[arg-type]
    ) as ckpt:
        with pytest.raises(SaveError) as raised:
            ckpt.save(Progress(step=1))
        message = str(raised.value)
        assert "step 1" in message
        assert str(tmp_path / "step_000000000001.pitstop") in message
        assert "can't start new thread" in message
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert ckpt._session.state.phase is Phase.IDLE
        assert ckpt._session.status(1) is SaveStatus.FAILED
        pool = ckpt._saver._pool
        assert pool is not None
        assert not pool._lent  # the staging buffers went back to the pool
        assert list(tmp_path.iterdir()) == [tmp_path / ".lock"]  # nothing written
        at_save = weights(model)
        saved = ckpt.save(Progress(step=1))  # the same step: the failed save did not count
        train_step(model, optimizer)
        ckpt.wait()
        assert saved.published
    assert _steps(tmp_path) == [1]
    assert same(dict(pitstop.load(saved.path)["weights"]["raw"]), at_save)


# --- a Ctrl-C in overlap mode's optimizer hook -----------------------------------------------


def _fail_the_deferred_copy(
    monkeypatch: pytest.MonkeyPatch, error: BaseException | None = None
) -> list[bool]:
    """The first snapshot's deferred copies raise ``error`` (a KeyboardInterrupt unless given;
    its first copy call copies the rest); returns each call's ``guard``."""
    real = StagingPool._copy
    calls: list[bool] = []

    def copy(
        self: StagingPool, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, guard: bool = True
    ) -> None:
        calls.append(guard)
        if len(calls) == 2:
            raise error if error is not None else KeyboardInterrupt
        real(self, pairs, guard=guard)

    monkeypatch.setattr(StagingPool, "_copy", copy)
    return calls


def _close(ckpt: Checkpointer) -> None:
    """close(), where a KeyboardInterrupt would be one the step hook kept: a failure, not the
    end of the test run."""
    try:
        ckpt.close()
    except KeyboardInterrupt:
        pytest.fail("close() raised a KeyboardInterrupt that the step hook had kept")


def test_a_ctrl_c_in_the_step_hooks_copy_is_raised_from_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer_gate: WriterGate
) -> None:
    model, optimizer = trained()
    calls = _fail_the_deferred_copy(monkeypatch)
    ckpt = Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap")
    try:
        at_save = weights(model)
        saved = ckpt.save(Progress(step=1))
        with pytest.raises(KeyboardInterrupt):
            train_step(model, optimizer)  # the writer is held: the hook copies, and is interrupted
        assert calls == [True, True]  # on the loop's thread
        assert same(weights(model), at_save)  # raised before the step changed anything
        assert saved.status is SaveStatus.FAILED  # abandoned, and consistent:
        assert ckpt._session.state.phase is not Phase.COPYING
        pool = ckpt._saver._pool
        assert pool is not None
        assert not pool._lent
        again = ckpt.save(Progress(step=1))  # no second interrupt; step 1 was not saved
        train_step(model, optimizer)
        writer_gate.open()
        ckpt.wait()
        assert again.published
    finally:
        writer_gate.open()
        _close(ckpt)
    assert _steps(tmp_path) == [1]
    assert same(dict(pitstop.load(again.path)["weights"]["raw"]), at_save)


def test_a_ctrl_c_in_the_step_hook_leaves_a_with_block_as_a_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer_gate: WriterGate
) -> None:
    """Leaving the block, close() puts the abandoned save's schedule back and raises nothing of
    its own: the interrupt is what the user sees, and the directory is unlocked."""
    model, optimizer = trained()
    _fail_the_deferred_copy(monkeypatch)
    opened: list[Checkpointer] = []
    reached = []

    def loop() -> None:
        with Checkpointer(
            tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap"
        ) as ckpt:
            opened.append(ckpt)
            try:
                ckpt.save(Progress(step=1))
                train_step(model, optimizer)
                reached.append("after the step")
            finally:
                writer_gate.open()  # before close() joins the writer

    with pytest.raises(KeyboardInterrupt) as raised:
        loop()
    assert reached == []  # raised from the step, not later
    assert raised.value.__context__ is None  # nothing raised on top of it, or under it
    assert not _locked(opened[0], tmp_path)
    assert _steps(tmp_path) == []


# --- a writer thread that took a job whose save then ended ------------------------------------


def test_a_job_taken_before_its_save_failed_writes_nothing_and_the_next_save_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer takes save 1's job, then is held; meanwhile the loop's step makes save 1's
    deferred copy, which fails; the next call raises that, and save 2 is handed over. Save 1's
    job must write nothing (its buffers were never filled) and must not end save 2."""
    model, optimizer = trained()
    taken, go = threading.Event(), threading.Event()
    real_work = session_module._work

    def work(session: session_module.SaveSession) -> None:
        job = session._next_job()  # save 1's job, taken...
        taken.set()
        assert go.wait(TIMEOUT), "the test never let the writer go"
        if job is not None:
            session._run(*job)  # ...and run once its save is long over
        real_work(session)

    monkeypatch.setattr(session_module, "_work", work)
    _fail_the_deferred_copy(monkeypatch, RuntimeError("the copy failed"))  # by the loop's step
    ckpt = Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap")
    try:
        first = ckpt.save(Progress(step=1))
        assert taken.wait(TIMEOUT)
        train_step(model, optimizer)  # the hook copies, and the copy fails
        assert first.status is SaveStatus.FAILED
        with pytest.raises(SaveError, match=r"step 1.*the copy failed"):
            ckpt.save(Progress(step=2))
        at_save = weights(model)
        second = ckpt.save(Progress(step=2))
        train_step(model, optimizer)  # the hook makes save 2's copy: it is being written
        go.set()
        ckpt.wait()
        assert second.published
    finally:
        go.set()
        ckpt.close()
    assert _steps(tmp_path) == [2]
    assert same(dict(pitstop.load(second.path)["weights"]["raw"]), at_save)
