"""Resume order: which checkpoint a resume tries first, and the fallbacks."""

from __future__ import annotations

import pytest
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
from pitstop.core.saving.pointers import Tier, drop_behind, resume_order, tiered_resume_order
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


@st.composite
def _tiers(draw: st.DrawFn) -> tuple[Catalog, Catalog]:
    """A local catalog and a remote one: copies of some local checkpoints (same name and seq)
    and checkpoints of the remote alone (retired locally, or another timeline's, even under a
    local name)."""
    local = draw(catalogs(max_size=8))
    copies = [e for e in local if draw(st.booleans())]
    others = [e for e in draw(catalogs(max_size=8)) if e.name not in {c.name for c in copies}]
    return local, Catalog(entries=(*copies, *others))


def _pointers(data: st.DataObject, catalog: Catalog) -> Pointers:
    return data.draw(pointers_into(catalog, dangling=True))


@given(st.data(), _tiers(), st.sampled_from(PointerName), bests)
def test_a_tiered_resume_tries_every_candidate_of_both_tiers_once(
    data: st.DataObject, tiers: tuple[Catalog, Catalog], source: PointerName, best: Best
) -> None:
    local, remote = tiers
    pl, pr = _pointers(data, local), _pointers(data, remote)
    order = tiered_resume_order((local, pl), (remote, pr), source, best)
    assert len(order) == len(set(order))
    mine = [n for t, n in order if t is Tier.LOCAL]
    theirs = [n for t, n in order if t is Tier.REMOTE]
    assert sorted(theirs) == sorted(resume_order(remote, pr, source, best))
    if source is PointerName.LAST:
        assert sorted(mine) == sorted(resume_order(local, pl, source, best))
        return
    assert tuple(mine) == resume_order(local, pl, source, best)  # the local order is kept
    twins = [n for n in theirs if n in local and local.get(n) == remote.get(n) and n in mine]
    for name in twins:  # a copy of a local candidate is tried right after it
        assert order.index((Tier.REMOTE, name)) == order.index((Tier.LOCAL, name)) + 1
    rest = [n for n in theirs if n not in twins]  # the others, in the remote tier's order
    assert rest == [n for n in resume_order(remote, pr, source, best) if n not in twins]


@given(st.data(), _tiers())
def test_a_tiered_resume_of_last_tries_the_newest_in_either_tier_local_first(
    data: st.DataObject, tiers: tuple[Catalog, Catalog]
) -> None:
    local, remote = tiers
    order = tiered_resume_order(
        (local, _pointers(data, local)), (remote, _pointers(data, remote)), PointerName.LAST
    )
    entries = [(local if t is Tier.LOCAL else remote).get(n) for t, n in order]
    keys = [(e.seq, e.step) for e in entries]  # type: ignore[union-attr]
    assert keys == sorted(keys, reverse=True)
    for (tier, name), key in zip(order, keys, strict=True):
        if tier is Tier.REMOTE and name in local:
            twin = local.get(name)
            if (twin.seq, twin.step) == key:  # type: ignore[union-attr]
                assert order.index((Tier.LOCAL, name)) < order.index((tier, name))


@given(st.data(), catalogs(max_size=12), st.sampled_from(PointerName), bests)
def test_one_empty_tier_leaves_the_other_tiers_order(
    data: st.DataObject, catalog: Catalog, source: PointerName, best: Best
) -> None:
    pointers = _pointers(data, catalog)
    alone = resume_order(catalog, pointers, source, best)
    empty = (Catalog(), Pointers())
    assert tiered_resume_order((catalog, pointers), empty, source, best) == tuple(
        (Tier.LOCAL, n) for n in alone
    )
    assert tiered_resume_order(empty, (catalog, pointers), source, best) == tuple(
        (Tier.REMOTE, n) for n in alone
    )


def test_a_damaged_newest_local_checkpoint_falls_back_to_its_remote_copy_first() -> None:
    def entry(step: int, seq: int) -> CheckpointEntry:
        return CheckpointEntry(progress=Progress(step=step), seq=seq, reason=SaveReason.INTERVAL)

    local = Catalog(entries=[entry(10, 1), entry(20, 2), entry(30, 3)])
    remote = Catalog(entries=[entry(10, 1), entry(20, 2), entry(30, 3), entry(40, 4)])
    order = tiered_resume_order((local, Pointers()), (remote, Pointers()), PointerName.LAST)
    assert order[:4] == (
        (Tier.REMOTE, _name(40)),  # newer than anything local
        (Tier.LOCAL, _name(30)),
        (Tier.REMOTE, _name(30)),
        (Tier.LOCAL, _name(20)),
    )
