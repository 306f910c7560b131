# Unwrapping live models: the module inside DDP / DataParallel / torch.compile / AveragedModel,
# and its state dict under plain names.
#
# Rules: a checkpoint stores the model unwrapped, so every path that reads or writes a model's
# state (capture, restore, load_weights, import, the trainer) first removes the wrappers around
# the whole model — repeatedly, in any nesting — and then the key prefixes they leave: every
# `_orig_mod.` segment (a compiled submodule), and a leading `module.` / `_orig_mod.` only while
# every key has it (a wrapper pitstop does not recognise). Two keys that would become one name
# are a ConfigError. Nothing is copied: the results share the model's tensors.
# How: isinstance checks against the wrapper classes (torch.compile's only if torch._dynamo is
# already imported: no model can be compiled otherwise, and importing it costs a second).

"""Unwrapping models: the module inside its wrappers, and its state dict under plain names."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

from pitstop.errors import ConfigError

__all__ = ["plain_names", "plain_state_dict", "unwrap_model"]

# Wrappers whose wrapped module is `.module`; torch.compile's OptimizedModule keeps `._orig_mod`.
_MODULE_WRAPPERS = (DistributedDataParallel, DataParallel, AveragedModel)
# State dict key prefixes those wrappers add.
_PREFIXES = ("module.", "_orig_mod.")
_COMPILED = "_orig_mod"


def _optimized_module() -> type[nn.Module] | None:
    # torch.compile's wrapper class. If torch._dynamo was never imported, no module can be one,
    # and importing it here would cost a second or more.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    kind = getattr(eval_frame, "OptimizedModule", None)
    return kind if isinstance(kind, type) else None


def unwrap_model(module: nn.Module) -> nn.Module:
    """Return the model inside any DDP, DataParallel, ``torch.compile`` and AveragedModel wrappers.

    Wrappers are removed repeatedly, in any nesting (``DDP(torch.compile(model))``,
    ``torch.compile(DDP(model))``, ...): ``.module`` of DistributedDataParallel, DataParallel
    and :class:`torch.optim.swa_utils.AveragedModel`, ``._orig_mod`` of torch.compile's
    ``OptimizedModule``. A module that is no wrapper is returned as it is. Nothing is copied:
    the result shares its parameters with ``module``.
    """
    compiled = _optimized_module()
    while True:
        if compiled is not None and isinstance(module, compiled):
            inner = module._orig_mod
        elif isinstance(module, _MODULE_WRAPPERS):
            inner = module.module
        else:
            return module
        if not isinstance(inner, nn.Module):  # pragma: no cover - a broken wrapper
            raise TypeError(f"{type(module).__qualname__} wraps a {type(inner).__qualname__}")
        module = inner


def _plain_name(key: str) -> str:
    """Return state dict key ``key`` without its ``_orig_mod`` segments.

    ``_orig_mod`` is the attribute torch.compile's wrapper keeps the compiled module in, so it
    appears where a submodule was compiled (``encoder._orig_mod.weight`` → ``encoder.weight``).
    """
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def plain_names(keys: list[str]) -> dict[str, str]:
    """Map each of a state dict's ``keys`` to its plain name (see :func:`plain_state_dict`)."""
    names = {key: _plain_name(key) for key in keys}
    # An unrecognised top-level wrapper whose only child is `.module` (or `._orig_mod`): every
    # key starts with the same prefix. Strip it while that holds.
    while names:
        prefix = next((p for p in _PREFIXES if all(n.startswith(p) for n in names.values())), None)
        if prefix is None:
            break
        names = {key: name[len(prefix) :] for key, name in names.items()}
    seen: dict[str, str] = {}
    for key, name in names.items():
        if name in seen:
            raise ConfigError(
                f"state dict keys {seen[name]!r} and {key!r} both become {name!r} once wrapper "
                f"prefixes are removed"
            )
        seen[name] = key
    return names


def plain_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Return ``unwrap_model(module).state_dict()`` as a plain dict, with wrapper prefixes removed.

    Exactly this is stripped from the keys, after :func:`unwrap_model` removed the wrappers
    around the whole model: every ``_orig_mod.`` segment (a submodule compiled with
    torch.compile: ``encoder._orig_mod.weight`` → ``encoder.weight``), then, while **every** key
    starts with ``module.`` or with ``_orig_mod.``, that leading prefix (a wrapper pitstop does
    not recognise). A ``module.`` that only some keys start with belongs to the model and is
    kept. Raises :class:`~pitstop.errors.ConfigError` if two keys would become the same name.
    The values are the state dict's own tensors, not copies.
    """
    state = unwrap_model(module).state_dict()
    names = plain_names(list(state))
    return {names[key]: value for key, value in state.items()}
