"""Helpers for tests that put real checkpoints into real directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from pitstop.core.metadata import entry_meta
from pitstop.core.records import Progress
from pitstop.core.saving.plan import SavePlan, plan_save
from pitstop.core.saving.schedule import Call, ScheduleState, decide_save
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory


def state_at(step: int) -> dict[str, Any]:
    """A small training-state-like tree whose tensors depend on ``step``."""
    torch.manual_seed(step)
    weight = torch.randn(16, 8)
    return {
        "weights": {"raw": {"w": weight, "b": torch.randn(8)}, "tied": weight},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(16, 8)}}, "param_groups": [{"lr": 0.1}]},
        "step": step,
    }


def save(
    directory: CheckpointDirectory,
    step: int,
    *,
    call: Call = Call.MANUAL,
    metrics: dict[str, float] | None = None,
    stop: bool = False,
    tree: Any = None,
    meta: dict[str, Any] | None = None,
) -> SavePlan:
    """Save ``tree`` (default ``state_at(step)``) with extra ``meta`` into ``directory`` as the
    shell would, and return the plan."""
    progress = Progress(step=step)
    decision = decide_save(
        directory.policy,
        ScheduleState(timer_start=0.0),
        directory.pointers,
        call=call,
        progress=progress,
        now=0.0,
        metrics=metrics,
        stop=stop,
    )
    plan = plan_save(
        directory.catalog,
        directory.pointers,
        decision,
        progress=progress,
        policy=directory.policy,
        metrics=metrics,
    )
    prepared = fileformat.prepare(state_at(step) if tree is None else tree)
    directory.execute(
        plan,
        lambda file, entry, sync: fileformat.write(
            file, prepared, {**entry_meta(entry), **(meta or {})}, sync=sync
        ),
    )
    return plan


def snapshot(path: Path) -> dict[str, tuple[str, str]]:
    """Every entry of a directory (but the lock): symlink targets and file digests."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = path / name
        if name == ".lock":
            continue
        if full.is_symlink():
            out[name] = ("link", os.readlink(full))
        else:
            out[name] = ("file", hashlib.sha256(full.read_bytes()).hexdigest())
    return out
