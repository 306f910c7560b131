# A sharded checkpoint the nodes' directories do not hold complete, taken from the remote tier.
#
# Rules: on nodes that share no directory, with a remote tier (remote=), a resume's candidate
# not complete across the directories (a wiped node held the only copy of its ranks' shards)
# that the remote tier holds is downloaded by each directory's writer, without the prefix's
# lease (rank 0's is the uploader's): only what the core's tier_takes says — the manifest and
# DCP's metadata where the directory lacks them, and each file whole in no directory, by the
# directory of the rank that wrote it — each file checked as it lands and moved into the
# directory's copy of the same save, if any (a copy of another save is replaced by the whole
# checkpoint). The files other ranks' reads need then move between the directories as for any
# candidate (acrossnodes), so each lost shard is downloaded once. A failed download is a
# warning; the candidate is judged again by what the directories then hold.
# How: functions over the Ranks, the core's DirectoryGroups and the TieredDirectory.

"""A sharded candidate no node holds complete: each node's writer takes its lack from the tier."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

from pitstop.core.ranks import DirectoryGroups, entry_from_wire, entry_to_wire
from pitstop.core.records import CheckpointEntry, PointerName
from pitstop.core.sharding.shardcover import tier_takes
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardFile
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.store.tiers import TieredDirectory

__all__ = ["remote_listed", "take_from_tier"]

log = logging.getLogger("pitstop")


def remote_listed(tiered: TieredDirectory, pointer: PointerName) -> list[tuple[str, Any]]:
    """Rank 0: the remote tier's resume order, each name with its entry as it travels."""
    return [(name, entry_to_wire(entry)) for name, entry in tiered.remote_order(pointer)]


def take_from_tier(
    tiered: TieredDirectory,
    name: str,
    wire: tuple[Any, ...],
    ranks: Ranks,
    groups: DirectoryGroups,
    held: Sequence[frozenset[str]],
    same: Sequence[bool],
) -> None:
    """Every rank: each writer copies from the remote tier's sharded checkpoint ``name`` (its
    entry ``wire``) what it lacks (the core's tier_takes, given the files each directory was
    found to hold whole, ``held``: the manifest and DCP's metadata, and the files whole in no
    directory that its ranks wrote) into its copy, if any — ``same[d]``: none, or one of the
    same save — or, where its copy is another save's, the whole checkpoint, replacing it (no
    lease taken: rank 0's is the uploader's); a failed download is a warning, and the
    candidate is judged by what the directories then hold."""
    entry = entry_from_wire(wire)
    assert isinstance(entry, CheckpointEntry)
    index = groups.group_of(ranks.rank)
    from pitstop.shell.sharded.dcpio import DCP_METADATA  # DCP itself only where sharded

    every = {MANIFEST_NAME, DCP_METADATA}
    have = [h if ok else frozenset() for h, ok in zip(held, same, strict=True)]

    def only(files: Sequence[ShardFile]) -> tuple[str, ...]:
        rows = [(f.name, f.rank) for f in files]
        return tier_takes(rows, groups.groups, index, have, every)

    work = partial(tiered.bring_sharded, name, entry, only if same[index] else None)
    said = ranks.all_gather_each(work if groups.writes(ranks.rank) else lambda: None)
    if ranks.leader:
        log.info(
            "resume: %s is not complete across the nodes: each takes what it lacks of it from "
            "the remote tier %s",
            name,
            tiered.remote.url,
        )
        for writer, problem in enumerate(said):
            if problem is not None:
                log.warning("resume: rank %d's directory could not take %s", writer, problem)
