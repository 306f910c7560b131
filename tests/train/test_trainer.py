"""The Trainer in this process: stop requests, limits, pointers, exact resume, save_model."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset
from trainkit import last, steps_on_disk, tree

from pitstop.core.records import Policy, Progress, SaveReason
from pitstop.errors import ConfigError, SaveError
from pitstop.shell.manager import Checkpoint
from pitstop.shell.store import atomic
from pitstop.train import Reporter, TrainConfig, Trainer, TrainState
from pitstop.train.task import mse_loss
from storagetrace import Op, OsSpy, durability_problems, recording_local_storage
from trees import assert_same

SAMPLES, BATCH = 48, 4  # 12 micro-batches per epoch


class Recorder(Reporter):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def started(self, *, restored: Progress, target_step: int | None, resumed_from: Any) -> None:
        self.events.append(("started", (restored.step, target_step)))

    def stepped(self, progress: Progress, *, loss: float, lr: float | None) -> None:
        self.events.append(("stepped", progress.step))

    def evaluated(self, progress: Progress, metrics: Mapping[str, float]) -> None:
        self.events.append(("evaluated", progress.step))

    def published(self, checkpoint: Checkpoint, *, size: int, blocked: float) -> None:
        assert size > 0
        assert blocked >= 0
        self.events.append(("published", (checkpoint.step, checkpoint.reason)))

    def finished(self, state: TrainState) -> None:
        self.events.append(("finished", state.step))

    def of(self, kind: str) -> list[Any]:
        return [value for name, value in self.events if name == kind]


def make_trainer(
    *,
    stop_at_micro: int | None = None,
    val_losses: list[float] | None = None,
    reporter: Reporter | None = None,
) -> Trainer:
    """A small run: dropout, AdamW, a schedule and an EMA, all seeded the same every time."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 3, generator=generator)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
    micro = 0
    trainer: Trainer

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        nonlocal micro
        micro += 1
        if micro == stop_at_micro:
            trainer.stop.request("test")
        return mse_loss(model, batch)

    scripted = iter(val_losses or [])

    def evaluate(model: nn.Module) -> Mapping[str, float]:
        return {"val_loss": next(scripted, 1.0)}

    trainer = Trainer(
        model,
        optimizer,
        data=data,
        batch_size=BATCH,
        loss_fn=loss_fn,
        evaluate=evaluate,
        ema=ema,
        scheduler=scheduler,
        data_seed=7,
        config={"lr": 0.05},
        reporter=reporter,
    )
    return trainer


def weights_of(trainer: Trainer) -> dict[str, Any]:
    assert trainer.ema is not None
    return {
        "model": trainer.model.state_dict(),
        "ema": trainer.ema.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }


@pytest.mark.parametrize("stop_at_micro", [3, 6, 12, 13])
def test_a_stop_finishes_the_window_saves_last_and_resume_is_exact(
    tmp_path: Path, stop_at_micro: int
) -> None:
    config = TrainConfig(max_steps=9, accumulate=2, eval_every=4)
    straight = make_trainer()
    straight.train(config, checkpoint_dir=tmp_path / "straight")

    recorder = Recorder()
    first = make_trainer(stop_at_micro=stop_at_micro, reporter=recorder)
    state = first.train(config, checkpoint_dir=tmp_path / "split", resume_from="last")
    stopped_at = math.ceil(stop_at_micro / 2)
    assert (state.step, state.stop_reason, state.metrics) == (stopped_at, "test", {})
    assert state.new_updates == stopped_at
    saved = last(tmp_path / "split")
    assert (saved.step, saved.reason, saved.detail) == (stopped_at, SaveReason.STOP, "test")
    assert not (tmp_path / "split" / "final").exists()
    # The final evaluation is skipped: evaluations happened only at multiples of eval_every.
    assert recorder.of("evaluated") == [s for s in (4,) if s <= stopped_at]

    second = make_trainer()
    state = second.train(config, checkpoint_dir=tmp_path / "split", resume_from="last")
    assert (state.restored.step, state.step, state.stop_reason) == (stopped_at, 9, None)
    assert state.metrics == {"val_loss": 1.0}
    assert [step for step, _ in state.losses] == list(range(stopped_at + 1, 10))
    assert_same(weights_of(straight), weights_of(second))
    assert_same(tree(tmp_path / "straight" / "final"), tree(tmp_path / "split" / "final"))


def test_a_normal_end_evaluates_and_saves_final(tmp_path: Path) -> None:
    recorder = Recorder()
    trainer = make_trainer(reporter=recorder)
    state = trainer.train(
        TrainConfig(max_steps=5, accumulate=2),
        checkpoint_dir=tmp_path,
        policy=Policy(every_steps=2, keep_last=None),
    )
    assert (state.step, state.epoch, state.stop_reason) == (5, 0, None)
    assert recorder.of("started") == [(0, 5)]
    assert recorder.of("stepped") == [1, 2, 3, 4, 5]
    assert recorder.of("evaluated") == [5]
    assert recorder.of("published") == [
        (2, SaveReason.INTERVAL),
        (4, SaveReason.INTERVAL),
        (5, SaveReason.FINAL),
    ]
    assert recorder.of("finished") == [5]
    assert (tmp_path / "final").resolve().name == "step_000000000005.pitstop"


def test_best_follows_val_loss(tmp_path: Path) -> None:
    trainer = make_trainer(val_losses=[0.9, 0.4, 0.6, 0.5])
    trainer.train(TrainConfig(max_steps=8, accumulate=1, eval_every=2), checkpoint_dir=tmp_path)
    assert (tmp_path / "best").resolve().name == "step_000000000004.pitstop"
    assert (tmp_path / "final").resolve().name == "step_000000000008.pitstop"


def test_limits_are_cumulative(tmp_path: Path) -> None:
    """Epoch and step limits are absolute; a limit at or below the restored position does no
    updates but still ends the run normally (a final evaluation, the final pointer)."""
    per_epoch = SAMPLES // BATCH // 2
    state = make_trainer().train(TrainConfig(epochs=1, accumulate=2), checkpoint_dir=tmp_path)
    assert (state.step, state.epoch) == (per_epoch, 1)
    state = make_trainer().train(
        TrainConfig(epochs=2, accumulate=2), checkpoint_dir=tmp_path, resume_from="last"
    )
    assert (state.restored.step, state.step, state.epoch) == (per_epoch, 2 * per_epoch, 2)
    before = steps_on_disk(tmp_path)
    recorder = Recorder()
    state = make_trainer(reporter=recorder).train(
        TrainConfig(max_steps=3, accumulate=2), checkpoint_dir=tmp_path, resume_from="last"
    )
    assert (state.new_updates, state.step, state.stop_reason) == (0, 2 * per_epoch, None)
    assert recorder.of("evaluated") == [2 * per_epoch]  # the final evaluation
    assert steps_on_disk(tmp_path) == before
    # Both limits: whichever comes first.
    state = make_trainer().train(
        TrainConfig(epochs=4, max_steps=2 * per_epoch + 2, accumulate=2),
        checkpoint_dir=tmp_path,
        resume_from="last",
    )
    assert (state.step, state.epoch) == (2 * per_epoch + 2, 2)


def test_without_a_checkpoint_directory_nothing_is_written(tmp_path: Path) -> None:
    state = make_trainer(stop_at_micro=2).train(TrainConfig(max_steps=4))
    assert (state.step, state.stop_reason) == (2, "test")
    with pytest.raises(ConfigError, match=r"needs a checkpoint_dir"):
        make_trainer().train(TrainConfig(max_steps=4), resume_from=tmp_path / "last")


def test_resume_from_a_pointer_path_with_nothing_behind_it_starts_fresh(tmp_path: Path) -> None:
    state = make_trainer().train(
        TrainConfig(max_steps=2), checkpoint_dir=tmp_path, resume_from=tmp_path / "last"
    )
    assert (state.restored.step, state.step) == (0, 2)
    state = make_trainer().train(
        TrainConfig(max_steps=3), checkpoint_dir=tmp_path, resume_from=tmp_path / "last"
    )
    assert (state.restored.step, state.step) == (2, 3)
    file = tmp_path / "step_000000000002.pitstop"
    state = make_trainer().train(
        TrainConfig(max_steps=3), checkpoint_dir=tmp_path / "other", resume_from=file
    )
    assert (state.restored.step, state.step) == (2, 3)


def test_train_off_the_main_thread_stops_on_request(tmp_path: Path) -> None:
    """Signals cannot be caught there; a stop request still works."""
    result: list[TrainState] = []
    trainer = make_trainer(stop_at_micro=3)
    thread = threading.Thread(
        target=lambda: result.append(
            trainer.train(TrainConfig(max_steps=6), checkpoint_dir=tmp_path)
        )
    )
    thread.start()
    thread.join()
    assert [(s.step, s.stop_reason) for s in result] == [(3, "test")]


def test_save_model_writes_a_plain_state_dict(tmp_path: Path) -> None:
    trainer = make_trainer()
    trainer.train(TrainConfig(max_steps=3))
    raw = torch.load(trainer.save_model(tmp_path / "raw.pt"), weights_only=True)
    assert_same(raw, dict(trainer.model.state_dict()))
    ema = torch.load(trainer.save_model(tmp_path / "ema.pt", weights="ema"), weights_only=True)
    assert sorted(ema) == sorted(raw)  # no "module." prefix from the AveragedModel
    assert trainer.ema is not None
    assert_same(ema, dict(trainer.ema.module.state_dict()))
    with pytest.raises(ConfigError, match=r"writes .pt files"):
        trainer.save_model(tmp_path / "model.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema.pt", "raw.pt"]  # no temp left


def test_save_model_is_durable_through_the_atomic_write_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer()
    trainer.train(TrainConfig(max_steps=1))
    ops: list[Op] = []
    monkeypatch.setattr(atomic, "LocalStorage", recording_local_storage(ops))
    spy = OsSpy(monkeypatch)
    target = trainer.save_model(tmp_path / "models" / "raw.pt")
    # The helper's publish sequence (temp, write, fsync, close, rename, directory fsync) ...
    assert [op.kind for op in ops if op.kind != "write"] == [
        "create",
        "sync_file",
        "close",
        "replace",
        "sync_directory",
    ]
    assert ops[-2] == Op("replace", ops[0].name, "raw.pt")
    assert durability_problems(ops) == []
    # ... and the fsyncs really reach the file and its directory.
    assert spy.problems(target) == []
    assert_same(torch.load(target, weights_only=True), dict(trainer.model.state_dict()))


def test_save_model_failure_is_a_save_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer()
    target = tmp_path / "raw.pt"
    target.write_bytes(b"before")

    def full(obj: object, file: Any) -> None:
        file.write(b"part")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SaveError, match=r"could not write .*raw\.pt: disk full"):
        trainer.save_model(target)
    assert target.read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.pt"]


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match=r"needs epochs or max_steps"):
        TrainConfig()
    with pytest.raises(ConfigError, match=r"TrainConfig.accumulate must be an int >= 1, got 0"):
        TrainConfig(max_steps=1, accumulate=0)
    with pytest.raises(ConfigError, match=r"TrainConfig.max_steps must be an int >= 0"):
        TrainConfig(max_steps=-1)
    with pytest.raises(ConfigError, match=r"accumulate=13 needs more micro-batches than the 12"):
        make_trainer().train(TrainConfig(max_steps=1, accumulate=13))
