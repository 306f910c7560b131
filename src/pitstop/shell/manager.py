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
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from pitstop.core.compat import judge
from pitstop.core.naming import checkpoint_name
from pitstop.core.plan import SavePlan, plan_save
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
from pitstop.core.session import Event, Request
from pitstop.errors import ConfigError, IncompatibleCheckpoint
from pitstop.shell import fileformat
from pitstop.shell.capture import LiveState, capture, deferrable, stored_groups
from pitstop.shell.checkpoint import Checkpoint, manual_reason, metrics_of, stop_detail
from pitstop.shell.directory import CheckpointDirectory
from pitstop.shell.resolve import find_resume
from pitstop.shell.restore import apply, component_differences, differences, load_component
from pitstop.shell.session import Reported, SaveSession, SaveTicket
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
    configuration, stored and compared on resume. The directory is locked until :meth:`close`.
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
        async_save: bool | Literal["overlap"] = False,
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
        self.async_save = async_save
        self.policy = policy if policy is not None else Policy()
        self._live = LiveState(
            model=unwrap_model(model),
            ema=ema,
            components={},
            config=copy.deepcopy(dict(config)) if config is not None else None,
        )
        for name, obj in (state or {}).items():
            self._add_component(name, obj)
        self._resumed_from: Path | None = None
        self._directory = CheckpointDirectory(directory, policy=self.policy)
        self._directory.open()
        self._schedule = ScheduleState(timer_start=time.monotonic())
        self._pointers = self._directory.pointers
        self.last_blocking_s = 0.0
        """Seconds the last save held the training loop (capture, and the copy when async)."""
        self._session = SaveSession(self._directory.path, background=bool(async_save))
        self._pool = StagingPool() if async_save else None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for obj in self._live.optimizers():
            self._hook(obj)
        # A Checkpointer dropped or left open at exit still publishes what is in flight. The
        # finalizer refers to the session, the directory and the hooks — never to self.
        self._finalizer = weakref.finalize(
            self, _shut_down, self._session, self._directory, self._hooks
        )

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

    def wait(self) -> None:
        """Wait until every save is published; raise the error of one that failed."""
        self._enter(Request.WAIT)

    def close(self) -> None:
        """Publish what is in flight, release the directory lock; idempotent.

        Raises the error of a background save that failed, after releasing everything.
        """
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        try:
            reported = self._session.close()
        finally:
            _release(self._directory, self._hooks)
        self._raise(reported)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint file the last :meth:`resume` restored (``None``: started fresh)."""
        return self._resumed_from

    def checkpoints(self) -> list[Checkpoint]:
        """The published checkpoints, oldest (lowest save sequence number) first."""
        self._enter(Request.LIST)
        return [Checkpoint.of(self.directory, e) for e in self._directory.catalog]

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

    def register(self, name: str, obj: Stateful) -> None:
        """Add a component; if the resumed checkpoint holds it, restore it now (deferred).

        A deferred component gets the same checks as one passed to the constructor; on a
        mismatch it raises :class:`~pitstop.errors.IncompatibleCheckpoint` and is not added.
        """
        self._enter(Request.REGISTER)
        live = self._live
        self._add_component(name, obj)
        if name in live.pending:
            stored = live.pending[name]
            found = component_differences(live, name, obj, stored, live.pending_groups)
            try:
                if found:
                    raise IncompatibleCheckpoint(str(d) for d in found)
                load_component(name, obj, stored)
            except IncompatibleCheckpoint:
                del live.components[name]
                raise
            del live.pending[name]
        elif self._resumed_from is not None:
            log.warning("component %r is not in %s; it starts fresh", name, self._resumed_from.name)
        self._hook(obj)

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
        self._enter(Request.SAVE)
        if not isinstance(progress, Progress):
            raise ConfigError(f"progress must be a pitstop.Progress, got {progress!r}")
        values = metrics_of(metrics)
        stopped, stopped_by = stop_detail(stop)
        decision = decide_save(
            self.policy,
            self._schedule,
            self._pointers,
            call=call,
            progress=progress,
            now=time.monotonic(),
            metrics=values,
            stop=stopped,
            manual_reason=manual,
        )
        if not decision.acts:
            return None
        started = time.perf_counter()  # what the caller waits for, the previous save included
        self._enter(Request.WRITE)  # the directory's state must include the save in flight
        directory = self._directory
        plan = plan_save(
            directory.catalog,
            directory.pointers,
            decision,
            progress=progress,
            policy=self.policy,
            metrics=values,
            detail=detail or stopped_by,
        )
        entry: CheckpointEntry | NoCheckpoint = plan.entry
        name = entry.name if entry is not NO_CHECKPOINT else checkpoint_name(progress.step)
        undo = (self._schedule, self._pointers)
        ticket = self._session.begin(progress.step, name, undo)
        try:
            self._carry_out(plan)
        except BaseException:
            self._session.event(Event.ABORTED)
            raise
        self.last_blocking_s = time.perf_counter() - started
        self._schedule, self._pointers = decision.state, plan.pointers
        if entry is NO_CHECKPOINT:
            entry = directory.catalog.get(plan.pointers.last)
        if entry is NO_CHECKPOINT:
            return None
        background = SaveTicket(self._session, ticket) if self._pool is not None else None
        return Checkpoint.of(self.directory, entry, background)

    def _carry_out(self, plan: SavePlan) -> None:
        """Capture now; write now (synchronous) or hand the write to the session's thread."""
        directory, entry, session = self._directory, plan.entry, self._session
        if entry is NO_CHECKPOINT:  # only pointers move
            session.event(Event.CAPTURED)
            if self._pool is None:
                directory.repoint(plan)
                session.event(Event.PUBLISHED)
            else:
                session.hand_over(partial(directory.repoint, plan), None)
            return
        tree, meta = capture(self._live)
        pool = self._pool
        if pool is None:  # synchronous: write straight from the live tensors
            prepared = fileformat.prepare(tree)
            session.event(Event.CAPTURED)
            directory.publish(plan, entry, lambda: prepared, meta)
            session.event(Event.PUBLISHED)
            return
        defer = deferrable(self._live) if self.async_save == "overlap" else frozenset()
        staged, finish_copy = pool.snapshot(tree, defer=defer)

        def copy(guard: bool) -> None:
            finish_copy()
            pool.ready()

        def write() -> None:
            try:
                directory.publish(plan, entry, lambda: fileformat.prepare(staged), meta)
            finally:
                pool.release()

        session.hand_over(write, copy if defer else None)

    # --- restoring ----------------------------------------------------------------------

    def resume(self, source: str | os.PathLike[str] = "last", *, strict: bool = True) -> Progress:
        """Restore the whole state from ``source`` and return its Progress.

        ``source``: ``"last"`` (the most recently published checkpoint that verifies),
        ``"best"``, ``"final"``, or a path. Nothing to resume from ``"last"`` returns
        ``Progress()`` and leaves everything untouched. Raises
        :class:`~pitstop.errors.IncompatibleCheckpoint` listing every difference — or naming
        what failed while loading — with the run exactly as before; ``strict=False`` lets
        missing components and config differences pass with a warning (never shape or dtype
        differences).
        """
        self._enter(Request.RESUME)
        path, entry = find_resume(self._directory, source)
        now = time.monotonic()
        if path is None:
            self._schedule = resumed_state(self._directory.catalog, NO_CHECKPOINT, now=now)
            return Progress()
        manifest = fileformat.read_manifest(path)
        tree: Any = fileformat.load(path, verify=False)  # verified when it was chosen
        found, deferred = differences(self._live, tree, manifest.meta)
        if judge(found, strict=strict):
            raise IncompatibleCheckpoint(f"{path.name}: {d}" for d in found)
        for difference in found:
            log.warning("resume from %s: %s", path.name, difference)
        apply(self._live, tree, path)
        self._live.pending = {name: tree[STATE][name] for name in deferred}
        self._live.pending_groups = stored_groups(manifest.meta)
        if deferred:
            log.info(
                "%s holds %s, not registered yet: register() will restore them",
                path.name,
                ", ".join(sorted(deferred)),
            )
        self._resumed_from = path
        in_directory = (
            entry
            if entry is not NO_CHECKPOINT and self._directory.catalog.get(entry.name) == entry
            else NO_CHECKPOINT
        )
        self._schedule = resumed_state(self._directory.catalog, in_directory, now=now)
        return entry.progress if entry is not NO_CHECKPOINT else Progress()


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
