# NumPy arrays and scalars in a checkpoint tree: their bytes, dtype and shape, never a pickle.
#
# Rules: a value is NumPy's when its type's module is `numpy` (so nothing here imports NumPy
# before a tree holds a NumPy value, and pitstop runs without NumPy installed). Stored: exactly
# np.ndarray (not np.matrix, a masked array or another subclass) and the NumPy scalar types of
# pitstop.core.file.arrays' dtype allow-list (bool, signed and unsigned ints, floats, complexes);
# anything else NumPy (object, str, datetime or structured dtypes) is a SaveError naming the key
# path. The bytes are C-order and little-endian; a value comes back as the same NumPy type with
# the same dtype and shape, C-contiguous, writable and in native byte order. The reader checks
# each payload (pitstop.core.file.arrays) before NumPy sees a byte.
# How: the tree walk calls check() for a NumPy leaf and the builder copy() (a snapshot) or
# payload() (the encoder); the decoder calls build() with the checked fields.

"""NumPy values in a checkpoint tree: check, copy, encode and rebuild (ext 8 and 9)."""

from __future__ import annotations

import sys
from functools import cache
from types import MappingProxyType
from typing import Any, Final

from pitstop.core.file.arrays import (
    NUMPY_DTYPE_NAMES,
    array_payload,
    check_array,
    check_scalar,
    scalar_payload,
)
from pitstop.core.file.manifest import MAX_NDIM
from pitstop.errors import CheckpointCorrupt, SaveError

__all__ = ["build_array", "build_scalar", "check", "copy", "is_numpy", "payload"]

_ALLOWED: Final = ", ".join(NUMPY_DTYPE_NAMES)


def is_numpy(value: object) -> bool:
    """Whether ``value`` is a NumPy object (an array, a scalar or anything else NumPy's)."""
    module = type(value).__module__
    return module == "numpy" or module.startswith("numpy.")


def _numpy() -> Any:
    numpy = sys.modules.get("numpy")
    if numpy is None:  # reading only: a tree holding NumPy values came from a process with NumPy
        try:
            import numpy
        except ImportError as error:
            raise CheckpointCorrupt(
                "the checkpoint holds NumPy values; install numpy to read it"
            ) from error
    return numpy


@cache
def _itemsizes() -> MappingProxyType[str, int]:
    np = _numpy()
    return MappingProxyType({name: np.dtype(name).itemsize for name in NUMPY_DTYPE_NAMES})


@cache
def _scalar_types() -> frozenset[type]:
    np = _numpy()
    return frozenset(np.dtype(name).type for name in NUMPY_DTYPE_NAMES)


def check(value: Any, where: str) -> bool:
    """Check a NumPy ``value`` found at ``where`` (a key path); return whether it is an array.

    Raises :class:`~pitstop.errors.SaveError` naming ``where`` for a value a checkpoint
    cannot hold.
    """
    np = _numpy()
    kind = type(value)
    if kind is np.ndarray:
        if value.dtype.name not in _itemsizes() or value.dtype.fields is not None:
            raise SaveError(
                f"{where}: NumPy arrays of dtype {value.dtype} cannot be stored "
                f"(stored dtypes: {_ALLOWED})"
            )
        if value.ndim > MAX_NDIM:
            raise SaveError(f"{where}: {value.ndim} dimensions is more than {MAX_NDIM}")
        return True
    if kind in _scalar_types():
        return False
    raise SaveError(
        f"{where}: cannot store a NumPy value of type {kind.__module__}.{kind.__qualname__}; "
        f"a checkpoint holds np.ndarray and NumPy scalars of dtype {_ALLOWED}"
    )


def copy(value: Any, is_array: bool) -> Any:
    """A snapshot of a checked NumPy value: a copy of an array (a scalar is immutable)."""
    return value.copy() if is_array else value


def _little(dtype: Any) -> Any:
    return dtype.newbyteorder("<")


def payload(value: Any, is_array: bool) -> list[object]:
    """The stored payload of a checked NumPy value (:mod:`pitstop.core.file.arrays`)."""
    np = _numpy()
    name = value.dtype.name
    if is_array:
        data = np.ascontiguousarray(value, dtype=_little(value.dtype)).tobytes()
        return array_payload(name, tuple(value.shape), data)
    return scalar_payload(name, np.asarray(value, dtype=_little(value.dtype)).tobytes())


def build_array(content: object) -> Any:
    """The NumPy array a stored payload describes; CheckpointCorrupt if it is not one."""
    np = _numpy()
    name, shape, data = check_array(content, _itemsizes())
    stored = np.frombuffer(data, dtype=_little(np.dtype(name)))
    return stored.astype(np.dtype(name)).reshape(shape)  # a copy: writable, native order


def build_scalar(content: object) -> Any:
    """The NumPy scalar a stored payload describes; CheckpointCorrupt if it is not one."""
    np = _numpy()
    name, data = check_scalar(content, _itemsizes())
    return np.frombuffer(data, dtype=_little(np.dtype(name))).astype(np.dtype(name))[0]
