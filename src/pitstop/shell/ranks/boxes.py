# How a value travels in one of pitstop's collectives: pickled, in a box of fixed size.
#
# Rules: a box is the value's size (HEADER bytes, little-endian), then the value itself when it
# fits; a value that does not fit travels in a second round whose size every rank read from the
# first. Pickles go only between this job's own processes, in memory, as torch.distributed's
# object collectives do: nothing read from a checkpoint is ever unpickled.
# How: uint8 tensors; pitstop.shell.ranks.distributed sends and receives them.

"""Boxes: a value pickled into a fixed-size byte tensor for a collective, and back."""

from __future__ import annotations

import pickle  # noqa: TID251 - in memory between this job's ranks, as torch's object collectives do
from typing import Any, Final

import torch

__all__ = ["HEADER", "boxed_value", "bytes_tensor", "dumps", "loads", "size_of"]

HEADER: Final = 8  # the value's size, little-endian, before it in its box


def dumps(value: object) -> bytes:
    # Between this job's own processes, as torch.distributed's object collectives do.
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def bytes_tensor(data: bytes, size: int) -> torch.Tensor:
    tensor = torch.zeros(size, dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


def boxed_value(data: bytes, box: int) -> torch.Tensor:
    """``data``'s size, then ``data`` itself if it fits: a box of ``box`` bytes for one round."""
    size = len(data).to_bytes(HEADER, "little")
    return bytes_tensor(size + data if len(data) <= box else size, HEADER + box)


def size_of(box: torch.Tensor) -> int:
    return int.from_bytes(box[:HEADER].numpy().tobytes(), "little")
