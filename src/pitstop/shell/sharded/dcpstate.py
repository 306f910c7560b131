# What a sharded checkpoint saves through torch.distributed.checkpoint (DCP), and how it is put
# back: the model, its EMA and its optimizers, under fixed top-level keys.
#
# Rules: the model's state (get_model_state_dict) under `model`; each optimizer's
# (get_optimizer_state_dict, keyed by parameter names) under its component name; an EMA's
# weights under `ema` — the module inside its wrappers (an AveragedModel's `.module`), so its
# names are the model's — and an AveragedModel's update count under `ema_count`. Every one of
# them is a view of the live tensors (a DTensor's local shard), so DCP reads into them in place;
# an EMA that is not sharded is saved through DCP too (DCP writes a replicated tensor once). A
# component name that is not a plain key, or that is one of these, is a ConfigError.
# How: plain functions over torch's state_dict helpers.

"""The state dict a sharded checkpoint saves through DCP: model, EMA, optimizers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.swa_utils import AveragedModel

from pitstop.errors import ConfigError
from pitstop.shell.state.unwrap import unwrap_model

__all__ = ["EMA", "EMA_COUNT", "MODEL", "Optimizers", "apply_state", "dcp_state", "local_shard"]

MODEL: Final = "model"
"""The top-level key the model's state is saved under (optimizers go under their own names)."""

EMA: Final = "ema"
"""The top-level key of the EMA's weights (the module inside its wrappers)."""

EMA_COUNT: Final = "ema_count"
"""The top-level key of an ``AveragedModel``'s ``n_averaged``."""

Optimizers = Mapping[str, torch.optim.Optimizer]


def local_shard(value: torch.Tensor) -> torch.Tensor:
    """The tensor DCP reads into or writes from for ``value``: a DTensor's local shard (its
    storage), or ``value`` itself."""
    to_local = getattr(value, "to_local", None)
    return value if to_local is None else to_local()


def dcp_state(
    model: nn.Module, optimizers: Optimizers, ema: nn.Module | None = None
) -> dict[str, Any]:
    """What DCP saves or fills: the model's state under ``model``, each optimizer's under its
    name (keyed by parameter names, as ``get_optimizer_state_dict`` makes them) and, with an
    ``ema``, its weights under ``ema`` (and an AveragedModel's count under ``ema_count``)."""
    for name in optimizers:
        if name in (MODEL, EMA, EMA_COUNT) or not name or "." in name:
            raise ConfigError(
                f"sharded component {name!r}: a name without '.', not {MODEL!r}, {EMA!r} or "
                f"{EMA_COUNT!r}"
            )
    state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
    if ema is not None:
        state[EMA] = get_model_state_dict(unwrap_model(ema))
        if isinstance(ema, AveragedModel):
            state[EMA_COUNT] = {"n_averaged": ema.n_averaged}
    for name, optimizer in optimizers.items():
        state[name] = get_optimizer_state_dict(model, optimizer)
    return state


def apply_state(
    model: nn.Module,
    optimizers: Optimizers,
    ema: nn.Module | None,
    state: Mapping[str, Any],
    fresh: tuple[str, ...],
) -> None:
    """Load what DCP read into ``state`` (made by :func:`dcp_state`); the optimizers named in
    ``fresh`` had no state when it was saved and get none. An AveragedModel's count is
    copied in (read in place, it is copied onto itself)."""
    set_model_state_dict(model, state[MODEL])
    if ema is not None:
        set_model_state_dict(unwrap_model(ema), state[EMA])
        if isinstance(ema, AveragedModel) and EMA_COUNT in state:
            with torch.no_grad():
                ema.n_averaged.copy_(state[EMA_COUNT]["n_averaged"])
    for name, optimizer in optimizers.items():
        set_optimizer_state_dict(model, optimizer, state[name])
        if name in fresh:
            optimizer.state.clear()
