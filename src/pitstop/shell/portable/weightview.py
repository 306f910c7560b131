# A checkpoint's raw or EMA weights, read on their own: the view load_weights and
# export_weights both start from.
#
# Rules: a checkpoint stores the model's state dict unwrapped under weights.raw and, when an EMA
# is configured, the EMA module's own state dict under weights.ema. `weights` selects the
# parameter set ("raw" or "ema"); the checkpoint argument (file, pointer, directory) selects the
# training position, and a corrupt pointer target falls back to the previous valid one. When
# the EMA did not average buffers (meta weights.ema_buffers == "raw"), its set is the EMA's
# parameters plus the raw model's checkpoint-time buffers. Only the bytes a view needs are read,
# and each blob read is checked against its CRC-32 first; the tensors map the file
# copy-on-write. A set the checkpoint does not hold, or one that is not a mapping of names to
# tensors, is an IncompatibleCheckpoint saying so.
# How: fileformat.load with select= for each subtree (pitstop.core.schema names them).

"""A checkpoint's raw or EMA weights as ``{name: CPU tensor}``, reading only their bytes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

import torch

from pitstop.core.schema import RAW, weights_meta, weights_path
from pitstop.errors import CheckpointCorrupt, ConfigError, IncompatibleCheckpoint
from pitstop.shell.format import fileformat
from pitstop.shell.format.treecheck import TensorRef, subtree
from pitstop.shell.sharded.support import require_sharded
from pitstop.shell.store.directory import is_sharded_path
from pitstop.shell.store.resolve import read_resolved

__all__ = ["Weights", "check_weights", "read_view", "weights_view"]

Weights = Literal["raw", "ema"]
"""Which parameter set of a checkpoint: the model's own weights or its EMA's."""


def check_weights(weights: object) -> Weights:
    """``weights`` as a :data:`Weights`; a :class:`~pitstop.errors.ConfigError` unless it is one."""
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
    kind = check_weights(weights)
    return read_resolved(checkpoint, lambda path: read_view(path, kind), fallback=True)[1]


def read_view(path: Path, kind: Weights) -> dict[str, torch.Tensor]:
    """The parameter set ``kind`` of the checkpoint file ``path`` (see :func:`weights_view`).

    A sharded checkpoint directory: the model's (or the EMA's) full, unsharded state,
    gathered from its DCP files in this process (verified first; nothing is unpickled).
    """
    if is_sharded_path(path):
        return _sharded_view(path, kind)
    manifest = fileformat.read_manifest(path)
    stored = _stored(manifest, kind)
    if stored is None:
        if kind == "ema":
            raise _no_ema(path)
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


def _no_ema(path: Path) -> IncompatibleCheckpoint:
    return IncompatibleCheckpoint(
        [f"{path} holds no EMA weights (it was saved without an EMA); load weights='raw' instead"]
    )


def _sharded_view(path: Path, kind: Weights) -> dict[str, torch.Tensor]:
    """:func:`read_view` of a sharded checkpoint directory."""
    require_sharded(f"reading the sharded checkpoint {path}")
    from pitstop.shell.sharded.engine import EMA, MODEL, full_state_dict, holds_ema, read_layout

    if kind == "raw":
        return _tensor_dict(full_state_dict(path), f"{path} weights.raw")
    layout, meta = read_layout(path)
    if not holds_ema(layout):
        raise _no_ema(path)
    view = _tensor_dict(full_state_dict(path, EMA), f"{path} weights.ema")
    described = weights_meta(meta, str(path))
    if described.ema_buffers == "raw" and described.buffers:
        buffers = full_state_dict(path, MODEL, keys=described.buffers)
        view.update(_tensor_dict(buffers, f"{path} weights.raw"))
    return view
