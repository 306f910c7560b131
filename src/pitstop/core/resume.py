# Which checkpoint a resume tries first, and what it falls back to.
#
# Rules:
# * last: every published checkpoint, newest save sequence number first. Pointers are not
#   consulted, so a stale or missing `last` pointer never hides a newer checkpoint.
# * best: the best pointer's target first, then the other checkpoints that recorded the Best
#   metric, better value first (ties: the more recent first).
# * final: the final pointer's target first, then the other checkpoints saved at a normal end,
#   newest first.
# The shell tries the candidates in order until one verifies, warning about each it skips.
# What it reads into memory of its own (an optimizer's state) leaves the page cache behind the
# read (drop_behind) only where no other process of the job reads the same file after it:
# a job of one process. With more ranks, the others read the chosen file after rank 0 and
# find it in the page cache (on one machine); a rank's drop would send the next one to disk.
# How: sorting the catalog, O(n log n).

"""Resume order: the candidates a resume tries, best first."""

from __future__ import annotations

import math

from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    PointerName,
    Pointers,
    SaveReason,
)

__all__ = ["drop_behind", "resume_order"]


def resume_order(
    catalog: Catalog,
    pointers: Pointers,
    source: PointerName,
    best: Best | None = None,
) -> tuple[str, ...]:
    """Return the names a resume from ``source`` should try, in order.

    ``best`` ranks the fallbacks of a ``best`` resume; without it only the pointer is tried.
    An empty result means there is nothing to resume from that source.
    """
    source = PointerName(source)
    newest_first = tuple(reversed(catalog.entries))
    if source is PointerName.LAST:
        return tuple(e.name for e in newest_first)

    head = pointers.target(source)
    order: list[str] = [head] if head is not NO_CHECKPOINT and head in catalog else []
    if source is PointerName.FINAL:
        order += [e.name for e in newest_first if e.reason is SaveReason.FINAL and e.name != head]
        return tuple(order)

    if best is not None:
        ranked = sorted(
            (
                e
                for e in newest_first
                if e.name != head
                and best.metric in e.metrics
                and not math.isnan(e.metrics[best.metric])
            ),
            key=lambda e: best.rank_key(e.metrics[best.metric]),
        )  # sorted is stable: equal values keep newest-first order
        order += [e.name for e in ranked]
    return tuple(order)


def drop_behind(world_size: int) -> bool:
    """Whether a resume's read lets the bytes it read into memory of its own (an optimizer's
    state) leave the page cache as it goes: only in a job of one process (``world_size`` 1),
    where no other rank reads the same file after it."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size == 1
