# A torch.save'd tensor's container, read without unpickling: where its elements lie in it.
#
# Rules: a torch.save'd tensor is a zip whose central directory, data.pkl and one storage record
# are parsed — never unpickled: data.pkl's opcodes are only read (pickletools), and compared with
# those of a contiguous CPU tensor of the dtype and shape the caller expects — and the record's
# size must be numel x itemsize, its bytes little-endian and stored uncompressed; anything else
# (another stride, a record stored compressed or past 4 GiB, a damaged container) is "not found"
# (None), never an exception, never a position past the item: the caller then loads it with
# torch.load(weights_only=True).
# How: pure functions over the item's first and last bytes (pitstop.shell.sharded.rawread reads
# them); the parse of a data.pkl is remembered (a checkpoint's items share a few).

"""Where a torch.save'd tensor's elements lie in its zip, found without unpickling."""

from __future__ import annotations

import pickletools
import struct
import sys
from typing import Any, Final

import torch

__all__ = ["raw_record"]

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
