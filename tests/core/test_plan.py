"""Planning one save: sequence numbers, replacement of abandoned timelines, retention."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.plan import (
    plan_arrival,
    plan_catch_up,
    plan_save,
    plan_subject,
    rollback_removals,
)
from pitstop.core.saving.pointers import recompute_best, recompute_final
from pitstop.core.saving.schedule import Call, SaveDecision, ScheduleState
from plan_driver import Driver
from strategies import METRIC, catalogs, finite_metric_values, pointers_into, policies


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


def _decision(
    *reasons: SaveReason, write: bool = True, best_value: float | None = None
) -> SaveDecision:
    moves = {PointerName.LAST} if write else set()
    if SaveReason.FINAL in reasons:
        moves.add(PointerName.FINAL)
    if SaveReason.BEST in reasons:
        moves.add(PointerName.BEST)
    return SaveDecision(
        write=write,
        reasons=frozenset(reasons),
        moves=frozenset(moves),
        best_value=best_value,
        state=ScheduleState(timer_start=0.0),
    )


@given(st.data(), catalogs(), policies, st.integers(0, 10_000), st.none() | finite_metric_values)
def test_a_written_save_is_published_with_the_next_sequence_and_survives_retention(
    data: st.DataObject, catalog: Catalog, policy: Policy, step: int, value: float | None
) -> None:
    pointers = data.draw(pointers_into(catalog))
    metrics = None if value is None else {METRIC: value}
    plan = plan_save(
        catalog,
        pointers,
        _decision(SaveReason.INTERVAL),
        progress=Progress(step=step),
        policy=policy,
        metrics=metrics,
    )
    assert plan.entry is not NO_CHECKPOINT
    assert plan.entry.seq == catalog.next_seq()
    assert plan.entry.seq > max((e.seq for e in catalog), default=0)
    assert plan.replaces == (_name(step) in catalog)
    assert plan.pointers.last == _name(step)
    assert plan.catalog.newest() == plan.entry
    assert _name(step) not in plan.retention.delete
    assert plan.pointers.targets() <= set(plan.retention.keep)
    # Every pointer names a file that exists once the plan is carried out.
    assert all(t in plan.catalog_after for t in plan.pointers.targets() if t in plan.catalog)
    for name in plan.retention.delete:
        assert name in catalog  # only files that existed before this save are deleted


def test_replacing_an_abandoned_checkpoint_recomputes_pointers_to_it() -> None:
    best = Best(METRIC)
    policy = Policy(keep_last=None, best=best)
    # Timeline A saved 100, 200 (best, final) and 300; the run resumed from 100 and reaches 200.
    catalog = Catalog(
        entries=[
            CheckpointEntry(
                progress=Progress(step=100), seq=1, reason="interval", metrics={METRIC: 0.4}
            ),
            CheckpointEntry(
                progress=Progress(step=200), seq=2, reason="final", metrics={METRIC: 0.1}
            ),
            CheckpointEntry(progress=Progress(step=300), seq=3, reason="interval"),
        ]
    )
    pointers = Pointers(last=_name(300), best=_name(200), best_value=0.1, final=_name(200))
    plan = plan_save(
        catalog,
        pointers,
        _decision(SaveReason.INTERVAL),
        progress=Progress(step=200),
        policy=policy,
        metrics={METRIC: 0.3},
    )
    assert plan.replaces
    assert plan.entry.seq == 4  # type: ignore[union-attr]
    assert plan.pointers.last == _name(200)
    # The old best (0.1) is gone; the new 200 (0.3) beats the remaining 100 (0.4).
    assert (plan.pointers.best, plan.pointers.best_value) == (_name(200), 0.3)
    # The old final is gone and no other normal end exists.
    assert plan.pointers.final is NO_CHECKPOINT
    assert [e.step for e in plan.catalog] == [100, 300, 200]


def test_a_repoint_to_a_missing_file_becomes_a_write() -> None:
    driver = Driver(Policy(every_steps=4))
    driver.call(Call.MAYBE, Progress(step=4))
    driver.catalog = Catalog()  # the file was removed by hand
    decision = driver.call(Call.FINISH, Progress(step=4))
    assert not decision.write
    assert driver.written == [4, 4]
    assert driver.pointers.final == driver.pointers.last == _name(4)


def test_pointer_only_plans_write_nothing_and_may_release_an_old_best() -> None:
    policy = Policy(keep_last=1, best=Best(METRIC))
    driver = Driver(policy)
    driver.call(Call.MAYBE, Progress(step=1), metrics={METRIC: 0.5})
    driver.call(Call.MANUAL, Progress(step=2))
    driver.call(Call.MAYBE, Progress(step=2), metrics={METRIC: 0.4})
    plan = driver.plans[-1]
    assert plan.entry is NO_CHECKPOINT
    assert plan.pointers.best == _name(2)
    assert plan.retention.delete == (_name(1),)


@given(
    st.data(),
    catalogs(),
    policies,
    st.integers(0, 10_000),
    st.sets(st.sampled_from([SaveReason.INTERVAL, SaveReason.FINAL, SaveReason.BEST]), min_size=1),
    st.booleans(),
)
def test_a_rollback_takes_out_only_a_new_checkpoint_that_no_pointer_names(
    data: st.DataObject,
    catalog: Catalog,
    policy: Policy,
    step: int,
    reasons: set[SaveReason],
    write: bool,
) -> None:
    """Undoing a save whose pointer phase failed, however far putting the old pointers back
    got (on disk: any mix of old and new targets): the new file goes only if none of them
    names it and it replaced nothing — then the directory is as before; else it stays, listed.
    Either way every pointer on disk names a file that is there."""
    pointers = data.draw(pointers_into(catalog))
    if catalog and data.draw(st.booleans()):  # the step of a file there: a replacement
        step = data.draw(st.sampled_from([e.step for e in catalog]))
    plan = plan_save(
        catalog,
        pointers,
        _decision(*reasons, write=write),
        progress=Progress(step=step),
        policy=policy,
    )
    candidates = sorted(pointers.targets() | plan.pointers.targets())
    on_disk = data.draw(st.sets(st.sampled_from(candidates))) if candidates else set()
    named = plan.entry is not NO_CHECKPOINT and plan.entry.name in on_disk
    removed = rollback_removals(plan, named_on_disk=named)
    after = plan.catalog.without(removed)
    assert on_disk <= {e.name for e in after}  # nothing points at a missing checkpoint
    assert not set(removed) & {e.name for e in catalog}  # nothing that was there before goes
    if plan.entry is NO_CHECKPOINT or plan.replaces or named:
        assert removed == ()
        assert after == plan.catalog  # what stays is listed
    else:
        assert removed == (plan.entry.name,)
        assert after == catalog  # the directory is as it was


@given(st.data(), catalogs(), policies, st.integers(0, 10_000), st.booleans())
def test_a_saves_messages_name_what_it_writes_or_a_pointer_it_moves(
    data: st.DataObject, catalog: Catalog, policy: Policy, step: int, write: bool
) -> None:
    pointers = data.draw(pointers_into(catalog))
    reasons = (SaveReason.INTERVAL,) if write else (SaveReason.BEST,)
    plan = plan_save(
        catalog,
        pointers,
        _decision(*reasons, write=write),
        progress=Progress(step=step),
        policy=policy,
    )
    subject = plan_subject(plan, pointers)
    moved = [
        plan.pointers.target(p)
        for p in PointerName
        if plan.pointers.target(p) != pointers.target(p)
    ]
    named = [t for t in (*moved, plan.pointers.last) if t is not NO_CHECKPOINT]
    if plan.entry is not NO_CHECKPOINT:
        assert subject == (plan.entry.step, plan.entry.name)
    elif named:  # the first pointer it moves, else last (a best or final it leaves is no news)
        assert subject[1] == named[0]
    else:
        assert subject == ("?", "no checkpoint")


@given(st.data(), catalogs(max_size=12), policies, st.integers(0, 10_000), st.integers(1, 10**6))
def test_a_checkpoint_arriving_from_another_tier_keeps_its_seq_and_its_tiers_retention(
    data: st.DataObject, catalog: Catalog, policy: Policy, step: int, seq: int
) -> None:
    # The remote tier's own retention (and the local directory a remote checkpoint is brought
    # back into): the arriving checkpoint is not renumbered, the pointers are what the catalog
    # says, and retention keeps what the tier's policy keeps — the arrival among them when it
    # is the newest, and every pointer target.
    if any(e.seq == seq for e in catalog if e.name != _name(step)):
        return
    entry = CheckpointEntry(
        progress=Progress(step=step), seq=seq, reason=data.draw(st.sampled_from(SaveReason))
    )
    plan = plan_arrival(catalog, entry, policy)
    assert plan.entry == entry
    assert plan.replaces == (entry.name in catalog)
    assert plan.catalog.get(entry.name) == entry
    assert {e.name for e in plan.catalog} == {e.name for e in catalog} | {entry.name}
    newest = plan.catalog.newest()
    assert newest is not NO_CHECKPOINT
    assert plan.pointers.last == newest.name
    assert plan.pointers.final == recompute_final(plan.catalog)
    assert (plan.pointers.best, plan.pointers.best_value) == recompute_best(
        plan.catalog, policy.best
    )
    kept = {e.name for e in plan.catalog_after}
    assert plan.pointers.targets() <= kept
    if policy.keep_last is None:
        assert plan.retention.delete == ()
    else:
        assert len(kept) <= policy.keep_last + len(plan.pointers.targets()) + sum(
            1 for e in plan.catalog if policy.keep_every and e.step % policy.keep_every == 0
        )


def test_the_remote_tiers_keep_every_outlives_the_local_keep_last() -> None:
    remote = Policy(keep_last=None, keep_every=1000)
    local = Policy(keep_last=2)
    catalog = Catalog()
    local_catalog = Catalog()
    for seq, step in enumerate(range(500, 3001, 500), start=1):
        entry = CheckpointEntry(progress=Progress(step=step), seq=seq, reason=SaveReason.INTERVAL)
        catalog = plan_arrival(catalog, entry, remote).catalog_after
        local_catalog = plan_arrival(local_catalog, entry, local).catalog_after
    assert [e.step for e in catalog] == [500, 1000, 1500, 2000, 2500, 3000]  # keep_last=None
    assert [e.step for e in local_catalog] == [2500, 3000]
    thin = Policy(keep_last=1, keep_every=1000)
    catalog = Catalog()
    for seq, step in enumerate(range(500, 3001, 500), start=1):
        entry = CheckpointEntry(progress=Progress(step=step), seq=seq, reason=SaveReason.INTERVAL)
        catalog = plan_arrival(catalog, entry, thin).catalog_after
    assert [e.step for e in catalog] == [1000, 2000, 3000]


@given(st.data(), catalogs(max_size=10), policies)
def test_a_remote_tier_catches_up_on_what_it_lacks_and_would_keep(
    data: st.DataObject, local: Catalog, policy: Policy
) -> None:
    # The remote tier holds some of the local checkpoints (the uploads that succeeded, less
    # what its own retention retired); catching up uploads, oldest first, each local one it
    # lacks unless its retention would retire it at once — none of them is retired by its own
    # arrival, every one left out would be retired, and a second catch-up has nothing to do.
    held = data.draw(
        st.lists(st.sampled_from(local.entries), unique=True) if local else st.just([])
    )
    remote = Catalog(entries=tuple(held))
    chosen = plan_catch_up(local, remote, policy)
    missing = [e for e in local if e.name not in remote]
    assert set(chosen) <= set(missing)
    assert [e.seq for e in chosen] == sorted(e.seq for e in chosen)
    catalog = remote
    for entry in chosen:
        plan = plan_arrival(catalog, entry, policy)
        assert entry.name not in plan.retention.delete  # never retired at once
        catalog = plan.catalog_after
    merged = remote
    for entry in missing:
        merged = merged.with_entry(entry)
    everything = plan_arrival(merged, merged.newest(), policy) if merged else None
    for entry in missing:
        if entry not in chosen:
            assert everything is not None
            assert entry.name in everything.retention.delete
    assert plan_catch_up(local, catalog, policy) == ()


def test_catching_up_skips_what_the_remote_holds_a_newer_save_of() -> None:
    old = CheckpointEntry(progress=Progress(step=5), seq=3, reason=SaveReason.INTERVAL)
    new = CheckpointEntry(progress=Progress(step=5), seq=9, reason=SaveReason.INTERVAL)
    keep = Policy(keep_last=None)
    assert plan_catch_up(Catalog(entries=(old,)), Catalog(entries=(new,)), keep) == ()
    assert plan_catch_up(Catalog(entries=(new,)), Catalog(entries=(old,)), keep) == (new,)
