"""``pitstop train``: run the reference trainer from a YAML configuration."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from pitstop.errors import ConfigError

__all__ = ["add_parser", "run_train"]


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


def run_train(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop train``; 0 after a normal end or a stop, 2 for a bad configuration."""
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
        result = train_from_config(config, reporter=reporter)
    except ConfigError as exc:
        errors.print(f"[red]error:[/red] {escape(str(args.config))}: {escape(str(exc))}")
        return 2
    if result.stop_reason is not None and result.checkpoint_dir is not None:
        reporter.line(
            f"paused: {result.checkpoint_dir}/last holds step {result.steps}; continue with "
            f"--resume"
        )
    return 0
