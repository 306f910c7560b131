# Sharded state (FSDP2, DTensor) through torch.distributed.checkpoint (DCP), published like a
# file.
#
# Rules: every rank makes the same calls. A save: rank 0 creates the temp directory (exclusive;
# the outcome is agreed), every rank writes its shards through DCP's FileSystemWriter, whose
# streams CRC-32 each file as DCP writes it and fsync it (pitstop.shell.dcpwrite), so the table
# of the files it wrote itself — rank 0's include `.metadata` — needs no re-read; the tables are
# gathered; rank 0 builds the layout (pitstop.core.sharded), writes the manifest last
# (publish_file: temp name, fsync, rename, directory fsync — which makes the names of every
# rank's files durable too), renames the temp directory into place and fsyncs the parent.
# A load: the layout comes from the manifest (DCP's pickled `.metadata` is never read: see
# pitstop.shell.dcpio), the live state is compared with it (IncompatibleCheckpoint listing every
# difference), each rank verifies the files DCP's own local read plan names for it, the outcome
# is agreed, and only then does DCP read, resharding to this world size. DCP's collectives run
# on `group` (async: on DCP's upload thread, so then `group` must be a process group of its
# own); pitstop's agreement runs on `ranks`, from the calling thread only.
# How: DCP does the tensor I/O and the resharding; pitstop.shell.sharddir the files around it.

"""Sharded checkpoints: write, publish, verify and read DCP directories; gather for export."""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from pitstop.core.sharded import LiveValue, ShardedLayout, ShardFile, files_for, layout_differences
from pitstop.errors import ConfigError, IncompatibleCheckpoint, SaveError
from pitstop.shell.dcpio import (
    DCP_METADATA,
    NO_DIST_WARNING,
    SafePlanner,
    Writer,
    layout_of,
    load_checked,
    metadata_of,
)
from pitstop.shell.distributed import Ranks
from pitstop.shell.sharddir import (
    delete_sharded,
    file_table,
    publish_sharded,
    read_layout,
    verify_sharded,
    write_manifest,
)
from pitstop.shell.shardsave import is_sharded
from pitstop.shell.treewalk import TENSOR_DTYPES, dtype_name

__all__ = [
    "MODEL",
    "PendingShardedWrite",
    "WrittenShards",
    "async_write_sharded",
    "delete_sharded",
    "files_to_verify",
    "full_state_dict",
    "is_sharded",
    "make_stager",
    "publish_sharded",
    "read_layout",
    "read_sharded",
    "sharded_differences",
    "verify_sharded",
    "write_manifest",
    "write_sharded",
    "write_shards",
]

MODEL = "model"
"""The top-level key the model's state is saved under (optimizers go under their own names)."""

Optimizers = Mapping[str, torch.optim.Optimizer]


def _state(model: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    """What DCP saves or fills: the model's state under ``model``, each optimizer's under its
    name (keyed by parameter names, as ``get_optimizer_state_dict`` makes them)."""
    for name in optimizers:
        if name == MODEL or not name or "." in name:
            raise ConfigError(f"sharded component {name!r}: a name without '.', not {MODEL!r}")
    state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
    for name, optimizer in optimizers.items():
        state[name] = get_optimizer_state_dict(model, optimizer)
    return state


# --- writing ----------------------------------------------------------------------------------


def _fresh(directory: Path, ranks: Ranks, *, created: bool) -> Writer:
    """Rank 0 creates ``directory`` (it must not exist yet; every rank hears the outcome),
    unless it was ``created`` already (by rank 0, before every rank heard its name)."""

    def create() -> None:
        try:
            directory.mkdir()
        except OSError as exc:
            raise SaveError(f"could not create {directory}: {exc}") from exc

    if not created:
        ranks.lead(create)
    return Writer(directory)


@contextlib.contextmanager
def _removed_on_error(directory: Path, ranks: Ranks) -> Iterator[None]:
    """Rank 0 removes the temp ``directory`` of a save that failed (on every rank, by then)."""
    try:
        yield
    except Exception:
        if ranks.leader:
            shutil.rmtree(directory, ignore_errors=True)
        raise


def _table(directory: Path, writer: Writer, ranks: Ranks) -> tuple[ShardFile, ...]:
    names = writer.written + ((DCP_METADATA,) if ranks.leader else ())
    return file_table(directory, names, ranks.rank, writer.checksums())


@attrs.frozen
class WrittenShards:
    """Every rank's shards of a save, durable in its temp directory; what rank 0 publishes."""

    metadata: Metadata | None
    """DCP's metadata (rank 0's; ``None`` on the other ranks)."""
    tables: tuple[tuple[ShardFile, ...], ...]
    """Every rank's files, in rank order."""
    riders: tuple[Any, ...] = ()
    """What each rank sent along (``gather``), in rank order."""

    def layout(self, world_size: int) -> ShardedLayout:
        """Rank 0: the checkpoint's layout, from DCP's metadata and every rank's files."""
        assert self.metadata is not None  # rank 0's
        return layout_of(self.metadata, [f for t in self.tables for f in t], world_size)


def _agreed(written: WrittenShards, ranks: Ranks) -> ShardedLayout:
    """Rank 0 builds the layout; every rank gets it."""
    return ranks.lead(partial(written.layout, ranks.world_size))


def write_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
) -> ShardedLayout:
    """Every rank: save the model's and ``optimizers``' state into the new ``directory``.

    Each rank writes its shards through DCP (on ``group``; ``None``: the default group), each
    file checksummed as written and fsynced; every rank returns the same layout. Nothing is
    published yet (:func:`write_manifest`, :func:`publish_sharded`). Raises
    :class:`~pitstop.errors.SaveError` on every rank when any rank fails.
    """
    return _agreed(write_shards(directory, model, optimizers, ranks=ranks, group=group), ranks)


def write_shards(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
    created: bool = False,
    gather: Callable[[], Any] | None = None,
) -> WrittenShards:
    """Every rank: :func:`write_sharded`, without the round that hands rank 0's layout to
    every rank (rank 0 builds it from the result, :meth:`WrittenShards.layout`, with what it
    publishes). ``created``: rank 0 made ``directory`` already. ``gather()``: run on every
    rank once its shards are durable, its result gathered with the files (one round)."""
    root = Path(directory)
    writer = _fresh(root, ranks, created=created)
    with _removed_on_error(root, ranks):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
                state = _state(model, optimizers)
                metadata = save(state, storage_writer=writer, process_group=group)
        except CheckpointException as exc:  # a BaseException, raised on every rank
            raise SaveError(f"could not write the shards of {root}: {exc}") from exc

        def table() -> tuple[tuple[ShardFile, ...], Any]:
            return _table(root, writer, ranks), (gather() if gather is not None else None)

        gathered = ranks.all_gather_each(table)
        return WrittenShards(
            metadata=metadata if ranks.leader else None,
            tables=tuple(t for t, _ in gathered),
            riders=tuple(r for _, r in gathered) if gather is not None else (),
        )


def make_stager() -> DefaultStager:
    """A stager for :func:`async_write_sharded`, to keep and reuse (it caches its host buffers):
    pinned memory and a background copy with CUDA, a blocking copy on the CPU (DCP's own
    FileSystemWriter stager, ``cache_staged_state_dict=True``, cannot pin memory there)."""
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=cuda,
        use_non_blocking_copy=cuda,
    )
    return DefaultStager(options)


class PendingShardedWrite:
    """A save :func:`async_write_sharded` started. DCP writes on its upload thread (each file
    checksummed as written, then fsynced), and there this rank's table is made. :meth:`result`
    gathers (after a ``timeout`` there, DCP may still be writing: do not reuse the directory)."""

    def __init__(self, directory: Path, writer: Writer, ranks: Ranks, response: Any) -> None:
        self._directory, self._writer, self._ranks = directory, writer, ranks
        self._staging: Future[Any] | None = getattr(response, "staging_completion", None)
        upload: Future[Any] = getattr(response, "upload_completion", response)
        self._done: Future[tuple[Metadata, tuple[ShardFile, ...]]] = Future()
        upload.add_done_callback(self._checksum)

    def _checksum(self, upload: Future[Any]) -> None:  # DCP's upload thread: no collective here
        try:
            metadata = upload.result()
            self._done.set_result((metadata, _table(self._directory, self._writer, self._ranks)))
        except BaseException as exc:  # CheckpointException included: result() raises it
            self._done.set_exception(exc)

    def staged(self, timeout: float | None = None) -> None:
        """Wait until the state is copied to host buffers (then the model may change)."""
        if self._staging is not None:
            self._staging.result(timeout)

    def done(self) -> bool:
        """Whether this rank's files are written, fsynced and in its table (or failed)."""
        return self._done.done()

    def result(self, timeout: float | None = None) -> ShardedLayout:
        """Every rank, from the calling thread: wait and gather; the same layout on every rank,
        or :class:`~pitstop.errors.SaveError` on every rank when any rank failed."""
        return _agreed(self.written(timeout), self._ranks)

    def written(self, timeout: float | None = None) -> WrittenShards:
        """:meth:`result` without the round that hands rank 0's layout to every rank."""

        def wait() -> tuple[Metadata | None, tuple[ShardFile, ...]]:
            try:
                metadata, table = self._done.result(timeout)
            except CheckpointException as exc:
                raise SaveError(f"could not write the shards of {self._directory}: {exc}") from exc
            return (metadata if self._ranks.leader else None), table  # rank 0 builds the layout

        with _removed_on_error(self._directory, self._ranks):
            outcomes = self._ranks.all_gather_each(wait)
        return WrittenShards(metadata=outcomes[0][0], tables=tuple(t for _, t in outcomes))

    def drain(self, timeout: float | None = None) -> None:
        """Wait for DCP's write to end, whatever its outcome (its collectives done), before
        the group it runs on is used again; a failure is not raised."""
        with contextlib.suppress(BaseException):
            self._done.result(timeout)


def async_write_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any,
    stager: DefaultStager,
    created: bool = False,
) -> PendingShardedWrite:
    """Every rank: :func:`write_sharded` through ``dcp.async_save`` with ``stager``.

    ``group``: a gloo process group nothing else uses while the write runs (DCP runs its
    collectives on its own thread). Returns once the state is staged on the CPU; with CUDA,
    once staging began (wait for :meth:`PendingShardedWrite.staged` before the next step).
    ``created``: rank 0 made ``directory`` already.
    """
    root = Path(directory)
    writer = _fresh(root, ranks, created=created)
    state = _state(model, optimizers)
    response = async_save(state, storage_writer=writer, async_stager=stager, process_group=group)
    return PendingShardedWrite(root, writer, ranks, response)


# --- reading ----------------------------------------------------------------------------------


def _live(value: object) -> LiveValue:
    if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
        return LiveValue(dtype=dtype_name(value.dtype), shape=tuple(value.shape))
    return LiveValue(dtype=None)


def _planned_files(
    directory: Path, layout: ShardedLayout, state: dict[str, Any], rank: int
) -> tuple[str, ...]:
    """Check that ``state`` fits ``layout``; the files DCP's local plan reads on this rank."""
    planner = SafePlanner()
    planner.set_up_planner(state, metadata_of(layout), rank == 0)
    live = {fqn: _live(value) for fqn, value in planner.state_dict.items()}
    problems = layout_differences(layout, live)
    if problems:
        raise IncompatibleCheckpoint(f"{directory}: {p}" for p in problems)
    reads = [r.storage_index for r in planner.create_local_plan().items]
    return files_for(
        layout, [(i.fqn, None if i.offset is None else tuple(i.offset)) for i in reads]
    )


def sharded_differences(
    directory: str | os.PathLike[str], model: nn.Module, optimizers: Optimizers, rank: int
) -> list[str]:
    """Every difference between this rank's live sharded state and the directory's layout
    (empty when it fits); reads the manifest only."""
    root = Path(directory)
    layout, _ = read_layout(root)
    try:
        _planned_files(root, layout, _state(model, optimizers), rank)
    except IncompatibleCheckpoint as exc:
        return list(exc.differences)
    return []


def files_to_verify(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    rank: int,
    world_size: int,
) -> tuple[ShardedLayout, tuple[str, ...]]:
    """The layout, and the files this rank checks when a resume considers ``directory``:
    those DCP's read plan names for it — or, when its state does not fit the layout (the
    comparison reports that later), an equal share of every file the layout lists."""
    root = Path(directory)
    layout, _ = read_layout(root)
    try:
        return layout, _planned_files(root, layout, _state(model, optimizers), rank)
    except IncompatibleCheckpoint:
        names = [f.name for f in layout.files]
        return layout, tuple(names[rank::world_size])


def read_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
    verify: bool = True,
) -> ShardedLayout:
    """Every rank: restore the model and ``optimizers`` from a sharded checkpoint directory.

    Before any tensor is touched, the manifest is read, the live state is checked against it
    (:class:`~pitstop.errors.IncompatibleCheckpoint` listing every difference) and each rank
    verifies the files DCP will read for it (:class:`~pitstop.errors.CheckpointCorrupt`
    naming the file); every rank raises the same error. Then DCP reads, resharding to this
    world size, and ``set_*_state_dict`` applies the state. Returns the layout.
    ``verify=False``: the files were verified already (a resume's choice checks them).
    """
    root = Path(directory)
    layout = ranks.each(lambda: read_layout(root)[0])
    state = _state(model, optimizers)
    names = ranks.each(lambda: _planned_files(root, layout, state, ranks.rank))
    if verify:
        ranks.each(lambda: verify_sharded(root, layout, names))
    load_checked(root, state, layout, process_group=group)
    set_model_state_dict(model, state[MODEL])
    for name, optimizer in optimizers.items():
        set_optimizer_state_dict(model, optimizer, state[name])
    return layout


def full_state_dict(directory: str | os.PathLike[str], component: str = MODEL) -> dict[str, Any]:
    """The full, unsharded state of ``component`` as plain CPU tensors, read in this process.

    Verifies the files that hold it first and never unpickles. The model's state loads into
    an unsharded copy of the model with ``strict=True``.
    """
    root = Path(directory)
    layout, _ = read_layout(root)
    wanted = [v for v in layout.values if v.path[:1] == (component,)]
    if not wanted:
        raise IncompatibleCheckpoint([f"{root}: the checkpoint holds no {component!r} state"])
    verify_sharded(root, layout, {c.file for v in wanted for c in v.chunks})
    state: dict[Any, Any] = {}
    for value in wanted:
        node = state
        for key in value.path[:-1]:
            node = node.setdefault(key, {})
        dtype = None if value.dtype is None else TENSOR_DTYPES[value.dtype]
        # A non-tensor value: DCP puts what it stored in place of the None.
        node[value.path[-1]] = None if dtype is None else torch.empty(value.shape, dtype=dtype)
    load_checked(root, state, layout, no_dist=True)
    return dict(state[component])
