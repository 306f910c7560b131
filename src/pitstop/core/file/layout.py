# Where each tensor's bytes go in a checkpoint file, and how the checking read takes them back.
#
# Rules: tensor data is laid out before the manifest, each storage once. Tensors that share a
# storage (tied weights, views) are described by the byte range they use inside it; a storage is
# stored as the smallest span covering every range used, so views of one storage keep their
# relative offsets and come back sharing memory, and a small view of a huge storage does not drag
# the whole storage along. Every span starts at a multiple of `alignment` (a power of two), so a
# reader can memory-map tensors in place. Spans appear in order of their storage's first use, so
# the layout of a given state is deterministic.
# How: one pass to find each storage's span, one pass to place the spans: O(n).
#
# Reading: a blob is read front to back in chunks of at most `chunk` bytes; each chunk's CRC-32
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

"""Tensor layout: file offsets for tensor data, shared storage laid out once; read plans."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from pitstop.errors import SaveError

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DIRECT_FROM",
    "BlobRead",
    "Layout",
    "Span",
    "TensorExtent",
    "align",
    "layout_tensors",
    "plan_blob_reads",
    "reads_past_cache",
]

DEFAULT_ALIGNMENT = 64


def _byte_count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SaveError(f"TensorExtent.{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class TensorExtent:
    """The bytes one tensor uses inside its storage: ``[start, stop)``.

    ``storage`` identifies the storage; tensors with equal ``storage`` share memory.
    For a strided view, the range runs from its first to one past its last element's byte.
    """

    storage: Hashable
    start: int = attrs.field(validator=_byte_count)
    stop: int = attrs.field(validator=_byte_count)

    def __attrs_post_init__(self) -> None:
        if self.stop < self.start:
            raise SaveError(
                f"TensorExtent of storage {self.storage!r} ends before it starts: "
                f"[{self.start}, {self.stop})"
            )


@attrs.frozen(kw_only=True)
class Span:
    """One storage's bytes ``[start, stop)`` placed at file offset ``offset``."""

    storage: Hashable
    offset: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Bytes the span occupies in the file."""
        return self.stop - self.start


@attrs.frozen(kw_only=True)
class Layout:
    """File placement of tensor data.

    ``spans``: the storage spans in file order. ``offsets[i]``: the file offset of tensor
    ``i``'s first byte. ``end``: the offset just past the last span (where the manifest may go).
    """

    spans: tuple[Span, ...]
    offsets: tuple[int, ...]
    end: int


def align(offset: int, alignment: int) -> int:
    """Round ``offset`` up to a multiple of ``alignment`` (a power of two)."""
    return (offset + alignment - 1) & -alignment


def layout_tensors(
    extents: Sequence[TensorExtent],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    base: int = 0,
) -> Layout:
    """Lay out the storages behind ``extents`` from file offset ``base``.

    Returns the spans to write, in order, and each tensor's file offset.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise SaveError(f"alignment must be a positive power of two, got {alignment!r}")
    if alignment & (alignment - 1):
        raise SaveError(f"alignment must be a power of two, got {alignment}")
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise SaveError(f"base must be an int >= 0, got {base!r}")

    ranges: dict[Hashable, tuple[int, int]] = {}
    for extent in extents:
        known = ranges.get(extent.storage)
        ranges[extent.storage] = (
            (extent.start, extent.stop)
            if known is None
            else (min(known[0], extent.start), max(known[1], extent.stop))
        )

    spans: list[Span] = []
    placed: dict[Hashable, Span] = {}
    cursor = base
    for storage, (start, stop) in ranges.items():  # dicts keep first-use order
        span = Span(storage=storage, offset=align(cursor, alignment), start=start, stop=stop)
        spans.append(span)
        placed[storage] = span
        cursor = span.offset + span.length

    offsets = tuple(placed[e.storage].offset + (e.start - placed[e.storage].start) for e in extents)
    return Layout(spans=tuple(spans), offsets=offsets, end=cursor)


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
