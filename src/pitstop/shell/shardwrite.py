# Writing sharded state (FSDP2, DTensor) through torch.distributed.checkpoint (DCP).
#
# Rules: every rank makes the same calls. Rank 0 creates the temp directory (exclusive; the
# outcome is agreed — or it did so already, with the plan), every rank writes its shards through
# DCP's FileSystemWriter, whose files are CRC-32ed (from a map of their pages, beside their
# fsync) as DCP closes them (pitstop.shell.dcpwrite), so the table of the files it wrote itself
# — rank 0's include `.metadata` — needs no re-read; the tables are gathered (with whatever each
# rank sends along) and rank 0 builds the layout (pitstop.core.sharded). A failure on any rank
# is the same SaveError on every rank, and the temp directory is removed. DCP's collectives run
# on `group` (async: on DCP's upload thread, so then `group` must be a process group of its
# own); pitstop's agreement runs on `ranks`, started from the calling thread only — except the
# round that agrees every rank staged a background save, which runs on `group`, on pitstop's
# thread that then starts DCP's write (no other thread uses `group` then). In the background,
# each rank stages first, on its own (pitstop.shell.shardstage); then either DCP starts at once
# (start_sharded: the caller agreed already) or the call returns and a thread makes the copies
# left for later (overlap mode), agrees that every rank staged, and starts DCP
# (start_once_agreed): a rank that could not stage leaves no DCP collective waiting on the
# others, and no rank waits for that round in the call. Publishing is pitstop.shell.sharddir's.
# How: DCP does the tensor I/O; this module the directory, the tables and the agreement.

"""Write a checkpoint directory's shards through DCP, synchronously or in the background."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import attrs
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from pitstop.core.sharded import ShardedLayout, ShardFile
from pitstop.errors import SaveError
from pitstop.shell.dcpio import DCP_METADATA, NO_DIST_WARNING, Writer, layout_of
from pitstop.shell.dcpstate import MODEL, Optimizers, dcp_state
from pitstop.shell.distributed import GATHER_BOX, PART_BOX, Ranks
from pitstop.shell.sharddir import file_table
from pitstop.shell.shardstage import Handed, StagedShards, make_stager, stage_sharded

__all__ = [
    "MODEL",
    "Optimizers",
    "PendingShardedWrite",
    "StagedShards",
    "WrittenShards",
    "async_write_sharded",
    "dcp_state",
    "make_stager",
    "stage_sharded",
    "start_once_agreed",
    "start_sharded",
    "write_sharded",
    "write_shards",
]

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
    ema: nn.Module | None = None,
) -> ShardedLayout:
    """Every rank: save the model's, the ``ema``'s and ``optimizers``' state into the new
    ``directory`` (under :func:`~pitstop.shell.dcpstate.dcp_state`'s keys).

    Each rank writes its shards through DCP (on ``group``; ``None``: the default group), each
    file checksummed as written and fsynced; every rank returns the same layout. Nothing is
    published yet (:func:`write_manifest`, :func:`publish_sharded`). Raises
    :class:`~pitstop.errors.SaveError` on every rank when any rank fails.
    """
    written = write_shards(directory, model, optimizers, ranks=ranks, group=group, ema=ema)
    return _agreed(written, ranks)


def write_shards(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
    created: bool = False,
    gather: Callable[[], Any] | None = None,
    ema: nn.Module | None = None,
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
                state = dcp_state(model, optimizers, ema)
                metadata = save(state, storage_writer=writer, process_group=group)
        except CheckpointException as exc:  # a BaseException, raised on every rank
            raise SaveError(f"could not write the shards of {root}: {exc}") from exc

        def table() -> tuple[tuple[ShardFile, ...], Any]:
            return _table(root, writer, ranks), (gather() if gather is not None else None)

        gathered = ranks.all_gather_each(table, box=PART_BOX if gather is not None else GATHER_BOX)
        return WrittenShards(
            metadata=metadata if ranks.leader else None,
            tables=tuple(t for t, _ in gathered),
            riders=tuple(r for _, r in gathered) if gather is not None else (),
        )


class PendingShardedWrite:
    """A save :func:`async_write_sharded` started. DCP writes on its upload thread (each file
    checksummed and fsynced as DCP closes it), and there this rank's table is made. :meth:`result`
    gathers (after a ``timeout`` there, DCP may still be writing: do not reuse the directory)."""

    def __init__(
        self,
        directory: Path,
        writer: Writer,
        ranks: Ranks,
        response: Any,
        *,
        rider: Any = None,
        box: int = GATHER_BOX,
    ) -> None:
        self._directory, self._writer, self._ranks = directory, writer, ranks
        self._rider, self._box = rider, box  # the same box on every rank
        upload: Future[Any] = getattr(response, "upload_completion", response)
        self._done: Future[tuple[Metadata | None, tuple[ShardFile, ...]]] = Future()
        upload.add_done_callback(self._checksum)

    def _checksum(self, upload: Future[Any]) -> None:  # DCP's upload thread: no collective here
        try:
            metadata = upload.result()
            if metadata is _NOT_WRITTEN:  # another rank could not stage: nothing written here
                self._done.set_result((None, ()))
                return
            self._done.set_result((metadata, _table(self._directory, self._writer, self._ranks)))
        except BaseException as exc:  # CheckpointException included: result() raises it
            self._done.set_exception(exc)

    def done(self) -> bool:
        """Whether this rank's files are written, fsynced and in its table (or failed)."""
        return self._done.done()

    def result(self, timeout: float | None = None) -> ShardedLayout:
        """Every rank, from the calling thread: wait and gather; the same layout on every rank,
        or :class:`~pitstop.errors.SaveError` on every rank when any rank failed."""
        return _agreed(self.written(timeout), self._ranks)

    def written(self, timeout: float | None = None) -> WrittenShards:
        """:meth:`result` without the round that hands rank 0's layout to every rank; each
        rank's ``rider`` comes along (:attr:`WrittenShards.riders`)."""

        def wait() -> tuple[Metadata | None, tuple[ShardFile, ...], Any]:
            try:
                metadata, table = self._done.result(timeout)
            except CheckpointException as exc:
                raise SaveError(f"could not write the shards of {self._directory}: {exc}") from exc
            leaders = metadata if self._ranks.leader else None  # rank 0 builds the layout
            return leaders, table, self._rider

        with _removed_on_error(self._directory, self._ranks):
            outcomes = self._ranks.all_gather_each(wait, box=self._box)
        return WrittenShards(
            metadata=outcomes[0][0],
            tables=tuple(t for _, t, _ in outcomes),
            riders=tuple(r for _, _, r in outcomes),
        )


def start_sharded(
    directory: str | os.PathLike[str],
    staged: StagedShards,
    *,
    ranks: Ranks,
    group: Any,
    created: bool = False,
) -> PendingShardedWrite:
    """Every rank, once every rank staged: DCP's ``async_save`` of ``staged`` into
    ``directory`` on ``group`` (a gloo process group nothing else uses while the write runs:
    DCP runs its collectives on its own thread). ``created``: rank 0 made ``directory``
    already."""
    root = Path(directory)
    writer = _fresh(root, ranks, created=created)
    handed = Handed(staged.whole())
    response = async_save({}, storage_writer=writer, async_stager=handed, process_group=group)
    return PendingShardedWrite(root, writer, ranks, response)


_NOT_WRITTEN = object()
"""What a rank's write ends with when another rank could not stage (nothing was written)."""


def start_once_agreed(
    directory: str | os.PathLike[str],
    staged: StagedShards | Exception,
    *,
    ranks: Ranks,
    group: Any,
    timeout: float,
    rider: Any = None,
) -> PendingShardedWrite:
    """Every rank, right after its own staging at the call: ``staged``, or the error that
    stopped it. Returns at once; a thread of pitstop's makes the copy ``staged`` left for
    later (unless the loop's next optimizer step began it), then runs the round, on
    ``group``, that tells every rank whether every rank staged, then starts DCP's
    ``async_save`` of ``staged`` into ``directory`` (made by rank 0 already) on ``group`` —
    or, when any rank could not stage, no rank does: a rank that could not stage ends with
    its error, the others with nothing written. Both come out of
    :meth:`PendingShardedWrite.written` (the same error on every rank), which also carries
    each rank's ``rider``. Only that thread and DCP's write use ``group``, one save at a time."""
    root = Path(directory)
    writer = Writer(root)
    on_group = Ranks(ranks.rank, ranks.world_size, group)
    started: Future[Any] = Future()

    def start() -> None:
        try:
            own: Exception | None = staged if isinstance(staged, Exception) else None
            state: dict[str, Any] = {}
            if isinstance(staged, StagedShards):
                try:
                    state = staged.whole()
                except Exception as exc:  # this rank's write failure, agreed below
                    own = exc
                except BaseException as exc:  # a Ctrl-C in the step's copy (the loop heard it)
                    own = SaveError(f"the copy of this rank's shards was interrupted: {exc!r}")
            anyone_failed = on_group.any_failed_later(own is not None)(timeout)
            if own is not None:
                raise own
            if anyone_failed:
                started.set_result(_NOT_WRITTEN)
                return
            try:
                response: Any = async_save(
                    {}, storage_writer=writer, async_stager=Handed(state), process_group=group
                )
            except Exception as exc:  # DCP's write never began here; the others' did
                _refuse_in_dcp(writer, group, ranks.rank, exc)  # raises on every rank
                raise
            upload: Future[Any] = getattr(response, "upload_completion", response)
            upload.add_done_callback(partial(_forward, started))
        except BaseException as exc:
            started.set_exception(exc)

    # Not a daemon: at interpreter exit a daemon thread inside torch's C++ (a collective, a
    # copy) aborts the process as it takes the GIL back; this one ends within ``timeout``.
    try:
        threading.Thread(target=start, name="pitstop-dcp-start").start()
    except RuntimeError:  # no new threads now (at interpreter exit): do it all here
        start()
    return PendingShardedWrite(root, writer, ranks, started, rider=rider, box=PART_BOX)


class _Refusing(DefaultSavePlanner):
    """A save planner that fails before DCP's first collective, with ``error``."""

    def __init__(self, error: SaveError) -> None:
        super().__init__()
        self._error = error

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        """Raise the error (DCP gathers it to every rank with its plan)."""
        raise self._error


def _refuse_in_dcp(writer: Writer, group: Any, rank: int, error: Exception) -> None:
    """This rank could not start DCP's background write, which every other rank started: it
    joins their write with a planner that fails at once, so DCP's first collective (the
    plans) ends every rank's write with this rank's error instead of leaving them to wait
    for the collectives' timeout. Raises DCP's CheckpointException."""
    why = SaveError(f"rank {rank} could not start DCP's write: {type(error).__name__}: {error}")
    save({}, storage_writer=writer, planner=_Refusing(why), process_group=group)


def _forward(to: Future[Any], done: Future[Any]) -> None:
    """Hand ``done``'s outcome to ``to``."""
    try:
        to.set_result(done.result())
    except BaseException as exc:
        to.set_exception(exc)


def async_write_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any,
    stager: DefaultStager,
    created: bool = False,
    ema: nn.Module | None = None,
) -> PendingShardedWrite:
    """Every rank: :func:`write_sharded` through ``dcp.async_save`` with ``stager``:
    :func:`stage_sharded`, then :func:`start_sharded`, with no agreement in between (a rank
    that fails to stage leaves the others' DCP write waiting for its collectives; the
    Checkpointer agrees first). Returns once the state is staged (the model may change).
    ``group`` and ``created``: as for :func:`start_sharded`.
    """
    staged = stage_sharded(model, optimizers, stager, ema=ema)
    return start_sharded(directory, staged, ranks=ranks, group=group, created=created)
