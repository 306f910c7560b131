# Publishing a sharded checkpoint: what a failure part-way (or a writer that died in it) leaves
# under its names, and what to do about each.
#
# Rules: a directory cannot be renamed over another, so a save whose step already has a sharded
# checkpoint (an abandoned timeline, an overwrite) moves the old one aside first (the core's
# `aside_name`), renames the new one from its temp name into place, fsyncs the parent, and only
# then removes the old one. After a failure anywhere in that sequence — and when a directory is
# next opened, for what a writer that died in it left aside — the shell looks at the three names
# (the new one's temp name, the aside name, the real name) and settles them by these rules:
# * the temp directory was never published (no pointer ever named it): it goes;
# * a new checkpoint renamed into place stays when it replaced one (the old one's name is its
#   own now: the catalog holds it), and is taken out again when it replaced nothing (then the
#   directory is as it was, as for a file);
# * the old checkpoint moved aside goes back under the real name when that is free;
# * a complete checkpoint is removed only while the new one is in place under the real name;
#   what is left of an old one half removed (its manifest, removed first, gone) just goes;
# * what could not be looked at is left as it is.
# So the real name holds the old checkpoint or the new one, never neither — unless putting the
# old one back fails too; then it stays aside, whole, and the next open() puts it back.
# How: one pure function over what is found under each name; the shell carries it out in the
# order of the record's fields and says in the error what the real name holds.

"""Settling a sharded checkpoint's publish after a failure, and what a dead writer left aside."""

from __future__ import annotations

import enum

import attrs

__all__ = ["Found", "Holds", "Settlement", "settle_replacement"]


class Found(enum.Enum):
    """What is under one name of a sharded publish."""

    MISSING = "missing"
    COMPLETE = "complete"  # a directory holding its manifest: a checkpoint
    INCOMPLETE = "incomplete"  # anything else: no manifest (cut short, half removed), a file
    UNKNOWN = "unknown"  # it could not be looked at


class Holds(enum.Enum):
    """What the real name holds once a settlement is carried out."""

    OLD = "the old checkpoint"  # as before the save (put back, or never moved)
    NEW = "the new checkpoint"
    NOTHING = "nothing"
    UNKNOWN = "something this save did not put there"


@attrs.frozen(kw_only=True)
class Settlement:
    """What to do, in this order, after a sharded publish failed (or at open, for an aside).

    ``remove_temp``: the new directory under its temp name. ``remove_final``: the new one under
    the real name (it replaced nothing). ``restore``: rename the old one from the aside name
    back to the real name. ``remove_aside``: the old one under the aside name. ``holds``: what
    the real name holds then.
    """

    remove_temp: bool
    remove_final: bool
    restore: bool
    remove_aside: bool
    holds: Holds

    def __attrs_post_init__(self) -> None:
        if self.restore and self.remove_aside:
            raise ValueError("an aside checkpoint is either put back or removed, not both")


def settle_replacement(*, replacing: bool, temp: Found, aside: Found, final: Found) -> Settlement:
    """Settle a sharded publish that stopped part-way, from what is under each of its names.

    ``replacing``: the real name held a checkpoint when the publish began, to be moved to the
    aside name (at open, for an aside left there: True). ``temp``: the new directory's temp
    name; ``aside``: the aside name; ``final``: the real name.
    """
    renamed_in = temp is Found.MISSING and final is Found.COMPLETE  # the new one is in place
    remove_final = renamed_in and not replacing
    final_after = Found.MISSING if remove_final else final
    restore = aside is Found.COMPLETE and final_after is Found.MISSING
    remove_aside = aside is Found.INCOMPLETE or (
        aside is Found.COMPLETE and renamed_in and replacing
    )
    if restore:
        holds = Holds.OLD
    elif final_after is Found.MISSING:
        holds = Holds.NOTHING
    elif final_after is not Found.COMPLETE:
        holds = Holds.UNKNOWN
    elif renamed_in:
        holds = Holds.NEW
    elif replacing and aside is not Found.COMPLETE:  # the old one was never moved
        holds = Holds.OLD
    else:
        holds = Holds.UNKNOWN
    return Settlement(
        remove_temp=temp is not Found.MISSING,
        remove_final=remove_final,
        restore=restore,
        remove_aside=remove_aside,
        holds=holds,
    )
