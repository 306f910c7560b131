# The reference trainer: a compact training loop on the public Checkpointer API.
#
# Rules (the seed's "Stop and resume"): SIGINT/SIGTERM, while train() runs in the main thread,
# only set a StopRequest; trainer.stop.request() does the same from any code. A stop is
# honoured at the end of the current accumulation window: the update happens, `last` is saved
# with the stop reason (when a checkpoint directory is configured), the final evaluation is
# skipped, and train() returns with stop_reason set. A normal end evaluates and saves `final`.
# Limits are cumulative and absolute (plan_run): max_steps / epochs at or below the restored
# position do no updates, and the run still ends normally (a final evaluation, the final
# pointer), which is why a stop request, not a shorter max_steps, is the transparent way to
# pause. One optimizer update = `accumulate` micro-batches; an epoch is
# batches_per_epoch // accumulate updates (trailing micro-batches that cannot fill a window
# are not read). Data order is epoch-addressed (ResumableSampler positioned from the Progress),
# the DataLoader gets its own generator so creating an iterator never draws from the global
# RNG, and evaluation draws none: so N steps, stop, resume, M steps is bitwise the same run as
# N + M steps on the CPU.
# How: a Checkpointer per train() call, with optimizer, scheduler and sampler as components; the
# loop itself is pitstop.train.loop, given the trainer's parts and its three steps (micro-step,
# update, evaluation); a Reporter hears about steps, evaluations and saves; save_model writes
# through pitstop.shell.store.atomic (temp, fsync, rename, directory fsync).

"""Trainer: the reference training loop with stop requests, checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sized
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, Dataset

# The checkpointing side uses only pitstop's public API (it is also the proof that it is enough).
from pitstop import (
    Best,
    Checkpointer,
    ConfigError,
    Policy,
    Progress,
    ResumableSampler,
    StopRequest,
)
from pitstop.core.compat import may_change_patterns
from pitstop.core.guard import foreign_save_problem
from pitstop.core.validators import is_int
from pitstop.shell.portable.weights import plain_state_dict
from pitstop.shell.store.atomic import write_atomically
from pitstop.train.loop import Steps, TrainLoop
from pitstop.train.records import TrainConfig, TrainState
from pitstop.train.report import Reporter

__all__ = ["TrainConfig", "TrainState", "Trainer"]

log = logging.getLogger("pitstop.train")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
EvaluateFn = Callable[[nn.Module], Mapping[str, float]]


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def _signals(stop: StopRequest) -> contextlib.AbstractContextManager[object]:
    """Catch SIGINT/SIGTERM in the main thread; elsewhere only stop.request() stops."""
    if threading.current_thread() is threading.main_thread():
        return stop.catch_signals()
    return contextlib.nullcontext()


class Trainer:
    """A compact training loop that pauses on a signal and resumes exactly.

    ``model``: the module to train, already on ``device`` (a DDP or compiled wrapper is fine;
    checkpoints hold the plain model). ``optimizer`` (and ``scheduler``, stepped once per
    update) work on its parameters. ``data``: a map-style dataset, read in epoch-addressed
    shuffled order (seeded by ``data_seed``) in batches of ``batch_size``. ``loss_fn(model,
    batch)`` returns the mean loss of a batch. ``evaluate(model)`` returns metrics such as
    ``{"val_loss": ...}``; it must draw no random numbers. ``ema``: an AveragedModel updated
    after every optimizer step. ``config``: the run's configuration, stored in checkpoints and
    compared on resume; ``config_may_change``: its key paths or globs that a resume may change
    (limits that grow, such as ``max_steps``; the output directory), only reported.
    ``reporter`` hears about steps, evaluations and checkpoints (silent by default). During
    :meth:`train`, ``trainer.stop`` is the run's :class:`~pitstop.StopRequest`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        data: Dataset[Any],
        batch_size: int,
        loss_fn: LossFn,
        evaluate: EvaluateFn | None = None,
        ema: AveragedModel | None = None,
        scheduler: LRScheduler | None = None,
        data_seed: int = 0,
        num_workers: int = 0,
        device: str | torch.device = "cpu",
        config: Mapping[str, Any] | None = None,
        config_may_change: Iterable[str] = (),
        reporter: Reporter | None = None,
    ) -> None:
        if not is_int(num_workers) or num_workers < 0:
            raise ConfigError(f"Trainer num_workers must be an int >= 0, got {num_workers!r}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.evaluate = evaluate
        self.ema = ema
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.config = config
        self.config_may_change = may_change_patterns(config_may_change)
        self.reporter = reporter if reporter is not None else Reporter()
        self.sampler = ResumableSampler(len(cast(Sized, data)), batch_size, seed=data_seed)
        self.loader: DataLoader[Any] = DataLoader(
            data,
            batch_sampler=self.sampler,
            num_workers=num_workers,
            # Creating an iterator draws its base seed from this generator, never from the
            # global RNG, so a resumed run's draws line up with the uninterrupted run's.
            generator=torch.Generator(),
        )
        self.stop = StopRequest()

    # --- the run --------------------------------------------------------------------------

    def train(
        self,
        config: TrainConfig,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        policy: Policy | None = None,
        async_save: bool | Literal["overlap"] = False,
        overwrite: bool = False,
    ) -> TrainState:
        """Train until ``config``'s limits or a stop request; return where the run ended.

        ``checkpoint_dir``: save there under ``policy`` (default: keep the last 3, ``best`` by
        ``val_loss`` when there is an evaluation, ``final`` at a normal end). ``resume_from``:
        ``"last"``, ``"best"``, ``"final"``, a pointer such as ``checkpoint_dir / "last"``
        (nothing there yet: start fresh) or a checkpoint file; it needs ``checkpoint_dir``.
        Without ``resume_from``, a ``checkpoint_dir`` that already holds checkpoints raises
        :class:`~pitstop.errors.ConfigError` before the first step, naming it and its newest
        step, unless ``overwrite`` lets this run replace them.
        """
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"Trainer.train config must be a TrainConfig, got {config!r}")
        if resume_from is not None and checkpoint_dir is None:
            raise ConfigError(
                f"Trainer.train resume_from={os.fspath(resume_from)!r} needs a checkpoint_dir "
                f"to continue saving into"
            )
        self.stop = StopRequest()
        with contextlib.ExitStack() as stack:
            stack.enter_context(_signals(self.stop))  # first: a stop while opening is heard
            stack.callback(self.reporter.close)
            checkpointer: Checkpointer | None = None
            if checkpoint_dir is not None:
                checkpointer = stack.enter_context(
                    Checkpointer(
                        checkpoint_dir,
                        model=self.model,
                        ema=self.ema,
                        state=self._components(),
                        policy=policy if policy is not None else self._default_policy(),
                        config=self.config,
                        config_may_change=self.config_may_change,
                        async_save=async_save,
                        overwrite=overwrite,
                    )
                )
            restored, resumed_from = Progress(), None
            if checkpointer is not None and resume_from is None and not overwrite:
                _refuse_another_run(checkpointer)  # before the first step, not at the first save
            if checkpointer is not None and resume_from is not None:
                restored = checkpointer.resume(resume_from)
                resumed_from = checkpointer.resumed_from
            steps = Steps(self._micro_step, self._update, self._evaluate)
            state = TrainLoop(self, steps, config, checkpointer, restored, resumed_from).run()
            self.reporter.finished(state)
            return state

    def _components(self) -> dict[str, Any]:
        components: dict[str, Any] = {"optimizer": self.optimizer}
        if self.scheduler is not None:
            components["scheduler"] = self.scheduler
        components["sampler"] = self.sampler
        return components

    def _default_policy(self) -> Policy:
        return Policy(best=Best("val_loss")) if self.evaluate is not None else Policy()

    # --- one micro-batch, one update --------------------------------------------------------

    def _micro_step(self, batch: Any, accumulate: int) -> torch.Tensor:
        """Forward and backward one micro-batch; return its (detached) share of the loss."""
        loss = self.loss_fn(self.model, _to_device(batch, self.device)) / accumulate
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return loss.detach()

    def _update(self) -> None:
        """One optimizer update: step, clear gradients, schedule, average."""
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def _evaluate(self) -> dict[str, float]:
        if self.evaluate is None:
            return {}
        return {str(key): float(value) for key, value in self.evaluate(self.model).items()}

    # --- exporting ----------------------------------------------------------------------------

    def save_model(
        self, path: str | os.PathLike[str], *, weights: Literal["raw", "ema"] = "raw"
    ) -> Path:
        """Write the current weights to ``path`` (``.pt``) as a plain CPU state dict.

        No wrapper prefixes (``module.``, ``_orig_mod.``); loadable with
        ``torch.load(path, weights_only=True)``. ``weights="ema"`` writes the averaged weights.
        The file appears atomically and durably (temp file, fsync, rename, directory fsync);
        a failure raises :class:`~pitstop.errors.SaveError` naming ``path`` and leaves it as it
        was. To export weights from a saved checkpoint instead, use
        :func:`pitstop.export_weights`.
        """
        target = Path(path)
        if target.suffix.lower() != ".pt":
            raise ConfigError(f"save_model writes .pt files, got {target}")
        if weights not in ("raw", "ema"):
            raise ConfigError(f"save_model weights must be 'raw' or 'ema', got {weights!r}")
        if weights == "ema" and self.ema is None:
            raise ConfigError("save_model weights='ema': this trainer has no EMA")
        module = self.ema if weights == "ema" and self.ema is not None else self.model
        plain = {
            name: tensor.detach().to("cpu", copy=True).contiguous()
            for name, tensor in plain_state_dict(module).items()
        }
        return write_atomically(target, lambda file: torch.save(plain, file))


def _refuse_another_run(checkpointer: Checkpointer) -> None:
    """Raise ConfigError when a run that does not resume would replace another's checkpoints."""
    existing = checkpointer.checkpoints()
    newest = max(existing, key=lambda c: (c.step, c.seq), default=None)
    problem = foreign_save_problem(
        None if newest is None else (newest.step, newest.path.name),
        directory=str(checkpointer.directory),
        count=len(existing),
        resume="pass --resume (checkpoint.resume: true)",
        overwrite="pass --overwrite (checkpoint.overwrite: true) to replace them",
    )
    if problem is not None:
        raise ConfigError(problem)
