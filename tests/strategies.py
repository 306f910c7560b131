"""Hypothesis strategies shared by the core's property tests."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from pitstop.core.naming import MAX_STEP
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)

METRIC = "val_loss"

steps = st.integers(min_value=0, max_value=MAX_STEP)
small_steps = st.integers(min_value=0, max_value=10_000)
counts = st.integers(min_value=0, max_value=10**9)
metric_values = st.floats(allow_nan=True, allow_infinity=False, width=32)
finite_metric_values = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def progresses(draw: st.DrawFn, step: st.SearchStrategy[int] = small_steps) -> Progress:
    """Any valid Progress."""
    s = draw(step)
    return Progress(
        step=s,
        epoch=draw(st.integers(0, 1000)),
        batch_in_epoch=draw(st.integers(0, s)),
        samples=draw(counts),
        tokens=draw(counts),
    )


bests = st.builds(Best, st.just(METRIC), mode=st.sampled_from(["min", "max"]))

policies = st.builds(
    Policy,
    every_steps=st.none() | st.integers(1, 50),
    every_seconds=st.none() | st.floats(0.5, 1000.0),
    keep_last=st.none() | st.integers(1, 6),
    keep_every=st.none() | st.integers(1, 100),
    best=st.none() | bests,
    save_final=st.booleans(),
)

metrics = st.dictionaries(st.sampled_from([METRIC, "accuracy", "loss"]), metric_values, max_size=3)


FILES_ONLY = st.just(False)  # catalogs of checkpoint files only (no sharded directories)


@st.composite
def catalogs(
    draw: st.DrawFn, max_size: int = 25, sharded: st.SearchStrategy[bool] = FILES_ONLY
) -> Catalog:
    """A catalog of distinct steps whose save order need not follow step order.

    Out-of-order sequence numbers model abandoned timelines: a run that resumed from an older
    checkpoint saves low steps after high ones. ``sharded``: whether each entry is a sharded
    checkpoint directory rather than a file.
    """
    step_list = draw(st.lists(small_steps, unique=True, max_size=max_size))
    seqs = draw(
        st.lists(
            st.integers(1, 10**6), unique=True, min_size=len(step_list), max_size=len(step_list)
        )
    )
    entries = [
        CheckpointEntry(
            progress=Progress(step=s),
            seq=q,
            reason=draw(st.sampled_from(SaveReason)),
            metrics=draw(metrics),
            sharded=draw(sharded),
        )
        for s, q in zip(step_list, seqs, strict=True)
    ]
    return Catalog(entries=entries)


@st.composite
def pointers_into(draw: st.DrawFn, catalog: Catalog, dangling: bool = False) -> Pointers:
    """Pointers whose targets are catalog names (or, with ``dangling``, other names too)."""
    names = [e.name for e in catalog]
    if dangling:
        names += ["step_999999999999.pitstop", "step_000000424242.pitstop"]
    target = st.sampled_from(names) | st.just(NO_CHECKPOINT) if names else st.just(NO_CHECKPOINT)
    best = draw(target)
    value = None if best is NO_CHECKPOINT else draw(st.none() | finite_metric_values)
    return Pointers(last=draw(target), best=best, final=draw(target), best_value=value)


@st.composite
def grid_covers(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A small shape (0 to 3 dimensions) and chunks that cover it exactly once: a grid, each
    dimension cut at random points (as DCP's shards of a value are), in random order."""
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    cuts = [sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=3))}) for n in shape]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for points in cuts:
        spans = list(itertools.pairwise(points)) or [(0, 0)]
        boxes = [((*o, a), (*s, b - a)) for o, s in boxes for a, b in spans]
    return shape, draw(st.permutations(boxes))


@st.composite
def any_boxes(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A small shape and any chunks inside it (covering it or not, overlapping or not)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offsets = tuple(draw(st.integers(0, n)) for n in shape)
        sizes = tuple(draw(st.integers(0, n - o)) for o, n in zip(offsets, shape, strict=True))
        boxes.append((offsets, sizes))
    return shape, boxes
