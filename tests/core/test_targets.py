"""Absolute step and epoch targets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pitstop
from pitstop.core.records import Progress
from pitstop.core.saving.targets import (
    RunTarget,
    micro_batch_position,
    new_updates,
    plan_run,
    target_epoch,
    target_step,
)
from pitstop.errors import ConfigError
from strategies import progresses

counts = st.integers(0, 10**9)


# The seed's "Absolute target behavior" table (003_…).
@pytest.mark.parametrize(
    ("restored", "requested", "updates"),
    [(0, 10, 10), (4, 10, 6), (10, 10, 0), (12, 10, 0)],
)
def test_absolute_target_table(restored: int, requested: int, updates: int) -> None:
    assert target_step(restored, requested) == max(restored, requested)
    assert new_updates(restored, requested) == updates
    assert pitstop.target_step(restored, requested) == target_step(restored, requested)


@given(counts, counts)
def test_target_is_max_and_updates_are_never_negative(restored: int, requested: int) -> None:
    assert target_step(restored, requested) == max(restored, requested)
    assert new_updates(restored, requested) == max(0, requested - restored)
    assert target_epoch(restored, requested) == max(restored, requested)


@given(counts, counts, counts)
def test_raising_a_limit_continues_the_run(restored: int, a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert new_updates(restored, high) - new_updates(restored, low) == max(
        0, high - max(restored, low)
    )


@pytest.mark.parametrize(("restored", "requested"), [(-1, 3), (3, -1), (True, 3), (3, 2.5)])
def test_invalid_positions_are_config_errors(restored: object, requested: object) -> None:
    with pytest.raises(ConfigError, match="must be an int >= 0"):
        target_step(restored, requested)  # type: ignore[arg-type]


@given(progresses(), st.none() | counts, st.none() | st.integers(0, 1000))
def test_plan_run_applies_the_same_arithmetic(
    restored: Progress, max_steps: int | None, epochs: int | None
) -> None:
    target = plan_run(restored, max_steps=max_steps, epochs=epochs)
    if max_steps is None:
        assert target.step is None
        assert target.updates_left(restored) is None
    else:
        assert target.step == max(restored.step, max_steps)
        assert target.updates_left(restored) == new_updates(restored.step, max_steps)
    if epochs is not None:
        assert target.epoch == max(restored.epoch, epochs)
    reached = (max_steps is not None and restored.step >= max_steps) or (
        epochs is not None and restored.epoch >= epochs
    )
    assert target.reached(restored) == reached


def test_a_run_without_limits_never_ends_on_its_own() -> None:
    assert not RunTarget().reached(Progress(step=10**9, epoch=10**6))


@pytest.mark.parametrize(
    ("max_steps", "epochs", "name"), [(True, None, "max_steps"), (None, -1, "epochs")]
)
def test_plan_run_names_the_bad_limit(max_steps: object, epochs: object, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be an int >= 0"):
        plan_run(Progress(), max_steps=max_steps, epochs=epochs)  # type: ignore[arg-type]


# --- a sampler's position under gradient accumulation --------------------------------------------


@given(st.integers(1, 64), st.integers(1, 8), st.data())
def test_a_resumed_run_starts_at_the_micro_batch_the_straight_run_reads_next(
    batches: int, accumulate: int, data: st.DataObject
) -> None:
    # The straight run: windows of `accumulate` micro-batches, one update (Progress.advance)
    # per full window; stopped after any number of updates it could make in the epoch.
    updates = data.draw(st.integers(0, batches // accumulate))
    read = iter(range(batches))
    progress = Progress()
    for _ in range(updates):
        for _ in range(accumulate):
            next(read)
        progress = progress.advance()
    next_read = next(read, batches)
    assert (
        micro_batch_position(
            progress.batch_in_epoch, accumulate=accumulate, batches_per_epoch=batches
        )
        == next_read
    )


@given(st.integers(0, 10**6), st.integers(1, 64), st.integers(0, 10**6), st.integers(0, 99))
def test_a_position_past_the_epoch_is_refused_naming_the_numbers(
    updates: int, accumulate: int, batches: int, epoch: int
) -> None:
    if updates * accumulate <= batches:
        assert (
            micro_batch_position(
                updates, accumulate=accumulate, batches_per_epoch=batches, epoch=epoch
            )
            == updates * accumulate
        )
        return
    with pytest.raises(ConfigError) as caught:
        micro_batch_position(updates, accumulate=accumulate, batches_per_epoch=batches, epoch=epoch)
    message = str(caught.value)
    assert f"batches_per_epoch={batches}" in message
    assert f"got {updates} (epoch {epoch})" in message
    assert (f"accumulate={accumulate}" in message) == (accumulate > 1)


@pytest.mark.parametrize("accumulate", [0, -1, 1.0, True, "2"])
def test_accumulate_must_be_a_positive_int(accumulate: object) -> None:
    with pytest.raises(ConfigError, match=f"accumulate must be an int >= 1, got {accumulate!r}"):
        micro_batch_position(0, accumulate=accumulate, batches_per_epoch=4)  # type: ignore[arg-type]
