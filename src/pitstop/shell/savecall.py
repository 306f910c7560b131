# One save call (maybe_save, save, finish) on every rank: from each rank's inputs to the save
# written, handed over, or none.
#
# Rules: every rank brings its inputs (progress, stop, metrics) to rank 0, which decides with the
# core and plans there (pitstop.shell.saving); then a file save is written by rank 0 with every
# rank's part, and a sharded one by every rank through DCP (pitstop.shell.shardsave). With a
# sharded background save in flight, the same round also tells every rank whether every rank's
# part of it is written, so that it is published first when it is (or when the new save needs the
# directory settled). With no save in flight, a rank that foresees a background sharded save (the
# core's foresees_write: an explicit save, a final save, its own stop, an interval step) copies
# its shards while its inputs travel to rank 0 and rank 0 decides, so that the round's wait
# overlaps the copy; a save rank 0 then does not plan drops the copy. A Ctrl-C during that copy
# ends the round on rank 0 (every rank raises it, nothing planned); on another rank (or during a
# copy made after the round, on any rank) it fails that rank's write of the save, heard by every
# rank at a later call (so no rank waits for it). A call that raises from a step that does not end
# its own save ends it (Saver.abandon: the core's left_by_raise), so that no later call — close()
# included — waits for a save that nobody carries on.
# A maybe_save off the interval first takes the quick round: one all-reduce of three flags (a
# rank stops, a rank's inputs failed, rank 0 would save or failed deciding); all clear — the
# common step — ends the call there, else the full round follows with the inputs already taken.
# Every call given a StopRequest agrees its stop: each rank adopts the merged answer (the core's
# pitstop.core.ranks), and rank 0 says once, at INFO, who asked, why and at which step.
# How: the rounds are pitstop.shell.ranks.distributed.Ranks' (one process: plain calls).

"""A save call on every rank: hear every rank, decide and plan on rank 0, write."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from pitstop.core.ranks import CallInput, DirectoryGroups, merge_inputs, stop_origin
from pitstop.core.ranks.copies import copy_role
from pitstop.core.records import Policy, Progress, SaveReason
from pitstop.core.saving.schedule import Call, foresees_write
from pitstop.shell.checkpoint import call_input
from pitstop.shell.ranks.collectives import GATHER_BOX
from pitstop.shell.ranks.distributed import Ranks, Round
from pitstop.shell.ranks.peers import gather_to_writers
from pitstop.shell.saving import Saver
from pitstop.shell.shardsave import ShardedSaves, Staged
from pitstop.shell.state.capture import LiveState, rank_state
from pitstop.shell.stop import StopRequest
from pitstop.shell.store.tiers import TieredDirectory

__all__ = ["SaveCalls"]

Planned = tuple[tuple[Any, ...], str | None]  # rank 0's plan (on the wire), a temp directory
Agreed = tuple[bool, str, int | None]  # the call's stop: whether, why, which rank asked

log = logging.getLogger("pitstop")


def _quick(call: Call, progress: object, policy: Policy) -> bool:
    """Whether a call may end in the quick round: a ``maybe_save`` that no rank can tell will
    write (off the interval; its progress checked in the full round otherwise)."""
    return (
        call is Call.MAYBE
        and isinstance(progress, Progress)
        and not foresees_write(policy, call, progress.step)
    )


def _agreed(inputs: list[CallInput]) -> Agreed:
    asked = merge_inputs(inputs)
    return asked.stop, asked.reason, stop_origin(inputs)


@attrs.frozen(kw_only=True)
class SaveCalls:
    """The save calls of one Checkpointer: its saver, its ranks, its sharded saves (``None``:
    the state is not sharded) and its live state."""

    saver: Saver
    ranks: Ranks
    shards: ShardedSaves | None
    live: LiveState
    groups: DirectoryGroups | None = None
    """Which ranks share a directory (``None``: one directory for every rank)."""
    told: set[str] = attrs.field(factory=set, init=False)
    """What rank 0 has said once (that the run stops)."""

    def run(
        self,
        call: Call,
        progress: Progress,
        *,
        policy: Policy,
        resumed_from: Path | None,
        overlap: bool,
        metrics: Mapping[str, object] | None,
        stop: object,
        detail: str,
        manual: SaveReason,
    ) -> tuple[Any, int] | None:
        """Every rank: carry out ``call`` at ``progress``; the planned entry (on the wire) and
        the save's ticket, or ``None`` when the policy saves nothing now."""
        ranks, shards, saver = self.ranks, self.shards, self.saver
        ranks.call(f"{call.value} at step {getattr(progress, 'step', '?')}")
        # A sharded save in flight: every rank has one, or none has (each call's rounds
        # start and settle it on every rank).
        done = shards.done() if shards is not None else None
        each: Callable[[], CallInput]
        each = partial(call_input, progress, stop, metrics, call=call.value)
        held: BaseException | None = None  # rank 0's own decision failed in the quick round

        def decide(asked: CallInput) -> bool:
            return saver.decide(policy, call, progress, asked, manual)

        groups = self.groups if self.groups is not None and not self.groups.shared else None

        def plan(asked: CallInput) -> Planned:
            planned = saver.plan(policy, progress, asked, detail, resumed_from)
            if groups is not None:  # the other directories' writers plan the same decision
                planned = (*planned, saver.decision, asked)
            return planned, (shards.begin(progress) if shards is not None else None)

        def decide_and_plan(inputs: list[CallInput]) -> tuple[Planned | None, Agreed]:
            if held is not None:
                raise held
            asked = merge_inputs(inputs)
            return (plan(asked) if decide(asked) else None), _agreed(inputs)

        planned: Planned | None
        staged: Staged | None = None
        interrupt: BaseException | None = None  # a Ctrl-C in this rank's copy: raised last
        try:
            if ranks.many and _quick(call, progress, policy) and (shards is None or done is None):
                quiet, each, held = self._quick(each, decide)
                if quiet:  # nobody stops, rank 0 saves nothing, nothing failed: one round
                    self._agree(stop, (False, "", None), progress, planned=False)
                    return None
            if shards is None or done is None:  # one round trip: rank 0 hears, decides, plans
                round_ = ranks.begin(each, box=GATHER_BOX)
                if shards is not None and self._foresees(call, progress, policy, round_.value):
                    staged, interrupt = _stage_during(shards, round_, ranks.rank)
                planned, agreed = round_.lead(decide_and_plan)
            else:  # every rank hears whether every rank's part of the save in flight is written
                gathered = ranks.all_gather_each(lambda: (each(), done))
                inputs = [inputs for inputs, _ in gathered]
                asked, agreed = merge_inputs(inputs), _agreed(inputs)
                shards.settle(block=False, done=[d for _, d in gathered])  # its error raised
                if shards.done() is None:  # published
                    planned = ranks.lead(lambda: plan(asked) if decide(asked) else None)
                elif ranks.lead(lambda: decide(asked)):  # the plan needs the directory settled
                    shards.settle(block=True)
                    planned = ranks.lead(lambda: plan(asked))
                else:
                    planned = None
            self._agree(stop, agreed, progress, planned=planned is not None)
            if planned is None:
                if interrupt is not None:
                    raise interrupt
                return None
            (_, wire, *decided), temp = planned
            if shards is not None and temp is not None:
                across = None
                if groups is not None:  # each writer follows rank 0 into the same temp name
                    decision, merged = decided
                    begin = partial(
                        self._begin_across, temp, wire, decision, policy, progress, merged, detail
                    )
                    across = (groups, partial(begin, resumed_from))
                ticket = shards.save(temp, staged, across)
            else:
                write = partial(saver.write, progress, overlap=overlap)
                if groups is not None:  # every directory's writer writes its own copy
                    decision, merged = decided  # rank 0's, for the other writers to follow
                    follow = partial(
                        saver.follow, decision, policy, progress, merged, detail, resumed_from
                    )
                    ticket = self._write_copies(groups, write, follow)
                elif ranks.many:  # every rank's part reaches rank 0, which writes them
                    ticket = ranks.gather_state(rank_state(self.live), write)
                else:
                    ticket = write(None)
        except BaseException:
            if ranks.leader or (groups is not None and groups.writes(ranks.rank)):
                saver.abandon()  # a fault that no step of the save caught: nothing waits for it
            raise
        if interrupt is not None:  # this rank's part of the save is handed over, as failed
            raise interrupt
        return wire, ticket

    def _begin_across(self, temp: str, wire: Any, decision: Any, *planned: Any) -> None:
        """Another directory's writer: plan rank 0's sharded save on its own directory and
        make rank 0's temp directory there (rank 0 began it already); a remote tier's upload
        of it goes where rank 0 commits it (``wire``: rank 0's entry, its seq)."""
        if not self.ranks.leader:
            own = self.saver.follow(decision, *planned)[1]
            directory = self.saver.directory
            if isinstance(directory, TieredDirectory) and directory.remote.nodes is not None:
                directory.remote.nodes.follows(own[0].step, own[1], wire[1])
            copy = self.shards is not None and self.shards.copies  # in the background
            self.saver.begin_sharded(planned[1], temp=temp, copy=copy)

    def _write_copies(
        self, groups: DirectoryGroups, write: Callable[[Any], int], follow: Callable[[], object]
    ) -> int:
        """Every rank's part to every directory's writer, which plans rank 0's decision on its
        own directory (``follow``, in that round: its outcome agreed before any copy is
        written) and writes its copy (``write``); the save counts once every copy is published
        (agreed). The roles are the core's (:func:`copy_role`): a background write is held
        until that last round has passed here, when several writers write."""
        role = copy_role(groups, self.ranks.rank)
        first = follow if role.follows else (lambda: None)
        with self.saver.session.holding(role.holds):
            return gather_to_writers(self.ranks, groups, rank_state(self.live), write, first) or 0

    def _quick(
        self, each: Callable[[], CallInput], decide: Callable[[CallInput], bool]
    ) -> tuple[bool, Callable[[], CallInput], BaseException | None]:
        """The quick round of a ``maybe_save`` off the interval: one all-reduce of three bits
        (any rank stops, any rank's inputs failed, rank 0 would save or failed deciding).
        Whether it was quiet (all three clear: the call is over), the inputs for the full
        round otherwise (this rank's, taken once), and rank 0's own failure to raise there."""
        mine: CallInput | None = None
        failed: BaseException | None = None
        try:
            mine = each()
        except (Exception, KeyboardInterrupt) as exc:
            failed = exc
        acts, held = False, None
        if self.ranks.leader and mine is not None and not mine.stop:
            try:
                acts = decide(mine)
            except (Exception, KeyboardInterrupt) as exc:
                held = exc
        stops = mine is not None and mine.stop
        quiet = not any(self.ranks.flags([stops, failed is not None, acts or held is not None]))

        def again() -> CallInput:
            if failed is not None:
                raise failed
            assert mine is not None
            return mine

        return quiet, again, held

    def _agree(self, stop: object, agreed: Agreed, progress: Progress, *, planned: bool) -> None:
        """Every rank adopts the call's agreed stop; rank 0 says once why the run stops."""
        stopping, reason, origin = agreed
        newly = stopping
        if isinstance(stop, StopRequest):
            newly = stop._agreed(stopping, reason, self.ranks.world_size)
        elif stopping:
            newly = "stop" not in self.told
        if not (newly and stopping):
            return
        self.told.add("stop")
        if self.ranks.leader:
            where = f" on rank {origin}" if self.ranks.many and origin is not None else ""
            then = "saving it" if planned else "it is saved already"
            log.info(
                "stop requested%s (%s) at step %d: every rank stops there; %s",
                where,
                reason,
                progress.step,
                then,
            )

    def _foresees(self, call: Call, progress: Progress, policy: Policy, asked: object) -> bool:
        """Whether this rank stages a background sharded save while the ranks agree: it has
        peers to wait for, and foresees the save (the core's ``foresees_write``; ``asked``:
        its own inputs, ``None`` when they failed)."""
        return (
            self.ranks.many
            and isinstance(asked, CallInput)
            and foresees_write(policy, call, progress.step, stop=asked.stop)
        )


def _stage_during(
    shards: ShardedSaves, round_: Round, rank: int
) -> tuple[Staged | None, BaseException | None]:
    """Every rank that foresees a background save: its copy, made while its inputs travel to
    rank 0 and rank 0 decides (the round's wait then overlaps the copy), and the Ctrl-C that
    came during the copy (``None``: none came). On rank 0 the interrupt ends the round before
    anything is planned: every rank raises it. On another rank the save goes on without this
    rank's copy (:meth:`ShardedSaves.stage_or_interrupted`) and the call raises the interrupt
    once the save is handed over."""
    staged, interrupt = shards.stage_or_interrupted()
    if interrupt is not None and rank == 0:
        error = interrupt

        def interrupted(_: object) -> None:
            raise error

        round_.lead(interrupted)  # raises it here (as itself) and on every rank
    return staged, interrupt
