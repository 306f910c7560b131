# The pure planning core.
#
# Rules: no torch, os, pathlib, time, threading, signal or pitstop.shell here (a test enforces
# it). Every input — the clock, a directory's contents, metrics — arrives as an argument; every
# decision leaves as a frozen value for the shell to carry out. Rooms, one job each, each using
# only the shared records here (records, naming, validators, ...) and the rooms before it:
# `file` (the checkpoint file's framing, layout, manifest), `sharding` (DCP directories, their
# cover across nodes), `s3` (object keys, commits, leases, client settings), `saving` (schedule,
# targets, plans, retention, pointers) and `settings` (the configuration and the arguments).

"""pitstop's pure planning core: every decision, as functions over frozen records."""

from pitstop.core.file.layout import Layout, Span, TensorExtent, layout_tensors
from pitstop.core.naming import EntryKind, checkpoint_name, classify, parse_name, temp_name
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    KeepReason,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.saving.plan import SavePlan, plan_save
from pitstop.core.saving.pointers import reconcile_pointers, resume_order
from pitstop.core.saving.retention import RetentionPlan, plan_retention
from pitstop.core.saving.schedule import Call, SaveDecision, ScheduleState, decide_save
from pitstop.core.saving.targets import RunTarget, new_updates, plan_run, target_epoch, target_step
from pitstop.core.settings.config import (
    CheckpointConfig,
    parse_checkpoint_config,
    resolve_directory,
)

__all__ = [
    "NO_CHECKPOINT",
    "Best",
    "Call",
    "Catalog",
    "CheckpointConfig",
    "CheckpointEntry",
    "EntryKind",
    "KeepReason",
    "Layout",
    "NoCheckpoint",
    "PointerName",
    "Pointers",
    "Policy",
    "Progress",
    "RetentionPlan",
    "RunTarget",
    "SaveDecision",
    "SavePlan",
    "SaveReason",
    "ScheduleState",
    "Span",
    "TensorExtent",
    "checkpoint_name",
    "classify",
    "decide_save",
    "layout_tensors",
    "new_updates",
    "parse_checkpoint_config",
    "parse_name",
    "plan_retention",
    "plan_run",
    "plan_save",
    "reconcile_pointers",
    "resolve_directory",
    "resume_order",
    "target_epoch",
    "target_step",
    "temp_name",
]
