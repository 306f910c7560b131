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
from pitstop.core.targets import target_step
from pitstop.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    ConfigError,
    DirectoryLocked,
    IncompatibleCheckpoint,
    InvalidValue,
    PitstopError,
    SaveError,
)

try:
    __version__ = version("pitstop")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from pitstop.shell.resolve import load, verify

# Public names that need torch, and the module each comes from.
_LAZY = {"load": "pitstop.shell.resolve", "verify": "pitstop.shell.resolve"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pitstop' has no attribute {name!r}")


__all__ = [
    "Best",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "ConfigError",
    "DirectoryLocked",
    "IncompatibleCheckpoint",
    "InvalidValue",
    "PitstopError",
    "Policy",
    "Progress",
    "SaveError",
    "SaveReason",
    "__version__",
    "load",
    "target_step",
    "verify",
]
