# The public record of one checkpoint, and the Checkpointer's argument checks.
#
# Rules: a Checkpoint is a frozen record of a catalog entry — path, progress, reason, detail,
# sequence number, metrics; pitstop.info() also fills in what only the manifest says (the
# config, the file's size, the tensor table), each with a default, so a record made from a
# catalog entry alone leaves them empty. One returned by a background save carries a ticket to
# its save session, so it can say whether it is published yet and wait for it; equality ignores
# it; the record knows the ticket only by what it asks of it (status, wait), never the session.
# Metrics are floats (numbers, one-element tensors, NumPy scalars; never str or bool): a tensor
# is read here, the rules are pitstop.core.settings.arguments.call_metrics', and a bad one names
# the call and the step. A save's reason is a SaveReason (by value) or the caller's own words,
# recorded as a manual save's detail. A run's config must be a mapping every save can store: it is
# walked once at construction by the same walk every save's meta goes through
# (pitstop.shell.format.treewalk), so a value no checkpoint can hold is refused then, by key path,
# not at the first save.
# How: attrs records and small functions; errors are ConfigError naming the argument.

"""Checkpoint: one checkpoint as the Checkpointer reports it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from pitstop.core.ranks import CallInput
from pitstop.core.records import Catalog, CheckpointEntry, Metrics, Progress, SaveReason
from pitstop.core.session import SaveStatus
from pitstop.core.settings.arguments import (
    CheckpointerOptions,
    call_metrics,
    check_path,
    describe_value,
)
from pitstop.errors import ConfigError, SaveError
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.tiers import TieredDirectory

__all__ = [
    "Checkpoint",
    "TensorInfo",
    "call_input",
    "checked_options",
    "config_of",
    "manual_reason",
    "metrics_of",
    "records",
    "stop_detail",
]


class Ticket(Protocol):
    """A background save's link to its session (pitstop.shell.session's SaveTicket, or a
    RemoteTicket on the ranks that hear rank 0): whether it is published yet, or wait for it."""

    def status(self) -> SaveStatus: ...

    def wait(self) -> SaveStatus: ...


@attrs.frozen(kw_only=True)
class TensorInfo:
    """One stored tensor as the manifest describes it: its key path, dtype and shape.

    ``name`` is the key path in the stored tree (``weights.raw.fc.weight``); ``nbytes`` the
    bytes its elements take. A tensor stored under several names (tied weights) has a record
    per name.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen(kw_only=True)
class Checkpoint:
    """One checkpoint: published, or (from a background save) on its way.

    ``reason``: why it was written; ``detail``: the caller's words (``save(reason="eval")``)
    or the signal behind a stop. A record returned by a background save says whether it is
    published yet (:attr:`published`, :meth:`wait`).
    """

    path: Path
    progress: Progress
    reason: SaveReason
    seq: int
    metrics: Metrics = attrs.field(hash=False)
    detail: str = ""
    config: Mapping[str, object] | None = attrs.field(default=None, hash=False)
    """The run's config as stored (from :func:`pitstop.info`; ``None``: none, or not read)."""
    size_bytes: int | None = None
    """The file's size (from :func:`pitstop.info`)."""
    tensors: tuple[TensorInfo, ...] = attrs.field(default=(), repr=False)
    """The tensor table, in file order (from :func:`pitstop.info`)."""
    ticket: Ticket | None = attrs.field(default=None, eq=False, hash=False, repr=False)
    tiers: tuple[str, ...] = attrs.field(default=("local",), eq=False, hash=False)
    """Which tiers hold it: ``("local",)``, ``("local", "remote")`` once a remote tier holds
    it too, ``("remote",)`` when only the remote tier does (its local copy retired)."""

    @property
    def step(self) -> int:
        """The optimizer step the checkpoint holds."""
        return self.progress.step

    @property
    def status(self) -> SaveStatus:
        """``PENDING`` while a background save is being written, then published or failed."""
        return SaveStatus.PUBLISHED if self.ticket is None else self.ticket.status()

    @property
    def published(self) -> bool:
        """Whether the checkpoint is durable and pointed to."""
        return self.status is SaveStatus.PUBLISHED

    def wait(self) -> bool:
        """Wait until the save is published (True) or has failed (False).

        A failure's error is raised by the Checkpointer's next call, whatever it is.
        """
        status = SaveStatus.PUBLISHED if self.ticket is None else self.ticket.wait()
        return status is SaveStatus.PUBLISHED

    @classmethod
    def of(
        cls,
        directory: Path,
        entry: CheckpointEntry,
        ticket: Ticket | None = None,
        *,
        tiers: tuple[str, ...] = ("local",),
        path: Path | None = None,
    ) -> Checkpoint:
        """The public record of the catalog ``entry`` in ``directory`` (or at ``path``)."""
        return cls(
            path=path or directory / entry.name,
            tiers=tiers,
            progress=entry.progress,
            reason=entry.reason,
            seq=entry.seq,
            metrics=entry.metrics,
            detail=entry.detail,
            ticket=ticket,
        )


def checked_options(
    directory: object,
    *,
    model: object,
    ema: object,
    state: object,
    storage: object,
    policy: Any,
    timeout_s: Any,
    async_save: Any,
    overwrite: Any,
    per_rank: object,
) -> CheckpointerOptions:
    """Check the Checkpointer's arguments, before anything is touched; its plain settings.

    Raises :class:`~pitstop.errors.ConfigError` naming the first argument that is not what it
    must be (the settings' own checks are
    :class:`~pitstop.core.settings.arguments.CheckpointerOptions`')."""
    from torch import nn  # imported by then: the caller holds a model

    from pitstop.shell.store.storage import Storage

    check_path(directory, argument="Checkpointer.directory")
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"Checkpointer.model must be an nn.Module (the model itself, not its "
            f"state_dict()), got {type(model).__name__}"
        )
    if ema is not None and not isinstance(ema, nn.Module):
        raise ConfigError(f"Checkpointer.ema must be an nn.Module, got {type(ema).__name__}")
    if state is not None and not isinstance(state, Mapping):
        raise ConfigError(
            f"Checkpointer.state must be a mapping of names to components (objects with "
            f"state_dict() and load_state_dict()), such as {{'optimizer': optimizer}}, got "
            f"{describe_value(state)}"
        )
    if storage is not None and not isinstance(storage, Storage):
        raise ConfigError(
            f"Checkpointer.storage must implement pitstop.shell.store.storage.Storage (or be "
            f"None: the local filesystem), got {describe_value(storage)}"
        )
    return CheckpointerOptions(
        policy=policy,
        timeout_s=timeout_s,
        async_save=async_save,
        overwrite=overwrite,
        per_rank=per_rank,
    )


def config_of(config: object) -> dict[str, Any] | None:
    """``Checkpointer(config=...)`` as the copy every save stores (``None``: no config).

    Raises :class:`~pitstop.errors.ConfigError` unless it is a mapping a checkpoint can hold,
    naming the key path of the first value it cannot (``Checkpointer.config: config.run.out:
    cannot store a value of type pathlib.PosixPath ...``).
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"Checkpointer.config must be a mapping of the run's settings (such as "
            f"{{'lr': 0.1}}) or None, got {describe_value(config)}"
        )
    from pitstop.shell.format.treewalk import walk  # torch: only once a Checkpointer is made

    try:  # a copy of every container; no NumPy values (the config is compared on resume)
        stored = walk(dict(config), on_tensor=None, root="config", numpy=False)
    except SaveError as exc:
        raise ConfigError(f"Checkpointer.config cannot be stored in a checkpoint: {exc}") from exc
    assert isinstance(stored, dict)
    return stored


def metrics_of(metrics: object, *, call: str = "save", step: int = 0) -> dict[str, float] | None:
    """Metrics as floats: numbers, one-element tensors and NumPy scalars; never str or bool.

    A tensor is read here (``.item()``, detached); the core's :func:`call_metrics` judges the
    rest and raises :class:`~pitstop.errors.ConfigError` naming ``call``, ``step`` and the
    metric.
    """
    if isinstance(metrics, Mapping):
        metrics = {key: _plain_number(value) for key, value in metrics.items()}
    return call_metrics(metrics, call=call, step=step)


def _plain_number(value: object) -> object:
    """A one-element tensor's value (detached: no autograd warning); anything else as it is."""
    import torch  # imported by then: a Checkpointer made the call

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().item()
    return value


def call_input(progress: object, stop: object, metrics: object, *, call: str = "save") -> CallInput:
    """What this rank brings to a save ``call``: its stop request, metrics and clock."""
    if not isinstance(progress, Progress):
        raise ConfigError(f"progress must be a pitstop.Progress, got {progress!r}")
    stopped, stopped_by = stop_detail(stop)
    return CallInput(
        stop=stopped,
        reason=stopped_by,
        metrics=metrics_of(metrics, call=call, step=progress.step),
        now=time.monotonic(),
    )


def stop_detail(stop: object) -> tuple[bool, str]:
    """Whether ``stop`` asks to stop, and why: a StopRequest's own offer (what this rank heard,
    agreed or not: the call's round agrees it), else its truth and ``reason``."""
    from pitstop.shell.stop import StopRequest  # imported by then: a Checkpointer made the call

    if isinstance(stop, StopRequest):
        stopped, offered = stop._offer()
        return stopped, offered if stopped else ""
    if stop is None or not stop:
        return False, ""
    reason = getattr(stop, "reason", None)
    return True, str(reason) if reason else "requested"


def manual_reason(reason: object) -> tuple[SaveReason, str]:
    """``save(reason=...)``: a SaveReason by value, or any other words kept as the detail."""
    if isinstance(reason, SaveReason):
        return reason, ""
    if not isinstance(reason, str) or not reason:
        raise ConfigError(f"save(reason=...) must be a non-empty str, got {reason!r}")
    try:
        return SaveReason(reason), ""
    except ValueError:
        return SaveReason.MANUAL, reason


def records(directory: CheckpointDirectory, catalog: Catalog) -> list[Checkpoint]:
    """The public records of ``catalog`` (``directory``'s checkpoints), oldest first; with a
    remote tier, each says which tiers hold it, and those only the remote tier holds (as far as
    this process knows: once it uploaded or resumed) are listed too."""
    if not isinstance(directory, TieredDirectory):
        return [Checkpoint.of(directory.path, e) for e in catalog]
    remote = directory.remote
    local = [
        (e, Checkpoint.of(directory.path, e, tiers=remote.tiers(e.name, e.seq))) for e in catalog
    ]
    held = {(e.name, e.seq) for e in catalog}
    only = [
        (e, Checkpoint.of(directory.path, e, tiers=("remote",), path=remote.objects.path(e.name)))
        for e in remote.directory.catalog
        if (e.name, e.seq) not in held
    ]
    return [c for _, c in sorted(local + only, key=lambda pair: (pair[0].seq, pair[0].step))]
