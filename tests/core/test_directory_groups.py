"""Which ranks share a checkpoint directory, and how a directory catches up (core.ranks)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import (
    DirectoryGroups,
    Transfer,
    catch_up,
    directory_groups,
    merged_order,
)
from pitstop.core.ranks.catchup import Held, copies_first, copy_failed
from pitstop.errors import ConfigError

# A job: each rank's directory, as a label (ranks with the same label share a directory).
layouts = st.lists(st.integers(0, 3), min_size=1, max_size=9)


def sightings(layout: list[int]) -> list[set[int]]:
    """What each rank finds: the probes of every rank whose directory is its own."""
    return [{r for r, other in enumerate(layout) if other == mine} for mine in layout]


@given(layouts)
def test_ranks_that_see_each_other_form_one_group_written_by_its_lowest_rank(
    layout: list[int],
) -> None:
    groups = directory_groups(sightings(layout))
    assert sorted(r for g in groups.groups for r in g) == list(range(len(layout)))
    for rank, label in enumerate(layout):
        group = groups.groups[groups.group_of(rank)]
        assert set(group) == {r for r, other in enumerate(layout) if other == label}
        assert groups.writer(rank) == min(group)
        assert groups.writes(rank) == (rank == min(group))
    assert groups.writers[0] == 0  # rank 0 always writes its directory
    assert list(groups.writers) == sorted(groups.writers)
    assert groups.shared == (len(set(layout)) == 1)


@given(st.integers(1, 16))
def test_one_directory_is_one_group(world: int) -> None:
    shared = directory_groups([set(range(world))] * world)
    assert shared == DirectoryGroups.one(world)
    assert shared.shared
    assert shared.writers == (0,)


@given(layouts, st.data())
def test_a_directory_shared_in_part_is_refused(layout: list[int], data: st.DataObject) -> None:
    seen = sightings(layout)
    rank = data.draw(st.integers(0, len(layout) - 1))
    others = [r for r in range(len(layout)) if r not in seen[rank]]
    if not others:  # nothing to see in part: lose sight of the own probe instead
        seen[rank].discard(rank)
    else:
        seen[rank].add(data.draw(st.sampled_from(others)))  # one-sided: not an equivalence
    with pytest.raises(ConfigError, match="probe"):
        directory_groups(seen, directory="/ckpt")


@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_every_directory_without_a_valid_copy_gets_one_from_a_directory_with_one(
    valid: list[bool],
) -> None:
    groups = DirectoryGroups(tuple((2 * i, 2 * i + 1) for i in range(len(valid))))
    plan = catch_up(groups, valid)
    if not any(valid):
        assert plan is None
        return
    assert plan is not None
    holders = {w for w, ok in zip(groups.writers, valid, strict=True) if ok}
    assert sorted(t.target for t in plan) == sorted(
        w for w, ok in zip(groups.writers, valid, strict=True) if not ok
    )
    assert all(t.source in holders for t in plan)
    # the senders are taken in turn: none sends twice before every holder sent once
    counts = [sum(t.source == h for t in plan) for h in sorted(holders)]
    assert max(counts) - min(counts) <= 1


def test_a_wiped_node_gets_the_copy_of_the_other() -> None:
    groups = directory_groups([{0}, {1, 2}, {1, 2}])
    assert catch_up(groups, [True, False]) == (Transfer(source=0, target=1),)


names = st.sampled_from([f"step_{i:012d}.pitstop" for i in range(8)])


@given(st.lists(st.lists(st.tuples(names, st.integers(0, 20)), max_size=6), max_size=4))
def test_a_resume_of_last_tries_every_name_once_newest_first(
    orders: list[list[tuple[str, int]]],
) -> None:
    merged = merged_order(orders, newest_first=True)
    listed = {n for order in orders for n, _ in order}
    assert sorted(merged) == sorted(listed)
    best = {n: max(s for order in orders for m, s in order if m == n) for n in listed}
    assert [best[n] for n in merged] == sorted((best[n] for n in merged), reverse=True)


def test_another_pointer_keeps_the_first_directory_order_then_the_others() -> None:
    orders = [[("b", 1), ("a", 5)], [("c", 9), ("a", 5)]]
    assert merged_order(orders, newest_first=False) == ("b", "a", "c")


@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_copies_start_before_the_checks_only_to_directories_that_lack_it(
    listed: list[bool],
) -> None:
    groups = DirectoryGroups(tuple((2 * i, 2 * i + 1) for i in range(len(listed))))
    first = copies_first(groups, listed)
    if all(listed) or not any(listed):  # each checks its own copy, or nothing to send
        assert first == ()
        return
    holders = {w for w, has in zip(groups.writers, listed, strict=True) if has}
    lacking = [w for w, has in zip(groups.writers, listed, strict=True) if not has]
    assert sorted(t.target for t in first) == lacking  # each one copy, none to a holder
    assert all(t.source in holders for t in first)
    counts = [sum(t.source == h for t in first) for h in sorted(holders)]
    assert max(counts) - min(counts) <= 1  # the senders taken in turn, as catch_up takes them
    # with nothing found wrong, these are the copies catch_up would plan after the checks
    assert first == catch_up(groups, listed)


held_states = st.sampled_from(list(Held))


@given(st.lists(held_states, min_size=2, max_size=6), st.data())
def test_a_failed_copy_is_everyones_error_unless_its_senders_copy_is_bad(
    held: list[Held], data: st.DataObject
) -> None:
    ranks = range(len(held))
    pairs = st.tuples(st.sampled_from(ranks), st.sampled_from(ranks)).filter(lambda p: p[0] != p[1])
    moves = [Transfer(source=s, target=t) for s, t in data.draw(st.lists(pairs, max_size=4))]
    raised = copy_failed(moves, held)
    expected = any(
        held[m.source] is not Held.INVALID
        and (held[m.source] is Held.FAILED or held[m.target] is Held.FAILED)
        for m in moves
    )
    assert raised == expected
    if all(h is not Held.FAILED for h in held):  # nothing failed on its way: nothing raised
        assert not raised
    for m in moves:  # a bad sender's copy explains its receiver's failure: no error
        if held[m.source] is Held.INVALID:
            assert not copy_failed([m], held)


def test_a_wiped_node_receives_at_once_and_a_bad_senders_copy_falls_back() -> None:
    groups = directory_groups([{0}, {1}])
    first = copies_first(groups, [True, False])
    assert first == (Transfer(source=0, target=1),)
    assert copy_failed(first, [Held.VALID, Held.FAILED])  # broke on its way: raised everywhere
    assert not copy_failed(first, [Held.INVALID, Held.FAILED])  # rank 0's copy is bad: skipped
    assert not copy_failed(first, [Held.VALID, Held.VALID])
