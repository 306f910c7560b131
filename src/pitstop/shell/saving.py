# Carrying out one planned save: capture the state, then write it now or hand it over.
#
# Rules: a synchronous save writes straight from the live tensors before its call returns. A
# background save copies them into staging buffers first (in overlap mode, the storages only
# optimizer.step() changes are copied later, by whichever thread needs them first) and hands
# the write to the session's writer thread. Every step is reported to the session as the
# core's event. Nothing here refers to the Checkpointer, so the job a writer thread holds
# keeps no Checkpointer alive.
# How: a function over the live state, the directory, the session and the staging pool.

"""Saving: capture, then publish (synchronously) or hand over (in the background)."""

from __future__ import annotations

from functools import partial
from typing import Any

from pitstop.core.plan import SavePlan
from pitstop.core.records import NO_CHECKPOINT
from pitstop.core.session import Event
from pitstop.shell import fileformat
from pitstop.shell.capture import LiveState, capture, deferrable
from pitstop.shell.directory import CheckpointDirectory
from pitstop.shell.session import SaveSession
from pitstop.shell.staging import StagingPool

__all__ = ["carry_out"]


def carry_out(
    plan: SavePlan,
    *,
    live: LiveState,
    parts: list[dict[str, Any]] | None,
    directory: CheckpointDirectory,
    session: SaveSession,
    pool: StagingPool | None,
    overlap: bool,
) -> None:
    """Capture ``live`` (with every rank's ``parts``) and write ``plan``'s checkpoint."""
    entry = plan.entry
    if entry is NO_CHECKPOINT:  # only pointers move
        if pool is None:
            session.event(Event.CAPTURED)
            directory.repoint(plan)
            session.event(Event.PUBLISHED)
        else:
            session.hand_over(partial(directory.repoint, plan), None)
        return
    tree, meta = capture(live, parts)
    if pool is None:  # synchronous: write straight from the live tensors
        prepared = fileformat.prepare(tree)
        session.event(Event.CAPTURED)
        directory.publish(plan, entry, lambda: prepared, meta)
        session.event(Event.PUBLISHED)
        return
    defer = deferrable(live) if overlap else frozenset()
    staged, finish_copy = pool.snapshot(tree, defer=defer)

    def copy(guard: bool) -> None:
        # On the loop's thread (guard): later work on its streams waits for the copies. On
        # the writer's: they are on their own, and write() waits for them before reading.
        finish_copy(guard)

    def write() -> None:
        try:
            pool.ready()  # every device-to-host copy has landed
            directory.publish(plan, entry, lambda: fileformat.prepare(staged), meta)
        finally:
            pool.release()

    session.hand_over(write, copy if defer else None)
