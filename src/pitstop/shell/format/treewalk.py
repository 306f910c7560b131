# What a checkpoint tree may hold, decided once for every path that saves one.
#
# Rules: a tree is built from these types, compared by exact type (a subclass is not its base:
# a defaultdict is not a dict, a namedtuple is not a tuple, a bool is not an int):
#   containers  dict, OrderedDict, list, tuple, set, frozenset
#   leaves      str, bytes, int (in [-2**63, 2**64 - 1]), float, bool, None, torch.Size,
#               torch.dtype (the allow-listed names), dense tensors (torch.Tensor and
#               nn.Parameter; not sparse, nested, quantized or on the meta device), and NumPy
#               arrays and scalars of numeric dtypes (pitstop.shell.format.numpyvalues; not in
#               a Checkpointer's config, which is compared on resume)
# A tensor is never a dict key or a set member; containers nest at most MAX_DEPTH deep. Anything
# else is a SaveError naming its key path (`state.scheduler.lr_lambdas[0]`), raised by the walk
# — so before a byte is copied or written. A synchronous save (prepare, through the tree
# encoder), a background one (the staging snapshot) and the writer's meta all walk with `walk`,
# so they accept and refuse the same trees with the same message; the reader checks a decoded
# tree against the same tables (pitstop.shell.format.treecheck.check_tree).
# How: one recursive walk. Scalars are checked inline by exact type, since RNG states are long
# tuples of ints and a snapshot runs while the training loop waits. A Builder rebuilds each
# container from its walked contents (the same types for a snapshot, msgpack values for the
# encoder). Each distinct tensor object is checked and handed to the caller's function once;
# later occurrences get the same result, so tied weights stay tied. Torch is imported by the
# walk and by the functions that build the torch tables (tensor_dtypes, dtypes, leaves), never
# by this module: reading and checking a manifest uses names and ITEMSIZES only.

"""The one definition of what a checkpoint tree may hold, and the walk that enforces it."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, TypeAlias

from pitstop.core.file.manifest import MAX_NDIM
from pitstop.errors import SaveError
from pitstop.shell.format import numpyvalues

if TYPE_CHECKING:
    import torch

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "ITEMSIZES",
    "MAPPINGS",
    "MAX_DEPTH",
    "SCALARS",
    "SEQUENCES",
    "SETS",
    "Builder",
    "TensorVisit",
    "dtype_name",
    "dtypes",
    "join_key",
    "leaves",
    "short",
    "show_path",
    "storage_of",
    "tensor_dtypes",
    "type_name",
    "walk",
]

MAX_DEPTH: Final = 128  # containers nested deeper than this are refused (write) / corrupt (read)
INT_MIN: Final = -(1 << 63)
INT_MAX: Final = (1 << 64) - 1

# The types a tree may hold, by exact type.
SCALARS: Final[frozenset[type]] = frozenset({str, bytes, int, float, bool, type(None)})
"""Leaves that hold nothing else (an int must also lie in [INT_MIN, INT_MAX])."""
MAPPINGS: Final = frozenset({dict, collections.OrderedDict})
SEQUENCES: Final = frozenset({list, tuple})
SETS: Final = frozenset({set, frozenset})
_NON_INT_SCALARS: Final = SCALARS - {int}
_CONTENTS: Final = (
    "dict, OrderedDict, list, tuple, set, frozenset, str, bytes, int, float, bool, None, "
    "torch.dtype, torch.Size, tensors and NumPy arrays and scalars"
)

# The dtype allow-list, by the name torch prints (`torch.float32` -> "float32"), with the bytes
# per element of a stored tensor: all that reading and checking a manifest needs, so listing,
# inspecting and verifying a checkpoint never import torch. A name is only ever looked up in
# these tables, never resolved by getattr on untrusted input. Names this torch lacks are left
# out of tensor_dtypes() and dtypes(), so an older torch simply loads fewer dtypes.
ITEMSIZES: Final[Mapping[str, int]] = MappingProxyType(
    {
        **dict.fromkeys(("bool", "uint8", "int8", "bits1x8", "bits2x4", "bits4x2", "bits8"), 1),
        **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"), 1),
        **dict.fromkeys(("float8_e8m0fnu", "float4_e2m1fn_x2"), 1),
        **dict.fromkeys((f"{u}int{n}" for u in ("", "u") for n in range(1, 8)), 1),  # sub-byte
        **dict.fromkeys(("int16", "uint16", "float16", "bfloat16", "bits16"), 2),
        **dict.fromkeys(("int32", "uint32", "float32", "complex32"), 4),
        **dict.fromkeys(("int64", "uint64", "float64", "complex64"), 8),
        "complex128": 16,
    }
)
"""Dtypes a stored tensor may have: bytes per element, by name (as the reader checks them)."""
# Quantized dtypes may appear as values in a tree, but quantized tensors are not stored.
_VALUE_ONLY_DTYPE_NAMES: Final = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


def _dtype_table(names: tuple[str, ...]) -> Mapping[str, torch.dtype]:
    import torch

    table: dict[str, torch.dtype] = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if (
            isinstance(dtype, torch.dtype)
            and str(dtype) == f"torch.{name}"
            and dtype.itemsize == ITEMSIZES.get(name, dtype.itemsize)
        ):
            table[name] = dtype
    return MappingProxyType(table)


@cache
def tensor_dtypes() -> Mapping[str, torch.dtype]:
    """Dtypes a stored tensor may have, by name: those of :data:`ITEMSIZES` this torch has
    (imports torch)."""
    return _dtype_table(tuple(ITEMSIZES))


@cache
def dtypes() -> Mapping[str, torch.dtype]:
    """Dtypes a tree may hold as values, by name (imports torch)."""
    return _dtype_table((*ITEMSIZES, *_VALUE_ONLY_DTYPE_NAMES))


@cache
def _dtype_set() -> frozenset[torch.dtype]:
    return frozenset(dtypes().values())


@cache
def _tensor_dtype_set() -> frozenset[torch.dtype]:
    return frozenset(tensor_dtypes().values())


@cache
def leaves() -> frozenset[type]:
    """Every leaf type but a tensor: :data:`SCALARS`, ``torch.Size`` and ``torch.dtype``
    (imports torch; a tree holds neither of the last two unless torch is loaded)."""
    import torch

    return SCALARS | frozenset({torch.Size, torch.dtype})


def dtype_name(dtype: torch.dtype) -> str:
    """Return the name a dtype is stored under (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


# --- key paths --------------------------------------------------------------------------------


def join_key(path: str, key: object) -> str:
    """Return the key path of ``key`` under ``path``: ``a.b``, ``a[0]``, ``a['x.y']``."""
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{short(key)}]"


def show_path(path: str) -> str:
    """Return ``path`` for a message (the root is ``<root>``)."""
    return path or "<root>"


def short(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def type_name(value: object) -> str:
    """The name of ``value``'s type, with its module unless it is a builtin."""
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


# --- tensors ----------------------------------------------------------------------------------


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    import torch

    where = show_path(path)
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        raise SaveError(
            f"{where}: tensor subclass {type(tensor).__qualname__} is not supported; "
            f"store a plain tensor"
        )
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise SaveError(f"{where}: {tensor.layout} tensors are not supported, only dense ones")
    if tensor.is_quantized:
        raise SaveError(f"{where}: quantized tensors are not supported")
    if tensor.is_meta:
        raise SaveError(f"{where}: a tensor on the meta device has no data to save")
    if tensor.dtype not in _tensor_dtype_set():
        raise SaveError(f"{where}: tensors of dtype {tensor.dtype} are not supported")
    if tensor.dim() > MAX_NDIM:
        raise SaveError(f"{where}: {tensor.dim()} dimensions is more than {MAX_NDIM}")


def storage_of(tensor: torch.Tensor, path: str) -> torch.UntypedStorage:
    """``tensor``'s storage; a :class:`~pitstop.errors.SaveError` naming ``path`` if it has none."""
    try:
        return tensor.untyped_storage()
    except RuntimeError as error:  # a tensor without accessible storage
        raise SaveError(f"{show_path(path)}: cannot read the tensor's storage: {error}") from error


# --- the walk ---------------------------------------------------------------------------------


class Builder:
    """How a walk rebuilds each container from its walked contents.

    This one rebuilds the same types: a copy of every container, so that changing the live
    tree's containers later does not change the copy. Subclasses build other values, such as
    msgpack's.
    """

    def mapping(self, kind: type, items: dict[object, object]) -> object:
        """A dict or OrderedDict (``kind``) holding ``items``, in order."""
        return items if kind is dict else collections.OrderedDict(items)

    def sequence(self, kind: type, items: list[object]) -> object:
        """A list or tuple (``kind``) of ``items``."""
        return items if kind is list else tuple(items)

    def members(self, kind: type, items: list[object]) -> object:
        """A set or frozenset (``kind``) of ``items``."""
        return set(items) if kind is set else frozenset(items)

    def size(self, value: torch.Size) -> object:
        """A torch.Size leaf."""
        return value

    def dtype(self, value: torch.dtype, name: str) -> object:
        """A torch.dtype leaf, stored under ``name``."""
        return value

    def numpy(self, value: object, is_array: bool) -> object:
        """A checked NumPy leaf (an array when ``is_array``, else a scalar): a copy of it."""
        return numpyvalues.copy(value, is_array)


TensorVisit: TypeAlias = Callable[["torch.Tensor", str], object]
"""Called once per distinct tensor object, with its (first) key path; returns its replacement."""

SAME_TYPES: Final = Builder()


def walk(
    tree: object,
    *,
    on_tensor: TensorVisit | None,
    build: Builder = SAME_TYPES,
    root: str = "",
    numpy: bool = True,
) -> object:
    """Check ``tree`` against the rules above and rebuild it with ``build``.

    Each distinct tensor object is checked, then replaced by ``on_tensor(tensor, key_path)``
    (every occurrence by the same result); ``on_tensor=None`` forbids tensors. ``root``
    prefixes key paths in messages; ``numpy=False`` refuses NumPy values. Raises
    :class:`~pitstop.errors.SaveError` naming the key path of the first value (in depth-first
    order) that a checkpoint cannot hold.
    """
    try:
        return _Walk(on_tensor, build, numpy).value(tree, root, 0, None)
    except RecursionError:
        raise SaveError(
            f"{show_path(root)}: the tree is nested too deeply to walk (limit {MAX_DEPTH})"
        ) from None


class _Walk:
    def __init__(self, on_tensor: TensorVisit | None, build: Builder, numpy: bool) -> None:
        import torch  # a tree to save: torch is loaded (its types, bound once per walk)

        self._tensor_type: type[torch.Tensor] = torch.Tensor
        self._parameter_type: type[torch.nn.Parameter] = torch.nn.Parameter
        self._size_type: type[torch.Size] = torch.Size
        self._dtype_type: type[torch.dtype] = torch.dtype
        self._dtypes = _dtype_set()
        self._on_tensor = on_tensor
        self._build = build
        self._numpy = numpy
        self._done: dict[int, object] = {}  # id(tensor) -> its replacement; the tree keeps ids

    def value(self, value: object, path: str, depth: int, hashable: str | None) -> object:
        # ``hashable`` names the role ("dict key", "set member") when value must stay hashable.
        if depth > MAX_DEPTH:
            raise SaveError(f"{show_path(path)}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if kind is self._tensor_type or kind is self._parameter_type:  # the commonest leaf first
            assert isinstance(value, self._tensor_type)
            return self._tensor(value, path, hashable)
        if kind in _NON_INT_SCALARS:
            return value
        if kind is int:
            assert isinstance(value, int)
            if not INT_MIN <= value <= INT_MAX:
                raise SaveError(
                    f"{show_path(path)}: int {short(value)} is outside the int64/uint64 range "
                    f"a checkpoint stores ([-2**63, 2**64 - 1])"
                )
            return value
        if kind is dict or kind is collections.OrderedDict:
            assert isinstance(value, dict)
            return self._mapping(kind, value, path, depth + 1)
        if kind is list or kind is tuple:
            assert isinstance(value, (list, tuple))
            return self._sequence(kind, value, path, depth + 1, hashable)
        if kind is set or kind is frozenset:
            assert isinstance(value, (set, frozenset))
            return self._members(kind, value, path, depth + 1)
        if kind is self._size_type:
            assert isinstance(value, self._size_type)
            return self._build.size(value)
        if kind is self._dtype_type:
            assert isinstance(value, self._dtype_type)
            if value not in self._dtypes:
                raise SaveError(f"{show_path(path)}: dtype {value} cannot be stored")
            return self._build.dtype(value, dtype_name(value))
        if isinstance(value, self._tensor_type):  # a subclass: _tensor() refuses it by name
            return self._tensor(value, path, hashable)
        if numpyvalues.is_numpy(value):
            if not self._numpy:
                raise SaveError(
                    f"{show_path(path)}: NumPy values are not allowed here ({short(value)}); "
                    f"convert it with .item() or .tolist()"
                )
            is_array = numpyvalues.check(value, show_path(path))
            return self._build.numpy(value, is_array)
        raise SaveError(
            f"{show_path(path)}: cannot store a value of type {type_name(value)} "
            f"({short(value)}); a checkpoint holds {_CONTENTS}"
        )

    # Each container loop passes scalars through inline — the same test as value()'s first
    # branches — and only calls value() (and builds a key path) for anything else.

    def _mapping(self, kind: type, node: dict[object, object], path: str, depth: int) -> object:
        low, high, plain = INT_MIN, INT_MAX, _NON_INT_SCALARS
        out: dict[object, object] = {}
        for key, item in node.items():
            kk = type(key)
            stored_key = (
                key
                if kk in plain or (kk is int and low <= key <= high)  # type: ignore[operator]
                else self.value(key, f"{show_path(path)} (key {short(key)})", depth, "dict key")
            )
            ki = type(item)
            out[stored_key] = (
                item
                if ki in plain or (ki is int and low <= item <= high)  # type: ignore[operator]
                else self.value(item, join_key(path, key), depth, None)
            )
        return self._build.mapping(kind, out)

    def _sequence(
        self,
        kind: type,
        node: list[object] | tuple[object, ...],
        path: str,
        depth: int,
        hashable: str | None,
    ) -> object:
        low, high, plain = INT_MIN, INT_MAX, _NON_INT_SCALARS
        items = [
            item
            if (ki := type(item)) in plain or (ki is int and low <= item <= high)  # type: ignore[operator]
            else self.value(item, join_key(path, index), depth, hashable)
            for index, item in enumerate(node)
        ]
        return self._build.sequence(kind, items)

    def _members(
        self, kind: type, node: set[object] | frozenset[object], path: str, depth: int
    ) -> object:
        items = [self.value(m, f"{path}{{{short(m)}}}", depth, "set member") for m in node]
        return self._build.members(kind, items)

    def _tensor(self, tensor: torch.Tensor, path: str, hashable: str | None) -> object:
        if hashable is not None:
            raise SaveError(f"{show_path(path)}: a tensor cannot be stored as a {hashable}")
        if self._on_tensor is None:
            raise SaveError(f"{show_path(path)}: tensors are not allowed here")
        done = self._done.get(id(tensor), _NOT_YET)
        if done is not _NOT_YET:
            return done
        _check_tensor(tensor, path)
        result = self._on_tensor(tensor, path)
        self._done[id(tensor)] = result
        return result


_NOT_YET: Final = object()
