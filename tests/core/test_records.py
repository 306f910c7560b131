"""The core's records: validation, derived facts and small behaviours."""

from __future__ import annotations

import math

import attrs
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
    Policy,
    Progress,
    SaveReason,
    freeze_metrics,
)
from pitstop.errors import ConfigError, InvalidValue
from strategies import catalogs, finite_metric_values, progresses


@given(progresses(), st.integers(0, 100), st.integers(0, 100))
def test_advance_is_one_update(progress: Progress, samples: int, tokens: int) -> None:
    after = progress.advance(samples=samples, tokens=tokens)
    assert after.step == progress.step + 1
    assert after.batch_in_epoch == progress.batch_in_epoch + 1
    assert after.epoch == progress.epoch
    assert (after.samples, after.tokens) == (progress.samples + samples, progress.tokens + tokens)


@given(progresses())
def test_next_epoch_resets_the_batch_position_only(progress: Progress) -> None:
    after = progress.next_epoch()
    assert (after.epoch, after.batch_in_epoch) == (progress.epoch + 1, 0)
    assert (after.step, after.samples, after.tokens) == (
        progress.step,
        progress.samples,
        progress.tokens,
    )


def test_records_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Progress().step = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Progress(step=-1), "Progress.step must be an int >= 0, got -1"),
        (lambda: Progress(epoch=True), "Progress.epoch must be an int >= 0, got True"),
        (lambda: Progress(samples=1.5), "Progress.samples must be an int >= 0, got 1.5"),
        (lambda: Progress().advance(samples=-2), "Progress.samples must be an int >= 0"),
        (lambda: Policy(every_steps=0), "Policy.every_steps must be a positive int or None"),
        (lambda: Policy(keep_last=0), "Policy.keep_last must be a positive int or None, got 0"),
        (lambda: Policy(keep_every=-5), "Policy.keep_every must be a positive int or None"),
        (lambda: Policy(every_seconds=math.inf), "Policy.every_seconds must be a positive"),
        (lambda: Policy(every_seconds=0), "Policy.every_seconds must be a positive"),
        (lambda: Policy(save_final=1), "Policy.save_final must be a bool, got 1"),
        (lambda: Policy(best="val_loss"), "Policy.best must be a Best or None"),
        (lambda: Best(""), "Best.metric must be a non-empty str"),
        (lambda: Best("loss", mode="lowest"), "Best.mode must be 'min' or 'max', got 'lowest'"),
        (lambda: Pointers(best_value=1.0), "there is no best checkpoint"),
        (lambda: Pointers(last=""), "Pointers.last must be a checkpoint name"),
    ],
)
def test_validation_names_field_and_value(make: object, message: str) -> None:
    with pytest.raises(InvalidValue) as info:
        make()  # type: ignore[operator]
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, ValueError)


def test_policy_defaults_match_the_contract() -> None:
    policy = Policy()
    assert (policy.every_steps, policy.every_seconds, policy.keep_last) == (None, None, 3)
    assert (policy.keep_every, policy.best, policy.save_final) == (None, None, True)


@given(finite_metric_values, finite_metric_values)
def test_best_improves_strictly(a: float, b: float) -> None:
    low, high = Best("m"), Best("m", mode="max")
    assert low.improves(a, b) == (a < b)
    assert high.improves(a, b) == (a > b)
    assert not low.improves(a, a)  # a tie keeps the incumbent
    assert low.improves(a, None)


def test_nan_never_improves_and_never_blocks() -> None:
    best = Best("m")
    assert not best.improves(math.nan, None)
    assert not best.improves(math.nan, 1.0)
    assert best.improves(1.0, math.nan)


def test_metrics_are_frozen_floats() -> None:
    frozen = freeze_metrics({"loss": 1, "acc": 0.5})
    assert dict(frozen) == {"loss": 1.0, "acc": 0.5}
    assert isinstance(frozen["loss"], float)
    with pytest.raises(TypeError):
        frozen["loss"] = 2.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"loss": "low"}, "metrics['loss'] must be a real number, got 'low'"),
        ({"loss": True}, "metrics['loss'] must be a real number, got True"),
        ({1: 1.0}, "metrics keys must be str, got 1"),
        ([("loss", 1.0)], "metrics must be a mapping"),
    ],
)
def test_bad_metrics_name_the_key(metrics: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        freeze_metrics(metrics)  # type: ignore[arg-type]


def _entry(step: int, seq: int, reason: SaveReason = SaveReason.INTERVAL) -> CheckpointEntry:
    return CheckpointEntry(progress=Progress(step=step), seq=seq, reason=reason)


def test_entry_name_and_step_derive_from_progress() -> None:
    entry = _entry(100, 1)
    assert entry.step == 100
    assert entry.name == "step_000000000100.pitstop"


def test_entry_reason_accepts_its_string_value() -> None:
    assert CheckpointEntry(progress=Progress(), seq=1, reason="stop").reason is SaveReason.STOP


@given(catalogs())
def test_catalog_is_ordered_by_sequence_number(catalog: Catalog) -> None:
    seqs = [e.seq for e in catalog]
    assert seqs == sorted(seqs)
    assert all(catalog.next_seq() > s for s in seqs)
    newest = catalog.newest()
    if seqs:
        assert newest is not NO_CHECKPOINT
        assert newest.seq == max(seqs)
    else:
        assert newest is NO_CHECKPOINT
        assert catalog.next_seq() == 1


def test_catalog_rejects_two_entries_for_one_name() -> None:
    with pytest.raises(ConfigError, match=r"step_000000000005\.pitstop"):
        Catalog(entries=(_entry(5, 1), _entry(5, 2)))


def test_with_entry_replaces_the_same_name() -> None:
    catalog = Catalog(entries=(_entry(5, 1), _entry(10, 2)))
    replaced = catalog.with_entry(_entry(5, 3, SaveReason.STOP))
    assert [(e.step, e.seq) for e in replaced] == [(10, 2), (5, 3)]
    assert replaced.get("step_000000000005.pitstop") == _entry(5, 3, SaveReason.STOP)
    assert replaced.without(["step_000000000010.pitstop"]).get("step_000000000010.pitstop") is (
        NO_CHECKPOINT
    )


def test_pointers_report_their_targets() -> None:
    pointers = Pointers(last="a.pitstop", best="b.pitstop", best_value=0.5)
    assert pointers.target(PointerName.BEST) == "b.pitstop"
    assert pointers.target(PointerName.FINAL) is NO_CHECKPOINT
    assert pointers.items() == ((PointerName.LAST, "a.pitstop"), (PointerName.BEST, "b.pitstop"))
    assert pointers.targets() == frozenset({"a.pitstop", "b.pitstop"})
