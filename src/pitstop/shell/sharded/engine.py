# Sharded state (FSDP2, DTensor) through torch.distributed.checkpoint (DCP), published like a
# file. What DCP saves and fills — the model, its EMA, the optimizers — is
# pitstop.shell.sharded.dcpstate's.
#
# Rules: every rank makes the same calls. A save: every rank writes its shards into a temp
# directory and the tables of its files are gathered (pitstop.shell.sharded.shardwrite, whose names
# are re-exported here); rank 0 builds the layout (pitstop.core.sharding.sharded), writes the
# manifest last (publish_file: temp name, fsync, rename, directory fsync — which makes the names of
# every rank's files durable too), renames the temp directory into place and fsyncs the parent. A
# load: the layout comes from the manifest (DCP's pickled `.metadata` is never read: see
# pitstop.shell.sharded.dcpio), the live state is compared with it (IncompatibleCheckpoint listing
# every difference), every file DCP's local read plans name is verified once, by one of the ranks
# that read it (the plans are gathered: pitstop.core.sharding.sharded.share_checks), the outcome is
# agreed, and only then does DCP read, resharding to this world size. DCP reads into the live
# tensors, so each rank first keeps a host copy of every tensor it reads into; when the read or the
# apply that follows fails on any rank (DCP's errors reach every rank, the apply's are agreed),
# every rank copies its tensors back and hands each optimizer its own state and groups again — and
# an optimizer that had no state (DCP gives it zeroed state to read into) has none again. A resume
# reads without DCP's read instead (pitstop.shell.sharded.rawread): its choice checks every file and
# finds every item on every rank first, nothing live touched; then (read_sharded's `checked`) the
# state is applied — its tensors the live ones, unwritten yet, each optimizer's own state and groups
# kept by reference for a failure — and only then are the verified records copied into the live
# tensors (no host copy: a failure there is an I/O error). DCP's collectives run on `group` (async:
# on DCP's upload thread, so then `group` must be a process group of its own); pitstop's agreement
# runs on `ranks`, from the calling thread only.
# How: DCP does the tensor I/O and the resharding; pitstop.shell.store.sharddir the files around it.

"""Sharded checkpoints: write, publish, verify and read DCP directories; gather for export."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint._traverse import traverse_state_dict

from pitstop.core.compat import Difference, Kind, diff_ema
from pitstop.core.sharding.sharded import (
    LiveValue,
    ShardedLayout,
    fresh_optimizers,
    layout_differences,
    regions_for,
    share_checks,
)
from pitstop.errors import IncompatibleCheckpoint
from pitstop.shell.format.treewalk import dtype_name, tensor_dtypes
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sharded.dcpio import SafePlanner, load_checked, metadata_of
from pitstop.shell.sharded.dcpstate import (
    EMA,
    MODEL,
    Optimizers,
    apply_state,
    dcp_state,
    local_shard,
)
from pitstop.shell.sharded.rawread import Checked
from pitstop.shell.sharded.shardwrite import (
    PendingShardedWrite,
    WrittenShards,
    async_write_sharded,
    make_stager,
    write_sharded,
    write_shards,
)
from pitstop.shell.sharded.support import is_sharded
from pitstop.shell.state.freshopt import FreshOptimizers
from pitstop.shell.store.publish import delete_sharded
from pitstop.shell.store.sharddir import (
    publish_sharded,
    read_layout,
    verify_sharded,
    write_manifest,
)

__all__ = [
    "EMA",
    "MODEL",
    "PendingShardedWrite",
    "ShardedPlan",
    "WrittenShards",
    "async_write_sharded",
    "delete_sharded",
    "full_state_dict",
    "holds_ema",
    "is_sharded",
    "make_stager",
    "plan_read",
    "publish_sharded",
    "read_layout",
    "read_sharded",
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
    return tuple(sorted({file for file, _, _ in _local_plan(directory, layout, state, rank)[2]}))


def _local_plan(
    directory: Path, layout: ShardedLayout, state: dict[str, Any], rank: int
) -> tuple[SafePlanner, tuple[Any, ...], tuple[tuple[str, int, int], ...]]:
    """Check that ``state`` fits ``layout``; DCP's planner set up on it, its local plan's
    items, and where they read: ``(file, start, length)`` each."""
    planner = SafePlanner()
    planner.set_up_planner(state, metadata_of(layout), rank == 0)
    live = {fqn: _live(value) for fqn, value in planner.state_dict.items()}
    problems = layout_differences(layout, live)
    if problems:
        raise IncompatibleCheckpoint(f"{directory}: {p}" for p in problems)
    items = tuple(planner.create_local_plan().items)
    reads = [r.storage_index for r in items]
    regions = regions_for(
        layout, [(i.fqn, None if i.offset is None else tuple(i.offset)) for i in reads]
    )
    return planner, items, regions


def holds_ema(layout: ShardedLayout) -> bool:
    """Whether the checkpoint ``layout`` describes holds an EMA's weights."""
    return any(v.path[:1] == (EMA,) for v in layout.values)


def _state(
    layout: ShardedLayout, model: nn.Module, optimizers: Optimizers, ema: nn.Module | None
) -> dict[str, Any]:
    """What a load of ``layout`` fills: the EMA's only when it holds one (a run's EMA that
    the checkpoint lacks is a difference of its own, pitstop.core.compat.diff_ema)."""
    return dcp_state(model, optimizers, ema if holds_ema(layout) else None)


@attrs.frozen(eq=False)
class ShardedPlan:
    """One rank's plan for reading a sharded checkpoint, made before a byte of its files is
    read: what a resume checks (the files to verify, the differences) and then reads with."""

    directory: Path
    """The checkpoint directory."""
    layout: ShardedLayout
    """The layout in its manifest."""
    meta: Mapping[str, Any]
    """Its manifest's meta."""
    state: dict[str, Any]
    """What DCP fills on this rank (:func:`~pitstop.shell.sharded.dcpstate.dcp_state`)."""
    files: tuple[str, ...]
    """The files DCP's read plan names on this rank — or, when the state does not fit the
    layout, an equal share of every file the layout lists."""
    differences: tuple[Difference, ...]
    """Every difference between this rank's state and the layout (empty when it fits), an
    EMA on one side only judged as for a file checkpoint."""
    reads: tuple[Any, ...] = ()
    r"""DCP's local read plan on this rank (its ``ReadItem``\ s; empty when the state does not
    fit), made by :attr:`planner`."""
    planner: Any = None
    """DCP's load planner, set up on :attr:`state` (``None`` when the state does not fit)."""
    regions: tuple[tuple[str, int, int], ...] = ()
    """Where :attr:`reads` read: ``(file, start, length)`` each (empty when it does not fit)."""


def plan_read(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    rank: int,
    world_size: int,
    ema: nn.Module | None = None,
    read: tuple[ShardedLayout, Mapping[str, Any]] | None = None,
) -> ShardedPlan:
    """This rank's :class:`ShardedPlan` of ``directory``; reads the manifest only (``read``:
    its layout and meta, read already)."""
    root = Path(directory)
    layout, meta = read_layout(root) if read is None else read
    found = diff_ema(stored=holds_ema(layout), live=ema is not None)
    state: dict[str, Any] = {}
    regions: tuple[tuple[str, int, int], ...] = ()
    planner, reads = None, ()
    try:
        state = _state(layout, model, optimizers, ema)
        planner, reads, regions = _local_plan(root, layout, state, rank)
        files = tuple(sorted({file for file, _, _ in regions}))
    except IncompatibleCheckpoint as exc:
        found += [Difference(kind=Kind.SHAPE, message=p) for p in exc.differences]
        names = [f.name for f in layout.files]
        files = tuple(names[rank::world_size])
    return ShardedPlan(
        directory=root,
        layout=layout,
        meta=meta,
        state=state,
        files=files,
        differences=tuple(found),
        reads=reads,
        planner=planner,
        regions=regions,
    )


class _Kept:
    """This rank's sharded state before DCP reads into it: a host copy of every tensor of
    ``state`` (a DTensor's local shard) and each optimizer's own state and groups. ``only``:
    copy the tensors under these top-level keys alone (what an apply of staged state writes
    into in place: an optimizer is handed new tensors, its own are kept by reference)."""

    def __init__(
        self, state: dict[str, Any], optimizers: Optimizers, only: Collection[str] | None = None
    ) -> None:
        self._tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._optimizers = [(o, o.state, o.param_groups) for o in optimizers.values()]

        def keep(_path: object, value: object) -> None:
            if isinstance(value, torch.Tensor):
                local = local_shard(value)
                self._tensors.append((local, local.detach().to("cpu", copy=True)))

        copied = state if only is None else {k: v for k, v in state.items() if k in only}
        traverse_state_dict(copied, keep)

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


def _chosen(root: Path, plan: ShardedPlan) -> tuple[ShardedLayout, tuple[str, ...], dict[str, Any]]:
    """A chosen plan's layout, its optimizers stored fresh, and its state; refused where the
    state does not fit (a resume refuses that before it reads)."""
    if plan.directory != root:
        raise ValueError(f"the plan is for {plan.directory}, not {root}")
    shapes = [d.message for d in plan.differences if d.kind is Kind.SHAPE]
    if shapes:
        raise IncompatibleCheckpoint(shapes)
    return plan.layout, fresh_optimizers(plan.meta), plan.state


def read_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizers: Optimizers,
    *,
    ranks: Ranks,
    group: Any = None,
    chosen: ShardedPlan | None = None,
    ema: nn.Module | None = None,
    checked: Checked | None = None,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
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
    ``chosen``: this rank's :func:`plan_read` of ``directory``, made by a resume that has
    compared it with the run and verified every file of it on every rank already: read with
    it, without reading the manifest or planning again. ``checked``: the resume's check of
    ``chosen`` on every rank (:func:`~pitstop.shell.sharded.rawread.check_read`, every file
    verified): the state is applied, then its tensors copied in; DCP reads nothing.
    ``before``: run on every rank just before the apply, agreed in the same round (a
    resume's restore of the replicated state: the caller undoes it when this raises).
    ``after``: run on every rank just after a ``checked`` read's apply, in its round (what
    fails there leaves every tensor as it was).
    """
    root = Path(directory)
    if checked is not None:
        if chosen is None:
            raise ValueError("a checked read is applied with the plan it was checked with")
        _apply_checked(root, model, optimizers, ranks, chosen, checked, ema, before, after)
        return chosen.layout
    with FreshOptimizers(optimizers) as fresh:
        if chosen is not None:
            layout, stored_fresh, state = ranks.each(lambda: _chosen(root, chosen))
        else:
            layout, stored_fresh = ranks.each(lambda: _layout_and_fresh(root))
            state = _state(layout, model, optimizers, ema)
            reads = ranks.all_gather_each(lambda: _planned_files(root, layout, state, ranks.rank))
            mine = share_checks(layout, reads)[ranks.rank]  # each file, once, by a reader
            ranks.each(lambda: verify_sharded(root, layout, mine))
        kept = _Kept(state, optimizers)
        try:
            load_checked(root, state, layout, process_group=group)
            live_ema = ema if EMA in state else None
            apply = partial(apply_state, model, optimizers, live_ema, state, stored_fresh)
            ranks.each(partial(_then, before, apply))
        except BaseException:
            kept.put_back()
            raise
        fresh.keep()
    return layout


def _apply_checked(
    root: Path,
    model: nn.Module,
    optimizers: Optimizers,
    ranks: Ranks,
    chosen: ShardedPlan,
    checked: Checked,
    ema: nn.Module | None,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> None:
    """Every rank: apply ``chosen``'s state — its tensors the live ones, unwritten yet, its
    other values as read — all or nothing (each optimizer's own state and groups kept by
    reference; ``after()`` in the same round); then the checked read's tensors copied into the
    live ones."""
    with FreshOptimizers(optimizers) as fresh:
        _, stored_fresh, state = _chosen(root, chosen)  # it fits: the resume checked it
        kept = _Kept(state, optimizers, only=())  # no tensor is written before the copy
        try:
            live_ema = ema if EMA in state else None
            apply = partial(apply_state, model, optimizers, live_ema, state, stored_fresh)
            ranks.each(partial(_then, before, apply, after))  # one round for all
        except BaseException:
            checked.close()
            kept.put_back()
            raise
        ranks.each(checked.copy)  # verified on every rank: only an I/O error stops it
        fresh.keep()


def _then(*steps: Callable[[], object] | None) -> None:
    """Each of ``steps`` in turn (``None``: none there)."""
    for step in steps:
        if step is not None:
            step()


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
        dtype = None if value.dtype is None else tensor_dtypes()[value.dtype]
        # A non-tensor value: DCP puts what it stored in place of the None. A tensor's extents
        # passed read_layout's checks: its chunks cover it exactly once (every element is
        # filled) and their bytes, verified just above, hold its elements.
        node[value.path[-1]] = None if dtype is None else torch.empty(value.shape, dtype=dtype)
    load_checked(root, state, layout, no_dist=True)
    return dict(state[component])
