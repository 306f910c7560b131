"""The ranged GETs of a checkpoint's data region (pitstop.core.s3.reads): every byte once, cut
only at blobs (a blob of at most ``split`` bytes arrives in one read), joined up to ``join``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.s3.reads import plan_reads


@st.composite
def regions(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int, int]:
    """Blobs laid out as a checkpoint file lays them out: in order from the region's start,
    each aligned, zero padding between; the region ends where the last one does."""
    start = draw(st.integers(0, 4096))
    align = draw(st.sampled_from([1, 8, 64]))
    lengths = draw(st.lists(st.integers(0, 5000), max_size=12))
    blobs, cursor = [], start
    for length in lengths:
        offset = -(-cursor // align) * align
        blobs.append((offset, length))
        cursor = offset + length
    return blobs, start, cursor


@given(regions(), st.integers(1, 6000), st.integers(1, 6000))
def test_reads_cover_the_region_once_cut_only_at_blobs(
    region: tuple[list[tuple[int, int]], int, int], join: int, split: int
) -> None:
    blobs, start, stop = region
    reads = plan_reads(blobs, start, stop, join=join, split=split)
    # every byte exactly once, in order, no empty read
    assert all(a < b for a, b in reads)
    assert [a for a, _ in reads[1:]] == [b for _, b in reads[:-1]]
    assert (reads[0][0], reads[-1][1]) == (start, stop) if reads else start == stop
    starts = [a for a, _ in reads]
    for offset, length in blobs:
        inside = [a for a in starts if offset < a < offset + length]
        if length <= split:  # arrives whole, in one read
            assert inside == []
        else:  # in pieces, cut every split bytes from its start
            assert all((a - offset) % split == 0 for a in inside)
    cuts = {start} | {o for o, _ in blobs}
    cuts |= {o + k * split for o, n in blobs for k in range(1, -(-n // split))}
    for a, b in reads:
        if b - a > join:  # one blob, or a piece of one, with the padding after it
            assert not [c for c in cuts if a < c < b]
            assert sum(max(0, min(o + n, b) - max(o, a)) for o, n in blobs) <= split
    for (a, _), (_, d) in itertools.pairwise(reads):  # neighbours joined when they fit
        assert d - a > join


def test_the_benchmarks_layout_is_one_read_per_blob() -> None:
    mib = 1 << 20
    blobs = [(64 + i * 8 * mib, 8 * mib) for i in range(8)]
    reads = plan_reads(blobs, 64, 64 + 64 * mib, join=8 * mib, split=64 * mib)
    assert reads == tuple((o, o + n) for o, n in blobs)
    small = plan_reads([(0, 10), (16, 10), (32, 100)], 0, 132, join=40, split=64)
    assert small == ((0, 32), (32, 96), (96, 132))


def test_a_blob_outside_the_region_or_no_size_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        plan_reads([(0, 100)], 10, 100, join=8, split=8)
    with pytest.raises(ValueError, match="join, split"):
        plan_reads([], 0, 0, join=0, split=8)
