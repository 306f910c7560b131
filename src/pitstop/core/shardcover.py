# The checks a sharded layout's values must pass before any reader allocates or reads a byte.
#
# Rules: a layout read back is untrusted. Every tensor value's chunks cover its global shape
# exactly once (inside it, no two overlapping, their volumes adding up to its element count), so
# a tensor built from its extents and filled from its chunks has no element left as it was
# allocated; each chunk's bytes in its file are at least its elements' bytes (what DCP wrote:
# raw or torch.save'd), so a shape is bounded by the files' real (verified) sizes; a dtype is
# one the reader knows; key paths are non-empty, unique, and none is both a leaf and a subtree.
# A file a rank checks while DCP reads it is read once, start to end: the regions DCP's plan
# wants, in order, and every byte between and after them only checksummed (read_spans).
# How: pure functions over the layout's records; the overlap check sweeps along the dimension
# with the most distinct chunk offsets, comparing only chunks whose extents meet along it.

"""Pure checks of a sharded layout's values (exact cover, dtypes, byte bounds, key paths), and
the spans a checking read of a shard file goes through."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

__all__ = [
    "MAX_DIMS",
    "Box",
    "Span",
    "cover_problem",
    "extent_problem",
    "paths_problem",
    "read_spans",
]

MAX_DIMS: Final = 64
"""The most dimensions a stored tensor value may have (torch allows 64)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk's ``(offsets, sizes)`` in its value's global shape."""


def _volume(sizes: Iterable[int]) -> int:
    volume = 1
    for size in sizes:
        volume *= size
    return volume


def cover_problem(shape: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """What keeps ``chunks`` from covering every element of ``shape`` exactly once, or ``None``.

    Chunks with no elements cover nothing and are allowed anywhere inside.
    """
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions (at most {MAX_DIMS})"
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"a {len(offsets)}-d chunk in a {len(shape)}-d value"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return f"a chunk at {list(offsets)} of {list(sizes)} outside its shape {list(shape)}"
    boxes = [(o, s) for o, s in chunks if _volume(s) > 0]
    covered = sum(_volume(s) for _, s in boxes)
    if covered != _volume(shape):
        return f"chunks holding {covered} elements of {_volume(shape)}"
    if len(shape) == 0:
        return None if len(boxes) == 1 else f"{len(boxes)} chunks of one scalar"
    overlap = _overlap(boxes, len(shape))
    if overlap is not None:
        a, b = overlap
        return f"chunks at {list(a[0])} and {list(b[0])} overlapping (others leave a gap)"
    return None


def _overlap(boxes: Sequence[Box], dims: int) -> tuple[Box, Box] | None:
    """Two boxes that share an element, or ``None``."""
    axis = max(range(dims), key=lambda d: len({o[d] for o, _ in boxes}))
    ordered = sorted(boxes, key=lambda b: b[0][axis])
    for i, (offsets, sizes) in enumerate(ordered):
        end = offsets[axis] + sizes[axis]
        for other in ordered[i + 1 :]:
            if other[0][axis] >= end:
                break
            if all(
                o < p + t and p < o + s
                for o, s, p, t in zip(offsets, sizes, other[0], other[1], strict=True)
            ):
                return (offsets, sizes), other
    return None


def extent_problem(
    dtype: str, chunks: Sequence[tuple[Box, int]], itemsizes: Mapping[str, int]
) -> str | None:
    """What is wrong with a tensor value of ``dtype`` whose chunks (each with its byte
    ``length`` in its file) claim more elements than their bytes can hold, or ``None``."""
    itemsize = itemsizes.get(dtype)
    if itemsize is None:
        return f"an unknown dtype {dtype!r}"
    for (offsets, sizes), length in chunks:
        if _volume(sizes) * itemsize > length:
            return (
                f"a chunk at {list(offsets)} of {list(sizes)} {dtype} ({_volume(sizes) * itemsize}"
                f" bytes) stored in {length} bytes"
            )
    return None


def paths_problem(paths: Iterable[tuple[str | int, ...]]) -> str | None:
    """What is wrong with the values' key paths (empty, repeated, or one both a leaf and the
    root of others), or ``None``."""
    seen: set[tuple[str | int, ...]] = set()
    for path in paths:
        if not path:
            return "an empty key path"
        if path in seen:
            return f"the key path {list(path)} twice"
        seen.add(path)
    for path in seen:
        for end in range(1, len(path)):
            if path[:end] in seen:
                return f"the key path {list(path[:end])} both a value and holding {list(path)}"
    return None


Span = tuple[int, int, bool]
"""A piece of a checking read: ``(start, length, wanted)`` — ``wanted``: a region the read plan
asks for (its bytes are loaded as well as checksummed), else bytes only checksummed."""


def read_spans(size: int, regions: Iterable[tuple[int, int]]) -> tuple[Span, ...] | None:
    """The spans a read of a file of ``size`` bytes goes through to checksum every byte once
    and hand over each of ``regions`` (``(start, length)``, repeats counted once): in file
    order, every byte in exactly one span, no empty span. ``None`` when two distinct regions
    overlap, one is empty or one reaches past the end (the file is then checked whole before
    it is read)."""
    spans: list[Span] = []
    at = 0
    for start, length in sorted(set(regions)):
        if start < at or length <= 0 or start + length > size:
            return None
        if start > at:
            spans.append((at, start - at, False))
        spans.append((start, length, True))
        at = start + length
    if at < size:
        spans.append((at, size - at, False))
    return tuple(spans)
