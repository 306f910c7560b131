# The training loop of one Trainer.train() call.
#
# Rules: windows of `accumulate` micro-batches; after each update: next epoch when the epoch's
# updates are done, report, evaluate every eval_every updates, maybe_save (with the stop
# request, so a stop's save records its reason). A stop request is looked at between windows
# and after each update, never inside a window; with several ranks (a process group of more
# than one) the StopRequest shows the ranks' agreed answer, which maybe_save (given the stop)
# agrees after each update — the loop documented for users — so every rank stops at the same
# step; without a Checkpointer, StopRequest.sync() agrees instead. At the end: a stop saves `last`
# (finish with the stop) and skips the final evaluation; a normal end evaluates (unless the last
# update just did) and finishes, which saves `final`. A save is reported as published when its save
# sequence number is new.
# How: a small class holding the call's state. The Trainer supplies its parts (model, optimizer,
# sampler, loader, reporter, stop request: the Trained protocol) and its three steps (micro-step,
# update, evaluation: a Steps record of callables); the loop imports nothing of the trainer.

"""The loop behind Trainer.train()."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import torch
import torch.distributed as dist
from torch import nn

from pitstop import Checkpoint, Checkpointer, ConfigError, Progress, ResumableSampler, StopRequest
from pitstop.core.saving.targets import plan_run
from pitstop.train.records import TrainConfig, TrainState
from pitstop.train.report import Reporter

__all__ = ["Steps", "TrainLoop", "Trained"]


def _many_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _batch_size_of(batch: object) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor) and item.dim():
                return int(item.shape[0])
    return 0


class Trained(Protocol):
    """What the loop uses of the trainer that runs it (pitstop.train.trainer.Trainer)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def sampler(self) -> ResumableSampler: ...

    @property
    def loader(self) -> Iterable[Any]: ...

    @property
    def reporter(self) -> Reporter: ...

    @property
    def stop(self) -> StopRequest: ...


@attrs.frozen
class Steps:
    """The trainer's steps that the loop drives."""

    micro_step: Callable[[Any, int], torch.Tensor]
    """Forward and backward one micro-batch of a window of ``accumulate``; its (detached)
    share of the loss."""
    update: Callable[[], None]
    """One optimizer update: step, clear gradients, schedule, average."""
    evaluate: Callable[[], dict[str, float]]
    """The evaluation's metrics (``{}``: no evaluation)."""


class TrainLoop:
    """One train() call: its limits, its losses, and the loop itself."""

    def __init__(
        self,
        trainer: Trained,
        steps: Steps,
        config: TrainConfig,
        checkpointer: Checkpointer | None,
        restored: Progress,
        resumed_from: Path | None,
    ) -> None:
        self.trainer = trainer
        self.steps = steps
        self.config = config
        self.checkpointer = checkpointer
        self.restored = restored
        self.resumed_from = resumed_from
        self.target = plan_run(restored, max_steps=config.max_steps, epochs=config.epochs)
        self.per_epoch = trainer.sampler.batches_per_epoch // config.accumulate
        if self.per_epoch == 0:
            raise ConfigError(
                f"accumulate={config.accumulate} needs more micro-batches than the "
                f"{trainer.sampler.batches_per_epoch} an epoch has"
            )
        self.losses: list[tuple[int, float]] = []
        # The highest save sequence number seen: a higher one is a newly published file.
        self.published = 0
        if checkpointer is not None:
            self.published = max((c.seq for c in checkpointer.checkpoints()), default=0)

    def total_steps(self) -> int | None:
        """The absolute step the run ends at, if no stop comes first."""
        ends = []
        if self.target.step is not None:
            ends.append(self.target.step)
        if self.target.epoch is not None:
            left = self.target.epoch - self.restored.epoch
            done = min(self.restored.batch_in_epoch, self.per_epoch)
            ends.append(self.restored.step + max(0, left * self.per_epoch - done))
        return min(ends) if ends else None

    def run(self) -> TrainState:
        trainer = self.trainer
        trainer.reporter.started(
            restored=self.restored,
            target_step=self.total_steps(),
            resumed_from=self.resumed_from,
        )
        trainer.model.train()
        trainer.optimizer.zero_grad()
        progress = self.restored
        metrics: dict[str, float] | None = None
        self.agree_stop()
        while not self.target.reached(progress) and not self.stopping:
            if progress.batch_in_epoch >= self.per_epoch:
                progress = progress.next_epoch()
                continue
            progress, metrics = self.epoch(progress)
        if self.stopping:
            self.save("finish", progress, stop=trainer.stop)
            return self.state(progress, {})
        final = metrics if metrics is not None else self.steps.evaluate()
        if final and metrics is None:
            trainer.reporter.evaluated(progress, final)
        self.save("finish", progress, metrics=final or None)
        return self.state(progress, final)

    def epoch(self, progress: Progress) -> tuple[Progress, dict[str, float] | None]:
        """Train from ``progress`` to the end of its epoch, a limit, or a stop request.

        Returns the progress reached and the metrics evaluated at that step (if any).
        """
        trainer, accumulate = self.trainer, self.config.accumulate
        trainer.sampler.set_position(progress, accumulate=accumulate)
        window: list[torch.Tensor] = []
        samples = 0
        metrics: dict[str, float] | None = None
        for batch in trainer.loader:
            if not window and self.stopping:
                break  # stop between windows: nothing half-done to finish
            window.append(self.steps.micro_step(batch, accumulate))
            samples += _batch_size_of(batch)
            if len(window) < accumulate:
                continue  # a stop request waits for the end of the accumulation window
            self.steps.update()
            if self.checkpointer is None:  # else maybe_save agrees, below
                self.agree_stop()
            loss = float(torch.stack(window).sum().item())
            progress = progress.advance(samples=samples)
            window, samples = [], 0
            if progress.batch_in_epoch >= self.per_epoch:
                progress = progress.next_epoch()
            self.losses.append((progress.step, loss))
            trainer.reporter.stepped(progress, loss=loss, lr=self.lr())
            metrics = None
            every = self.config.eval_every
            if every is not None and progress.step % every == 0:
                metrics = self.steps.evaluate()
                if metrics:
                    trainer.reporter.evaluated(progress, metrics)
            self.save("maybe_save", progress, metrics=metrics, stop=trainer.stop)
            if self.stopping or self.target.reached(progress) or progress.batch_in_epoch == 0:
                break
        return progress, metrics

    def agree_stop(self) -> None:
        """With several ranks, agree on the stop request now (a collective): at the start, and
        after each update when no Checkpointer's maybe_save agrees it."""
        if _many_ranks():
            self.trainer.stop.sync()

    @property
    def stopping(self) -> bool:
        """Whether to stop: the agreed answer with several ranks, else the request itself."""
        return bool(self.trainer.stop)

    def lr(self) -> float | None:
        groups = self.trainer.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else None

    def save(
        self,
        call: Literal["maybe_save", "finish"],
        progress: Progress,
        *,
        metrics: Mapping[str, float] | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        started = time.perf_counter()
        saver = checkpointer.maybe_save if call == "maybe_save" else checkpointer.finish
        saved: Checkpoint | None = saver(progress, metrics=metrics, stop=stop)
        blocked = time.perf_counter() - started
        if saved is not None and saved.seq > self.published:
            self.published = saved.seq
            try:
                size = saved.path.stat().st_size
            except OSError:
                size = 0
            self.trainer.reporter.published(saved, size=size, blocked=blocked)

    def state(self, progress: Progress, metrics: Mapping[str, float]) -> TrainState:
        return TrainState(
            progress=progress,
            restored=self.restored,
            target=self.target,
            stop_reason=self.trainer.stop.reason if self.trainer.stop else None,
            metrics=dict(metrics),
            losses=tuple(self.losses),
        )
