# Model weights on their own: unwrapping live models, loading a checkpoint's weights into a model,
# and exporting them as an ordinary state dict.
#
# Rules: a checkpoint stores the model's state dict unwrapped under weights.raw and, when an EMA
# is configured, the EMA module's own state dict under weights.ema. `weights` selects the
# parameter set ("raw" or "ema"); the checkpoint argument (file, pointer, directory) selects the
# training position. When the EMA did not average buffers (meta weights.ema_buffers == "raw"),
# its set is the EMA's parameters plus the raw model's checkpoint-time buffers. Only the bytes a
# view needs are read, and each blob read is checked against its CRC-32 first. Loading is
# all-or-nothing: names, shapes and dtypes are compared (pitstop.core.compat) and every
# difference is reported before any tensor of the model is touched; strict=False lets missing
# and unexpected names through and returns them (shapes and dtypes must still match). Values
# are copied into the model's own tensors, or, with map_location, the model takes the
# checkpoint's tensors placed on that device (one transfer from the file's memory map, no
# second copy; a model built on the meta device loads this way). Exports are plain
# {name: tensor} dicts, written atomically (temp file, fsync, rename, directory fsync: the one
# helper, pitstop.shell.atomic).
# How: fileformat.load with select= for each subtree; the core compares; torch copies.

"""Load a checkpoint's raw or EMA weights into a model, or export them as a plain state dict."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

from pitstop.core.compat import Kind, diff_tensors
from pitstop.core.schema import RAW, weights_meta, weights_path
from pitstop.errors import CheckpointCorrupt, ConfigError, IncompatibleCheckpoint
from pitstop.shell import fileformat, progress
from pitstop.shell.atomic import write_atomically
from pitstop.shell.resolve import resolve_checkpoint
from pitstop.shell.state import tensor_specs
from pitstop.shell.treecodec import TensorRef, subtree

__all__ = [
    "IncompatibleKeys",
    "Weights",
    "export_weights",
    "load_weights",
    "plain_state_dict",
    "unwrap_model",
    "weights_view",
]

Weights = Literal["raw", "ema"]
"""Which parameter set of a checkpoint: the model's own weights or its EMA's."""


class IncompatibleKeys(NamedTuple):
    """What :func:`load_weights` left out, like ``nn.Module.load_state_dict``'s result.

    ``missing_keys``: in the model, not in the checkpoint (they keep their values);
    ``unexpected_keys``: in the checkpoint, not in the model (not loaded). Plain names, without
    wrapper prefixes. Both are empty after a ``strict=True`` load.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


# Wrappers whose wrapped module is `.module`; torch.compile's OptimizedModule keeps `._orig_mod`.
_MODULE_WRAPPERS = (DistributedDataParallel, DataParallel, AveragedModel)
# State dict key prefixes those wrappers add.
_PREFIXES = ("module.", "_orig_mod.")
_COMPILED = "_orig_mod"

# Accepted spellings of an export dtype.
_DTYPES: Mapping[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
_FORMATS = (".pt", ".safetensors")


# --- unwrapping -------------------------------------------------------------------------------


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


def _plain_names(keys: list[str]) -> dict[str, str]:
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
    names = _plain_names(list(state))
    return {names[key]: value for key, value in state.items()}


# --- reading a checkpoint's weights -----------------------------------------------------------


def _check_weights(weights: object) -> Weights:
    if not isinstance(weights, str) or weights not in get_args(Weights):
        raise ConfigError(f"weights must be 'raw' or 'ema', got {weights!r}")
    return weights  # type: ignore[return-value]  # checked against the Literal just above


def _weights_meta(manifest: fileformat.Manifest) -> tuple[str, list[str]]:
    """Return ``(ema_buffers, buffer names)`` from the manifest's ``weights`` meta."""
    meta = weights_meta(manifest.meta, str(manifest.path))
    return meta.ema_buffers, list(meta.buffers)


def _stored(manifest: fileformat.Manifest, kind: str) -> Mapping[str, object] | None:
    """The decoded (tensor-free) subtree ``weights.<kind>``, or None when there is none."""
    try:
        node = subtree(manifest.tree, weights_path(kind))  # type: ignore[arg-type]
    except KeyError:
        return None
    if not isinstance(node, Mapping):
        raise CheckpointCorrupt(f"{manifest.path}: weights.{kind} is not a mapping of tensors")
    return node


def _tensor_dict(tree: object, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(tree, Mapping):
        raise CheckpointCorrupt(f"{where} is not a mapping of tensors")
    bad = [
        f"{where}[{key!r}] is a {type(value).__qualname__}, not a tensor"
        if isinstance(key, str)
        else f"{where} has a non-str key {key!r}"
        for key, value in tree.items()
        if not isinstance(key, str) or not isinstance(value, torch.Tensor)
    ]
    if bad:
        raise IncompatibleCheckpoint(bad)
    return dict(tree)


def _raw_buffers(
    path: Path, manifest: fileformat.Manifest, raw: Mapping[str, object], names: list[str]
) -> dict[str, torch.Tensor]:
    """Load the raw model's buffers ``names`` — only their blobs, each checked first."""
    refs = {name: ref for name in names if isinstance(ref := raw.get(name), TensorRef)}
    if not refs:
        return {}
    # One unverified, lazily mapped load of weights.raw (no bytes are read until touched), then
    # a CRC-32 check of the buffers' blobs only: loading them one select at a time would read
    # and parse the whole manifest once per buffer.
    tree = fileformat.load(path, select=weights_path(RAW), verify=False)
    assert isinstance(tree, Mapping)
    fileformat.check_blobs(manifest, (manifest.tensors[ref.index].blob for ref in refs.values()))
    return _tensor_dict({name: tree[name] for name in refs}, f"{path} weights.raw")


def weights_view(
    checkpoint: str | os.PathLike[str], weights: Weights = "raw"
) -> dict[str, torch.Tensor]:
    """Return the parameter set ``weights`` of ``checkpoint`` as ``{name: CPU tensor}``.

    ``checkpoint`` is a checkpoint file, a pointer (``run/checkpoints/best``) or a checkpoint
    directory (its ``last``); a corrupt pointer target falls back to the previous valid one.
    ``"raw"`` is the model's state dict; ``"ema"`` is the EMA's, where an EMA that did not
    average its buffers takes the raw model's checkpoint-time buffers. Names carry no wrapper
    prefixes. Only the bytes of the selected tensors are read (and checked against their
    CRC-32); the tensors map the file copy-on-write, so writing to them never changes it.

    Raises :class:`~pitstop.errors.ConfigError` for a ``weights`` other than ``"raw"`` /
    ``"ema"``, :class:`~pitstop.errors.IncompatibleCheckpoint` when the checkpoint holds no
    such weights, :class:`~pitstop.errors.CheckpointCorrupt` for a damaged file and
    :class:`~pitstop.errors.CheckpointNotFound` when ``checkpoint`` names nothing.
    """
    kind = _check_weights(weights)
    return _view(resolve_checkpoint(checkpoint, fallback=True), kind)


def _view(path: Path, kind: Weights) -> dict[str, torch.Tensor]:
    manifest = fileformat.read_manifest(path)
    stored = _stored(manifest, kind)
    if stored is None:
        if kind == "ema":
            raise IncompatibleCheckpoint(
                [
                    f"{path} holds no EMA weights (it was saved without an EMA); "
                    f"load weights='raw' instead"
                ]
            )
        raise IncompatibleCheckpoint(
            [f"{path} holds no model weights (no weights.raw): it is not a training checkpoint"]
        )
    view = _tensor_dict(fileformat.load(path, select=weights_path(kind)), f"{path} weights.{kind}")
    if kind == "ema":
        ema_buffers, buffers = _weights_meta(manifest)
        raw = _stored(manifest, "raw")
        if ema_buffers == "raw" and raw is not None:
            view.update(_raw_buffers(path, manifest, raw, buffers))
    return view


# --- loading into a model ---------------------------------------------------------------------


def _map_location(map_location: str | torch.device | None) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location)
        except (RuntimeError, ValueError):
            pass
    raise ConfigError(
        f"map_location must be a device such as 'cpu', 'cuda' or torch.device('cuda', 0), "
        f"got {map_location!r}"
    )


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

    Returns the missing and unexpected keys (both empty under ``strict=True``).
    """
    kind = _check_weights(weights)
    if not isinstance(strict, bool):
        raise ConfigError(f"load_weights strict must be a bool, got {strict!r}")
    device = _map_location(map_location)
    target = unwrap_model(model)
    live = target.state_dict(keep_vars=True)
    names = _plain_names(list(live))
    path = resolve_checkpoint(checkpoint, fallback=True)
    view = _view(path, kind)
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


# --- exporting --------------------------------------------------------------------------------


def _export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        found = _DTYPES.get(dtype.lower().removeprefix("torch."))
        if found is None:
            raise ConfigError(
                f"dtype {dtype!r} is not a floating-point dtype pitstop knows; use one of "
                f"{sorted(_DTYPES)} or a torch.dtype"
            )
        return found
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ConfigError(
        f"dtype must be a floating-point torch.dtype or a name like 'bf16', got {dtype!r}"
    )


def export_weights(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    weights: Weights = "raw",
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write the parameter set ``weights`` of ``checkpoint`` to ``path`` as a plain state dict.

    The format follows the suffix: ``.pt`` is a :func:`torch.save` of a plain ``{name: tensor}``
    dict (loadable with ``torch.load(path, weights_only=True)``; tied tensors stay tied);
    ``.safetensors`` needs the optional ``safetensors`` package (``pip install
    pitstop[safetensors]``). Names carry no ``module.`` / ``_orig_mod.`` prefixes. ``dtype``
    (a floating-point ``torch.dtype`` or ``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"float16"``,
    ``"fp32"``, ...) converts floating-point tensors only; integer and bool tensors (such as
    BatchNorm's ``num_batches_tracked``) keep their dtype. Every tensor is written contiguous.
    The file appears atomically and durably (temp file in the same directory, fsync, rename,
    directory fsync). Returns the path written.

    Raises :class:`~pitstop.errors.ConfigError` for another suffix, a bad ``dtype``, a bad
    ``weights`` or a missing ``safetensors``; :class:`~pitstop.errors.SaveError` naming
    ``path`` when writing fails (``path`` is then as it was); otherwise as
    :func:`weights_view`.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in _FORMATS:
        raise ConfigError(
            f"cannot export weights to {target}: the suffix must be .pt or .safetensors, "
            f"got {target.suffix or 'none'!r}"
        )
    convert = _export_dtype(dtype)
    kind = _check_weights(weights)
    serialize: Callable[[dict[str, torch.Tensor]], bytes] | None = None
    if suffix == ".safetensors":
        try:
            serialize = importlib.import_module("safetensors.torch").save
        except ImportError as error:
            raise ConfigError(
                f"exporting {target} needs the safetensors package: "
                f"install pitstop[safetensors] (or pip install safetensors), or export to .pt"
            ) from error
    view = weights_view(checkpoint, kind)
    copies: dict[tuple[object, ...], torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    total = sum(t.numel() * t.element_size() for t in view.values())
    watched = progress.task(f"exporting {target}", total)
    for name, tensor in view.items():
        to = convert if convert is not None and tensor.is_floating_point() else tensor.dtype
        # Tied tensors (one storage, same view) become one copy, which torch.save keeps tied.
        identity = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        copy = copies.get(identity) if tensor.numel() and suffix == ".pt" else None
        if copy is None:
            # A contiguous copy, so the file holds no view of the checkpoint's memory map.
            copy = tensor.to(dtype=to, memory_format=torch.contiguous_format, copy=True)
            copies[identity] = copy
        plain[name] = copy
        watched.advance(tensor.numel() * tensor.element_size())
    watched.end()
    if suffix == ".pt":
        write_atomically(target, lambda file: torch.save(plain, file))
    else:
        assert serialize is not None
        write_atomically(target, lambda file: file.write(serialize(plain)))
    return target
