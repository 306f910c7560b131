"""pitstop: checkpoint-and-resume for PyTorch training loops.

Importing ``pitstop`` does not import torch: the planning core and the records below are pure
Python, so the CLI starts fast and tools can inspect checkpoint directories without torch.
"""

from importlib.metadata import PackageNotFoundError, version

from pitstop.core.records import Best, Policy, Progress, SaveReason
from pitstop.core.targets import target_step
from pitstop.errors import (
    CheckpointCorrupt,
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

__all__ = [
    "Best",
    "CheckpointCorrupt",
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
    "target_step",
]
