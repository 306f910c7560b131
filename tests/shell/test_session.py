"""The save session in the shell: what each call waits for, records that tell, errors once.

The writer thread is held back at its start by a gate the test opens, so every interleaving
below is the one the test names — never a race that usually goes one way.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import pitstop
from pitstop import Checkpointer, Progress, SaveReason
from pitstop.core.session import Phase, SaveStatus
from pitstop.errors import DirectoryLocked, SaveError
from pitstop.shell.session import SaveSession
from tinyrun import same, train_step, trained, weights
from writergate import OPENER_TIMEOUT, TIMEOUT, WriterGate


def test_overlap_mode_optimizer_step_waits_for_the_copy(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    """The step pre-hook takes the copy before step() changes the weights (issue 10)."""
    model, optimizer = trained()
    at_save = weights(model)
    with Checkpointer(
        tmp_path, model=model, state={"optimizer": optimizer}, async_save="overlap"
    ) as ckpt:
        saved = ckpt.save(Progress(step=1))
        assert not saved.published  # the writer has not even started
        train_step(model, optimizer)  # the hook must copy the weights before they change
        writer_gate.open()
        ckpt.wait()
    assert not same(weights(model), at_save)
    assert same(dict(pitstop.load(saved.path)["weights"]["raw"]), at_save)


def test_resume_waits_for_the_save_in_flight(tmp_path: Path, writer_gate: WriterGate) -> None:
    """Defect 2: resume() loading other weights while an overlap save's copy is pending."""
    other, _ = trained(seed=1)
    with Checkpointer(tmp_path / "other", model=other) as ckpt:
        other_path = ckpt.save(Progress(step=9)).path
    model, optimizer = trained()
    at_save = weights(model)
    with Checkpointer(
        tmp_path / "run", model=model, state={"optimizer": optimizer}, async_save="overlap"
    ) as ckpt:
        saved = ckpt.save(Progress(step=1))
        session = ckpt._session

        def open_once_copied() -> None:
            # resume() must take the copy itself before it loads anything; only then is the
            # writer let go (had resume not waited, the copy would see the loaded weights).
            with session._cond:
                session._cond.wait_for(
                    lambda: session._state.phase is Phase.WRITING, OPENER_TIMEOUT
                )
            writer_gate.open()

        opener = threading.Thread(target=open_once_copied)
        opener.start()
        try:
            ckpt.resume(other_path, strict=False)
        finally:
            opener.join(TIMEOUT)
        assert saved.published
    assert same(dict(pitstop.load(saved.path)["weights"]["raw"]), at_save)
    assert same(weights(model), weights(other))


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_a_dropped_checkpointer_unlocks_its_directory(tmp_path: Path, mode: bool | str) -> None:
    """Defect 3: no close(), no gc.collect(): dropping the last reference is enough."""
    model, optimizer = trained()
    ckpt = Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}, async_save=mode)  # type: ignore[arg-type]
    saved = ckpt.save(Progress(step=1))
    alive = weakref.ref(ckpt)
    del ckpt
    assert alive() is None
    assert saved.published  # the finalizer published what was in flight
    assert not optimizer._optimizer_step_pre_hooks  # and removed its hook
    with Checkpointer(tmp_path, model=model) as again:
        assert again.resume() == Progress(step=1)


def test_a_second_live_checkpointer_is_still_refused(tmp_path: Path) -> None:
    model, _ = trained()
    with Checkpointer(tmp_path, model=model, async_save=True), pytest.raises(DirectoryLocked):
        Checkpointer(tmp_path, model=model)


@pytest.mark.parametrize(
    ("reason", "recorded", "detail"),
    [
        ("manual", SaveReason.MANUAL, ""),
        ("before eval", SaveReason.MANUAL, "before eval"),
        ("stop", SaveReason.STOP, ""),
        (SaveReason.STOP, SaveReason.STOP, ""),
        ("final", SaveReason.FINAL, ""),
    ],
)
def test_save_records_the_reason_given(
    tmp_path: Path, reason: str, recorded: SaveReason, detail: str
) -> None:
    """Defect 6: ``save(progress, reason=...)`` recorded ``manual`` whatever the reason."""
    model, _ = trained()
    with Checkpointer(tmp_path, model=model) as ckpt:
        saved = ckpt.save(Progress(step=2), reason=reason)
        listed = ckpt.checkpoints()[-1]
    assert (saved.reason, saved.detail) == (recorded, detail)
    assert (listed.reason, listed.detail) == (recorded, detail)
    assert pitstop.load(saved.path) is not None
    final = tmp_path / "final"
    assert final.exists() is (recorded is SaveReason.FINAL)


@pytest.mark.parametrize("reason", ["best", "", 3])
def test_save_refuses_a_reason_it_cannot_record(tmp_path: Path, reason: object) -> None:
    model, _ = trained()
    with Checkpointer(tmp_path, model=model) as ckpt, pytest.raises(pitstop.ConfigError):
        ckpt.save(Progress(step=2), reason=reason)  # type: ignore[arg-type]
    assert list(tmp_path.glob("*.pitstop")) == []


def test_a_background_record_says_when_it_is_published(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    model, _ = trained()
    with Checkpointer(tmp_path, model=model, async_save=True) as ckpt:
        saved = ckpt.save(Progress(step=1))
        assert saved.status is SaveStatus.PENDING
        assert not saved.published
        assert not saved.path.exists()
        writer_gate.open()
        assert saved.wait() is True
        assert saved.published
        assert saved.path.is_file()


def _failing_directory(ckpt: Checkpointer, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ckpt._directory.execute
    failures = iter([OSError(28, "No space left on device")])

    def failing(plan, write):  # type: ignore[no-untyped-def]
        for failure in failures:
            raise failure
        return real(plan, write)

    monkeypatch.setattr(ckpt._directory, "execute", failing)


CALLS: dict[str, Callable[[Checkpointer], object]] = {
    "resume": lambda c: c.resume(),
    "register": lambda c: c.register("counter", torch.optim.SGD([nn.Parameter(torch.ones(1))])),
    "maybe_save": lambda c: c.maybe_save(Progress(step=3)),
    "save": lambda c: c.save(Progress(step=3)),
    "checkpoints": lambda c: c.checkpoints(),
    "wait": lambda c: c.wait(),
    "close": lambda c: c.close(),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_failed_background_save_is_raised_by_the_next_call_of_any_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    model, _ = trained()
    ckpt = Checkpointer(tmp_path, model=model, async_save=True)
    try:
        _failing_directory(ckpt, monkeypatch)
        saved = ckpt.save(Progress(step=2))
        assert saved.wait() is False
        assert saved.status is SaveStatus.FAILED
        with pytest.raises(SaveError) as raised:
            CALLS[call](ckpt)
        message = str(raised.value)
        assert "step 2" in message
        assert str(tmp_path / "step_000000000002.pitstop") in message
        assert "No space left on device" in message
        CALLS["wait"](ckpt) if call != "close" else None  # raised once, not twice
    finally:
        ckpt.close()
    assert not saved.published
    assert list(tmp_path.glob("*.pitstop")) == []


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_a_background_save_that_only_moves_pointers(tmp_path: Path, mode: bool | str) -> None:
    """finish() at the step the last maybe_save wrote: no new file, `final` moves to it."""
    model, _ = trained()
    policy = pitstop.Policy(every_steps=2)
    with Checkpointer(tmp_path, model=model, policy=policy, async_save=mode) as ckpt:  # type: ignore[arg-type]
        written = ckpt.maybe_save(Progress(step=2))
        final = ckpt.finish(Progress(step=2))
        assert written is not None
        assert final is not None
        assert final.path == written.path
        assert final.published
    assert (tmp_path / "final").resolve() == written.path.resolve()


class _Watched(threading.Condition):
    """A session's condition that says each time the writer thread starts to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.writer_waits = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread().name == "pitstop-writer":
            self.writer_waits.set()
        return super().wait(timeout)


def _settled(session: SaveSession, ticket: int) -> SaveStatus:
    """``session.wait_for(ticket)``, bounded: a held job never let go fails, never hangs."""
    got: list[SaveStatus] = []
    waiter = threading.Thread(target=lambda: got.append(session.wait_for(ticket)), daemon=True)
    waiter.start()
    waiter.join(TIMEOUT)
    assert got, f"save {ticket} never settled"
    return got[0]


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_write_handed_over_while_held_starts_only_once_the_hold_ends(
    tmp_path: Path, ends: str
) -> None:
    """A save written by several nodes' writers: the writer thread looks at the job handed
    over inside ``holding`` and waits again without starting it; it starts once the block
    ends, on either path (pitstop.core.ranks.copies)."""
    session = SaveSession(tmp_path, background=True)
    watched = session._cond = _Watched()
    ran: list[int] = []
    try:
        ticket = session.begin(1, "step_000000000001.pitstop", None)
        session.hand_over(lambda: ran.append(1), None)  # not held: it runs
        assert _settled(session, ticket) is SaveStatus.PUBLISHED
        raises = pytest.raises(RuntimeError) if ends == "raises" else contextlib.nullcontext()
        with raises, session.holding(True):
            ticket = session.begin(2, "step_000000000002.pitstop", None)
            with watched:  # the writer wakes for the job only once this lets go
                session.hand_over(lambda: ran.append(2), None)
                watched.writer_waits.clear()
            assert watched.writer_waits.wait(TIMEOUT)  # it looked, and waits again
            assert ran == [1]
            if ends == "raises":
                raise RuntimeError("a round failed")
        assert _settled(session, ticket) is SaveStatus.PUBLISHED
        assert ran == [1, 2]
    finally:
        assert session.close() is None


def test_a_job_handed_over_before_the_hold_is_not_held(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    """The previous save's job, not yet taken when the next save's call holds its own, still
    runs (the next save's plan waits for it: holding it would never end)."""
    session = SaveSession(tmp_path, background=True)
    ran: list[int] = []
    try:
        ticket = session.begin(1, "step_000000000001.pitstop", None)
        session.hand_over(lambda: ran.append(1), None)  # the writer waits at its gate
        with session.holding(True):
            writer_gate.open()
            assert _settled(session, ticket) is SaveStatus.PUBLISHED
        assert ran == [1]
    finally:
        assert session.close() is None
