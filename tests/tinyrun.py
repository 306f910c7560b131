"""A tiny model and AdamW after one step, for the save session's tests."""

from __future__ import annotations

import torch
from torch import nn


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two Linear layers and their AdamW, after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step on random inputs."""
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold equal tensors under the same names."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
