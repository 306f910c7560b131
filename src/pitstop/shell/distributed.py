# The ranks of a job, as the Checkpointer talks to them.
#
# Rules: pitstop's collectives run on a process group of its own (gloo, so CPU objects travel
# whatever backend the loop uses), created when every rank constructs its Checkpointer, and
# only ever from the loop's thread — never from the background writer, so a collective of
# pitstop can never interleave with the loop's own on one group (KempnerForge #104). Every
# collective has a timeout: a rank that never arrives becomes an error, not a hang. Rank 0 is
# the writer: it holds the directory lock and writes; the others never touch the directory.
# Errors travel as (class name, message) and are rebuilt as the same pitstop error class, so
# every rank raises the same error at the same call.
# Per-rank state trees travel as torch.save bytes (each storage once, so storage sharing
# survives) read back with weights_only=True.
# How: torch.distributed's object collectives (they pickle in memory between this job's own
# processes; nothing read from a checkpoint is ever unpickled).

"""Ranks: rank 0 decides and writes; every rank hears the same answer."""

from __future__ import annotations

import collections
import datetime
import io
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pitstop import errors
from pitstop.core.ranks import OK, Outcome, agree

__all__ = ["Ranks", "outcome_of", "raise_outcome"]

T = TypeVar("T")

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
    """``exc`` as an outcome other ranks can raise."""
    differences = getattr(exc, "differences", None)
    message = "\n".join(differences) if differences else str(exc)
    return Outcome(kind=type(exc).__name__, error=message or type(exc).__name__, rank=rank)


def raise_outcome(outcome: Outcome, *, own: BaseException | None = None) -> None:
    """Raise ``outcome`` (this rank's own exception when it is this rank's)."""
    if outcome.ok:
        return
    if own is not None:
        raise own
    cls = _ERRORS.get(outcome.kind)
    where = f"rank {outcome.rank}: "
    if cls is errors.IncompatibleCheckpoint:
        raise errors.IncompatibleCheckpoint(where + line for line in outcome.error.splitlines())
    if cls is None:
        raise errors.SaveError(f"{where}{outcome.kind}: {outcome.error}")
    raise cls(where + outcome.error)


def _pack(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: Any) -> Any:
    allowed: list[Any] = [set, frozenset, collections.OrderedDict, torch.Size]
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


class Ranks:
    """This process's place in the job, and pitstop's collectives."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group

    @classmethod
    def current(cls, timeout_s: float) -> Ranks:
        """The ranks of the initialised process group (one rank without torch.distributed)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(0, 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), group)

    @property
    def leader(self) -> bool:
        """Whether this rank decides and writes (rank 0)."""
        return self.rank == 0

    @property
    def many(self) -> bool:
        """Whether there is more than one rank."""
        return self.world_size > 1

    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        if not self.many:
            return [value]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value, group=self._group)
        return out

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if not self.many:
            return value
        box: list[Any] = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=self._group)
        return box[0]  # type: ignore[no-any-return]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` on rank 0 (an empty list elsewhere)."""
        if not self.many:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.leader else None
        torch.distributed.gather_object(value, out, dst=0, group=self._group)
        return out or []

    def gather_state(self, value: T) -> list[T]:
        """Every rank's state tree on rank 0 (an empty list elsewhere), storage sharing intact.

        Rank 0 keeps its own tree as it is (references to live tensors); the others travel
        through ``torch.save``, which writes each storage once, so tensors that share storage
        on a rank still share it on rank 0 (and are written once), and are read back with
        ``torch.load(weights_only=True)``, on the CPU.
        """
        if not self.many:
            return [value]
        sent = None if self.leader else _pack(value)
        received = self.gather(sent)
        return [value if r == 0 else _unpack(data) for r, data in enumerate(received)]

    def _attempt(self, work: Callable[[], T]) -> tuple[Any, Outcome, BaseException | None]:
        """``work()``'s result and outcome here (its own exception kept to raise as itself)."""
        try:
            return work(), OK, None
        except Exception as exc:
            return None, outcome_of(exc, self.rank), exc

    def lead(self, work: Callable[[], T]) -> T:
        """Run ``work`` on rank 0 and hand its result, or its error, to every rank."""
        if not self.many:
            return work()
        attempt: tuple[Any, Outcome, BaseException | None] = (None, OK, None)
        if self.leader:
            attempt = self._attempt(work)
        result, outcome, own = attempt
        outcome, result = self.broadcast((outcome, result))
        raise_outcome(outcome, own=own)
        return result  # type: ignore[no-any-return]

    def all_gather_each(self, work: Callable[[], T]) -> list[T]:
        """Run ``work`` on every rank and hand every result to every rank, or the same error."""
        if not self.many:
            return [work()]
        result, outcome, own = self._attempt(work)
        pairs = self.all_gather((outcome, result))
        agreed = agree([o for o, _ in pairs])
        raise_outcome(agreed, own=own if agreed == outcome else None)
        return [r for _, r in pairs]

    def each(self, work: Callable[[], T]) -> T:
        """Run ``work`` on every rank; if it fails anywhere, raise the same error everywhere."""
        if not self.many:
            return work()
        result, outcome, own = self._attempt(work)
        agreed = agree(self.all_gather(outcome))
        raise_outcome(agreed, own=own if agreed == outcome else None)
        return result  # type: ignore[no-any-return]
