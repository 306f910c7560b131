# The bridge between pitstop's sharded layout and torch.distributed.checkpoint (DCP).
#
# Rules: DCP reads nothing pitstop has not checked and unpickles nothing. Its `.metadata` is a
# pickle (FileSystemReader.read_metadata runs pickle.load; torch's weights-only unpickler reads
# only protocol 2 and DCP writes protocol 4), so the reader is handed DCP's metadata rebuilt
# from the layout in pitstop's manifest instead. Tensors DCP reads weights-only already; its
# planner reads non-tensor values with a full unpickler, so the planner here reads them with
# torch.load(weights_only=True). The writer notes the files its rank wrote from DCP's
# own write results, and their sizes and CRC-32s as its streams wrote and fsynced them
# (pitstop.shell.sharded.dcpwrite); that table, and what the rank sends along (its RNG, its per-rank
# state), reach rank 0 with DCP's own results, one more result of each rank's write that the
# writer on rank 0 takes out before DCP's metadata is made: no round of pitstop's gathers
# them, and only rank 0 receives them. A failure to make them is that rank's write failure
# (DCP raises it on every rank; :func:`own_failure` says whose it was). A layout is built only
# from untransformed files (no DCP extensions).
# How: small subclasses of DCP's FileSystemWriter, FileSystemReader and DefaultLoadPlanner.

"""DCP adapters: layout <-> DCP metadata, a writer that notes its files, a safe reader."""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pitstop.core.ranks import Outcome
from pitstop.core.sharding.sharded import ShardedLayout, ShardFile, StoredChunk, StoredValue
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format.treewalk import dtype_name, tensor_dtypes
from pitstop.shell.ranks.distributed import outcome_of, rebuilt
from pitstop.shell.sharded.dcpwrite import CrcFileSystem, Note
from pitstop.shell.store.sharddir import file_table

__all__ = [
    "DCP_METADATA",
    "NO_DIST_WARNING",
    "FilesNotMade",
    "RankFiles",
    "SafePlanner",
    "Writer",
    "layout_of",
    "load_checked",
    "metadata_of",
]

DCP_METADATA = ".metadata"
"""DCP's own (pickled) metadata file: rank 0 writes it; pitstop checksums it, never reads it."""
NO_DIST_WARNING = "torch.distributed is disabled"
"""The start of DCP's warning for a save or load in one process (silenced: that is meant)."""


def layout_of(metadata: Metadata, files: Sequence[ShardFile], world_size: int) -> ShardedLayout:
    """The layout of a DCP save: its metadata, joined with the ranks' file tables."""
    storage: Mapping[MetadataIndex, _StorageInfo] = metadata.storage_data
    paths: Mapping[str, Sequence[str | int]] = metadata.planner_data or {}

    def chunk(index: MetadataIndex, offsets: Sequence[int], sizes: Sequence[int]) -> StoredChunk:
        info = storage[index]
        if info.transform_descriptors:
            raise SaveError(f"DCP transformed {index.fqn}; pitstop stores untransformed files")
        return StoredChunk(
            offsets=tuple(offsets),
            sizes=tuple(sizes),
            file=info.relative_path,
            start=info.offset,
            length=info.length,
        )

    values = []
    for fqn, stored in metadata.state_dict_metadata.items():
        path = tuple(paths.get(fqn, (fqn,)))
        if isinstance(stored, TensorStorageMetadata):
            name = dtype_name(stored.properties.dtype)
            if name not in tensor_dtypes():
                raise SaveError(f"{fqn}: tensors of dtype {name} are not supported")
            chunks = tuple(
                chunk(MetadataIndex(fqn, c.offsets), c.offsets, c.sizes) for c in stored.chunks
            )
            shape = tuple(stored.size)
            values.append(StoredValue(fqn=fqn, path=path, dtype=name, shape=shape, chunks=chunks))
        else:
            only = (chunk(MetadataIndex(fqn), (), ()),)
            values.append(StoredValue(fqn=fqn, path=path, dtype=None, shape=(), chunks=only))
    return ShardedLayout(
        world_size=world_size,
        dcp_version=str(metadata.version),
        files=tuple(files),
        values=tuple(values),
    )


def metadata_of(layout: ShardedLayout) -> Metadata:
    """DCP's metadata rebuilt from a (checked) layout."""
    described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for value in layout.values:
        if value.dtype is None:
            described[value.fqn] = BytesStorageMetadata()
            only = value.chunks[0]
            storage[MetadataIndex(value.fqn)] = _StorageInfo(only.file, only.start, only.length)
            continue
        dtype = tensor_dtypes().get(value.dtype)
        if dtype is None:
            raise CheckpointCorrupt(f"{value.fqn}: unknown dtype {value.dtype!r}")
        chunks = []
        for c in value.chunks:
            offsets = torch.Size(c.offsets)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c.sizes)))
            storage[MetadataIndex(value.fqn, offsets)] = _StorageInfo(c.file, c.start, c.length)
        described[value.fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(value.shape), chunks=chunks
        )
    return Metadata(
        state_dict_metadata=described,
        planner_data={v.fqn: v.path for v in layout.values},
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=layout.dcp_version,
    )


_FILES = MetadataIndex("pitstop.rank-files")
"""The index of the result each rank's write adds for rank 0 (never in DCP's metadata)."""


@attrs.frozen
class RankFiles:
    """What one rank's write hands rank 0 beside DCP's results: its files and its rider."""

    rank: int
    table: tuple[ShardFile, ...]
    """The files it wrote, each with its size and CRC-32 (rank 0's: ``.metadata`` too)."""
    rider: Any = None
    """What it sent along (the ``rider()`` it was given), or ``None``."""


class FilesNotMade(Exception):
    """A rank's table or rider could not be made: its write failed (DCP raises this on every
    rank, :func:`own_failure` reads it). Carries the rank's error as an outcome."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome

    def __str__(self) -> str:
        return f"rank {self.outcome.rank}: {self.outcome.kind}: {self.outcome.error}"


Ship = Callable[[Path, tuple[ShardFile, ...]], None]
"""``ship(directory, table)``: sends the files a rank wrote on (an object store's upload), in its
write step, once they are durable and in its table; what it raises fails the rank's write."""


class Writer(FileSystemWriter):
    """DCP's file writer into the new ``directory``, never overwriting, for ``rank``; its
    streams fsync and checksum each file as DCP writes it (pitstop.shell.sharded.dcpwrite), so DCP's
    ``sync_files``, which would fsync each again, is off. Each rank's write also makes its file
    table and takes ``rider()``, and DCP's results carry them to rank 0, where
    :attr:`ranks_files` holds every rank's once DCP's write has ended; ``ship`` (if given)
    ships the rank's files on before that (:data:`Ship`)."""

    ranks_files: tuple[RankFiles, ...] = ()
    """Rank 0, once written: every rank's :class:`RankFiles`, in rank order."""
    failure: Exception | None = None
    """This rank's own error, when its table or rider could not be made."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int = 0,
        rider: Callable[[], Any] | None = None,
        ship: Ship | None = None,
    ) -> None:
        super().__init__(directory, sync_files=False, overwrite=False)
        self.fs = self._files = CrcFileSystem()
        self.path = self.fs.init_path(directory)
        self._rank, self._rider, self._ship = rank, rider, ship

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's ``write_data`` (it returns a completed future), and one result more: this
        rank's :class:`RankFiles`, for rank 0."""
        try:
            results = super().write_data(plan, planner).value()
        except Exception as exc:
            failure = self._files.failure  # what a full disk raised, hidden by torch.save
            if failure is not None and failure is not exc:
                raise failure from exc
            raise
        written = sorted({r.storage_data.relative_path for r in results})
        try:
            table = file_table(Path(self.path), written, self._rank, self._checksums())
            if self._ship is not None:  # its files uploaded: a failure is this rank's write's
                self._ship(Path(self.path), table)
            files = RankFiles(self._rank, table, None if self._rider is None else self._rider())
        except Exception as exc:  # this rank's write failure; DCP raises it on every rank
            self.failure = exc
            raise FilesNotMade(outcome_of(exc, self._rank)) from None
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, WriteResult(index=_FILES, size_in_bytes=0, storage_data=files)])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: DCP's ``finish`` (it writes ``.metadata``) of DCP's own results; every
        rank's :class:`RankFiles` kept in :attr:`ranks_files`. ``metadata`` (what DCP's
        ``save`` returns) is completed here, where it is made, as torch 2.13's ``finish`` does
        it: torch 2.11's completes a copy, and the ``metadata`` returned lacks its files."""
        ranks: dict[int, RankFiles] = {}
        ours = [[r for r in rank if r.index != _FILES] for rank in results]
        for rank in results:
            ranks.update((f.rank, f) for r in rank if isinstance(f := r.storage_data, RankFiles))
        metadata.storage_data = {r.index: r.storage_data for rank in ours for r in rank}
        version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
        if version is not None and hasattr(metadata, "version"):
            metadata.version = version
        super().finish(metadata, ours)
        mine = file_table(Path(self.path), [DCP_METADATA], self._rank, self._checksums())
        own = ranks[self._rank]
        ranks[self._rank] = attrs.evolve(own, table=own.table + mine)
        self.ranks_files = tuple(ranks[r] for r in sorted(ranks))

    def _checksums(self) -> dict[str, Note]:
        """``{name: (size, crc32)}`` of the files written (and fsynced) that could be vouched
        for as written; a file missing here is to be re-read."""
        return self._files.written(Path(self.path))


def own_failure(exc: CheckpointException, rank: int, writer: Writer) -> BaseException | None:
    """The error to raise on ``rank`` for DCP's failed write ``exc`` when a rank's files
    could not be made (:class:`FilesNotMade`): the lowest such rank's (its own exception
    there, a :class:`~pitstop.errors.SaveError` naming it elsewhere); ``None`` when the
    failure is DCP's own."""
    for failed, (error, _) in sorted(exc.failures.items()):
        if isinstance(error, FilesNotMade):
            if failed == rank and writer.failure is not None:
                return writer.failure
            return rebuilt(error.outcome)
    return None


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata from pitstop's manifest (``.metadata`` unread)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, one file at a time, so that an error names the file."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:  # DCP gathers it to every rank (it must pickle)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise CheckpointCorrupt(f"{name} could not be read: {first}") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor values are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put the non-tensor value ``value`` holds where ``read_item`` says."""
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_checked(
    directory: Path, state: dict[str, Any], layout: ShardedLayout, **kwargs: Any
) -> None:
    """``dcp.load`` into ``state`` from ``directory``, with metadata from ``layout`` and the
    safe planner (``kwargs``: ``process_group`` or ``no_dist``). DCP's errors, raised on every
    rank, become :class:`~pitstop.errors.CheckpointCorrupt`."""
    reader = _Reader(directory, metadata_of(layout))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
            load(state, storage_reader=reader, planner=SafePlanner(), **kwargs)
    except CheckpointException as exc:  # a BaseException, raised on every rank
        why = "; ".join(f"rank {rank}: {e}" for rank, (e, _) in sorted(exc.failures.items()))
        raise CheckpointCorrupt(f"{directory}: DCP could not read it: {why}") from exc
