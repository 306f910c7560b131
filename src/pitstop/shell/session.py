# Driving the save session: the writer thread, waiting at each call, and errors never lost.
#
# Rules: every decision is pitstop.core.session's — which phase follows which event, what a
# call waits for, whether it raises the pending failure. This module holds the one mutable
# Session value under a condition variable, applies events from the loop's thread and the
# writer's, and waits where the core says. A background save's error is kept with the core's
# record of which save failed and raised by the next call of any kind, as a SaveError naming
# the step and the file. Deferred copies (overlap mode) are taken by whichever thread needs
# them first: the writer when it gets to them, or the loop at its next optimizer step — so the
# loop never waits for a writer thread that has not been scheduled yet; a Ctrl-C while the loop
# makes them is raised there, the save abandoned (undone by the next call). A job handed over
# while the call holds it (holding: a save written by several nodes' writers, until its last
# round) waits for the call to let go. A Ctrl-C while close()
# waits for the writer does not stop the writer: close waits on, then raises it; a second one is
# raised at once, with the save still in flight, so the directory must stay locked
# (may_release) until a later close() has waited for it.
# Nothing here refers to the Checkpointer: a dropped Checkpointer is collected (and its
# directory unlocked) even while a job or an optimizer hook still refers to its session.
# How: a condition variable, one daemon worker thread started at the first background save
# (a hard exit never hangs on it; the temp file it leaves is removed when the directory is
# next opened), and jobs that are plain closures over what they write.

"""SaveSession: one save in flight, on the loop's thread or a writer thread."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from pitstop.core.session import (
    NO_FAILURE,
    Event,
    Phase,
    Request,
    SaveStatus,
    Session,
    Until,
    WriterStep,
    advance,
    after_failed_copy,
    claim_copy,
    gate,
    may_release,
    satisfied,
    save_status,
    writer_step,
)
from pitstop.errors import PitstopError, SaveError

__all__ = ["RemoteTicket", "Reported", "SaveSession", "SaveTicket"]

log = logging.getLogger("pitstop")

Copy = Callable[[bool], None]
"""Deferred copies: ``copy(guard)``; with ``guard``, later work on this stream waits for them."""


@attrs.frozen(kw_only=True)
class Reported:
    """A failed background save, handed to the caller: the error to raise (``None``: its
    thread raised it already, an interrupt) and what to undo."""

    error: BaseException | None
    undo: Any


class SaveSession:
    """The save session of one Checkpointer (see :mod:`pitstop.core.session`)."""

    def __init__(self, directory: Path, *, background: bool) -> None:
        self._directory = directory
        self._cond = threading.Condition()
        self._state = Session(background=background)
        self._error: BaseException | None = None
        self._undo: Any = None
        self._job: tuple[int, Callable[[], None]] | None = None  # (its save's ticket, write)
        self._copy: Copy | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._holding = False  # a job handed over now waits for the end of :meth:`holding`
        self._held = 0  # the ticket of the job that waits (0: none)

    @property
    def state(self) -> Session:
        """The session's current state (a frozen record)."""
        with self._cond:
            return self._state

    # --- the loop's side ------------------------------------------------------------------

    def enter(self, request: Request) -> Reported | None:
        """Wait as the core's gate says for ``request``; return the failure to raise, if any.

        Raises :class:`~pitstop.errors.PitstopError` when the session is closed.
        """
        started = time.perf_counter()
        with self._cond:
            rule = gate(self._state, request)
            if rule.refuse:
                raise PitstopError(f"the Checkpointer of {self._directory} is {rule.refuse}")
        if rule.until is not Until.NOW:
            self._take_copy(guard=True)
        with self._cond:
            while not satisfied(self._state, rule.until):
                self._cond.wait()
            waited = time.perf_counter() - started
            if waited > 0.001 and request is not Request.STEP:
                log.info("%s waited %.3fs for the save in flight", request.value, waited)
            if not rule.raise_failure or self._state.failure is NO_FAILURE:
                return None
            return self._report()

    def _report(self) -> Reported:
        failure = self._state.failure
        assert failure is not NO_FAILURE
        error, undo = self._error, self._undo
        self._error = self._undo = None
        self._state = advance(self._state, Event.REPORTED)
        if failure.raised:  # an interrupt, raised on the loop's thread already: only undone
            return Reported(error=None, undo=undo)
        assert error is not None
        if isinstance(error, Exception):
            where = self._directory / failure.name
            # pitstop's own errors say what they are; another's name says it (KeyError: ...)
            why = (
                str(error)
                if isinstance(error, PitstopError)
                else f"{type(error).__name__}: {error}"
            )
            wrapped = SaveError(f"background save of step {failure.step} ({where}) failed: {why}")
            wrapped.__cause__ = error
            error = wrapped
        return Reported(error=error, undo=undo)

    def step_hook(self, *_: object) -> None:
        """Optimizer step pre-hook (overlap mode): parameters change only once copied."""
        self.enter(Request.STEP)

    def begin(self, step: int, name: str, undo: Any) -> int:
        """A save starts capturing; ``undo`` is handed back if it fails. Returns its ticket."""
        with self._cond:
            self._state = advance(self._state, Event.BEGIN, step=step, name=name)
            self._undo = undo
            return self._state.ticket

    def event(self, event: Event) -> None:
        """Apply ``event`` (CAPTURED, PUBLISHED or ABORTED from the loop's thread)."""
        with self._cond:
            self._state = advance(self._state, event)
            self._cond.notify_all()

    def hand_over(self, write: Callable[[], None], copy: Copy | None) -> None:
        """Hand the captured save to the writer thread; ``copy``: the copies left to do.

        The writer thread starts at the first background save, before anything is handed to
        it. Raises :class:`~pitstop.errors.SaveError` naming the step and the file when it
        cannot start: nothing was handed over, and the caller aborts the save.
        """
        with self._cond:
            if self._thread is None:
                self._thread = self._start_writer()
            self._state = advance(self._state, Event.DEFER if copy else Event.CAPTURED)
            self._copy = copy
            self._job = (self._state.ticket, write)
            self._held = self._state.ticket if self._holding else 0
            self._cond.notify_all()

    @contextlib.contextmanager
    def holding(self, hold: bool) -> Iterator[None]:
        """``hold``: the writer starts no job handed over inside this block before the block
        ends, on any path (a save's last round passed: pitstop.core.ranks.copies); an earlier
        save's job is never held."""
        with self._cond:
            self._holding = hold
        try:
            yield
        finally:
            with self._cond:
                self._holding, self._held = False, 0
                self._cond.notify_all()

    def _start_writer(self) -> threading.Thread:
        thread = threading.Thread(target=_work, args=(self,), name="pitstop-writer", daemon=True)
        try:
            thread.start()
        except Exception as exc:  # RuntimeError: can't start new thread
            where = self._directory / self._state.name
            raise SaveError(
                f"background save of step {self._state.step} ({where}) failed: its writer "
                f"thread could not start: {exc}"
            ) from exc
        return thread

    def close(self) -> Reported | None:
        """Wait for the save in flight, stop the writer thread; return a failure to raise.

        An interrupt while it waits (a KeyboardInterrupt: any BaseException that is not an
        Exception) does not stop the writer, so close still waits for it, then closes and
        raises the interrupt (a failure of that save is logged). A second interrupt ends that
        wait too: it is raised at once, with the save still in flight and the session open —
        :meth:`may_release` says so — for a later close() to finish.
        """
        try:
            reported = self.enter(Request.CLOSE)
        except Exception:
            raise
        except BaseException:
            with self._cond:
                while not satisfied(self._state, Until.SETTLED):
                    self._cond.wait()
                failure, error = self._state.failure, self._error
            if failure is not NO_FAILURE and not failure.raised:
                where = self._directory / failure.name
                log.error("background save of step %d (%s) failed: %s", failure.step, where, error)
            self._shut()
            raise
        self._shut()
        return reported

    def _shut(self) -> None:
        """Close the session (a failure not raised yet is dropped) and end the writer thread."""
        with self._cond:
            if self._state.phase is not Phase.CLOSED:
                self._state = advance(self._state, Event.CLOSE)
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def may_release(self) -> bool:
        """Whether the directory may be unlocked: no writer may still write to it."""
        with self._cond:
            return may_release(self._state)

    def status(self, ticket: int) -> SaveStatus:
        """What became of save number ``ticket``."""
        with self._cond:
            return save_status(self._state, ticket)

    def wait_for(self, ticket: int) -> SaveStatus:
        """Wait until save number ``ticket`` is published or has failed."""
        self._take_copy(guard=True)
        with self._cond:
            while save_status(self._state, ticket) is SaveStatus.PENDING:
                self._cond.wait()
            return save_status(self._state, ticket)

    # --- both sides ------------------------------------------------------------------------

    def _take_copy(self, *, guard: bool, ticket: int | None = None) -> None:
        """Run the deferred copies on this thread if nobody has taken them yet (``ticket``:
        only those of that save — the writer's job's).

        A copy that fails fails the save (the writer then writes nothing). Its error waits for
        the next call — except an interrupt on the loop's thread (a KeyboardInterrupt: any
        BaseException that is not an Exception), raised here once the session is consistent.
        """
        with self._cond:
            if not claim_copy(self._state, ticket):
                return
            self._state = advance(self._state, Event.CLAIM)
            copy, self._copy = self._copy, None
        assert copy is not None
        try:
            copy(guard)
        except BaseException as exc:
            event = after_failed_copy(
                on_loop=threading.current_thread() is not self._thread,
                interrupt=not isinstance(exc, Exception),
            )
            self.fail(exc, event)
            if event is Event.INTERRUPTED:
                raise
            return
        self.event(Event.COPIED)

    def fail(self, exc: BaseException, event: Event = Event.FAILED) -> None:
        """The save in flight failed with ``exc``: kept, and raised by the next call
        (``event`` INTERRUPTED: this thread raises it; the next call only undoes the save)."""
        with self._cond:
            if self._state.phase in (Phase.FAILED, Phase.IDLE, Phase.CLOSED):
                return
            self._error = exc if event is Event.FAILED else None
            self._state = advance(self._state, event)
            self._cond.notify_all()
            step, name = self._state.step, self._state.name
        if event is Event.INTERRUPTED:
            where = self._directory / name
            log.warning("background save of step %d (%s) abandoned: interrupted", step, where)

    # --- the writer's side -----------------------------------------------------------------

    def _next_job(self) -> tuple[int, Callable[[], None]] | None:
        with self._cond:
            while (self._job is None or self._job[0] == self._held) and not self._stopping:
                self._cond.wait()
            job, self._job = self._job, None
            return job

    def _run(self, ticket: int, job: Callable[[], None]) -> None:
        try:
            self._take_copy(guard=False, ticket=ticket)
            with self._cond:
                while (step := writer_step(self._state, ticket)) is WriterStep.WAIT:
                    self._cond.wait()  # the loop took the copies
                if step is WriterStep.DROP:
                    return  # the copies failed, and the save may be over: nothing to write
            job()
        except BaseException as exc:  # kept for the caller, never lost
            self.fail(exc)
            return
        self.event(Event.PUBLISHED)


class SaveTicket:
    """A background save's link to its session: published yet, or wait for it."""

    def __init__(self, session: SaveSession, number: int) -> None:
        self._session = session
        self._number = number

    def status(self) -> SaveStatus:
        """Pending, published or failed."""
        return self._session.status(self._number)

    def wait(self) -> SaveStatus:
        """Wait until the save is published or has failed."""
        return self._session.wait_for(self._number)


class RemoteTicket:
    """A background save's record on a rank other than 0: rank 0 writes, this rank hears.
    (``sharded``: on every rank; every rank writes its shards, in DCP's background.)

    Its status stays pending until the Checkpointer's next collective call tells how rank 0's
    write ended; it cannot wait by itself (``ckpt.wait()``, on every rank, does).
    """

    def __init__(self, *, sharded: bool = False) -> None:
        self._status = SaveStatus.PENDING
        self._sharded = sharded

    def settle(self, status: SaveStatus) -> None:
        """Record how rank 0's write ended."""
        self._status = status

    def status(self) -> SaveStatus:
        """Pending, published or failed, as last heard from rank 0."""
        return self._status

    def wait(self) -> SaveStatus:
        """The outcome, once heard; waiting alone would wait for a collective call."""
        if self._status is SaveStatus.PENDING:
            who = (
                "every rank writes its shards and rank 0 publishes them"
                if self._sharded
                else "only rank 0 writes"
            )
            raise PitstopError(
                f"{who}: a background save's record learns its outcome from the "
                "Checkpointer's next call on every rank (ckpt.wait(), finish(), ...)"
            )
        return self._status


def _work(session: SaveSession) -> None:
    """The writer thread: one job at a time, until the session closes."""
    while True:
        job = session._next_job()
        if job is None:
            return
        session._run(*job)
        del job  # hold nothing of a finished save while waiting for the next
