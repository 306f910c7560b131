# Which checkpoints to keep.
#
# Rules (any one keeps a checkpoint, and each is recorded as a reason):
# * newest: the most recently published (highest sequence number) is always kept;
# * recent: the keep_last most recently published; keep_all when keep_last is None;
# * keep_every: a step that is a multiple of keep_every is kept forever;
# * pointer:last / pointer:best / pointer:final: a pointer target is never deleted.
# Everything else is deleted, oldest first. The plan is made over the catalog *including* the
# save being published, and the shell deletes only after that save and its pointers are
# durable, so nothing is ever deleted before its replacement exists.
# How: one pass over the catalog sorted by sequence number: O(n) after the catalog's sort.

"""Retention: the keep/delete plan, with the reasons each kept checkpoint is kept."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    KeepReason,
    PointerName,
    Pointers,
    Policy,
)

__all__ = ["RetentionPlan", "plan_retention"]

_POINTER_REASON = {
    PointerName.LAST: KeepReason.POINTER_LAST,
    PointerName.BEST: KeepReason.POINTER_BEST,
    PointerName.FINAL: KeepReason.POINTER_FINAL,
}


@attrs.frozen(kw_only=True)
class RetentionPlan:
    """The outcome of retention: what stays and why, and what goes (oldest first)."""

    keep: Mapping[str, frozenset[KeepReason]]
    delete: tuple[str, ...]

    def why(self, name: str) -> frozenset[KeepReason]:
        """Return why ``name`` is kept (empty when it is deleted or unknown)."""
        return self.keep.get(name, frozenset())


def plan_retention(catalog: Catalog, pointers: Pointers, policy: Policy) -> RetentionPlan:
    """Plan which checkpoints of ``catalog`` to keep under ``policy``, given ``pointers``."""
    reasons: dict[str, set[KeepReason]] = {e.name: set() for e in catalog.entries}

    newest = catalog.newest()
    if newest is not NO_CHECKPOINT:
        reasons[newest.name].add(KeepReason.NEWEST)

    if policy.keep_last is None:
        for entry in catalog.entries:
            reasons[entry.name].add(KeepReason.KEEP_ALL)
    else:
        for entry in catalog.entries[-policy.keep_last :]:
            reasons[entry.name].add(KeepReason.RECENT)

    if policy.keep_every is not None:
        for entry in catalog.entries:
            if entry.step % policy.keep_every == 0:
                reasons[entry.name].add(KeepReason.KEEP_EVERY)

    for pointer, target in pointers.items():
        if target in reasons:
            reasons[target].add(_POINTER_REASON[pointer])

    keep = {name: frozenset(why) for name, why in reasons.items() if why}
    delete = tuple(e.name for e in catalog.entries if e.name not in keep)
    return RetentionPlan(keep=MappingProxyType(keep), delete=delete)
