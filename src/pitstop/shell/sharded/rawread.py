# A sharded resume's read without DCP's: every file checked first, then copied straight into
# the live tensors from the files (by then in the page cache).
#
# Rules: what a rank reads is its read plan, made when it planned the candidate (DCP's own local
# plan, over the metadata rebuilt from pitstop's manifest: pitstop.shell.sharded.engine.plan_read),
# so no collective of DCP's runs. First each rank checks its share of the files (size, CRC-32:
# pitstop.shell.sharded.filecheck; the files it wrote on a thread started as soon as it read the
# manifest, while it planned) and then, for every item it reads, its container (the pages read by
# then): a torch.save'd tensor is a zip whose central directory, data.pkl and one storage record are
# parsed — never unpickled: data.pkl's opcodes are only compared with those of a contiguous tensor
# of the dtype and shape the manifest gives — and the record's size must be numel x itemsize;
# anything else (another stride, a record stored compressed or past 4 GiB) is loaded with
# torch.load(weights_only=True) now, and a non-tensor value through the safe planner. Every value is
# checked before anything is allocated from it. The ranks agree on what they found (one round); only
# when no rank found a problem are the live tensors written: each record read (pread, from the same
# open file) into its destination's memory, or into a buffer and copied where the destination is a
# slice or not on the CPU. A failure after the agreement is an I/O error on verified files; the
# state is then partly written (said in the error).
# How: functions over the plan's ReadItems; the files stay open from the check to the copy.

"""The resume's read of a sharded checkpoint: checked first, then copied into the live state."""

from __future__ import annotations

import ctypes
import io
import os
import pickletools
import struct
import sys
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

__all__ = ["Checked", "check_read", "raw_record"]

_LOOK: Final = 4096
"""Bytes read at an item's start and at its end to find its storage record."""
_EOCD: Final = struct.Struct("<IHHHHIIH")
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL: Final = struct.Struct("<IHHHHHIIIHH")
_SKIPPED: Final = frozenset({"BINPUT", "LONG_BINPUT", "MEMOIZE", "PROTO", "FRAME"})
_INTS: Final = frozenset({"BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG"})
_STRINGS: Final = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8"})
_TUPLES: Final = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_MARK: Final = object()


def _records(tail: bytes, length: int) -> dict[str, tuple[int, int, int]] | None:
    """The records of a zip of ``length`` bytes whose last bytes are ``tail``: name (less the
    archive's folder) → (local header offset, method, size); ``None`` when its central
    directory is not all in ``tail``, or is not a plain one (no zip64 sizes)."""
    if len(tail) < _EOCD.size:
        return None
    sig, _, _, _, count, cd_size, cd_at, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != 0x06054B50 or comment or count == 0xFFFF or cd_at == 0xFFFFFFFF:
        return None
    base = length - len(tail)  # where tail starts in the zip
    at = cd_at - base
    if at < 0 or cd_at + cd_size > length:
        return None
    found: dict[str, tuple[int, int, int]] = {}
    for _ in range(count):
        if at + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, at)
        sig, method, size, usize = fields[0], fields[4], fields[8], fields[9]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        name_at = at + _CENTRAL.size
        if sig != 0x02014B50 or name_at + name_len > len(tail) or size != usize:
            return None
        name = tail[name_at : name_at + name_len].decode("utf-8", "replace")
        found[name.split("/", 1)[-1]] = (local, method, size)
        at = name_at + name_len + extra_len + comment_len
    return found


def _data(head: bytes, record: tuple[int, int, int], length: int) -> int | None:
    """Where ``record``'s bytes start in the zip (its local header is in ``head``)."""
    local, method, size = record
    if method != 0 or local + _LOCAL.size > len(head):
        return None
    fields = _LOCAL.unpack_from(head, local)
    start = int(local + _LOCAL.size + fields[9] + fields[10])
    if fields[0] != 0x04034B50 or start + size > length:
        return None
    return start


def _parsed(pickled: bytes) -> Any:
    """:func:`_parse`'s value of ``pickled``, remembered (the items of a checkpoint share a
    few dtypes and shapes)."""
    if pickled not in _PARSED:
        if len(_PARSED) >= _REMEMBERED:
            _PARSED.clear()
        _PARSED[pickled] = _parse(pickled)
    return _PARSED[pickled]


_REMEMBERED: Final = 1024
_PARSED: dict[bytes, Any] = {}


def _parse(pickled: bytes) -> Any:
    """The value ``pickled`` describes, built of tuples, ints, strings and ``("global", name)``,
    ``("persid", value)``, ``("call", f, args)`` — or ``None`` at any other opcode. Nothing is
    imported or called: opcodes are only read."""
    stack: list[Any] = []
    try:
        for op, arg, _ in pickletools.genops(pickled):
            name = op.name
            if name in _SKIPPED:
                continue
            if name in _INTS or name in _STRINGS:
                stack.append(arg)
            elif name == "GLOBAL":
                stack.append(("global", arg))
            elif name == "MARK":
                stack.append(_MARK)
            elif name in _TUPLES:
                n = _TUPLES[name]
                items = tuple(stack[len(stack) - n :]) if n else ()
                del stack[len(stack) - n :]
                stack.append(items)
            elif name == "TUPLE":
                mark = len(stack) - 1 - stack[::-1].index(_MARK)
                items = tuple(stack[mark + 1 :])
                del stack[mark:]
                stack.append(items)
            elif name in ("NEWFALSE", "NEWTRUE"):
                stack.append(name == "NEWTRUE")
            elif name == "BINPERSID":
                stack.append(("persid", stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(("call", stack.pop(), args))
            elif name == "STOP":
                return stack.pop() if len(stack) == 1 else None
            else:
                return None
    except (ValueError, IndexError, TypeError):
        return None
    return None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def raw_record(
    head: bytes, tail: bytes, length: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> int | None:
    """Where the elements of a torch.save'd tensor of ``length`` bytes start (its first and
    last bytes: ``head``, ``tail``), when it is a contiguous CPU tensor of ``dtype`` and
    ``shape`` whose storage record holds exactly its elements, little-endian, uncompressed;
    ``None`` for anything else (the caller loads it with torch.load)."""
    records = _records(tail, length)
    storage = torch.storage._dtype_to_storage_type_map().get(dtype)
    if records is None or storage is None or sys.byteorder != "little":
        return None
    numel = 1
    for size in shape:
        numel *= size
    pickle_at = _data(head, records["data.pkl"], length) if "data.pkl" in records else None
    storage_at = _data(head, records["data/0"], length) if "data/0" in records else None
    if pickle_at is None or storage_at is None:
        return None
    if records["data/0"][2] != numel * torch.empty((), dtype=dtype).element_size():
        return None
    if "byteorder" in records:
        order_at = _data(head, records["byteorder"], length)
        size = records["byteorder"][2]
        if order_at is None or head[order_at : order_at + size] != b"little":
            return None
    if any(name.startswith("data/") and name != "data/0" for name in records):
        return None
    pickled = head[pickle_at : pickle_at + records["data.pkl"][2]]
    if len(pickled) != records["data.pkl"][2]:
        return None
    ordered = ("call", ("global", "collections OrderedDict"), ())
    persid = ("persid", ("storage", ("global", f"torch {storage}"), "0", "cpu", numel))
    rebuilt = (persid, 0, tuple(shape), _contiguous(tuple(shape)), False, ordered)
    expected = ("call", ("global", "torch._utils _rebuild_tensor_v2"), rebuilt)
    return storage_at if _parsed(pickled) == expected else None


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
        for name in sorted(set(checks) & early):
            assert started is not None
            started.verified(name)
        if started is not None:  # its files, open, for the items too
            opened = {**started.opened, **opened}
        checking = False
        storage = plan.planner.metadata.storage_data
        for item in plan.reads:
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


def _check_item(
    directory: Path, plan: Any, item: ReadItem, info: Any, fd: int, checked: Checked
) -> None:
    """Find ``item`` (where ``info`` says, in the file open as ``fd``) for ``checked``."""
    length = info.length
    if item.type == LoadItemType.BYTE_IO:
        plan.planner.load_bytes(item, io.BytesIO(os.pread(fd, length, info.offset)))
        return
    md = plan.planner.metadata.state_dict_metadata[item.storage_index.fqn]
    chunk = next(c for c in md.chunks if c.offsets == item.storage_index.offset)
    dtype, shape = md.properties.dtype, tuple(chunk.sizes)
    look = min(length, _LOOK)
    head = os.pread(fd, look, info.offset)
    tail = os.pread(fd, look, info.offset + length - look)
    at = raw_record(head, tail, length, dtype, shape)
    if at is not None:
        checked._raw.append((item, fd, info.offset + at, dtype, shape))
        return
    data = os.pread(fd, length, info.offset)
    loaded = torch.load(cast(IO[bytes], _Bytes(data)), map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != shape:
        raise CheckpointCorrupt(f"{directory}: {info.relative_path} holds no {shape} tensor there")
    checked._loaded.append((item, loaded))
