"""``pitstop import``: a torch.save, Lightning or Accelerate checkpoint as a pitstop one."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

__all__ = ["add_parser", "run_import"]


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``import`` subcommand to ``commands``."""
    command = commands.add_parser(
        "import",
        help="turn a torch.save, Lightning or Accelerate checkpoint into a pitstop one "
        "(weights_only reading: nothing is unpickled)",
    )
    command.add_argument(
        "source",
        help="a torch.save file ({'model': ..., 'optimizer': ..., 'step': ...}), a Lightning "
        ".ckpt, or an Accelerate save_state directory",
    )
    command.add_argument("directory", help="the pitstop checkpoint directory to write into")


def run_import(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop import``; 0 when written, 1 when the source is refused or missing."""
    from pitstop.cli.progress import progress_bars
    from pitstop.formatting import format_size
    from pitstop.shell.portable.importer import read_foreign, write_foreign

    foreign = read_foreign(args.source)
    for note in foreign.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False, soft_wrap=True)
    with progress_bars(console):
        record = write_foreign(foreign, args.directory)
    components = ", ".join(sorted(foreign.components)) or "none"
    console.print(
        f"imported {escape(str(foreign.source))} ({foreign.format}) as "
        f"{escape(str(record.path))}: step {record.step}, epoch {record.progress.epoch}; "
        f"model {len(foreign.weights)} tensors"
        + (f", EMA {len(foreign.ema)} tensors" if foreign.ema is not None else "")
        + f"; components: {escape(components)}; {format_size(record.size_bytes or 0)}",
        highlight=False,
        soft_wrap=True,
    )
    return 0
