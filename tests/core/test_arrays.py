"""pitstop.core.arrays: the check of a stored NumPy value's payload, on any input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.arrays import (
    NUMPY_DTYPE_NAMES,
    array_payload,
    check_array,
    check_scalar,
    scalar_payload,
)
from pitstop.core.manifest import MAX_NDIM
from pitstop.errors import CheckpointCorrupt

# The reader's table: NumPy's itemsizes, written out (the core knows no NumPy).
ITEMSIZES = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
names = st.sampled_from(NUMPY_DTYPE_NAMES)
small_shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)


def test_the_table_names_every_allowed_dtype() -> None:
    assert set(ITEMSIZES) == set(NUMPY_DTYPE_NAMES)


@given(names, small_shapes, st.data())
def test_a_written_array_payload_checks_back_to_its_fields(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    size = math.prod(shape) * ITEMSIZES[name]
    raw = data.draw(st.binary(min_size=size, max_size=size))
    assert check_array(array_payload(name, shape, raw), ITEMSIZES) == (name, shape, raw)


@given(names, st.data())
def test_a_written_scalar_payload_checks_back_to_its_fields(name: str, data: st.DataObject) -> None:
    raw = data.draw(st.binary(min_size=ITEMSIZES[name], max_size=ITEMSIZES[name]))
    assert check_scalar(scalar_payload(name, raw), ITEMSIZES) == (name, raw)


@given(names, small_shapes, st.binary(max_size=80))
def test_bytes_that_do_not_fill_the_shape_exactly_are_corrupt(
    name: str, shape: tuple[int, ...], raw: bytes
) -> None:
    payload = array_payload(name, shape, raw)
    if len(raw) == math.prod(shape) * ITEMSIZES[name]:
        assert check_array(payload, ITEMSIZES)[2] == raw
    else:
        with pytest.raises(CheckpointCorrupt, match=f"{name} of shape .* needs"):
            check_array(payload, ITEMSIZES)


_anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@given(_anything)
def test_any_decoded_value_is_a_consistent_array_or_corrupt(payload: object) -> None:
    # Never another exception, and never fields that disagree with each other.
    try:
        name, shape, raw = check_array(payload, ITEMSIZES)
    except CheckpointCorrupt:
        return
    assert len(shape) <= MAX_NDIM
    assert len(raw) == math.prod(shape) * ITEMSIZES[name]


@given(_anything)
def test_any_decoded_value_is_a_consistent_scalar_or_corrupt(payload: object) -> None:
    try:
        name, raw = check_scalar(payload, ITEMSIZES)
    except CheckpointCorrupt:
        return
    assert len(raw) == ITEMSIZES[name]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (["object", [1], b"\0" * 8], "dtype 'object' is not one"),
        (["float32", [2**62, 2**62], b""], r"needs \d+ bytes, holds 0"),
        (["float32", [-1], b""], "bad dimension"),
        (["float32", [2**63], b""], "bad dimension"),
        (["float32", [True], b"\0" * 4], "bad dimension"),
        (["float32", [1] * (MAX_NDIM + 1), b"\0" * 4], f"at most {MAX_NDIM}"),
        (["float32", [1], "abcd"], "data must be bytes"),
        (["float32", [1]], r"must be \[dtype, shape, bytes\]"),
        ({"dtype": "float32"}, r"must be \[dtype, shape, bytes\]"),
    ],
)
def test_hostile_array_payloads_are_corrupt_naming_the_field(payload: object, message: str) -> None:
    with pytest.raises(CheckpointCorrupt, match=message):
        check_array(payload, ITEMSIZES)


def test_hostile_scalar_payloads_are_corrupt() -> None:
    with pytest.raises(CheckpointCorrupt, match="float64 needs 8 bytes"):
        check_scalar(["float64", b"\0" * 4], ITEMSIZES)
    with pytest.raises(CheckpointCorrupt, match="dtype 'str' is not one"):
        check_scalar(["str", b"a"], ITEMSIZES)
