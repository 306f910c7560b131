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
# from untransformed files (no DCP extensions). A resume's read checks as it reads: each file
# this rank verifies (its share: pitstop.core.sharded.share_checks) is read once, start to end
# (pitstop.core.shardcover.read_spans), every byte CRC-32ed on the way and the regions DCP's
# plan wants loaded from those same bytes; its size is compared before a byte is read and its
# CRC-32 after the last, and a mismatch is this rank's read failure, which DCP raises on every
# rank (the caller reads into staging tensors, so nothing live has been touched by then).
# How: small subclasses of DCP's FileSystemWriter, FileSystemReader and DefaultLoadPlanner.

"""DCP adapters: layout <-> DCP metadata, a writer that notes its files, a safe reader."""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

import attrs
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
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
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from pitstop.core.ranks import Outcome
from pitstop.core.shardcover import read_spans
from pitstop.core.sharded import ShardedLayout, ShardFile, StoredChunk, StoredValue, file_problem
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format.checksums import PIECE, crc32_update
from pitstop.shell.format.treewalk import dtype_name, tensor_dtypes
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.ranks.distributed import outcome_of, rebuilt
from pitstop.shell.sharded.dcpstate import local_shard
from pitstop.shell.sharded.dcpwrite import CrcFileSystem, Note
from pitstop.shell.store.sharddir import file_table, verify_sharded

__all__ = [
    "DCP_METADATA",
    "NO_DIST_WARNING",
    "FilesNotMade",
    "RankFiles",
    "ReadFailed",
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


class Writer(FileSystemWriter):
    """DCP's file writer into the new ``directory``, never overwriting, for ``rank``; its
    streams fsync and checksum each file as DCP writes it (pitstop.shell.sharded.dcpwrite), so DCP's
    ``sync_files``, which would fsync each again, is off. Each rank's write also makes its file
    table and takes ``rider()``, and DCP's results carry them to rank 0, where
    :attr:`ranks_files` holds every rank's once DCP's write has ended."""

    ranks_files: tuple[RankFiles, ...] = ()
    """Rank 0, once written: every rank's :class:`RankFiles`, in rank order."""
    failure: Exception | None = None
    """This rank's own error, when its table or rider could not be made."""

    def __init__(
        self, directory: Path, *, rank: int = 0, rider: Callable[[], Any] | None = None
    ) -> None:
        super().__init__(directory, sync_files=False, overwrite=False)
        self.fs = self._files = CrcFileSystem()
        self.path = self.fs.init_path(directory)
        self._rank, self._rider = rank, rider

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
    """DCP's file reader, handed the metadata from pitstop's manifest (``.metadata`` unread);
    the files of ``checks`` (by name) it checks as it reads them."""

    def __init__(
        self,
        path: Path,
        layout: ShardedLayout,
        checks: Mapping[str, ShardFile] | None = None,
        beside: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(path)
        self._metadata = metadata_of(layout)
        self._layout = layout
        self._checks = dict(checks or {})
        self._beside = beside
        self.problem: str | None = None
        """What a check of this rank's found wrong (the first file that failed)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, one file at a time, so that an error names the file; a file
        of ``checks`` read once, start to end, checked as it streams."""
        per_file: dict[str, list[ReadItem]] = {name: [] for name in self._checks}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            expected = self._checks.get(name)
            try:
                if expected is not None:
                    self._read_checking(expected, items, planner)
                elif items:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointCorrupt as exc:
                self.problem = str(exc)
                raise _CheckFailed(self.problem) from None
            except Exception as exc:  # DCP gathers it to every rank (it must pickle)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise CheckpointCorrupt(f"{name} could not be read: {first}") from None
        problem = None if self._beside is None else self._beside()
        if problem is not None:  # the check made beside the read failed: as a file's would
            self.problem = problem
            raise _CheckFailed(problem)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_checking(
        self, expected: ShardFile, items: list[ReadItem], planner: LoadPlanner
    ) -> None:
        """Read ``expected``'s file once, checking its size and CRC-32, loading ``items``."""
        root = Path(self.path)
        regions: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            regions.setdefault((info.offset, info.length), []).append(item)
        spans = read_spans(expected.size, regions)
        if spans is None:  # regions a stream cannot hand over in one pass: check, then read
            verify_sharded(root, self._layout, [expected.name])
            if items:
                super().read_data(LoadPlan(items), planner).wait()
            return
        try:
            file = open_untrusted(root / expected.name, follow_symlinks=False)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{root}: {file_problem(expected, None, None)}") from None
        failed: Exception | None = None  # an item that would not load: bytes damaged?
        scratch = bytearray(max((n for _, n, wanted in spans if wanted), default=0))
        with file:
            size = os.fstat(file.fileno()).st_size
            crc = 0
            if size == expected.size:
                for start, length, wanted in spans:
                    if not wanted:
                        crc = _skim(file, length, crc)
                        continue
                    data = memoryview(scratch)[:length]
                    got = cast(io.BufferedReader, file).readinto(data)
                    crc = crc32_update(data[:got], crc)
                    if got != length:
                        break  # the file shrank: its size says so below
                    for item in regions[start, length] if failed is None else ():
                        try:
                            _load_item(item, data, planner)
                        except Exception as exc:  # the checksum says first whether it is torn
                            failed = exc
                size = file.tell()
        problem = file_problem(expected, size, crc)
        if problem is not None:
            raise CheckpointCorrupt(f"{root}: {problem}")
        if failed is not None:
            raise failed


class _CheckFailed(CheckpointCorrupt):
    """A file this rank checks failed its check (as DCP gathers it to every rank)."""


def _skim(file: Any, length: int, crc: int) -> int:
    """``crc`` continued over the next ``length`` bytes of ``file``, read and dropped."""
    while length > 0:
        piece = file.read(min(length, PIECE))
        if not piece:
            break
        crc = crc32_update(piece, crc)
        length -= len(piece)
    return crc


class _Bytes(io.RawIOBase):
    """A read-only, seekable file over ``view``, copied from only as it is read (``BytesIO``
    would copy it whole first)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._at = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        piece = self._view[self._at : self._at + len(target)]
        target[: len(piece)] = piece
        self._at += len(piece)
        return len(piece)


def _load_item(item: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
    """What DCP's own read does with one item's bytes ``data`` (untransformed, as pitstop
    writes them): a value through the planner, a tensor loaded weights-only and copied in."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(data))
        return
    loaded = torch.load(cast(IO[bytes], _Bytes(data)), map_location="cpu", weights_only=True)
    loaded = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
    if isinstance(planner, _StagingPlanner) and planner.adopt(item, loaded):
        return
    target = planner.resolve_tensor(item).detach()
    if target.size() != loaded.size():
        raise CheckpointCorrupt(
            f"{item.storage_index.fqn}: stored {tuple(loaded.size())}, "
            f"the plan reads {tuple(target.size())}"
        )
    target.copy_(loaded)
    planner.commit_tensor(item, target)


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


class ReadFailed(CheckpointCorrupt):
    """DCP could not read a sharded checkpoint (raised on every rank); :attr:`own` is what
    this rank found (``None``: another rank's failure, or its read of a file another rank's
    check found damaged)."""

    def __init__(self, message: str, own: str | None) -> None:
        super().__init__(message)
        self.own = own


def _staging(value: Any) -> Any:
    """A copy of the state dict ``value`` with a fresh, uninitialized tensor (a DTensor with
    the same placements) for each of its tensors; other values as they are."""
    if isinstance(value, DTensor):  # made from its local shard: no DTensor op to dispatch
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {key: _staging(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_staging(item) for item in value]
    return value


class _StagingPlanner(SafePlanner):
    """The safe planner, reading into :attr:`staged` (fresh tensors shaped like the state it
    is given, made in DCP's planning step: a rank that cannot make them fails DCP's load on
    every rank) instead of that state. A tensor loaded whole for one of them takes its place
    (:meth:`adopt`): its memory is never written, so never faulted in, and not copied."""

    staged: dict[str, Any] | None = None

    def adopt(self, item: ReadItem, loaded: torch.Tensor) -> bool:
        """Put ``loaded`` in place of the staged tensor ``item`` fills, if it fills all of it
        (same local shape, stride, dtype and device); whether it did."""
        fqn = item.dest_index.fqn
        staged = self.state_dict.get(fqn)
        if not isinstance(staged, torch.Tensor) or any(item.dest_offsets):
            return False
        local = local_shard(staged)
        same = (loaded.shape, loaded.stride(), loaded.dtype, loaded.device)
        if same != (local.shape, local.stride(), local.dtype, local.device):
            return False
        if tuple(item.lengths) != tuple(local.shape):
            return False
        adopted = loaded
        if isinstance(staged, DTensor):  # the same placements over the loaded shard
            adopted = DTensor.from_local(
                loaded,
                staged.device_mesh,
                staged.placements,
                run_check=False,
                shape=staged.shape,
                stride=staged.stride(),
            )
        self.state_dict[fqn] = adopted
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], adopted)
        return True

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's set-up, of a staging copy of ``state_dict``."""
        self.staged = _staging(state_dict)
        super().set_up_planner(self.staged, metadata, is_coordinator)


def load_checked(
    directory: Path,
    state: dict[str, Any],
    layout: ShardedLayout,
    *,
    checks: Sequence[str] = (),
    rank: int = 0,
    stage: bool = False,
    beside: Callable[[], str | None] | None = None,
    **kwargs: Any,
) -> dict[str, Any] | None:
    """``dcp.load`` into ``state`` from ``directory``, with metadata from ``layout`` and the
    safe planner (``kwargs``: ``process_group`` or ``no_dist``); the files ``checks`` are
    checked (size, CRC-32) as they are read, each read once. With ``stage``, ``state`` is
    left as it is and the state read is returned, in fresh tensors shaped like it.
    ``beside()``, called once this rank's reads are done, waits for a check made beside
    them and says what it found wrong, failing the read as a file's check would. DCP's
    errors, raised on every rank, become :class:`ReadFailed` (a
    :class:`~pitstop.errors.CheckpointCorrupt`); ``rank``: this rank's number in the group,
    for what it found itself."""
    try:
        wanted = {name: layout.file(name) for name in checks}
    except KeyError as exc:
        raise CheckpointCorrupt(f"{directory}: the manifest lists no file {exc}") from None
    reader = _Reader(directory, layout, wanted, beside)
    planner = _StagingPlanner() if stage else SafePlanner()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
            load(state, storage_reader=reader, planner=planner, **kwargs)
    except CheckpointException as exc:  # a BaseException, raised on every rank
        why = "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(exc.failures.items()))
        message = f"{directory}: DCP could not read it: {why}"
        checked = any(isinstance(e, _CheckFailed) for e, _ in exc.failures.values())
        # a file a check found damaged is the cause: another rank's read of it says nothing more
        own = reader.problem or (message if rank in exc.failures and not checked else None)
        raise ReadFailed(message, own) from exc
    return planner.staged if isinstance(planner, _StagingPlanner) else None
