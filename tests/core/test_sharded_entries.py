"""Sharded checkpoint directories among the core's decisions: names, entries, plans, pointers.

A sharded checkpoint is the directory ``step_<12 digits>`` (no suffix); everything the core
decides about files — classification, the entry's name, the save plan, retention, the
pointers latest.json may hold, what travels between ranks — holds for directories the same
way, in catalogs that mix both.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.metadata import entry_from_meta, entry_meta, pointers_from_latest_json
from pitstop.core.naming import (
    NOT_A_CHECKPOINT,
    EntryKind,
    checkpoint_name,
    classify,
    parse_checkpoint,
    parse_name,
    parse_sharded_name,
    sharded_name,
)
from pitstop.core.ranks import entry_from_wire, entry_to_wire
from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    CheckpointEntry,
    PointerName,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.plan import plan_save
from pitstop.core.saving.schedule import SaveDecision, ScheduleState
from strategies import catalogs, pointers_into, policies, progresses, steps

mixed_catalogs = catalogs(sharded=st.booleans())


@given(steps)
def test_a_directory_name_is_a_checkpoint_and_never_a_file_name(step: int) -> None:
    name = sharded_name(step)
    assert classify(name) is EntryKind.CHECKPOINT
    assert parse_sharded_name(name) == parse_checkpoint(name) == step
    assert parse_name(name) is NOT_A_CHECKPOINT
    assert parse_sharded_name(checkpoint_name(step)) is NOT_A_CHECKPOINT
    assert parse_checkpoint(checkpoint_name(step)) == step


@given(st.text(max_size=30))
def test_only_the_two_exact_forms_are_checkpoint_names(name: str) -> None:
    step = parse_checkpoint(name)
    if step is NOT_A_CHECKPOINT:
        assert classify(name) is not EntryKind.CHECKPOINT
    else:
        assert name in {checkpoint_name(step), sharded_name(step)}


@given(progresses(), st.booleans(), st.integers(1, 10**6))
def test_an_entry_is_named_by_its_form_and_its_manifest_reads_back(
    progress: Progress, sharded: bool, seq: int
) -> None:
    entry = CheckpointEntry(progress=progress, seq=seq, reason=SaveReason.INTERVAL, sharded=sharded)
    assert entry.name == (sharded_name if sharded else checkpoint_name)(progress.step)
    assert entry_from_meta(entry.name, entry_meta(entry)) == entry
    assert entry_from_wire(entry_to_wire(entry)) == entry  # travels: tests/shell/test_valuecodec


def _decision() -> SaveDecision:
    return SaveDecision(
        write=True,
        reasons=frozenset({SaveReason.INTERVAL}),
        moves=frozenset({PointerName.LAST}),
        best_value=None,
        state=ScheduleState(timer_start=0.0),
    )


@given(st.data(), mixed_catalogs, policies, st.integers(0, 10_000), st.booleans())
def test_a_sharded_save_plans_a_directory_and_retention_keeps_every_pointer_target(
    data: st.DataObject, catalog: Catalog, policy: Policy, step: int, sharded: bool
) -> None:
    pointers = data.draw(pointers_into(catalog))
    plan = plan_save(
        catalog,
        pointers,
        _decision(),
        progress=Progress(step=step),
        policy=policy,
        sharded=sharded,
    )
    entry = plan.entry
    assert entry is not NO_CHECKPOINT
    assert entry.sharded is sharded
    assert plan.pointers.last == entry.name
    assert plan.replaces == (entry.name in catalog)
    after = plan.catalog_after
    assert entry.name in after
    for pointer in PointerName:
        target = plan.pointers.target(pointer)
        assert target is NO_CHECKPOINT or target in after
    assert {e.sharded for e in after} <= {e.sharded for e in catalog} | {sharded}


@given(steps, st.booleans())
def test_latest_json_may_name_a_checkpoint_directory(step: int, sharded: bool) -> None:
    name = (sharded_name if sharded else checkpoint_name)(step)
    pointers, problems = pointers_from_latest_json({"pointers": {"last": name, "best": "x/"}})
    assert pointers.last == name
    assert pointers.best is NO_CHECKPOINT
    assert len(problems) == 1
