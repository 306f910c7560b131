"""``pitstop export``: write a checkpoint's raw or EMA weights as a plain state dict.

It never replaces an existing file unless ``--force`` is given, never writes onto a directory,
and says when a pointer's target did not verify and it exported the previous valid checkpoint
instead (and from what).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from pitstop.errors import ConfigError

__all__ = ["add_parser", "run_export"]


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``export`` subcommand to ``commands``."""
    export = commands.add_parser(
        "export",
        help="write a checkpoint's weights as a plain state dict (.pt or .safetensors)",
    )
    export.add_argument(
        "checkpoint", help="a checkpoint file, a pointer (DIR/best) or a directory (its last)"
    )
    export.add_argument("out", help="the file to write; .pt or .safetensors")
    export.add_argument(
        "--weights", choices=["raw", "ema"], default="raw", help="which parameter set"
    )
    export.add_argument("--dtype", help="convert floating-point tensors, e.g. bf16, fp16, fp32")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run_export(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop export``; 0 on success, 2 for a bad suffix or dtype, 1 otherwise."""
    from pathlib import Path

    from pitstop.cli.common import loading_target
    from pitstop.cli.progress import progress_bars
    from pitstop.formatting import format_size
    from pitstop.shell.portable.weights import export_weights

    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    out = Path(args.out)
    if out.is_dir():
        errors.print(
            f"[red]error:[/red] {escape(str(out))} is a directory; name the file to write, such "
            f"as {escape(str(out / 'model.pt'))}"
        )
        return 1
    if (out.exists() or out.is_symlink()) and not args.force:
        errors.print(f"[red]error:[/red] {escape(str(out))} exists; pass --force to replace it")
        return 1
    with progress_bars(console):
        target = loading_target(args.checkpoint)
        if target.note:
            console.print(
                f"[yellow]fell back:[/yellow] {escape(target.note)}",
                highlight=False,
                soft_wrap=True,
            )
        try:
            path = export_weights(target.path, out, weights=args.weights, dtype=args.dtype)
        except ConfigError as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}")
            return 2
    source = f" of {target.path.name}" if target.pointer is not None else ""
    console.print(
        f"wrote {escape(str(path))} ({args.weights} weights{source}"
        f"{f', {args.dtype}' if args.dtype else ''}, {format_size(path.stat().st_size)})",
        highlight=False,
        soft_wrap=True,
    )
    return 0
