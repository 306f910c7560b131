"""Read plans: a blob's chunks and their checksum windows, through the page cache or past it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.file.layout import DIRECT_FROM, BlobRead, plan_blob_reads, reads_past_cache

pages = st.sampled_from([512, 4096, 16384])


@given(
    offset=st.integers(0, 1 << 40),
    length=st.integers(0, 1 << 22),
    page=pages,
    per_chunk=st.integers(1, 64),
    direct=st.booleans(),
)
def test_the_windows_tile_the_blob_and_each_read_holds_its_window(
    offset: int, length: int, page: int, per_chunk: int, direct: bool
) -> None:
    chunk = per_chunk * page
    reads = plan_blob_reads(offset, length, chunk=chunk, page=page, direct=direct)
    # windows: in order, contiguous, the whole blob, none empty or over a chunk
    assert [r.start for r in reads] == [sum(x.nbytes for x in reads[:i]) for i in range(len(reads))]
    assert sum(r.nbytes for r in reads) == length
    assert all(0 < r.nbytes <= chunk for r in reads)
    for read in reads:
        if not direct:
            assert read.read_at is None  # through the cache: exactly the window
            continue
        assert read.read_at is not None
        assert read.read_at % page == 0
        assert read.read_bytes % page == 0
        assert 0 < read.read_bytes <= chunk
        window = (offset + read.start, offset + read.start + read.nbytes)
        assert read.read_at <= window[0]
        assert window[1] <= read.read_at + read.read_bytes
    if direct and reads:  # reads past the cache are back to back, from the blob's first page
        assert reads[0].read_at == offset - offset % page
        for before, after in itertools.pairwise(reads):
            assert before.read_at is not None
            assert after.read_at == before.read_at + before.read_bytes


def test_a_blob_that_starts_inside_a_page_reads_that_whole_page() -> None:
    assert plan_blob_reads(4096 + 64, 8192, chunk=8192, page=4096, direct=True) == (
        BlobRead(start=0, nbytes=8128, read_at=4096, read_bytes=8192),
        BlobRead(start=8128, nbytes=64, read_at=12288, read_bytes=4096),
    )
    assert plan_blob_reads(4096 + 64, 8192, chunk=8192, page=4096, direct=False) == (
        BlobRead(start=0, nbytes=8192),
    )


@given(length=st.integers(0, 1 << 30), placed=st.booleans(), dropping=st.booleans())
def test_only_a_large_kept_blob_that_nobody_needs_cached_is_read_past_the_cache(
    length: int, placed: bool, dropping: bool
) -> None:
    assert reads_past_cache(length, placed=placed, dropping=dropping) is (
        placed and dropping and length >= DIRECT_FROM
    )


@pytest.mark.parametrize(("chunk", "page"), [(4096 + 1, 4096), (0, 4096), (4096, 0)])
def test_a_chunk_that_is_not_whole_pages_is_refused(chunk: int, page: int) -> None:
    with pytest.raises(ValueError, match=rf"chunk \({chunk}\) must be a positive multiple"):
        plan_blob_reads(0, 10, chunk=chunk, page=page, direct=True)


def test_a_negative_offset_or_length_is_refused() -> None:
    with pytest.raises(ValueError, match="not -1 and 10"):
        plan_blob_reads(-1, 10, chunk=4096, page=4096, direct=False)
