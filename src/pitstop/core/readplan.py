# How the checking read cuts a blob into reads, and which blobs it reads past the page cache.
#
# Rules: a blob is read front to back in chunks of at most `chunk` bytes; each chunk's CRC-32
# covers a window of the blob's own bytes, and the windows tile the blob exactly, in order (so
# that, joined with crc32_combine, they are the blob's CRC). Through the page cache a chunk
# reads exactly its window. Past the page cache (O_DIRECT) every read starts on a page
# boundary of the file and covers whole pages, at most `chunk` bytes (a multiple of the page),
# and its window is the blob's bytes inside it: the blob's first and last pages take in a
# neighbour's bytes, which are read but never counted in the blob's CRC (the neighbour's own
# read checks them). A blob is read past the page cache only where the reader keeps its bytes
# in memory of its own (placed), nobody needs them cached (the reader drops behind: the
# core's drop_behind), and it is at least DIRECT_FROM bytes, where the whole pages at its ends
# are little beside what the cache costs.
# How: arithmetic over offsets, O(length / chunk).

"""Read plans: a blob's chunks and their checksum windows, through the page cache or past it."""

from __future__ import annotations

import attrs

__all__ = ["DIRECT_FROM", "BlobRead", "plan_blob_reads", "reads_past_cache"]

DIRECT_FROM = 1 << 20
"""Placed blobs from this size on are read past the page cache, where the reader drops them."""


@attrs.frozen(kw_only=True)
class BlobRead:
    """One read of a blob: the window ``start..start + nbytes`` of the blob's bytes that its
    CRC-32 covers, and, past the page cache, the page-aligned range of the file it reads
    (``read_at``, ``read_bytes``); through the cache it reads exactly its window."""

    start: int = attrs.field(validator=attrs.validators.ge(0))
    nbytes: int = attrs.field(validator=attrs.validators.gt(0))
    read_at: int | None = None
    read_bytes: int = 0


def reads_past_cache(length: int, *, placed: bool, dropping: bool) -> bool:
    """Whether a blob of ``length`` bytes is read past the page cache: one the reader keeps
    (``placed``) and drops behind it (``dropping``), of :data:`DIRECT_FROM` bytes or more."""
    return placed and dropping and length >= DIRECT_FROM


def plan_blob_reads(
    offset: int, length: int, *, chunk: int, page: int, direct: bool
) -> tuple[BlobRead, ...]:
    """The reads of the blob at file bytes ``offset..offset + length``, in order: chunks of at
    most ``chunk`` bytes, page-aligned ones of ``page``-byte pages when ``direct``."""
    if page <= 0 or chunk <= 0 or chunk % page:
        raise ValueError(f"chunk ({chunk}) must be a positive multiple of the page ({page})")
    if offset < 0 or length < 0:
        raise ValueError(f"a blob needs an offset and a length >= 0, not {offset} and {length}")
    if not direct:
        return tuple(
            BlobRead(start=at, nbytes=min(chunk, length - at)) for at in range(0, length, chunk)
        )
    stop = offset + length
    first = offset - offset % page
    last = -(-stop // page) * page
    reads = []
    for at in range(first, last if length else first, chunk):
        start, end = max(at, offset), min(at + chunk, stop)
        reads.append(
            BlobRead(
                start=start - offset,
                nbytes=end - start,
                read_at=at,
                read_bytes=min(chunk, last - at),
            )
        )
    return tuple(reads)
