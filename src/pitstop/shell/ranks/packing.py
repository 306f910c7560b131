# A rank's state tree as plain bytes for another rank, and back.
#
# Rules: the tree travels in pitstop's own tree encoding (pitstop.shell.format.treecodec), so what a
# checkpoint cannot hold is a SaveError naming its key path on the rank that holds it; each
# storage's bytes travel once, so tensors that share storage on one rank share it on the
# other; nothing is unpickled. Decoded as a checkpoint's tree is.
# How: pack_state on the sending rank, unpack_state on rank 0 (pitstop.shell.ranks.distributed's
# rounds and the riders of DCP's write results carry what it makes).

"""Packing a state tree for another rank (:func:`pack_state`, :func:`unpack_state`)."""

from __future__ import annotations

from typing import Any

import torch

from pitstop.shell.format.treecheck import resolve
from pitstop.shell.format.treecodec import encode_tree, tensor_dtypes, unpack
from pitstop.shell.format.treewalk import dtype_name, storage_of

__all__ = ["Packed", "pack_state", "unpack_state"]


Packed = tuple[bytes, tuple[bytes, ...], tuple[tuple[Any, ...], ...]]
"""A state tree for another rank: its msgpack, each storage's bytes, each tensor's view."""


def pack_state(value: object) -> Packed:
    """A state tree as plain bytes for another rank: the tree in pitstop's own encoding
    (:mod:`pitstop.shell.format.treecodec`, so what a checkpoint cannot hold is a SaveError naming
    its key path here), each storage's bytes once (tensors that share storage still share it
    in :func:`unpack_state`'s copy) and each tensor's dtype, offset, shape and strides."""
    storages: dict[Any, int] = {}
    data: list[bytes] = []
    views: list[tuple[Any, ...]] = []

    def on_tensor(tensor: torch.Tensor, path: str) -> int:
        storage = storage_of(tensor, path)
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in storages:
            storages[key] = len(data)
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            data.append(raw.cpu().numpy().tobytes())
        views.append(
            (
                storages[key],
                dtype_name(tensor.dtype),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
        )
        return len(views) - 1

    return encode_tree(value, on_tensor=on_tensor), tuple(data), tuple(views)


def unpack_state(packed: Packed) -> Any:
    """The tree :func:`pack_state` made, on the CPU: a copy, sharing nothing with the sender's
    (decoded as a checkpoint's tree is: no code runs)."""
    tree, data, views = packed
    made = [
        (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
        ).untyped_storage()
        for raw in data
    ]
    known = tensor_dtypes()
    tensors = {
        index: torch.empty(0, dtype=known[dtype]).set_(made[storage], offset, shape, stride)
        for index, (storage, dtype, offset, shape, stride) in enumerate(views)
    }
    return resolve(unpack(tree), tensors)
