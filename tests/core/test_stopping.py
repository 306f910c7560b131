"""Stop agreement: no interleaving of signals and calls lets two ranks see different answers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import (
    NOT_REQUESTED,
    SECONDHAND,
    CallInput,
    StopState,
    agree_codes,
    agreed,
    heard,
    merge_inputs,
    offer_code,
    offered_reason,
    stop_origin,
    visible,
)

REASONS = st.sampled_from(["SIGTERM", "SIGINT", "preempted", "requested"])
POINTS = ("before the call", "after the call")


def _agree_by_sync(states: list[StopState]) -> list[StopState]:
    """StopRequest.sync(): every rank's code, all-reduced; every rank adopts the result."""
    stop, reason = agree_codes([offer_code(s) for s in states])
    return [agreed(s, stop=stop, reason=reason, ranks=len(states)) for s in states]


def _agree_by_call(states: list[StopState]) -> list[StopState]:
    """A save call given the stop: every rank's offer merged on rank 0, the answer broadcast."""
    inputs = []
    for state in states:
        stop, reason = offered_reason(state)
        inputs.append(CallInput(stop=stop, reason=reason))
    merged = merge_inputs(inputs)
    return [agreed(s, stop=merged.stop, reason=merged.reason, ranks=len(states)) for s in states]


# One step of the simulated job: which rank hears which signal at which point of the loop, and
# whether the step's agreement is a sync() or a save call.
steps = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 3), st.sampled_from(POINTS), REASONS), max_size=3),
        st.sampled_from(["sync", "call"]),
    ),
    min_size=1,
    max_size=12,
)


@given(st.integers(2, 4), steps)
def test_every_rank_sees_one_answer_and_leaves_at_the_same_step(
    world: int, script: list[tuple[list[tuple[int, str, str]], str]]
) -> None:
    states = [StopState() for _ in range(world)]
    left: list[int | None] = [None] * world
    first_heard: tuple[int, str] | None = None  # the step and point of the first request
    for step, (signals, how) in enumerate(script):
        for point in POINTS:
            if point == "after the call":
                states = _agree_by_sync(states) if how == "sync" else _agree_by_call(states)
            seen_before = [visible(s, many=True) for s in states]
            for rank, at, reason in signals:
                if at == point and rank < world:
                    states[rank] = heard(states[rank], reason)
                    first_heard = first_heard or (step, point)
            seen = [visible(s, many=True) for s in states]
            # A signal between two agreements changes nothing any rank can see...
            assert seen == seen_before
            # ...and every rank sees the same answer, with the same reason.
            assert len(set(seen)) == 1, seen
        for rank, state in enumerate(states):
            if left[rank] is None and visible(state, many=True)[0]:
                left[rank] = step  # the loop's `if stop: break`, after the call
    assert len(set(left)) == 1, left
    if first_heard is not None:
        step, point = first_heard
        # Never lost: taken by the step's own agreement, or held for the next one.
        expected = step if point == "before the call" else step + 1
        assert left[0] == (expected if expected < len(script) else None)
    else:
        assert left[0] is None


@given(st.lists(REASONS, min_size=1, max_size=3))
def test_one_process_sees_a_request_at_once_with_its_first_reason(reasons: list[str]) -> None:
    state = StopState()
    assert visible(state, many=False) == (False, None)
    for reason in reasons:
        state = heard(state, reason)
    assert visible(state, many=False) == (True, reasons[0])
    # Several ranks: nothing shows before an agreement.
    assert visible(state, many=True) == (False, None)


@given(REASONS, st.booleans(), REASONS)
def test_an_agreed_stop_is_never_taken_back(reason: str, stop: bool, later: str) -> None:
    state = agreed(StopState(), stop=True, reason=reason, ranks=2)
    assert offer_code(state) != NOT_REQUESTED  # offered again at every later agreement
    assert offered_reason(state) == (True, SECONDHAND)
    state = agreed(state, stop=stop, reason=later, ranks=2)
    assert visible(state, many=True) == (True, reason)
    # Once several ranks agreed, the agreed answer is what shows, whatever `many` says now.
    assert visible(state, many=False) == (True, reason)


@given(st.lists(st.sampled_from([None, *["SIGTERM", "SIGINT", "preempted"]]), min_size=1))
def test_sync_names_the_lowest_rank_that_heard_the_request(heard_by: list[str | None]) -> None:
    states = [StopState() if r is None else heard(StopState(), r) for r in heard_by]
    stop, reason = agree_codes([offer_code(s) for s in states])
    requested = [(rank, r) for rank, r in enumerate(heard_by) if r is not None]
    assert stop is bool(requested)
    if requested:
        rank, first = requested[0]
        assert reason == (first if first.startswith("SIG") else f"requested on rank {rank}")


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["", SECONDHAND, "SIGTERM", "x"]))))
def test_the_origin_is_the_rank_whose_reason_the_merge_keeps(pairs: list[tuple[bool, str]]) -> None:
    inputs = [CallInput(stop=s, reason=r) for s, r in pairs]
    origin = stop_origin(inputs)
    if not any(s for s, _ in pairs):
        assert origin is None
        return
    assert origin is not None
    assert inputs[origin].stop
    merged = merge_inputs(inputs)
    assert inputs[origin].reason == merged.reason
