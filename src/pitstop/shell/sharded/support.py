# Whether the installed torch has what an optional feature needs (pitstop.core.support), and
# whether a run's state is sharded.
#
# Rules: detected by looking for the APIs themselves, never by torch's version string; a torch
# built without torch.distributed lacks them all. Asking for a feature the installed torch
# lacks is the core's ConfigError, raised before any of the feature's modules is imported.
# A run's state is sharded when its model or an optimizer holds DTensors (is_sharded).
# How: sharded_missing() imports DTensor's module and DCP's staging and saver (only when a
# sharded feature is asked for: importing DCP costs a tenth of a second or more); is_sharded()
# imports nothing, it looks for DTensor's and FSDP2's classes among the modules imported.

"""Feature detection on the installed torch, and whether a run's state is sharded."""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys
from collections.abc import Mapping

import torch
from torch import nn

from pitstop.core.support import SHARDED_STATE, torch_too_old

__all__ = ["is_sharded", "require_sharded", "sharded_missing"]

_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
# DTensor's module: public from torch 2.5; torch 2.4 has only the private one (2.5 on keep it
# as an alias of the same class). An FSDP2 module imports it.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def is_sharded(model: nn.Module, components: Mapping[str, object] | None = None) -> bool:
    """Whether ``model`` (or an optimizer among ``components``) holds sharded state: an FSDP2
    module anywhere in the model, or any DTensor parameter or buffer. Imports nothing (torch's
    optimizers import DTensor's module, but DCP's import costs a tenth of a second or more)."""
    classes = (getattr(sys.modules.get(name), "DTensor", None) for name in _DTENSOR_MODULES)
    dtensor = next((c for c in classes if isinstance(c, type)), None)
    if dtensor is None:  # no DTensor exists, nor an FSDP2 module
        return False
    for name in _FSDP_MODULES:
        fsdp = getattr(sys.modules.get(name), "FSDPModule", None)
        if fsdp is not None and any(isinstance(module, fsdp) for module in model.modules()):
            return True
    if any(isinstance(t, dtensor) for t in itertools.chain(model.parameters(), model.buffers())):
        return True
    return any(
        isinstance(p, dtensor)
        for obj in (components or {}).values()
        if isinstance(obj, torch.optim.Optimizer)
        for group in obj.param_groups
        for p in group["params"]
    )


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
