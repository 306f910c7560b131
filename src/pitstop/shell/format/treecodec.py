# Nested Python trees <-> msgpack, exactly, and without ever running code.
#
# Rules: what a tree may hold is decided by pitstop.shell.format.treewalk (dict, OrderedDict, list,
# tuple, set, frozenset, torch.Size, str, bytes, int in the int64/uint64 range, float, bool,
# None, torch.dtype and tensors, by exact type); encoding walks the tree with its walk, so a
# value it refuses is a SaveError naming the key path (`state.scheduler.lr_lambdas[0]`), raised
# before a byte of the file is written. The exact type comes back: a tuple stays a tuple, a set
# a set, int keys stay ints. Decoding accepts only what encoding produces: known ext codes,
# allow-listed dtype names, nesting at most MAX_DEPTH deep, values of the walk's types;
# anything else is CheckpointCorrupt.
# How: str/bytes/int/float/bool/None/list/dict are native msgpack; every other type is an
# ExtType whose payload is the msgpack of its contents (a dtype: its name; a tensor: its index
# in the file's tensor table; a NumPy array: its dtype name, shape and bytes, checked by
# pitstop.core.arrays before NumPy builds it). Tensors go to a callback while encoding and come
# back as TensorRef placeholders when decoding; the file reader resolves them.

"""Encoding and decoding of nested Python trees (state dicts and the like) as msgpack."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

import attrs
import msgpack

from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import numpyvalues
from pitstop.shell.format.treewalk import (
    MAPPINGS,
    MAX_DEPTH,
    SCALARS,
    SEQUENCES,
    SETS,
    Builder,
    TensorVisit,
    dtype_name,
    dtypes,
    join_key,
    leaves,
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
    "TensorRef",
    "check_tree",
    "dtype_name",
    "dtypes",
    "encode_tree",
    "join_key",
    "resolve",
    "show_path",
    "subtree",
    "tensor_dtypes",
    "tensor_refs",
    "unpack",
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


@attrs.frozen
class TensorRef:
    """Placeholder for a stored tensor in a decoded tree: ``index`` into the tensor table."""

    index: int


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


def unpack(data: bytes) -> object:
    """Decode msgpack ``data`` written by :func:`encode_tree` (or a manifest holding such trees).

    Tensors come back as :class:`TensorRef`. Only known ext codes and allow-listed dtype names
    are accepted; lengths are bounded by ``len(data)``. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` on anything else.
    """
    depth = 0

    def hook(code: int, payload: bytes) -> object:
        nonlocal depth
        if code == EXT_DTYPE:
            name = payload.decode("ascii", errors="replace")
            dtype = dtypes().get(name)  # imports torch: only it can rebuild a dtype value
            if dtype is None:
                raise CheckpointCorrupt(f"unknown dtype name {short(name)}")
            return dtype
        if code not in EXT_CODES:
            raise CheckpointCorrupt(f"unknown msgpack ext code {code}")
        depth += 1
        if depth > MAX_DEPTH:
            raise CheckpointCorrupt(f"values nested deeper than {MAX_DEPTH} levels")
        try:
            content = _unpackb(payload, hook)
        finally:
            depth -= 1
        return _build(code, content)

    try:
        return _unpackb(data, hook)
    except CheckpointCorrupt:
        raise
    except Exception as error:  # hostile bytes: whatever msgpack or a hook trips over
        raise CheckpointCorrupt(f"not a valid manifest encoding: {error!r}") from error


def _unpackb(data: bytes, hook: Callable[[int, bytes], object]) -> object:
    size = len(data)
    return msgpack.unpackb(
        data,
        ext_hook=hook,
        raw=False,
        use_list=True,
        strict_map_key=False,
        max_str_len=size,
        max_bin_len=size,
        max_array_len=size,
        max_map_len=size // 2,
        max_ext_len=size,
    )


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


def check_tree(tree: object, *, root: str, tensor_count: int | None) -> tuple[tuple[str, ...], ...]:
    """Check a decoded tree's value types and tensor references.

    ``tensor_count=None`` means tensors are not allowed (meta). Returns, per tensor index, the
    key paths that reference it. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the
    key path of a value of an unexpected type or a bad reference.
    """
    paths: list[list[str]] = [[] for _ in range(tensor_count or 0)]

    def check(value: object, path: str, depth: int, hashable: bool) -> None:
        if depth > MAX_DEPTH:
            raise CheckpointCorrupt(f"{show_path(path)}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if kind in SCALARS:  # an int from msgpack is always in range
            return
        if numpyvalues.is_numpy(value):  # built by the decoder from a checked payload
            return
        if kind is TensorRef:
            assert isinstance(value, TensorRef)
            if tensor_count is None:
                raise CheckpointCorrupt(f"{show_path(path)}: a tensor where none is allowed")
            if hashable:
                raise CheckpointCorrupt(f"{show_path(path)}: a tensor as a dict key or set member")
            if value.index >= tensor_count:
                raise CheckpointCorrupt(
                    f"{show_path(path)}: tensor index {value.index} is not in the tensor table "
                    f"({tensor_count} entries)"
                )
            paths[value.index].append(show_path(path))
            return
        # A leaf one level down passes unless it is too deep: it is not visited (nor its key
        # path built), which is most of a manifest (an RNG's state is 625 ints).
        leaf_passes = depth < MAX_DEPTH
        if kind in MAPPINGS:
            assert isinstance(value, dict)
            for k, v in value.items():
                if not (leaf_passes and type(k) in SCALARS):
                    check(k, f"{show_path(path)} (key)", depth + 1, True)
                if not (leaf_passes and type(v) in SCALARS):
                    check(v, join_key(path, k), depth + 1, hashable)
            return
        if kind in SEQUENCES:
            assert isinstance(value, (list, tuple))
            for i, v in enumerate(value):
                if not (leaf_passes and type(v) in SCALARS):
                    check(v, join_key(path, i), depth + 1, hashable)
            return
        if kind in SETS:
            assert isinstance(value, (set, frozenset))
            for m in value:
                if not (leaf_passes and type(m) in SCALARS):
                    check(m, f"{path}{{}}", depth + 1, True)
            return
        if kind in leaves():  # torch.Size, torch.dtype: decoded values (so torch is loaded)
            return
        raise CheckpointCorrupt(f"{show_path(path)}: unexpected value of type {type_name(value)}")

    check(tree, root, 0, False)
    return tuple(tuple(p) for p in paths)


def tensor_refs(tree: object) -> Iterator[TensorRef]:
    """Yield every :class:`TensorRef` in a checked tree (tensors are never keys or members)."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        yield tree
    elif kind in MAPPINGS:
        assert isinstance(tree, dict)
        for v in tree.values():
            yield from tensor_refs(v)
    elif kind in SEQUENCES:
        assert isinstance(tree, (list, tuple))
        for v in tree:
            yield from tensor_refs(v)


def resolve(tree: object, tensors: Mapping[int, torch.Tensor]) -> object:
    """Return a copy of a checked tree with each :class:`TensorRef` replaced from ``tensors``."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        return tensors[tree.index]
    if kind in MAPPINGS:
        assert isinstance(tree, dict)
        return type(tree)((k, resolve(v, tensors)) for k, v in tree.items())
    if kind in SEQUENCES:
        assert isinstance(tree, (list, tuple))
        return type(tree)(resolve(v, tensors) for v in tree)
    if kind in SETS:
        assert isinstance(tree, (set, frozenset))
        return type(tree)(tree)
    return tree


def subtree(tree: object, select: Sequence[str | int]) -> object:
    """Return the value at key path ``select`` in a decoded tree.

    Dicts are indexed by key (an int key is an int), lists and tuples by position. Raises
    :class:`KeyError` with the key path of the first step that does not exist.
    """
    node = tree
    path = ""
    for key in select:
        kind = type(node)
        if kind in MAPPINGS and key in node:  # type: ignore[operator]
            assert isinstance(node, dict)
            node = node[key]
        elif kind in SEQUENCES and type(key) is int and 0 <= key < len(node):  # type: ignore[arg-type]
            assert isinstance(node, (list, tuple))
            node = node[key]
        else:
            raise KeyError(join_key(path, key))
        path = join_key(path, key)
    return node
