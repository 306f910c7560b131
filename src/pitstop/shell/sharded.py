# Sharded state (FSDP2, DTensor) through torch.distributed.checkpoint (DCP), published like a
# file. What DCP saves and fills — the model, its EMA, the optimizers — is
# pitstop.shell.dcpstate's.
#
# Rules: every rank makes the same calls. A save: every rank writes its shards into a temp
# directory and the tables of its files are gathered (pitstop.shell.shardwrite, whose names are
# re-exported here); rank 0 builds the layout (pitstop.core.sharded), writes the manifest last
# (publish_file: temp name, fsync, rename, directory fsync — which makes the names of every
# rank's files durable too), renames the temp directory into place and fsyncs the parent.
# A load: the layout comes from the manifest (DCP's pickled `.metadata` is never read: see
# pitstop.shell.dcpio), the live state is compared with it (IncompatibleCheckpoint listing every
# difference), every file DCP's local read plans name is verified once, by one of the ranks
# that read it (the plans are gathered: pitstop.core.sharded.share_checks), the outcome is
# agreed, and only then does DCP read, resharding to this world size. DCP reads into the
# live tensors, so each rank first keeps a host copy of every tensor it reads into; when the
# read or the apply that follows fails on any rank (DCP's errors reach every rank, the apply's
# are agreed), every rank copies its tensors back and hands each optimizer its own state and
# groups again — and an optimizer that had no state (DCP gives it zeroed state to read into)
# has none again. DCP's collectives run
# on `group` (async: on DCP's upload thread, so then `group` must be a process group of its
# own); pitstop's agreement runs on `ranks`, from the calling thread only.
# How: DCP does the tensor I/O and the resharding; pitstop.shell.sharddir the files around it.

"""Sharded checkpoints: write, publish, verify and read DCP directories; gather for export."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._traverse import traverse_state_dict

from pitstop.core.compat import Difference, Kind, diff_ema
from pitstop.core.sharded import (
    LiveValue,
    ShardedLayout,
    files_for,
    fresh_optimizers,
    layout_differences,
    share_checks,
)
from pitstop.errors import IncompatibleCheckpoint
from pitstop.shell.dcpio import (
    SafePlanner,
    load_checked,
    metadata_of,
)
from pitstop.shell.dcpstate import EMA, MODEL, Optimizers, apply_state, dcp_state, local_shard
from pitstop.shell.distributed import Ranks
from pitstop.shell.freshopt import FreshOptimizers
from pitstop.shell.sharddir import (
    delete_sharded,
    publish_sharded,
    read_layout,
    verify_sharded,
    write_manifest,
)
from pitstop.shell.shardsave import is_sharded
from pitstop.shell.shardwrite import (
    PendingShardedWrite,
    WrittenShards,
    async_write_sharded,
    make_stager,
    write_sharded,
    write_shards,
)
from pitstop.shell.treewalk import TENSOR_DTYPES, dtype_name

__all__ = [
    "EMA",
    "MODEL",
    "PendingShardedWrite",
    "WrittenShards",
    "async_write_sharded",
    "delete_sharded",
    "files_to_verify",
    "full_state_dict",
    "holds_ema",
    "is_sharded",
    "make_stager",
    "publish_sharded",
    "read_layout",
    "read_sharded",
    "sharded_differences",
    "verify_sharded",
    "write_manifest",
    "write_sharded",
    "write_shards",
]

# --- reading ----------------------------------------------------------------------------------


def _live(value: object) -> LiveValue:
    if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
        return LiveValue(dtype=dtype_name(value.dtype), shape=tuple(value.shape))
    return LiveValue(dtype=None)


def _planned_files(
    directory: Path, layout: ShardedLayout, state: dict[str, Any], rank: int
) -> tuple[str, ...]:
    """Check that ``state`` fits ``layout``; the files DCP's local plan reads on this rank."""
    planner = SafePlanner()
    planner.set_up_planner(state, metadata_of(layout), rank == 0)
    live = {fqn: _live(value) for fqn, value in planner.state_dict.items()}
    problems = layout_differences(layout, live)
    if problems:
        raise IncompatibleCheckpoint(f"{directory}: {p}" for p in problems)
    reads = [r.storage_index for r in planner.create_local_plan().items]
    return files_for(
        layout, [(i.fqn, None if i.offset is None else tuple(i.offset)) for i in reads]
    )


def holds_ema(layout: ShardedLayout) -> bool:
    """Whether the checkpoint ``layout`` describes holds an EMA's weights."""
    return any(v.path[:1] == (EMA,) for v in layout.values)


def _state(
    layout: ShardedLayout, model: nn.Module, optimizers: Optimizers, ema: nn.Module | None
) -> dict[str, Any]:
    """What a load of ``layout`` fills: the EMA's only when it holds one (a run's EMA that
    the checkpoint lacks is a difference of its own, pitstop.core.compat.diff_ema)."""
    return dcp_state(model, optimizers, ema if holds_ema(layout) else None)


def sharded_differences(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    rank: int,
    *,
    ema: nn.Module | None = None,
) -> list[Difference]:
    """Every difference between this rank's live sharded state and the directory's layout
    (empty when it fits), an EMA on one side only judged as for a file checkpoint; reads the
    manifest only."""
    root = Path(directory)
    layout, _ = read_layout(root)
    found = diff_ema(stored=holds_ema(layout), live=ema is not None)
    try:
        _planned_files(root, layout, _state(layout, model, optimizers, ema), rank)
    except IncompatibleCheckpoint as exc:
        found += [Difference(kind=Kind.SHAPE, message=p) for p in exc.differences]
    return found


def files_to_verify(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    rank: int,
    world_size: int,
    ema: nn.Module | None = None,
) -> tuple[ShardedLayout, tuple[str, ...]]:
    """The layout, and the files this rank checks when a resume considers ``directory``:
    those DCP's read plan names for it — or, when its state does not fit the layout (the
    comparison reports that later), an equal share of every file the layout lists."""
    root = Path(directory)
    layout, _ = read_layout(root)
    try:
        state = _state(layout, model, optimizers, ema)
        return layout, _planned_files(root, layout, state, rank)
    except IncompatibleCheckpoint:
        names = [f.name for f in layout.files]
        return layout, tuple(names[rank::world_size])


class _Kept:
    """This rank's sharded state before DCP reads into it: a host copy of every tensor of
    ``state`` (a DTensor's local shard) and each optimizer's own state and groups."""

    def __init__(self, state: dict[str, Any], optimizers: Optimizers) -> None:
        self._tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._optimizers = [(o, o.state, o.param_groups) for o in optimizers.values()]

        def keep(_path: object, value: object) -> None:
            if isinstance(value, torch.Tensor):
                local = local_shard(value)
                self._tensors.append((local, local.detach().to("cpu", copy=True)))

        traverse_state_dict(state, keep)

    def put_back(self) -> None:
        """Everything as it was when kept."""
        with torch.no_grad():
            for live, kept in self._tensors:
                live.copy_(kept)
        for optimizer, own, groups in self._optimizers:
            optimizer.state, optimizer.param_groups = own, groups


def _layout_and_fresh(root: Path) -> tuple[ShardedLayout, tuple[str, ...]]:
    layout, meta = read_layout(root)
    return layout, fresh_optimizers(meta)


def read_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
    verify: bool = True,
    ema: nn.Module | None = None,
) -> ShardedLayout:
    """Every rank: restore the model, ``optimizers`` and the ``ema`` from a sharded checkpoint
    directory, all or nothing (the ``ema`` only when the checkpoint holds one).

    Before any tensor is touched, the manifest is read, the live state is checked against it
    (:class:`~pitstop.errors.IncompatibleCheckpoint` listing every difference) and every file
    DCP will read is verified, once, by one of the ranks that read it
    (:class:`~pitstop.errors.CheckpointCorrupt` naming the file); every rank raises the same
    error. Then DCP reads, resharding to this world size, and ``set_*_state_dict`` applies
    the state (an optimizer that had no state when the checkpoint was saved is left without).
    A failure there on any rank (DCP could not read a file:
    :class:`~pitstop.errors.CheckpointCorrupt`) puts every rank's state back as it was, from
    a host copy of this rank's tensors kept while DCP reads. Returns the layout.
    ``verify=False``: the files were verified already (a resume's choice checks them).
    """
    root = Path(directory)
    with FreshOptimizers(optimizers) as fresh:
        layout, stored_fresh = ranks.each(lambda: _layout_and_fresh(root))
        state = _state(layout, model, optimizers, ema)
        reads = ranks.all_gather_each(lambda: _planned_files(root, layout, state, ranks.rank))
        if verify:  # every file read, once, by one of its readers
            mine = share_checks(layout, reads)[ranks.rank]
            ranks.each(lambda: verify_sharded(root, layout, mine))
        kept = _Kept(state, optimizers)
        try:
            load_checked(root, state, layout, process_group=group)
            live_ema = ema if EMA in state else None
            ranks.each(lambda: apply_state(model, optimizers, live_ema, state, stored_fresh))
        except BaseException:
            kept.put_back()
            raise
        fresh.keep()
    return layout


def full_state_dict(
    directory: str | os.PathLike[str],
    component: str = MODEL,
    *,
    keys: Collection[str] | None = None,
) -> dict[str, Any]:
    """The full, unsharded state of ``component`` as plain CPU tensors, read in this process
    (only its entries ``keys``, when given).

    Verifies the files that hold it first and never unpickles. The model's state (and the
    EMA's) loads into an unsharded copy of the model with ``strict=True``.
    """
    root = Path(directory)
    layout, _ = read_layout(root)
    chosen = None if keys is None else {(component, key) for key in keys}
    wanted = [
        v
        for v in layout.values
        if v.path[:1] == (component,) and (chosen is None or v.path[:2] in chosen)
    ]
    if not wanted:
        raise IncompatibleCheckpoint([f"{root}: the checkpoint holds no {component!r} state"])
    verify_sharded(root, layout, {c.file for v in wanted for c in v.chunks})
    state: dict[Any, Any] = {}
    for value in wanted:
        node = state
        for key in value.path[:-1]:
            node = node.setdefault(key, {})
        dtype = None if value.dtype is None else TENSOR_DTYPES[value.dtype]
        # A non-tensor value: DCP puts what it stored in place of the None.
        node[value.path[-1]] = None if dtype is None else torch.empty(value.shape, dtype=dtype)
    load_checked(root, state, layout, no_dist=True)
    return dict(state[component])
