# The Checkpointer: what a training loop calls.
#
# Rules: every decision is the core's — when to save (decide_save), what a save does to the
# directory (plan_save), which checkpoint a resume uses (resume_order), whether a checkpoint
# fits the run (compat), and what each call must wait for (core.session). This class is the
# driver: it asks, then captures (shell.capture), writes through a locked CheckpointDirectory,
# or restores all-or-nothing (shell.restore). A component the checkpoint holds but the run has
# not registered yet is kept and applied when register() names it (deferred components).
# How: a synchronous save writes straight from the live tensors before it returns; a
# background one copies them into staging buffers and hands the write to the session's writer
# thread. The directory lock is held from construction to close(); a Checkpointer dropped
# without close() is collected and unlocks its directory (nothing in flight refers to it).

"""The Checkpointer: save and restore a whole training state from a custom loop."""

from __future__ import annotations

import copy
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from pitstop.core.compat import Difference, judge, may_change_patterns
from pitstop.core.naming import checkpoint_name
from pitstop.core.plan import SavePlan, plan_save
from pitstop.core.ranks import CallInput, entry_from_wire, entry_to_wire, merge_inputs
from pitstop.core.records import (
    NO_CHECKPOINT,
    CheckpointEntry,
    NoCheckpoint,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.schedule import Call, ScheduleState, decide_save, resumed_state
from pitstop.core.schema import STATE
from pitstop.core.session import Event, Request, SaveStatus
from pitstop.errors import ConfigError, IncompatibleCheckpoint
from pitstop.shell import fileformat
from pitstop.shell.capture import (
    LiveState,
    rank_state,
    ranked_state,
    stored_groups,
    stored_world_size,
)
from pitstop.shell.checkpoint import Checkpoint, manual_reason, metrics_of, stop_detail
from pitstop.shell.directory import CheckpointDirectory, scan
from pitstop.shell.distributed import Ranks
from pitstop.shell.resolve import find_resume
from pitstop.shell.restore import (
    Restore,
    component_differences,
    component_undo,
    differences,
    load_component,
)
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.saving import carry_out
from pitstop.shell.session import RemoteTicket, Reported, SaveSession, SaveTicket
from pitstop.shell.staging import StagingPool
from pitstop.shell.weights import unwrap_model

__all__ = ["Checkpoint", "Checkpointer", "Stateful"]

log = logging.getLogger("pitstop")


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: optimizers, schedulers, ..."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class Checkpointer:
    """Saves and restores a run's whole state into one checkpoint directory.

    ``model``: the raw ``nn.Module`` (DDP and ``torch.compile`` wrappers are unwrapped).
    ``ema``: a module of averaged weights (e.g. ``AveragedModel``). ``state``: other components
    by name (optimizer, scheduler, GradScaler, sampler, ...). ``config``: the run's
    configuration, stored and compared on resume; ``config_may_change``: key paths and glob
    patterns (``["max_iters", "out_dir", "run.*"]``) whose changes a resume only reports, in
    one info line, and never refuses. ``per_rank``: names of components whose
    state differs per rank (every ``ResumableSampler`` is). ``timeout_s``: how long a rank
    waits for the others in pitstop's collectives. The directory is locked until
    :meth:`close`; with several ranks, every rank makes the same calls and rank 0 writes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        ema: nn.Module | None = None,
        state: Mapping[str, Stateful] | None = None,
        policy: Policy | None = None,
        config: Mapping[str, Any] | None = None,
        config_may_change: Iterable[str] = (),
        async_save: bool | Literal["overlap"] = False,
        per_rank: Iterable[str] = (),
        timeout_s: float = 600.0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"Checkpointer model must be an nn.Module, got {type(model).__name__}"
            )
        if ema is not None and not isinstance(ema, nn.Module):
            raise ConfigError(f"Checkpointer ema must be an nn.Module, got {type(ema).__name__}")
        if not (isinstance(async_save, bool) or async_save == "overlap"):
            raise ConfigError(
                f"Checkpointer async_save must be False, True or 'overlap', got {async_save!r}"
            )
        names = [per_rank] if isinstance(per_rank, str) else list(per_rank)
        if not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"Checkpointer per_rank must be component names, got {per_rank!r}")
        self._config_may_change = may_change_patterns(config_may_change)
        self.async_save = async_save
        self.policy = policy if policy is not None else Policy()
        self._live = LiveState(
            model=unwrap_model(model),
            ema=ema,
            components={},
            config=copy.deepcopy(dict(config)) if config is not None else None,
            per_rank=set(names),
        )
        for name, obj in (state or {}).items():
            self._add_component(name, obj)
        self._resumed_from: Path | None = None
        self._ranks = Ranks.current(timeout_s)
        self._directory = CheckpointDirectory(directory, policy=self.policy)
        self._ranks.lead(self._open)  # only rank 0 locks and reads the directory
        self._schedule = ScheduleState(timer_start=time.monotonic())
        self._pointers = self._directory.pointers
        self.last_blocking_s = 0.0
        """Seconds the last save held the training loop (capture, and the copy when async)."""
        background = bool(async_save) and self._ranks.leader
        self._session = SaveSession(self._directory.path, background=background)
        self._pool = StagingPool() if background else None
        self._remote: RemoteTicket | None = None
        self._decided = self._schedule
        self._planned: SavePlan | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for obj in self._live.optimizers():
            self._hook(obj)
        # A Checkpointer dropped or left open at exit still publishes what is in flight. The
        # finalizer refers to the session, the directory and the hooks — never to self.
        self._finalizer = weakref.finalize(
            self, _shut_down, self._session, self._directory, self._hooks
        )

    def _open(self) -> None:
        self._directory.open()

    @property
    def model(self) -> nn.Module:
        """The (unwrapped) model."""
        return self._live.model

    @property
    def ema(self) -> nn.Module | None:
        """The EMA module, if any."""
        return self._live.ema

    @property
    def config(self) -> dict[str, Any] | None:
        """The run's configuration as stored with each checkpoint."""
        return self._live.config

    @property
    def rank(self) -> int:
        """This process's rank (0 writes)."""
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks share this Checkpointer's calls."""
        return self._ranks.world_size

    # --- lifetime -----------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory.path

    def _enter(self, request: Request) -> None:
        """Wait as the session says; raise a failed background save's error, undoing it."""
        self._raise(self._session.enter(request))

    def _raise(self, reported: Reported | None) -> None:
        if reported is not None:
            self._schedule, self._pointers = reported.undo
            raise reported.error

    def _settle(self, request: Request) -> None:
        """Rank 0 waits for its save in flight; every rank learns how it ended."""
        session = self._session

        def settle() -> SaveStatus | None:
            ticket = session.state.ticket
            try:
                self._enter(request)
            finally:
                status = session.status(ticket) if ticket else None
                self._hear(status)
            return status

        self._hear(self._ranks.lead(settle))

    def _hear(self, status: SaveStatus | None) -> None:
        if self._remote is not None and status is not None and status is not SaveStatus.PENDING:
            self._remote.settle(status)
            self._remote = None

    def wait(self) -> None:
        """Wait until every save is published; raise the error of one that failed."""
        self._settle(Request.WAIT)

    def close(self) -> None:
        """Publish what is in flight, release the directory lock; idempotent.

        Raises the error of a background save that failed, after releasing everything.
        """
        if not self._finalizer.alive:
            return
        self._finalizer.detach()

        def close() -> None:
            try:
                reported = self._session.close()
            finally:
                _release(self._directory, self._hooks)
            self._raise(reported)

        try:
            self._ranks.lead(close)
        finally:
            for hook in self._hooks:  # other ranks' hooks
                hook.remove()
            self._hooks.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint file the last :meth:`resume` restored (``None``: started fresh)."""
        return self._resumed_from

    def checkpoints(self) -> list[Checkpoint]:
        """The published checkpoints, oldest (lowest save sequence number) first.

        Not a collective: any rank may call it alone (ranks other than 0 scan the directory).
        """
        self._enter(Request.LIST)
        if self._ranks.leader:
            catalog = self._directory.catalog
        else:
            catalog = scan(self._directory.storage, self.policy.best).catalog
        return [Checkpoint.of(self.directory, e) for e in catalog]

    # --- components ---------------------------------------------------------------------

    def _add_component(self, name: str, obj: object) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"component names must be non-empty str, got {name!r}")
        if name in self._live.components:
            raise ConfigError(f"component {name!r} is already registered")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"component {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
            )
        self._live.components[name] = obj

    def _hook(self, obj: object) -> None:
        if self.async_save == "overlap" and isinstance(obj, torch.optim.Optimizer):
            self._hooks.append(obj.register_step_pre_hook(self._session.step_hook))

    def register(self, name: str, obj: Stateful, *, per_rank: bool = False) -> None:
        """Add a component; if the resumed checkpoint holds it, restore it now (deferred).

        A deferred component gets the same checks as one passed to the constructor; on a
        mismatch it raises :class:`~pitstop.errors.IncompatibleCheckpoint` and is not added.
        ``per_rank``: its state differs per rank. With several ranks, every rank registers.
        """
        self._settle(Request.REGISTER)
        live = self._live
        try:
            self._ranks.each(partial(self._add_component, name, obj))
        except BaseException:
            if live.components.get(name) is obj:  # added here, refused on another rank
                del live.components[name]
            raise
        if per_rank:
            live.per_rank.add(name)
        undo: list[Callable[[], object]] = []
        try:
            self._ranks.each(partial(self._restore_deferred, name, obj, undo))
        except BaseException:
            for action in undo:  # loaded here, failed on another rank
                action()
            del live.components[name]
            live.per_rank.discard(name)
            raise
        live.pending.pop(name, None)
        live.pending_per_rank.discard(name)
        self._hook(obj)

    def _restore_deferred(self, name: str, obj: Stateful, undo: list[Callable[[], object]]) -> None:
        live = self._live
        if name in live.pending:
            stored = live.pending[name]
            found = component_differences(live, name, obj, stored, live.pending_groups)
            if found:
                raise IncompatibleCheckpoint(str(d) for d in found)
            undo.append(component_undo(obj))
            load_component(name, obj, stored)
        elif self._resumed_from is not None:
            log.warning("component %r is not in %s; it starts fresh", name, self._resumed_from.name)

    # --- saving -------------------------------------------------------------------------

    def maybe_save(
        self,
        progress: Progress,
        *,
        metrics: Mapping[str, object] | None = None,
        stop: object = None,
    ) -> Checkpoint | None:
        """Save if the policy says so at ``progress`` (interval, time, best, stop)."""
        return self._save(Call.MAYBE, progress, metrics=metrics, stop=stop)

    def save(
        self,
        progress: Progress,
        *,
        reason: str | SaveReason = "manual",
        metrics: Mapping[str, object] | None = None,
    ) -> Checkpoint:
        """Save now, whatever the policy says.

        ``reason``: a :class:`~pitstop.SaveReason` or its value (``"stop"``, ``"final"`` —
        which also moves ``final`` — ...) is recorded as that reason; any other words are
        recorded as a ``manual`` save with them as its detail.
        """
        manual, detail = manual_reason(reason)
        saved = self._save(Call.MANUAL, progress, metrics=metrics, detail=detail, manual=manual)
        assert saved is not None  # a manual save always writes
        return saved

    def finish(
        self,
        progress: Progress,
        *,
        stop: object = None,
        metrics: Mapping[str, object] | None = None,
    ) -> Checkpoint | None:
        """End the run: save ``last`` with the stop reason, or ``final`` at a normal end."""
        saved = self._save(Call.FINISH, progress, metrics=metrics, stop=stop)
        self.wait()
        return saved

    def _save(
        self,
        call: Call,
        progress: Progress,
        *,
        metrics: Mapping[str, object] | None,
        stop: object = None,
        detail: str = "",
        manual: SaveReason = SaveReason.MANUAL,
    ) -> Checkpoint | None:
        started = time.perf_counter()  # what the caller waits for, the previous save included
        ranks = self._ranks

        def local_input() -> CallInput:
            if not isinstance(progress, Progress):
                raise ConfigError(f"progress must be a pitstop.Progress, got {progress!r}")
            stopped, stopped_by = stop_detail(stop)
            return CallInput(
                stop=stopped, reason=stopped_by, metrics=metrics_of(metrics), now=time.monotonic()
            )

        asked = merge_inputs(ranks.all_gather_each(local_input))
        planned = ranks.lead(partial(self._plan, call, progress, asked, detail, manual))
        if planned is None:
            return None
        parts = ranks.gather_state(rank_state(self._live)) if ranks.many else None
        ticket = ranks.lead(partial(self._write, progress, parts))
        self.last_blocking_s = time.perf_counter() - started
        entry = entry_from_wire(planned[1])
        if entry is NO_CHECKPOINT:
            return None
        handle: SaveTicket | RemoteTicket | None = None
        if bool(self.async_save) and ranks.leader:
            handle = SaveTicket(self._session, ticket)
        elif self.async_save:
            handle = self._remote = RemoteTicket()
        return Checkpoint.of(self.directory, entry, handle)

    def _plan(
        self,
        call: Call,
        progress: Progress,
        asked: CallInput,
        detail: str,
        manual: SaveReason,
    ) -> tuple[Any, ...] | None:
        """Rank 0: plan what this call does to the directory; the record it returns, as sent.

        ``None``: the call does nothing. The plan itself stays on rank 0 for :meth:`_write`.
        """
        self._enter(Request.SAVE)
        decision = decide_save(
            self.policy,
            self._schedule,
            self._pointers,
            call=call,
            progress=progress,
            now=asked.now,
            metrics=asked.metrics,
            stop=asked.stop,
            manual_reason=manual,
        )
        if not decision.acts:
            return None
        if self._live.pending and self._resumed_from is not None:
            self._directory.note_carried(self._live.pending, self._resumed_from.name)
        self._enter(Request.WRITE)  # the directory's state must include the save in flight
        directory = self._directory
        self._decided = decision.state
        plan = self._planned = plan_save(
            directory.catalog,
            directory.pointers,
            decision,
            progress=progress,
            policy=self.policy,
            metrics=asked.metrics,
            detail=detail or asked.reason,
        )
        entry = plan.entry
        if entry is NO_CHECKPOINT:
            entry = plan.catalog.get(plan.pointers.last)
        return ("write", entry_to_wire(entry))

    def _write(self, progress: Progress, parts: list[dict[str, Any]] | None) -> int:
        """Rank 0: carry the planned save out; returns the save's ticket."""
        plan = self._planned
        assert plan is not None
        entry = plan.entry
        name = entry.name if entry is not NO_CHECKPOINT else checkpoint_name(progress.step)
        ticket = self._session.begin(progress.step, name, (self._schedule, self._pointers))
        try:
            carry_out(
                plan,
                live=self._live,
                parts=parts,
                directory=self._directory,
                session=self._session,
                pool=self._pool,
                overlap=self.async_save == "overlap",
            )
        except BaseException:
            self._session.event(Event.ABORTED)
            raise
        self._schedule, self._pointers = self._decided, plan.pointers
        return ticket

    # --- restoring ----------------------------------------------------------------------

    def resume(self, source: str | os.PathLike[str] = "last", *, strict: bool = True) -> Progress:
        """Restore the whole state from ``source`` and return its Progress.

        ``source``: ``"last"`` (the most recently published checkpoint that verifies),
        ``"best"``, ``"final"``, or a path. Nothing to resume from ``"last"`` returns
        ``Progress()`` and leaves everything untouched. Raises
        :class:`~pitstop.errors.IncompatibleCheckpoint` listing every difference — or naming
        what failed while loading — with the run exactly as before; ``strict=False`` lets
        missing components, config differences and another world size pass with a warning
        (never shape or dtype differences). With several ranks, rank 0 chooses the checkpoint
        and every rank restores it, or none does.
        """
        ranks = self._ranks
        self._settle(Request.RESUME)
        reading = ResumeRead(self._live, ranks.rank)  # checks as it reads: the disk read once
        path, wire = ranks.lead(partial(_find_portable, self._directory, source, reading.verify))
        entry = entry_from_wire(wire)
        if path is None:
            ranks.lead(partial(self._resumed, NO_CHECKPOINT))
            return Progress()
        loaded = ranks.each(partial(self._load, path, reading))
        tree, meta, found, deferred = loaded
        found = _union(ranks.all_gather(found))
        if judge(found, strict=strict):
            raise IncompatibleCheckpoint(f"{path.name}: {d}" for d in found)
        for difference in found:
            log.warning("resume from %s: %s", path.name, difference)
        same_world = stored_world_size(meta) == ranks.world_size
        restore = Restore(self._live, tree, path, rank=ranks.rank, per_rank=same_world)
        try:
            ranks.each(restore.prepare)
        except BaseException:
            restore.undo()  # another rank failed: put this one back too
            raise
        restore.commit()
        live = self._live
        ranked = ranked_state(tree, ranks.rank) if same_world else {}
        live.pending = {n: ranked[n] if n in ranked else tree[STATE][n] for n in deferred}
        live.pending_per_rank = {n for n in deferred if n in ranked}
        live.pending_groups = stored_groups(meta)
        if deferred:
            log.info(
                "%s holds %s, not registered yet: register() will restore them",
                path.name,
                ", ".join(sorted(deferred)),
            )
        self._resumed_from = path
        ranks.lead(partial(self._resumed, entry))
        return entry.progress if entry is not NO_CHECKPOINT else Progress()

    def _load(
        self, path: Path, reading: ResumeRead
    ) -> tuple[Any, Mapping[str, Any], list[Difference], frozenset[str]]:
        """Every rank: read ``path`` and compare it with this rank's run."""
        manifest = fileformat.read_manifest(path)
        tree: Any = reading.load(path)  # rank 0 verified it as it loaded it, choosing it
        found, deferred = differences(
            self._live,
            tree,
            manifest.meta,
            rank=self._ranks.rank,
            world_size=self._ranks.world_size,
            may_change=self._config_may_change,
            where=path.name,
        )
        return tree, manifest.meta, found, deferred

    def _resumed(self, entry: CheckpointEntry | NoCheckpoint) -> None:
        """Rank 0: the schedule after resuming from ``entry``."""
        catalog = self._directory.catalog
        in_directory = (
            entry if entry is not NO_CHECKPOINT and catalog.get(entry.name) == entry else None
        )
        self._schedule = resumed_state(catalog, in_directory or NO_CHECKPOINT, now=time.monotonic())


def _find_portable(
    directory: CheckpointDirectory,
    source: str | os.PathLike[str],
    verify: Callable[[Path], None],
) -> tuple[Path | None, tuple[Any, ...] | None]:
    """Rank 0's resume choice, as it travels to the other ranks."""
    path, entry = find_resume(directory, source, verify=verify)
    return path, entry_to_wire(entry)


def _union(per_rank: list[list[Difference]]) -> list[Difference]:
    """Every rank's differences, each once, in rank order."""
    seen: dict[str, Difference] = {}
    for found in per_rank:
        for difference in found:
            seen.setdefault(str(difference), difference)
    return list(seen.values())


def _release(
    directory: CheckpointDirectory, hooks: list[torch.utils.hooks.RemovableHandle]
) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()
    directory.close()


def _shut_down(
    session: SaveSession,
    directory: CheckpointDirectory,
    hooks: list[torch.utils.hooks.RemovableHandle],
) -> None:
    """Finish a Checkpointer nobody closed (garbage collection or interpreter exit)."""
    try:
        reported = session.close()
        if reported is not None:
            log.error(
                "a background save failed and nobody was left to raise it: %s", reported.error
            )
    except Exception as exc:
        log.error("closing a dropped Checkpointer failed: %s", exc)
    finally:
        _release(directory, hooks)
