"""Agreement between ranks: merged inputs and outcomes are the same whichever rank looks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import (
    INTERRUPTED,
    OK,
    SECONDHAND,
    CallInput,
    Outcome,
    agree,
    entry_from_wire,
    entry_to_wire,
    merge_inputs,
    per_rank_message,
)
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, SaveReason
from strategies import metrics, progresses

reasons = st.sampled_from(["", "SIGTERM", "SIGINT", SECONDHAND, "preempted"])
inputs = st.builds(
    CallInput,
    stop=st.booleans(),
    reason=reasons,
    metrics=st.none() | st.dictionaries(st.sampled_from(["loss", "acc"]), st.floats(0, 1)),
    now=st.floats(0, 1e6),
)


@given(st.lists(inputs, min_size=1, max_size=8))
def test_any_rank_stops_every_rank_with_the_first_real_reason(ranks: list[CallInput]) -> None:
    merged = merge_inputs(ranks)
    assert merged.stop is any(r.stop for r in ranks)
    assert (merged.metrics, merged.now) == (ranks[0].metrics, ranks[0].now)
    real = [r.reason for r in ranks if r.stop and r.reason and r.reason != SECONDHAND]
    if real:
        assert merged.reason == real[0]  # the rank that got the signal, not one that heard of it
    elif not merged.stop:
        assert merged.reason == ""


def test_a_rank_that_only_heard_of_the_stop_loses_to_the_one_that_got_it() -> None:
    merged = merge_inputs(
        [CallInput(stop=True, reason=SECONDHAND), CallInput(stop=True, reason="SIGTERM")]
    )
    assert (merged.stop, merged.reason) == (True, "SIGTERM")


outcomes = st.builds(
    Outcome,
    kind=st.sampled_from(["", "SaveError", "CheckpointCorrupt", INTERRUPTED]),
    error=st.sampled_from(["", "disk full", "bad byte"]),
    rank=st.integers(0, 7),
)


@given(st.lists(outcomes, min_size=1, max_size=8))
def test_an_interrupted_rank_decides_then_the_lowest_failing_one(ranks: list[Outcome]) -> None:
    agreed = agree(ranks)
    interrupted = [o for o in ranks if o.interrupted]
    failing = [o for o in ranks if not o.ok]
    assert agreed == (interrupted or failing or [OK])[0]
    assert agreed.interrupted == bool(interrupted)
    assert agreed.ok == (not failing)


@given(st.integers(1, 64), st.integers(1, 64))
def test_the_world_size_message_names_both_sizes(stored: int, live: int) -> None:
    message = per_rank_message(stored, live, ["sampler"])
    assert f"world size is {stored} in the checkpoint, {live} in the run" in message
    assert "component 'sampler'" in message
    assert "strict=False" in message


entries = st.builds(
    CheckpointEntry,
    progress=progresses(),
    seq=st.integers(1, 10**9),
    reason=st.sampled_from(SaveReason),
    detail=st.sampled_from(["", "SIGTERM", "SIGINT"]),
    metrics=metrics,
    sharded=st.booleans(),
)


@given(entries)
def test_entries_travel_between_ranks_intact(entry: CheckpointEntry) -> None:
    assert entry_from_wire(entry_to_wire(entry)) == entry  # the wire form: test_valuecodec.py
    assert entry_to_wire(NO_CHECKPOINT) is None
    assert entry_from_wire(None) is NO_CHECKPOINT
