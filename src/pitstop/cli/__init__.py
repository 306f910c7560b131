"""The ``pitstop`` command line.

Exit status: 0 success, 1 a check failed (a corrupt checkpoint) or the command could not do its
work (one ``error:`` line naming the user's path, never a traceback), 2 bad usage or
configuration. Subcommands arrive with the features behind them; each one that exists does real
work.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

import pitstop
from pitstop.cli import demo as cli_demo
from pitstop.cli import export as cli_export
from pitstop.cli import importing as cli_import
from pitstop.cli import inspect as cli_inspect
from pitstop.cli import prune as cli_prune
from pitstop.cli import train as cli_train
from pitstop.errors import PitstopError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pitstop", description="Checkpoint-and-resume for PyTorch training loops."
    )
    parser.add_argument("--version", action="version", version=f"pitstop {pitstop.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_demo.add_parser(commands)
    ls = commands.add_parser("ls", help="list the checkpoints of a directory")
    ls.add_argument(
        "directory",
        help="a checkpoint directory (e.g. runs/demo/resumed/checkpoints, which the demo writes)",
    )
    ls.add_argument(
        "--check",
        action="store_true",
        help="verify every checkpoint and say which one a resume would use, and why",
    )
    ls.add_argument(
        "--json", action="store_true", help="one JSON object per checkpoint instead of a table"
    )
    verify = commands.add_parser(
        "verify", help="check every byte of a checkpoint (a pointer's own target; no fallback)"
    )
    verify.add_argument("path", help="a checkpoint file, a pointer (DIR/best) or a directory")
    cli_inspect.add_parser(commands)
    cli_train.add_parser(commands)
    cli_export.add_parser(commands)
    cli_prune.add_parser(commands)
    cli_import.add_parser(commands)
    return parser


def _subject(args: argparse.Namespace) -> str | None:
    """The path an error of this command is about: what the user asked it to write or read."""
    for name in ("out", "directory", "path", "checkpoint", "output_dir", "source"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            return value
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pitstop`` command line; return the process exit status."""
    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # logs and pipes: keep tables on one line per row
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from pitstop.cli.demo import run_demo

            return run_demo(console, ranks=args.ranks)
        if args.command == "train":
            return cli_train.run_train(console, args)
        if args.command == "export":
            return cli_export.run_export(console, args)
        if args.command == "inspect":
            return cli_inspect.run_inspect(console, args)
        if args.command == "prune":
            return cli_prune.run_prune(console, args)
        if args.command == "import":
            return cli_import.run_import(console, args)
        from pitstop.cli import listing

        if args.command == "ls":
            return listing.list_directory(
                console, args.directory, check=args.check, as_json=args.json
            )
        if args.command == "verify":
            return listing.verify_checkpoint(console, args.path)
    except PitstopError as exc:
        from pitstop.cli.common import scrub_temp_names

        message = scrub_temp_names(str(exc), exc)
        console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        return 1
    except OSError as exc:  # permissions, a read-only filesystem, a full disk: one line
        from pitstop.cli.common import os_error_message

        message = os_error_message(exc, _subject(args))
        console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        return 1
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others
