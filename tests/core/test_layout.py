"""Tensor layout: aligned spans, shared storage laid out once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.file.layout import TensorExtent, align, layout_tensors
from pitstop.errors import SaveError


@st.composite
def extents(draw: st.DrawFn) -> list[TensorExtent]:
    out = []
    for _ in range(draw(st.integers(0, 20))):
        start = draw(st.integers(0, 4096))
        out.append(
            TensorExtent(
                storage=draw(st.integers(0, 5)),
                start=start,
                stop=start + draw(st.integers(0, 4096)),
            )
        )
    return out


@given(extents(), st.sampled_from([1, 8, 64, 4096]), st.integers(0, 10_000))
def test_layout_invariants(items: list[TensorExtent], alignment: int, base: int) -> None:
    layout = layout_tensors(items, alignment=alignment, base=base)

    # One span per storage, in order of first use, aligned, non-overlapping, after `base`.
    storages = list(dict.fromkeys(e.storage for e in items))
    assert [s.storage for s in layout.spans] == storages
    cursor = base
    for span in layout.spans:
        assert span.offset % alignment == 0
        assert span.offset >= cursor
        assert span.offset - cursor < alignment  # padding is less than one alignment unit
        cursor = span.offset + span.length
    assert layout.end == cursor

    spans = {s.storage: s for s in layout.spans}
    for extent, offset in zip(items, layout.offsets, strict=True):
        span = spans[extent.storage]
        assert span.start <= extent.start <= extent.stop <= span.stop
        assert offset == span.offset + extent.start - span.start
    # Tensors sharing a storage keep their relative byte offsets.
    for a, oa in zip(items, layout.offsets, strict=True):
        for b, ob in zip(items, layout.offsets, strict=True):
            if a.storage == b.storage:
                assert ob - oa == b.start - a.start


def test_a_small_view_does_not_drag_its_whole_storage() -> None:
    layout = layout_tensors([TensorExtent(storage="big", start=4000, stop=4016)], base=64)
    assert (layout.spans[0].length, layout.offsets, layout.end) == (16, (64,), 80)


def test_tied_weights_are_laid_out_once() -> None:
    weight = TensorExtent(storage="w", start=0, stop=400)
    layout = layout_tensors([weight, TensorExtent(storage="b", start=0, stop=4), weight])
    assert len(layout.spans) == 2
    assert layout.offsets[0] == layout.offsets[2]
    assert layout.offsets[1] == align(400, 64)


@pytest.mark.parametrize("alignment", [0, 3, 48, -64, True])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(SaveError, match="alignment"):
        layout_tensors([], alignment=alignment)


def test_an_extent_cannot_end_before_it_starts() -> None:
    with pytest.raises(SaveError, match=r"\[10, 5\)"):
        TensorExtent(storage=0, start=10, stop=5)
