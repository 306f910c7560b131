# A save of replicated (DDP) state on nodes that share no directory: what each rank does in the
# save's rounds once rank 0 has decided and planned it.
#
# Rules: each directory's writer (its group's lowest rank) writes that directory's copy. In the
# round that carries every rank's own part (RNG streams, per-rank components) to every writer,
# each writer other than rank 0 first plans rank 0's decision on its own directory (its catalog,
# its pointers; rank 0 planned it already): the round agrees that planning's outcome too, so a
# failure of it — a background save of that writer's that failed, raised by the plan's wait — is
# raised on every rank before any copy is written, and no round is added for it. Every writer
# then writes its copy, and the outcome is agreed in one last round. A background write (an
# async_save) of a writer is held until that last round has passed on its rank, when several
# writers write: by then every writer's copy into its staging buffers is made, so no writer's
# disk write takes the CPU and memory bandwidth from another writer's copy or from the rounds —
# nodes with several ranks each share their machine, as simulated nodes share one. One writer
# (one directory for every rank) holds nothing: the other ranks only wait for it.
# How: one frozen record per rank, from the agreed groups; pitstop.shell.savecall follows it.

"""Each rank's part in a save of replicated state written once per directory."""

from __future__ import annotations

import attrs

from pitstop.core.ranks import DirectoryGroups

__all__ = ["CopyRole", "copy_role"]


@attrs.frozen(kw_only=True)
class CopyRole:
    """One rank's part in a save written by each directory's writer.

    ``writes``: it writes its directory's copy; ``follows``: it plans rank 0's decision on its
    own directory, in the round that brings it every rank's part; ``holds``: its background
    write waits until the save's last round has passed here.
    """

    writes: bool
    follows: bool
    holds: bool


def copy_role(groups: DirectoryGroups, rank: int) -> CopyRole:
    """What ``rank`` does in a save of replicated state under ``groups`` (see the rules)."""
    writes = groups.writes(rank)
    return CopyRole(
        writes=writes,
        follows=writes and rank != 0,
        holds=writes and len(groups.writers) > 1,
    )
