# What one save does to a checkpoint directory.
#
# Rules: a decision that writes gets a new entry with the next save sequence number; if a file
# of the same name exists (an abandoned timeline: the run resumed from an older checkpoint and
# reached this step again) the new file replaces it, and every pointer that went to the old file
# is recomputed first. Then the decision's pointer moves apply, then retention is planned over
# the catalog with the new entry, so the new save and every pointer target survive.
# (The recomputation sees the new entry, so it can win best by its own metric.)
# A decision that only moves pointers goes to the existing file of that step; if that file is
# gone (removed by hand), the decision is carried out as a write instead, so no pointer is ever
# planned to a missing file.
# A save whose pointer phase fails is rolled back: the old pointers are put back first, then
# the new checkpoint is taken out again — only if no pointer on disk may name it (putting the
# old pointers back can fail too) and only if it replaced nothing (else it is the only file of
# its name). What stays is complete and durable, and is in the catalog from then on
# (`catalog.without(removed)`).
# A save's messages name its subject (plan_subject): the checkpoint it writes, else the first
# pointer it moves, else `last`.
# A checkpoint that arrives from another tier (plan_arrival: a local one uploaded to the remote
# tier, or a remote one brought back into an empty or damaged local directory) keeps its own
# sequence number — the same checkpoint is equally recent in both tiers, and the next save
# continues after it; the pointers are recomputed over the catalog with it (last: the newest;
# best and final by their rules), then that tier's own retention is planned. A remote tier
# catches up (plan_catch_up) on the local checkpoints it lacks — an upload failed, or was
# queued when its process died — except those its own retention would retire at once.
# How: the shell executes the plan in order: write the entry (temp, fsync, rename, fsync dir),
# replace pointers the same way, then delete `retention.delete`.

"""Plan one save: the new entry, the pointers after it, and what retention deletes."""

from __future__ import annotations

import attrs

from pitstop.core.naming import NOT_A_CHECKPOINT, checkpoint_name, parse_checkpoint, sharded_name
from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    CheckpointEntry,
    Metrics,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
    Progress,
)
from pitstop.core.saving.pointers import (
    move_pointers,
    recompute_best,
    recompute_final,
    recompute_pointers_to,
)
from pitstop.core.saving.retention import RetentionPlan, plan_retention
from pitstop.core.saving.schedule import SaveDecision

__all__ = [
    "SavePlan",
    "plan_arrival",
    "plan_catch_up",
    "plan_save",
    "plan_subject",
    "rollback_removals",
]


@attrs.frozen(kw_only=True)
class SavePlan:
    """The steps the shell carries out for one save, in order.

    ``entry``: the checkpoint to write, or ``NO_CHECKPOINT`` when only pointers move.
    ``replaces``: whether ``entry`` replaces a file of the same name. ``pointers``: the
    pointers once it is published. ``catalog``: the directory after the write, before
    deletions. ``retention``: what to delete afterwards, and why the rest stays.
    """

    entry: CheckpointEntry | NoCheckpoint
    replaces: bool
    pointers: Pointers
    catalog: Catalog
    retention: RetentionPlan

    @property
    def catalog_after(self) -> Catalog:
        """The directory once the plan, deletions included, is carried out."""
        return self.catalog.without(self.retention.delete)


def plan_save(
    catalog: Catalog,
    pointers: Pointers,
    decision: SaveDecision,
    *,
    progress: Progress,
    policy: Policy,
    metrics: Metrics | None = None,
    detail: str = "",
    sharded: bool = False,
) -> SavePlan:
    """Plan carrying out ``decision`` at ``progress`` in a directory holding ``catalog``.

    ``sharded``: the checkpoint is a sharded directory (``step_000000000100/``), not a file.
    """
    name = (sharded_name if sharded else checkpoint_name)(progress.step)
    write = decision.write or (bool(decision.moves) and name not in catalog)
    entry: CheckpointEntry | NoCheckpoint = NO_CHECKPOINT
    replaces = False
    after = catalog
    if write:
        entry = CheckpointEntry(
            progress=progress,
            seq=catalog.next_seq(),
            reason=decision.reason,
            detail=detail,
            metrics=metrics,
            sharded=sharded,
        )
        replaces = name in catalog
        after = catalog.with_entry(entry)
        if replaces:
            pointers = recompute_pointers_to(pointers, name, after, policy.best)
    moves = decision.moves | {PointerName.LAST} if write else decision.moves
    pointers = move_pointers(pointers, name, moves, decision.best_value)
    return SavePlan(
        entry=entry,
        replaces=replaces,
        pointers=pointers,
        catalog=after,
        retention=plan_retention(after, pointers, policy),
    )


def plan_arrival(catalog: Catalog, entry: CheckpointEntry, policy: Policy) -> SavePlan:
    """Plan adding ``entry``, a checkpoint published in another tier, to a directory holding
    ``catalog``: it keeps its sequence number (replacing a checkpoint of its name), the pointers
    are recomputed over the catalog with it, and retention follows ``policy`` (its ``best``
    ranks the best pointer)."""
    after = catalog.with_entry(entry)
    pointers = _pointers_over(after, policy)
    return SavePlan(
        entry=entry,
        replaces=entry.name in catalog,
        pointers=pointers,
        catalog=after,
        retention=plan_retention(after, pointers, policy),
    )


def plan_catch_up(local: Catalog, remote: Catalog, policy: Policy) -> tuple[CheckpointEntry, ...]:
    """The checkpoints of ``local`` that a remote tier holding ``remote`` (retired by
    ``policy``) lacks and should get, oldest (lowest seq) first: those it does not hold, or
    holds an older save of under the same name — less the ones its retention would retire at
    once, over its checkpoints and all of them together (an upload that failed, or was still
    queued when its process was killed, catches up; one the remote tier has retired since, or
    would, does not)."""
    missing = []
    for entry in local:
        there = remote.get(entry.name)
        if there is NO_CHECKPOINT or there.seq < entry.seq:
            missing.append(entry)
    after = remote
    for entry in missing:
        after = after.with_entry(entry)
    retired = set(plan_retention(after, _pointers_over(after, policy), policy).delete)
    return tuple(sorted((e for e in missing if e.name not in retired), key=lambda e: e.seq))


def _pointers_over(catalog: Catalog, policy: Policy) -> Pointers:
    """The pointers over ``catalog`` (last: its newest; best by ``policy``; final)."""
    best, best_value = recompute_best(catalog, policy.best)
    newest = catalog.newest()
    return Pointers(
        last=newest.name if newest is not NO_CHECKPOINT else NO_CHECKPOINT,
        best=best,
        best_value=best_value,
        final=recompute_final(catalog),
    )


def rollback_removals(plan: SavePlan, *, named_on_disk: bool) -> tuple[str, ...]:
    """What undoing ``plan`` after its pointer phase failed takes out again: its new checkpoint,
    when no pointer on disk may name it once the old pointers were put back (``named_on_disk``:
    one may — putting them back failed part-way) and it replaced no file; else nothing — a
    pointer would name a missing file, or it is the only file of its name."""
    entry = plan.entry
    if entry is NO_CHECKPOINT or plan.replaces or named_on_disk:
        return ()
    return (entry.name,)


def plan_subject(plan: SavePlan, before: Pointers) -> tuple[int | str, str]:
    """The step and the checkpoint name a save is about, for its messages: the entry it writes,
    else the first pointer it moves away from ``before``, else ``last`` (``"?"``: no step)."""
    entry = plan.entry
    if entry is not NO_CHECKPOINT:
        return entry.step, entry.name
    moved = [
        plan.pointers.target(p) for p in PointerName if plan.pointers.target(p) != before.target(p)
    ]
    for target in (*moved, plan.pointers.last):
        if target is not NO_CHECKPOINT:
            step = parse_checkpoint(target)
            return (step if step is not NOT_A_CHECKPOINT else "?"), target
    return "?", "no checkpoint"
