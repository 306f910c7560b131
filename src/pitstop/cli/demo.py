"""``pitstop demo``: train, pause with a real SIGTERM, resume, and compare — on the CPU.

In ``runs/demo/`` (under the current directory) it:

1. trains the built-in task straight through to step 40 (``runs/demo/straight``);
2. trains it again in a child process (``pitstop train``) and sends that process a real SIGTERM
   mid-run: the child finishes its accumulation window, saves ``last`` and exits 0;
3. resumes that run to the same target (``runs/demo/resumed``);
4. lists the resumed run's checkpoints, says whether its final weights equal the straight
   run's bit for bit, and plots both loss curves to ``runs/demo/resume.png`` (matplotlib, when
   installed).

Exit status 0 when the weights are bitwise equal, 1 otherwise.

``pitstop demo --ranks N`` (N >= 2) runs the same story with N gloo ranks, one process each,
and a SIGTERM to one of them: see :mod:`pitstop.cli.demo_multirank`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from pitstop.shell.store.atomic import write_atomically

__all__ = ["DEMO_CONFIG", "add_parser", "run_demo"]

TARGET = 40
STOP_AFTER = 17  # the child is signalled once it reports this step

DEMO_CONFIG: dict[str, Any] = {
    "run": {"max_steps": TARGET, "seed": 0, "device": "cpu", "accumulate": 2, "eval_every": 5},
    "model": {"hidden": 64, "dropout": 0.1},
    "data": {"samples": 512, "val_samples": 128, "features": 8, "batch_size": 16, "seed": 0},
    "optimizer": {"lr": 0.03, "weight_decay": 0.01},
    "scheduler": {"warmup_steps": 4, "max_steps": TARGET},
    "ema": {"enabled": True, "decay": 0.9},
    "checkpoint": {"every_steps": 10, "keep_last": 2, "best": "val_loss"},
}
"""The demo's run configuration (``run.output_dir`` is filled in per run)."""

_STEP_LINE = re.compile(r"^step (\d+)/\d+ epoch \d+ loss (\S+)")


def _ranks(text: str) -> int:
    try:
        ranks = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks must be an integer, got {text!r}") from None
    if ranks < 1:
        raise argparse.ArgumentTypeError(f"--ranks must be >= 1, got {ranks}")
    return ranks


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand to ``commands``."""
    demo = commands.add_parser(
        "demo",
        help="show pitstop at work on the CPU",
        description="Train the built-in task, stop it with a real SIGTERM, resume it, list its "
        "checkpoints and compare it bit for bit with a straight run. With --ranks N: the same "
        "with N gloo ranks (one process each) and a SIGTERM to one of them.",
    )
    demo.add_argument(
        "--ranks",
        type=_ranks,
        default=1,
        help="how many ranks (processes on gloo) train together; default 1",
    )


def _config(output_dir: Path) -> dict[str, Any]:
    return {**DEMO_CONFIG, "run": {**DEMO_CONFIG["run"], "output_dir": str(output_dir)}}


def _signalled_run(console: Console, config_path: Path) -> tuple[list[tuple[int, float]], int]:
    """Run ``pitstop train`` in a child, SIGTERM it at STOP_AFTER; return its losses, exit code."""
    command = [sys.executable, "-m", "pitstop", "train", "--config", str(config_path), "--quiet"]
    losses: list[tuple[int, float]] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            for line in child.stdout:
                match = _STEP_LINE.match(line)
                if match:
                    losses.append((int(match.group(1)), float(match.group(2))))
                if line.startswith(("saved ", "stopped ", "paused")):
                    console.print(f"  [dim]child:[/dim] {line.rstrip()}", highlight=False)
                if match and int(match.group(1)) == STOP_AFTER:
                    console.print(
                        f"  sending SIGTERM to the child (pid {child.pid}) at step {STOP_AFTER}"
                    )
                    child.send_signal(signal.SIGTERM)
            return losses, child.wait(timeout=600)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def _plot(
    path: Path,
    straight: list[tuple[int, float]],
    stopped: list[tuple[int, float]],
    resumed: list[tuple[int, float]],
    stop_step: int,
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(*zip(*straight, strict=True), label="straight run", linewidth=3, alpha=0.4)
    axes.plot(*zip(*stopped, strict=True), "o-", markersize=3, label="stopped by SIGTERM")
    axes.plot(*zip(*resumed, strict=True), "s-", markersize=3, label="resumed")
    axes.axvline(stop_step, color="grey", linestyle="--", label=f"stop at step {stop_step}")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_yscale("log")
    axes.set_title("pitstop: a paused and resumed run follows the straight one exactly")
    axes.legend()
    figure.tight_layout()
    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=120))
    plt.close(figure)
    return True


def run_demo(console: Console, ranks: int = 1) -> int:
    """Run the demo in ``runs/demo``; return 0 when the resumed run equals the straight one.

    ``ranks`` > 1: the multi-rank demo in ``runs/demo-ranks`` instead.
    """
    if ranks > 1:
        from pitstop.cli.demo_multirank import run_ranks_demo

        return run_ranks_demo(console, ranks)
    root = Path("runs/demo")
    # Said before torch is imported (seconds on a cold start), so the first line comes at once.
    console.print(f"[bold]1.[/bold] training straight through to step {TARGET} ({root}/straight)")

    import torch

    import pitstop
    from pitstop.cli.listing import list_directory
    from pitstop.train.report import Reporter
    from pitstop.train.run import train_from_config

    for part in ("straight", "resumed"):
        shutil.rmtree(root / part, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    straight = train_from_config(_config(root / "straight"), reporter=Reporter())

    console.print(f"[bold]2.[/bold] training again in a child process ({root}/resumed)")
    config_path = root / "resumed.yaml"
    text = yaml.safe_dump(_config(root / "resumed"), sort_keys=False)
    write_atomically(config_path, lambda file: file.write(text.encode("utf-8")))
    stopped, code = _signalled_run(console, config_path)
    if code != 0:
        console.print(f"[red]the child exited with status {code}[/red]")
        return 1

    console.print(f"[bold]3.[/bold] resuming it to step {TARGET}")
    resumed = train_from_config(config_path, resume=True, reporter=Reporter())
    console.print(f"  resumed at step {resumed.start_step}, made {resumed.new_updates} updates")

    console.print("[bold]4.[/bold] the resumed run's checkpoints")
    list_directory(console, str(root / "resumed" / "checkpoints"))

    a = pitstop.load(root / "straight" / "checkpoints" / "final")["weights"]
    b = pitstop.load(root / "resumed" / "checkpoints" / "final")["weights"]
    equal = a.keys() == b.keys() and all(
        a[kind].keys() == b[kind].keys()
        and all(torch.equal(a[kind][name], b[kind][name]) for name in a[kind])
        for kind in a
    )
    if equal:
        console.print(
            "[green]bitwise equal:[/green] the resumed run's final raw and EMA weights are "
            "identical to the straight run's"
        )
    else:
        console.print("[red]NOT equal:[/red] the resumed run differs from the straight run")

    picture = root / "resume.png"
    with contextlib.suppress(FileNotFoundError):
        picture.unlink()
    if _plot(picture, list(straight.losses), stopped, list(resumed.losses), resumed.start_step):
        console.print(f"loss curves of both runs: {picture}")
    else:
        console.print(
            "matplotlib is not installed, so no plot (pip install 'pitstop[plot]')", markup=False
        )
    return 0 if equal else 1
