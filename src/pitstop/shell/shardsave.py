# What a Checkpointer does differently when its state is sharded (FSDP2, DTensor).
#
# Rules: a run's state is sharded when the model or an optimizer holds DTensors — decided once,
# when the Checkpointer is built; then every save is a checkpoint directory written through
# torch.distributed.checkpoint. DCP is imported only when the state is sharded (its import costs
# a tenth of a second or more, and torch's optimizers import DTensor's module in every run).
# An EMA is saved through DCP with the model (pitstop.shell.sharded.dcpstate). A sharded save is a
# collective: rank 0 plans it and creates the temp directory (its name goes with the plan),
# every rank writes its shards there, and only then does rank 0 write the manifest last and
# publish; every rank's own part (RNG, per-rank components) reaches rank 0 with the round that
# ends the write (in the background: taken at the call, sent with the round that ends DCP's
# write). A failure while writing shards is raised on every rank and leaves no temp directory;
# one after DCP's background write started is raised only once every rank's DCP write has ended
# (its collectives never meet the next's). In the background (async_save=True): rank 0 copies the
# replicated state, every rank stages its shards (with one kept stager; during the call's round when
# it foresees the save, pitstop.shell.savecall) and takes its part (packed off the call when it is
# RNG streams alone), and returns; a thread then runs the round that agrees every rank staged (on
# DCP's gloo group) and starts DCP's async_save once that round says every rank staged — else no
# rank starts it, and a rank's staging or part that failed is its write's failure, heard by every
# rank as below. With async_save="overlap" the parameters and optimizer state are staged after the
# call (pitstop.shell.sharded.shardstage): by that thread, or by the next optimizer.step()'s
# pre-hook, whichever comes first. The schedule and pointers move at the call. DCP's completion is a
# collective, so it is finished on the loop's thread, by a later call on every rank: each call asks
# every rank whether its part is done and, when all are, publishes; a call that must see the save
# settled (a save that writes, wait, finish, resume, close) waits for it. A failure is raised there
# on every rank, as rank 0's SaveError naming the step, with the schedule and pointers put back. A
# Checkpointer dropped without close() cannot run a collective: its save in flight is not published
# (its temp directory is removed when the directory is next opened). In directories the ranks
# do not share, each directory's writer follows rank 0's plan into the same temp name on its own
# disk (in the background: copying its replicated state, as rank 0 does), every rank writes its
# shards into its node's, and each writer gets rank 0's layout and every rank's part and
# publishes its own copy (the outcome agreed; in the background at the call that settles it:
# pitstop.shell.sharded.handover). On
# object storage (s3://) every rank stages its files in a local folder of its own and uploads
# them in DCP's write step (pitstop.shell.store.shardobjects: in the background, on DCP's thread),
# and rank 0 commits once the write ended on every rank; each other rank's staging folder goes
# once its write has ended.
# How: ShardedSaves, one per Checkpointer on every rank; the Checkpointer calls it.

"""The sharded (FSDP2, DTensor) variant of a Checkpointer's construction and saves."""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pitstop.core.ranks import DirectoryGroups
from pitstop.core.records import Progress
from pitstop.core.schema import RANKED
from pitstop.core.session import Phase, SaveStatus
from pitstop.errors import SaveError
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.packing import Packed, pack_state, unpack_state
from pitstop.shell.saving import Saver
from pitstop.shell.session import RemoteTicket
from pitstop.shell.sharded.handover import fail_written, publish_written, writes_copy
from pitstop.shell.sharded.support import is_sharded
from pitstop.shell.state.capture import LiveState, rank_state, sharded_components
from pitstop.shell.state.freshopt import FreshOptimizers
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.publish import PublishedInterrupted
from pitstop.shell.store.shardobjects import upload_shards

if TYPE_CHECKING:
    from pitstop.shell.sharded.shardstage import DeferredCopy, StagedShards

__all__ = ["Across", "ShardedSaves", "Staged", "holds_sharded"]

Across = tuple[DirectoryGroups, Callable[[], object]]
"""Directories the ranks do not share: which ranks share each, and what begins a save on a
writer (rank 0's decision followed on its own directory and rank 0's temp directory made)."""


def holds_sharded(live: LiveState) -> bool:
    """Whether the model or an optimizer holds sharded state (FSDP2, DTensor): then every
    save is a checkpoint directory written through DCP (with the EMA, if any)."""
    return is_sharded(live.model, live.components)


@attrs.frozen
class Staged:
    """A background save's copy, made by :meth:`ShardedSaves.stage`: this rank's shards in the
    stager's buffers (or the error that stopped the copy), its own part (to pack and send to
    rank 0 with its files; ``None`` after an error), and the optimizers given fresh state."""

    shards: StagedShards | Exception
    part: Callable[[], Packed] | None
    fresh: tuple[str, ...]


class ShardedSaves:
    """Every rank: a sharded run's saves, and the background one in flight (at most one)."""

    @classmethod
    def of(
        cls, saver: Saver, ranks: Ranks, *, background: bool | str, timeout_s: float
    ) -> ShardedSaves | None:
        """Every rank, at construction: the sharded saves of ``saver``'s run (``None``: its
        state is not sharded); ``background`` (``async_save``): through DCP's async_save,
        and with ``"overlap"`` the parameters and optimizer state copied after the call."""
        if not saver.sharded:
            return None
        saves = cls(saver, ranks, timeout_s=timeout_s)
        if background:
            saves.background(overlap=background == "overlap")
        return saves

    def __init__(self, saver: Saver, ranks: Ranks, *, timeout_s: float) -> None:
        self._directory, self._live = saver.directory.path, saver.live
        self._saver, self._ranks = saver, ranks
        self._timeout_s = timeout_s
        self._group: Any = None
        self._stager: Any = None
        self._pending: Any = None  # the PendingShardedWrite in flight
        self._overlap = False
        self._later: DeferredCopy | None = None  # its copy left for later (overlap mode)
        self._staging: Path | None = None  # this rank's staging folder (s3://, not rank 0)
        self._homes: DirectoryGroups | None = None  # directories the ranks do not share
        self.ticket: RemoteTicket | None = None
        """The record of the save in flight (every rank hears its outcome from a call)."""

    def background(self, *, overlap: bool = False) -> None:
        """Every rank, at construction: saves go through DCP's async_save (``overlap``: the
        parameters and optimizer state are copied after the call, before the next
        ``optimizer.step()``). DCP runs its collectives on its own thread, so they get a gloo
        group of their own."""
        from pitstop.shell.sharded.shardstage import make_stager

        self._overlap = overlap

        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            timeout = datetime.timedelta(seconds=self._timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._stager = make_stager(self._live.model)

    @property
    def copies(self) -> bool:
        """Whether saves are made in the background (a writer copies its replicated state
        when it begins one)."""
        return self._stager is not None

    def begin(self, progress: Progress) -> str | None:
        """Rank 0, right after the plan (in the same round): start the planned save; the temp
        directory, made, that every rank writes its shards into (``None``: the plan writes no
        checkpoint, only pointers move: the Saver does that as for a file)."""
        return self._saver.begin_sharded(progress, copy=self._stager is not None)

    def stage(self) -> Staged | None:
        """Every rank, a background save: copy this rank's shards to the stager's host buffers
        and take its own part, now — before the plan, when this rank foresees the save
        (pitstop.shell.savecall): :meth:`save` then starts the write from them. ``None``:
        saves are synchronous. A failure to stage is kept, to be this rank's write failure
        (raised by every rank at a settle); a KeyboardInterrupt is raised."""
        from pitstop.shell.sharded.shardstage import stage_sharded

        if self._stager is None:
            return None
        # DCP gives an optimizer without state zeroed state to save; it is taken away again
        # once staged, and the manifest names it (pitstop.shell.state.freshopt).
        with FreshOptimizers(sharded_components(self._live)) as fresh:
            try:
                staged = stage_sharded(
                    self._live.model,
                    sharded_components(self._live),
                    self._stager,
                    self._timeout_s,
                    ema=self._live.ema,
                    defer=self._overlap,
                )
                return Staged(staged, self._part_later(), fresh.names)
            except Exception as exc:  # this rank's write failure, heard by every rank later
                return Staged(exc, None, fresh.names)

    def save(self, temp: str, staged: Staged | None = None, across: Across | None = None) -> int:
        """Every rank writes its shards of the save :meth:`begin` started into ``temp``; then
        (synchronous) rank 0 publishes it, or (background) DCP goes on writing — from
        ``staged`` (:meth:`stage`, called before the plan), else from a copy made now (a
        Ctrl-C during it: see :meth:`stage_or_interrupted`). Every rank's own part (RNG,
        per-rank components) reaches rank 0 with the round that ends the write (synchronous)
        or, taken with the copy, with the one that ends DCP's write (background). The save's
        ticket (on rank 0). ``across``: directories the ranks do not share: each writer begins
        the save in its own and publishes it there."""
        if across is not None:
            groups, begin = across
            self._homes = groups
        if self._stager is None:
            # As in stage(): an optimizer without state is given zeroed state for DCP, and
            # it is taken away again once its shards are written.
            with FreshOptimizers(sharded_components(self._live)) as fresh:
                if across is not None:
                    self._ranks.each(lambda: begin() if self._writes() else None)
                return self._write(temp, fresh.names, across)
        if across is not None:  # every writer begins it before any rank's write starts
            self._ranks.each(lambda: begin() if self._writes() else None)
        interrupt = None
        if staged is None:
            try:
                staged = self.stage()
            except KeyboardInterrupt as exc:  # as stage_or_interrupted's
                staged, interrupt = self._interrupted(exc), exc
            except BaseException:  # a fault nothing here foresees: raised by this call alone
                self._abort(self._directory / temp)
                raise
        assert staged is not None
        ticket = self._start(temp, staged)
        if interrupt is not None:  # this rank's write is handed over, as failed
            raise interrupt
        return ticket

    def stage_or_interrupted(self) -> tuple[Staged | None, BaseException | None]:
        """:meth:`stage` during the round that plans the save, and the Ctrl-C (or any fault
        the copy itself does not keep) that came during it (``None``: none came). Then the
        copy is this rank's write failure — raised by every rank at a later call, so that no
        rank waits for this one's write until the timeout — and the caller raises the
        interrupt once the save is handed over (or, on rank 0, ends the round with it)."""
        try:
            return self.stage(), None
        except BaseException as exc:  # a fault nothing here foresees, too: as an interrupt
            return self._interrupted(exc), exc

    def _interrupted(self, exc: BaseException) -> Staged:
        """The copy ``exc`` interrupted, as this rank's write failure."""
        failed = SaveError(
            f"rank {self._ranks.rank}: the copy of this rank's shards was interrupted ({exc!r})"
        )
        return Staged(failed, None, ())

    def step_hook(self, *_: object) -> None:
        """Optimizer step pre-hook (overlap mode): the parameters and optimizer state of the
        save in flight are copied before the step changes them — here, unless pitstop's thread
        began the copy (then the step waits for it). A failed copy is raised by a later call."""
        later = self._later
        if later is not None:
            later.run()
            self._later = None

    def release(self) -> None:
        """This rank, at close(), the save in flight settled: the stager's host buffers and
        its staging thread go (a later save would make a new stager)."""
        if self._stager is not None:
            self._stager.close()

    def done(self) -> bool | None:
        """This rank's part of the save in flight is written (``None``: none in flight)."""
        return None if self._pending is None else bool(self._pending.done())

    def _part(self) -> Packed:
        """This rank's own part of the save, packed (rank 0 unpacks a copy of each)."""
        return pack_state(rank_state(self._live))

    def _part_later(self) -> Callable[[], Packed]:
        """This rank's own part of a background save, taken now; it is packed now too — or,
        when it holds nothing but RNG streams (copies nothing changes: a tuple of ints, new
        tensors), in DCP's write, off the call (packing them costs more than taking them). A
        per-rank component's state may be its live tensors, so it is packed now."""
        part = rank_state(self._live)
        if part[RANKED]:
            packed = pack_state(part)
            return lambda: packed
        return partial(pack_state, part)

    def _write(self, temp: str, fresh: tuple[str, ...], across: Across | None = None) -> int:
        from pitstop.shell.sharded.shardwrite import write_shards

        saver, ranks = self._saver, self._ranks
        root, model = self._directory / temp, self._live.model
        remote = self._remote()
        try:
            if remote is not None and not ranks.leader:  # this rank's own staging folder
                root.mkdir(parents=True, exist_ok=True)
            written = write_shards(
                root,
                model,
                sharded_components(self._live),
                ranks=ranks,
                created=True,
                gather=self._part,
                ema=self._live.ema,
                ship=None if remote is None else partial(upload_shards, remote),
            )
        except BaseException:  # raised on every rank: the temp directory is gone
            if ranks.leader:
                saver.abort_sharded()
            raise
        finally:
            if remote is not None and not ranks.leader:  # uploaded, or failed on every rank
                shutil.rmtree(root, ignore_errors=True)
        if across is not None:  # rank 0's layout and every rank's part to every writer
            groups = across[0]
            layout, riders = ranks.lead(lambda: (written.layout(ranks.world_size), written.riders))

            def publish_here() -> int:
                if not groups.writes(ranks.rank):
                    return 0
                parts = [unpack_state(packed) for packed in riders]
                return saver.publish_sharded(layout, parts, fresh=fresh, homes=groups.groups)

            return ranks.each(publish_here)  # counted once every writer published its copy

        def publish() -> int:
            parts = [unpack_state(packed) for packed in written.riders]
            return saver.publish_sharded(written.layout(ranks.world_size), parts, fresh=fresh)

        ticket: int = ranks.lead(publish)
        return ticket

    def _start(self, temp: str, ready: Staged) -> int:
        from pitstop.shell.sharded.shardwrite import start_once_agreed

        saver, ranks = self._saver, self._ranks
        root = self._directory / temp
        staged = ready.shards
        remote = self._remote()
        if remote is not None and not ranks.leader:  # this rank's own staging folder
            root.mkdir(parents=True, exist_ok=True)
            self._staging = root
        if not isinstance(staged, Exception):
            self._later = staged.later
        # No round here: the one that agrees every rank staged runs on pitstop's thread after
        # the call returns (after the deferred copy, in overlap mode), and DCP starts once it
        # has (no rank starts it when any could not stage).
        try:
            self._pending = start_once_agreed(
                root,
                staged,
                ranks=ranks,
                group=self._group,
                timeout=self._timeout_s,
                rider=ready.part,
                ship=None if remote is None else partial(upload_shards, remote),
            )
        except BaseException:  # a fault nothing here foresees: the others fail at the timeout
            self._later = None
            self._abort(root)
            raise
        self.ticket = RemoteTicket(sharded=True)
        if not self._writes():
            return 0
        homes = self._homes.groups if self._homes is not None else ()
        return saver.handed_over(fresh=ready.fresh, homes=homes)

    def _drop_staging(self) -> None:
        """Remove this rank's staging folder of the background save (s3://, not rank 0)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)

    def _remote(self) -> ObjectStorage | None:
        """The object storage this run's checkpoints go to (``None``: a local directory)."""
        storage = self._saver.directory.storage
        return storage if isinstance(storage, ObjectStorage) else None

    def _abort(self, root: Path) -> None:
        """This rank raises out of a background save's call: rank 0's session ends it (so that
        nothing waits for it) and its temp directory ``root`` goes (each directory's writer's)."""
        if self._writes():
            self._saver.abort_handed()
            shutil.rmtree(root, ignore_errors=True)

    def settle(self, *, block: bool, done: Sequence[bool | None] | None = None) -> None:
        """Every rank: publish the save in flight once every rank's shards are durable —
        waiting for them (``block``), or only if they already are (``done``: every rank's
        :meth:`done`, gathered already; else they are gathered here). Raises its failure."""
        pending = self._pending
        if pending is None:
            return
        if done is None and not block:
            done = self._ranks.all_gather(self.done())
        if not block and not all(done or ()):
            return
        self._pending = None
        ticket, self.ticket = self.ticket, None
        saver, ranks = self._saver, self._ranks
        staging = self._staging
        try:
            try:
                written = pending.written(self._timeout_s)  # every rank, or the same error
            except Exception:
                self._drop_staging()  # failed on every rank: nothing writes there any more
                raise
            self._drop_staging()  # uploaded on every rank
            publish_written(ranks, saver, written, self._homes)
        except Exception as exc:
            if ticket is not None:
                ticket.settle(SaveStatus.FAILED)
            fail_written(ranks, saver, exc, self._homes)  # a SaveError, on every rank
            raise  # fail_handed raised already; this keeps the type checker sure
        except PublishedInterrupted:  # published: a Ctrl-C came after (in its retention)
            if ticket is not None:
                ticket.settle(SaveStatus.PUBLISHED)
            raise
        except BaseException:  # KeyboardInterrupt while waiting: a later call finishes it
            self._pending, self.ticket, self._staging = pending, ticket, staging
            raise
        if ticket is not None:
            ticket.settle(SaveStatus.PUBLISHED)

    def _writes(self) -> bool:
        """Whether this rank publishes a copy: rank 0, or each directory's writer."""
        return writes_copy(self._ranks, self._homes)

    def abandon(self) -> None:
        """A Checkpointer dropped without close(): the save in flight is not published (no
        collective can run now). Rank 0's session records the failure, so closing it does not
        wait; the temp directory is removed when the directory is next opened."""
        if self._pending is None:
            return
        self._pending = None
        session = self._saver.session
        if self._writes() and session.state.phase is Phase.WRITING:
            session.fail(
                SaveError(
                    "the Checkpointer was dropped without close() while this sharded save "
                    "was in flight; it is not published"
                )
            )
