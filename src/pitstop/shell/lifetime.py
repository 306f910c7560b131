# How a Checkpointer ends: closed, or dropped without close().
#
# Rules: the end publishes what is in flight, then removes the optimizer hooks and releases the
# directory lock — in that order, and the release happens even when publishing fails, but never
# while a writer may still write (the core's may_release: a close interrupted twice). A
# Checkpointer closed by its owner raises a failed background save's error (after the
# release); one dropped without close() (collected, or left open at interpreter exit) has
# nobody to raise to, so the error is logged. The finalizer refers to the session, the
# directory and the hooks — never to the Checkpointer, so it does not keep it alive. A sharded
# save in flight needs a collective to finish, which a finalizer cannot run: it is abandoned
# (not published; logged as a failed save).
# How: the Checkpointer registers shut_down() with weakref.finalize; close() detaches it and
# calls release() itself.

"""Lifetime: releasing a Checkpointer's directory and hooks, and finishing a dropped one."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pitstop.shell.directory import CheckpointDirectory
from pitstop.shell.session import SaveSession

__all__ = ["release", "shut_down"]

log = logging.getLogger("pitstop")


def release(directory: CheckpointDirectory, hooks: list[torch.utils.hooks.RemovableHandle]) -> None:
    """Remove the optimizer ``hooks`` and release ``directory`` (its lock)."""
    for hook in hooks:
        hook.remove()
    hooks.clear()
    directory.close()


def shut_down(
    session: SaveSession,
    directory: CheckpointDirectory,
    hooks: list[torch.utils.hooks.RemovableHandle],
    abandon: Callable[[], None] | None = None,
) -> None:
    """Finish a Checkpointer nobody closed (garbage collection or interpreter exit).

    ``abandon``: gives up a save in flight that only a collective could finish (sharded).
    """
    try:
        if abandon is not None:
            abandon()
        reported = session.close()
        if reported is not None and reported.error is not None:
            log.error(
                "a background save failed and nobody was left to raise it: %s", reported.error
            )
    except Exception as exc:
        log.error("closing a dropped Checkpointer failed: %s", exc)
    finally:
        if session.may_release():
            release(directory, hooks)
        else:  # interrupted twice while the writer writes: the kernel drops the lock at exit
            log.error(
                "%s stays locked until this process exits: a save is in flight", directory.path
            )
