"""Each rank's part in a save of replicated state written once per directory (core.ranks.copies)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.ranks import directory_groups
from pitstop.core.ranks.copies import CopyRole, copy_role

# A job: each rank's directory, as a label (ranks with the same label share a directory).
layouts = st.lists(st.integers(0, 3), min_size=1, max_size=9)


def sightings(layout: list[int]) -> list[set[int]]:
    """What each rank finds: the probes of every rank whose directory is its own."""
    return [{r for r, other in enumerate(layout) if other == mine} for mine in layout]


@given(layouts)
def test_each_directory_is_written_once_and_a_background_write_is_held_only_among_writers(
    layout: list[int],
) -> None:
    groups = directory_groups(sightings(layout))
    roles = [copy_role(groups, rank) for rank in range(len(layout))]
    for index, group in enumerate(groups.groups):  # one writer per directory: its lowest rank
        assert [r for r in group if roles[r].writes] == [groups.writers[index]]
    # Every writer but rank 0 (which planned it) plans rank 0's decision on its own directory.
    assert [r for r, role in enumerate(roles) if role.follows] == list(groups.writers[1:])
    several = len(set(layout)) > 1
    for role in roles:
        # Held: every writer's write, once several write (none starts during another's copy);
        # with one directory (the 1-node path) nothing is held and nothing follows.
        assert role.holds == (role.writes and several)
        assert role.follows <= role.writes
    if not several:
        assert roles[0] == CopyRole(writes=True, follows=False, holds=False)
