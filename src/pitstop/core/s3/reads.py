# Which ranged GETs read a checkpoint file's data region from object storage.
#
# Rules: the reads cover the data region (from the header's end to the manifest's start) exactly
# once, in order, each a non-empty range. A read starts only where a blob starts (its padding,
# up to the next blob, goes with it) or inside a blob longer than `split`, at a multiple of
# `split` from that blob's start: so a blob of at most `split` bytes arrives whole in one
# response, and its tensors are built over that response's buffer without a copy; only a
# longer blob is joined (copied) from its pieces. Neighbours are joined into one read while it
# stays at most `join` bytes (fewer, larger requests for many small blobs); a read longer than
# `join` holds one blob, or one piece of one, with the padding after it.
# How: cut points (the region's start, every blob's start, the split points of long blobs),
# then a greedy join of the segments between them.

"""The ranged GETs that read a checkpoint's data region: cut at blobs, joined up to a size."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plan_reads"]


def plan_reads(
    blobs: Sequence[tuple[int, int]], start: int, stop: int, *, join: int, split: int
) -> tuple[tuple[int, int], ...]:
    """The ranged GETs ``(start, end)`` (end exclusive) that read bytes ``start..stop``, cut at
    the ``blobs`` (``(offset, length)`` each, inside the region): at a blob's start, or inside
    a blob longer than ``split`` every ``split`` bytes from its start; neighbours joined while
    a read stays at most ``join`` bytes. Raises ``ValueError`` for a blob outside the region
    or a ``join`` or ``split`` not positive."""
    if join <= 0 or split <= 0 or not 0 <= start <= stop:
        raise ValueError(f"need join, split > 0 and 0 <= start <= stop; got {join}, {split}")
    cuts = {start}
    for offset, length in blobs:
        if offset < start or length < 0 or offset + length > stop:
            raise ValueError(f"a blob at {offset} of {length} bytes is outside {start}..{stop}")
        cuts.add(offset)
        cuts.update(range(offset + split, offset + length, split))
    points = sorted(c for c in cuts if c < stop)
    reads: list[tuple[int, int]] = []
    for begin, end in zip(points, [*points[1:], stop][: len(points)], strict=True):
        if reads and end - reads[-1][0] <= join:
            reads[-1] = (reads[-1][0], end)
        else:
            reads.append((begin, end))
    return tuple(reads)
