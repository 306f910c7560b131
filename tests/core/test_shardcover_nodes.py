"""A sharded checkpoint's files across directories the ranks do not share (core.shardcover)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.sharding.shardcover import (
    cover_nodes,
    file_homes,
    not_on_every_directory,
    part_here,
    tier_takes,
)

names = st.lists(
    st.sampled_from([f"__{r}_0.distcp" for r in range(5)] + [".metadata", "m"]),
    min_size=1,
    max_size=7,
    unique=True,
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[str], list[set[str]], list[set[str]]]:
    """A checkpoint's files, what each directory holds whole, and what each one's ranks need."""
    listed = draw(names)
    dirs = draw(st.integers(1, 4))
    held = [set(draw(st.lists(st.sampled_from(listed), max_size=7))) for _ in range(dirs)]
    needed = [set(draw(st.lists(st.sampled_from(listed), max_size=7))) for _ in range(dirs)]
    return listed, held, needed


@given(cases())
def test_a_checkpoint_is_complete_exactly_when_every_file_is_whole_somewhere(
    case: tuple[list[str], list[set[str]], list[set[str]]],
) -> None:
    listed, held, needed = case
    cover = cover_nodes(listed, held, needed)
    union = set().union(*held)
    assert cover.missing == tuple(sorted(set(listed) - union))
    assert cover.complete == (set(listed) <= union)
    if not cover.complete:
        assert cover.moves == ()


@given(cases())
def test_each_directory_receives_what_it_needs_and_lacks_from_one_that_holds_it(
    case: tuple[list[str], list[set[str]], list[set[str]]],
) -> None:
    listed, held, needed = case
    cover = cover_nodes(listed, held, needed)
    if not cover.complete:
        return
    after = [set(h) for h in held]
    for move in cover.moves:
        assert move.name in held[move.source]  # sent only by a directory that holds it whole
        assert move.name not in after[move.target]  # never a file it holds already
        assert move.name in needed[move.target]  # never a file its ranks do not read
        after[move.target].add(move.name)
    for have, want in zip(after, needed, strict=True):
        assert want <= have
    sent = [0] * len(held)
    for move in cover.moves:  # the senders take turns: the one that has sent fewest first
        holders = [d for d, h in enumerate(held) if move.name in h]
        assert sent[move.source] == min(sent[d] for d in holders)
        sent[move.source] += 1


def test_a_needed_file_the_checkpoint_does_not_list_is_refused() -> None:
    with pytest.raises(ValueError, match="x"):
        cover_nodes(["a"], [{"a"}], [{"x"}])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_each_file_lies_in_the_directory_of_the_rank_that_wrote_it(layout: list[int]) -> None:
    labels = sorted(set(layout))
    groups = [{r for r, label in enumerate(layout) if label == mine} for mine in labels]
    files = [(f"__{r}_0.distcp", r) for r in range(len(layout))] + [(".metadata", 0)]
    homes = file_homes(files, groups)
    assert sorted(n for home in homes for n in home) == sorted(n for n, _ in files)
    for name, rank in files:
        assert name in homes[next(d for d, g in enumerate(groups) if rank in g)]
    with pytest.raises(ValueError, match="rank 9"):
        file_homes([("y", 9)], groups)


@given(
    st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 3)), unique_by=lambda f: f[0]),
    st.sets(st.sampled_from("abcdefg")),
)
def test_a_directorys_part_counts_what_it_holds_and_names_the_ranks_of_the_rest(
    files: list[tuple[str, int]], present: set[str]
) -> None:
    here, listed, absent = part_here(files, present)
    assert listed == len(files)
    assert here == len([n for n, _ in files if n in present])
    assert set(absent) == {r for n, r in files if n not in present}
    assert (here == listed) == (absent == ())


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
    st.lists(st.integers(0, 6), max_size=6),
    st.data(),
)
def test_each_lost_file_is_taken_from_the_remote_tier_once_where_its_writer_is(
    layout: list[int], writers: list[int], data: st.DataObject
) -> None:
    """Files written by ranks of this world (``layout``: each rank's directory label) and by
    ranks of an older, larger one (``writers`` beyond it); each directory holds some whole.
    Afterwards every file is whole somewhere; a directory takes nothing it holds, the
    manifest and metadata unless it holds them, and of the rest only a file whole nowhere
    that its own ranks wrote (the first directory: one no rank of this world wrote)."""
    labels = sorted(set(layout))
    groups = [tuple(r for r, label in enumerate(layout) if label == mine) for mine in labels]
    files = [(f"__{r}_0.distcp", r) for r in sorted(set(writers))]
    files += [(".metadata", 0), ("manifest.pitstop", 0)]
    every = {".metadata", "manifest.pitstop"}
    names = [n for n, _ in files]
    held = [set(data.draw(st.lists(st.sampled_from(names), max_size=4))) for _ in groups]
    takes = [tier_takes(files, groups, d, held, every) for d in range(len(groups))]
    after = [h | set(t) for h, t in zip(held, takes, strict=True)]
    assert cover_nodes(names, after, [set()] * len(groups)).complete
    world = set(range(len(layout)))
    for d, (group, took) in enumerate(zip(groups, takes, strict=True)):
        assert list(took) == sorted(took)
        assert not set(took) & held[d]
        assert every - held[d] <= set(took)
        for name, rank in files:
            if name in took and name not in every:
                assert not any(name in h for h in held), name
                assert rank in group or (d == 0 and rank not in world), (name, d)
    for name in set(names) - every:
        assert sum(name in took for took in takes) <= 1, name


@given(
    st.lists(
        st.sets(st.tuples(st.sampled_from(["step_1", "step_2", "step_3"]), st.integers(0, 2))),
        min_size=1,
        max_size=4,
    )
)
def test_a_catch_up_leaves_out_exactly_what_some_directory_lacks_as_that_save(
    held: list[set[tuple[str, int]]],
) -> None:
    left_out = not_on_every_directory(held)
    for name in {n for row in held for n, _ in row}:
        saves = {(n, seq) for row in held for n, seq in row if n == name}
        everywhere = all(saves <= row for row in held)  # each directory: this very save
        assert (name not in left_out) == everywhere, (name, held)
    assert left_out <= {n for row in held for n, _ in row}
