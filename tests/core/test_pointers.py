"""Pointers: moving, recomputing after a replacement, and reconciling what is on disk."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    PointerName,
    Pointers,
    Progress,
    SaveReason,
)
from pitstop.core.saving.pointers import (
    move_pointers,
    recompute_best,
    recompute_final,
    reconcile_pointers,
)
from strategies import METRIC, bests, catalogs, pointers_into


def _entry(step: int, seq: int, reason: SaveReason, **metrics: float) -> CheckpointEntry:
    return CheckpointEntry(progress=Progress(step=step), seq=seq, reason=reason, metrics=metrics)


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


CATALOG = Catalog(
    entries=[
        _entry(100, 1, SaveReason.INTERVAL, val_loss=0.5),
        _entry(200, 2, SaveReason.FINAL, val_loss=0.2),
        _entry(300, 3, SaveReason.INTERVAL, val_loss=0.2),
        _entry(400, 4, SaveReason.STOP),
    ]
)


def test_move_pointers_moves_only_what_is_named() -> None:
    moved = move_pointers(Pointers(), "x.pitstop", [PointerName.LAST, PointerName.BEST], 0.3)
    assert moved == Pointers(last="x.pitstop", best="x.pitstop", best_value=0.3)
    assert move_pointers(moved, "y.pitstop", [], None) is moved


def test_recompute_final_and_best() -> None:
    assert recompute_final(CATALOG) == _name(200)
    assert recompute_best(CATALOG, Best(METRIC)) == (_name(200), 0.2)  # a tie keeps the earlier
    assert recompute_best(CATALOG, Best(METRIC, mode="max")) == (_name(100), 0.5)
    assert recompute_best(CATALOG, None) == (NO_CHECKPOINT, None)
    assert recompute_final(Catalog()) is NO_CHECKPOINT


def test_recompute_best_ignores_nan() -> None:
    catalog = Catalog(entries=[_entry(1, 1, SaveReason.BEST, val_loss=math.nan)])
    assert recompute_best(catalog, Best(METRIC)) == (NO_CHECKPOINT, None)


def test_last_is_the_highest_sequence_and_a_stale_pointer_is_reported() -> None:
    stale = Pointers(last=_name(300))
    pointers, warnings = reconcile_pointers(CATALOG, links=stale, manifest=stale, best=None)
    assert pointers.last == _name(400)
    assert len(warnings) == 2
    assert all(_name(300) in w and _name(400) in w and "stale" in w for w in warnings)


def test_dangling_pointers_are_dropped_and_recomputed() -> None:
    gone = _name(999)
    links = Pointers(last=_name(400), best=gone, final=gone)
    pointers, warnings = reconcile_pointers(
        CATALOG, links=links, manifest=Pointers(), best=Best(METRIC)
    )
    assert pointers == Pointers(last=_name(400), best=_name(200), best_value=0.2, final=_name(200))
    assert sum(gone in w and "ignored" in w for w in warnings) == 2


def test_best_value_comes_from_latest_json_when_it_agrees() -> None:
    # 300 became best by a pointer-only move at a value its file did not record.
    manifest = Pointers(last=_name(400), best=_name(300), best_value=0.15)
    pointers, warnings = reconcile_pointers(
        CATALOG, links=Pointers(best=_name(300)), manifest=manifest, best=Best(METRIC)
    )
    assert (pointers.best, pointers.best_value) == (_name(300), 0.15)
    assert warnings == ()


def test_a_best_pointer_behind_a_better_checkpoint_is_moved() -> None:
    # A crash after publishing 200 (val_loss 0.2) but before `best` moved off 100 (0.5).
    links = Pointers(last=_name(400), best=_name(100))
    pointers, warnings = reconcile_pointers(
        CATALOG, links=links, manifest=Pointers(), best=Best(METRIC)
    )
    assert (pointers.best, pointers.best_value) == (_name(200), 0.2)
    assert warnings == (
        f"pointer best -> {_name(100)} (val_loss=0.5) is stale; {_name(200)} recorded val_loss=0.2",
    )


def test_symlinks_win_over_latest_json() -> None:
    pointers, _ = reconcile_pointers(
        CATALOG,
        links=Pointers(final=_name(100)),
        manifest=Pointers(final=_name(200)),
        best=None,
    )
    assert pointers.final == _name(100)


@given(st.data(), catalogs(), st.none() | bests)
def test_reconciled_pointers_name_published_checkpoints_and_no_better_best_exists(
    data: st.DataObject, catalog: Catalog, best: Best | None
) -> None:
    links = data.draw(pointers_into(catalog, dangling=True))
    manifest = data.draw(pointers_into(catalog, dangling=True))
    pointers, warnings = reconcile_pointers(catalog, links=links, manifest=manifest, best=best)
    assert all(target in catalog for target in pointers.targets())
    if best is not None:
        # Candidates: checkpoints that recorded the metric after step 0 (nothing trained before).
        recorded = [e.metrics[METRIC] for e in catalog if METRIC in e.metrics and e.step > 0]
        assert not any(best.improves(v, pointers.best_value) for v in recorded)
        if any(v == v for v in recorded):  # some finite value: there is a best checkpoint
            assert pointers.best is not NO_CHECKPOINT
    newest = catalog.newest()
    assert pointers.last == (NO_CHECKPOINT if newest is NO_CHECKPOINT else newest.name)
    # Every dangling pointer that was consulted is reported; latest.json is consulted for a
    # pointer only when its symlink is missing or dangling (and always for last).
    for pointer, target in links.items():
        if target not in catalog:
            assert any(target in w and pointer.value in w for w in warnings)
    for pointer, target in manifest.items():
        link = links.target(pointer)
        consulted = pointer is PointerName.LAST or link is NO_CHECKPOINT or link not in catalog
        if target not in catalog and consulted:
            assert any(target in w and "latest.json" in w for w in warnings)


def test_a_missing_last_pointer_is_reported() -> None:
    pointers, warnings = reconcile_pointers(
        CATALOG, links=Pointers(), manifest=Pointers(), best=None
    )
    assert pointers.last == _name(400)
    assert warnings == (
        f"pointer last is missing; the most recently published checkpoint is {_name(400)}",
    )


def test_a_symlink_and_latest_json_that_disagree_are_reported() -> None:
    _, warnings = reconcile_pointers(
        CATALOG,
        links=Pointers(last=_name(400), final=_name(100)),
        manifest=Pointers(last=_name(400), final=_name(200)),
        best=None,
    )
    assert warnings == (
        f"pointer final: symlink -> {_name(100)} but latest.json -> {_name(200)}; "
        "using the symlink",
    )


def test_recompute_best_ignores_a_step_0_checkpoint() -> None:
    """A manual save before training may record the metric; it holds no training to be best."""
    untrained = CheckpointEntry(
        progress=Progress(), seq=1, reason=SaveReason.MANUAL, metrics={METRIC: 0.0}
    )
    catalog = Catalog(entries=[untrained, _entry(5, 2, SaveReason.INTERVAL, val_loss=0.7)])
    assert recompute_best(catalog, Best(METRIC)) == (_name(5), 0.7)
    assert recompute_best(Catalog(entries=[untrained]), Best(METRIC)) == (NO_CHECKPOINT, None)
