"""When to save: interval, time, best, stop, final and manual saves."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.schedule import (
    Call,
    SaveDecision,
    ScheduleState,
    decide_save,
    foresees_write,
    resumed_state,
)
from pitstop.errors import ConfigError
from plan_driver import Driver
from strategies import METRIC, metric_values, policies


# The seed's "Final-step gap" table (003_…): saving only at exact multiples of every_steps.
@pytest.mark.parametrize(
    ("final_step", "interval", "latest_saved"),
    [(3, 2, 2), (4, 2, 4), (5, 2, 4)],
)
def test_final_step_gap_table_holds_with_save_final_false(
    final_step: int, interval: int, latest_saved: int
) -> None:
    driver = Driver(Policy(every_steps=interval, save_final=False))
    driver.run(final_step)
    assert driver.latest_saved_step() == latest_saved
    assert driver.pointers.final is NO_CHECKPOINT  # a normal end without save_final moves nothing


@pytest.mark.parametrize(("final_step", "interval"), [(3, 2), (4, 2), (5, 2), (1, 7)])
def test_save_final_always_saves_the_final_step(final_step: int, interval: int) -> None:
    driver = Driver(Policy(every_steps=interval, save_final=True))
    driver.run(final_step)
    assert driver.latest_saved_step() == final_step
    assert driver.pointers.final == driver.pointers.last
    assert driver.written.count(final_step) == 1  # 4/2: the interval save is reused


@given(st.integers(1, 20), st.integers(1, 60))
def test_interval_saves_happen_at_exact_multiples_only(every: int, final_step: int) -> None:
    driver = Driver(Policy(every_steps=every, save_final=False))
    driver.run(final_step)
    assert driver.written == list(range(every, final_step + 1, every))


def test_step_zero_is_never_an_interval_save() -> None:
    decision = decide_save(
        Policy(every_steps=1),
        ScheduleState(timer_start=0.0),
        Pointers(),
        call=Call.MAYBE,
        progress=Progress(),
        now=0.0,
    )
    assert not decision.acts


def test_time_trigger_counts_from_the_last_write() -> None:
    driver = Driver(Policy(every_seconds=10.0, save_final=False))
    for step, now in [(1, 5.0), (2, 9.99), (3, 10.0), (4, 15.0), (5, 20.0)]:
        driver.call(Call.MAYBE, Progress(step=step), now=now)
    assert driver.written == [3, 5]
    assert driver.plans[0].entry.reason is SaveReason.TIME  # type: ignore[union-attr]


def test_best_saves_when_the_metric_improves() -> None:
    driver = Driver(Policy(best=Best(METRIC), save_final=False))
    losses = {2: 0.9, 4: 0.5, 6: 0.7, 8: 0.5, 10: 0.1}
    driver.run(10, metrics_at={s: {METRIC: v} for s, v in losses.items()})
    assert driver.written == [2, 4, 10]
    assert driver.pointers.best == driver.catalog.entries[-1].name
    assert driver.pointers.best_value == pytest.approx(0.1)


def test_stop_saves_last_with_the_stop_reason_and_no_final() -> None:
    driver = Driver(Policy(every_steps=100))
    driver.run(50, stop_at=7)
    assert driver.written == [7]
    assert driver.catalog.entries[-1].reason is SaveReason.STOP
    assert driver.pointers.final is NO_CHECKPOINT  # a stop is not an end


def test_stop_with_save_final_false_still_saves() -> None:
    driver = Driver(Policy(save_final=False))
    driver.run(10, stop_at=3)
    assert driver.written == [3]


def test_manual_save_always_writes_and_records_manual() -> None:
    driver = Driver(Policy(every_steps=5))
    driver.call(Call.MAYBE, Progress(step=5))
    driver.call(Call.MANUAL, Progress(step=5))
    assert driver.written == [5, 5]
    assert driver.catalog.entries[-1].reason is SaveReason.MANUAL
    assert len(driver.catalog) == 1  # same name: the second write replaced the first


def test_final_and_best_at_an_already_saved_step_only_move_pointers() -> None:
    driver = Driver(Policy(every_steps=4, best=Best(METRIC)))
    driver.call(Call.MAYBE, Progress(step=4))
    decision = driver.call(Call.FINISH, Progress(step=4), metrics={METRIC: 0.3})
    assert not decision.write
    assert decision.moves == {PointerName.FINAL, PointerName.BEST}
    assert driver.written == [4]
    assert driver.pointers.final == driver.pointers.best == driver.pointers.last
    assert driver.pointers.best_value == pytest.approx(0.3)


def test_reason_priority() -> None:
    decision = decide_save(
        Policy(every_steps=2),
        ScheduleState(timer_start=0.0),
        Pointers(),
        call=Call.MAYBE,
        progress=Progress(step=2),
        now=0.0,
        stop=True,
    )
    assert decision.reasons == {SaveReason.INTERVAL, SaveReason.STOP}
    assert decision.reason is SaveReason.STOP


calls = st.lists(
    st.tuples(
        st.integers(0, 3),  # steps to advance before the call
        st.sampled_from([Call.MAYBE, Call.MAYBE, Call.FINISH]),
        st.none() | st.fixed_dictionaries({METRIC: metric_values}),
        st.booleans(),  # stop requested
        st.floats(0.0, 50.0),  # seconds passing
    ),
    max_size=40,
)


@given(policies, calls)
def test_no_step_is_written_twice_in_one_timeline(policy: Policy, script: list) -> None:  # type: ignore[type-arg]
    driver = Driver(policy)
    progress, now = Progress(), 0.0
    for advance, call, metrics, stop, seconds in script:
        for _ in range(advance):
            progress = progress.advance()
        now += seconds
        decision = driver.call(call, progress, now=now, metrics=metrics, stop=stop)
        assert decision.write == (PointerName.LAST in decision.moves)
        if decision.write:
            assert decision.state.last_saved_step == progress.step
            assert decision.state.timer_start == now
    assert len(driver.written) == len(set(driver.written))
    assert driver.written == sorted(driver.written)


def test_time_never_fires_at_step_zero_or_at_the_end() -> None:
    driver = Driver(Policy(every_seconds=1.0, save_final=False))
    driver.call(Call.MAYBE, Progress(step=0), now=100.0)
    driver.call(Call.FINISH, Progress(step=3), now=200.0)
    assert driver.written == []


def test_resumed_state_counts_the_restored_step_as_saved_only_if_it_is_the_newest() -> None:
    driver = Driver(Policy(every_steps=2))
    driver.run(6)  # writes 2, 4, 6
    newest, older = driver.catalog.entries[-1], driver.catalog.entries[0]
    assert resumed_state(driver.catalog, newest, now=5.0) == ScheduleState(
        timer_start=5.0, last_saved_step=6
    )
    assert resumed_state(driver.catalog, older, now=5.0) == ScheduleState(timer_start=5.0)
    assert resumed_state(driver.catalog, NO_CHECKPOINT, now=1.0) == ScheduleState(timer_start=1.0)


def test_a_stop_right_after_resuming_an_older_checkpoint_saves_it_again() -> None:
    driver = Driver(Policy(every_steps=2, keep_last=None))
    driver.run(6)
    older = driver.catalog.entries[0]  # step 2; 4 and 6 become an abandoned timeline
    driver.state = resumed_state(driver.catalog, older, now=0.0)
    driver.call(Call.FINISH, older.progress, stop=True)
    assert driver.written[-1] == 2
    assert driver.pointers.last == older.name  # a resume from `last` continues from the stop


# --- nothing is best before there is something to compare -------------------------------------


@given(policies, st.dictionaries(st.just(METRIC), metric_values, max_size=1), st.booleans())
def test_an_evaluation_before_any_training_is_never_best(
    policy: Policy, metrics: dict[str, float], finish: bool
) -> None:
    """Step 0 holds no update: a metric reported there saves nothing and moves no pointer."""
    decision = decide_save(
        policy,
        ScheduleState(timer_start=0.0),
        Pointers(),
        call=Call.FINISH if finish else Call.MAYBE,
        progress=Progress(),
        now=1e9,
        metrics=metrics,
    )
    assert SaveReason.BEST not in decision.reasons
    assert PointerName.BEST not in decision.moves
    if not finish:
        assert not decision.acts


def test_the_first_best_is_the_first_trained_step_that_reports_the_metric() -> None:
    driver = Driver(Policy(best=Best(METRIC), save_final=False))
    driver.call(Call.MAYBE, Progress(), metrics={METRIC: 5.0})  # the eval before training
    assert driver.written == []
    assert driver.pointers.best is NO_CHECKPOINT
    driver.call(Call.MAYBE, Progress(step=1))  # no metric: not a candidate
    driver.call(Call.MAYBE, Progress(step=2), metrics={"other": 0.0})  # not this metric either
    assert driver.written == []
    driver.call(Call.MAYBE, Progress(step=3), metrics={METRIC: 9.0})  # worse than step 0's
    assert driver.written == [3]
    assert driver.pointers.best == driver.catalog.entries[-1].name
    assert driver.pointers.best_value == 9.0


@given(policies, st.lists(st.none() | metric_values, min_size=1, max_size=12))
def test_best_only_ever_points_at_a_trained_save_that_carries_the_metric(
    policy: Policy, values: list[float | None]
) -> None:
    driver = Driver(policy)
    for step, value in enumerate(values):  # step 0 first: an evaluation before training
        metrics = None if value is None else {METRIC: value}
        driver.call(Call.MAYBE, Progress(step=step), metrics=metrics)
    if driver.pointers.best is not NO_CHECKPOINT:
        entry = driver.catalog.get(driver.pointers.best)
        assert entry is not NO_CHECKPOINT
        assert entry.step > 0
        assert METRIC in entry.metrics


@given(
    policy=policies,
    reached=st.integers(0, 1000),
    step=st.integers(0, 1000),
    call=st.sampled_from(list(Call)),
    stop=st.booleans(),
)
def test_a_call_below_the_step_the_run_reached_is_refused_and_no_other_is(
    policy: Policy, reached: int, step: int, call: Call, stop: bool
) -> None:
    state = ScheduleState(timer_start=0.0, reached_step=reached)

    def decide() -> object:
        return decide_save(
            policy, state, Pointers(), call=call, progress=Progress(step=step), now=1.0, stop=stop
        )

    if step < reached:
        message = f"{call.value}: progress went backwards: step {step}, .* at step {reached}"
        with pytest.raises(ConfigError, match=message):
            decide()
        return
    decision = decide()
    assert isinstance(decision, SaveDecision)
    # A write moves the run's step forward to this one; anything else leaves it where it was.
    assert decision.state.reached_step == (step if decision.write else reached)


def test_a_resume_sets_the_step_the_run_reached_wherever_it_resumed_from() -> None:
    driver = Driver(Policy(every_steps=2))
    driver.run(6)
    newest, older = driver.catalog.get(driver.pointers.last), driver.catalog.entries[0]
    assert resumed_state(driver.catalog, newest, now=0.0, step=6).reached_step == 6
    assert resumed_state(driver.catalog, older, now=0.0, step=2).reached_step == 2
    assert resumed_state(driver.catalog, NO_CHECKPOINT, now=0.0, step=9).reached_step == 9


@given(
    policies,
    st.sampled_from(list(Call)),
    st.integers(0, 120),
    st.none() | st.integers(0, 120),  # the step last saved
    st.booleans(),  # this rank's stop
    st.booleans(),  # another rank's stop
    st.none() | st.fixed_dictionaries({METRIC: metric_values}),
    st.floats(0.0, 2000.0),  # seconds since the timer started
)
def test_a_rank_foresees_exactly_the_writes_it_can_tell_of_alone(
    policy: Policy,
    call: Call,
    step: int,
    saved: int | None,
    stop: bool,
    other_stop: bool,
    metrics: dict[str, float] | None,
    seconds: float,
) -> None:
    state = ScheduleState(
        timer_start=0.0,
        last_saved_step=NO_CHECKPOINT if saved is None else saved,
        reached_step=min(step, saved or 0),
    )
    decision = decide_save(
        policy,
        state,
        Pointers(),
        call=call,
        progress=Progress(step=step),
        now=seconds,
        metrics=metrics,
        stop=stop or other_stop,
    )
    foreseen = foresees_write(policy, call, step, stop=stop)
    if foreseen:  # it writes, unless its step is saved already (an explicit save writes even so)
        assert decision.write or (call is not Call.MANUAL and saved == step)
    elif decision.write:  # a write this rank could not tell of alone
        assert decision.reasons & {SaveReason.TIME, SaveReason.BEST} or other_stop
