# How a sharded checkpoint is read through DCP: checked as it is read, into staging if asked.
#
# Rules: DCP's reader is handed the metadata rebuilt from pitstop's manifest (its pickled
# `.metadata` is never read: pitstop.shell.sharded.dcpio) and the safe planner. A resume's read
# checks as it reads: each file this rank verifies (its share: pitstop.core.sharded.share_checks)
# is read once, start to end (pitstop.core.shardcover.read_spans), into one reused buffer, every
# byte CRC-32ed on the way and the regions DCP's plan wants loaded from those same bytes; its
# size is compared before a byte is read and its CRC-32 after the last, and a mismatch is this
# rank's read failure, which DCP raises on every rank. With staging, DCP reads into fresh
# tensors made in its planning step (a rank that cannot make them fails the load everywhere),
# and a tensor torch.load made for a whole local shard takes the staged one's place (never
# copied; the staged memory is never touched): nothing live is touched by the read.
# How: a subclass of DCP's FileSystemReader and of the safe planner; load_checked runs dcp.load.

"""DCP's read of a sharded checkpoint: each checked file read once, into staging if asked."""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.tensor import DTensor
from torch.futures import Future

from pitstop.core.shardcover import read_spans
from pitstop.core.sharded import ShardedLayout, ShardFile, file_problem
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.checksums import PIECE, crc32_update
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.sharded.dcpio import NO_DIST_WARNING, SafePlanner, metadata_of
from pitstop.shell.sharded.dcpstate import local_shard
from pitstop.shell.store.sharddir import verify_sharded

__all__ = ["ReadFailed", "load_checked"]


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
