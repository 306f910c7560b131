"""load_weights' arguments: a wrong model or checkpoint, or a device the tensors cannot go to,
is a ConfigError naming the argument, raised before the model is touched. Real files in
tmp_path; no sleeps, no timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pitstop import Checkpointer, ConfigError, Progress, load_weights


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    with Checkpointer(tmp_path / "run", model=_model(seed=1)) as ckpt:
        return ckpt.save(Progress(step=1)).path


def _unchanged(model: nn.Module) -> bool:
    fresh = _model()
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    return all(not a.is_meta and torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"weight": torch.zeros(2, 3)},
            "load_weights model must be an nn.Module (a state dict? pass the module it belongs "
            "to), got dict",
        ),
        (None, "load_weights model must be an nn.Module, got NoneType"),
    ],
    ids=["state dict", "None"],
)
def test_a_model_that_is_no_module_is_named(checkpoint: Path, model: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_weights(model, checkpoint)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (3, "got int 3"),
        (None, "got NoneType None"),
        (b"run/checkpoints", "got bytes b'run/checkpoints'"),
    ],
    ids=["int", "None", "bytes"],
)
def test_a_checkpoint_that_is_no_path_is_named(where: object, message: str) -> None:
    model = _model()
    with pytest.raises(ConfigError) as caught:
        load_weights(model, where)  # type: ignore[arg-type]
    assert str(caught.value).startswith(
        "load_weights checkpoint must be a path (str or os.PathLike) to a checkpoint file, a "
        "pointer or a checkpoint directory, "
    )
    assert str(caught.value).endswith(message)
    assert _unchanged(model)


def test_swapped_arguments_say_so(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match=r"takes the model first and the checkpoint second"):
        load_weights(checkpoint, _model())  # type: ignore[arg-type]


def test_the_meta_device_is_refused_and_the_model_keeps_its_weights(checkpoint: Path) -> None:
    model = _model()
    with pytest.raises(ConfigError) as caught:
        load_weights(model, checkpoint, map_location="meta")
    assert str(caught.value).startswith(
        "load_weights map_location='meta': the meta device holds no data, so the model would be "
        "left without its weights"
    )
    assert _unchanged(model)  # before, its parameters became meta tensors: the weights gone


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_refused_naming_map_location(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, device: str | torch.device
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = _model()
    with pytest.raises(ConfigError) as caught:
        load_weights(model, checkpoint, map_location=device)
    assert str(caught.value) == (
        f"load_weights map_location={str(device)!r}: this process has no cuda device (none is "
        f"available or torch was built without cuda support); pass 'cpu' or a device it has"
    )
    assert _unchanged(model)


def test_a_cuda_device_this_process_lacks_is_refused_naming_the_ones_it_has(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = _model()
    with pytest.raises(ConfigError) as caught:
        load_weights(model, checkpoint, map_location="cuda:2")
    assert str(caught.value) == (
        "load_weights map_location='cuda:2': there is no cuda:2; this process has 2 cuda "
        "device(s) (cuda:0 to cuda:1)"
    )
    assert _unchanged(model)


def test_the_cpu_still_loads(checkpoint: Path) -> None:
    model = _model()
    load_weights(model, checkpoint, map_location="cpu")
    assert torch.equal(model.weight, _model(seed=1).weight)
