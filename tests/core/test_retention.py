"""Retention: what is kept, why, and what is never deleted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    CheckpointEntry,
    KeepReason,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.retention import plan_retention
from strategies import catalogs, pointers_into, policies


def _catalog(*steps: int) -> Catalog:
    return Catalog(
        entries=[
            CheckpointEntry(progress=Progress(step=s), seq=i + 1, reason=SaveReason.INTERVAL)
            for i, s in enumerate(steps)
        ]
    )


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


@given(st.data(), catalogs(), policies)
def test_retention_invariants(data: st.DataObject, catalog: Catalog, policy: Policy) -> None:
    pointers = data.draw(pointers_into(catalog))
    plan = plan_retention(catalog, pointers, policy)
    names = [e.name for e in catalog]

    assert set(plan.keep).isdisjoint(plan.delete)
    assert set(plan.keep) | set(plan.delete) == set(names)
    assert list(plan.delete) == [n for n in names if n in plan.delete]  # oldest first
    assert pointers.targets() <= set(plan.keep)  # pointer targets are never deleted
    newest = catalog.newest()
    if newest is not NO_CHECKPOINT:
        assert KeepReason.NEWEST in plan.why(newest.name)
    if policy.keep_last is None:
        assert plan.delete == ()
    else:
        assert set(names[-policy.keep_last :]) <= set(plan.keep)
    for entry in catalog:
        why = plan.why(entry.name)
        if policy.keep_every is not None and entry.step % policy.keep_every == 0:
            assert KeepReason.KEEP_EVERY in why
        if entry.name in plan.delete:
            assert why == frozenset()


def test_keep_last_keeps_the_most_recent_by_sequence_not_by_step() -> None:
    # An abandoned timeline: 300 was saved before the run resumed at 100 and saved 200 again.
    catalog = Catalog(
        entries=[
            CheckpointEntry(progress=Progress(step=s), seq=q, reason=SaveReason.INTERVAL)
            for s, q in [(100, 1), (300, 3), (200, 4)]
        ]
    )
    plan = plan_retention(catalog, Pointers(), Policy(keep_last=1))
    assert plan.delete == (_name(100), _name(300))


def test_each_kept_checkpoint_carries_its_reasons() -> None:
    catalog = _catalog(10, 20, 30, 40, 50)
    pointers = Pointers(last=_name(50), best=_name(10), best_value=0.1, final=_name(50))
    plan = plan_retention(catalog, pointers, Policy(keep_last=2, keep_every=20))
    assert plan.why(_name(10)) == {KeepReason.POINTER_BEST}
    assert plan.why(_name(20)) == {KeepReason.KEEP_EVERY}
    assert plan.why(_name(30)) == frozenset()
    assert plan.why(_name(40)) == {KeepReason.RECENT, KeepReason.KEEP_EVERY}
    assert plan.why(_name(50)) == {
        KeepReason.NEWEST,
        KeepReason.RECENT,
        KeepReason.POINTER_LAST,
        KeepReason.POINTER_FINAL,
    }
    assert plan.delete == (_name(30),)


def test_keep_all() -> None:
    plan = plan_retention(_catalog(1, 2, 3), Pointers(), Policy(keep_last=None))
    assert plan.delete == ()
    assert all(KeepReason.KEEP_ALL in why for why in plan.keep.values())


def test_empty_directory() -> None:
    plan = plan_retention(Catalog(), Pointers(), Policy())
    assert (dict(plan.keep), plan.delete) == ({}, ())
