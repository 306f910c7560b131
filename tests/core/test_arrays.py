"""pitstop.core.file.arrays: the check of a stored NumPy value's payload, on any input."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pitstop.core.file.arrays import (
    NUMPY_DTYPE_NAMES,
    array_payload,
    check_array,
    check_safetensors_entry,
    check_scalar,
    scalar_payload,
)
from pitstop.core.file.manifest import MAX_NDIM
from pitstop.errors import CheckpointCorrupt, ImportRefused

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


# --- a .safetensors header entry --------------------------------------------------------------

SAFETENSORS_ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1}
safetensors_names = st.sampled_from(sorted(SAFETENSORS_ITEMSIZES))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@given(safetensors_names, small_shapes, st.integers(0, 64), st.integers(0, 64))
def test_an_honest_safetensors_entry_is_accepted_as_it_says(
    name: str, shape: tuple[int, ...], begin: int, slack: int
) -> None:
    size = math.prod(shape) * SAFETENSORS_ITEMSIZES[name]
    spec = {"dtype": name, "shape": list(shape), "data_offsets": [begin, begin + size]}
    body = begin + size + slack
    assert check_safetensors_entry("w", spec, body, SAFETENSORS_ITEMSIZES) == (
        name,
        shape,
        begin,
        begin + size,
    )


@given(
    safetensors_names,
    st.lists(json_values, max_size=4),
    st.lists(json_values, max_size=3),
    st.integers(0, 1 << 70),
)
def test_any_safetensors_entry_is_accepted_only_when_every_field_is_exact(
    name: str, shape: list[object], offsets: list[object], body: int
) -> None:
    spec = {"dtype": name, "shape": shape, "data_offsets": offsets}
    exact = (
        all(type(d) is int and 0 <= d < 2**63 for d in shape)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
    )
    if not exact:
        with pytest.raises(ImportRefused, match=r"^tensor 'w': "):
            check_safetensors_entry("tensor 'w'", spec, body, SAFETENSORS_ITEMSIZES)
        return
    try:
        found = check_safetensors_entry("tensor 'w'", spec, body, SAFETENSORS_ITEMSIZES)
    except ImportRefused:
        return  # exact fields, but offsets outside the body or of another size
    # accepted: the offsets are the bytes the shape needs, in the body
    begin, end = found[2], found[3]
    assert 0 <= begin <= end <= body
    assert end - begin == math.prod(found[1]) * SAFETENSORS_ITEMSIZES[name]


@given(json_values)
@example(-1)
@example(float("inf"))
def test_a_safetensors_entry_that_is_anything_else_is_refused_naming_it(spec: object) -> None:
    with pytest.raises(ImportRefused, match=r"^tensor 'w': "):
        check_safetensors_entry("tensor 'w'", spec, 100, SAFETENSORS_ITEMSIZES)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"shape": [-1, -2]}, "shape [-1, -2]"),
        ({"shape": [float("inf")]}, "shape [inf]"),
        ({"dtype": "F99"}, "unknown dtype 'F99'"),
        ({"data_offsets": [0, 1 << 40]}, "data_offsets [0, 1099511627776]"),
    ],
)
def test_each_lie_of_a_safetensors_entry_is_named(changes: dict[str, object], why: str) -> None:
    spec = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **changes}
    with pytest.raises(ImportRefused, match=re.escape(why)):
        check_safetensors_entry("tensor 'w'", spec, 8, SAFETENSORS_ITEMSIZES)
