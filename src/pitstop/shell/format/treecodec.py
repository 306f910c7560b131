# Nested Python trees <-> msgpack, exactly, and without ever running code.
#
# Rules: what a tree may hold is decided by pitstop.shell.format.treewalk (dict, OrderedDict, list,
# tuple, set, frozenset, torch.Size, str, bytes, int in the int64/uint64 range, float, bool,
# None, torch.dtype and tensors, by exact type); encoding walks the tree with its walk, so a
# value it refuses is a SaveError naming the key path (`state.scheduler.lr_lambdas[0]`), raised
# before a byte of the file is written. The exact type comes back: a tuple stays a tuple, a set
# a set, int keys stay ints. Decoding accepts only what encoding produces: known ext codes,
# allow-listed dtype names, ext values nested at most MAX_DEPTH deep, at most
# MAX_MANIFEST_NODES values built (counted as they are built, so that a small hostile manifest
# cannot cost gigabytes); anything else is CheckpointCorrupt. What the values may be is
# checked after (pitstop.shell.format.treecheck).
# How: str/bytes/int/float/bool/None/list/dict are native msgpack; every other type is an
# ExtType whose payload is the msgpack of its contents (a dtype: its name; a tensor: its index
# in the file's tensor table; a NumPy array: its dtype name, shape and bytes, checked by
# pitstop.core.file.arrays before NumPy builds it). Tensors go to a callback while encoding and come
# back as TensorRef placeholders when decoding; the file reader resolves them.

"""Encoding and decoding of nested Python trees (state dicts and the like) as msgpack."""

from __future__ import annotations

import collections
import sys
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

import msgpack

from pitstop.core.file.manifest import MAX_MANIFEST_NODES
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import numpyvalues
from pitstop.shell.format.treecheck import TensorRef
from pitstop.shell.format.treewalk import (
    MAX_DEPTH,
    Builder,
    TensorVisit,
    dtype_name,
    dtypes,
    join_key,
    short,
    show_path,
    tensor_dtypes,
    type_name,
    walk,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXT_CODES",
    "MAX_DEPTH",
    "ValueBudget",
    "count_values",
    "dtype_name",
    "dtypes",
    "encode_tree",
    "join_key",
    "manifest_budget",
    "partial_map",
    "show_path",
    "tensor_dtypes",
    "unpack",
    "unpacker",
]

# Ext type codes. Never renumber one: files on disk carry them.
EXT_TUPLE: Final = 1
EXT_SET: Final = 2
EXT_FROZENSET: Final = 3
EXT_ORDERED_DICT: Final = 4
EXT_SIZE: Final = 5
EXT_DTYPE: Final = 6
EXT_TENSOR: Final = 7
EXT_NDARRAY: Final = 8
EXT_NPSCALAR: Final = 9
EXT_CODES: Final = MappingProxyType(
    {
        EXT_TUPLE: "tuple",
        EXT_SET: "set",
        EXT_FROZENSET: "frozenset",
        EXT_ORDERED_DICT: "OrderedDict",
        EXT_SIZE: "torch.Size",
        EXT_DTYPE: "torch.dtype",
        EXT_TENSOR: "tensor",
        EXT_NDARRAY: "numpy.ndarray",
        EXT_NPSCALAR: "NumPy scalar",
    }
)


# --- encoding ---------------------------------------------------------------------------------

TensorCallback = TensorVisit  # (tensor, key path) -> its index in the file's tensor table


def encode_tree(
    tree: object,
    *,
    on_tensor: TensorCallback | None,
    root: str = "",
    numpy_seen: list[bool] | None = None,
) -> bytes:
    """Return the msgpack encoding of ``tree``.

    ``numpy_seen``: set to ``[True]`` when the tree holds a NumPy value (which only a format
    version 2 reader decodes: the writer then says so in the file's version).

    Each distinct tensor object is passed once to ``on_tensor(tensor, key_path)``, which
    returns its index in the file's tensor table. ``on_tensor=None`` forbids tensors. ``root``
    prefixes key paths in messages. Raises :class:`~pitstop.errors.SaveError` naming the key
    path of the first value that cannot be stored (the rules of
    :mod:`pitstop.shell.format.treewalk`).
    """
    visit: TensorVisit | None = None
    if on_tensor is not None:
        index_of = on_tensor

        def visit(tensor: torch.Tensor, path: str) -> object:
            return _ext(EXT_TENSOR, index_of(tensor, path))

    builder = _Msgpack()
    native = walk(tree, on_tensor=visit, build=builder, root=root)
    if numpy_seen is not None:
        numpy_seen[:] = [builder.numpy_seen]
    packed: bytes = msgpack.packb(native, use_bin_type=True)
    return packed


def _ext(code: int, content: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(content, use_bin_type=True))


class _Msgpack(Builder):
    """Builds msgpack values: native maps and arrays, ext types for everything else."""

    def __init__(self) -> None:
        self.numpy_seen = False

    def mapping(self, kind: type, items: dict[object, object]) -> object:
        return items if kind is dict else _ext(EXT_ORDERED_DICT, items)

    def sequence(self, kind: type, items: list[object]) -> object:
        return items if kind is list else _ext(EXT_TUPLE, items)

    def members(self, kind: type, items: list[object]) -> object:
        # Sorted by encoding, so equal sets give equal bytes whatever the hash seed.
        items.sort(key=lambda m: msgpack.packb(m, use_bin_type=True))
        return _ext(EXT_SET if kind is set else EXT_FROZENSET, items)

    def size(self, value: torch.Size) -> object:
        return _ext(EXT_SIZE, list(value))

    def dtype(self, value: torch.dtype, name: str) -> object:
        return msgpack.ExtType(EXT_DTYPE, name.encode("ascii"))

    def numpy(self, value: object, is_array: bool) -> object:
        self.numpy_seen = True
        return _ext(EXT_NDARRAY if is_array else EXT_NPSCALAR, numpyvalues.payload(value, is_array))


# --- decoding ---------------------------------------------------------------------------------


class ValueBudget:
    """How many values the decodes of one manifest may still build: each map or array counts
    once and each of its items once (a map's keys and values both), ext payloads included.
    ``limit=None`` counts without a limit (a writer measuring what it would write)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.ceiling = sys.maxsize if limit is None else limit
        self.used = 0

    def take(self, count: int) -> None:
        """Count ``count`` more values; CheckpointCorrupt once past the limit."""
        self.used += count
        if self.used > self.ceiling:
            raise CheckpointCorrupt(
                f"more than {self.limit:,} values (maps and arrays, and their items): "
                f"a reader decodes at most that many"
            )


def manifest_budget() -> ValueBudget:
    """The budget of one manifest's decodes: ``MAX_MANIFEST_NODES`` values."""
    return ValueBudget(MAX_MANIFEST_NODES)


def unpack(data: bytes, budget: ValueBudget | None = None) -> object:
    """Decode msgpack ``data`` written by :func:`encode_tree` (or a manifest holding such trees).

    Tensors come back as :class:`TensorRef`. Only known ext codes and allow-listed dtype names
    are accepted; lengths are bounded by ``len(data)``, nesting of ext values by
    ``MAX_DEPTH`` and the values built by ``budget`` (default: a manifest's,
    :func:`manifest_budget`), counted as they are built, so that no decode holds more. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` on anything else.
    """
    try:
        return _Decoder(budget or manifest_budget()).unpackb(data)
    except CheckpointCorrupt:
        raise
    except Exception as error:  # hostile bytes: whatever msgpack or a hook trips over
        raise CheckpointCorrupt(f"not a valid manifest encoding: {error!r}") from error


def unpacker(data: bytes, budget: ValueBudget) -> msgpack.Unpacker:
    """A streaming decoder over ``data`` with :func:`unpack`'s rules, for a reader that decodes
    some of a map's values and skips the others (``Unpacker.skip`` builds nothing). Its errors
    are msgpack's and CheckpointCorrupt: the caller names them."""
    decoder = _Decoder(budget)
    stream = msgpack.Unpacker(**decoder.options(len(data)))
    stream.feed(data)
    return stream


def count_values(data: bytes) -> int:
    """How many values a reader builds decoding ``data``: what :class:`ValueBudget` counts."""
    budget = ValueBudget(limit=None)
    unpack(data, budget)
    return budget.used


class _Decoder:
    """The hooks of one manifest's decode: ext values (nested at most MAX_DEPTH deep) and the
    value budget, shared by the decodes of ext payloads."""

    def __init__(self, budget: ValueBudget) -> None:
        self.budget = budget
        self.depth = 0

    def options(self, size: int) -> dict[str, object]:
        # No container longer than the budget allows is built before its hook sees it.
        longest = size if self.budget.limit is None else min(size, self.budget.limit)
        return {
            "ext_hook": self.ext,
            "list_hook": self.array,
            "object_hook": self.map,
            "raw": False,
            "use_list": True,
            "strict_map_key": False,
            "max_str_len": size,
            "max_bin_len": size,
            "max_array_len": longest,
            "max_map_len": longest // 2,
            "max_ext_len": size,
        }

    def unpackb(self, data: bytes) -> object:
        return msgpack.unpackb(data, **self.options(len(data)))

    def array(self, items: list[object]) -> list[object]:
        budget = self.budget  # inline: called once per array of the manifest
        budget.used += 1 + len(items)
        if budget.used > budget.ceiling:
            budget.take(0)
        return items

    def map(self, items: dict[object, object]) -> dict[object, object]:
        budget = self.budget
        budget.used += 1 + 2 * len(items)
        if budget.used > budget.ceiling:
            budget.take(0)
        return items

    def ext(self, code: int, payload: bytes) -> object:
        if code == EXT_DTYPE:
            name = payload.decode("ascii", errors="replace")
            dtype = dtypes().get(name)  # imports torch: only it can rebuild a dtype value
            if dtype is None:
                raise CheckpointCorrupt(f"unknown dtype name {short(name)}")
            return dtype
        if code not in EXT_CODES:
            raise CheckpointCorrupt(f"unknown msgpack ext code {code}")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CheckpointCorrupt(f"values nested deeper than {MAX_DEPTH} levels")
        try:
            content = self.unpackb(payload)
        finally:
            self.depth -= 1
        return _build(code, content)


def _build(code: int, content: object) -> object:
    name = EXT_CODES[code]
    if code == EXT_ORDERED_DICT:
        if type(content) is not dict:
            raise CheckpointCorrupt(f"ext {name} must hold a map, got {type_name(content)}")
        return collections.OrderedDict(content)
    if code == EXT_NDARRAY:
        return numpyvalues.build_array(content)
    if code == EXT_NPSCALAR:
        return numpyvalues.build_scalar(content)
    if code == EXT_TENSOR:
        if type(content) is not int or content < 0:
            raise CheckpointCorrupt(f"ext tensor must hold an index >= 0, got {short(content)}")
        return TensorRef(content)
    if type(content) is not list:
        raise CheckpointCorrupt(f"ext {name} must hold an array, got {type_name(content)}")
    if code == EXT_TUPLE:
        return tuple(content)
    if code == EXT_SIZE:
        if not all(type(d) is int and 0 <= d < (1 << 63) for d in content):
            raise CheckpointCorrupt(f"ext torch.Size holds a bad dimension: {short(content)}")
        import torch  # a torch.Size value: torch is needed to build it

        return torch.Size(content)
    members = set(content)  # TypeError (unhashable member) is reported by unpack()
    if len(members) != len(content):
        raise CheckpointCorrupt(f"ext {name} holds duplicate members")
    return members if code == EXT_SET else frozenset(members)


def partial_map(stream: msgpack.Unpacker, skip: Mapping[str, Collection[str]]) -> object:
    """A map from ``stream`` whose entries ``skip`` names (a key: the keys of its own map to
    skip) are left out; a value that is no map comes back whole, for the checks to name."""
    try:
        length = stream.read_map_header()
    except msgpack.UnpackValueError:  # not a map: decoded whole, refused by the meta check
        return stream.unpack()
    result: dict[object, object] = {}
    for _ in range(length):
        key = stream.unpack()
        inner = skip.get(key) if isinstance(key, str) else None
        if inner is None:
            result[key] = stream.unpack()
            continue
        try:
            count = stream.read_map_header()
        except msgpack.UnpackValueError:
            result[key] = stream.unpack()
            continue
        value: dict[object, object] = {}
        for _ in range(count):
            entry = stream.unpack()
            if isinstance(entry, str) and entry in inner:
                stream.skip()
            else:
                value[entry] = stream.unpack()
        result[key] = value
    return result
