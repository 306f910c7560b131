"""pitstop.core.sharding.shardcover: a sharded value's chunks must cover it exactly once; dtypes,
byte bounds and key paths of an untrusted layout."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.sharding.shardcover import MAX_DIMS, cover_problem, extent_problem, paths_problem
from strategies import any_boxes, grid_covers

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def _counts(shape: tuple[int, ...], boxes: Boxes) -> dict[tuple[int, ...], int]:
    """How many chunks hold each element: the oracle, element by element."""
    counts = dict.fromkeys(itertools.product(*(range(n) for n in shape)), 0)
    for offsets, sizes in boxes:
        for element in itertools.product(
            *(range(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        ):
            counts[element] += 1
    return counts


@given(grid_covers())
def test_a_grid_of_chunks_covers_its_value(cover: tuple[tuple[int, ...], Boxes]) -> None:
    shape, boxes = cover
    assert cover_problem(shape, boxes) is None


@given(any_boxes())
def test_cover_is_accepted_exactly_when_every_element_is_held_once(
    case: tuple[tuple[int, ...], Boxes],
) -> None:
    shape, boxes = case
    once = all(n == 1 for n in _counts(shape, boxes).values())
    assert (cover_problem(shape, boxes) is None) == once


@given(grid_covers(), st.data())
def test_a_dropped_or_repeated_chunk_is_refused(
    cover: tuple[tuple[int, ...], Boxes], data: st.DataObject
) -> None:
    shape, boxes = cover
    holding = [b for b in boxes if all(s > 0 for s in b[1])]
    if not holding:
        return
    chosen = data.draw(st.sampled_from(holding))
    dropped = [b for b in boxes if b is not chosen]
    assert cover_problem(shape, dropped) is not None
    assert cover_problem(shape, [*boxes, chosen]) is not None


def test_named_problems() -> None:
    assert "outside its shape" in str(cover_problem((4,), [((2,), (3,))]))
    assert "holding 2 elements of 4" in str(cover_problem((4,), [((0,), (2,))]))
    assert "overlapping" in str(cover_problem((4,), [((0,), (2,)), ((1,), (2,))]))
    assert "dimensions" in str(cover_problem((1,) * (MAX_DIMS + 1), []))
    assert "1-d chunk in a 2-d value" in str(cover_problem((2, 2), [((0,), (4,))]))
    assert cover_problem((2**62,), [((0,), (2**62,))]) is None  # the cover alone: extents next


def test_extents_are_bounded_by_their_bytes() -> None:
    sizes = {"float32": 4}
    assert extent_problem("float32", [(((0,), (3,)), 12)], sizes) is None
    assert "unknown dtype 'float99'" in str(extent_problem("float99", [], sizes))
    lie = extent_problem("float32", [(((0,), (3 * 2**28,)), 171_000)], sizes)
    assert "3221225472 bytes) stored in 171000 bytes" in str(lie)


def test_key_paths() -> None:
    assert paths_problem([("model", "w"), ("model", "b")]) is None
    assert "empty key path" in str(paths_problem([("model", "w"), ()]))
    assert "twice" in str(paths_problem([("model", "w"), ("model", "w")]))
    both = paths_problem([("model", "w", "x"), ("model", "w")])
    assert "['model', 'w'] both a value and holding ['model', 'w', 'x']" in str(both)
