"""The part plan of an upload to object storage."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.s3.uploads import (
    MAX_OBJECT,
    MAX_PART,
    MAX_PARTS,
    MIN_PART,
    STREAM_PART,
    UploadPlan,
    file_plan,
    stream_plan,
)

MIB = 1 << 20
sizes = st.one_of(
    st.integers(0, 64 * STREAM_PART),
    st.integers(0, MAX_OBJECT),
    st.sampled_from([STREAM_PART * MAX_PARTS + d for d in (-1, 0, 1)] + [MAX_OBJECT]),
)


@given(sizes)
def test_a_files_parts_fit_s3s_limits_and_are_the_smallest_that_do(size: int) -> None:
    plan = file_plan(size)
    assert MIN_PART <= STREAM_PART <= plan.part_size <= MAX_PART
    assert plan.part_size % MIB == 0
    assert plan.parts(size) <= MAX_PARTS
    assert plan.largest >= size
    # smallest: a MiB less would not do (or it is the stream's own part size)
    assert plan.part_size == STREAM_PART or (plan.part_size - MIB) * MAX_PARTS < size
    assert 1 <= plan.concurrency <= 64


@pytest.mark.parametrize("size", [-1, MAX_OBJECT + 1])
def test_a_size_s3_cannot_hold_in_one_object_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="an object holds"):
        file_plan(size)


def test_a_stream_sends_parts_s3_takes_and_holds_a_large_checkpoint() -> None:
    plan = stream_plan()
    assert MIN_PART <= plan.part_size <= MAX_PART
    assert plan.largest == plan.part_size * MAX_PARTS >= 64 << 30
    assert plan.concurrency >= 1


@given(st.integers(1, 64), st.integers(0, 10**9))
def test_parts_cover_an_object_exactly(part: int, size: int) -> None:
    plan = UploadPlan(part, 1)
    assert (plan.parts(size) - 1) * part < max(size, 1) <= plan.parts(size) * part
