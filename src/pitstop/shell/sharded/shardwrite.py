# Writing sharded state (FSDP2, DTensor) through torch.distributed.checkpoint (DCP).
#
# Rules: every rank makes the same calls. Rank 0 creates the temp directory (exclusive; the
# outcome is agreed — or it did so already, with the plan), every rank writes its shards through
# DCP's FileSystemWriter, whose files are CRC-32ed (from a map of their pages, beside their
# fsync) as DCP closes them (pitstop.shell.sharded.dcpwrite), so the table of the files it wrote
# itself — rank 0's include `.metadata` — needs no re-read; the tables (with whatever each rank
# sends along) reach rank 0 with DCP's own results (pitstop.shell.sharded.dcpio), and rank 0 builds
# the layout (pitstop.core.sharding.sharded). A failure on any rank is the same error on every rank
# (the failing rank's own, when its table or part could not be made), and the temp directory is
# removed. DCP's collectives run on `group` (async: on DCP's upload thread, so then `group` must be
# a process group of its own); pitstop's agreement runs on `ranks`, started from the calling thread
# only — except the round that agrees every rank staged a background save, which runs on `group`, on
# pitstop's thread that then starts DCP's write (no other thread uses `group` then). In the
# background, each rank stages first, on its own (pitstop.shell.sharded.shardstage); then either DCP
# starts at once (start_sharded: the caller agreed already) or the call returns and a thread makes
# the copies left for later (overlap mode), agrees that every rank staged, and starts DCP
# (start_once_agreed): a rank that could not stage leaves no DCP collective waiting on the others,
# and no rank waits for that round in the call. Publishing is pitstop.shell.store.sharddir's.
# How: DCP does the tensor I/O; this module the directory, the tables and the agreement.

"""Write a checkpoint directory's shards through DCP, synchronously or in the background."""

from __future__ import annotations

import contextlib
import errno
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
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from pitstop.core.sharding.sharded import ShardedLayout, ShardFile
from pitstop.errors import SaveError
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sharded.dcpio import NO_DIST_WARNING, Ship, Writer, layout_of, own_failure
from pitstop.shell.sharded.dcpstate import MODEL, Optimizers, dcp_state
from pitstop.shell.sharded.shardstage import (
    Handed,
    KeptStager,
    StagedShards,
    make_stager,
    stage_sharded,
)

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


def _fresh(
    directory: Path,
    ranks: Ranks,
    *,
    created: bool,
    rider: Callable[[], Any] | None = None,
    ship: Ship | None = None,
) -> Writer:
    """Rank 0 creates ``directory`` (it must not exist yet; every rank hears the outcome),
    unless it was ``created`` already (by rank 0, before every rank heard its name); this
    rank's writer into it, which sends ``rider()`` to rank 0 with its files."""

    def create() -> None:
        try:
            directory.mkdir()
        except OSError as exc:
            raise SaveError(f"could not create {directory}: {exc}") from exc

    if not created:
        ranks.lead(create)
    return Writer(directory, rank=ranks.rank, rider=rider, ship=ship)


@contextlib.contextmanager
def _removed_on_error(directory: Path, ranks: Ranks) -> Iterator[None]:
    """Rank 0 removes the temp ``directory`` of a save that failed (on every rank, by then)."""
    try:
        yield
    except Exception:
        if ranks.leader:
            shutil.rmtree(directory, ignore_errors=True)
        raise


def _write_error(root: Path, exc: CheckpointException, writer: Writer, rank: int) -> Exception:
    """DCP's failed write of ``root`` (raised on every rank) as the same error on every rank:
    a rank's own that made its files fail (:func:`~pitstop.shell.sharded.dcpio.own_failure`), else a
    SaveError with DCP's failures, one per rank."""
    own = own_failure(exc, rank, writer)
    if isinstance(own, Exception):
        return own
    why = "; ".join(f"rank {r}: {_failure(e)}" for r, (e, _) in sorted(exc.failures.items()))
    return SaveError(f"could not write the shards of {root}: {why}")


def _failure(error: BaseException) -> str:
    """One rank's failure in words: a full disk said so, with the file it was writing."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        name = errno.errorcode[error.errno]
        return f"no space left on the device ({name}) writing {error.filename}"
    return f"{type(error).__name__}: {error}"


def _written(metadata: Metadata | None, writer: Writer, ranks: Ranks) -> WrittenShards:
    """What a finished DCP write hands rank 0 (every rank's files and riders); nothing on
    the other ranks."""
    if not ranks.leader:
        return WrittenShards(metadata=None, tables=())
    files = writer.ranks_files
    return WrittenShards(
        metadata=metadata,
        tables=tuple(f.table for f in files),
        riders=tuple(f.rider for f in files),
    )


@attrs.frozen
class WrittenShards:
    """Every rank's shards of a save, durable in its temp directory; what rank 0 publishes."""

    metadata: Metadata | None
    """DCP's metadata (rank 0's; ``None`` on the other ranks)."""
    tables: tuple[tuple[ShardFile, ...], ...]
    """Every rank's files, in rank order (rank 0's; empty on the other ranks)."""
    riders: tuple[Any, ...] = ()
    """What each rank sent along, in rank order (rank 0's; empty on the other ranks)."""

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
    ``directory`` (under :func:`~pitstop.shell.sharded.dcpstate.dcp_state`'s keys).

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
    ship: Ship | None = None,
) -> WrittenShards:
    """Every rank: :func:`write_sharded`, without the round that hands rank 0's layout to
    every rank (rank 0 builds it from the result, :meth:`WrittenShards.layout`, with what it
    publishes). ``created``: rank 0 made ``directory`` already. ``gather()``: run on every
    rank once its shards are durable, its result handed to rank 0 with the files
    (:attr:`WrittenShards.riders`) by DCP's own gather of its write results. ``ship``: each
    rank's files are sent on in its write step too (:data:`~pitstop.shell.sharded.dcpio.Ship`)."""
    root = Path(directory)
    writer = _fresh(root, ranks, created=created, rider=gather, ship=ship)
    with _removed_on_error(root, ranks):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
                state = dcp_state(model, optimizers, ema)
                metadata = save(state, storage_writer=writer, process_group=group)
        except CheckpointException as exc:  # a BaseException, raised on every rank
            raise _write_error(root, exc, writer, ranks.rank) from exc
        return _written(metadata, writer, ranks)


class PendingShardedWrite:
    """A save :func:`async_write_sharded` started. DCP writes on its upload thread, each file
    checksummed and fsynced as DCP closes it, and hands every rank's table (and rider) to rank
    0 with its results. :meth:`result` agrees on the outcome (after a ``timeout`` there, DCP
    may still be writing: do not reuse the directory)."""

    def __init__(self, directory: Path, writer: Writer, ranks: Ranks, response: Any) -> None:
        self._directory, self._writer, self._ranks = directory, writer, ranks
        self._upload: Future[Any] = getattr(response, "upload_completion", response)

    def done(self) -> bool:
        """Whether this rank's write has ended (its files written, fsynced and in its table,
        and on rank 0 every rank's handed over), or failed."""
        return self._upload.done()

    def result(self, timeout: float | None = None) -> ShardedLayout:
        """Every rank, from the calling thread: wait and agree; the same layout on every rank,
        or the same error on every rank when any rank failed."""
        return _agreed(self.written(timeout), self._ranks)

    def written(self, timeout: float | None = None) -> WrittenShards:
        """:meth:`result` without the round that hands rank 0's layout to every rank; rank 0's
        result holds every rank's rider (:attr:`WrittenShards.riders`)."""
        writer, rank = self._writer, self._ranks.rank

        def wait() -> Metadata | None:
            try:
                metadata = self._upload.result(timeout)
            except CheckpointException as exc:
                own = _write_error(self._directory, exc, writer, rank)
                if isinstance(own, SaveError) or own is writer.failure:
                    raise own from exc
                return None  # another rank's files were not made: that rank raises its own
            return None if metadata is _NOT_WRITTEN else metadata  # the stager's raises

        with _removed_on_error(self._directory, self._ranks):
            metadata = self._ranks.each(wait)  # the same error on every rank
        assert metadata is not None or not self._ranks.leader  # rank 0 wrote, or raised
        return _written(metadata, writer, self._ranks)


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
    rider: Callable[[], Any] | None = None,
    ship: Ship | None = None,
) -> PendingShardedWrite:
    """Every rank, right after its own staging at the call: ``staged``, or the error that
    stopped it. Returns at once; a thread of pitstop's makes the copy ``staged`` left for
    later (unless the loop's next optimizer step began it), then runs the round, on
    ``group``, that tells every rank whether every rank staged, then starts DCP's
    ``async_save`` of ``staged`` into ``directory`` (made by rank 0 already) on ``group`` —
    or, when any rank could not stage, no rank does: a rank that could not stage ends with
    its error, the others with nothing written. Both come out of
    :meth:`PendingShardedWrite.written` (the same error on every rank); ``rider()``, called
    in DCP's write (off the call), reaches rank 0 with this rank's files (its result's
    riders). Only that thread and DCP's write use ``group``, one save at a time."""
    root = Path(directory)
    writer = Writer(root, rank=ranks.rank, rider=rider, ship=ship)
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
    return PendingShardedWrite(root, writer, ranks, started)


class _Refusing(DefaultSavePlanner):
    """A save planner that fails before DCP's first collective, with ``error``."""

    def __init__(self, error: SaveError) -> None:
        super().__init__()
        self._error = error

    def set_up_planner(
        self, state_dict: Any = None, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        """Raise the error (DCP gathers it to every rank with its plan). The parameters are
        DCP's own (a planner without ``storage_meta`` makes DCP warn)."""
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
    stager: KeptStager,
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
