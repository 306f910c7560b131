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
# (not published; logged as a failed save). A remote tier's uploads are waited for when the
# directory is released; one that failed is raised by close() after it (logged either way). A
# rank that writes nothing still removes its object storage's local files (s3://) at close().
# How: the Checkpointer registers shut_down() with weakref.finalize; close_run() (its close())
# detaches it once the lock may go, and calls release() itself.

"""Lifetime: releasing a Checkpointer's directory and hooks, and finishing a dropped one."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pitstop.core.ranks import DirectoryGroups
from pitstop.core.session import SaveStatus, agreed_status
from pitstop.shell.session import SaveSession
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import RemoteStorage

if TYPE_CHECKING:
    from pitstop.shell.ranks.distributed import Ranks
    from pitstop.shell.saving import Saver
    from pitstop.shell.shardsave import ShardedSaves

__all__ = ["close_run", "on_writers", "release", "settle_on_writers", "shut_down"]

log = logging.getLogger("pitstop")


def on_writers(ranks: Ranks, groups: DirectoryGroups, work: Callable[[], Any]) -> None:
    """Run ``work`` on rank 0 (one directory) or on every directory's writer; its failure is
    raised on every rank."""
    if groups.shared:
        ranks.lead(work)
    else:
        ranks.each(lambda: work() if groups.writes(ranks.rank) else None)


def settle_on_writers(
    ranks: Ranks,
    groups: DirectoryGroups,
    settle: Callable[[], SaveStatus | None],
    then: Callable[[], Any] | None = None,
) -> tuple[SaveStatus | None, Any]:
    """How the save in flight ended, heard by every rank: rank 0's ``settle`` (one directory),
    or every directory's writer's, agreed (the core's agreed_status); a failure on any writer
    is raised on every rank. ``then``: rank 0's work once it settled, its result handed to
    every rank too — in the same round where the directory is shared (``None``: none)."""
    if groups.shared:
        return ranks.lead(lambda: (settle(), then() if then is not None else None))
    statuses = ranks.all_gather_each(lambda: settle() if groups.writes(ranks.rank) else None)
    after = ranks.lead(then) if then is not None else None
    return agreed_status([statuses[w] for w in groups.writers]), after


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


def close_run(
    *,
    finalizer: weakref.finalize,  # type: ignore[type-arg]
    session: SaveSession,
    directory: CheckpointDirectory,
    hooks: list[torch.utils.hooks.RemovableHandle],
    saver: Saver,
    shards: ShardedSaves | None,
    ranks: Ranks,
    groups: DirectoryGroups,
) -> None:
    """Every rank: a Checkpointer's close() — publish what is in flight, then (rank 0) close
    the session, remove the hooks and release the lock once no writer may still write, and
    raise a failed background save's error. An interrupt while a sharded save is settled
    leaves it in flight (and the lock held) for a later close(). After a collective failed
    (a rank gone), every rank closes on its own: no collective, and no second error that
    would hide the first. Ranks that share no directory: each directory's writer closes its
    own, as rank 0 does."""
    writes = groups.writes(ranks.rank)

    def close() -> None:
        try:
            reported = session.close()
        finally:
            if session.may_release():  # no writer may still write to the directory
                finalizer.detach()
                release(directory, hooks)  # a remote tier's uploads are waited for first
        saver.raise_failed(reported)
        saver.settle_uploads(block=False)  # and one that failed is raised

    interrupted = False
    try:
        if shards is not None:  # every rank: the sharded save in flight, published
            shards.settle(block=True)
    except BaseException as exc:
        # Interrupted, the sharded save stays in flight: only a later settle publishes it.
        interrupted = not isinstance(exc, Exception)
        raise
    finally:
        if not interrupted:
            try:
                if shards is not None:
                    shards.release()
                if ranks.failed is None:
                    on_writers(ranks, groups, close)
                elif writes:  # the ranks are out of step: each ends on its own
                    close()
            finally:
                if not writes:  # nothing written here, nothing to wait for
                    finalizer.detach()
                    for hook in hooks:
                        hook.remove()
                    hooks.clear()
                    if isinstance(directory.storage, RemoteStorage):  # its local files go
                        directory.storage.close()
