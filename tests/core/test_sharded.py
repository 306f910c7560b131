"""pitstop.core.sharded: directory names, the layout's wire form, and the pure checks."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.naming import NOT_A_CHECKPOINT, checkpoint_name
from pitstop.core.sharded import (
    LiveValue,
    ShardedLayout,
    ShardFile,
    StoredChunk,
    StoredValue,
    file_problem,
    files_for,
    layout_differences,
    layout_from_wire,
    layout_to_wire,
    parse_sharded_name,
    sharded_name,
)
from pitstop.errors import CheckpointCorrupt


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
    assert layout_from_wire(layout_to_wire(layout())) == layout()


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
        layout_from_wire(wire)


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
        layout_from_wire(wire)


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
