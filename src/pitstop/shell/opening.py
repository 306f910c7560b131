# Opening a Checkpointer: its parts made and wired, its directory locked and read, and nothing
# left locked or hooked when any of it fails.
#
# Rules: the arguments are checked before anything is touched (pitstop.shell.checkpoint); then
# the live state is gathered, the ranks found, and every rank opens the directory on its writer
# (pitstop.shell.nodes). From that lock on, whatever fails releases the directory and removes
# the hooks made so far before it is raised. With async_save="overlap", each optimizer gets a
# step pre-hook that finishes the copy before the step changes the tensors. A Checkpointer
# dropped or left open at exit still publishes what is in flight: its finalizer
# (pitstop.shell.lifetime.shut_down) refers to the session, the directory and the hooks — never
# to the Checkpointer.
# How: open_parts makes the parts in that order and hands them back as one record; the
# Checkpointer keeps them.

"""Opening a Checkpointer: its live state, ranks, directory, session, saver and save calls."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from pitstop.core.ranks import DirectoryGroups
from pitstop.core.records import Policy
from pitstop.core.saving.schedule import ScheduleState
from pitstop.core.settings.arguments import CheckpointerOptions
from pitstop.shell.checkpoint import config_of
from pitstop.shell.lifetime import release, shut_down
from pitstop.shell.nodes import open_directories
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.registration import add_component
from pitstop.shell.savecall import SaveCalls
from pitstop.shell.saving import Saver
from pitstop.shell.session import SaveSession
from pitstop.shell.sharded.support import require_sharded
from pitstop.shell.shardsave import ShardedSaves, holds_sharded
from pitstop.shell.state.capture import LiveState
from pitstop.shell.state.staging import StagingPool
from pitstop.shell.state.unwrap import unwrap_model
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.location import checkpoint_directory
from pitstop.shell.store.storage import Storage

__all__ = ["Parts", "hook_optimizer", "open_parts"]


@attrs.frozen
class Parts:
    """What an open Checkpointer is made of (:func:`open_parts`)."""

    live: LiveState
    ranks: Ranks
    directory: CheckpointDirectory
    hooks: list[torch.utils.hooks.RemovableHandle]
    groups: DirectoryGroups
    session: SaveSession
    saver: Saver
    shards: ShardedSaves | None
    """The sharded saves (``None``: the state is not sharded)."""
    calls: SaveCalls
    finalizer: weakref.finalize[Any, Any]
    """Publishes what is in flight when the owner is dropped without close()."""


def hook_optimizer(
    obj: object,
    hooks: list[torch.utils.hooks.RemovableHandle],
    session: SaveSession,
    shards: ShardedSaves | None,
    *,
    overlap: bool,
) -> None:
    """With ``overlap`` (async_save="overlap"), hook optimizer ``obj``'s step so that the copy
    in flight (the session's, or the sharded save's) ends before the step; the hook joins
    ``hooks``."""
    if overlap and isinstance(obj, torch.optim.Optimizer):
        hook = session.step_hook if shards is None else shards.step_hook
        hooks.append(obj.register_step_pre_hook(hook))


def open_parts(
    owner: object,
    directory: str | os.PathLike[str],
    options: CheckpointerOptions,
    *,
    model: nn.Module,
    ema: nn.Module | None,
    state: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    storage: Storage | None,
    storage_options: Mapping[str, Any] | None,
    remote: str | None,
    remote_policy: Policy | None,
) -> Parts:
    """Every rank: make ``owner``'s (a Checkpointer's) parts from its checked ``options`` and
    its arguments, its directory locked and read on each writer. Whatever fails after the lock
    releases the directory and removes the hooks made before it is raised."""
    live = LiveState(
        model=unwrap_model(model),
        ema=ema,
        components={},
        config=config_of(config),
        per_rank=set(options.per_rank),
    )
    for name, obj in (state or {}).items():
        add_component(live, name, obj)
    sharded = holds_sharded(live)
    if sharded:
        require_sharded("a Checkpointer whose model or optimizer holds DTensors")
    ranks = Ranks.current(options.timeout_s)
    tier = (remote, remote_policy)  # a remote tier (s3://), and its retention
    opened = checkpoint_directory(
        directory, options.policy, storage, storage_options, not options.overwrite, tier
    )
    hooks: list[torch.utils.hooks.RemovableHandle] = []
    ranks.call(f"Checkpointer({str(directory)!r})")
    groups = open_directories(ranks, opened, sharded=sharded)  # each writer locks and reads it
    try:
        schedule = ScheduleState(timer_start=time.monotonic())
        background = bool(options.async_save) and groups.writes(ranks.rank)
        session = SaveSession(opened.path, background=background)
        saver = Saver(
            schedule=schedule,
            live=live,
            directory=opened,
            session=session,
            pool=StagingPool() if background else None,
            sharded=sharded,
        )
        shards = ShardedSaves.of(
            saver, ranks, background=options.async_save, timeout_s=options.timeout_s
        )
        calls = SaveCalls(saver=saver, ranks=ranks, shards=shards, live=live, groups=groups)
        for obj in live.optimizers():
            hook_optimizer(obj, hooks, session, shards, overlap=options.async_save == "overlap")
        # A Checkpointer dropped or left open at exit still publishes what is in flight. The
        # finalizer refers to the session, the directory and the hooks — never to the owner.
        abandon = shards.abandon if shards is not None else None
        finalizer = weakref.finalize(owner, shut_down, session, opened, hooks, abandon)
    except BaseException:  # whatever failed, nothing stays locked or hooked
        release(opened, hooks)
        raise
    return Parts(
        live=live,
        ranks=ranks,
        directory=opened,
        hooks=hooks,
        groups=groups,
        session=session,
        saver=saver,
        shards=shards,
        calls=calls,
        finalizer=finalizer,
    )
