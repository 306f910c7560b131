# Carrying out one planned file save on rank 0: capture the live state, then write it.
#
# Rules: a synchronous save writes straight from the live tensors before its call returns; a
# background save copies them into staging buffers first (in overlap mode, the storages only
# optimizer.step() changes are copied later, by whichever thread needs them first) and hands
# the write to the session's writer thread. Every step is reported to the session as the
# core's event. Staging buffers go back to the pool on every path that ends without a write:
# a deferred copy that failed, a writer thread that could not start. A plan that writes no
# checkpoint only moves pointers (on the writer thread, in the background).
# How: one function over the plan, the live state, the directory, the session and the pool;
# the writer's job and copy are closures over what they write, nothing else.

"""carry_out: capture a planned save, then publish it (synchronously) or hand it over."""

from __future__ import annotations

from functools import partial
from typing import Any

from pitstop.core.records import NO_CHECKPOINT
from pitstop.core.saving.plan import SavePlan
from pitstop.core.session import Event
from pitstop.shell.format import fileformat
from pitstop.shell.session import SaveSession
from pitstop.shell.state.capture import LiveState, capture, deferrable
from pitstop.shell.state.staging import StagingPool
from pitstop.shell.store.directory import CheckpointDirectory

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
        # the writer's: they have landed when it returns. A copy that fails ends the save
        # before write() runs: its buffers go back to the pool here, for the next save.
        try:
            finish_copy(guard)
        except BaseException:
            pool.give_back()
            raise

    def write() -> None:
        try:
            pool.ready()  # every device-to-host copy has landed
            directory.publish(plan, entry, lambda: fileformat.prepare(staged), meta)
        finally:
            pool.release()

    try:
        session.hand_over(write, copy if defer else None)
    except BaseException:  # nothing was handed over (no writer thread): the buffers go back
        pool.give_back()
        raise
