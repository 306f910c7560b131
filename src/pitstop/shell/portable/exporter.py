# Exporting a checkpoint's raw or EMA weights as an ordinary state dict file.
#
# Rules: the file is a plain {name: tensor} dict without wrapper prefixes — torch.save's (.pt,
# loadable with weights_only=True; tied tensors stay tied) or safetensors' (.safetensors, with
# the optional package), chosen by the suffix; any other suffix is a ConfigError before
# anything is read. `dtype` converts floating-point tensors only; every tensor is written as a
# contiguous copy, so the file holds no view of the checkpoint's memory map. The file appears
# atomically and durably (temp file, fsync, rename, directory fsync: the one helper,
# pitstop.shell.store.atomic); a failed write leaves the path as it was.
# How: weights_view reads the set; torch copies and converts; write_atomically writes.

"""export_weights: a checkpoint's raw or EMA weights as a plain ``.pt`` or ``.safetensors``."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path
from pitstop.errors import ConfigError
from pitstop.shell.format import progress
from pitstop.shell.portable.weightview import Weights, check_weights, weights_view
from pitstop.shell.store.atomic import write_atomically

__all__ = ["export_weights"]

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
_SHORT = {"bf16", "fp16", "fp32", "fp64"}
_FORMATS = (".pt", ".safetensors")


def _export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        found = _DTYPES.get(dtype.lower().removeprefix("torch."))
        if found is None:
            raise ConfigError(
                f"dtype {dtype!r} is not a floating-point dtype pitstop exports to; use bf16, "
                f"fp16, fp32 or fp64 (also spelt {', '.join(sorted(set(_DTYPES) - _SHORT))})"
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
    :func:`weights_view`. A ``checkpoint`` or ``path`` that is no path (str or
    ``os.PathLike``) is a :class:`~pitstop.errors.ConfigError` naming it, before anything is
    read or written.
    """
    check_path(checkpoint, argument="export_weights checkpoint", to=CHECKPOINT_PATH)
    check_path(path, argument="export_weights path", to="the .pt or .safetensors file to write")
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in _FORMATS:
        raise ConfigError(
            f"cannot export weights to {target}: the suffix must be .pt or .safetensors, "
            f"got {target.suffix or 'none'!r}"
        )
    convert = _export_dtype(dtype)
    kind = check_weights(weights)
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
