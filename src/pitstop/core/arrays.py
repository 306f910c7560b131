# What a stored NumPy value's payload must say, and the check a reader applies to it.
#
# Rules: a NumPy array is stored as [dtype name, shape, bytes] and a NumPy scalar as [dtype name,
# bytes] (docs/file-format.md, ext 8 and 9): the bytes are the C-order, little-endian elements.
# A dtype name is looked up in the reader's allow-list (numbers and bool, never object, str or
# structured dtypes), never resolved dynamically. A shape has at most MAX_NDIM dimensions, each
# an int in [0, 2**63); the bytes are exactly (product of the shape) x itemsize long, computed
# with Python's unbounded ints, so no shape can overflow or claim bytes that are not there. A
# scalar's bytes are exactly one item. Anything else is a CheckpointCorrupt naming what is wrong.
# How: pure functions over the decoded msgpack values; the shell builds the NumPy value after.

"""Stored NumPy values: the payload's fields and their checks (no NumPy here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from pitstop.core.manifest import MAX_NDIM
from pitstop.errors import CheckpointCorrupt

__all__ = ["NUMPY_DTYPE_NAMES", "array_payload", "check_array", "check_scalar", "scalar_payload"]

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
    if not all(type(d) is int and 0 <= d < _DIM_LIMIT for d in raw_shape):
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
