# The resume path: choose a checkpoint, read it, check it against the run, restore it.
#
# Rules: the round that settles the save in flight comes first (a sharded choice's resume order
# travels in it). Rank 0 chooses (the core's resume order through pitstop.shell.store.resolve, each
# candidate checked as it is read: a corrupt newest file is skipped with a warning) and its choice
# travels to the other ranks; nothing to resume leaves everything untouched. Every rank then reads
# the chosen file and compares it with its own run; the differences of all ranks, each once, decide
# (pitstop.core.compat's judge: hard ones always refuse, soft ones only under strict=True, and pass
# with a warning otherwise). The restore is all-or-nothing on every rank: prepared everywhere,
# committed only when every rank prepared, undone where it was prepared when any rank failed.
# Components the checkpoint holds but the run has not registered are kept in the live state
# (deferred) for register() to apply; per-rank state is handed back only when the world size is the
# one that saved it. A sharded checkpoint (a DCP directory) is chosen by every rank together
# (pitstop.shell.sharded.choice: each file read is checked once, by one of its readers, nothing
# live touched; on object storage each rank downloads and checks its own copy as it arrives; with a
# remote tier rank 0 copies a remote candidate in first; across directories the ranks do not share,
# pitstop.shell.sharded.acrossnodes); its replicated tree is checked and restored as above, and its
# layout checked on every rank in the same pass (agreed with the files' checks where it was
# chosen); the restore prepared and the state applied in one round, then the checked tensors copied
# in from the same open files. An optimizer that had no state has none again unless the resume
# restored it (pitstop.shell.state.freshopt). Only a resume that succeeded on every rank moves
# rank 0's schedule on (the first save's refusal off): after it, in a round of its own — or, where
# the copy's round ends the resume in one plain local directory (core.sharding.sharded.
# adopts_without_round), worked out in the apply's round and kept once the copy's agreed.
# How: functions over the live state, the ranks and the directory; the Checkpointer calls
# resume_from() and keeps what it returns (the path restored and its entry).

"""Resuming: choose, read, check and restore a checkpoint, on every rank or none."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from torch import nn

from pitstop.core.compat import Difference, judge
from pitstop.core.ranks import DirectoryGroups, entry_from_wire, entry_to_wire
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, NoCheckpoint, PointerName
from pitstop.core.s3.objects import is_object_url
from pitstop.core.schema import STATE
from pitstop.core.sharding.sharded import adopts_without_round
from pitstop.errors import (
    IncompatibleCheckpoint,
    ResumeWarning,
)
from pitstop.shell.format import fileformat
from pitstop.shell.format.untrusted import free_later
from pitstop.shell.lifetime import on_writers
from pitstop.shell.nodes import choose_across, choose_path_across, fetch_for_readers
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.sharded.acrossnodes import choose_sharded_across, choose_sharded_path_across
from pitstop.shell.sharded.candidate import plan_of
from pitstop.shell.sharded.choice import choose_sharded
from pitstop.shell.state.capture import (
    LiveState,
    ranked_state,
    sharded_components,
    stored_groups,
    stored_world_size,
)
from pitstop.shell.state.freshopt import FreshOptimizers
from pitstop.shell.state.restore import Restore, differences
from pitstop.shell.store.directory import CheckpointDirectory, is_sharded_path
from pitstop.shell.store.resolve import find_resume, own_pointer
from pitstop.shell.store.storage import RemoteStorage
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.saving import Saver
    from pitstop.shell.sharded.engine import ShardedPlan


__all__ = ["resume_from"]

log = logging.getLogger("pitstop")

T = TypeVar("T")


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
    settle: Callable[[Callable[[], Any] | None], Any] | None = None,
    saver: Saver | None = None,
) -> tuple[Path | None, CheckpointEntry | NoCheckpoint]:
    """Restore ``live`` from ``source`` on every rank; the path restored and its entry; then
    the ``saver``'s schedule after it, on its writers (``Saver.resumed``) — rank 0's worked
    out in the apply's round and kept once the copy's round agreed, where that round ends the
    resume (the core's adopts_without_round), else in a round of its own.

    ``(None, NO_CHECKPOINT)``: nothing to resume, nothing touched. Raises
    :class:`~pitstop.errors.IncompatibleCheckpoint` listing every rank's differences (each once)
    with the run exactly as before. ``may_change``: the config patterns a resume only reports.
    ``groups``: which ranks share a directory (directories not shared: every writer's copy
    counts, and one that lacks the checkpoint chosen gets it first, pitstop.shell.nodes; sharded
    state: the newest checkpoint complete across them, pitstop.shell.sharded.acrossnodes).
    ``settle(then)``: the round that settles the save in flight, run first, with rank 0's
    ``then()`` in it (its result returned on every rank): a sharded choice's resume order
    travels in it.
    """
    kept: list[Callable[[], None]] = []  # rank 0's schedule, worked out in the apply's round
    adopting = partial(_adopting, saver, kept, ranks.leader) if saver is not None else None
    path, entry, folded = _restored(
        source, strict, live, ranks, directory, may_change, sharded, groups, settle, adopting
    )
    if folded:  # agreed in the copy's round: kept, nothing left to fail
        for keep in kept:
            keep()
    elif saver is not None:
        writers = groups or DirectoryGroups.one(ranks.world_size)
        on_writers(ranks, writers, partial(saver.resumed, entry))
    return path, entry


def _adopting(
    saver: Saver,
    kept: list[Callable[[], None]],
    leader: bool,
    entry: CheckpointEntry | NoCheckpoint,
) -> None:
    """Rank 0: ``saver``'s schedule after resuming from ``entry`` worked out into ``kept``."""
    if leader:
        kept.append(saver.resuming(entry))


def _restored(
    source: str | os.PathLike[str],
    strict: bool,
    live: LiveState,
    ranks: Ranks,
    directory: CheckpointDirectory,
    may_change: tuple[str, ...],
    sharded: bool,
    groups: DirectoryGroups | None,
    settle: Callable[[Callable[[], Any] | None], Any] | None,
    adopting: Callable[[CheckpointEntry | NoCheckpoint], None] | None,
) -> tuple[Path | None, CheckpointEntry | NoCheckpoint, bool]:
    """:func:`resume_from`'s restore; and whether ``adopting(entry)`` ran in the apply's
    round (on every rank; the copy's round that ended the resume agreed after it)."""
    # DCP's choice gives an optimizer without state zeroed state: taken away unless restored
    with (
        FreshOptimizers(sharded_components(live) if sharded else {}) as fresh,
        ExitStack() as opened,
    ):
        # checks as it reads: the disk read once
        reading = ResumeRead(live, ranks.rank, ranks.world_size)
        pointer = own_pointer(directory, source)
        plan = checked = compared = None
        target = _replicated(live) if sharded else live
        across = groups is not None and not groups.shared
        listed: list[int] = []  # rank 0: the checkpoints before the choice, once settled
        lead: Callable[[Callable[[], Any]], Any] = ranks.lead
        if settle is not None and sharded and pointer is not None and not across:
            lead = partial(_settled, settle, directory, listed)  # the choice's first round
        else:
            if settle is not None:
                settle(None)
            if ranks.leader:
                listed[:] = [e.seq for e in directory.catalog]
        if sharded and pointer is not None and across:  # each node holds its ranks' shards
            assert groups is not None
            planner = partial(plan_of, live=live, ranks=ranks)
            path, wire, plan = choose_sharded_across(directory, pointer, ranks, groups, planner)
        elif sharded and across and not is_object_url(source):  # an explicit path, each node
            assert groups is not None
            planner = partial(plan_of, live=live, ranks=ranks)
            picked = choose_sharded_path_across(directory, source, ranks, groups, planner)
            path, wire, plan = picked
        elif sharded and pointer is not None:
            compare = partial(_compare, reading, live, target, ranks, may_change)
            chosen = choose_sharded(directory, pointer, reading, live, ranks, compare, lead)
            path, wire, plan, checked, compared = chosen
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
            return None, NO_CHECKPOINT, False
        # a chosen plan: a directory, on every rank
        is_directory = plan is not None or ranks.each(partial(is_sharded_path, path))
        if is_directory != sharded:
            held = "sharded state (a DCP directory)" if is_directory else "unsharded state (a file)"
            run = "sharded (FSDP2, DTensor)" if sharded else "not sharded"
            raise IncompatibleCheckpoint([f"{path.name}: holds {held}; this run's model is {run}"])
        if compared is not None:  # compared as it was checked, in the same round
            loaded, found = compared[0], _union(compared[1])
        else:
            read = partial(_load, path, reading, live, target, ranks, may_change, plan)
            loaded, found = _compared(ranks, read)  # each rank's differences in one round
        tree, meta, _, deferred, plan = loaded
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
        plain = not isinstance(directory, TieredDirectory)
        folded = adopting is not None and adopts_without_round(
            checked_read=checked is not None,
            one_directory=groups is None or groups.shared,
            adopting_reads_nothing=plain and not isinstance(directory.storage, RemoteStorage),
        )
        after = partial(adopting, entry) if folded and adopting is not None else None
        try:
            if not sharded:
                ranks.each(restore.prepare)
            else:  # checked and verified on every rank before DCP touches a tensor
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
                    before=restore.prepare,  # agreed in the apply's round
                    after=after,  # in its round too; kept once the copy's round agreed
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
        free_later(done_with.clear)
        if ranks.leader:
            _say_resumed(path, entry, listed if pointer is PointerName.LAST else [])
        return path, entry, folded


def _settled(
    settle: Callable[[Callable[[], Any] | None], Any],
    directory: CheckpointDirectory,
    listed: list[int],
    work: Callable[[], T],
) -> T:
    """``work()``, rank 0's, in the settle's round (a sharded choice's resume order), after
    rank 0 noted the checkpoints the directory then holds into ``listed``."""

    def then() -> T:
        listed[:] = [e.seq for e in directory.catalog]
        return work()

    return settle(then)  # type: ignore[no-any-return]


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
            plan = plan_of(path, live, ranks)
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


def _compare(
    reading: ResumeRead,
    live: LiveState,
    target: LiveState,
    ranks: Ranks,
    may_change: tuple[str, ...],
    path: Path,
    plan: ShardedPlan,
) -> tuple[tuple[Any, Mapping[str, Any], list[Difference], frozenset[str], Any], list[Difference]]:
    """A sharded candidate's :func:`_load` (kept on this rank) and its differences (told)."""
    loaded = _load(path, reading, live, target, ranks, may_change, plan)
    return loaded, loaded[2]


def _compared(
    ranks: Ranks, read: Callable[[], tuple[Any, Any, list[Difference], Any, Any]]
) -> tuple[tuple[Any, Any, list[Difference], Any, Any], list[Difference]]:
    """Every rank: ``read()`` (what :func:`_load` returns) and every rank's differences, each
    once, in one round; a failure to read on any rank raised on every rank."""
    loaded: list[Any] = []

    def differences_here() -> list[Difference]:
        loaded.append(read())
        return list(loaded[0][2])

    found = _union(ranks.all_gather_each(differences_here))  # raises unless it read here
    return loaded[0], found


def _replicated(live: LiveState) -> LiveState:
    """What a sharded checkpoint's manifest holds of ``live``: every component but the model,
    its EMA and the optimizers DCP saves (an empty module stands in for the model)."""
    through_dcp = sharded_components(live)
    components = {n: o for n, o in live.components.items() if n not in through_dcp}
    return attrs.evolve(live, model=nn.Module(), ema=None, components=components)


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
