# Rank 0's saves: planning each one with the core, carrying it out, keeping the outcome.
#
# Rules: what a call does is the core's — whether it saves (decide_save) and what the save does
# to the directory (plan_save). The schedule and the pointers move only once the save has been
# carried out (or, in the background, handed over); a background save that fails later puts
# them back as they were before it (the undo its session ticket holds), raised by the next
# call that waits. The write itself is pitstop.shell.carryout's (synchronous, or handed to the
# writer thread). A Ctrl-C once the save is out of the call's hands — published (the
# directory's carried_out says so, even before the call heard) or handed over (the core's
# after_raise) — is raised with the save counted, never ended as failed.
# Every step is reported to the session as the core's event. Nothing here refers to the
# Checkpointer, so the job a writer thread holds keeps no Checkpointer alive. A sharded save
# (begin_sharded, publish_sharded): rank 0 creates the temp directory, every rank writes its
# shards into it (the Checkpointer drives that collective), then rank 0 captures the
# replicated state with every rank's part and publishes. In the background (capture_sharded,
# handed_over; later publish_handed or fail_handed): rank 0 copies the replicated state
# before DCP's write starts, the schedule and pointers move once its own shards are staged,
# and the publish with every rank's part — or the failure, undone — comes at a later call.
# How: a Saver keeps the schedule, the pointers and the plan between a call's collectives.

"""Saving: plan with the core, capture, then publish (synchronously) or hand over."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import attrs

from pitstop.core.naming import checkpoint_name
from pitstop.core.ranks import CallInput, entry_to_wire
from pitstop.core.records import (
    NO_CHECKPOINT,
    CheckpointEntry,
    NoCheckpoint,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.plan import SavePlan, plan_save
from pitstop.core.saving.schedule import (
    Call,
    SaveDecision,
    ScheduleState,
    decide_save,
    resumed_state,
)
from pitstop.core.session import Event, Request, after_raise, left_by_raise, waits_for_uploads
from pitstop.core.sharding.sharded import ShardedLayout, sharded_meta
from pitstop.errors import SaveError
from pitstop.shell.carryout import carry_out
from pitstop.shell.session import Reported, SaveSession
from pitstop.shell.state.capture import LiveState, capture, with_parts
from pitstop.shell.state.staging import StagingPool
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.publish import PublishedInterrupted
from pitstop.shell.store.tiers import TieredDirectory

__all__ = ["Saver"]


@attrs.frozen(kw_only=True)
class _Handed:
    """A background sharded save between its hand-over and its publish: its plan, the
    schedule it leads to, and the replicated state (copied) its manifest will hold."""

    plan: SavePlan
    entry: CheckpointEntry  # the plan's
    decided: ScheduleState
    tree: dict[str, Any]
    meta: dict[str, Any]


class Saver:
    """One Checkpointer's saves: the schedule and pointers so far, and the save being planned.

    Every rank holds one (each waits on its own session); only rank 0 plans and writes.
    """

    def __init__(
        self,
        *,
        schedule: ScheduleState,
        live: LiveState,
        directory: CheckpointDirectory,
        session: SaveSession,
        pool: StagingPool | None,
        sharded: bool = False,
    ) -> None:
        self.sharded = sharded
        """Each save writes a sharded checkpoint directory (the model holds DTensors)."""
        self.schedule = schedule
        self.pointers = directory.pointers
        self._decided = schedule
        self._planned: SavePlan | None = None
        self._decision: SaveDecision | None = None
        self._handed: _Handed | None = None
        self._live = live
        self._directory = directory
        self._session = session
        self._pool = pool
        self._ticket = 0
        self._temp = ""  # the temp directory of the sharded save begun last (every rank's)

    @property
    def session(self) -> SaveSession:
        """The save session this Saver reports to."""
        return self._session

    @property
    def directory(self) -> CheckpointDirectory:
        """The checkpoint directory this Saver writes."""
        return self._directory

    @property
    def live(self) -> LiveState:
        """The run's live state this Saver captures."""
        return self._live

    def enter(self, request: Request) -> None:
        """Wait as the session says; raise a failed background save's error, undoing it; then
        (a remote tier) wait for its uploads as the core says, and raise one that failed."""
        self.raise_failed(self._session.enter(request))
        self.settle_uploads(block=waits_for_uploads(request))

    def settle_uploads(self, *, block: bool) -> None:
        """A remote tier's uploads: ``block``: wait for them; raise one that failed, once."""
        if isinstance(self._directory, TieredDirectory):
            self._directory.remote.settle(block=block)

    def raise_failed(self, reported: Reported | None) -> None:
        """Raise the error of a failed background save, after putting its undo back (an
        interrupted one's error was raised already: only undone)."""
        if reported is not None:
            self.schedule, self.pointers = reported.undo
            if reported.error is not None:
                raise reported.error

    def decide(
        self,
        policy: Policy,
        call: Call,
        progress: Progress,
        asked: CallInput,
        manual: SaveReason,
    ) -> bool:
        """Rank 0: whether this call saves (or moves pointers); :meth:`plan` then plans it."""
        self.enter(Request.SAVE)
        decision = decide_save(
            policy,
            self.schedule,
            self.pointers,
            call=call,
            progress=progress,
            now=asked.now,
            metrics=asked.metrics,
            stop=asked.stop,
            manual_reason=manual,
        )
        self._decision = decision if decision.acts else None
        return self._decision is not None

    def follow(self, decision: SaveDecision, *planned: Any) -> tuple[Any, ...]:
        """Another directory's writer: :meth:`plan` rank 0's ``decision`` (``planned``: the
        plan's arguments) on this directory, its own catalog and pointers, for :meth:`write`."""
        self.enter(Request.SAVE)
        self._decision = decision
        return self.plan(*planned)

    @property
    def decision(self) -> SaveDecision | None:
        """What the last :meth:`decide` decided (``None``: nothing to do)."""
        return self._decision

    def plan(
        self,
        policy: Policy,
        progress: Progress,
        asked: CallInput,
        detail: str,
        resumed_from: Path | None,
    ) -> tuple[Any, ...]:
        """Rank 0: plan what the call :meth:`decide` decided on does to the directory; the
        record it returns, as sent. The plan itself stays on rank 0 for :meth:`write`."""
        decision = self._decision
        assert decision is not None
        if self._live.pending and resumed_from is not None:
            self._directory.note_carried(self._live.pending, resumed_from.name)
        self.enter(Request.WRITE)  # the directory's state must include the save in flight
        directory = self._directory
        self._decided = decision.state
        plan = self._planned = plan_save(
            directory.catalog,
            directory.pointers,
            decision,
            progress=progress,
            policy=policy,
            metrics=asked.metrics,
            detail=detail or asked.reason,
            sharded=self.sharded,
        )
        entry = plan.entry
        if entry is NO_CHECKPOINT:
            entry = plan.catalog.get(plan.pointers.last)
        return ("write", entry_to_wire(entry))

    def write(
        self, progress: Progress, parts: list[dict[str, Any]] | None, *, overlap: bool
    ) -> int:
        """Rank 0: carry the planned save out; returns the save's ticket."""
        plan = self._planned
        assert plan is not None
        self._directory.check(plan)  # another run's checkpoints: refused before writing
        entry = plan.entry
        name = entry.name if entry is not NO_CHECKPOINT else checkpoint_name(progress.step)
        ticket = self._session.begin(progress.step, name, (self.schedule, self.pointers))
        try:
            carry_out(
                plan,
                live=self._live,
                parts=parts,
                directory=self._directory,
                session=self._session,
                pool=self._pool,
                overlap=overlap,
            )
        except BaseException:
            self._raised(plan)
            raise
        self.schedule, self.pointers = self._decided, plan.pointers
        return ticket

    def _raised(self, plan: SavePlan) -> bool:
        """The call raised while carrying ``plan`` out (a fault, or a Ctrl-C anywhere in it).
        A save still the call's own ends as aborted, unless the directory published it (a
        Ctrl-C in its retention or just after): then it counts, as does one handed to the
        writer thread. Returns whether the save counts."""
        published = self._directory.carried_out(plan)
        event = after_raise(self._session.state, published=published)
        if event is not None:
            self._session.event(event)
        if event is Event.ABORTED:
            return False
        self.schedule, self.pointers = self._decided, plan.pointers
        return True

    def begin_sharded(
        self, progress: Progress, *, copy: bool = False, temp: str | None = None
    ) -> str | None:
        """Rank 0: start the planned sharded save and create the temp directory every rank
        writes its shards into; its name (``None``: the plan writes no checkpoint, only moves
        pointers). ``copy`` (a background save): the replicated state is copied now
        (:meth:`capture_sharded`). ``temp``: another directory's writer makes rank 0's."""
        plan = self._planned
        assert plan is not None
        self._directory.check(plan)  # another run's checkpoints: refused before writing
        entry = plan.entry
        if entry is NO_CHECKPOINT:
            return None
        self._ticket = self._session.begin(
            progress.step, entry.name, (self.schedule, self.pointers)
        )
        if copy:
            self.capture_sharded()
        temp = self._temp = temp or self._directory.sharded_temp(entry)  # this attempt's own
        try:
            (self._directory.path / temp).mkdir()  # it must not exist yet
        except OSError as exc:
            self._handed = None
            self.abort_sharded()
            raise SaveError(f"could not create {self._directory.path / temp}: {exc}") from exc
        return temp

    def _planned_save(self) -> tuple[SavePlan, CheckpointEntry]:
        """The planned save and the checkpoint it writes (it writes one)."""
        plan = self._planned
        assert plan is not None
        assert plan.entry is not NO_CHECKPOINT
        return plan, plan.entry

    def _remove_temp(self) -> None:
        """Remove the temp directory of the sharded save begun last, whatever is left of it."""
        if self._temp:
            shutil.rmtree(self._directory.path / self._temp, True)

    def abandon(self) -> None:
        """Rank 0: the save call raised from a step that did not end its own save (a fault
        between the plan and the write): end it as aborted, its temp directory removed, so
        that no later call, ``close`` included, waits for it."""
        if not left_by_raise(self._session.state):
            return
        self._session.event(Event.ABORTED)
        self._handed = None
        self._remove_temp()  # a file save has none

    def abort_sharded(self) -> None:
        """Rank 0: the shards could not be written (every rank raises the same error)."""
        self._session.event(Event.ABORTED)

    def publish_sharded(
        self,
        layout: ShardedLayout,
        parts: list[dict[str, Any]] | None,
        *,
        fresh: tuple[str, ...] = (),
        homes: Sequence[Sequence[int]] = (),
    ) -> int:
        """Rank 0: every rank's shards are durable in the temp directory: capture the
        replicated state, write the manifest last, publish, then pointers and retention.
        ``fresh``: the optimizers that had no state when the save began; ``homes``: as for
        ``sharded_meta`` (each file lies in its writing rank's directory)."""
        plan, entry = self._planned_save()
        try:
            tree, meta = capture(self._live, parts, sharded=True)
            meta = sharded_meta(meta, fresh, homes)
            self._session.event(Event.CAPTURED)
            self._directory.publish_sharded(plan, entry, layout, tree, meta, temp=self._temp)
        except BaseException:
            if not self._raised(plan):
                self._remove_temp()
            raise
        self._session.event(Event.PUBLISHED)
        self.schedule, self.pointers = self._decided, plan.pointers
        return self._ticket

    # A background sharded save: capture_sharded, (every rank stages), handed_over; later, once
    # every rank's shards are durable, publish_handed with every rank's part — or fail_handed.

    def capture_sharded(self) -> None:
        """Rank 0: copy the replicated state of the planned save now (training goes on while
        the shards are written); an error aborts the save before any shard is written. Every
        rank's own part (RNG, per-rank components) comes with :meth:`publish_handed`."""
        plan, entry = self._planned_save()
        try:
            tree, meta = capture(self._live, [], sharded=True)  # the parts: publish_handed's
            tree = deepcopy(tree)  # small: the model and optimizers go through DCP
        except BaseException:
            self.abort_sharded()
            raise
        self._handed = _Handed(plan=plan, entry=entry, decided=self._decided, tree=tree, meta=meta)

    def handed_over(
        self, *, fresh: tuple[str, ...] = (), homes: Sequence[Sequence[int]] = ()
    ) -> int:
        """Rank 0 (or a directory's writer): its shards are staged and every rank's write is
        on its way: the schedule and the pointers move now (put back if the save fails);
        returns the save's ticket. ``fresh``, ``homes``: as for :meth:`publish_sharded`."""
        handed = self._handed
        assert handed is not None
        self._handed = attrs.evolve(handed, meta=sharded_meta(handed.meta, fresh, homes))
        self._session.event(Event.CAPTURED)
        self.schedule, self.pointers = handed.decided, handed.plan.pointers
        return self._ticket

    @property
    def handing(self) -> bool:
        """Whether a background sharded save is handed over and not yet published or failed."""
        return self._handed is not None

    def abort_handed(self) -> None:
        """Rank 0: DCP's write could not be started (every rank raises the same error)."""
        self._handed = None
        self.abort_sharded()

    def publish_handed(self, layout: ShardedLayout, parts: Sequence[Mapping[str, Any]]) -> None:
        """Rank 0: every rank's shards of the handed-over save are durable, and ``parts`` is
        every rank's own part (RNG, per-rank components, taken when the save was called):
        write the manifest last, publish, then pointers and retention (a failure: see
        :meth:`fail_handed`)."""
        handed = self._handed
        assert handed is not None
        tree, meta = with_parts(handed.tree, handed.meta, parts)
        interrupted: PublishedInterrupted | None = None
        try:
            self._directory.publish_sharded(
                handed.plan, handed.entry, layout, tree, meta, temp=self._temp
            )
        except KeyboardInterrupt as exc:  # a Ctrl-C: once it is published, the save counts
            if not self._directory.carried_out(handed.plan):
                raise
            interrupted = (
                exc if isinstance(exc, PublishedInterrupted) else PublishedInterrupted(*exc.args)
            )
        self._handed = None
        self._session.event(Event.PUBLISHED)
        if interrupted is not None:
            raise interrupted

    def fail_handed(self, error: BaseException) -> None:
        """Rank 0: the handed-over save failed (on any rank): remove its temp directory, put
        the schedule and pointers back and raise the error, as for a failed background save."""
        assert self._handed is not None
        self._handed = None
        self._remove_temp()
        self._session.fail(error)
        self.enter(Request.LIST)  # raises it, named and undone
        raise AssertionError("a failed save reports its error")  # pragma: no cover

    def resumed(self, entry: CheckpointEntry | NoCheckpoint) -> None:
        """Rank 0: the schedule after resuming from ``entry`` (or finding nothing to resume).
        Resuming is continuing: from now on the checkpoints the directory held when it was
        opened are this run's to replace — only once the resume has succeeded."""
        self._directory.adopt()  # a remote tier's checkpoint resumed from is now local too
        self.resuming(entry, adopted=True)()

    def resuming(
        self, entry: CheckpointEntry | NoCheckpoint, *, adopted: bool = False
    ) -> Callable[[], None]:
        """Rank 0: :meth:`resumed` worked out, nothing changed yet; the callable keeps it
        (assignments only) — ``adopted``: the directory adopted it already; else it adopts it
        then, and adopting must leave its catalog as it is (a plain local directory's)."""
        directory, catalog = self._directory, self._directory.catalog
        tiered = isinstance(directory, TieredDirectory)
        pointers = directory.pointers if tiered else self.pointers
        held = entry if entry is not NO_CHECKPOINT and catalog.get(entry.name) == entry else None
        step = entry.step if entry is not NO_CHECKPOINT else 0
        schedule = resumed_state(catalog, held or NO_CHECKPOINT, now=time.monotonic(), step=step)

        def keep() -> None:
            if not adopted:
                directory.adopt()
            self.pointers, self.schedule = pointers, schedule

        return keep
