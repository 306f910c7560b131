# The built-in task: noisy linear regression with a small MLP, no download.
#
# Rules: the data is a pure function of the data section (its own torch.Generator, never the
# global RNG): y = x·w + b + noise·ε with x, b, ε standard normal and w normal with variance
# 1/features (so y has about unit variance). The model is
# Linear → ReLU → Dropout → Linear, initialised from the global RNG (seeded by run.seed before
# it is built). Evaluation runs in eval mode under no_grad, draws no random numbers (so it can
# run at any step without changing what training does next) and puts the model back in its
# previous mode.
# How: TensorDatasets and plain tensor arithmetic.

"""The built-in synthetic regression task: data, model, loss and evaluation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pitstop.train.config import DataSection, ModelSection

__all__ = ["Task", "make_evaluate", "make_model", "make_task", "mse_loss"]


@attrs.frozen(kw_only=True)
class Task:
    """The training set and the validation tensors of the built-in task."""

    train: TensorDataset
    val_inputs: torch.Tensor
    val_targets: torch.Tensor
    features: int


def make_task(data: DataSection) -> Task:
    """Generate the task ``data`` describes; the same section always gives the same tensors."""
    generator = torch.Generator().manual_seed(data.seed)
    total = data.samples + data.val_samples
    weight = torch.randn(data.features, 1, generator=generator) / data.features**0.5
    bias = torch.randn(1, generator=generator)
    inputs = torch.randn(total, data.features, generator=generator)
    targets = inputs @ weight + bias + data.noise * torch.randn(total, 1, generator=generator)
    return Task(
        train=TensorDataset(inputs[: data.samples], targets[: data.samples]),
        val_inputs=inputs[data.samples :],
        val_targets=targets[data.samples :],
        features=data.features,
    )


def make_model(model: ModelSection, features: int) -> nn.Sequential:
    """Build the MLP (from the global RNG: seed it first for a reproducible start)."""
    return nn.Sequential(
        nn.Linear(features, model.hidden),
        nn.ReLU(),
        nn.Dropout(model.dropout),
        nn.Linear(model.hidden, 1),
    )


def mse_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """The training loss of one ``(inputs, targets)`` batch."""
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def make_evaluate(
    inputs: torch.Tensor, targets: torch.Tensor
) -> Callable[[nn.Module], Mapping[str, float]]:
    """Return an evaluation function: ``{"val_loss": mean squared error}`` on the given set.

    The tensors are moved to the model's device on each call.
    """

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                prediction = model(inputs.to(device))
                loss = nn.functional.mse_loss(prediction, targets.to(device))
        finally:
            model.train(was_training)
        return {"val_loss": float(loss.item())}

    return evaluate
