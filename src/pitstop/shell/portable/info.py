# A checkpoint's facts without its tensors.
#
# Rules: info() reads the header, the footer and the manifest of one checkpoint — never a tensor
# byte — so it takes the same time on any size. A pointer or a directory names its target as
# the directory scan reconciles it (no full verify, which would read every byte; `verify` is
# for that). The record is the public Checkpoint with what only the manifest knows filled in:
# the stored config, the file's size and the tensor table (key path, dtype, shape, bytes).
# How: read_resolved (fallback=False), read_manifest, entry_from_meta.

"""pitstop.info: what a checkpoint holds, from its manifest alone."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from pitstop.core.metadata import entry_from_meta
from pitstop.core.naming import NOT_A_CHECKPOINT, checkpoint_name, parse_checkpoint
from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.checkpoint import Checkpoint, TensorInfo
from pitstop.shell.format import fileformat
from pitstop.shell.format.treewalk import ITEMSIZES
from pitstop.shell.store.directory import is_sharded_path
from pitstop.shell.store.resolve import manifest_path, read_resolved

__all__ = ["info", "tensor_table"]


def tensor_table(manifest: fileformat.Manifest) -> tuple[TensorInfo, ...]:
    """One :class:`TensorInfo` per key path that holds a tensor, in the file's tensor order."""
    out = []
    for index, descriptor in enumerate(manifest.tensors):
        nbytes = descriptor.numel * ITEMSIZES[descriptor.dtype]
        out += [
            TensorInfo(name=name, dtype=descriptor.dtype, shape=descriptor.shape, nbytes=nbytes)
            for name in manifest.tensor_paths[index]
        ]
    return tuple(out)


def info(checkpoint: str | os.PathLike[str]) -> Checkpoint:
    """Return what ``checkpoint`` records, reading only its manifest (no tensor bytes).

    ``checkpoint`` is a file, a pointer (``run/checkpoints/best``) or a directory (its
    ``last``). The record has ``.path``, ``.step``, ``.progress``, ``.reason`` (and
    ``.detail``), ``.seq``, ``.metrics``, ``.config`` (the run's config as stored, or
    ``None``), ``.size_bytes`` and ``.tensors`` (key path, dtype, shape and bytes of each
    stored tensor). Enough to rebuild a model from the stored config before loading its
    weights. The tensor bytes are not checked; :func:`pitstop.verify` does that.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` for a file whose manifest does not read
    back and :class:`~pitstop.errors.CheckpointNotFound` when ``checkpoint`` names nothing, or
    names a pointer whose checkpoint does not exist (naming the pointer and the file).
    """
    check_path(checkpoint, argument="info checkpoint", to=CHECKPOINT_PATH)
    return read_resolved(checkpoint, _read_info)[1]


def _read_info(path: Path) -> Checkpoint:
    """What the checkpoint at ``path`` records (its manifest, and a sharded one's layout)."""
    sharded = is_sharded_path(path)
    manifest = fileformat.read_manifest(manifest_path(path))
    meta = manifest.meta
    name = path.name
    if parse_checkpoint(name) is NOT_A_CHECKPOINT:  # a renamed file: named by the step it holds
        progress = meta.get("progress")
        step = progress.get("step") if isinstance(progress, Mapping) else None
        name = checkpoint_name(step) if isinstance(step, int) else name
    entry = entry_from_meta(name, meta)
    config = meta.get("config")
    if config is not None and not isinstance(config, Mapping):
        raise CheckpointCorrupt(f"{path}: manifest key 'config' must be a mapping, got {config!r}")
    return Checkpoint(
        path=Path(path),
        progress=entry.progress,
        reason=entry.reason,
        seq=entry.seq,
        metrics=entry.metrics,
        detail=entry.detail,
        config=None if config is None else MappingProxyType(dict(config)),
        size_bytes=manifest.size + (_sharded_bytes(path) if sharded else 0),
        tensors=tensor_table(manifest) + (_sharded_table(path) if sharded else ()),
    )


def _sharded_bytes(path: Path) -> int:
    from pitstop.shell.store.sharddir import read_layout

    return sum(f.size for f in read_layout(path)[0].files)


def _sharded_table(path: Path) -> tuple[TensorInfo, ...]:
    """The tensors a sharded directory's DCP files hold, by key path, with global shapes."""
    from pitstop.shell.store.sharddir import read_layout

    out = []
    for value in read_layout(path)[0].values:
        if value.dtype is None:
            continue
        numel = 1
        for n in value.shape:
            numel *= n
        nbytes = numel * ITEMSIZES[value.dtype]
        name = ".".join(str(p) for p in value.path)
        out.append(TensorInfo(name=name, dtype=value.dtype, shape=value.shape, nbytes=nbytes))
    return tuple(out)
