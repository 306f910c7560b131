"""pitstop.core.sharding.sharded: directory names, the layout's wire form, and the pure checks."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.naming import MAX_STEP, NOT_A_CHECKPOINT, checkpoint_name
from pitstop.core.sharding.layoutwire import layout_from_wire, layout_to_wire
from pitstop.core.sharding.shardcover import DIRECTORIES
from pitstop.core.sharding.sharded import (
    FRESH_OPTIMIZERS,
    LiveValue,
    ShardedLayout,
    ShardFile,
    StoredChunk,
    StoredValue,
    adopts_without_round,
    early_checks,
    file_problem,
    files_for,
    fresh_optimizers,
    guess_holds,
    guessed_first,
    layout_differences,
    parse_sharded_name,
    sharded_meta,
    sharded_name,
    share_checks,
    writer_checks,
    writers_read,
)
from pitstop.errors import CheckpointCorrupt

ITEMSIZES = {"float32": 4, "bfloat16": 2, "int64": 8}


def layout() -> ShardedLayout:
    """A 2-rank save of a 5x2 weight (rows 0-2 on rank 0, 3-4 on rank 1) and an lr."""
    files = (
        ShardFile(name="__0_0.distcp", size=100, crc32=1, rank=0),
        ShardFile(name="__1_0.distcp", size=80, crc32=2, rank=1),
        ShardFile(name=".metadata", size=10, crc32=3, rank=0),
    )
    weight = StoredValue(
        fqn="model.w",
        path=("model", "w"),
        dtype="float32",
        shape=(5, 2),
        chunks=(
            StoredChunk(offsets=(0, 0), sizes=(3, 2), file="__0_0.distcp", start=0, length=60),
            StoredChunk(offsets=(3, 0), sizes=(2, 2), file="__1_0.distcp", start=0, length=50),
        ),
    )
    lr = StoredValue(
        fqn="optimizer.param_groups.0.lr",
        path=("optimizer", "param_groups", 0, "lr"),
        dtype=None,
        shape=(),
        chunks=(StoredChunk(offsets=(), sizes=(), file="__1_0.distcp", start=50, length=30),),
    )
    return ShardedLayout(world_size=2, dcp_version="1.0.0", files=files, values=(weight, lr))


@given(st.integers(0, 10**12 - 1))
def test_directory_names_parse_back_and_are_never_file_names(step: int) -> None:
    assert parse_sharded_name(sharded_name(step)) == step
    assert parse_sharded_name(checkpoint_name(step)) is NOT_A_CHECKPOINT
    assert sharded_name(step) + ".pitstop" == checkpoint_name(step)


def test_the_wire_form_round_trips() -> None:
    assert layout_from_wire(layout_to_wire(layout()), itemsizes=ITEMSIZES) == layout()


def _json(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(), kids)
    )


_LEAVES = st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=4)


@given(st.data())
def test_any_damaged_wire_form_is_checkpoint_corrupt_and_nothing_else(data: st.DataObject) -> None:
    wire = layout_to_wire(layout())
    # Replace one leaf or one subtree somewhere in the wire form with anything at all.
    path = data.draw(st.lists(st.integers(0, 6), max_size=5))
    node: Any = wire
    parent: Any = None
    key: Any = None
    for step in path:
        if not isinstance(node, (dict, list)) or not node:
            break
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, keys[step % len(keys)]
        node = node[key]
    replacement = data.draw(_json(_LEAVES))
    if parent is None:
        wire = replacement
    else:
        parent[key] = replacement
    with contextlib.suppress(CheckpointCorrupt):  # anything else fails the test
        layout_from_wire(wire, itemsizes=ITEMSIZES)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"world_size": 0}, "world_size"),
        ({"files": [["a/b", 1, 1, 0]]}, "plain file name"),
        ({"files": [["x", 1, 2**32, 0]]}, "CRC-32"),
    ],
)
def test_bad_fields_are_named(change: dict[str, Any], why: str) -> None:
    wire = {**layout_to_wire(layout()), "values": [], **change}
    with pytest.raises(CheckpointCorrupt, match=why):
        layout_from_wire(wire, itemsizes=ITEMSIZES)


def test_chunks_must_lie_inside_their_value_and_a_listed_file() -> None:
    good = layout()
    weight = good.values[0]
    outside = attrs.evolve(weight.chunks[1], offsets=(4, 0))
    past_end = attrs.evolve(weight.chunks[1], length=81)
    unlisted = attrs.evolve(weight.chunks[1], file="__7_0.distcp")
    for chunk in (outside, past_end, unlisted):
        bad = attrs.evolve(weight, chunks=(weight.chunks[0], chunk))
        with pytest.raises(CheckpointCorrupt, match=r"model\.w"):
            attrs.evolve(good, values=(bad,))


def test_files_for_names_the_files_of_the_chunks_read() -> None:
    assert files_for(layout(), [("model.w", (3, 0))]) == ("__1_0.distcp",)
    both = [("model.w", (0, 0)), ("optimizer.param_groups.0.lr", None)]
    assert files_for(layout(), both) == ("__0_0.distcp", "__1_0.distcp")
    with pytest.raises(CheckpointCorrupt, match=r"model\.w"):
        files_for(layout(), [("model.w", (1, 0))])


def test_each_file_read_is_checked_once_by_its_writer_when_it_reads_it() -> None:
    # rank 0 reads a bit of rank 1's file (the lr): rank 1 checks it, rank 0 its own
    assert share_checks(layout(), [["__0_0.distcp", "__1_0.distcp"], ["__1_0.distcp"]]) == (
        ("__0_0.distcp",),
        ("__1_0.distcp",),
    )
    # one rank reads everything (2 -> 1): it checks every file it reads, and nothing else
    assert share_checks(layout(), [["__1_0.distcp", "__0_0.distcp"]]) == (
        ("__0_0.distcp", "__1_0.distcp"),
    )
    with pytest.raises(CheckpointCorrupt, match="__9_0"):
        share_checks(layout(), [["__9_0.distcp"]])


@given(st.data())
def test_every_file_read_is_checked_by_exactly_one_of_its_readers(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 6), label="ranks")
    sizes = data.draw(st.lists(st.integers(0, 1000), min_size=1, max_size=8), label="sizes")
    files = tuple(
        ShardFile(name=f"__{i}_0.distcp", size=n, crc32=0, rank=data.draw(st.integers(0, 7)))
        for i, n in enumerate(sizes)
    )
    names = [f.name for f in files]
    reads = [data.draw(st.lists(st.sampled_from(names)), label=f"rank {r}") for r in range(world)]
    saved = ShardedLayout(world_size=8, dcp_version="x", files=files, values=())
    shares = share_checks(saved, reads)
    assert len(shares) == world
    checked = [name for share in shares for name in share]
    assert sorted(checked) == sorted({n for names in reads for n in names})  # each once
    for rank, share in enumerate(shares):
        assert set(share) <= set(reads[rank])  # only files it reads (their pages are its own)
        assert list(share) == sorted(share)
    for file in files:  # a writer that reads its own file, alone with it, checks it
        readers = [r for r in range(world) if file.name in reads[r]]
        if readers == [file.rank]:
            assert file.name in shares[file.rank]


@given(st.data())
def test_the_writers_checks_cover_every_file_read_once_exactly_when_the_writers_read_them(
    data: st.DataObject,
) -> None:
    world = data.draw(st.integers(1, 5), label="ranks")
    count = data.draw(st.integers(1, 6), label="files")
    files = tuple(
        ShardFile(name=f"__{i}_0.distcp", size=1, crc32=0, rank=data.draw(st.integers(0, 6)))
        for i in range(count)
    )
    names = [f.name for f in files]
    reads = [data.draw(st.lists(st.sampled_from(names)), label=f"rank {r}") for r in range(world)]
    saved = ShardedLayout(world_size=7, dcp_version="x", files=files, values=())
    checks = [writer_checks(saved, reads[r], r, world) for r in range(world)]
    read = {n for names in reads for n in names}
    for rank, share in enumerate(checks):
        outside = {n for n in reads[rank] if files[names.index(n)].rank >= world}
        assert (share is None) == bool(outside)  # a writer not in the run: no hope
        assert share is None or (set(share) <= set(reads[rank]) and list(share) == sorted(share))
    if any(share is None for share in checks):
        assert not writers_read(saved, reads)
        return
    checked = [name for share in checks if share is not None for name in share]
    assert len(checked) == len(set(checked))  # none twice
    assert writers_read(saved, reads) == (set(checked) == read)  # all, exactly when they hold


@given(st.data())
def test_the_checks_begun_before_the_plan_hold_every_writer_check_in_the_same_world(
    data: st.DataObject,
) -> None:
    world = data.draw(st.integers(1, 5), label="ranks")
    saved_world = data.draw(st.sampled_from([world, 7]), label="saved by")
    count = data.draw(st.integers(1, 6), label="files")
    files = tuple(
        ShardFile(name=f"__{i}_0.distcp", size=1, crc32=0, rank=data.draw(st.integers(0, 6)))
        for i in range(count)
    )
    names = [f.name for f in files]
    saved = ShardedLayout(world_size=saved_world, dcp_version="x", files=files, values=())
    for rank in range(world):
        early = early_checks(saved, rank, world)
        if saved_world != world:  # a reshard reads other files: none begun
            assert early == ()
            continue
        assert early == tuple(sorted(f.name for f in files if f.rank == rank))  # its own
        reads = data.draw(st.lists(st.sampled_from(names)), label=f"rank {rank} reads")
        assert set(writer_checks(saved, reads, rank, world) or ()) <= set(early)


def test_the_checks_are_spread_when_every_rank_reads_every_file() -> None:
    files = tuple(ShardFile(name=f"__{r}_0.distcp", size=100, crc32=0, rank=r) for r in range(4))
    everything = [f.name for f in files]
    saved = ShardedLayout(world_size=4, dcp_version="x", files=files, values=())
    shares = share_checks(saved, [everything] * 4)
    assert shares == tuple((f"__{r}_0.distcp",) for r in range(4))  # each its own, once


def test_the_fresh_optimizers_of_a_manifest_are_a_list_of_names() -> None:
    assert fresh_optimizers({}) == ()
    assert fresh_optimizers({"fresh_optimizers": ["optimizer", "ema_opt"]}) == (
        "optimizer",
        "ema_opt",
    )
    for bad in ("optimizer", [1], {"optimizer": 1}, None):
        with pytest.raises(CheckpointCorrupt, match="fresh_optimizers"):
            fresh_optimizers({"fresh_optimizers": bad})


def test_file_problems_name_the_file() -> None:
    expected = layout().files[1]
    assert file_problem(expected, 80, 2) is None
    assert "missing" in (file_problem(expected, None, None) or "")
    assert "79 bytes" in (file_problem(expected, 79, 2) or "")
    assert "fails its checksum" in (file_problem(expected, 80, 5) or "")


def test_every_difference_is_listed_within_the_components_loaded() -> None:
    live = {
        "model.w": LiveValue(dtype="float32", shape=(6, 2)),
        "model.b": LiveValue(dtype="float32", shape=(6,)),
    }
    assert layout_differences(layout(), live) == [
        "model.b: not in the checkpoint",
        "model.w: the checkpoint holds float32[5, 2], the live value is float32[6, 2]",
    ]
    fits = {"model.w": LiveValue(dtype="float32", shape=(5, 2))}
    assert layout_differences(layout(), fits) == []  # the stored optimizer is not loaded here
    lr_as_tensor = {**fits, "optimizer.param_groups.0.lr": LiveValue(dtype="float32")}
    assert layout_differences(layout(), lr_as_tensor) == [
        "optimizer.param_groups.0.lr: the checkpoint holds not a tensor here"
    ]


@given(st.integers(0, MAX_STEP), st.text(max_size=30))
def test_a_rank_guesses_only_a_plain_sharded_name_and_uses_it_for_that_candidate_alone(
    step: int, other: str
) -> None:
    """The start before rank 0's order: a pointer's link is trusted as a guess only as a plain
    ``step_<digits>`` name (never a path, a file or a foreign name), and the start serves the
    candidate of that very name only."""
    name = sharded_name(step)
    assert guessed_first(name) == name
    for hostile in (f"../{name}", f"{name}/", f"/x/{name}", checkpoint_name(step), name + "x"):
        assert guessed_first(hostile) is None
    guessed = guessed_first(other)
    assert guessed == (other if isinstance(parse_sharded_name(other), int) else None)
    assert guess_holds(name, name)
    assert not guess_holds(None, name)
    assert guess_holds(name, other) == (other == name)


@given(st.booleans(), st.booleans(), st.booleans())
def test_rank_0_adopts_in_the_copy_s_round_only_where_it_ends_the_resume_of_one_plain_directory(
    checked: bool, one: bool, plain: bool
) -> None:
    """The schedule needs no round of its own only where the copy's round ends the resume (a
    checked read), in one directory every rank shares, whose adopting reads and writes
    nothing."""
    folded = adopts_without_round(
        checked_read=checked, one_directory=one, adopting_reads_nothing=plain
    )
    assert folded == (checked and one and plain)


@given(
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers()),
    st.lists(st.sampled_from(["optimizer", "other"]), unique=True),
    st.lists(st.lists(st.integers(0, 7), min_size=1), max_size=3),
)
def test_a_sharded_manifest_s_meta_names_its_fresh_optimizers_and_homes_only_when_there_are(
    meta: dict[str, object], fresh: list[str], homes: list[list[int]]
) -> None:
    out = sharded_meta(dict(meta), fresh, homes)
    assert {k: v for k, v in out.items() if k in meta} == meta
    assert fresh_optimizers(out) == tuple(fresh)
    assert (FRESH_OPTIMIZERS in out) == bool(fresh)
    assert out.get(DIRECTORIES, []) == homes
