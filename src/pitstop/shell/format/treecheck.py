# What a decoded tree may hold, and what readers do with one: check it, find its tensors, put
# tensors in, take a subtree; and build a file's tensors over the storages of its blobs.
#
# Rules: a decoded tree holds the types pitstop.shell.format.treewalk allows, tensors as
# TensorRef placeholders (never as dict keys or set members, each naming a row of the file's
# tensor table), nested at most MAX_DEPTH deep; check_tree refuses anything else with a
# CheckpointCorrupt naming the key path. Key paths are built only for a message or a tensor's
# users: a manifest is mostly leaves that pass unvisited.
# How: recursive walks over the decoded values (depth bounded by the check).

"""Checking decoded trees, and resolving their tensor references."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

import attrs

from pitstop.core.file.manifest import Manifest
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint
from pitstop.shell.format import numpyvalues
from pitstop.shell.format.treewalk import (
    MAPPINGS,
    MAX_DEPTH,
    SCALARS,
    SEQUENCES,
    SETS,
    join_key,
    leaves,
    show_path,
    tensor_dtypes,
    type_name,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "TensorRef",
    "blob_places",
    "build_tensors",
    "check_dtypes",
    "check_tree",
    "from_held",
    "resolve",
    "subtree",
    "tensor_refs",
]


@attrs.frozen
class TensorRef:
    """Placeholder for a stored tensor in a decoded tree: ``index`` into the tensor table."""

    index: int


def check_tree(tree: object, *, root: str, tensor_count: int | None) -> tuple[tuple[str, ...], ...]:
    """Check a decoded tree's value types and tensor references.

    ``tensor_count=None`` means tensors are not allowed (meta). Returns, per tensor index, the
    key paths that reference it. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the
    key path of a value of an unexpected type or a bad reference.
    """
    paths: list[list[str]] = [[] for _ in range(tensor_count or 0)]

    def check(value: object, where: _Where, depth: int, hashable: bool) -> None:
        if depth > MAX_DEPTH:
            raise CheckpointCorrupt(f"{_shown(where)}: nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if kind in SCALARS:  # an int from msgpack is always in range
            return
        # A leaf one level down passes unless it is too deep: it is not visited (nor its key
        # path built), which is most of a manifest (an RNG's state is 625 ints).
        leaf_passes = depth < MAX_DEPTH
        if kind in MAPPINGS:
            assert isinstance(value, dict)
            for k, v in value.items():
                if not (leaf_passes and type(k) in SCALARS):
                    check(k, (where, _KEY_OF, None), depth + 1, True)
                if not (leaf_passes and type(v) in SCALARS):
                    check(v, (where, _ITEM, k), depth + 1, hashable)
            return
        if kind in SEQUENCES:
            assert isinstance(value, (list, tuple))
            for i, v in enumerate(value):
                if not (leaf_passes and type(v) in SCALARS):
                    check(v, (where, _ITEM, i), depth + 1, hashable)
            return
        if kind is TensorRef:
            assert isinstance(value, TensorRef)
            if tensor_count is None:
                raise CheckpointCorrupt(f"{_shown(where)}: a tensor where none is allowed")
            if hashable:
                raise CheckpointCorrupt(f"{_shown(where)}: a tensor as a dict key or set member")
            if value.index >= tensor_count:
                raise CheckpointCorrupt(
                    f"{_shown(where)}: tensor index {value.index} is not in the tensor table "
                    f"({tensor_count} entries)"
                )
            paths[value.index].append(_shown(where))
            return
        if kind in SETS:
            assert isinstance(value, (set, frozenset))
            for m in value:
                if not (leaf_passes and type(m) in SCALARS):
                    check(m, (where, _MEMBER, None), depth + 1, True)
            return
        if numpyvalues.is_numpy(value):  # built by the decoder from a checked payload
            return
        if kind in leaves():  # torch.Size, torch.dtype: decoded values (so torch is loaded)
            return
        raise CheckpointCorrupt(f"{_shown(where)}: unexpected value of type {type_name(value)}")

    check(tree, root, 0, False)
    return tuple(tuple(p) for p in paths)


# Where a value is in the tree being checked, built only when a message or a tensor's key path
# needs it: the root's path, or (parent, step, key) — an item under key, the key of a map item,
# or a set member.
_ITEM, _KEY_OF, _MEMBER = 0, 1, 2
_Where: TypeAlias = "str | tuple[_Where, int, object]"


def _path(where: _Where) -> str:
    if isinstance(where, str):
        return where
    parent, step, key = where
    path = _path(parent)
    if step == _ITEM:
        return join_key(path, key)
    return f"{show_path(path)} (key)" if step == _KEY_OF else f"{path}{{}}"


def _shown(where: _Where) -> str:
    return show_path(_path(where))


def tensor_refs(tree: object) -> Iterator[TensorRef]:
    """Yield every :class:`TensorRef` in a checked tree (tensors are never keys or members)."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        yield tree
    elif kind in MAPPINGS:
        assert isinstance(tree, dict)
        for v in tree.values():
            yield from tensor_refs(v)
    elif kind in SEQUENCES:
        assert isinstance(tree, (list, tuple))
        for v in tree:
            yield from tensor_refs(v)


def resolve(tree: object, tensors: Mapping[int, torch.Tensor]) -> object:
    """Return a copy of a checked tree with each :class:`TensorRef` replaced from ``tensors``."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        return tensors[tree.index]
    if kind in MAPPINGS:
        assert isinstance(tree, dict)
        return type(tree)((k, resolve(v, tensors)) for k, v in tree.items())
    if kind in SEQUENCES:
        assert isinstance(tree, (list, tuple))
        return type(tree)(resolve(v, tensors) for v in tree)
    if kind in SETS:
        assert isinstance(tree, (set, frozenset))
        return type(tree)(tree)
    return tree


def subtree(tree: object, select: Sequence[str | int]) -> object:
    """Return the value at key path ``select`` in a decoded tree.

    Dicts are indexed by key (an int key is an int), lists and tuples by position. Raises
    :class:`KeyError` with the key path of the first step that does not exist.
    """
    node = tree
    path = ""
    for key in select:
        kind = type(node)
        if kind in MAPPINGS and key in node:  # type: ignore[operator]
            assert isinstance(node, dict)
            node = node[key]
        elif kind in SEQUENCES and type(key) is int and 0 <= key < len(node):  # type: ignore[arg-type]
            assert isinstance(node, (list, tuple))
            node = node[key]
        else:
            raise KeyError(join_key(path, key))
        path = join_key(path, key)
    return node


def check_dtypes(manifest: Manifest, needed: Sequence[int]) -> Mapping[str, torch.dtype]:
    """torch's dtype of each dtype name, once this host and torch can build every tensor
    ``needed`` of ``manifest`` (little-endian, each dtype known): checked before a byte is read
    into memory; else :class:`~pitstop.errors.IncompatibleCheckpoint` naming the file."""
    import torch

    if sys.byteorder != "little":
        raise IncompatibleCheckpoint(
            [f"{manifest.path}: this host is big-endian; pitstop files hold little-endian bytes"]
        )
    known = tensor_dtypes()
    for i in needed:  # a dtype on pitstop's list that an older torch lacks
        if manifest.tensors[i].dtype not in known:
            raise IncompatibleCheckpoint(
                [
                    f"{manifest.path}: tensor {', '.join(manifest.tensor_paths[i])} has dtype "
                    f"{manifest.tensors[i].dtype}, which torch {torch.__version__} does not have"
                ]
            )
    return known


def build_tensors(
    manifest: Manifest,
    needed: Sequence[int],
    storages: Mapping[int, torch.UntypedStorage],
    known: Mapping[str, torch.dtype],
) -> dict[int, torch.Tensor]:
    """Tensors ``needed`` of ``manifest``, each over its blob's storage in ``storages`` as its
    descriptor says; CheckpointCorrupt naming the tensor for one that does not fit."""
    import torch

    tensors: dict[int, torch.Tensor] = {}
    for i in needed:
        d = manifest.tensors[i]
        storage = storages[d.blob]
        try:
            # (a uint8 view, not torch.empty(dtype=...): that warns for complex32)
            tensors[i] = (
                torch.empty(0, dtype=torch.uint8, device=storage.device)
                .view(known[d.dtype])
                .set_(storage, d.storage_offset, d.shape, d.stride)
            )
        except RuntimeError as error:
            raise CheckpointCorrupt(
                f"{manifest.path}: tensor {', '.join(manifest.tensor_paths[i])} cannot be built: "
                f"{error}"
            ) from error
    return tensors


def blob_places(
    manifest: Manifest, devices: Mapping[int, torch.device | None]
) -> dict[int, torch.device]:
    """Where each blob goes: its tensors' device, or mapped (left out) where they disagree."""
    wanted: dict[int, set[torch.device | None]] = {}
    for i, device in devices.items():
        wanted.setdefault(manifest.tensors[i].blob, set()).add(device)
    places: dict[int, torch.device] = {}
    for blob, choice in wanted.items():
        device = choice.pop() if len(choice) == 1 else None
        if device is not None:
            places[blob] = device
    return places


def from_held(
    manifest: Manifest,
    needed: Sequence[int],
    devices: Mapping[int, torch.device | None],
    held: Mapping[int, memoryview],
) -> dict[int, torch.Tensor]:
    """Build tensors ``needed`` over the ``held`` blobs' bytes (checked as they arrived; the
    buffers become the tensors' memory), a placed blob's copied to its device."""
    import torch

    known = check_dtypes(manifest, needed)
    places = blob_places(manifest, devices)
    storages = {}
    with warnings.catch_warnings():  # the buffers are read-only: nothing else reads them
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        for index in sorted({manifest.tensors[i].blob for i in needed}):
            view = held[index]
            empty = torch.empty(0, dtype=torch.uint8)
            data = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else empty
            device = places.get(index)
            if device is not None and device.type != "cpu":
                data = data.to(device)
            storages[index] = data.untyped_storage()
    return build_tensors(manifest, needed, storages, known)
