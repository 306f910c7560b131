# YAML runs: a run configuration in, a trained (or paused) run out.
#
# Rules: the configuration is parsed strictly (pitstop.train.config); everything random is
# seeded from it (run.seed: Python, NumPy when installed, torch — so the model's initial
# weights; data.seed: the data and its shuffle), so two runs of one file compute the same
# thing. Resuming (resume=True or checkpoint.resume: true) continues from the checkpoint
# directory's `last`; with nothing there the run starts fresh (a directory that does not exist
# at all — a typo? — says so in one warning line). The checkpoints store the whole
# configuration but its checkpoint section (RunConfig.stored); the limits, the output directory,
# the device and the evaluation and log intervals may change on resume (config.MAY_CHANGE, the
# Checkpointer's config_may_change), so a resume with a raised --max-steps passes the
# compatibility check and says what changed. The scheduler's shape is a plain function of the step
# (a closure, which LambdaLR does not store), so a resume uses the current scheduler.max_steps.
# How: build the task, model, AdamW, LambdaLR and AveragedModel, then Trainer.train.

"""train_from_config: run the reference trainer from a YAML file or a mapping."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from pitstop.errors import ConfigError
from pitstop.train.config import MAY_CHANGE, RunConfig, SchedulerSection, load_config
from pitstop.train.report import Reporter
from pitstop.train.task import make_evaluate, make_model, make_task, mse_loss
from pitstop.train.trainer import TrainConfig, Trainer

__all__ = ["TrainResult", "train_from_config", "warmup_cosine"]

log = logging.getLogger("pitstop.train")


@attrs.frozen(kw_only=True)
class TrainResult:
    """What a YAML run did.

    ``steps``: the absolute final step (a resumed run counts from the run's beginning, not
    from the resume). ``start_step``: the step it resumed at (0 for a fresh run).
    ``stop_reason``: ``None`` after a normal end. ``losses``: ``(step, loss)`` of each update
    this call made. ``metrics``: the final evaluation (empty when stopped).
    """

    steps: int
    epoch: int
    start_step: int
    stop_reason: str | None
    checkpoint_dir: Path | None
    losses: tuple[tuple[int, float], ...]
    metrics: Mapping[str, float]

    @property
    def new_updates(self) -> int:
        """Optimizer updates this call made."""
        return self.steps - self.start_step


def warmup_cosine(scheduler: SchedulerSection) -> Callable[[int], float]:
    """Return the learning-rate factor of update ``step`` (0-based): a linear warm-up over
    ``warmup_steps``, then a cosine from 1 to 0 at ``max_steps`` (``None``: stay at 1)."""
    warmup, horizon = scheduler.warmup_steps, scheduler.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if horizon is None:
            return 1.0
        span = max(1, horizon - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))

    return factor


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: 'cuda' is not available here (torch.cuda.is_available())")
    return torch.device(name)


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def train_from_config(
    config: RunConfig | Mapping[str, Any] | str | os.PathLike[str],
    resume: bool = False,
    *,
    reporter: Reporter | None = None,
) -> TrainResult:
    """Train the built-in task as ``config`` (a YAML path, a mapping, or a RunConfig) says.

    ``resume`` (or ``checkpoint.resume: true``) continues from the checkpoint directory's
    ``last``; ``run.max_steps`` is then an absolute target: ``max(restored, requested)``.
    Raises :class:`~pitstop.errors.ConfigError` naming the key path of every problem.
    """
    cfg = load_config(config)
    resume = resume or cfg.checkpoint.resume
    checkpoint_dir = cfg.checkpoint_dir
    if resume and checkpoint_dir is None:
        raise ConfigError("checkpoint.resume: resuming needs checkpoint.enabled: true")
    device = _device(cfg.run.device)
    if resume and checkpoint_dir is not None and not checkpoint_dir.exists():
        log.warning("resume: %s does not exist; the run starts fresh", checkpoint_dir)
    output_dir = Path(cfg.run.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(
            f"run.output_dir (--output-dir): {output_dir} is a file, and a run needs a "
            f"directory there (created when missing); name a new or existing directory"
        )
    output_dir.mkdir(parents=True, exist_ok=True)

    _seed(cfg.run.seed)
    task = make_task(cfg.data)
    model = make_model(cfg.model, task.features).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.scheduler))
    ema = None
    if cfg.ema.enabled:
        average = get_ema_multi_avg_fn(cfg.ema.decay)  # type: ignore[no-untyped-call]
        ema = AveragedModel(model, multi_avg_fn=average, use_buffers=True)
    trainer = Trainer(
        model,
        optimizer,
        data=task.train,
        batch_size=cfg.data.batch_size,
        loss_fn=mse_loss,
        evaluate=make_evaluate(task.val_inputs, task.val_targets),
        ema=ema,
        scheduler=scheduler,
        data_seed=cfg.data.seed,
        device=device,
        config=cfg.stored(),
        config_may_change=MAY_CHANGE,
        reporter=reporter,
    )
    state = trainer.train(
        TrainConfig(
            epochs=cfg.run.epochs,
            max_steps=cfg.run.max_steps,
            accumulate=cfg.run.accumulate,
            eval_every=cfg.run.eval_every,
        ),
        checkpoint_dir=checkpoint_dir,
        resume_from="last" if resume else None,
        policy=cfg.checkpoint.policy(),
        async_save=cfg.checkpoint.async_,
        overwrite=cfg.checkpoint.overwrite,
    )
    return TrainResult(
        steps=state.step,
        epoch=state.epoch,
        start_step=state.restored.step,
        stop_reason=state.stop_reason,
        checkpoint_dir=checkpoint_dir,
        losses=state.losses,
        metrics=state.metrics,
    )
