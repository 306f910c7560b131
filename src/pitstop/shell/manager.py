# The Checkpointer: what a training loop calls.
#
# Rules: every decision is the core's — when to save (decide_save), what a save does to the
# directory (plan_save), which checkpoint a resume uses (resume_order), whether a checkpoint
# fits the run (compat), and what each call must wait for (core.session). This class is the
# driver: it checks its arguments, makes every rank take part in each call's collectives, and
# hands the work to the module that does it, each with one reason to change:
#   pitstop.shell.opening       its parts made and wired, the directory locked and read
#   pitstop.shell.savecall      one save call on every rank: hear, decide, plan, write
#   pitstop.shell.saving        rank 0 plans a save with the core and carries it out
#   pitstop.shell.resuming      choose, read, check and restore a checkpoint, all-or-nothing
#   pitstop.shell.registration  components, and the deferred ones (held until register())
#   pitstop.shell.lifetime      the end: close(), or a Checkpointer dropped without it
#   pitstop.shell.shardsave     sharded state: every rank writes its shards through DCP
# How: a synchronous save writes straight from the live tensors before it returns; a
# background one copies them into staging buffers and hands the write to the session's writer
# thread. The directory lock is held from construction to close(); a Checkpointer dropped
# without close() is collected and unlocks its directory (nothing in flight refers to it).
# After close(), every call but close() and checkpoints() raises a PitstopError naming it.

"""The Checkpointer: save and restore a whole training state from a custom loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

from torch import nn

from pitstop.core.compat import may_change_patterns
from pitstop.core.ranks import entry_from_wire
from pitstop.core.records import NO_CHECKPOINT, Policy, Progress, SaveReason
from pitstop.core.saving.schedule import Call
from pitstop.core.session import Request, SaveStatus, settles_first
from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path
from pitstop.errors import PitstopError
from pitstop.shell.checkpoint import Checkpoint, checked_options, manual_reason, records
from pitstop.shell.lifetime import close_run, settle_on_writers
from pitstop.shell.opening import hook_optimizer, open_parts
from pitstop.shell.registration import register_component
from pitstop.shell.resuming import resume_from
from pitstop.shell.session import RemoteTicket, SaveTicket
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import Storage

__all__ = ["Checkpoint", "Checkpointer", "Stateful"]


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
    one info line, and never refuses. ``per_rank``: names of components whose state differs
    per rank (every ``ResumableSampler`` and ``StatefulDataLoader`` is). ``timeout_s``: how
    long a rank waits for the others in pitstop's collectives. ``overwrite``: a run that does
    not :meth:`resume` may replace the checkpoints the directory already holds (by default its
    first save refuses, naming the directory and its newest step, before writing anything).
    ``storage``: what the directory's files are written, renamed, synced and listed through
    (default: the local filesystem at ``directory``); a wrapper may log or inject faults —
    checkpoints are read back from ``directory`` itself. ``directory`` may be
    ``"s3://bucket/prefix"`` (docs/object-storage.md; ``storage_options`` go to its S3
    client). ``remote="s3://..."``: a remote tier — each checkpoint published locally is then
    uploaded in the background, retired there by ``remote_policy`` (default: ``policy``), and a
    resume takes the newest that verifies in either tier. The directory is locked until
    :meth:`close`; every rank makes the same calls, rank 0 writes (each node's first rank,
    where nodes have disks of their own). A sharded model (FSDP2, DTensor) saves each
    checkpoint as a directory written through ``torch.distributed.checkpoint`` and resumes it
    resharded (docs/distributed.md); ``async_save=True`` writes through DCP's async_save, and
    ``"overlap"`` leaves the copy to the next ``optimizer.step()``; its ``ema`` is saved too.
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
        overwrite: bool = False,
        storage: Storage | None = None,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | None = None,
        remote_policy: Policy | None = None,
    ) -> None:
        options = checked_options(
            directory,
            model=model,
            ema=ema,
            state=state,
            storage=storage,
            policy=policy,
            timeout_s=timeout_s,
            async_save=async_save,
            overwrite=overwrite,
            per_rank=per_rank,
        )
        self._config_may_change = may_change_patterns(config_may_change)
        self.async_save = options.async_save
        self.policy = options.policy
        self._resumed_from: Path | None = None
        self._remote: RemoteTicket | None = None
        self.last_blocking_s = 0.0
        """Seconds the last save held the training loop (capture, and the copy when async)."""
        parts = open_parts(
            self,
            directory,
            options,
            model=model,
            ema=ema,
            state=state,
            config=config,
            storage=storage,
            storage_options=storage_options,
            remote=remote,
            remote_policy=remote_policy,
        )
        self._live, self._ranks, self._directory = parts.live, parts.ranks, parts.directory
        self._hooks, self._groups, self._session = parts.hooks, parts.groups, parts.session
        self._saver, self._shards, self._calls = parts.saver, parts.shards, parts.calls
        self._finalizer = parts.finalizer

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

    def _settle(self, request: Request, then: Callable[[], Any] | None = None) -> Any:
        """Rank 0 waits for its save in flight, then runs ``then``; every rank hears both."""
        session = self._session
        self._ranks.call(request.value)
        if self._shards is not None:  # every rank: the sharded save in flight, published
            self._shards.settle(block=settles_first(request))

        def settle() -> SaveStatus | None:
            ticket = session.state.ticket
            try:
                self._saver.enter(request)
            finally:
                status = session.status(ticket) if ticket else None
                self._hear(status)
            return status

        status, after = settle_on_writers(self._ranks, self._groups, settle, then)
        self._hear(status)
        return after

    def _hear(self, status: SaveStatus | None) -> None:
        if self._remote is not None and status is not None and status is not SaveStatus.PENDING:
            self._remote.settle(status)
            self._remote = None

    def _check_open(self, call: str) -> None:
        """Raise a PitstopError naming ``call`` once close() has run (on this rank)."""
        if not self._finalizer.alive:
            raise PitstopError(
                f"{call}(): the Checkpointer of {self.directory} is closed; make a new "
                f"Checkpointer on it (and resume()) to go on"
            )

    def wait(self) -> None:
        """Wait until every save is published; raise the error of one that failed."""
        self._check_open("wait")
        self._settle(Request.WAIT)

    def close(self) -> None:
        """Publish what is in flight, release the directory lock; idempotent.

        Raises the error of a background save that failed, after releasing everything. The lock
        is never released while a writer may still write: a Ctrl-C while close() waits for one
        lets it finish first, then is raised; a second Ctrl-C is raised at once, and the
        directory stays locked until close() is called again (or the process ends).
        """
        if not self._finalizer.alive:
            return
        self._ranks.call("close")
        close_run(
            finalizer=self._finalizer,
            session=self._session,
            directory=self._directory,
            hooks=self._hooks,
            saver=self._saver,
            shards=self._shards,
            ranks=self._ranks,
            groups=self._groups,
        )

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
        self._saver.enter(Request.LIST)
        if self._ranks.leader:
            catalog = self._directory.catalog
        else:
            catalog = scan(self._directory.storage, self.policy.best).catalog
        return records(self._directory, catalog)

    # --- components ---------------------------------------------------------------------

    def _hook(self, obj: object) -> None:
        overlap = self.async_save == "overlap"
        hook_optimizer(obj, self._hooks, self._session, self._shards, overlap=overlap)

    def register(self, name: str, obj: Stateful, *, per_rank: bool = False) -> None:
        """Add a component; if the resumed checkpoint holds it, restore it now (deferred).

        A deferred component gets the same checks as one passed to the constructor; on a
        mismatch it raises :class:`~pitstop.errors.IncompatibleCheckpoint` and is not added.
        ``per_rank``: its state differs per rank. With several ranks, every rank registers.
        """
        self._check_open("register")
        self._settle(Request.REGISTER)
        register_component(
            self._live,
            self._ranks,
            name,
            obj,
            per_rank=per_rank,
            resumed_from=self._resumed_from,
            sharded=self._shards is not None,
        )
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
        self._check_open(call.value)
        started = time.perf_counter()  # what the caller waits for, the previous save included
        carried = self._calls.run(
            call,
            progress,
            policy=self.policy,
            resumed_from=self._resumed_from,
            overlap=self.async_save == "overlap",
            metrics=metrics,
            stop=stop,
            detail=detail,
            manual=manual,
        )
        if carried is None:
            return None
        wire, ticket = carried
        ranks, shards = self._ranks, self._shards
        self.last_blocking_s = time.perf_counter() - started
        entry = entry_from_wire(wire)
        if entry is NO_CHECKPOINT:
            return None
        handle: SaveTicket | RemoteTicket | None = None
        if shards is not None and shards.ticket is not None:
            handle = shards.ticket
        elif bool(self.async_save) and ranks.leader:
            handle = SaveTicket(self._session, ticket)
        elif self.async_save:
            handle = self._remote = RemoteTicket()
        return Checkpoint.of(self.directory, entry, handle)

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
        and every rank restores it, or none does. A ``source`` that is no path (str or
        ``os.PathLike``) is a :class:`~pitstop.errors.ConfigError` naming it.
        """
        self._check_open("resume")
        check_path(
            source, argument="resume source", to=f"{CHECKPOINT_PATH}, or 'last', 'best' or 'final'"
        )
        path, entry = resume_from(
            source,
            settle=partial(self._settle, Request.RESUME),  # its round the resume's first
            strict=strict,
            live=self._live,
            ranks=self._ranks,
            directory=self._directory,
            may_change=self._config_may_change,
            sharded=self._shards is not None,
            groups=self._groups,
            saver=self._saver,  # its schedule after it, on its writers
        )
        if path is not None:
            self._resumed_from = path
        return entry.progress if entry is not NO_CHECKPOINT else Progress()
