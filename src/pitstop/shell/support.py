# Whether the installed torch has what an optional feature needs (pitstop.core.support).
#
# Rules: detected by looking for the APIs themselves, never by torch's version string; a torch
# built without torch.distributed lacks them all. Asking for a feature the installed torch
# lacks is the core's ConfigError, raised before any of the feature's modules is imported.
# How: sharded_missing() imports DTensor's module and DCP's staging and saver (only when a
# sharded feature is asked for: importing DCP costs a tenth of a second or more).

"""Feature detection on the installed torch, for the features that need more than torch 2.4."""

from __future__ import annotations

import importlib
import inspect

import torch

from pitstop.core.support import SHARDED_STATE, torch_too_old

__all__ = ["require_sharded", "sharded_missing"]


def _attribute(module: str, name: str) -> object | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def sharded_missing() -> tuple[str, ...]:
    """The APIs of :data:`~pitstop.core.support.SHARDED_STATE` the installed torch lacks."""
    dtensor, stager, options, async_save = SHARDED_STATE.apis
    missing = []
    if _attribute("torch.distributed.tensor", "DTensor") is None:
        missing.append(dtensor)
    staging = "torch.distributed.checkpoint.staging"
    if _attribute(staging, "DefaultStager") is None:
        missing.append(stager)
    if _attribute(staging, "StagingOptions") is None:
        missing.append(options)
    saver = _attribute("torch.distributed.checkpoint.state_dict_saver", "async_save")
    if not callable(saver) or "async_stager" not in inspect.signature(saver).parameters:
        missing.append(async_save)
    return tuple(missing)


def require_sharded(asked_by: str) -> None:
    """Raise a ConfigError naming ``asked_by`` when the installed torch cannot save, resume or
    read sharded state (see :data:`~pitstop.core.support.SHARDED_STATE`)."""
    missing = sharded_missing()
    if missing:
        raise torch_too_old(
            SHARDED_STATE, asked_by=asked_by, installed=torch.__version__, missing=missing
        )
