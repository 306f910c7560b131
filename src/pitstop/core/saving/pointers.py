# Where the named pointers go.
#
# Rules:
# * last is the most recently published checkpoint: highest save sequence number, never mtime.
# * final is the newest checkpoint written at a normal end; best the checkpoint whose Best metric
#   is best (ties: the earlier one, as a tie never improves) among those that recorded it after
#   step 0 (a step-0 checkpoint holds no training, as the schedule's best rule says).
# * A save moves the pointers its decision names. When a save replaces a file of the same name
#   from an abandoned timeline, every pointer that went to the old file is recomputed over what
#   remains before the moves apply.
# * Pointers read from disk (symlinks, latest.json) are advice, not truth: last is always
#   recomputed; a pointer whose target is not in the catalog is dropped and recomputed; a best
#   pointer that a checkpoint's recorded metric beats is moved; every disagreement is reported
#   as a warning string naming both sides.
# How: recompute_* derive one pointer from a catalog; move_pointers applies a decision;
# reconcile_pointers turns what the shell found on disk into trustworthy Pointers.
#
# Which checkpoint a resume tries first, and what it falls back to.
#
# Rules:
# * last: every published checkpoint, newest save sequence number first. Pointers are not
#   consulted, so a stale or missing `last` pointer never hides a newer checkpoint.
# * best: the best pointer's target first, then the other checkpoints that recorded the Best
#   metric, better value first (ties: the more recent first).
# * final: the final pointer's target first, then the other checkpoints saved at a normal end,
#   newest first.
# The shell tries the candidates in order until one verifies, warning about each it skips.
# What it reads into memory of its own (an optimizer's state) leaves the page cache behind the
# read (drop_behind) only where no other process of the job reads the same file after it:
# a job of one process. With more ranks, the others read the chosen file after rank 0 and
# find it in the page cache (on one machine); a rank's drop would send the next one to disk.
# With a remote tier (tiered_resume_order), a resume tries both tiers' candidates: for last,
# every checkpoint of either tier, newest (save sequence number, then step) first, the local copy
# of the same checkpoint before the remote one (it needs no download); for best and final, the
# local order, each candidate followed by its remote copy, then the remote tier's other ones in
# its own order. So an empty or damaged local directory resumes from the remote tier, and a
# damaged local checkpoint falls back to its remote copy before any older one.
# How: sorting the catalog, O(n log n).

"""Pointer arithmetic: moving, recomputing and reconciling last / best / final."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import attrs

from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    PointerName,
    Pointers,
    SaveReason,
)

__all__ = [
    "Tier",
    "drop_behind",
    "move_pointers",
    "recompute_best",
    "recompute_final",
    "recompute_pointers_to",
    "reconcile_pointers",
    "resume_order",
    "tiered_resume_order",
]


class Tier(enum.Enum):
    """Where a checkpoint is held: the local directory, or the remote tier (object storage)."""

    LOCAL = "local"
    REMOTE = "remote"


def recompute_final(catalog: Catalog) -> str | NoCheckpoint:
    """Return the newest checkpoint saved at a normal end, or ``NO_CHECKPOINT``."""
    for entry in reversed(catalog.entries):
        if entry.reason is SaveReason.FINAL:
            return entry.name
    return NO_CHECKPOINT


def recompute_best(catalog: Catalog, best: Best | None) -> tuple[str | NoCheckpoint, float | None]:
    """Return the best checkpoint by ``best``'s metric and its value.

    Entries that did not record the metric, or recorded NaN, are not candidates, and neither
    is a step-0 entry (nothing trained yet: :func:`~pitstop.core.saving.schedule.decide_save` never
    makes one best).
    """
    if best is None:
        return NO_CHECKPOINT, None
    winner: CheckpointEntry | None = None
    for entry in catalog.entries:  # oldest first: a tie keeps the earlier one
        value = entry.metrics.get(best.metric)
        if value is None or entry.step == 0:
            continue
        if best.improves(value, None if winner is None else winner.metrics[best.metric]):
            winner = entry
    if winner is None:
        return NO_CHECKPOINT, None
    return winner.name, winner.metrics[best.metric]


def recompute_pointers_to(
    pointers: Pointers, name: str, catalog: Catalog, best: Best | None
) -> Pointers:
    """Recompute every pointer that goes to ``name`` over ``catalog``.

    ``catalog`` is the directory as it is after ``name`` was replaced or removed.
    """
    changes: dict[str, object] = {}
    if pointers.last == name:
        newest = catalog.newest()
        changes["last"] = NO_CHECKPOINT if newest is NO_CHECKPOINT else newest.name
    if pointers.final == name:
        changes["final"] = recompute_final(catalog)
    if pointers.best == name:
        changes["best"], changes["best_value"] = recompute_best(catalog, best)
    return attrs.evolve(pointers, **changes) if changes else pointers  # type: ignore[arg-type]


def move_pointers(
    pointers: Pointers,
    name: str,
    moves: Iterable[PointerName],
    best_value: float | None,
) -> Pointers:
    """Return ``pointers`` with each pointer in ``moves`` going to ``name``.

    ``best_value`` becomes the best value when ``best`` moves.
    """
    changes: dict[str, object] = {PointerName(p).value: name for p in moves}
    if "best" in changes:
        changes["best_value"] = best_value
    return attrs.evolve(pointers, **changes) if changes else pointers  # type: ignore[arg-type]


def reconcile_pointers(
    catalog: Catalog,
    *,
    links: Pointers,
    manifest: Pointers,
    best: Best | None,
) -> tuple[Pointers, tuple[str, ...]]:
    """Derive trustworthy pointers for ``catalog`` from what the shell found on disk.

    ``links`` are the pointer symlinks, ``manifest`` the pointers in ``latest.json`` (with the
    best value); both are already parsed and may be stale, dangling or missing. Returns the
    pointers to use and a warning for every disagreement.
    """
    warnings: list[str] = []

    newest = catalog.newest()
    last: str | NoCheckpoint = NO_CHECKPOINT if newest is NO_CHECKPOINT else newest.name
    for source, found in (("symlink", links.last), ("latest.json", manifest.last)):
        if found is not NO_CHECKPOINT and found != last:
            seq = "" if newest is NO_CHECKPOINT else f" (seq {newest.seq})"
            warnings.append(
                f"pointer last ({source}) -> {found} is stale; the most recently published "
                f"checkpoint is {last}{seq}"
            )

    if (
        newest is not NO_CHECKPOINT
        and links.last is NO_CHECKPOINT
        and manifest.last is NO_CHECKPOINT
    ):
        warnings.append(
            f"pointer last is missing; the most recently published checkpoint is {last}"
        )

    def pick(pointer: PointerName) -> str | NoCheckpoint:
        link, json = links.target(pointer), manifest.target(pointer)
        if link != json and link in catalog and json in catalog:
            warnings.append(
                f"pointer {pointer.value}: symlink -> {link} but latest.json -> {json}; "
                "using the symlink"
            )
        for source, found in (
            ("symlink", links.target(pointer)),
            ("latest.json", manifest.target(pointer)),
        ):
            if found is NO_CHECKPOINT:
                continue
            if found in catalog:
                return found
            warnings.append(
                f"pointer {pointer.value} ({source}) -> {found} names no published checkpoint; "
                "ignored"
            )
        return NO_CHECKPOINT

    final = pick(PointerName.FINAL)
    if final is NO_CHECKPOINT:
        final = recompute_final(catalog)

    best_name = pick(PointerName.BEST)
    best_value: float | None = None
    if best_name is not NO_CHECKPOINT:
        entry = catalog.get(best_name)
        if manifest.best == best_name and manifest.best_value is not None:
            best_value = manifest.best_value
        elif best is not None and entry is not NO_CHECKPOINT:
            best_value = entry.metrics.get(best.metric)
    # A crash between publishing a checkpoint and moving `best` leaves the pointer behind a
    # better checkpoint; the metrics each file recorded settle it.
    winner, winner_value = recompute_best(catalog, best)
    if (
        best is not None
        and winner is not NO_CHECKPOINT
        and winner_value is not None
        and best.improves(winner_value, best_value)
    ):
        if best_name is not NO_CHECKPOINT:
            warnings.append(
                f"pointer best -> {best_name} ({best.metric}={best_value}) is stale; "
                f"{winner} recorded {best.metric}={winner_value}"
            )
        best_name, best_value = winner, winner_value

    pointers = Pointers(last=last, final=final, best=best_name, best_value=best_value)
    return pointers, tuple(warnings)


def resume_order(
    catalog: Catalog,
    pointers: Pointers,
    source: PointerName,
    best: Best | None = None,
) -> tuple[str, ...]:
    """Return the names a resume from ``source`` should try, in order.

    ``best`` ranks the fallbacks of a ``best`` resume; without it only the pointer is tried.
    An empty result means there is nothing to resume from that source.
    """
    source = PointerName(source)
    newest_first = tuple(reversed(catalog.entries))
    if source is PointerName.LAST:
        return tuple(e.name for e in newest_first)

    head = pointers.target(source)
    order: list[str] = [head] if head is not NO_CHECKPOINT and head in catalog else []
    if source is PointerName.FINAL:
        order += [e.name for e in newest_first if e.reason is SaveReason.FINAL and e.name != head]
        return tuple(order)

    if best is not None:
        ranked = sorted(
            (
                e
                for e in newest_first
                if e.name != head
                and best.metric in e.metrics
                and not math.isnan(e.metrics[best.metric])
            ),
            key=lambda e: best.rank_key(e.metrics[best.metric]),
        )  # sorted is stable: equal values keep newest-first order
        order += [e.name for e in ranked]
    return tuple(order)


def tiered_resume_order(
    local: tuple[Catalog, Pointers],
    remote: tuple[Catalog, Pointers],
    source: PointerName,
    best: Best | None = None,
) -> tuple[tuple[Tier, str], ...]:
    """Return the ``(tier, name)`` candidates a resume from ``source`` tries, in order, given
    each tier's catalog and pointers (see the rules above)."""
    source = PointerName(source)
    (local_catalog, local_pointers), (remote_catalog, remote_pointers) = local, remote
    mine = resume_order(local_catalog, local_pointers, source, best)
    theirs = resume_order(remote_catalog, remote_pointers, source, best)
    if source is PointerName.LAST:
        found = [(local_catalog.get(n), Tier.LOCAL, n) for n in mine]
        found += [(remote_catalog.get(n), Tier.REMOTE, n) for n in theirs]
        # a stable sort: at the same (seq, step) the local copy stays first
        found.sort(key=lambda c: (-c[0].seq, -c[0].step) if c[0] is not NO_CHECKPOINT else (0, 0))
        return tuple((tier, name) for _, tier, name in found)
    order: list[tuple[Tier, str]] = []
    left = list(theirs)
    for name in mine:
        order.append((Tier.LOCAL, name))
        if name in left and _same(local_catalog.get(name), remote_catalog.get(name)):
            order.append((Tier.REMOTE, name))
            left.remove(name)
    return (*order, *((Tier.REMOTE, name) for name in left))


def _same(one: CheckpointEntry | NoCheckpoint, other: CheckpointEntry | NoCheckpoint) -> bool:
    """Whether two tiers' entries are copies of one checkpoint: equal entries (name, step, seq,
    metrics ...); another timeline's checkpoint under the same name and seq is not one."""
    if one is NO_CHECKPOINT or other is NO_CHECKPOINT:
        return False
    return one == other


def drop_behind(world_size: int) -> bool:
    """Whether a resume's read lets the bytes it read into memory of its own (an optimizer's
    state) leave the page cache as it goes: only in a job of one process (``world_size`` 1),
    where no other rank reads the same file after it."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size == 1
