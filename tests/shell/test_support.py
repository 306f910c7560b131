"""Sharded state asked of a torch that lacks it is one ConfigError naming the feature, the torch
it needs and the installed torch, raised before DCP is imported or the directory touched; the
rest of pitstop does not need it. On this torch for real when it lacks the APIs, and everywhere
with their detection made to miss them. In one process (a 1-rank gloo group)."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, SHARDED_MISSING, sharded_model
from pitstop.shell.sharded import support
from pitstop.shell.sharded.support import is_sharded

pytestmark = NEEDS_GLOO


def dtensor_linear() -> nn.Module:
    """A Linear whose weight is a replicated DTensor, made through the DTensor module this
    torch has (public from torch 2.5; torch 2.4's is private)."""
    from torch.distributed.device_mesh import init_device_mesh

    name = "torch.distributed._tensor" if SHARDED_MISSING else "torch.distributed.tensor"
    tensors: Any = importlib.import_module(name)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():  # torch 2.4: DTensor's random ops on a CPU mesh
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        model.weight = nn.Parameter(
            tensors.distribute_tensor(model.weight.data, mesh, [tensors.Replicate()])
        )
    return model


@pytest.fixture
def lacking(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch seen as lacking DCP's DefaultStager (as every torch before 2.9 does)."""
    found = support._attribute

    def attribute(module: str, name: str) -> object | None:
        return None if name == "DefaultStager" else found(module, name)

    monkeypatch.setattr(support, "_attribute", attribute)


def assert_names_the_torch(error: pitstop.ConfigError, *missing: str) -> None:
    assert "torch 2.9 or newer" in str(error), error
    assert f"this is torch {torch.__version__}" in str(error), error
    assert "sharded state (FSDP2, DTensor)" in str(error), error
    for api in missing:
        assert api in str(error), error


def test_a_dtensor_model_is_sharded_whichever_module_its_class_is_in(group: Any) -> None:
    assert is_sharded(dtensor_linear())
    assert not is_sharded(nn.Linear(4, 4))


def test_a_missing_api_is_named_and_nothing_else(lacking: None) -> None:
    assert support.sharded_missing() == (
        SHARDED_MISSING or ("torch.distributed.checkpoint.staging.DefaultStager",)
    )
    with pytest.raises(pitstop.ConfigError) as raised:
        support.require_sharded("this test")
    assert_names_the_torch(raised.value, "DefaultStager")
    assert str(raised.value).startswith("this test needs sharded state")


@pytest.mark.skipif(not SHARDED_MISSING, reason="this torch can save sharded state")
def test_a_sharded_checkpointer_on_this_torch_is_a_config_error(group: Any, tmp_path: Path) -> None:
    model = dtensor_linear()
    with pytest.raises(pitstop.ConfigError) as raised:
        pitstop.Checkpointer(tmp_path / "checkpoints", model=model)
    assert_names_the_torch(raised.value, *SHARDED_MISSING)
    assert not (tmp_path / "checkpoints").exists()


def test_a_sharded_checkpointer_on_a_torch_without_it_is_a_config_error(
    group: Any, tmp_path: Path, lacking: None
) -> None:
    optimizer = torch.optim.AdamW((model := dtensor_linear()).parameters())
    with pytest.raises(pitstop.ConfigError) as raised:
        pitstop.Checkpointer(tmp_path / "checkpoints", model=model, state={"optimizer": optimizer})
    assert_names_the_torch(raised.value, "DefaultStager")
    assert "a Checkpointer whose model or optimizer holds DTensors" in str(raised.value)
    assert not (tmp_path / "checkpoints").exists()


@NEEDS_SHARDED  # writing the sharded checkpoint it then reads as if on an older torch
def test_reading_a_sharded_checkpoint_on_a_torch_without_it_is_a_config_error(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = sharded_model()
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    monkeypatch.setattr(support, "sharded_missing", lambda: ("an API",))
    pitstop.verify(root)  # checksums and the manifest: no DCP
    assert pitstop.info(root).step == 1
    for read in (
        lambda: pitstop.load(root),
        lambda: pitstop.load_weights(nn.Linear(1, 1), root),
        lambda: pitstop.export_weights(root, tmp_path / "model.pt"),
    ):
        with pytest.raises(
            pitstop.ConfigError, match=r"reading the sharded checkpoint .*torch 2\.9"
        ):
            read()
    assert not (tmp_path / "model.pt").exists()
