# Capturing and restoring live training state: tensors by name, optimizers, RNG streams.
#
# Rules: capture references live memory (no copies: a synchronous save writes straight from the
# tensors); restore copies into the live objects, so tensors keep the device and dtype of the
# run (a CPU checkpoint restores into a CUDA model). RNG covers Python `random`, NumPy's global
# generator (when NumPy is installed), torch's CPU generator, and every CUDA device's generator
# when CUDA is initialized. Descriptions (names → dtype and shape) are what the core's
# compatibility checks compare.
# How: small functions over torch objects; no decisions are made here.

"""Live state: describe, capture and restore model weights, optimizers and RNG streams."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pitstop.core.compat import TensorSpec, flatten

try:
    import numpy
except ImportError:  # pragma: no cover - numpy is optional at run time
    numpy = None  # type: ignore[assignment]

__all__ = [
    "capture_rng",
    "describe",
    "entry_specs",
    "optimizer_groups",
    "restore_rng",
    "snapshot",
    "tensor_specs",
]


def tensor_specs(state: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Describe the tensors of a flat state dict: ``{name: TensorSpec}``."""
    return {
        name: TensorSpec(dtype=str(value.dtype).removeprefix("torch."), shape=tuple(value.shape))
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def entry_specs(state: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Describe every entry of a flat state dict, tensors or not.

    A non-tensor entry (a module's ``_extra_state``) is described by its Python type, so a
    key that one side lacks, or a value of another kind, shows as a difference.
    """
    return {
        name: TensorSpec(dtype=str(value.dtype).removeprefix("torch."), shape=tuple(value.shape))
        if isinstance(value, torch.Tensor)
        else TensorSpec(dtype=f"<{type(value).__name__}>", shape=())
        for name, value in state.items()
    }


def describe(tree: object) -> dict[str, TensorSpec]:
    """Describe every tensor in a nested tree by key path (``state.0.exp_avg``)."""
    return tensor_specs(
        {path: leaf for path, leaf in flatten(tree).items() if isinstance(leaf, torch.Tensor)}
    )


def optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """Name the parameters of each of ``optimizer``'s groups after ``model``'s parameters.

    A parameter the model does not own is named by its shape, so a mismatch still shows.
    """
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [
        [names.get(id(p), f"<not in the model: {list(p.shape)}>") for p in group["params"]]
        for group in optimizer.param_groups
    ]


def snapshot(obj: Any) -> Any:
    """A deep copy of ``obj.state_dict()``, to roll a failed restore back with."""
    return copy.deepcopy(obj.state_dict())


def capture_rng(*, cuda: bool = False) -> dict[str, Any]:
    """Return the state of every random number generator this process uses.

    The CUDA generators are in it once CUDA is initialized — or, with ``cuda``, whenever a GPU
    is available (before a restore sets them, so that undoing the restore puts them back).
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "keys": torch.from_numpy(numpy.asarray(keys).astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and (cuda or torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        state["cuda"] = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put every random number generator back to ``state`` (from :func:`capture_rng`)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].clone())
    stored = state.get("numpy")
    if numpy is not None and stored is not None:
        numpy.random.set_state(
            (
                stored["bit_generator"],
                stored["keys"].numpy().astype("uint32"),
                stored["pos"],
                stored["has_gauss"],
                stored["cached_gaussian"],
            )
        )
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for index, generator in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(generator.clone(), index)
