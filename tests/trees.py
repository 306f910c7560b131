"""Comparing nested state trees bit for bit, for tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def assert_same(a: object, b: object, path: str = "") -> None:
    """Bitwise equality of two trees (tensors compare as raw bytes, so NaNs compare too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), path
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)), path
        assert type(a) is type(b), path
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
