# Nested Python trees <-> msgpack, exactly, and without ever running code.
#
# Rules: a tree is built from dict, OrderedDict, list, tuple, set, frozenset, torch.Size, str,
# bytes, int (int64/uint64 range), float, bool, None, torch.dtype and tensors. Anything else is
# a SaveError naming its key path (`state.scheduler.lr_lambdas[0]`), raised while encoding, so
# before a byte of the file is written. The exact type comes back: a tuple stays a tuple, a set a
# set, int keys stay ints. Decoding accepts only what encoding produces: known ext codes,
# allow-listed dtype names, nesting at most MAX_DEPTH deep; anything else is CheckpointCorrupt.
# How: str/bytes/int/float/bool/None/list/dict are native msgpack; every other type is an
# ExtType whose payload is the msgpack of its contents (a dtype: its name; a tensor: its index
# in the file's tensor table). Tensors go to a callback while encoding and come back as TensorRef
# placeholders when decoding; the file format resolves them.

"""Encoding and decoding of nested Python trees (state dicts and the like) as msgpack."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Final

import attrs
import msgpack
import torch

from pitstop.errors import CheckpointCorrupt, SaveError

__all__ = [
    "DTYPES",
    "EXT_CODES",
    "MAX_DEPTH",
    "TENSOR_DTYPES",
    "TensorRef",
    "check_tree",
    "dtype_name",
    "encode_tree",
    "join_key",
    "resolve",
    "show_path",
    "subtree",
    "tensor_refs",
    "unpack",
]

MAX_DEPTH: Final = 128  # containers nested deeper than this are refused (write) / corrupt (read)
INT_MIN: Final = -(1 << 63)
INT_MAX: Final = (1 << 64) - 1

# Ext type codes. Never renumber one: files on disk carry them.
EXT_TUPLE: Final = 1
EXT_SET: Final = 2
EXT_FROZENSET: Final = 3
EXT_ORDERED_DICT: Final = 4
EXT_SIZE: Final = 5
EXT_DTYPE: Final = 6
EXT_TENSOR: Final = 7
EXT_CODES: Final = MappingProxyType(
    {
        EXT_TUPLE: "tuple",
        EXT_SET: "set",
        EXT_FROZENSET: "frozenset",
        EXT_ORDERED_DICT: "OrderedDict",
        EXT_SIZE: "torch.Size",
        EXT_DTYPE: "torch.dtype",
        EXT_TENSOR: "tensor",
    }
)

# The dtype allow-list, by the name torch prints (`torch.float32` -> "float32"). A name is only
# ever looked up in this table, never resolved by getattr on untrusted input. Names this torch
# lacks are skipped, so an older torch simply reads fewer dtypes.
_TENSOR_DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
)
# Quantized dtypes may appear as values in a tree, but quantized tensors are not stored.
_VALUE_ONLY_DTYPE_NAMES: Final = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


def _dtype_table(names: Sequence[str]) -> Mapping[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}":
            table[name] = dtype
    return MappingProxyType(table)


TENSOR_DTYPES: Final = _dtype_table(_TENSOR_DTYPE_NAMES)
"""Dtypes a stored tensor may have, by name."""
DTYPES: Final = _dtype_table((*_TENSOR_DTYPE_NAMES, *_VALUE_ONLY_DTYPE_NAMES))
"""Dtypes a tree may hold as values, by name."""


def dtype_name(dtype: torch.dtype) -> str:
    """Return the name a dtype is stored under (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class TensorRef:
    """Placeholder for a stored tensor in a decoded tree: ``index`` into the tensor table."""

    index: int


# --- key paths --------------------------------------------------------------------------------


def join_key(path: str, key: object) -> str:
    """Return the key path of ``key`` under ``path``: ``a.b``, ``a[0]``, ``a['x.y']``."""
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{_short(key)}]"


def show_path(path: str) -> str:
    """Return ``path`` for a message (the root is ``<root>``)."""
    return path or "<root>"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _type_name(value: object) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


# --- encoding ---------------------------------------------------------------------------------

TensorCallback = Callable[[torch.Tensor, str], int]


def encode_tree(tree: object, *, on_tensor: TensorCallback | None, root: str = "") -> bytes:
    """Return the msgpack encoding of ``tree``.

    Each tensor is passed to ``on_tensor(tensor, key_path)``, which returns its index in the
    file's tensor table. ``on_tensor=None`` forbids tensors. ``root`` prefixes key paths in
    messages. Raises :class:`~pitstop.errors.SaveError` naming the key path of the first value
    that cannot be stored.
    """
    try:
        native = _Encoder(on_tensor).encode(tree, root, 0, None)
    except RecursionError:
        raise SaveError(
            f"{show_path(root)}: the tree is nested too deeply to encode (limit {MAX_DEPTH})"
        ) from None
    packed: bytes = msgpack.packb(native, use_bin_type=True)
    return packed


def _ext(code: int, content: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(content, use_bin_type=True))


class _Encoder:
    def __init__(self, on_tensor: TensorCallback | None) -> None:
        self._on_tensor = on_tensor

    def encode(self, value: object, path: str, depth: int, hashable: str | None) -> object:
        # ``hashable`` names the role ("dict key", "set member") when value must stay hashable.
        if depth > MAX_DEPTH:
            raise SaveError(f"{show_path(path)}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if value is None or kind in (str, bytes, float, bool):
            return value
        if kind is int:
            assert isinstance(value, int)
            if not INT_MIN <= value <= INT_MAX:
                raise SaveError(
                    f"{show_path(path)}: int {_short(value)} is outside the int64/uint64 range "
                    f"a checkpoint stores ([-2**63, 2**64 - 1])"
                )
            return value
        if kind is dict or kind is collections.OrderedDict:
            assert isinstance(value, dict)
            encoded = {
                self.encode(k, f"{show_path(path)} (key {_short(k)})", depth + 1, "dict key"): (
                    self.encode(v, join_key(path, k), depth + 1, None)
                )
                for k, v in value.items()
            }
            return encoded if kind is dict else _ext(EXT_ORDERED_DICT, encoded)
        if kind is list:
            assert isinstance(value, list)
            return [self.encode(v, join_key(path, i), depth + 1, None) for i, v in enumerate(value)]
        if kind is tuple:
            assert isinstance(value, tuple)
            items = [
                self.encode(v, join_key(path, i), depth + 1, hashable) for i, v in enumerate(value)
            ]
            return _ext(EXT_TUPLE, items)
        if kind is set or kind is frozenset:
            assert isinstance(value, (set, frozenset))
            members = [
                self.encode(m, f"{path}{{{_short(m)}}}", depth + 1, "set member") for m in value
            ]
            # Sorted by encoding, so equal sets give equal bytes whatever the hash seed.
            members.sort(key=lambda m: msgpack.packb(m, use_bin_type=True))
            return _ext(EXT_SET if kind is set else EXT_FROZENSET, members)
        if kind is torch.Size:
            assert isinstance(value, torch.Size)
            return _ext(EXT_SIZE, list(value))
        if isinstance(value, torch.dtype):
            name = dtype_name(value)
            if name not in DTYPES:
                raise SaveError(f"{show_path(path)}: dtype {value} cannot be stored")
            return msgpack.ExtType(EXT_DTYPE, name.encode("ascii"))
        if isinstance(value, torch.Tensor):
            if hashable is not None:
                raise SaveError(f"{show_path(path)}: a tensor cannot be stored as a {hashable}")
            if self._on_tensor is None:
                raise SaveError(f"{show_path(path)}: tensors are not allowed here")
            return _ext(EXT_TENSOR, self._on_tensor(value, path))
        raise SaveError(
            f"{show_path(path)}: cannot store a value of type {_type_name(value)} "
            f"({_short(value)}); a checkpoint holds dict, list, tuple, set, frozenset, str, bytes, "
            f"int, float, bool, None, torch.dtype, torch.Size and tensors"
        )


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
            dtype = DTYPES.get(name)
            if dtype is None:
                raise CheckpointCorrupt(f"unknown dtype name {_short(name)}")
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
            raise CheckpointCorrupt(f"ext {name} must hold a map, got {_type_name(content)}")
        return collections.OrderedDict(content)
    if code == EXT_TENSOR:
        if type(content) is not int or content < 0:
            raise CheckpointCorrupt(f"ext tensor must hold an index >= 0, got {_short(content)}")
        return TensorRef(content)
    if type(content) is not list:
        raise CheckpointCorrupt(f"ext {name} must hold an array, got {_type_name(content)}")
    if code == EXT_TUPLE:
        return tuple(content)
    if code == EXT_SIZE:
        if not all(type(d) is int and 0 <= d < (1 << 63) for d in content):
            raise CheckpointCorrupt(f"ext torch.Size holds a bad dimension: {_short(content)}")
        return torch.Size(content)
    members = set(content)  # TypeError (unhashable member) is reported by unpack()
    if len(members) != len(content):
        raise CheckpointCorrupt(f"ext {name} holds duplicate members")
    return members if code == EXT_SET else frozenset(members)


_LEAF_TYPES: Final = (type(None), bool, int, float, str, bytes, torch.dtype)


def check_tree(tree: object, *, root: str, tensor_count: int | None) -> tuple[tuple[str, ...], ...]:
    """Check a decoded tree's value types and tensor references.

    ``tensor_count=None`` means tensors are not allowed (meta). Returns, per tensor index, the
    key paths that reference it. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the
    key path of a value of an unexpected type or a bad reference.
    """
    paths: list[list[str]] = [[] for _ in range(tensor_count or 0)]

    def walk(value: object, path: str, depth: int, hashable: bool) -> None:
        if depth > MAX_DEPTH:
            raise CheckpointCorrupt(f"{show_path(path)}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if kind in _LEAF_TYPES or kind is torch.Size:
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
        if kind is dict or kind is collections.OrderedDict:
            assert isinstance(value, dict)
            for k, v in value.items():
                walk(k, f"{show_path(path)} (key)", depth + 1, True)
                walk(v, join_key(path, k), depth + 1, hashable)
            return
        if kind is list or kind is tuple:
            assert isinstance(value, (list, tuple))
            for i, v in enumerate(value):
                walk(v, join_key(path, i), depth + 1, hashable)
            return
        if kind is set or kind is frozenset:
            assert isinstance(value, (set, frozenset))
            for m in value:
                walk(m, f"{path}{{}}", depth + 1, True)
            return
        raise CheckpointCorrupt(f"{show_path(path)}: unexpected value of type {_type_name(value)}")

    walk(tree, root, 0, False)
    return tuple(tuple(p) for p in paths)


def tensor_refs(tree: object) -> Iterator[TensorRef]:
    """Yield every :class:`TensorRef` in a checked tree (tensors are never keys or members)."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        yield tree
    elif kind is dict or kind is collections.OrderedDict:
        assert isinstance(tree, dict)
        for v in tree.values():
            yield from tensor_refs(v)
    elif kind is list or kind is tuple:
        assert isinstance(tree, (list, tuple))
        for v in tree:
            yield from tensor_refs(v)


def resolve(tree: object, tensors: Mapping[int, torch.Tensor]) -> object:
    """Return a copy of a checked tree with each :class:`TensorRef` replaced from ``tensors``."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        return tensors[tree.index]
    if kind is dict or kind is collections.OrderedDict:
        assert isinstance(tree, dict)
        return kind((k, resolve(v, tensors)) for k, v in tree.items())
    if kind is list or kind is tuple:
        assert isinstance(tree, (list, tuple))
        return kind(resolve(v, tensors) for v in tree)
    if kind is set or kind is frozenset:
        assert isinstance(tree, (set, frozenset))
        return kind(tree)
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
        if (kind is dict or kind is collections.OrderedDict) and key in node:  # type: ignore[operator]
            assert isinstance(node, dict)
            node = node[key]
        elif (kind is list or kind is tuple) and type(key) is int and 0 <= key < len(node):  # type: ignore[arg-type]
            assert isinstance(node, (list, tuple))
            node = node[key]
        else:
            raise KeyError(join_key(path, key))
        path = join_key(path, key)
    return node
