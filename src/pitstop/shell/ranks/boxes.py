# How a value travels in one of pitstop's collectives: encoded, in a box of fixed size.
#
# Rules: a box is the value's size (HEADER bytes, little-endian), then the value itself when it
# fits; a value that does not fit travels in a second round whose size every rank read from the
# first. A value is encoded by pitstop.shell.ranks.valuecodec (msgpack, a closed set of types:
# nothing is ever unpickled), and one that cannot travel still fills its box, as its refusal,
# so that every rank completes the round.
# How: uint8 tensors; pitstop.shell.ranks.collectives sends and receives them.

"""Boxes: a value encoded into a fixed-size byte tensor for a collective, and back."""

from __future__ import annotations

from typing import Any, Final

import torch

from pitstop.shell.ranks.valuecodec import decode, encode

__all__ = ["HEADER", "boxed_value", "bytes_tensor", "dumps", "loads", "size_of"]

HEADER: Final = 8  # the value's size, little-endian, before it in its box


def dumps(value: object, rank: int) -> bytes:
    """``value``, sent by ``rank``, as bytes (:func:`pitstop.shell.ranks.valuecodec.encode`)."""
    return encode(value, rank=rank)


def loads(data: torch.Tensor) -> Any:
    """The value in ``data`` (uint8, contiguous): :func:`~pitstop.shell.ranks.valuecodec.decode`."""
    return decode(data.numpy())


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
