"""Resume order: which checkpoint a resume tries first, and the fallbacks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.pointers import drop_behind, resume_order
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
from strategies import METRIC, bests, catalogs, pointers_into


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


@given(st.data(), catalogs())
def test_last_tries_everything_newest_sequence_first(data: st.DataObject, catalog: Catalog) -> None:
    # Whatever the pointers say — stale, dangling or missing — they never hide a newer checkpoint.
    pointers = data.draw(pointers_into(catalog, dangling=True))
    order = resume_order(catalog, pointers, PointerName.LAST)
    assert sorted(order) == sorted(e.name for e in catalog)
    seqs = [catalog.get(n).seq for n in order]  # type: ignore[union-attr]
    assert seqs == sorted(seqs, reverse=True)


@given(st.data(), catalogs(), bests)
def test_best_tries_the_pointer_then_better_metrics_first(
    data: st.DataObject, catalog: Catalog, best: Best
) -> None:
    pointers = data.draw(pointers_into(catalog, dangling=True))
    order = resume_order(catalog, pointers, PointerName.BEST, best)
    assert len(order) == len(set(order))
    assert all(name in catalog for name in order)
    rest = list(order)
    if pointers.best is not NO_CHECKPOINT and pointers.best in catalog:
        assert rest.pop(0) == pointers.best
    keys = [best.rank_key(catalog.get(n).metrics[METRIC]) for n in rest]  # type: ignore[union-attr]
    assert keys == sorted(keys)
    candidates = {
        e.name for e in catalog if METRIC in e.metrics and e.metrics[METRIC] == e.metrics[METRIC]
    }
    assert set(rest) == candidates - {pointers.best}


@given(st.data(), catalogs())
def test_final_tries_the_pointer_then_other_normal_ends(
    data: st.DataObject, catalog: Catalog
) -> None:
    pointers = data.draw(pointers_into(catalog, dangling=True))
    order = list(resume_order(catalog, pointers, PointerName.FINAL))
    if pointers.final is not NO_CHECKPOINT and pointers.final in catalog:
        assert order.pop(0) == pointers.final
    finals = [e.name for e in reversed(catalog.entries) if e.reason is SaveReason.FINAL]
    assert order == [n for n in finals if n != pointers.final]


def test_best_without_a_metric_tries_only_the_pointer() -> None:
    catalog = Catalog(
        entries=[
            CheckpointEntry(progress=Progress(step=s), seq=s, reason=SaveReason.BEST)
            for s in (1, 2)
        ]
    )
    assert resume_order(catalog, Pointers(best=_name(1)), PointerName.BEST) == (_name(1),)
    assert resume_order(catalog, Pointers(), PointerName.BEST) == ()
    assert resume_order(Catalog(), Pointers(), PointerName.LAST) == ()


@given(st.integers(min_value=1, max_value=1 << 20))
def test_only_a_job_of_one_process_drops_what_it_read_behind_the_read(world_size: int) -> None:
    # With more ranks the others read the chosen file after rank 0, from the page cache.
    assert drop_behind(world_size) is (world_size == 1)


@given(st.integers(max_value=0))
def test_a_world_of_no_process_is_refused(world_size: int) -> None:
    with pytest.raises(ValueError, match=f"world_size must be at least 1, got {world_size}"):
        drop_behind(world_size)
