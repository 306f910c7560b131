"""An EMA of a sharded model, saved and resumed through DCP with it, in one process.

``Checkpointer(..., model=fsdp_model, ema=...)`` with FSDP2 state (a 1-rank gloo group): the
EMA — an ``AveragedModel`` whose module is sharded like the model, or a plain sharded copy
updated by hand — is saved through DCP under ``ema`` (an AveragedModel's ``n_averaged`` under
``ema_count``), synchronously and in the background, and a resume into new modules puts it back
bitwise; the replicated tree in the manifest holds none of it. A run with an EMA refuses a
checkpoint without one, even with strict=False, leaving its EMA as it was; an optimizer named
like one of those keys is refused. The EMA's weights export to an unsharded model, with the
model's buffers where the EMA copies the model's (an AveragedModel) and its own otherwise. The
2-rank versions (a run killed and resumed, resharding, a failed read rolled back, export) are
in tests/e2e/test_sharded_checkpointer.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
from onerank import NEEDS_GLOO, Scaled
from pitstop.core.schema import EMA, WEIGHTS
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.shell.format import fileformat
from pitstop.shell.store.sharddir import read_layout

pytestmark = NEEDS_GLOO


def build(seed: int, kind: str) -> tuple[nn.Module, Any, nn.Module]:
    """A sharded model (a Linear, a Scaled), its AdamW, and its EMA: an AveragedModel of it
    (``kind="averaged"``) or a copy (``"copy"``), sharded the same way after it was made."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), Scaled())
    if kind == "averaged":
        ema: nn.Module = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        inner = ema.module
    else:
        ema = inner = nn.Sequential(nn.Linear(16, 16), Scaled())
        inner.load_state_dict(model.state_dict())
    for module in (model, inner):
        fully_shard(module[0])
        fully_shard(module[1].linear)
        fully_shard(module)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), ema


def train(model: nn.Module, optimizer: Any, ema: nn.Module, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optimizer.step()
        if isinstance(ema, AveragedModel):
            ema.update_parameters(model)
        else:
            with torch.no_grad():
                for mine, theirs in zip(ema.parameters(), model.parameters(), strict=True):
                    mine.lerp_(theirs, 0.1)


def local(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s own state: its local shards and plain tensors, by name."""
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["averaged", "copy"])
def test_an_ema_is_saved_through_dcp_and_resumed_bitwise(
    group: Any, tmp_path: Path, kind: str, async_save: bool
) -> None:
    model, optimizer, ema = build(0, kind)
    train(model, optimizer, ema, 3)
    saved = local(ema)
    root = tmp_path / "checkpoints"
    state = {"optimizer": optimizer}
    with pitstop.Checkpointer(root, model=model, ema=ema, state=state, async_save=async_save) as c:
        c.save(pitstop.Progress(step=3))
    checkpoint = root / sharded_name(3)
    layout, _ = read_layout(checkpoint)
    stored = {v.fqn for v in layout.values}
    assert {"ema.0.weight", "ema.1.linear.weight", "ema.1.scale"} <= stored
    assert ("ema_count.n_averaged" in stored) == (kind == "averaged")
    manifest = fileformat.read_manifest(checkpoint / MANIFEST_NAME)
    assert EMA not in manifest.tree[WEIGHTS]  # not in the replicated tree: DCP has it
    assert "ema" not in manifest.tree  # nor an AveragedModel's count

    model, optimizer, ema = build(1, kind)  # other weights: a load that did nothing shows
    weight = next(k for k in saved if k.endswith("1.linear.weight"))
    assert not torch.equal(local(ema)[weight], saved[weight])
    with pitstop.Checkpointer(root, model=model, ema=ema, state={"optimizer": optimizer}) as c:
        assert c.resume().step == 3
    assert_equal(local(ema), saved)


def test_a_run_with_an_ema_refuses_a_checkpoint_without_one_and_keeps_its_ema(
    group: Any, tmp_path: Path
) -> None:
    model, optimizer, _ = build(0, "averaged")
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    model, optimizer, ema = build(1, "averaged")
    before, weights = local(ema), local(model)
    ckpt = pitstop.Checkpointer(root, model=model, ema=ema, state={"optimizer": optimizer})
    with ckpt, pytest.raises(pitstop.IncompatibleCheckpoint) as raised:
        ckpt.resume(strict=False)
    assert raised.value.differences == (
        f"{sharded_name(1)}: ema: the checkpoint holds no EMA weights",
    )
    assert_equal(local(ema), before)
    assert_equal(local(model), weights)
    assert not optimizer.state


@pytest.mark.parametrize("name", ["ema", "ema_count"])
def test_an_optimizer_named_like_the_ema_s_keys_is_refused(
    group: Any, tmp_path: Path, name: str
) -> None:
    model, optimizer, ema = build(0, "averaged")
    root = tmp_path / "checkpoints"
    ckpt = pitstop.Checkpointer(root, model=model, ema=ema, state={name: optimizer})
    with ckpt, pytest.raises(pitstop.ConfigError, match=rf"sharded component '{name}'"):
        ckpt.save(pitstop.Progress(step=1))
    assert not list(root.glob("step_*"))


@pytest.mark.parametrize("kind", ["averaged", "copy"])
def test_the_ema_s_weights_export_with_the_model_s_buffers_unless_it_keeps_its_own(
    group: Any, tmp_path: Path, kind: str
) -> None:
    """An AveragedModel (use_buffers=False: torch's AveragedModel cannot average an FSDP2
    module's plain buffers with its DTensors) copies the model's buffers at each update; its
    exported weights take the model's buffers as they were at the save. A copy keeps its own."""
    model, optimizer, ema = build(0, kind)
    train(model, optimizer, ema, 3)
    model(torch.randn(4, 16))  # the model's buffer moves on after the EMA's last update
    inner = ema.module if isinstance(ema, AveragedModel) else ema
    assert not torch.equal(model[1].scale, inner[1].scale)
    full = {k: v.full_tensor() for k, v in inner.state_dict().items() if "scale" not in k}
    full["1.scale"] = (model if kind == "averaged" else inner)[1].scale.clone()
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(root, model=model, ema=ema, state={"optimizer": optimizer}) as c:
        c.save(pitstop.Progress(step=3))
    exported = pitstop.export_weights(root, tmp_path / "ema.pt", weights="ema")
    plain = nn.Sequential(nn.Linear(16, 16), Scaled())
    plain.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    assert_equal(dict(plain.state_dict()), full)


@pytest.mark.parametrize("weights", ["raw", "ema"])
def test_load_weights_into_a_sharded_model_is_refused_saying_what_to_do(
    group: Any, tmp_path: Path, weights: str
) -> None:
    """load_weights into an FSDP2 model: one ConfigError (resume through a Checkpointer, or
    load into the unsharded model), the model untouched; the unsharded model loads."""
    model, optimizer, ema = build(0, "copy")
    train(model, optimizer, ema, 2)
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(root, model=model, ema=ema, state={"optimizer": optimizer}) as c:
        c.save(pitstop.Progress(step=2))
    other, _, _ = build(1, "copy")
    before = local(other)
    with pytest.raises(pitstop.ConfigError) as caught:
        pitstop.load_weights(other, root, weights=weights)
    message = str(caught.value)
    assert "the model is sharded (FSDP2, DTensor" in message, message
    assert "resume it through a Checkpointer" in message, message
    assert "build the model without fully_shard, load_weights into it, then shard it" in message
    assert_equal(local(other), before)
    plain = nn.Sequential(nn.Linear(16, 16), Scaled())
    pitstop.load_weights(plain, root, weights=weights)
    source = model if weights == "raw" else ema
    full = {k: v.full_tensor() for k, v in source.state_dict().items() if "scale" not in k}
    assert_equal({k: v for k, v in plain.state_dict().items() if "scale" not in k}, full)
