"""The Checkpointer's arguments: a wrong one is a pitstop error naming it, raised before the
directory is touched; a save call's metrics are checked the same way, naming the call and the
step. Real files in tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pitstop
from pitstop import Checkpointer, ConfigError, InvalidValue, Policy, Progress


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"policy": {"keep_last": 3}},
            InvalidValue,
            "Checkpointer.policy must be a pitstop.Policy (e.g. Policy(every_steps=100, "
            "keep_last=3)) or None, got dict {'keep_last': 3}",
        ),
        ({"policy": 3}, InvalidValue, "Checkpointer.policy must be a pitstop.Policy"),
        (
            {"config": [("lr", 0.1)]},
            ConfigError,
            "Checkpointer.config must be a mapping of the run's settings (such as {'lr': 0.1}) "
            "or None, got list [('lr', 0.1)]",
        ),
        ({"config": "lr=0.1"}, ConfigError, "Checkpointer.config must be a mapping"),
        (
            {"state": [torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)]},
            ConfigError,
            "Checkpointer.state must be a mapping of names to components (objects with "
            "state_dict() and load_state_dict()), such as {'optimizer': optimizer}, got list",
        ),
        (
            {"state": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)},
            ConfigError,
            "Checkpointer.state must be a mapping of names to components",
        ),
        (
            {"storage": "/tmp/elsewhere"},
            ConfigError,
            "Checkpointer.storage must implement pitstop.shell.store.storage.Storage",
        ),
        (
            {"timeout_s": -1},
            InvalidValue,
            "Checkpointer.timeout_s must be a positive, finite number of seconds, got -1",
        ),
        (
            {"timeout_s": math.nan},
            InvalidValue,
            "Checkpointer.timeout_s must be a positive, finite number of seconds, got nan",
        ),
        (
            {"timeout_s": "600"},
            InvalidValue,
            "Checkpointer.timeout_s must be a positive, finite number of seconds, got '600'",
        ),
        ({"per_rank": 3}, InvalidValue, "Checkpointer.per_rank must be component names, got 3"),
        (
            {"model": {"weight": torch.zeros(1)}},
            ConfigError,
            "Checkpointer.model must be an nn.Module (the model itself, not its state_dict()), "
            "got dict",
        ),
    ],
    ids=[
        "policy dict",
        "policy int",
        "config list",
        "config str",
        "state list",
        "state optimizer",
        "storage path",
        "timeout negative",
        "timeout nan",
        "timeout str",
        "per_rank int",
        "model state dict",
    ],
)
def test_a_wrong_argument_is_named_before_the_directory_is_touched(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments: dict[str, Any] = {"model": _model(), **kwargs}
    with pytest.raises(error) as caught:
        Checkpointer(tmp_path / "run", **arguments)
    assert message in str(caught.value)
    assert not (tmp_path / "run").exists()  # not created, not locked


def test_a_directory_that_is_no_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Checkpointer\.directory must be a path .*got int 3"):
        Checkpointer(3, model=_model())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({"run": {"out": Path("runs/a")}}, "config.run.out: cannot store a value of type pathlib"),
        ({"layers": [16, object()]}, "config.layers[1]: cannot store a value of type object"),
        ({"init": torch.zeros(2)}, "config.init: tensors are not allowed here"),
        ({"seed": 2**70}, "config.seed: int 1180591620717411303424 is outside the int64"),
    ],
    ids=["path", "object in a list", "tensor", "huge int"],
)
def test_a_config_no_checkpoint_can_hold_is_refused_at_construction_by_key_path(
    tmp_path: Path, config: dict[str, Any], where: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Checkpointer(tmp_path / "run", model=_model(), config=config)
    assert str(caught.value).startswith("Checkpointer.config cannot be stored in a checkpoint: ")
    assert where in str(caught.value)
    assert not (tmp_path / "run").exists()  # refused before the first save, not by it


def test_a_storable_config_is_kept_as_a_copy_and_saved(tmp_path: Path) -> None:
    config: dict[str, Any] = {"lr": 0.1, "layers": [16, 8], "tags": {"a"}, "pair": (1, 2.5)}
    with Checkpointer(tmp_path, model=_model(), config=config, policy=Policy()) as ckpt:
        config["layers"].append(4)  # the caller's later changes are not the stored config
        assert ckpt.config == {"lr": 0.1, "layers": [16, 8], "tags": {"a"}, "pair": (1, 2.5)}
        saved = ckpt.save(Progress(step=1))
    assert pitstop.info(saved.path).config == ckpt.config


# --- a save call's metrics ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "metrics", "message"),
    [
        (
            "save",
            {"val_loss": "0.25"},
            "save(step=3): metrics['val_loss'] must be a number (an int, a float, a one-element "
            "tensor or a NumPy scalar), got str '0.25'",
        ),
        (
            "maybe_save",
            {"val_loss": torch.ones(3)},
            "maybe_save(step=3): metrics['val_loss'] must be a number (an int, a float, a "
            "one-element tensor or a NumPy scalar), got Tensor tensor([1., 1., 1.])",
        ),
        ("finish", {"acc": None}, "finish(step=3): metrics['acc'] must be a number"),
        (
            "save",
            [("val_loss", 0.25)],
            "save(step=3): metrics must be a mapping of metric names to numbers, such as "
            "{'val_loss': 0.25}, got list [('val_loss', 0.25)]",
        ),
        ("maybe_save", 0.25, "maybe_save(step=3): metrics must be a mapping"),
        ("save", {1: 0.25}, "save(step=3): metric names must be non-empty str, got int 1"),
    ],
    ids=["str value", "tensor of 3", "None value", "list", "bare float", "int name"],
)
def test_bad_metrics_name_the_call_the_step_and_the_metric_and_nothing_is_saved(
    tmp_path: Path, call: str, metrics: object, message: str
) -> None:
    policy = Policy(every_steps=1, best=pitstop.Best("val_loss"))
    with Checkpointer(tmp_path, model=_model(), policy=policy) as ckpt:
        with pytest.raises(ConfigError) as caught:
            getattr(ckpt, call)(Progress(step=3), metrics=metrics)
        assert message in str(caught.value)
        assert ckpt.checkpoints() == []


def test_numbers_of_every_kind_are_recorded_as_floats_without_an_autograd_warning(
    tmp_path: Path,
) -> None:
    loss = (torch.ones(2, requires_grad=True) * 0.5).sum()  # a live loss, still in the graph
    metrics = {"loss": loss, "acc": np.float32(0.25), "n": 3, "val": torch.tensor([0.5])}
    with Checkpointer(tmp_path, model=_model()) as ckpt:
        saved = ckpt.save(Progress(step=1), metrics=metrics)
    assert dict(saved.metrics) == {"loss": 1.0, "acc": 0.25, "n": 3.0, "val": 0.5}
    assert all(type(v) is float for v in saved.metrics.values())
