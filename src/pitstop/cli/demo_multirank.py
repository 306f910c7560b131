"""``pitstop demo --ranks N``: the demo with N gloo ranks, a SIGTERM to one of them — on the CPU.

In ``runs/demo-ranks/`` (under the current directory) it:

1. runs N ranks (``python -m pitstop.cli.demo_ranks``, one process each, a gloo process group
   on 127.0.0.1 at a free port) straight through to step 40 (``runs/demo-ranks/straight``);
2. runs them again (``runs/demo-ranks/resumed``), paced so that there is time to watch, and
   sends a real SIGTERM to the last rank's process only, once it reports step 17: every rank
   stops at the same step (``maybe_save`` agrees the stop) and one checkpoint is published, with the
   reason ``stop (SIGTERM)``;
3. resumes that run, all N ranks, to the same target;
4. lists its checkpoint directory (``pitstop ls``);
5. says whether the resumed run equals the straight run bit for bit: the final checkpoints'
   whole stored trees (weights, optimizer, every rank's RNG streams and sampler slice), each
   rank's live weights, and each rank's RNG draws after training.

Every child is ended (its process group killed if it is still alive when a stage ends) and
every wait has a timeout. Exit status 0 when everything is bitwise equal and the stop went as
described, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape

__all__ = ["STOP_AFTER", "TARGET", "run_ranks_demo"]

TARGET = 40
STOP_AFTER = 17  # the signalled rank gets SIGTERM once it reports this step
PACE_S = 0.1  # seconds per update in the signalled run: the signal lands long before the end
STAGE_TIMEOUT_S = 300.0  # a bound on a hang, never a timing assertion
_KILL_WAIT_S = 30.0
_STEP_LINE = re.compile(r"^step (\d+) loss ")
_STOPPED_LINE = re.compile(r"^stopped at step (\d+) \((.*)\)$")
_SHOWN = ("starting fresh", "resumed at", "stopped ", "finished ", "error ")  # every rank's
_SHOWN_BY_WRITER = ("saved ",)  # rank 0's only: every rank reports the same save
_PORT_IN_USE = ("EADDRINUSE", "address already in use")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class RankJob:
    """N rank processes of ``pitstop.cli.demo_ranks``; their lines on one queue; a context
    manager that kills (each rank's process group) whatever is still alive on exit."""

    def __init__(self, ranks: int, args: list[str]) -> None:
        self.ranks = ranks
        self.port = free_port()
        self.lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.outputs: dict[int, list[str]] = {rank: [] for rank in range(ranks)}
        self.procs: list[subprocess.Popen[str]] = []
        self._threads: list[threading.Thread] = []
        command = [sys.executable, "-m", "pitstop.cli.demo_ranks", *args]
        try:
            for rank in range(ranks):
                env = dict(os.environ)
                env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(ranks),
                    LOCAL_WORLD_SIZE=str(ranks),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(self.port),
                    PYTHONUNBUFFERED="1",
                    OMP_NUM_THREADS="1",
                )
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    text=True,
                    errors="replace",
                    bufsize=1,
                    start_new_session=True,  # its own process group, killed as one
                )
                self.procs.append(proc)
                thread = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.close()
            raise

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for raw in proc.stdout:
                self.lines.put((rank, raw.rstrip("\r\n")))
        self.lines.put((rank, None))

    def __enter__(self) -> RankJob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def follow(self, timeout: float) -> Iterator[tuple[int, str]]:
        """Each rank's lines as they come, until every rank's output has ended."""
        deadline = time.monotonic() + timeout
        open_ranks = set(range(self.ranks))
        while open_ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the ranks did not finish within {timeout:g} s")
            try:
                rank, line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                open_ranks.discard(rank)
                continue
            self.outputs[rank].append(line)
            yield rank, line

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit status (waits up to ``timeout`` seconds in all)."""
        deadline = time.monotonic() + timeout
        return [proc.wait(timeout=max(0.1, deadline - time.monotonic())) for proc in self.procs]

    def signal(self, rank: int, sig: int) -> int:
        """Send ``sig`` to rank ``rank``'s process only; return its pid."""
        pid = self.procs[rank].pid
        os.kill(pid, sig)
        return pid

    def close(self) -> None:
        """Kill every rank still alive (its whole process group); reap; join the readers."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_KILL_WAIT_S)
        for thread in self._threads:
            thread.join(timeout=5.0)
        for proc in self.procs:
            if proc.stdout is not None:
                with contextlib.suppress(OSError):
                    proc.stdout.close()


OnLine = Callable[[RankJob, int, str], None]


def _run_job(console: Console, ranks: int, args: list[str], on_line: OnLine | None = None) -> bool:
    """Run the ranks to their end, echoing what they say; True when every rank exited 0.

    A port taken between choosing it and binding it (rank 0 cannot listen) is retried with a
    new port, up to three times; nothing has trained then.
    """
    for attempt in range(3):
        with RankJob(ranks, args) as job:
            try:
                for rank, line in job.follow(STAGE_TIMEOUT_S):
                    if line.startswith(_SHOWN) or (rank == 0 and line.startswith(_SHOWN_BY_WRITER)):
                        console.print(f"  [dim]rank {rank}:[/dim] {escape(line)}", highlight=False)
                    if on_line is not None:
                        on_line(job, rank, line)
                codes = job.wait(STAGE_TIMEOUT_S)
            except (TimeoutError, subprocess.TimeoutExpired):
                console.print(f"[red]the ranks did not finish within {STAGE_TIMEOUT_S:g} s[/red]")
                _tail(console, job)
                return False
            if all(code == 0 for code in codes):
                return True
            text = "\n".join(line for lines in job.outputs.values() for line in lines)
            if attempt < 2 and any(word in text for word in _PORT_IN_USE):
                console.print(f"  port {job.port} was taken; again with another one")
                continue
            console.print(f"[red]the ranks exited with status {codes}[/red]")
            _tail(console, job)
            return False
    return False


def _tail(console: Console, job: RankJob) -> None:
    for rank, lines in job.outputs.items():
        for line in lines[-15:]:
            console.print(f"  [dim]rank {rank} |[/dim] {escape(line)}", highlight=False)


def _results(out: Path, ranks: int) -> list[dict[str, Any]]:
    results = []
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.json", encoding="utf-8") as file:
            results.append(json.load(file))
    return results


def _equal_trees(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal_trees(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def run_ranks_demo(console: Console, ranks: int = 2) -> int:
    """Run the N-rank demo in ``runs/demo-ranks``; 0 when the resumed run equals the straight."""
    if ranks < 2:
        raise ValueError(f"the multi-rank demo needs at least 2 ranks, got {ranks}")
    root = Path("runs/demo-ranks")
    straight_dir, resumed_dir = root / "straight", root / "resumed"
    # Said before anything slow (the ranks import torch: seconds on a cold start).
    console.print(
        f"[bold]1.[/bold] training {ranks} ranks (gloo, one process each) straight through to "
        f"step {TARGET} ({straight_dir})"
    )
    for part in (straight_dir, resumed_dir):
        shutil.rmtree(part, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)

    def job_args(run: Path, pace: float = 0.0) -> list[str]:
        return [
            "--dir",
            str(run / "checkpoints"),
            "--target",
            str(TARGET),
            "--out",
            str(run / "result"),
            "--pace",
            str(pace),
        ]

    for run in (straight_dir, resumed_dir):
        run.mkdir(parents=True)
    if not _run_job(console, ranks, job_args(straight_dir)):
        return 1

    victim = ranks - 1
    console.print(
        f"[bold]2.[/bold] training {ranks} ranks again ({resumed_dir}), {PACE_S:g} s per update; "
        f"at step {STOP_AFTER} a SIGTERM goes to rank {victim}'s process only"
    )
    sent: list[int] = []

    def on_line(job: RankJob, rank: int, line: str) -> None:
        match = _STEP_LINE.match(line)
        if not sent and rank == victim and match and int(match.group(1)) == STOP_AFTER:
            pid = job.signal(victim, signal.SIGTERM)
            sent.append(pid)
            others = "rank 0 gets" if ranks == 2 else f"ranks 0-{victim - 1} get"
            console.print(
                f"  sending SIGTERM to rank {victim} (pid {pid}) at step {STOP_AFTER}; "
                f"{others} no signal"
            )

    if not _run_job(console, ranks, job_args(resumed_dir, PACE_S), on_line):
        return 1
    if not sent:
        console.print(f"[red]the run ended before rank {victim} reported step {STOP_AFTER}[/red]")
        return 1
    stopped_results = _results(resumed_dir / "result", ranks)
    stop_steps = {r["step"] for r in stopped_results}
    if len(stop_steps) != 1 or not all(r["stop_reason"] for r in stopped_results):
        console.print(f"[red]the ranks did not stop together: {stopped_results}[/red]")
        return 1
    (stop_step,) = stop_steps
    if stop_step >= TARGET:
        console.print("[red]the signal landed too late: the run reached its target[/red]")
        return 1

    import pitstop

    checkpoints = resumed_dir / "checkpoints"
    published = [pitstop.info(path) for path in sorted(checkpoints.glob("step_*.pitstop"))]
    stops = [c for c in published if c.reason is pitstop.SaveReason.STOP]
    named = ", ".join(
        f"{c.path.name} ({c.reason.value}{f' ({c.detail})' if c.detail else ''})" for c in stops
    )
    console.print(
        f"  every rank stopped at step {stop_step}; checkpoints with reason stop: "
        f"{len(stops)} — {named or 'none'}"
    )
    stopped_ok = len(stops) == 1 and stops[0].step == stop_step and stops[0].detail == "SIGTERM"

    console.print(f"[bold]3.[/bold] resuming all {ranks} ranks to step {TARGET}")
    if not _run_job(console, ranks, job_args(resumed_dir)):
        return 1

    console.print(f"[bold]4.[/bold] pitstop ls {checkpoints}")
    from pitstop.cli.listing import list_directory

    list_directory(console, str(checkpoints))

    console.print("[bold]5.[/bold] comparing the resumed run with the straight run")
    # The whole stored tree: weights, optimizer, every rank's RNG streams and sampler slice.
    a = pitstop.load(straight_dir / "checkpoints" / "final")
    b = pitstop.load(checkpoints / "final")
    weights_equal = _equal_trees(a["weights"], b["weights"])
    state_equal = _equal_trees(a, b)
    straight_results = _results(straight_dir / "result", ranks)
    resumed_results = _results(resumed_dir / "result", ranks)
    ranks_equal = True

    def numpy_draw(result: dict[str, Any]) -> str:
        draws = result["draws"].get("numpy")
        return f", numpy {draws[0]}" if draws else ""

    for s, r in zip(straight_results, resumed_results, strict=True):
        same_weights = s["weights_sha256"] == r["weights_sha256"]
        same_draws = s["draws"] == r["draws"]
        ranks_equal = ranks_equal and same_weights and same_draws and r["step"] == TARGET
        console.print(
            f"  rank {s['rank']}: live weights {'equal' if same_weights else 'DIFFERENT'} "
            f"(sha256 {r['weights_sha256'][:16]}…), RNG draws "
            f"{'equal' if same_draws else 'DIFFERENT'} (torch {r['draws']['torch'][0]}, "
            f"python {r['draws']['python'][0]}{numpy_draw(r)})",
            highlight=False,
        )
    equal = weights_equal and state_equal and ranks_equal
    if equal:
        console.print(
            f"[green]bitwise equal:[/green] the resumed {ranks}-rank run's final checkpoint "
            "(weights, optimizer, every rank's RNG streams and sampler slice), each rank's live "
            "weights and each rank's RNG draws are identical to the straight run's"
        )
    else:
        console.print(
            f"[red]NOT equal:[/red] the resumed run differs from the straight run (final "
            f"weights {weights_equal}, whole checkpoint {state_equal}, ranks {ranks_equal})"
        )
    if not stopped_ok:
        console.print("[red]the stop did not publish exactly one stop (SIGTERM) checkpoint[/red]")
    return 0 if equal and stopped_ok else 1
