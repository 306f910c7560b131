# A replaced node's catch-up: which copies start before any writer has checked its own copy,
# and when such a copy's failure is everyone's error.
#
# Rules: a resume of a pointer tries the checkpoints every directory lists, newest first. For a
# checkpoint that some directories list and others do not (a wiped or replaced node), the
# copies to the directories that lack it start at once, each from a directory that lists it
# (the senders taken in turn, as catch_up takes them), before any check of the senders' own
# copies: a sender checks every piece of its copy as it reads it for sending — the same checks,
# against the file's own checksums, as its receiver makes as the piece lands, and as a verify
# makes — so the separate check before the copy, and the receiver's wait for it, are gone.
# Every other directory that lists it verifies its copy in the same round. Nothing is
# published or loaded before its checks passed, on either side.
# Each writer then says what it holds: VALID (checked whole: verified, sent, or received),
# INVALID (its own copy is missing, unreadable or corrupt: a verify would have said so), or
# FAILED (a copy it sent or received failed on its way: the stream, a write, a check of bytes
# its sender read whole). A failed copy whose sender's own copy was not found INVALID is an
# error on every rank (the one the copy raised, as a copy made after the checks raises it); a
# copy that failed because its sender's copy is bad is the bad copy's finding alone — its
# directory does not hold the checkpoint, and the choice goes on as after a failed verify
# (catch_up over what is VALID now: another holder, the remote tier, or the next checkpoint).
# How: frozen records and pure functions; pitstop.shell.nodes runs the round.

"""The catch-up's first round: copies that start before the checks, and their outcome."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pitstop.core.ranks import DirectoryGroups, Transfer

__all__ = ["Held", "copies_first", "copy_failed"]


class Held(enum.Enum):
    """What a writer holds of a checkpoint after the catch-up's first round."""

    VALID = "valid"
    """Its copy checked whole: verified, or sent or received with every piece checked."""
    INVALID = "invalid"
    """Its own copy is missing, unreadable or corrupt (a verify would have said so)."""
    FAILED = "failed"
    """A copy it sent or received failed on its way (the stream, a write, a check of bytes)."""


def copies_first(groups: DirectoryGroups, listed: Sequence[bool]) -> tuple[Transfer, ...]:
    """The copies that start before any check: to each directory that does not list the
    checkpoint (``listed[i]``: whether group ``i``'s writer lists it), from one that does, the
    senders taken in turn. Empty when every directory lists it (each checks its own) or none
    does (nothing to send)."""
    if len(listed) != len(groups.groups):
        raise ValueError(f"{len(listed)} answers for {len(groups.groups)} directories")
    holders = [writer for writer, has in zip(groups.writers, listed, strict=True) if has]
    lacking = [writer for writer, has in zip(groups.writers, listed, strict=True) if not has]
    if not holders or not lacking:
        return ()
    return tuple(
        Transfer(source=holders[i % len(holders)], target=target)
        for i, target in enumerate(lacking)
    )


def copy_failed(transfers: Sequence[Transfer], held: Sequence[Held]) -> bool:
    """Whether a copy of ``transfers`` failed on its way (``held[rank]``: what each rank says
    it holds after the round) while its sender's own copy was not found bad: an error on every
    rank."""
    return any(
        held[move.source] is not Held.INVALID
        and Held.FAILED in (held[move.source], held[move.target])
        for move in transfers
    )
