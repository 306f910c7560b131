"""The decisions that let a Checkpointer open its directory in the probe's own round."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import directory_groups, writes_as_seen


@st.composite
def sightings(draw: st.DrawFn) -> list[frozenset[int]]:
    """What each rank of a job saw: the ranks of its group (the ranks split into groups that
    share a directory, in any order)."""
    world = draw(st.integers(1, 9))
    labels = draw(st.lists(st.integers(0, 3), min_size=world, max_size=world))
    groups = {label: frozenset(r for r in range(world) if labels[r] == label) for label in labels}
    return [groups[labels[r]] for r in range(world)]


@given(sightings())
def test_a_rank_judges_from_its_own_sighting_what_the_agreed_groups_decide(
    seen: list[frozenset[int]],
) -> None:
    groups = directory_groups(seen)
    for rank, mine in enumerate(seen):
        assert writes_as_seen(rank, mine) is groups.writes(rank)
    assert sum(writes_as_seen(r, s) for r, s in enumerate(seen)) == len(groups.groups)


@given(st.integers(0, 8), st.sets(st.integers(0, 8)))
def test_a_rank_that_did_not_see_its_own_probe_never_writes(rank: int, seen: set[int]) -> None:
    seen.discard(rank)
    assert not writes_as_seen(rank, seen)
