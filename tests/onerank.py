"""One process as a 1-rank gloo job, for in-process tests of sharded (FSDP2) state."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pitstop.core.support import SHARDED_STATE
from pitstop.shell.sharded.support import sharded_missing

SHARDED_MISSING = sharded_missing()
SHARDED_REASON = (
    f"{SHARDED_STATE.name} needs torch {SHARDED_STATE.minimum} or newer; this is torch "
    f"{torch.__version__}, which lacks {', '.join(SHARDED_MISSING)}"
)
NEEDS_SHARDED = pytest.mark.skipif(bool(SHARDED_MISSING), reason=SHARDED_REASON)
"""A test's mark when it makes sharded state (FSDP2, DTensor) or saves it through DCP."""

NEEDS_GLOO = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)
"""A module's ``pytestmark`` when its tests need a gloo group."""


@contextlib.contextmanager
def one_rank_group() -> Iterator[Any]:
    """A 1-rank gloo default group on a free port (and, yielded, a group of its own for DCP's
    async collectives); destroyed on leaving."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def sharded_model(*, step: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP, each Linear and the root ``fully_shard``ed, and its AdamW (with state
    after one step on fixed inputs when ``step``)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    if step:
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
    return model, optimizer


class Scaled(nn.Module):
    """A Linear and a buffer that each forward pass scales (a buffer training changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(1.01)
        return self.linear(x) * self.scale
