# The resume path: choose a checkpoint, read it, check it against the run, restore it.
#
# Rules: rank 0 chooses (the core's resume order through pitstop.shell.store.resolve, each candidate
# checked as it is read: a corrupt newest file is skipped with a warning) and its choice travels
# to the other ranks; nothing to resume leaves everything untouched. Every rank then reads the
# chosen file and compares it with its own run; the differences of all ranks, each once, decide
# (pitstop.core.compat's judge: hard ones always refuse, soft ones only under strict=True, and
# pass with a warning otherwise). The restore is all-or-nothing on every rank: prepared
# everywhere, committed only when every rank prepared, undone where it was prepared when any
# rank failed. Components the checkpoint holds but the run has not registered are kept in the
# live state (deferred) for register() to apply; per-rank state is handed back only when the
# world size is the one that saved it. A sharded checkpoint (a DCP directory) is chosen by
# every rank together: rank 0 sends the resume order, the ranks gather the files their read
# plans name, each file read is verified once, by one of its readers (pitstop.core.sharded.
# share_checks) together with where each item this rank reads lies in its file (pitstop.shell.
# sharded.rawread.check_read: nothing live touched, DCP's collectives not run) — and all move
# to the next candidate, whose files are read only then, when any rank found a problem; its
# replicated tree is checked and restored as above, and its layout checked on every rank in
# the same pass; then the state is applied and the checked tensors copied in from the same
# open files (where a rank's state does not fit the layout, the files are verified alone).
# An optimizer that had no state has none again unless the resume restored it
# (pitstop.shell.state.freshopt).
# On object storage (s3://) each rank downloads, into a local folder of its own, the candidate's
# manifest, plans its read, then downloads the files its plan names (rank 0: DCP's `.metadata`
# too) and checks each itself (size, CRC-32) — its copy is its own; the outcome is agreed as
# above, every rank warns about a candidate skipped, and its folder is removed. With a remote
# tier (remote=) rank 0 lists both tiers (the local copy of a step first), and a remote
# candidate is copied into the directory by rank 0 (checked, published by its rename) before the
# ranks try it as a local one.
# How: functions over the live state, the ranks and the directory; the Checkpointer calls
# resume_from() and keeps what it returns (the path restored and its entry).

"""Resuming: choose, read, check and restore a checkpoint, on every rank or none."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from torch import nn

from pitstop.core.compat import Difference, Kind, judge
from pitstop.core.objects import is_object_url
from pitstop.core.pointers import resume_order
from pitstop.core.ranks import DirectoryGroups, entry_from_wire, entry_to_wire
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, NoCheckpoint, PointerName
from pitstop.core.schema import STATE
from pitstop.core.sharded import MANIFEST_NAME, share_checks
from pitstop.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    IncompatibleCheckpoint,
    ResumeWarning,
)
from pitstop.shell.format import fileformat
from pitstop.shell.nodes import choose_across, choose_path_across, fetch_for_readers
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.sharded.acrossnodes import choose_sharded_across
from pitstop.shell.state.capture import (
    LiveState,
    ranked_state,
    sharded_components,
    stored_groups,
    stored_world_size,
)
from pitstop.shell.state.freshopt import FreshOptimizers
from pitstop.shell.state.restore import Restore, differences
from pitstop.shell.store.directory import CheckpointDirectory, is_sharded_path, scan
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.resolve import find_resume, own_pointer
from pitstop.shell.store.sharddir import prefetch, verify_sharded
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.sharded.engine import ShardedPlan
    from pitstop.shell.sharded.rawread import Checked

__all__ = ["resume_from"]

log = logging.getLogger("pitstop")


def resume_from(
    source: str | os.PathLike[str],
    *,
    strict: bool,
    live: LiveState,
    ranks: Ranks,
    directory: CheckpointDirectory,
    may_change: tuple[str, ...],
    sharded: bool = False,
    groups: DirectoryGroups | None = None,
) -> tuple[Path | None, CheckpointEntry | NoCheckpoint]:
    """Restore ``live`` from ``source`` on every rank; the path restored and its entry.

    ``(None, NO_CHECKPOINT)``: nothing to resume, nothing touched. Raises
    :class:`~pitstop.errors.IncompatibleCheckpoint` listing every rank's differences (each once)
    with the run exactly as before. ``may_change``: the config patterns a resume only reports.
    ``groups``: which ranks share a directory (directories not shared: every writer's copy
    counts, and one that lacks the checkpoint chosen gets it first, pitstop.shell.nodes; sharded
    state: the newest checkpoint complete across them, pitstop.shell.sharded.acrossnodes).
    """
    # DCP's choice gives an optimizer without state zeroed state: taken away unless restored
    with (
        FreshOptimizers(sharded_components(live) if sharded else {}) as fresh,
        ExitStack() as opened,
    ):
        # checks as it reads: the disk read once
        reading = ResumeRead(live, ranks.rank, ranks.world_size)
        pointer = own_pointer(directory, source)
        listed = [e.seq for e in directory.catalog] if ranks.leader else []  # before the choice
        plan = checked = None
        across = groups is not None and not groups.shared
        if sharded and pointer is not None and across:  # each node holds its ranks' shards
            assert groups is not None
            planner = partial(_plan, live=live, ranks=ranks)
            path, wire, plan = choose_sharded_across(directory, pointer, ranks, groups, planner)
        elif sharded and pointer is not None:
            path, wire, plan, checked = _choose_sharded(directory, pointer, reading, live, ranks)
            if checked is not None:  # its files, open until it is applied or refused
                opened.callback(checked.close)
        elif across and pointer is not None:
            assert groups is not None
            path, wire = choose_across(directory, pointer, reading, ranks, groups)
        elif across and not sharded and not is_object_url(source):  # an explicit file path
            assert groups is not None
            path, wire = choose_path_across(directory, source, reading, ranks, groups)
        else:
            path, wire = ranks.lead(partial(_find_portable, directory, source, reading.verify))
            if pointer is not None and path is not None:  # s3:// on several nodes: each fetches
                path = fetch_for_readers(ranks, directory, path)
        entry = entry_from_wire(wire)
        if path is None:
            if ranks.leader:
                log.info("resume: %s holds no checkpoint; starting fresh", directory.path)
            return None, NO_CHECKPOINT
        # a chosen plan: a directory, on every rank
        is_directory = plan is not None or ranks.each(partial(is_sharded_path, path))
        if is_directory != sharded:
            held = "sharded state (a DCP directory)" if is_directory else "unsharded state (a file)"
            run = "sharded (FSDP2, DTensor)" if sharded else "not sharded"
            raise IncompatibleCheckpoint([f"{path.name}: holds {held}; this run's model is {run}"])
        target = _replicated(live) if sharded else live
        loaded = ranks.each(partial(_load, path, reading, live, target, ranks, may_change, plan))
        tree, meta, found, deferred, plan = loaded
        found = _union(ranks.all_gather(found))
        if judge(found, strict=strict):
            raise IncompatibleCheckpoint(f"{path.name}: {d}" for d in found)
        for difference in found:
            if difference.allowed:  # a Python warning, which the caller may catch or filter
                note = f"resume(strict=False) from {path.name}: {difference.allowed}"
                warnings.warn(note, ResumeWarning, stacklevel=3)
            else:
                log.warning("resume from %s: %s", path.name, difference)
        same_world = stored_world_size(meta) == ranks.world_size
        restore = Restore(target, tree, path, rank=ranks.rank, per_rank=same_world)
        try:
            ranks.each(restore.prepare)
            if sharded:  # checked and verified on every rank before DCP touches a tensor
                from pitstop.shell.sharded.engine import read_sharded

                # every file was verified when the checkpoint was chosen, with this plan (and
                # its read checked, where every rank's state fits its layout)
                components = sharded_components(live)
                read_sharded(
                    path,
                    live.model,
                    components,
                    ranks=ranks,
                    chosen=plan,
                    ema=live.ema,
                    checked=checked,
                )
        except BaseException:
            restore.undo()  # another rank failed: put this one back too
            raise
        restore.commit()
        fresh.keep()
        ranked = ranked_state(tree, ranks.rank) if same_world else {}
        live.pending = {n: ranked[n] if n in ranked else tree[STATE][n] for n in deferred}
        live.pending_per_rank = {n for n in deferred if n in ranked}
        live.pending_groups = stored_groups(meta)
        if deferred:
            log.info(
                "%s holds %s, not registered yet: register() will restore them",
                path.name,
                ", ".join(sorted(deferred)),
            )
        # the loaded tree (a map of the checkpoint: unmapping 64 MiB took 10-50 ms on the VM)
        # and the undo record are freed on a thread of their own, not by the resume's return
        done_with = [tree, loaded, restore, ranked]
        del tree, loaded, restore, ranked
        threading.Thread(target=done_with.clear, name="pitstop-free").start()
        if ranks.leader:
            _say_resumed(path, entry, listed if pointer is PointerName.LAST else [])
        return path, entry


def _say_resumed(path: Path, entry: CheckpointEntry | NoCheckpoint, listed: list[int]) -> None:
    """One INFO line: which checkpoint, which step, and how many newer ones (of the save
    sequence numbers ``listed`` before a resume of ``last`` chose) were skipped."""
    if entry is NO_CHECKPOINT:
        return
    newer = [seq for seq in listed if seq > entry.seq]
    skipped = f"; {len(newer)} newer checkpoint(s) skipped, see the warnings" if newer else ""
    progress = entry.progress
    log.info(
        "resumed from %s: step %d, epoch %d, batch %d%s",
        path,
        progress.step,
        progress.epoch,
        progress.batch_in_epoch,
        skipped,
    )


def _load(
    path: Path,
    reading: ResumeRead,
    live: LiveState,
    target: LiveState,
    ranks: Ranks,
    may_change: tuple[str, ...],
    plan: ShardedPlan | None,
) -> tuple[Any, Mapping[str, Any], list[Difference], frozenset[str], ShardedPlan | None]:
    """Every rank: read ``path`` and compare it with this rank's run (``target``: what its
    file or manifest holds); a sharded checkpoint's layout too, with the plan its choice made
    (made here when the checkpoint was named by path), which the read then uses."""
    if is_sharded_path(path):
        if plan is None:
            plan = _plan(path, live, ranks)
        meta = plan.meta
    else:
        meta = fileformat.read_manifest(path).meta
    tree: Any = reading.load(path)  # rank 0 verified it as it loaded it, choosing it
    found, deferred = differences(
        target,
        tree,
        meta,
        rank=ranks.rank,
        world_size=ranks.world_size,
        may_change=may_change,
        where=path.name,
    )
    if plan is not None:
        found += plan.differences
    return tree, meta, found, deferred, plan


def _replicated(live: LiveState) -> LiveState:
    """What a sharded checkpoint's manifest holds of ``live``: every component but the model,
    its EMA and the optimizers DCP saves (an empty module stands in for the model)."""
    through_dcp = sharded_components(live)
    components = {n: o for n, o in live.components.items() if n not in through_dcp}
    return attrs.evolve(live, model=nn.Module(), ema=None, components=components)


def _candidates(
    directory: CheckpointDirectory, pointer: PointerName
) -> tuple[list[tuple[Path, tuple[Any, ...] | None, bool]], bool]:
    """Rank 0: the resume order for ``pointer``, each with its entry as it travels and
    whether it is a remote tier's (made local before it is tried), and whether the directory
    (or its remote tier) holds any checkpoint at all."""
    path = directory.storage.path
    if isinstance(directory, TieredDirectory):  # both tiers, a remote candidate made local
        both = directory.tiered_order(pointer)
        return [(path(n), entry_to_wire(e), remote) for n, e, remote in both], bool(both)
    best = directory.policy.best
    found = scan(directory.storage, best)
    order = resume_order(found.catalog, found.pointers, pointer, best)
    wires = [(path(n), entry_to_wire(found.catalog.get(n)), False) for n in order]
    return wires, bool(found.catalog)


def _plan(path: Path, live: LiveState, ranks: Ranks) -> ShardedPlan:
    """This rank's plan of the sharded checkpoint ``path``."""
    from pitstop.shell.sharded.engine import plan_read

    return plan_read(
        path,
        live.model,
        sharded_components(live),
        rank=ranks.rank,
        world_size=ranks.world_size,
        ema=live.ema,
    )


_Planned = tuple["ShardedPlan | None", str | None]
"""A candidate's plan on this rank (``None``: a file checkpoint, or a directory this rank
could not plan), and what went wrong."""


def _planned(path: Path, live: LiveState, ranks: Ranks) -> _Planned:
    """This rank's plan of candidate ``path`` (none for a file checkpoint)."""
    if not is_sharded_path(path):
        return None, None
    try:
        return _plan(path, live, ranks), None
    except (CheckpointCorrupt, OSError) as exc:
        return None, str(exc)


def _shares(planned: _Planned, reads: list[tuple[str, ...]]) -> tuple[tuple[str, ...], ...] | None:
    """Which rank verifies which file (``None``: this rank could not read the layout)."""
    plan = planned[0]
    if plan is None:
        return None
    try:
        return share_checks(plan.layout, reads)
    except CheckpointCorrupt:  # another rank's plan names a file this layout lacks
        return None


def _fits(planned: _Planned) -> bool:
    """Whether this rank planned the candidate's DCP read (its state fits the layout)."""
    plan = planned[0]
    return plan is not None and not any(d.kind is Kind.SHAPE for d in plan.differences)


def _problem(
    path: Path,
    reading: ResumeRead,
    planned: _Planned,
    shares: tuple[tuple[str, ...], ...] | None,
    ranks: Ranks,
    remote: ObjectStorage | None = None,
) -> str | None:
    """What this rank finds wrong with candidate ``path`` (``None``: its part verifies), where
    its files are not checked as DCP reads them (a file checkpoint, a state that does not fit).

    Rank 0 checks the manifest whole (and a plain file whole) and DCP's ``.metadata``; every
    file some rank's DCP read plan names is checked by one of those ranks, in parallel (on
    object storage: by each rank that downloads it, ``shares`` None)."""
    plan, problem = planned
    if problem is not None:
        return problem
    try:
        if ranks.leader:
            reading.verify(path, shards=False)
        if plan is not None:
            mine = _checks(plan, shares, ranks)
            # downloaded: each file checksummed as it arrived, compared here, not read again
            arrived = remote.fetch_files(path.name, mine) if remote is not None else None
            verify_sharded(path, plan.layout, mine, arrived=arrived)
    except (CheckpointCorrupt, OSError) as exc:
        return str(exc)
    return None


def _checks(
    plan: ShardedPlan, shares: tuple[tuple[str, ...], ...] | None, ranks: Ranks
) -> tuple[str, ...]:
    """The files this rank verifies of ``plan``'s checkpoint: its share, and (rank 0) DCP's
    own metadata, which no rank reads (a DCP tool would)."""
    from pitstop.shell.sharded.dcpio import DCP_METADATA

    mine = shares[ranks.rank] if shares is not None else plan.files
    if ranks.leader:
        mine = (*mine, *(f.name for f in plan.layout.files if f.name == DCP_METADATA))
    return mine


def _fetched(
    storage: ObjectStorage, name: str, live: LiveState, ranks: Ranks
) -> tuple[Path, _Planned]:
    """This rank's local folder of candidate ``name`` (fresh: its manifest downloaded) and its
    plan of it."""
    path = storage.path(name)
    shutil.rmtree(path, ignore_errors=True)
    try:
        storage.fetch_files(name, (MANIFEST_NAME,))
    except (CheckpointCorrupt, OSError) as exc:
        return path, (None, str(exc))
    return path, _planned(path, live, ranks)


def _choose_sharded(
    directory: CheckpointDirectory,
    pointer: PointerName,
    reading: ResumeRead,
    live: LiveState,
    ranks: Ranks,
) -> tuple[Path | None, tuple[Any, ...] | None, ShardedPlan | None, Checked | None]:
    """Every rank: try rank 0's resume order until a candidate verifies on every rank (with
    this rank's plan of it, and the state DCP read into staging as it was checked); all ranks
    move on together, rank 0 warning about each one skipped and why (and where)."""
    candidates, any_found = ranks.lead(partial(_candidates, directory, pointer))
    storage = directory.storage
    remote = storage if isinstance(storage, ObjectStorage) else None
    for path, wire, tiered in candidates:
        checked = None
        if tiered:  # the remote tier's: rank 0 copies it into the directory first
            assert isinstance(directory, TieredDirectory)
            problem = ranks.lead(partial(directory.bring_sharded, path.name))
            if problem is not None:
                if ranks.leader:
                    log.warning("resume skips a checkpoint that does not verify: %s", problem)
                continue
        if remote is not None:  # this rank's own copy: the manifest first; each checks its own
            path, planned = _fetched(remote, path.name, live, ranks)
            files = planned[0].files if planned[0] is not None else ()
            ranks.all_gather(files)
            problems = ranks.all_gather(_problem(path, reading, planned, None, ranks, remote))
        else:
            planned = _planned(path, live, ranks)
            if planned[0] is not None:  # the disk reads them while the ranks agree
                prefetch(path, [(name, 0, 0) for name in planned[0].files])  # checked whole
            files = planned[0].files if planned[0] is not None else ()
            gathered = ranks.all_gather((files, _fits(planned)))
            shares = _shares(planned, [f for f, _ in gathered])
            streamed = all(fits for _, fits in gathered)
            if streamed and planned[0] is not None:  # every check, and the manifest, in the read
                from pitstop.shell.sharded.rawread import check_agreed

                beside = reading.read_beside(path)
                checks = _checks(planned[0], shares, ranks)
                checked, problems = check_agreed(planned[0], checks, ranks, beside)
                if checked is not None:  # checked on every rank: read when applied
                    return path, wire, planned[0], checked
            else:
                problems = ranks.all_gather(_problem(path, reading, planned, shares, ranks))
        found: dict[str, list[int]] = {}
        for rank, problem in enumerate(problems):
            if problem is not None:
                found.setdefault(problem, []).append(rank)
        if not found:
            return path, wire, planned[0], checked
        if remote is not None:
            shutil.rmtree(path, ignore_errors=True)
        if ranks.leader or remote is not None:  # one line per problem, with the ranks that found it
            for problem, where in found.items():
                ranks_found = ", ".join(map(str, where))
                log.warning(
                    "resume skips a checkpoint that does not verify (rank %s): %s",
                    ranks_found,
                    problem,
                )
    if pointer is not PointerName.LAST and any_found:
        raise CheckpointNotFound(f"{directory.path} has no valid {pointer.value} checkpoint")
    return None, None, None, None


def _find_portable(
    directory: CheckpointDirectory,
    source: str | os.PathLike[str],
    verify: Callable[[Path], None],
) -> tuple[Path | None, tuple[Any, ...] | None]:
    """Rank 0's resume choice, as it travels to the other ranks."""
    path, entry = find_resume(directory, source, verify=verify)
    return path, entry_to_wire(entry)


def _union(per_rank: list[list[Difference]]) -> list[Difference]:
    """Every rank's differences, each once, in rank order."""
    seen: dict[str, Difference] = {}
    for found in per_rank:
        for difference in found:
            seen.setdefault(str(difference), difference)
    return list(seen.values())
