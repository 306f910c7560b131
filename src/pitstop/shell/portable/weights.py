# Loading a checkpoint's raw or EMA weights into a model, and the weights API in one place.
#
# Rules: `weights` selects the parameter set ("raw" or "ema"), the checkpoint argument (file,
# pointer, directory) the training position (pitstop.shell.portable.weightview reads it). Loading
# is all-or-nothing: names, shapes and dtypes are compared (pitstop.core.compat) and every
# difference is reported before any tensor of the model is touched; strict=False lets missing
# and unexpected names through and returns them (shapes and dtypes must still match). Values
# are copied into the model's own tensors, or, with map_location, the model takes the
# checkpoint's tensors placed on that device (one transfer from the file's memory map, no
# second copy; a model built on the meta device loads this way) — a device this process has:
# "meta" (no data) and a device it lacks are refused first, naming map_location (the rule is
# pitstop.core.settings.arguments.device_problem). A sharded model (FSDP2, DTensor) is refused
# first, saying what to do instead (resume through a Checkpointer; load before sharding). The other
# pieces, each with one reason to change, and re-exported here:
#   pitstop.shell.state.unwrap          unwrap_model, plain_state_dict: wrappers, key prefixes
#   pitstop.shell.portable.weightview   weights_view: a parameter set, only its bytes read
#   pitstop.shell.portable.exporter     export_weights: the set as a plain .pt / .safetensors
# How: the core compares; torch copies (or assigns, with map_location).

"""Load a checkpoint's raw or EMA weights into a model, or export them as a plain state dict."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from pitstop.core.compat import Kind, diff_tensors
from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path, device_problem
from pitstop.errors import ConfigError, IncompatibleCheckpoint
from pitstop.shell.portable.exporter import export_weights
from pitstop.shell.portable.weightview import Weights, check_weights, read_view, weights_view
from pitstop.shell.sharded.support import is_sharded
from pitstop.shell.state.live import tensor_specs
from pitstop.shell.state.unwrap import plain_names, plain_state_dict, unwrap_model
from pitstop.shell.store.resolve import read_resolved

__all__ = [
    "IncompatibleKeys",
    "Weights",
    "export_weights",
    "load_weights",
    "plain_state_dict",
    "unwrap_model",
    "weights_view",
]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_weights` left out, like ``nn.Module.load_state_dict``'s result.

    ``missing_keys``: in the model, not in the checkpoint (they keep their values);
    ``unexpected_keys``: in the checkpoint, not in the model (not loaded). Plain names, without
    wrapper prefixes. Both are empty after a ``strict=True`` load.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _map_location(map_location: str | torch.device | None) -> torch.device | None:
    if map_location is None:
        return None
    device = None
    if isinstance(map_location, (str, torch.device)):
        with contextlib.suppress(RuntimeError, ValueError):
            device = torch.device(map_location)
    if device is None:
        raise ConfigError(
            f"load_weights map_location must be a device such as 'cpu', 'cuda' or "
            f"torch.device('cuda', 0), got {map_location!r}"
        )
    problem = device_problem(
        "load_weights map_location",
        str(map_location),
        kind=device.type,
        index=device.index,
        count=_device_count(device.type),
    )
    if problem is not None:
        raise ConfigError(problem)
    return device


def _device_count(kind: str) -> int:
    """How many devices of type ``kind`` this process can place tensors on (0: none)."""
    if kind in ("cpu", "meta"):
        return 1
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = getattr(torch, kind, None)
    try:
        if backend is not None and callable(getattr(backend, "device_count", None)):
            available = getattr(backend, "is_available", lambda: True)
            return int(backend.device_count()) if available() else 0
        torch.empty(0, device=kind)  # a backend without a count: try it
    except Exception:  # not built in, no driver, ...: nothing to place tensors on
        return 0
    return 1


def _check_arguments(model: object, checkpoint: object) -> None:
    """Raise a ConfigError naming ``model`` or ``checkpoint`` when it is not what it must be."""
    if isinstance(model, (str, os.PathLike)) and isinstance(checkpoint, nn.Module):
        raise ConfigError(
            "load_weights takes the model first and the checkpoint second: "
            "load_weights(model, checkpoint)"
        )
    if not isinstance(model, nn.Module):
        hint = " (a state dict? pass the module it belongs to)" if isinstance(model, dict) else ""
        raise ConfigError(
            f"load_weights model must be an nn.Module{hint}, got {type(model).__qualname__}"
        )
    check_path(checkpoint, argument="load_weights checkpoint", to=CHECKPOINT_PATH)


def load_weights(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    weights: Weights = "raw",
    strict: bool = True,
    map_location: str | torch.device | None = None,
) -> IncompatibleKeys:
    """Load the parameter set ``weights`` of ``checkpoint`` into ``model``.

    Pass the plain model, unwrapped and uncompiled; no optimizer or data is needed. A wrapped
    model (DDP, DataParallel, ``torch.compile``, AveragedModel) is unwrapped first with
    :func:`unwrap_model`, and compiled submodules are matched by their plain names, so loading
    into a wrapped model loads into the model inside it. ``checkpoint`` is a file, a pointer
    (``run/checkpoints/best``) or a directory (its ``last``): it selects the training position;
    ``weights`` (``"raw"`` or ``"ema"``) selects the parameter set at that position.

    All or nothing: names, shapes and dtypes are compared with the model's state dict first,
    and :class:`~pitstop.errors.IncompatibleCheckpoint` lists every difference (missing,
    unexpected, shape, dtype) before any tensor of the model is touched. ``strict=False``
    loads what the two share and returns the names that are missing from the checkpoint or
    unexpected in it (fine-tuning with a new head); shapes and dtypes must still match.

    ``map_location=None``: values are copied into the model's own tensors, which keep their
    identity and device. ``map_location="cuda"`` (any device): the model's parameters and
    buffers become the checkpoint's tensors on that device, moved straight from the file's
    memory map — no second copy on the host, and the only way to load a model built on the
    ``meta`` device. On ``"cpu"`` they are the memory-mapped tensors themselves (copy-on-write:
    writing to them never changes the file). Tied parameters stay tied.

    A sharded model (FSDP2, DTensor parameters) is refused with
    :class:`~pitstop.errors.ConfigError`: resume it through a Checkpointer, or load into the
    model before it is sharded.

    Returns the missing and unexpected keys (both empty under ``strict=True``).
    """
    _check_arguments(model, checkpoint)
    kind = check_weights(weights)
    if not isinstance(strict, bool):
        raise ConfigError(f"load_weights strict must be a bool, got {strict!r}")
    device = _map_location(map_location)
    target = unwrap_model(model)
    if is_sharded(target):
        raise ConfigError(
            "load_weights: the model is sharded (FSDP2, DTensor parameters), and load_weights "
            "loads only into an unsharded model. To continue a run, resume it through a "
            "Checkpointer built with this model (Checkpointer(directory, model=model, "
            "...).resume()), which loads each rank's shards; to load the weights, build the "
            "model without fully_shard, load_weights into it, then shard it"
        )
    live = target.state_dict(keep_vars=True)
    names = plain_names(list(live))
    path, view = read_resolved(checkpoint, lambda found: read_view(found, kind), fallback=True)
    plain_live = {names[key]: value for key, value in live.items()}
    where = f"{path} weights.{kind}"
    found = diff_tensors(where, tensor_specs(view), tensor_specs(plain_live))
    extra = [name for name, value in plain_live.items() if not isinstance(value, torch.Tensor)]
    differences = [str(d) for d in found if strict or d.kind not in _LENIENT]
    if strict:
        differences += [
            f"{where}: {name!r} in the model is a {type(plain_live[name]).__qualname__} (extra "
            f"state), which load_weights does not load"
            for name in extra
        ]
    if differences:
        raise IncompatibleCheckpoint(differences)
    if device is None:
        meta = [key for key, value in live.items() if _on_meta(value) and names[key] in view]
        if meta:
            raise ConfigError(
                f"load_weights: the model's {meta[0]!r}"
                + (f" and {len(meta) - 1} more" if len(meta) > 1 else "")
                + " are on the meta device and cannot be copied into; pass map_location= "
                "(e.g. 'cuda' or 'cpu') to load the checkpoint's tensors in their place"
            )
    keys = [key for key in live if isinstance(live[key], torch.Tensor) and names[key] in view]
    loaded = (
        {key: view[names[key]] for key in keys}
        if device is None
        else _placed(live, keys, {key: view[names[key]] for key in keys}, device)
    )
    target.load_state_dict(loaded, strict=False, assign=device is not None)
    plain_keys = {names[key] for key in keys}
    return IncompatibleKeys(
        missing_keys=[name for name in plain_live if name not in plain_keys],
        unexpected_keys=[name for name in view if name not in plain_live],
    )


# Differences strict=False lets through (and returns): names on one side only.
_LENIENT = frozenset({Kind.MISSING, Kind.UNEXPECTED})


def _on_meta(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _placed(
    live: Mapping[str, object],
    keys: list[str],
    stored: Mapping[str, torch.Tensor],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The stored tensors on ``device``, as the values the model takes (assign=True).

    One transfer per tensor, straight from the memory map; ``.to()`` returns the mapped tensor
    itself on the CPU. Keys that share one tensor in the live model (tied parameters) get one
    object, a Parameter where the live one is, so they stay tied after the assignment.
    """
    out: dict[str, torch.Tensor] = {}
    by_identity: dict[int, torch.Tensor] = {}
    for key in keys:
        now = live[key]
        assert isinstance(now, torch.Tensor)
        shared = by_identity.get(id(now))
        if shared is not None:
            out[key] = shared
            continue
        value = stored[key].to(device)
        if isinstance(now, nn.Parameter):
            value = nn.Parameter(value, requires_grad=now.requires_grad)
        by_identity[id(now)] = out[key] = value
    return out
