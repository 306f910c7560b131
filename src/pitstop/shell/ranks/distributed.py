# The ranks of a job, as the Checkpointer talks to them: the rounds of agreement built on
# pitstop's collectives (pitstop.shell.ranks.collectives).
#
# Rules: pitstop's process group is created when every rank constructs its Checkpointer. Rank 0
# is the writer: it holds the directory lock and writes; the others never touch the directory.
# Errors travel as (class name, message) and are rebuilt as the same pitstop error class, so
# every rank raises the same error at the same call. A gather-then-lead round may be begun
# (this rank's value on its way, the gather running on gloo's threads) and led later by the same
# thread, with no other collective of pitstop's between (Ranks.begin, Round.lead): the caller
# works meanwhile.
# Per-rank state trees travel in pitstop's own tree encoding with each storage's bytes once
# (so storage sharing survives), decoded as a checkpoint's tree is.
# How: each round runs the work on the ranks it names, turns its result or error into an
# outcome (pitstop.shell.ranks.outcomes), agrees on the outcomes (pitstop.core.ranks.agree) in
# one all-gather, gather or broadcast, and raises the agreed error on every rank.

"""Ranks: rank 0 decides and writes; every rank hears the same answer."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pitstop.core.ranks import OK, Outcome, agree
from pitstop.shell.ranks.collectives import GATHER_BOX, PART_BOX, Collectives
from pitstop.shell.ranks.outcomes import outcome_of, raise_outcome, rebuilt
from pitstop.shell.ranks.packing import pack_state, unpack_state

__all__ = ["Ranks", "Round", "outcome_of", "raise_outcome", "rebuilt"]

T = TypeVar("T")


class Ranks(Collectives):
    """This process's place in the job, pitstop's collectives and its rounds of agreement."""

    @classmethod
    def current(cls, timeout_s: float) -> Ranks:
        """The ranks of the initialised process group (one rank without torch.distributed)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(0, 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), group, timeout_s=timeout_s)

    def gather_then_lead(
        self, each: Callable[[], Any], work: Callable[[list[Any]], T], *, box: int = PART_BOX
    ) -> T:
        """Run ``each`` on every rank, hand every result to rank 0 (:meth:`gather`), run
        ``work(results)`` there and hand its result, or the first error, to every rank: two
        collectives, rank 0 the only one that receives every rank's. An error of ``each`` on
        any rank (the lowest such rank's) is raised on every rank instead, and ``work`` does
        not run; a rank raises its own exception as itself."""
        return self.begin(each, box=box).lead(work)

    def begin(self, each: Callable[[], Any], *, box: int = PART_BOX) -> Round:
        """:meth:`gather_then_lead` begun: ``each`` runs here and its result is on its way to
        rank 0, without waiting for it; this rank may do other work before the round's
        :meth:`Round.lead` (which every rank calls next, before any other collective)."""
        return Round(self, each, box)

    def gather_state(self, value: object, work: Callable[[list[Any]], T]) -> T:
        """:meth:`gather_then_lead` of every rank's state tree: ``work(trees)`` on rank 0
        with every rank's tree, storage sharing intact; a tree that cannot be packed raises
        the same SaveError on every rank (its own, naming its key path, on its rank).

        Rank 0 keeps its own tree as it is (references to live tensors); the others travel
        packed (:func:`pack_state`: each storage once, so tensors that share storage on a rank
        still share it on rank 0, and are written once) and arrive on the CPU.
        """

        def trees(packed: list[Any]) -> T:
            return work([value, *(unpack_state(other) for other in packed[1:])])

        return self.gather_then_lead(lambda: None if self.leader else pack_state(value), trees)

    def _attempt(self, work: Callable[[], T]) -> tuple[Any, Outcome, BaseException | None]:
        """``work()``'s result and outcome here (its own exception kept to raise as itself).
        A Ctrl-C in ``work`` is an outcome too: the round still runs, so that the other ranks
        hear of it (and raise it) instead of waiting for this rank until the timeout."""
        try:
            return work(), OK, None
        except (Exception, KeyboardInterrupt) as exc:
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

    def all_gather_each(self, work: Callable[[], T], *, box: int = GATHER_BOX) -> list[T]:
        """Run ``work`` on every rank and hand every result to every rank, or the same error
        (``box``: as for :meth:`all_gather`)."""
        if not self.many:
            return [work()]
        result, outcome, own = self._attempt(work)
        pairs = self.all_gather((outcome, result), box=box)
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


class Round:
    """A :meth:`Ranks.gather_then_lead` that :meth:`Ranks.begin` began: this rank's ``each()``
    ran and its result is on its way to rank 0; :meth:`lead` ends the round."""

    def __init__(self, ranks: Ranks, each: Callable[[], Any], box: int) -> None:
        self._ranks = ranks
        self.value, self._outcome, self._own = ranks._attempt(each)
        """This rank's ``each()`` (``None`` when it raised: the round raises it at the end)."""
        self._sent = ranks._send((self._outcome, self.value), box) if ranks.many else None

    def lead(self, work: Callable[[list[Any]], T]) -> T:
        """Rank 0 runs ``work`` on every rank's result; its result, or the first error, is
        raised or returned on every rank (as :meth:`Ranks.gather_then_lead` does)."""
        ranks, sent = self._ranks, self._sent
        if sent is None:  # one rank
            if self._own is not None:
                raise self._own
            return work([self.value])
        gathered = ranks._gathered(sent)
        answer: tuple[Outcome, Any] = (OK, None)
        outcome, own = self._outcome, self._own
        if ranks.leader:
            agreed = agree([o for o, _ in gathered])
            if agreed.ok:
                value, outcome, own = ranks._attempt(lambda: work([r for _, r in gathered]))
                answer = (outcome, value)
            else:
                answer = (agreed, None)
        agreed, value = ranks.broadcast(answer)
        raise_outcome(agreed, own=own if agreed == outcome else None)
        return value  # type: ignore[no-any-return]
