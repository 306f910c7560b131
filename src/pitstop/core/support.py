# Which torch an optional feature needs, and what is said when the installed torch lacks it.
#
# Rules: pitstop declares torch>=2.4; single-process file checkpoints, load_weights / export,
# the CLI and multi-rank DDP work on every torch it declares. A feature that needs more names
# the torch APIs it uses and the first torch release that has all of them (read from torch's
# own releases). The shell detects those APIs on the installed torch (never by its version
# string); when any is missing, asking for the feature is one ConfigError naming the feature,
# what it was asked for by, the torch it needs, the installed torch and the missing APIs —
# raised before any of it is imported, never an ImportError from deep inside.
# How: TorchFeature records; torch_too_old builds the error from what the shell found missing.

"""What each optional feature needs from torch, and the error when it is missing."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from pitstop.errors import ConfigError

__all__ = ["SHARDED_STATE", "TorchFeature", "torch_too_old"]


@attrs.frozen(kw_only=True)
class TorchFeature:
    """An optional feature, the first torch release that has every API it uses, and those APIs."""

    name: str
    minimum: str
    apis: tuple[str, ...]


SHARDED_STATE = TorchFeature(
    name="sharded state (FSDP2, DTensor) through torch.distributed.checkpoint",
    minimum="2.9",
    apis=(
        "torch.distributed.tensor.DTensor",  # public since torch 2.5 (before: ._tensor)
        "torch.distributed.checkpoint.staging.DefaultStager",  # torch 2.9
        "torch.distributed.checkpoint.staging.StagingOptions",  # torch 2.9
        "torch.distributed.checkpoint.async_save(async_stager=...)",  # torch 2.9
    ),
)
"""Saving, resuming or reading a sharded checkpoint directory (synchronous or background)."""


def torch_too_old(
    feature: TorchFeature, *, asked_by: str, installed: str, missing: Sequence[str]
) -> ConfigError:
    """The error for ``asked_by`` needing ``feature`` on torch ``installed``, which lacks
    ``missing`` (a subset of ``feature.apis``)."""
    return ConfigError(
        f"{asked_by} needs {feature.name}, which needs torch {feature.minimum} or newer; "
        f"this is torch {installed}, which lacks {', '.join(missing)}"
    )
