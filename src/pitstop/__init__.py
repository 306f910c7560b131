"""pitstop: checkpoint-and-resume for PyTorch training loops.

Importing ``pitstop`` does not import torch: the planning core and the records below are pure
Python, and the names that need torch (``load``, ``verify``) are imported on first use, so the
CLI starts fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from pitstop.core.records import Best, Policy, Progress, SaveReason
from pitstop.core.saving.targets import target_step
from pitstop.core.session import SaveStatus
from pitstop.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CollectiveError,
    ConfigError,
    DirectoryLocked,
    ImportRefused,
    IncompatibleCheckpoint,
    InvalidValue,
    PitstopError,
    ResumeWarning,
    SaveError,
)

try:
    __version__ = version("pitstop")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from pitstop.shell.checkpoint import Checkpoint
    from pitstop.shell.data.workerrng import WorkerRNG
    from pitstop.shell.manager import Checkpointer
    from pitstop.shell.portable.importer import import_checkpoint
    from pitstop.shell.portable.info import info
    from pitstop.shell.portable.loading import load
    from pitstop.shell.portable.weights import export_weights, load_weights
    from pitstop.shell.sampler import ResumableSampler
    from pitstop.shell.stop import StopRequest
    from pitstop.shell.store.resolve import verify

# Public names that need torch, and the module each comes from.
_LAZY = {
    "Checkpoint": "pitstop.shell.checkpoint",
    "Checkpointer": "pitstop.shell.manager",
    "ResumableSampler": "pitstop.shell.sampler",
    "StopRequest": "pitstop.shell.stop",
    "WorkerRNG": "pitstop.shell.data.workerrng",
    "export_weights": "pitstop.shell.portable.weights",
    "import_checkpoint": "pitstop.shell.portable.importer",
    "info": "pitstop.shell.portable.info",
    "load": "pitstop.shell.portable.loading",
    "load_weights": "pitstop.shell.portable.weights",
    "verify": "pitstop.shell.store.resolve",
}


def __getattr__(name: str) -> Any:
    if name == "train":  # the reference trainer's package (imports torch only when used)
        return importlib.import_module("pitstop.train")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pitstop' has no attribute {name!r}")


__all__ = [
    "Best",
    "Checkpoint",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "Checkpointer",
    "CollectiveError",
    "ConfigError",
    "DirectoryLocked",
    "ImportRefused",
    "IncompatibleCheckpoint",
    "InvalidValue",
    "PitstopError",
    "Policy",
    "Progress",
    "ResumableSampler",
    "ResumeWarning",
    "SaveError",
    "SaveReason",
    "SaveStatus",
    "StopRequest",
    "WorkerRNG",
    "__version__",
    "export_weights",
    "import_checkpoint",
    "info",
    "load",
    "load_weights",
    "target_step",
    "verify",
]
