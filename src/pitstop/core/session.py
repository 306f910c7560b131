# The life of a save, as a pure state machine (h11's style: no I/O, no threads, no clock).
#
# Rules: a Checkpointer has at most one save in flight, and this record says where it is:
#   IDLE ── BEGIN ──► CAPTURING      a save call reads the live state on the loop's thread
#   CAPTURING ── DEFER ──► DEFERRED  (overlap mode) the copies of what only optimizer.step()
#                                    changes are left for later; the call returns
#   DEFERRED ── CLAIM ──► COPYING    a thread (the writer, or the loop at its next step) takes
#                                    them; no other thread copies too
#   CAPTURING | COPYING ── CAPTURED/COPIED ──► WRITING   nothing live is read any more (except
#                                    by a synchronous save, which writes from the live tensors
#                                    before its call returns)
#   WRITING ── PUBLISHED ──► IDLE    durable, pointers moved
#   any save phase ── FAILED ──► FAILED   (in the background) the error waits for the next call
#   COPYING ── INTERRUPTED ──► FAILED     the loop's thread, making the deferred copies, was
#                                    interrupted (a Ctrl-C): it raises that there and then
#   any save phase ── ABORTED ──► IDLE    (on the loop's thread) the call raised it itself;
#                                    `left_by_raise` says whether a call that raised from
#                                    anywhere left its own save unended (it must abort it)
#   FAILED ── REPORTED ──► IDLE      the error reached the caller, exactly once (an interrupted
#                                    save's already had: reporting it only puts its undo back)
#   IDLE | FAILED ── CLOSE ──► CLOSED
# Every other (phase, event) pair is a bug and raises IllegalTransition. Before a call does
# anything it asks `gate`: what it must wait for (nothing; until the live state is no longer
# read; until the save in flight is published or failed), whether the pending failure is raised
# first, or that it is refused (closed: all but close, the hook and listing). Calls that change
# or read live state (resume, register, a save that writes, the optimizer's step in overlap
# mode) wait until nothing live is read; calls that read the directory or end the session wait
# until the save settles.
# A deferred copy that raised is raised at once only when it is an interrupt on the loop's
# thread (`after_failed_copy`); any other error waits for the next call, as raising it inside
# optimizer.step() would break the user's step. Each save gets a ticket number; `save_status`
# tells a Checkpoint record whether its save is pending, published or failed, and the writer's
# job carries its save's number (`writer_step`): a job whose save ended before the writer got to
# it writes nothing and claims nothing of the next save's. The directory may
# be unlocked (`may_release`) only when no save is in flight: a close() interrupted while the
# writer writes keeps the lock.
# How: enums for phases, events and requests; a dict for the transition table; frozen records.

"""The save session: phases, events, and what each call waits for."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

import attrs

from pitstop.errors import PitstopError

__all__ = [
    "NO_FAILURE",
    "Event",
    "FailedSave",
    "Gate",
    "IllegalTransition",
    "NoFailure",
    "Phase",
    "Request",
    "SaveStatus",
    "Session",
    "Until",
    "WriterStep",
    "advance",
    "after_failed_copy",
    "after_raise",
    "agreed_status",
    "claim_copy",
    "gate",
    "left_by_raise",
    "may_release",
    "reads_live",
    "satisfied",
    "save_status",
    "settles_first",
    "waits_for_uploads",
    "writer_step",
]


class IllegalTransition(PitstopError):
    """An event that the session's phase does not allow (a bug, or a call from two threads)."""


class Phase(enum.Enum):
    """Where the save in flight is (IDLE: none)."""

    IDLE = "idle"
    CAPTURING = "capturing"
    DEFERRED = "deferred"  # overlap mode: copies left for the next optimizer step
    COPYING = "copying"
    WRITING = "writing"
    FAILED = "failed"
    CLOSED = "closed"


class Event(enum.Enum):
    """What happened to the session."""

    BEGIN = "begin"
    DEFER = "defer"
    CLAIM = "claim"
    COPIED = "copied"
    CAPTURED = "captured"
    PUBLISHED = "published"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # the loop's thread, interrupted in its copy, raises it itself
    ABORTED = "aborted"
    REPORTED = "reported"
    CLOSE = "close"


_SAVING: Final = (Phase.CAPTURING, Phase.DEFERRED, Phase.COPYING, Phase.WRITING)

TRANSITIONS: Final[dict[tuple[Phase, Event], Phase]] = {
    (Phase.IDLE, Event.BEGIN): Phase.CAPTURING,
    (Phase.CAPTURING, Event.DEFER): Phase.DEFERRED,
    (Phase.CAPTURING, Event.CAPTURED): Phase.WRITING,
    (Phase.DEFERRED, Event.CLAIM): Phase.COPYING,
    (Phase.COPYING, Event.COPIED): Phase.WRITING,
    (Phase.COPYING, Event.INTERRUPTED): Phase.FAILED,
    (Phase.WRITING, Event.PUBLISHED): Phase.IDLE,
    **{(phase, Event.FAILED): Phase.FAILED for phase in _SAVING},
    **{(phase, Event.ABORTED): Phase.IDLE for phase in _SAVING},
    (Phase.FAILED, Event.REPORTED): Phase.IDLE,
    (Phase.IDLE, Event.CLOSE): Phase.CLOSED,
    (Phase.FAILED, Event.CLOSE): Phase.CLOSED,
}
"""``(phase, event) -> next phase``; a pair not in the table is illegal."""


class NoFailure(enum.Enum):
    """Sentinel: no failed save waits to be raised."""

    NO_FAILURE = "no failure"

    def __repr__(self) -> str:
        return "NO_FAILURE"


NO_FAILURE: Final = NoFailure.NO_FAILURE


@attrs.frozen(kw_only=True)
class FailedSave:
    """A background save that failed: which one (the shell keeps the exception itself).

    ``raised``: the thread that met the error raised it itself (the loop's, interrupted in its
    copy), so reporting it only puts the schedule and pointers back.
    """

    ticket: int
    step: int
    name: str
    raised: bool = False


class SaveStatus(enum.Enum):
    """What became of one save."""

    PENDING = "pending"
    PUBLISHED = "published"
    FAILED = "failed"


def agreed_status(statuses: Sequence[SaveStatus | None]) -> SaveStatus | None:
    """One background save written by several writers (one per directory the ranks do not
    share): ``statuses``, each writer's (``None``: it has none). Failed if any copy failed,
    pending while any copy is, published once every copy is; ``None`` when no writer has one."""
    held = [s for s in statuses if s is not None]
    for status in (SaveStatus.FAILED, SaveStatus.PENDING, SaveStatus.PUBLISHED):
        if status in held:
            return status
    return None


@attrs.frozen(kw_only=True)
class Session:
    """The session's state.

    ``background``: saves are written on another thread (``async_save`` True or "overlap").
    ``ticket``: the number of the most recent save begun (0: none yet). ``step`` and ``name``:
    that save's step and file. ``failure``: a failed save not yet raised. ``failed``: the
    tickets of every save that failed.
    """

    background: bool
    phase: Phase = Phase.IDLE
    ticket: int = 0
    step: int = 0
    name: str = ""
    failure: FailedSave | NoFailure = NO_FAILURE
    failed: frozenset[int] = frozenset()


def advance(session: Session, event: Event, *, step: int = 0, name: str = "") -> Session:
    """The session after ``event``; ``step`` and ``name`` describe the save a BEGIN starts.

    Raises :class:`IllegalTransition` for an event the phase does not allow.
    """
    after = TRANSITIONS.get((session.phase, event))
    if after is None:
        raise IllegalTransition(
            f"a save session in phase {session.phase.value!r} cannot take {event.value!r}"
            + (f" (save of step {session.step}, {session.name})" if session.ticket else "")
        )
    if event is Event.BEGIN:
        return attrs.evolve(session, phase=after, ticket=session.ticket + 1, step=step, name=name)
    if event in (Event.FAILED, Event.INTERRUPTED):
        failure = FailedSave(
            ticket=session.ticket,
            step=session.step,
            name=session.name,
            raised=event is Event.INTERRUPTED,
        )
        return attrs.evolve(
            session, phase=after, failure=failure, failed=session.failed | {session.ticket}
        )
    if event is Event.ABORTED:
        return attrs.evolve(session, phase=after, failed=session.failed | {session.ticket})
    if event in (Event.REPORTED, Event.CLOSE):
        return attrs.evolve(session, phase=after, failure=NO_FAILURE)
    return attrs.evolve(session, phase=after)


def after_failed_copy(*, on_loop: bool, interrupt: bool) -> Event:
    """What a deferred copy that raised does to its save: INTERRUPTED (the thread raises it at
    once) when the loop's thread was interrupted — a Ctrl-C, meant for the loop — else FAILED
    (the error waits for the next call; the writer's thread has nobody to raise to)."""
    return Event.INTERRUPTED if on_loop and interrupt else Event.FAILED


def claim_copy(session: Session, ticket: int | None = None) -> bool:
    """Whether a thread may take the deferred copies now (nobody has yet).

    ``ticket``: the save the thread works for (the writer's job); a job of a save that has
    ended claims nothing of the next one's. ``None``: the save in flight, whichever it is (the
    loop's thread).
    """
    return session.phase is Phase.DEFERRED and ticket in (None, session.ticket)


class WriterStep(enum.Enum):
    """What the writer thread does next with the job of one save."""

    WAIT = "wait"  # the loop's thread is making that save's copies
    WRITE = "write"  # that save is the one in flight, and nothing live is read any more
    DROP = "drop"  # that save has ended (its copies failed): its job must write nothing


def writer_step(session: Session, ticket: int) -> WriterStep:
    """What the writer does with the job of save number ``ticket``.

    A job is tied to its save: once that save has ended — failed, reported, and another begun
    in the meantime — its job writes nothing, and it never ends the save now in flight. (The
    writer claims its save's deferred copies first, :func:`claim_copy`, so it never asks while
    they are still to take.)
    """
    if session.ticket != ticket:
        return WriterStep.DROP
    if session.phase is Phase.COPYING:
        return WriterStep.WAIT
    return WriterStep.WRITE if session.phase is Phase.WRITING else WriterStep.DROP


def left_by_raise(session: Session) -> bool:
    """Whether a save call that raised left its own save unended, to be ABORTED on its thread.

    A save still capturing is the calling thread's own; without a background writer, so is a
    save in any phase. A background save handed over (deferred, copying, writing) belongs to
    the thread that took it, which ends it.
    """
    if session.phase is Phase.CAPTURING:
        return True
    return not session.background and session.phase in _SAVING


def after_raise(session: Session, *, published: bool) -> Event | None:
    """How a save call that raised ends its save, when it ends it (``None``: it does not).

    ``published``: the directory published the save before the call heard (a Ctrl-C in its
    retention, or on the way back). A save still the call's own (:func:`left_by_raise`) ends
    PUBLISHED if it was being written and was published — it counts — else ABORTED; one handed
    to the writer, or over already, is not the call's to end (it counts as handed over).
    """
    if not left_by_raise(session):
        return None
    return Event.PUBLISHED if published and session.phase is Phase.WRITING else Event.ABORTED


def reads_live(session: Session) -> bool:
    """Whether the save in flight may still read the live tensors."""
    if session.phase in (Phase.CAPTURING, Phase.DEFERRED, Phase.COPYING):
        return True
    return session.phase is Phase.WRITING and not session.background


class Request(enum.Enum):
    """The Checkpointer calls that consult the session."""

    SAVE = "maybe_save"  # maybe_save / save / finish, before the policy decides
    WRITE = "write"  # a save the policy decided on: it captures the live state
    RESUME = "resume"
    REGISTER = "register"
    STEP = "optimizer step"  # the overlap mode's optimizer pre-hook
    WAIT = "wait"
    CLOSE = "close"
    LIST = "checkpoints"


class Until(enum.Enum):
    """What a call waits for before it goes on."""

    NOW = "now"
    COPIED = "copied"  # the save in flight reads nothing live any more
    SETTLED = "settled"  # the save in flight is published or has failed


@attrs.frozen(kw_only=True)
class Gate:
    """What a call must do first: wait ``until``, then report the pending failure or not (put
    its undo back, and raise its error unless its thread raised it already).

    ``refuse``: non-empty when the call is refused, with the reason.
    """

    until: Until
    raise_failure: bool
    refuse: str = ""


_GATES: Final = {
    Request.SAVE: Gate(until=Until.NOW, raise_failure=True),
    Request.WRITE: Gate(until=Until.SETTLED, raise_failure=True),
    Request.RESUME: Gate(until=Until.SETTLED, raise_failure=True),
    Request.REGISTER: Gate(until=Until.COPIED, raise_failure=True),
    # Raising inside optimizer.step() would break the user's step; the next call raises it.
    Request.STEP: Gate(until=Until.COPIED, raise_failure=False),
    Request.WAIT: Gate(until=Until.SETTLED, raise_failure=True),
    Request.CLOSE: Gate(until=Until.SETTLED, raise_failure=True),
    Request.LIST: Gate(until=Until.NOW, raise_failure=True),
}


def gate(session: Session, request: Request) -> Gate:
    """What ``request`` must wait for, and whether it raises the pending failure first."""
    if session.phase is Phase.CLOSED:
        if request in (Request.CLOSE, Request.STEP, Request.LIST):
            return Gate(until=Until.NOW, raise_failure=False)
        return Gate(until=Until.NOW, raise_failure=False, refuse="closed")
    return _GATES[request]


def waits_for_uploads(request: Request) -> bool:
    """Whether ``request`` waits until a remote tier's uploads are done (``wait``, ``finish``
    and ``close``: the run's end; ``resume``: it reads the remote tier). Any other call only
    raises an upload's failure, never waits for one."""
    return request in (Request.WAIT, Request.CLOSE, Request.RESUME)


def settles_first(request: Request) -> bool:
    """Whether ``request`` waits until the save in flight is published or has failed — so a
    save only a collective call can finish (sharded, in the background) is finished first."""
    return _GATES[request].until is Until.SETTLED


def satisfied(session: Session, until: Until) -> bool:
    """Whether what a call waits for has happened."""
    if until is Until.NOW:
        return True
    if until is Until.COPIED:
        return not reads_live(session)
    return session.phase not in _SAVING


def save_status(session: Session, ticket: int) -> SaveStatus:
    """What became of the save numbered ``ticket``."""
    if not 0 < ticket <= session.ticket:
        raise ValueError(f"no save numbered {ticket} (saves begun: {session.ticket})")
    if ticket in session.failed:
        return SaveStatus.FAILED
    if ticket == session.ticket and session.phase in _SAVING:
        return SaveStatus.PENDING
    return SaveStatus.PUBLISHED


def may_release(session: Session) -> bool:
    """Whether the directory may be unlocked: no save is in flight, so no thread (the writer's
    least of all) may still write to it."""
    return session.phase not in _SAVING
