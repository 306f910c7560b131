# Checkpoints from elsewhere, parsed: what a torch.save, Lightning or Accelerate checkpoint
# holds, as the record a pitstop checkpoint is written from.
#
# Rules: three formats are recognised — a torch.save training checkpoint ({"model": ...,
# "optimizer": ..., "step"/"iter_num": ...}; a bare state dict too), a Lightning .ckpt
# (state_dict, optimizer_states, lr_schedulers, global_step, epoch) and an Accelerate save_state
# directory (model.safetensors or pytorch_model.bin, optimizer.bin, scheduler.bin, scaler.pt).
# Every file is read by pitstop.shell.portable.foreignread (nothing is unpickled); Accelerate's
# *.pkl files (random states, custom objects) are pickles and are skipped with a note, never opened.
# What is kept: the weights (without module./_orig_mod. or a shared Lightning model. prefix),
# components by name (optimizer, scheduler, scaler, anything else with tensors), the progress the
# source recorded, and everything else that is plain data as the config. The optimizers' parameter
# groups are recorded by position (their parameters were never named), which the resume check
# compares by size, as torch's load_state_dict matches them. What was skipped or guessed becomes a
# note, one line each.
# How: read_foreign() tells the formats apart and parses each into a Foreign record.

"""read_foreign: a torch.save, Lightning or Accelerate checkpoint, parsed into a record."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from pitstop.core.records import Progress
from pitstop.errors import CheckpointNotFound, ImportRefused
from pitstop.shell.portable.foreignread import read_safetensors, torch_load
from pitstop.shell.state.unwrap import plain_names

__all__ = ["ACCELERATE", "LIGHTNING", "TORCH_SAVE", "Foreign", "read_foreign"]

TORCH_SAVE: Final = "torch.save"
LIGHTNING: Final = "lightning"
ACCELERATE: Final = "accelerate"

# Keys of a torch.save training checkpoint, most common spelling first.
_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "net")
_EMA_KEYS = ("ema", "model_ema", "ema_model", "ema_state_dict")
_COMPONENT_KEYS = {
    "optimizer": ("optimizer", "optimizer_state_dict", "optim", "opt"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict"),
}
_STEP_KEYS = ("step", "iter_num", "global_step", "iteration", "iter", "steps")
_COUNTER_KEYS = {"epoch": ("epoch",), "samples": ("samples",), "tokens": ("tokens",)}
_LIGHTNING_MARKERS = ("pytorch-lightning_version", "optimizer_states", "lr_schedulers", "loops")


@attrs.frozen(kw_only=True)
class Foreign:
    """A checkpoint from elsewhere, parsed: what becomes the pitstop checkpoint.

    ``weights``/``ema``: state dicts with plain names; ``components``: stored states by name;
    ``groups``: each optimizer's parameter groups by position; ``notes``: what was skipped or
    guessed, one line each.
    """

    source: Path
    format: str
    progress: Progress
    weights: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None = None
    components: dict[str, Any] = attrs.Factory(dict)
    groups: dict[str, list[list[int]]] = attrs.Factory(dict)
    config: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


def _state_dict(value: object, what: str) -> dict[str, torch.Tensor]:
    """``value`` as a plain-named state dict; refused unless it maps names to tensors."""
    if not isinstance(value, Mapping) or not value:
        raise ImportRefused(f"{what} is not a state dict (a mapping of names to tensors)")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ImportRefused(
            f"{what} is not a state dict: {bad[0]!r} is not a name mapped to a tensor"
        )
    names = plain_names(list(value))
    return {names[key]: tensor for key, tensor in value.items()}


def _groups(state: object, what: str) -> list[list[int]]:
    """An optimizer state dict's parameter groups, by position; refused when it is none."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping)
        and isinstance(g.get("params"), list)
        and all(type(p) is int for p in g["params"])
        for g in groups
    ):
        raise ImportRefused(f"{what} is not an optimizer state dict (no param_groups of ids)")
    return [list(group["params"]) for group in groups]


def _counter(data: Mapping[str, Any], keys: tuple[str, ...], what: str) -> tuple[int, str | None]:
    for key in keys:
        if key in data:
            value = data[key]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if type(value) is not int or value < 0:
                raise ImportRefused(f"{what}[{key!r}] must be an int >= 0, got {value!r}")
            return value, key
    return 0, None


def _plain(value: object) -> bool:
    """Whether ``value`` is plain data (no tensors, no objects): a config value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _scalar(value: object) -> object:
    """A one-element tensor as a Python number (a best_val_loss kept as a tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        return value.item()
    return value


def _progress(data: Mapping[str, Any], what: str, notes: list[str]) -> Progress:
    step, step_key = _counter(data, _STEP_KEYS, what)
    counters = {name: _counter(data, keys, what)[0] for name, keys in _COUNTER_KEYS.items()}
    if step_key is None:
        notes.append(f"{what} records no step ({', '.join(_STEP_KEYS)}): imported as step 0")
    return Progress(step=step, **counters)


def _from_torch_save(path: Path, data: Mapping[str, Any]) -> Foreign:
    what = str(path)
    notes: list[str] = []
    if all(isinstance(v, torch.Tensor) for v in data.values()):  # a bare state dict
        notes.append(f"{what} is a bare state dict: imported as model weights at step 0")
        return Foreign(
            source=path,
            format=TORCH_SAVE,
            progress=Progress(),
            weights=_state_dict(data, what),
            notes=tuple(notes),
        )
    model_key = next((k for k in _MODEL_KEYS if k in data), None)
    if model_key is None:
        raise ImportRefused(
            f"{what} is not a training checkpoint pitstop imports: no model state dict under "
            f"{', '.join(repr(k) for k in _MODEL_KEYS)} (it holds {sorted(map(str, data))})"
        )
    used = {model_key}
    weights = _state_dict(data[model_key], f"{what}[{model_key!r}]")
    ema = None
    ema_key = next((k for k in _EMA_KEYS if k in data), None)
    if ema_key is not None:
        ema = _state_dict(data[ema_key], f"{what}[{ema_key!r}]")
        used.add(ema_key)
    components: dict[str, Any] = {}
    groups: dict[str, list[list[int]]] = {}
    for name, keys in _COMPONENT_KEYS.items():
        key = next((k for k in keys if k in data and data[k] is not None), None)
        if key is None:
            continue
        used.add(key)
        components[name] = data[key]
        if name == "optimizer":
            groups[name] = _groups(data[key], f"{what}[{key!r}]")
    progress = _progress(data, what, notes)
    used |= {*_STEP_KEYS, *(k for keys in _COUNTER_KEYS.values() for k in keys)}
    config: dict[str, Any] = {}
    for key, value in data.items():
        if key in used:
            continue
        value = _scalar(value)
        if _plain(value):
            config[str(key)] = value
        else:
            components[str(key)] = value
            notes.append(f"{what}[{key!r}] holds tensors or objects: kept as component {key!r}")
    return Foreign(
        source=path,
        format=TORCH_SAVE,
        progress=progress,
        weights=weights,
        ema=ema,
        components=components,
        groups=groups,
        config=config or None,
        notes=tuple(notes),
    )


def _from_lightning(path: Path, data: Mapping[str, Any]) -> Foreign:
    what = str(path)
    notes: list[str] = []
    state = data.get("state_dict")
    if not isinstance(state, Mapping):
        raise ImportRefused(f"{what} is a Lightning checkpoint without a state_dict")
    keys = [k for k in state if isinstance(k, str)]
    if keys and len(keys) == len(state) and all(k.startswith("model.") for k in keys):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    weights = _state_dict(state, f"{what}['state_dict']")
    components: dict[str, Any] = {}
    groups: dict[str, list[list[int]]] = {}
    for index, optimizer in enumerate(data.get("optimizer_states") or []):
        name = "optimizer" if index == 0 else f"optimizer_{index}"
        components[name] = optimizer
        groups[name] = _groups(optimizer, f"{what}['optimizer_states'][{index}]")
    for index, scheduler in enumerate(data.get("lr_schedulers") or []):
        components["scheduler" if index == 0 else f"scheduler_{index}"] = scheduler
    for key in ("native_amp_scaling_state", "MixedPrecision"):
        if isinstance(data.get(key), Mapping) and data[key]:
            components["scaler"] = data[key]
            break
    step, _ = _counter(data, ("global_step",), what)
    epoch, _ = _counter(data, ("epoch",), what)
    hyper = data.get("hyper_parameters")
    config = dict(hyper) if isinstance(hyper, Mapping) and _plain(hyper) else None
    if hyper is not None and config is None:
        notes.append(f"{what}['hyper_parameters'] is not plain data: not kept as the config")
    if data.get("loops") or data.get("callbacks"):
        notes.append(
            f"{what}: Lightning's loop and callback states are not imported (the data position "
            f"starts at the beginning of epoch {epoch})"
        )
    return Foreign(
        source=path,
        format=LIGHTNING,
        progress=Progress(step=step, epoch=epoch),
        weights=weights,
        components=components,
        groups=groups,
        config=config,
        notes=tuple(notes),
    )


def _numbered(directory: Path, stem: str, suffixes: tuple[str, ...]) -> list[Path]:
    """Accelerate's files for ``stem``: ``stem.ext``, then ``stem_1.ext``, ``stem_2.ext``, ..."""
    return sorted(
        (
            p
            for p in directory.iterdir()
            if p.is_file()
            and p.suffix in suffixes
            and re.fullmatch(rf"{re.escape(stem)}(_\d+)?", p.stem)
        ),
        key=lambda p: (len(p.stem), p.stem),
    )


def _from_accelerate(directory: Path) -> Foreign:
    notes: list[str] = []
    models = _numbered(directory, "model", (".safetensors",)) + _numbered(
        directory, "pytorch_model", (".bin",)
    )
    if not models:
        raise ImportRefused(
            f"{directory} is not an Accelerate save_state directory: it has no model.safetensors "
            f"or pytorch_model.bin"
        )
    if len(models) > 1:
        raise ImportRefused(
            f"{directory} holds {len(models)} models ({', '.join(p.name for p in models)}); a "
            f"pitstop checkpoint holds one model"
        )
    [model] = models
    raw = read_safetensors(model) if model.suffix == ".safetensors" else torch_load(model)
    weights = _state_dict(raw, str(model))
    components: dict[str, Any] = {}
    groups: dict[str, list[list[int]]] = {}
    for stem, name, suffixes in (
        ("optimizer", "optimizer", (".bin",)),
        ("scheduler", "scheduler", (".bin",)),
        ("sampler", "sampler", (".bin",)),
        ("scaler", "scaler", (".pt",)),
    ):
        for index, file in enumerate(_numbered(directory, stem, suffixes)):
            key = name if index == 0 else f"{name}_{index}"
            components[key] = torch_load(file)
            if stem == "optimizer":
                groups[key] = _groups(components[key], str(file))
    for pickled in sorted(directory.glob("*.pkl")):
        notes.append(
            f"skipped {pickled}: a pickle (Accelerate's random states or a custom object), "
            f"never unpickled — the random number generators start from the new run's seed"
        )
    match = re.search(r"(?:^|[_-])(step|epoch)[_-]?(\d+)$", directory.name)
    progress = Progress()
    if match and match.group(1) == "step":
        progress = Progress(step=int(match.group(2)))
    elif match:
        progress = Progress(epoch=int(match.group(2)))
    scheduler = components.get("scheduler")
    last_epoch = scheduler.get("last_epoch") if isinstance(scheduler, Mapping) else None
    if progress.step == 0 and type(last_epoch) is int and last_epoch > 0:
        progress = Progress(step=last_epoch, epoch=progress.epoch)
        notes.append(f"{directory}: the step is scheduler.bin's last_epoch ({last_epoch})")
    elif progress.step == 0:
        notes.append(
            f"{directory}: Accelerate records no step (name the directory step_N, as "
            f"save_state(output_dir=f'step_{{step}}') does): imported as step 0"
        )
    return Foreign(
        source=directory,
        format=ACCELERATE,
        progress=progress,
        weights=weights,
        components=components,
        groups=groups,
        notes=tuple(notes),
    )


def read_foreign(src: str | os.PathLike[str]) -> Foreign:
    """Parse ``src`` — a torch.save or Lightning file, or an Accelerate directory.

    Raises :class:`~pitstop.errors.ImportRefused` saying why a source is not imported, and
    :class:`~pitstop.errors.CheckpointNotFound` when it does not exist.
    """
    source = Path(src)
    if source.is_dir():
        return _from_accelerate(source)
    if not source.is_file():
        raise CheckpointNotFound(f"nothing to import at {source}: not a file or a directory")
    if source.suffix == ".safetensors":
        return _from_torch_save(source, read_safetensors(source))
    data = torch_load(source)
    if not isinstance(data, Mapping):
        raise ImportRefused(
            f"{source} holds a {type(data).__name__}, not a checkpoint dict or a state dict"
        )
    if "state_dict" in data and any(k in data for k in _LIGHTNING_MARKERS):
        return _from_lightning(source, data)
    return _from_torch_save(source, data)
