"""``async_save="overlap"`` with a sharded model, in one process.

``Checkpointer(..., model=fsdp_model, async_save="overlap")`` with FSDP2 state (a 1-rank gloo
group): the call copies the buffers, the EMA and everything that is not a parameter or
optimizer state; the parameters and optimizer state are copied after it, by pitstop's thread
or by the next ``optimizer.step()``'s pre-hook, whichever comes first — so the checkpoint holds
the state at the call although the next forward pass changed a buffer, the step changed the
weights and the EMA was updated before the save was written. A copy that fails there is
raised by a later call as a failed background save, and nothing of it is left. The 2-rank
version (a run killed after an overlap save, resumed bitwise) is in
tests/e2e/test_sharded_checkpointer.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
from onerank import NEEDS_GLOO, Scaled
from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell.sharded.engine import MODEL, full_state_dict
from pitstop.shell.sharded.shardstage import DeferredCopy, StagedShards
from trees import assert_same

pytestmark = NEEDS_GLOO

GATE_TIMEOUT = 30.0


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, AveragedModel]:
    """A sharded model (a Linear, a Scaled), its AdamW and an AveragedModel of it."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), Scaled())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for module in (model, ema.module):
        fully_shard(module[0])
        fully_shard(module[1].linear)
        fully_shard(module)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), ema


def step(model: nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel) -> None:
    """One training step: forward (the buffer changes), backward, step, EMA update."""
    optimizer.zero_grad()
    model(torch.randn(4, 16)).pow(2).mean().backward()
    optimizer.step()
    ema.update_parameters(model)


def full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s full tensors (its local shards are the whole on one rank)."""
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of the optimizer's state tensors, in parameter order."""
    return [
        (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


class Gate:
    """Holds pitstop's thread back before it makes a save's deferred copy, until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.held = 0

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    real = StagedShards.whole

    def whole(self: StagedShards) -> Any:
        if threading.current_thread() is not threading.main_thread():
            held.held += 1
            assert held.opened.wait(GATE_TIMEOUT), "the gate was never opened"
        return real(self)

    monkeypatch.setattr(StagedShards, "whole", whole)
    try:
        yield held
    finally:
        held.open()


def overlapping(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module
) -> pitstop.Checkpointer:
    """A Checkpointer of them in ``root``, with ``async_save="overlap"``."""
    state = {"optimizer": optimizer}
    return pitstop.Checkpointer(root, model=model, ema=ema, state=state, async_save="overlap")


def fail_second_copy(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[list[str]]:
    """The stager's second copy (the first save's deferred one: its parameters and moments)
    raises ``error``; returned: the top-level keys of every copy asked for, in order."""
    real = DefaultStager.stage
    calls: list[list[str]] = []

    def stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        calls.append(sorted(state_dict))
        if len(calls) == 2:
            raise error
        return real(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "stage", stage)
    return calls


def stored_model(root: Path, saved_step: int) -> dict[str, torch.Tensor]:
    return full_state_dict(root / sharded_name(saved_step), MODEL)


def test_the_next_step_copies_the_weights_before_changing_them(
    group: Any, tmp_path: Path, gate: Gate
) -> None:
    """The thread is held: the step's pre-hook makes the copy; the checkpoint holds the
    weights, the moments, the buffer and the EMA as they were at the call (the forward pass
    before that step changed the buffer, the step the weights, the update the EMA)."""
    model, optimizer, ema = build(0)
    step(model, optimizer, ema)
    at_call, ema_at_call, moments_at_call = full(model), full(ema.module), moments(optimizer)
    root = tmp_path / "checkpoints"
    with overlapping(root, model, optimizer, ema) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
        assert saved is not None
        assert not saved.published
        step(model, optimizer, ema)  # the pre-hook copies first; the thread is still held
        gate.open()
        ckpt.wait()
        assert saved.status is pitstop.SaveStatus.PUBLISHED
    now = full(model)
    assert not torch.equal(now["1.scale"], at_call["1.scale"])
    assert not torch.equal(now["0.weight"], at_call["0.weight"])
    assert_same(stored_model(root, 1), at_call, "model")
    assert_same(full_state_dict(root / sharded_name(1), "ema"), ema_at_call, "ema")

    model, optimizer, ema = build(1)  # other weights: a resume that did nothing shows
    with pitstop.Checkpointer(root, model=model, ema=ema, state={"optimizer": optimizer}) as c:
        assert c.resume().step == 1
    assert_same(full(model), at_call, "resumed model")
    assert_same(full(ema.module), ema_at_call, "resumed ema")
    assert_same(moments(optimizer), moments_at_call, "resumed optimizer")
    assert gate.held == 1  # the thread asked for the copy after the step had made it


def test_the_thread_makes_the_copy_when_no_step_comes(group: Any, tmp_path: Path) -> None:
    """No step after the call: pitstop's thread copies, and every save is published."""
    model, optimizer, ema = build(0)
    root = tmp_path / "checkpoints"
    with overlapping(root, model, optimizer, ema) as ckpt:
        step(model, optimizer, ema)
        at_call = full(model)
        ckpt.save(pitstop.Progress(step=1))
        ckpt.wait()
        step(model, optimizer, ema)
        ckpt.save(pitstop.Progress(step=2))
    assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(1), sharded_name(2)]
    assert_same(stored_model(root, 1), at_call, "step 1")
    assert_same(stored_model(root, 2), full(model), "step 2")


def test_a_deferred_copy_that_fails_is_raised_later_and_leaves_nothing(
    group: Any, tmp_path: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy the step's pre-hook makes raises: the step goes on, the next call raises a
    failed background save naming the step, and no checkpoint or temp directory is left."""
    model, optimizer, ema = build(0)
    step(model, optimizer, ema)
    calls = fail_second_copy(monkeypatch, OSError("copy injected"))
    root = tmp_path / "checkpoints"
    with overlapping(root, model, optimizer, ema) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
        assert saved is not None
        step(model, optimizer, ema)  # the hook's copy fails; the step is not stopped
        gate.open()
        with pytest.raises(pitstop.SaveError, match="copy injected") as raised:
            ckpt.wait()
        assert "step 1" in str(raised.value)
        assert saved.status is pitstop.SaveStatus.FAILED
        assert ckpt.checkpoints() == []
    assert calls[1] == [MODEL, "optimizer"]  # the part left for later: weights and moments
    assert "ema" in calls[0]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_a_deferred_copy_runs_once_and_keeps_its_outcome() -> None:
    calls: list[int] = []

    def copy() -> str:
        calls.append(1)
        return "copied"

    later = DeferredCopy(copy)
    assert not later.done
    later.run()
    later.run()  # the step's hook, then the thread: one copy
    assert later.done
    assert later.result() == "copied"
    assert calls == [1]


def test_a_deferred_copy_keeps_its_error_and_raises_a_keyboard_interrupt_where_it_ran() -> None:
    def broken() -> None:
        raise OSError("disk")

    later = DeferredCopy(broken)
    later.run()  # the hook's copy failed: the step goes on
    with pytest.raises(OSError, match="disk"):
        later.result()  # the thread hears it, as the save's failure

    def interrupted() -> None:
        raise KeyboardInterrupt

    later = DeferredCopy(interrupted)
    with pytest.raises(KeyboardInterrupt):
        later.run()  # a Ctrl-C during the hook's copy reaches the loop
    assert later.done
    with pytest.raises(KeyboardInterrupt):
        later.result()  # and the save fails with it


def test_a_ctrl_c_in_the_step_s_copy_reaches_the_loop_and_fails_only_that_save(
    group: Any, tmp_path: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt during the copy the step's pre-hook makes is raised by that step;
    the save fails (a SaveError at the next call, not the interrupt again), and the next save
    is published."""
    model, optimizer, ema = build(0)
    step(model, optimizer, ema)
    fail_second_copy(monkeypatch, KeyboardInterrupt())
    root = tmp_path / "checkpoints"
    with overlapping(root, model, optimizer, ema) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
        with pytest.raises(KeyboardInterrupt):
            step(model, optimizer, ema)
        gate.open()
        with pytest.raises(pitstop.SaveError, match="interrupted") as raised:
            ckpt.wait()
        assert "step 1" in str(raised.value)
        assert saved is not None
        assert saved.status is pitstop.SaveStatus.FAILED
        ckpt.save(pitstop.Progress(step=2))
        ckpt.wait()
        assert [c.path.name for c in ckpt.checkpoints()] == [sharded_name(2)]
