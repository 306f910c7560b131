# One candidate of a sharded resume on this rank: its plan, and the check of the files this rank
# wrote, started as soon as its manifest is read — before rank 0's resume order arrives, where
# the checkpoint this rank's pointer links to can be guessed.
#
# Rules: a rank plans a candidate from its manifest (read once: the plan is made from it) and
# starts checking the files it wrote (core.sharding.sharded.early_checks) on a thread while it
# plans (pitstop.shell.sharded.filecheck.Started). A resume of a pointer of a local directory
# every rank sees may start that sooner: each rank reads where the pointer links
# (core.sharding.sharded.guessed_first: a plain sharded name only) and starts on it before the
# round that brings rank 0's resume order — reading only, nothing live touched, no collective;
# the disk reads while the ranks agree. The start serves only the candidate it guessed
# (guess_holds), its manifest still the one it read (same inode, size and times); for any other
# it is closed, and a manifest that could not be read is read again
# (and its problem told) as if nothing had been guessed. Whatever happens, a start not handed
# over is closed (Guess is a context manager).
# How: functions over the live state, the ranks and a candidate's path; the choice
# (pitstop.shell.sharded.choice) tells them which candidate.

"""A sharded resume's candidate on this rank: its plan and its early checks, guessed early."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitstop.core.compat import Kind
from pitstop.core.records import PointerName
from pitstop.core.sharding.sharded import (
    MANIFEST_NAME,
    ShardedLayout,
    early_checks,
    guess_holds,
    guessed_first,
    share_checks,
)
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.state.capture import LiveState, sharded_components
from pitstop.shell.store.directory import CheckpointDirectory, is_sharded_path
from pitstop.shell.store.storage import LocalStorage
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.sharded.engine import ShardedPlan
    from pitstop.shell.sharded.filecheck import Started

__all__ = ["Guess", "Planned", "fits", "guess", "plan_of", "planned", "shares", "started"]

Read = tuple[ShardedLayout, Mapping[str, Any]]
"""A candidate's manifest, read: its layout and meta."""


def plan_of(path: Path, live: LiveState, ranks: Ranks, read: Read | None = None) -> ShardedPlan:
    """This rank's plan of the sharded checkpoint ``path`` (``read``: its layout and meta)."""
    from pitstop.shell.sharded.engine import plan_read

    return plan_read(
        path,
        live.model,
        sharded_components(live),
        rank=ranks.rank,
        world_size=ranks.world_size,
        ema=live.ema,
        read=read,
    )


Planned = tuple["ShardedPlan | None", str | None]
"""A candidate's plan on this rank (``None``: a file checkpoint, or a directory this rank
could not plan), and what went wrong."""


def planned(path: Path, live: LiveState, ranks: Ranks) -> Planned:
    """This rank's plan of candidate ``path`` (none for a file checkpoint)."""
    if not is_sharded_path(path):
        return None, None
    try:
        return plan_of(path, live, ranks), None
    except (CheckpointCorrupt, OSError) as exc:
        return None, str(exc)


class Guess:
    """The start on the checkpoint ``path`` that this rank's pointer links to: its manifest,
    read, and the check of the files this rank wrote, begun (:func:`guess`)."""

    def __init__(self, path: Path, seen: tuple[int, ...], read: Read, begun: Started) -> None:
        self.path = path
        self._seen = seen
        self._read: Read | None = read
        self._begun: Started | None = begun

    def take(self, path: Path) -> tuple[Read, Started] | None:
        """The start, handed over (once) when ``path`` is the checkpoint it guessed, its
        manifest the one read then; else ``None``, and the start is closed (it serves no other
        candidate)."""
        read, begun = self._read, self._begun
        same = guess_holds(self.path.name, path.name) and _seen(path) == self._seen
        if read is None or begun is None or not same:
            self.close()
            return None
        self._read = self._begun = None
        return read, begun

    def close(self) -> None:
        """Stop the check begun and close its files, unless handed over (twice: harmless)."""
        begun, self._read, self._begun = self._begun, None, None
        if begun is not None:
            begun.close()

    def __enter__(self) -> Guess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def guess(directory: CheckpointDirectory, pointer: PointerName, ranks: Ranks) -> Guess | None:
    """This rank's start on the checkpoint ``pointer`` links to in ``directory``, before rank
    0's resume order arrives (a local directory every rank reads: not a tiered or object
    store's): its manifest read and the files this rank wrote being checked. ``None`` where
    the link is missing or names no sharded checkpoint, or its manifest cannot be read (the
    candidate is then read, and its problem told, as if nothing had been guessed)."""
    from pitstop.shell.sharded import engine
    from pitstop.shell.sharded.filecheck import Started

    storage = directory.storage
    if isinstance(directory, TieredDirectory) or not isinstance(storage, LocalStorage):
        return None
    try:
        name = guessed_first(storage.read_link(pointer.value))
        if name is None:
            return None
        path = storage.path(name)
        seen = _seen(path)
        read = engine.read_layout(path)
    except Exception:  # only a guess: the candidate's own read tells what is wrong
        return None
    begun = Started(path, read[0], early_checks(read[0], ranks.rank, ranks.world_size))
    return Guess(path, seen, read, begun)


def _seen(path: Path) -> tuple[int, ...]:
    """Which manifest ``path`` holds now (its inode, size and change time; empty: none)."""
    try:
        found = os.stat(path / MANIFEST_NAME)
    except OSError:
        return ()
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns


def started(
    path: Path, live: LiveState, ranks: Ranks, guessed: Guess | None = None
) -> tuple[Planned, Started | None]:
    """:func:`planned`, with the check of the files this rank wrote started as soon as the
    manifest is read (core.sharding.sharded.early_checks), reading while the rank plans —
    or taken from ``guessed``, where it guessed ``path``."""
    from pitstop.shell.sharded import engine
    from pitstop.shell.sharded.filecheck import Started

    taken = guessed.take(path) if guessed is not None else None
    if not is_sharded_path(path):
        if taken is not None:
            taken[1].close()
        return (None, None), None
    if taken is not None:
        read, begun = taken
    else:
        try:
            read = engine.read_layout(path)  # once: the plan is made from it
        except (CheckpointCorrupt, OSError) as exc:
            return (None, str(exc)), None
        begun = Started(path, read[0], early_checks(read[0], ranks.rank, ranks.world_size))
    try:
        return (plan_of(path, live, ranks, read), None), begun
    except (CheckpointCorrupt, OSError) as exc:
        begun.close()
        return (None, str(exc)), None
    except BaseException:
        begun.close()
        raise


def shares(plan: Planned, reads: list[tuple[str, ...]]) -> tuple[tuple[str, ...], ...] | None:
    """Which rank verifies which file (``None``: this rank could not read the layout)."""
    if plan[0] is None:
        return None
    try:
        return share_checks(plan[0].layout, reads)
    except CheckpointCorrupt:  # another rank's plan names a file this layout lacks
        return None


def fits(plan: Planned) -> bool:
    """Whether this rank planned the candidate's DCP read (its state fits the layout)."""
    return plan[0] is not None and not any(d.kind is Kind.SHAPE for d in plan[0].differences)
