# A rank's outcome as the other ranks raise it.
#
# Rules: an error travels as (class name, message, rank) and is rebuilt as the same pitstop
# error class (any other as a SaveError naming it), its message prefixed with the rank it came
# from; a Ctrl-C (any KeyboardInterrupt) travels as an interrupt and is raised as one. A rank
# raises its own exception as itself.
# How: pitstop.core.ranks' Outcome records; a table of the classes that can be rebuilt.

"""Outcomes between ranks: an error on one rank, raised as the same error on every rank."""

from __future__ import annotations

from pitstop import errors
from pitstop.core.ranks import INTERRUPTED, Outcome

__all__ = ["outcome_of", "raise_outcome", "rebuilt"]

_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.PitstopError,
        errors.CheckpointCorrupt,
        errors.CheckpointNotFound,
        errors.ConfigError,
        errors.DirectoryLocked,
        errors.IncompatibleCheckpoint,
        errors.SaveError,
    )
}


def outcome_of(exc: BaseException, rank: int) -> Outcome:
    """``exc`` as an outcome other ranks can raise (any ``KeyboardInterrupt`` as one)."""
    if isinstance(exc, KeyboardInterrupt):
        return Outcome(kind=INTERRUPTED, error=str(exc) or "interrupted (Ctrl-C)", rank=rank)
    differences = getattr(exc, "differences", None)
    message = "\n".join(differences) if differences else str(exc)
    return Outcome(kind=type(exc).__name__, error=message or type(exc).__name__, rank=rank)


def rebuilt(outcome: Outcome) -> errors.PitstopError | KeyboardInterrupt:
    """A failed ``outcome`` as the error another rank raises: the same pitstop class (any
    other as a SaveError naming it), its message prefixed with the rank it came from; an
    interrupt as a ``KeyboardInterrupt`` naming the rank it came from."""
    cls = _ERRORS.get(outcome.kind)
    where = f"rank {outcome.rank}: "
    if outcome.interrupted:
        return KeyboardInterrupt(f"{where}{outcome.error}")
    if cls is errors.IncompatibleCheckpoint:
        return errors.IncompatibleCheckpoint(where + line for line in outcome.error.splitlines())
    if cls is None:
        return errors.SaveError(f"{where}{outcome.kind}: {outcome.error}")
    return cls(where + outcome.error)


def raise_outcome(outcome: Outcome, *, own: BaseException | None = None) -> None:
    """Raise ``outcome`` (this rank's own exception when it is this rank's)."""
    if outcome.ok:
        return
    raise own if own is not None else rebuilt(outcome)
