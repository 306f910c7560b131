"""The ``pitstop`` command line.

Exit status: 0 success, 1 a check failed (a corrupt checkpoint), 2 bad usage or configuration.
Subcommands arrive with the features behind them; each one that exists does real work.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

import pitstop
from pitstop.cli import export as cli_export
from pitstop.cli import train as cli_train
from pitstop.errors import PitstopError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pitstop", description="Checkpoint-and-resume for PyTorch training loops."
    )
    parser.add_argument("--version", action="version", version=f"pitstop {pitstop.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("demo", help="show pitstop at work on the CPU")
    ls = commands.add_parser("ls", help="list the checkpoints of a directory")
    ls.add_argument("directory", help="a checkpoint directory (e.g. runs/demo/checkpoints)")
    ls.add_argument(
        "--check",
        action="store_true",
        help="verify every checkpoint and say which one a resume would use, and why",
    )
    verify = commands.add_parser("verify", help="check every byte of a checkpoint")
    verify.add_argument("path", help="a checkpoint file, a pointer (DIR/best) or a directory")
    cli_train.add_parser(commands)
    cli_export.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pitstop`` command line; return the process exit status."""
    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 160  # logs and pipes: keep tables on one line per row
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from pitstop.cli.demo import run_demo

            return run_demo(console)
        if args.command == "train":
            return cli_train.run_train(console, args)
        if args.command == "export":
            return cli_export.run_export(console, args)
        from pitstop.cli import listing

        if args.command == "ls":
            return listing.list_directory(console, args.directory, check=args.check)
        if args.command == "verify":
            return listing.verify_checkpoint(console, args.path)
    except PitstopError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return 1
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others
