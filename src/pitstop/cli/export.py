"""``pitstop export``: write a checkpoint's raw or EMA weights as a plain state dict."""

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


def run_export(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop export``; 0 on success, 2 for a bad suffix or dtype."""
    from pitstop.formatting import format_size
    from pitstop.shell.weights import export_weights

    try:
        path = export_weights(args.checkpoint, args.out, weights=args.weights, dtype=args.dtype)
    except ConfigError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[red]error:[/red] {escape(str(exc))}"
        )
        return 2
    console.print(
        f"wrote {path} ({args.weights} weights{f', {args.dtype}' if args.dtype else ''}, "
        f"{format_size(path.stat().st_size)})",
        highlight=False,
        soft_wrap=True,
    )
    return 0
