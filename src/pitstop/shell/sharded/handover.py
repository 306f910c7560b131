# A background sharded save once DCP's write has ended on every rank: published with every rank's
# own part, or its failure undone — by rank 0 in one directory, or by each directory's writer
# where the ranks share none (nodes with disks of their own).
#
# Rules: in one directory rank 0 alone publishes (its layout and the riders are its own), and a
# failure is rank 0's SaveError, raised on every rank. Across directories rank 0's layout and
# every rank's part reach every rank, each writer publishes its own copy (its manifest names the
# ranks sharing each directory: its handed-over meta), and the outcome is agreed: a failure on
# any writer is raised on every rank, and each writer that had not published yet undoes its
# save (its temp directory removed, its schedule and pointers put back), as a failed background
# save always is; a copy published before the failure stays (a resume takes the newest
# checkpoint complete somewhere).
# How: functions over the Ranks and a Handing (pitstop.shell.saving.Saver is one).

"""A settled background sharded save: published, or undone, on rank 0 or on every writer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pitstop.core.ranks import DirectoryGroups
from pitstop.core.sharding.sharded import ShardedLayout
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.packing import Packed, unpack_state

if TYPE_CHECKING:
    from pitstop.shell.sharded.shardwrite import WrittenShards

__all__ = ["Handing", "fail_written", "publish_written", "writes_copy"]


class Handing(Protocol):
    """What publishes, or undoes, a handed-over background sharded save on one rank."""

    @property
    def handing(self) -> bool:
        """Whether a save is handed over and not yet published or failed."""
        ...

    def publish_handed(self, layout: ShardedLayout, parts: Sequence[Mapping[str, Any]]) -> None:
        """Write the manifest last and publish, with every rank's own part."""
        ...

    def fail_handed(self, error: BaseException) -> None:
        """Undo the save and raise ``error`` as its SaveError."""
        ...


def writes_copy(ranks: Ranks, homes: DirectoryGroups | None) -> bool:
    """Whether this rank publishes a copy: rank 0, or (``homes``: directories the ranks do
    not share) each directory's writer."""
    return ranks.leader or (homes is not None and homes.writes(ranks.rank))


def publish_written(
    ranks: Ranks, saver: Handing, written: WrittenShards, homes: DirectoryGroups | None
) -> None:
    """Every rank: publish the save whose shards are ``written`` on every rank — rank 0 alone,
    or each writer of ``homes`` its own copy with rank 0's layout (agreed)."""

    def publish(layout: ShardedLayout, riders: Sequence[Packed]) -> None:
        saver.publish_handed(layout, [unpack_state(packed) for packed in riders])

    if homes is None:
        ranks.lead(lambda: publish(written.layout(ranks.world_size), written.riders))
        return
    layout, riders = ranks.lead(lambda: (written.layout(ranks.world_size), written.riders))
    ranks.each(lambda: publish(layout, riders) if writes_copy(ranks, homes) else None)


def fail_written(
    ranks: Ranks, saver: Handing, error: BaseException, homes: DirectoryGroups | None
) -> None:
    """Every rank: the save failed (``error``, on any rank): rank 0's SaveError raised on every
    rank — or each writer of ``homes`` that had not published undoes its own, and the lowest
    one's SaveError is raised on every rank."""
    if homes is None:
        ranks.lead(lambda: saver.fail_handed(error))
    else:
        ranks.each(lambda: saver.fail_handed(error) if saver.handing else None)
