"""An optimizer without state, saved through DCP, goes on as if it had never been saved.

DCP's ``get_optimizer_state_dict`` gives an optimizer that has no state yet zeroed state to save
(one step at learning rate 0), so AdamW's first real step would be its step 2. In one process
(a 1-rank gloo group, FSDP2): a sharded save before the first step — synchronous and in the
background — leaves the optimizer without state, and a run resumed from that checkpoint starts
without state too; both then train bitwise equal to a run that never saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from onerank import NEEDS_GLOO, NEEDS_SHARDED, sharded_model
from pitstop.core.sharding.sharded import FRESH_OPTIMIZERS, MANIFEST_NAME, sharded_name
from pitstop.shell.format import fileformat

pytestmark = [NEEDS_GLOO, NEEDS_SHARDED]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> dict[str, Any]:
    for step in range(steps):
        optimizer.zero_grad()  # sharded_model() leaves its step's gradients
        torch.manual_seed(step)
        model(torch.randn(4, 64)).pow(2).mean().backward()
        optimizer.step()
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_before_the_first_step_changes_nothing_now_or_after_a_resume(
    group: Any, tmp_path: Path, async_save: bool
) -> None:
    never_saved = train(*sharded_model(step=False))

    model, optimizer = sharded_model(step=False)
    root = tmp_path / "checkpoints"
    state = {"optimizer": optimizer}
    with pitstop.Checkpointer(root, model=model, state=state, async_save=async_save) as ckpt:
        ckpt.save(pitstop.Progress(step=0))
        ckpt.wait()
        assert not optimizer.state  # not the zeroed state DCP saved
        assert_equal(train(model, optimizer), never_saved)
    manifest = fileformat.read_manifest(root / sharded_name(0) / MANIFEST_NAME)
    assert manifest.meta[FRESH_OPTIMIZERS] == ["optimizer"]

    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        assert again.resume().step == 0
        assert again.resumed_from == root / sharded_name(0)
        assert not optimizer.state
        assert_equal(train(model, optimizer), never_saved)


def test_an_optimizer_with_state_is_saved_and_resumed_as_it_is(group: Any, tmp_path: Path) -> None:
    model, optimizer = sharded_model()  # one step taken: AdamW has state
    root = tmp_path / "checkpoints"
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    manifest = fileformat.read_manifest(root / sharded_name(1) / MANIFEST_NAME)
    assert FRESH_OPTIMIZERS not in manifest.meta
    straight = train(model, optimizer)

    model, optimizer = sharded_model(step=False)
    with pitstop.Checkpointer(root, model=model, state={"optimizer": optimizer}) as again:
        assert again.resume().step == 1
        assert [float(s["step"]) for s in optimizer.state.values()] == [1.0] * 4
        assert_equal(train(model, optimizer), straight)
