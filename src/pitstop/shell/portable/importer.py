# Checkpoints from elsewhere becoming pitstop checkpoints.
#
# Rules: three formats are recognised — a torch.save training checkpoint ({"model": ...,
# "optimizer": ..., "step"/"iter_num": ...}), a Lightning .ckpt (state_dict, optimizer_states,
# lr_schedulers, global_step, epoch) and an Accelerate save_state directory (model.safetensors
# or pytorch_model.bin, optimizer.bin, scheduler.bin, scaler.pt). Every file is read with
# torch.load(weights_only=True) (or, for .safetensors, a reader of that format's JSON header and
# raw bytes) and nothing else: a file that needs more is refused with a message saying why,
# never unpickled; Accelerate's *.pkl files (random states, custom objects) are pickles and are
# skipped with a note, never opened. The result is one checkpoint in pitstop's layout — weights
# (without module./_orig_mod. or a shared Lightning model. prefix), components by name
# (optimizer, scheduler, scaler, anything else with tensors), the progress the source recorded,
# and everything else that is plain data as the config — written into the destination
# directory as a manual save, under its lock, and only into a directory that holds no
# checkpoint yet (pitstop.core.guard: never over a run, so nothing of it is moved or deleted). The
# optimizers' parameter groups are recorded by position (their parameters were never named),
# which the resume check compares by size, as torch's load_state_dict matches them.
# How: read_foreign() (pitstop.shell.portable.foreign, re-exported here) parses the source into a
# Foreign record; write_foreign() plans the save with the core and publishes it through a
# CheckpointDirectory.

"""import_checkpoint: a torch.save, Lightning or Accelerate checkpoint as a pitstop one."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

from pitstop.core.guard import import_target_problem
from pitstop.core.records import NO_CHECKPOINT, Policy, SaveReason
from pitstop.core.saving.plan import plan_save
from pitstop.core.saving.schedule import Call, ScheduleState, decide_save
from pitstop.core.schema import EMA, RAW, RNG, STATE, WEIGHTS, WeightsMeta, encode_weights_meta
from pitstop.core.settings.arguments import check_path
from pitstop.errors import SaveError
from pitstop.shell.checkpoint import Checkpoint
from pitstop.shell.format import fileformat
from pitstop.shell.portable.foreign import Foreign, read_foreign
from pitstop.shell.portable.info import info
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.resolve import recorded_policy

__all__ = ["Foreign", "import_checkpoint", "read_foreign", "write_foreign"]

log = logging.getLogger("pitstop")


def _meta(foreign: Foreign) -> dict[str, Any]:
    from pitstop import __version__

    return {
        "pitstop": __version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "world_size": 1,
        "config": foreign.config,
        "components": sorted(foreign.components),
        "per_rank": [],
        "optimizers": foreign.groups,
        WEIGHTS: encode_weights_meta(WeightsMeta(ema=foreign.ema is not None)),
        "imported": {"from": str(foreign.source), "format": foreign.format},
    }


def write_foreign(foreign: Foreign, directory: str | os.PathLike[str]) -> Checkpoint:
    """Publish ``foreign`` into the checkpoint directory ``directory`` as a manual save.

    The directory is locked for the write and must hold no checkpoint: one that does (a run's)
    is refused with a :class:`~pitstop.errors.SaveError` naming it and its newest step, before
    anything is written or moved. Returns the new checkpoint's record (:func:`pitstop.info`).
    """
    target = Path(directory)
    policy = (recorded_policy(target) if target.is_dir() else None) or Policy(keep_last=None)
    weights: dict[str, Any] = {RAW: foreign.weights}
    if foreign.ema is not None:
        weights[EMA] = foreign.ema
    tree = {WEIGHTS: weights, STATE: foreign.components, RNG: {}}
    prepared = fileformat.prepare(tree)  # refuses what pitstop cannot store, before any write
    with CheckpointDirectory(target, policy=policy) as opened:
        newest = opened.catalog.newest()
        problem = import_target_problem(
            None if newest is NO_CHECKPOINT else (newest.step, newest.name),
            directory=str(target),
            count=len(opened.catalog),
        )
        if problem is not None:
            raise SaveError(problem)
        progress = foreign.progress
        decision = decide_save(
            policy,
            ScheduleState(timer_start=0.0),
            opened.pointers,
            call=Call.MANUAL,
            progress=progress,
            now=0.0,
            manual_reason=SaveReason.MANUAL,
        )
        plan = plan_save(
            opened.catalog,
            opened.pointers,
            decision,
            progress=progress,
            policy=policy,
            detail=f"imported from {foreign.format}",
        )
        entry = plan.entry
        assert entry is not NO_CHECKPOINT  # a manual save always writes
        opened.publish(plan, entry, lambda: prepared, _meta(foreign))
    return info(target / entry.name)


def import_checkpoint(src: str | os.PathLike[str], directory: str | os.PathLike[str]) -> Checkpoint:
    """Import a checkpoint written elsewhere into the pitstop checkpoint directory ``directory``.

    ``src`` is a ``torch.save`` training checkpoint (``{"model": ..., "optimizer": ...,
    "step"/"iter_num": ...}``; a bare state dict too), a Lightning ``.ckpt`` or an Accelerate
    ``save_state`` directory. Files are read with ``torch.load(weights_only=True)`` only: one
    that needs more is refused (:class:`~pitstop.errors.ImportRefused`, saying why) and never
    unpickled; Accelerate's ``*.pkl`` files
    are skipped. What was skipped or guessed is logged as a warning. ``directory`` must hold no
    checkpoint yet: a run's directory is refused (:class:`~pitstop.errors.SaveError`, naming
    it and its newest step) and left as it was. A ``Checkpointer`` on
    ``directory`` then resumes from it (``strict=False`` when the run has components the
    source did not hold, such as a sampler). Returns the new checkpoint's record. A ``src`` or
    ``directory`` that is no path (str or ``os.PathLike``) is a
    :class:`~pitstop.errors.ConfigError` naming it, before anything is read.
    """
    check_path(
        src,
        argument="import_checkpoint src",
        to="a torch.save or Lightning checkpoint file or an Accelerate save_state directory",
    )
    check_path(directory, argument="import_checkpoint directory", to="a checkpoint directory")
    foreign = read_foreign(src)
    for note in foreign.notes:
        log.warning("import: %s", note)
    return write_foreign(foreign, directory)
