# A sharded resume's read without DCP's: every file checked first, then copied straight into
# the live tensors from the files (by then in the page cache).
#
# Rules: what a rank reads is its read plan, made when it planned the candidate (DCP's own local
# plan, over the metadata rebuilt from pitstop's manifest: pitstop.shell.sharded.engine.plan_read),
# so no collective of DCP's runs. First each rank checks its share of the files (size, CRC-32:
# pitstop.shell.sharded.filecheck; the files it wrote on a thread started as soon as it read the
# manifest, while it planned) and, for every item it reads, its container, from pages read by
# then — an item of a file checked on that thread as soon as the check's stream has passed it,
# the others once every check ended: a torch.save'd tensor's zip is parsed, never unpickled
# (pitstop.shell.sharded.torchzip); anything else is loaded with torch.load(weights_only=True),
# and a non-tensor value through the safe planner — both only once every check passed. Every
# value is checked before anything is allocated from it. The ranks agree on what they found (one
# round); only when no rank found a problem are the live tensors written: each record read
# (pread, from the same open file) into its destination's memory, or into a buffer and copied
# where the destination is a slice or not on the CPU. A failure after the agreement is an I/O
# error on verified files; the state is then partly written (said in the error).
# How: functions over the plan's ReadItems; the files stay open from the check to the copy.

"""The resume's read of a sharded checkpoint: checked first, then copied into the live state."""

from __future__ import annotations

import ctypes
import io
import os
from collections.abc import Callable, Collection
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, Final, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.sharded.filecheck import PIECE, Started, checked_file
from pitstop.shell.sharded.torchzip import raw_record

__all__ = ["Checked", "check_read", "raw_record"]

_LOOK: Final = 4096
"""Bytes read at an item's start and at its end to find its storage record."""


def _pread(fd: int, target: Any, position: int) -> None:
    """Fill ``target`` (a writable buffer) from ``fd`` at ``position``; OSError if short."""
    view = memoryview(target).cast("B")
    while view:
        got = os.preadv(fd, [view], position)
        if got <= 0:
            raise OSError(f"the file ended {len(view)} bytes early")
        view, position = view[got:], position + got


class _Bytes(io.RawIOBase):
    """A read-only, seekable file over ``data`` (torch.load wants one)."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self._data, self._at = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        piece = self._data[self._at : self._at + len(target)]
        target[: len(piece)] = piece
        self._at += len(piece)
        return len(piece)


class Checked:
    """What :func:`check_read` found and keeps for the copy: the open files, and for each
    tensor item either where its elements are or the tensor torch.load made of it."""

    def __init__(self, files: ExitStack, planner: Any) -> None:
        self._files = files
        self._planner = planner
        self._raw: list[tuple[ReadItem, int, int, torch.dtype, tuple[int, ...]]] = []
        self._loaded: list[tuple[ReadItem, torch.Tensor]] = []

    def close(self) -> None:
        """Close the files."""
        self._files.close()

    def copy(self) -> None:
        """Every rank, once every rank's check passed: write each tensor into its live place;
        the files are closed after."""
        with self._files:
            for item, fd, position, dtype, shape in self._raw:
                target = self._planner.resolve_tensor(item).detach()
                whole = not any(item.storage_offsets) and tuple(item.lengths) == shape
                if whole and target.device.type == "cpu" and target.is_contiguous():
                    nbytes = target.numel() * target.element_size()
                    if nbytes:
                        memory = (ctypes.c_char * nbytes).from_address(target.data_ptr())
                        _pread(fd, memory, position)
                else:
                    buffer = bytearray(_size(dtype, shape))
                    _pread(fd, buffer, position)
                    stored = torch.frombuffer(buffer, dtype=dtype).view(shape) if buffer else None
                    if stored is not None:
                        part = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                        target.copy_(part)
                self._planner.commit_tensor(item, target)
            for item, loaded in self._loaded:
                target = self._planner.resolve_tensor(item).detach()
                target.copy_(narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths))
                self._planner.commit_tensor(item, target)


def _size(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * torch.empty((), dtype=dtype).element_size()


def check_read(
    directory: Path,
    plan: Any,
    checks: Collection[str],
    beside: Callable[[], str | None] | None = None,
    started: Started | None = None,
) -> tuple[Checked | None, str | None, bool]:
    """This rank's check of ``plan``'s read (a :class:`~pitstop.shell.sharded.engine.
    ShardedPlan`): the files ``checks`` verified whole, every item it reads found in its file
    (a non-tensor value loaded into the plan's state; nothing live touched), and ``beside()``
    waited for. The checked read, or what was wrong and whether a check found it (a file's
    size or CRC-32, or ``beside``) rather than a read of a file another rank checks.
    ``started``: the check of some files begun early (its files are closed with the read's):
    those of ``checks`` among them are waited for once the others are checked here; the items
    are found after (their pages read by then), in the same open files."""
    files = ExitStack()
    if started is not None:
        files.enter_context(started)
    checked = Checked(files, plan.planner)
    checking, name = True, ""
    try:
        early = set(started.names) if started is not None else set()
        now = sorted(set(checks) - early)  # not begun early: checked here, first
        scratch = bytearray(PIECE if now else 0)
        opened: dict[str, int] = {}
        for name in now:
            opened[name] = checked_file(directory, plan.layout, name, files, scratch)
        waited = sorted(set(checks) & early)
        if started is not None:  # its files, open, for the items too
            opened = {**started.opened, **opened}
        checking = False
        storage = plan.planner.metadata.storage_data
        later = []  # loaded (torch.load, a value) only once its file's check passed
        for item in _in_read_order(plan.reads, storage, started):
            info = storage[item.storage_index]
            name = info.relative_path
            if started is None or name not in started.opened:  # read once the checks end
                later.append(item)
                continue
            started.read_past(name, info.offset + info.length)  # its pages read by now
            try:
                if not _check_item(directory, plan, item, info, opened[name], checked, raw=True):
                    later.append(item)
            except Exception:  # a check's problem first, as if the checks had ended before
                checking = True
                _verified(started, waited)
                checking = False
                raise
        checking = True
        _verified(started, waited)
        checking = False
        for item in later:
            info = storage[item.storage_index]
            name = info.relative_path
            if name not in opened:
                opened[name] = files.enter_context(
                    open_untrusted(directory / name, follow_symlinks=False)
                ).fileno()
            _check_item(directory, plan, item, info, opened[name], checked)
        checking = True
        problem = None if beside is None else beside()
    except CheckpointCorrupt as exc:
        problem = str(exc)
    except Exception as exc:  # a file that cannot be read, an item torch.load refuses
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problem = f"{directory}: {name} could not be read: {first}"
    if problem is not None:
        files.close()
        if beside is not None:
            beside()
        return None, problem, checking
    return checked, None, False


def _in_read_order(reads: Any, storage: Any, started: Started | None) -> list[Any]:
    """``reads`` in the order their pages arrive: those in the files ``started`` checks by
    file (in its order) and offset, then the others (other ranks' files: not read ahead of
    the check's stream)."""
    order = {name: i for i, name in enumerate(started.names)} if started is not None else {}
    last = len(order)

    def key(item: Any) -> tuple[int, int]:
        info = storage[item.storage_index]
        return order.get(
            info.relative_path, last
        ), info.offset if info.relative_path in order else 0

    return sorted(reads, key=key)


def _verified(started: Started | None, names: Collection[str]) -> None:
    """Wait for the check of each of ``names`` (begun early, by ``started``), raise the first
    problem found."""
    for name in names:
        assert started is not None
        started.verified(name)


def _check_item(
    directory: Path,
    plan: Any,
    item: ReadItem,
    info: Any,
    fd: int,
    checked: Checked,
    *,
    raw: bool = False,
) -> bool:
    """Find ``item`` (where ``info`` says, in the file open as ``fd``) for ``checked``;
    whether it did (``raw``: only where its elements lie plain in the file — a value or a
    tensor torch.load must read is left for later)."""
    length = info.length
    if item.type == LoadItemType.BYTE_IO:
        if raw:
            return False
        plan.planner.load_bytes(item, io.BytesIO(os.pread(fd, length, info.offset)))
        return True
    md = plan.planner.metadata.state_dict_metadata[item.storage_index.fqn]
    chunk = next(c for c in md.chunks if c.offsets == item.storage_index.offset)
    dtype, shape = md.properties.dtype, tuple(chunk.sizes)
    look = min(length, _LOOK)
    head = os.pread(fd, look, info.offset)
    tail = os.pread(fd, look, info.offset + length - look)
    at = raw_record(head, tail, length, dtype, shape)
    if at is not None:
        checked._raw.append((item, fd, info.offset + at, dtype, shape))
        return True
    if raw:
        return False
    data = os.pread(fd, length, info.offset)
    loaded = torch.load(cast(IO[bytes], _Bytes(data)), map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != shape:
        raise CheckpointCorrupt(f"{directory}: {info.relative_path} holds no {shape} tensor there")
    checked._loaded.append((item, loaded))
    return True
