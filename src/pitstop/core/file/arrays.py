# What a stored NumPy value's payload must say, and the check a reader applies to it.
#
# Rules: a NumPy array is stored as [dtype name, shape, bytes] and a NumPy scalar as [dtype name,
# bytes] (docs/file-format.md, ext 8 and 9): the bytes are the C-order, little-endian elements.
# A dtype name is looked up in the reader's allow-list (numbers and bool, never object, str or
# structured dtypes), never resolved dynamically. A shape has at most MAX_NDIM dimensions, each
# an int in [0, 2**63); the bytes are exactly (product of the shape) x itemsize long, computed
# with Python's unbounded ints, so no shape can overflow or claim bytes that are not there. A
# scalar's bytes are exactly one item. Anything else is a CheckpointCorrupt naming what is wrong.
# A .safetensors header entry (a file pitstop imports) is held to the same shape rule: a JSON
# object with a known dtype, a shape of ints in [0, 2**63) (no negative, float or infinite
# dimension) and two int data offsets inside the body, exactly (product of the shape) x itemsize
# apart; anything else is an ImportRefused naming the entry.
# How: pure functions over the decoded msgpack or JSON values; the shell builds the value after.

"""Stored NumPy values: the payload's fields and their checks (no NumPy here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from pitstop.core.file.manifest import MAX_NDIM
from pitstop.errors import CheckpointCorrupt, ImportRefused

__all__ = [
    "NUMPY_DTYPE_NAMES",
    "array_payload",
    "check_array",
    "check_safetensors_entry",
    "check_scalar",
    "scalar_payload",
]

NUMPY_DTYPE_NAMES: Final = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
"""The NumPy dtypes a checkpoint stores, by NumPy's name (``np.dtype(name).name``)."""

_DIM_LIMIT: Final = 1 << 63


def array_payload(name: str, shape: tuple[int, ...], data: bytes) -> list[object]:
    """The payload of a stored NumPy array: its dtype name, shape and C-order bytes."""
    return [name, list(shape), data]


def scalar_payload(name: str, data: bytes) -> list[object]:
    """The payload of a stored NumPy scalar: its dtype name and its one item's bytes."""
    return [name, data]


def _name(value: object, itemsizes: Mapping[str, int], what: str) -> str:
    if type(value) is not str or value not in itemsizes:
        raise CheckpointCorrupt(f"{what}: dtype {value!r} is not one a checkpoint stores")
    return value


def _dimensions(shape: list[object]) -> bool:
    """Whether every dimension of ``shape`` is an int (not a bool or float) in [0, 2**63)."""
    return all(type(d) is int and 0 <= d < _DIM_LIMIT for d in shape)


def _kind(value: object) -> str:
    """``value`` as an error message shows it: a short repr, or only the kind of a nested
    container (whose repr could be huge, or nested past the recursion limit)."""
    if isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)
    ):
        return f"a nested JSON {'object' if isinstance(value, dict) else 'array'}"
    return f"{value!r:.80}"


def check_safetensors_entry(
    where: str, spec: object, body_size: int, itemsizes: Mapping[str, int]
) -> tuple[str, tuple[int, ...], int, int]:
    """Check one tensor entry of a .safetensors header; return ``(dtype, shape, begin, end)``.

    ``where`` names the entry (file and tensor name) in the :class:`~pitstop.errors.
    ImportRefused` raised for anything wrong; ``body_size``: the bytes after the header;
    ``itemsizes``: the dtype names the reader knows and their bytes per element.
    """
    if type(spec) is not dict:
        raise ImportRefused(f"{where}: its header entry is {_kind(spec)}, not a JSON object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in spec]
    if missing:
        raise ImportRefused(f"{where}: its header entry has no {', '.join(missing)}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if type(dtype) is not str or dtype not in itemsizes:
        raise ImportRefused(
            f"{where}: unknown dtype {_kind(dtype)} (known: {', '.join(sorted(itemsizes))})"
        )
    if type(shape) is not list or len(shape) > MAX_NDIM or not _dimensions(shape):
        raise ImportRefused(
            f"{where}: shape {_kind(shape)} is not a list of at most {MAX_NDIM} ints in [0, 2**63)"
        )
    if type(offsets) is not list or len(offsets) != 2 or not _dimensions(offsets):
        raise ImportRefused(f"{where}: data_offsets {_kind(offsets)} are not two ints >= 0")
    begin, end = offsets
    needed = math.prod(shape) * itemsizes[dtype]
    if not begin <= end <= body_size or end - begin != needed:
        raise ImportRefused(
            f"{where}: data_offsets [{begin}, {end}] are not the {needed} bytes a {dtype} of "
            f"shape {shape} needs inside the {body_size}-byte body"
        )
    return dtype, tuple(shape), begin, end


def check_array(
    payload: object, itemsizes: Mapping[str, int]
) -> tuple[str, tuple[int, ...], bytes]:
    """Check a decoded array payload; return ``(dtype name, shape, bytes)``.

    ``itemsizes``: the reader's allow-list, the bytes per element of each dtype name.
    """
    what = "NumPy array"
    if type(payload) is not list or len(payload) != 3:
        raise CheckpointCorrupt(f"{what} must be [dtype, shape, bytes], got {payload!r:.80}")
    raw_name, raw_shape, data = payload
    name = _name(raw_name, itemsizes, what)
    if type(raw_shape) is not list or len(raw_shape) > MAX_NDIM:
        raise CheckpointCorrupt(
            f"{what}: shape must be a list of at most {MAX_NDIM} ints, got {raw_shape!r:.80}"
        )
    if not _dimensions(raw_shape):
        raise CheckpointCorrupt(f"{what}: shape {raw_shape!r:.80} has a bad dimension")
    if type(data) is not bytes:
        raise CheckpointCorrupt(f"{what}: data must be bytes, got {type(data).__qualname__}")
    shape = tuple(raw_shape)
    expected = math.prod(shape) * itemsizes[name]
    if len(data) != expected:
        raise CheckpointCorrupt(
            f"{what}: {name} of shape {list(shape)} needs {expected} bytes, holds {len(data)}"
        )
    return name, shape, data


def check_scalar(payload: object, itemsizes: Mapping[str, int]) -> tuple[str, bytes]:
    """Check a decoded scalar payload; return ``(dtype name, bytes)``."""
    what = "NumPy scalar"
    if type(payload) is not list or len(payload) != 2:
        raise CheckpointCorrupt(f"{what} must be [dtype, bytes], got {payload!r:.80}")
    raw_name, data = payload
    name = _name(raw_name, itemsizes, what)
    if type(data) is not bytes or len(data) != itemsizes[name]:
        raise CheckpointCorrupt(f"{what}: {name} needs {itemsizes[name]} bytes, got {data!r:.80}")
    return name, data
