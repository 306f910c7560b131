"""``pitstop train``: run the reference trainer from a YAML configuration."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from pitstop.errors import ConfigError
from pitstop.train.report import Reporter

if TYPE_CHECKING:
    from pitstop.core.records import Progress
    from pitstop.shell.checkpoint import Checkpoint
    from pitstop.train.records import TrainState

__all__ = ["add_parser", "run_train"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StoppedEarly(BaseException):
    """A stop signal before the trainer's own handlers: nothing was trained, nothing saved."""


class _EarlyStop:
    """SIGINT/SIGTERM while the run is imported and built: end it there, with status 0.

    Installed first thing, before torch is imported; the trainer's handlers replace it while it
    trains (and put it back after). Once training began, a late signal is only noted.
    """

    def __init__(self) -> None:
        self.building = True
        self.previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.building:
            self.building = False  # a second signal while unwinding must not interrupt it
            raise _StoppedEarly(signal.Signals(signum).name)

    def began(self) -> None:
        """Training began (the trainer's handlers are in place): a later signal ends nothing."""
        self.building = False

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``train`` subcommand to ``commands``."""
    train = commands.add_parser(
        "train",
        help="train the built-in task from a YAML configuration (pause: SIGTERM or Ctrl-C)",
        description="Train the built-in task from a YAML configuration. SIGTERM or one Ctrl-C "
        "finishes the current accumulation window, saves `last` and exits 0; a second Ctrl-C "
        "ends the process at once.",
    )
    train.add_argument("--config", required=True, help="the run's YAML file")
    train.add_argument("--output-dir", help="sets run.output_dir")
    train.add_argument(
        "--max-steps",
        type=int,
        help="sets run.max_steps and scheduler.max_steps: an absolute step, max(restored, N)",
    )
    train.add_argument("--device", choices=["cpu", "cuda"], help="sets run.device")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint directory's last (sets checkpoint.resume: true)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="without --resume, replace the checkpoints the directory already holds "
        "(sets checkpoint.overwrite: true; by default the run refuses to start)",
    )
    train.add_argument(
        "--quiet", action="store_true", help="plain log lines instead of a progress bar"
    )


class _Training(Reporter):
    """``reporter``, telling ``early`` when training begins."""

    def __init__(self, reporter: Reporter, early: _EarlyStop) -> None:
        self.reporter = reporter
        self.early = early

    def started(
        self, *, restored: Progress, target_step: int | None, resumed_from: Path | None
    ) -> None:
        self.early.began()
        self.reporter.started(restored=restored, target_step=target_step, resumed_from=resumed_from)

    def stepped(self, progress: Progress, *, loss: float, lr: float | None) -> None:
        self.reporter.stepped(progress, loss=loss, lr=lr)

    def evaluated(self, progress: Progress, metrics: Mapping[str, float]) -> None:
        self.reporter.evaluated(progress, metrics)

    def published(self, checkpoint: Checkpoint, *, size: int, blocked: float) -> None:
        self.reporter.published(checkpoint, size=size, blocked=blocked)

    def finished(self, state: TrainState) -> None:
        self.reporter.finished(state)

    def close(self) -> None:
        self.reporter.close()


def run_train(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop train``; 0 after a normal end or a stop, 2 for a bad configuration."""
    early = _EarlyStop()
    try:
        print(f"preparing the run from {args.config}", file=sys.stderr, flush=True)
        return _run(console, args, early)
    except _StoppedEarly as stopped:
        console.print(f"stopped before training began ({stopped}): nothing was trained or saved")
        return 0
    finally:
        early.restore()


def _run(console: Console, args: argparse.Namespace, early: _EarlyStop) -> int:
    from pitstop.train.config import load_config, override, read_yaml

    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        data = read_yaml(args.config)
    except ConfigError as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    try:
        config = load_config(
            override(
                data,
                output_dir=args.output_dir,
                max_steps=args.max_steps,
                device=args.device,
                resume=True if args.resume else None,
                overwrite=True if args.overwrite else None,
            )
        )
    except ConfigError as exc:
        errors.print(f"[red]error:[/red] {escape(str(args.config))}: {escape(str(exc))}")
        return 2

    from pitstop.train.report import PlainReporter, RichReporter
    from pitstop.train.run import train_from_config

    reporter = (
        PlainReporter(console, log_every=config.run.log_every)
        if args.quiet or not console.is_terminal
        else RichReporter(console)
    )
    try:
        result = train_from_config(config, reporter=_Training(reporter, early))
    except ConfigError as exc:
        errors.print(f"[red]error:[/red] {escape(str(args.config))}: {escape(str(exc))}")
        return 2
    if result.stop_reason is not None and result.checkpoint_dir is not None:
        reporter.line(
            f"paused: {result.checkpoint_dir}/last holds step {result.steps}; continue with "
            f"--resume"
        )
    return 0
