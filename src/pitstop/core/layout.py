# Where each tensor's bytes go in a checkpoint file.
#
# Rules: tensor data is laid out before the manifest, each storage once. Tensors that share a
# storage (tied weights, views) are described by the byte range they use inside it; a storage is
# stored as the smallest span covering every range used, so views of one storage keep their
# relative offsets and come back sharing memory, and a small view of a huge storage does not drag
# the whole storage along. Every span starts at a multiple of `alignment` (a power of two), so a
# reader can memory-map tensors in place. Spans appear in order of their storage's first use, so
# the layout of a given state is deterministic.
# How: one pass to find each storage's span, one pass to place the spans: O(n).

"""Tensor layout: file offsets for tensor data, shared storage laid out once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from pitstop.errors import SaveError

__all__ = ["DEFAULT_ALIGNMENT", "Layout", "Span", "TensorExtent", "align", "layout_tensors"]

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
