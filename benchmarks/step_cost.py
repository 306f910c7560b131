"""What pitstop costs a step that saves nothing, with several ranks: one all-reduce, or more?

A real job of ``--ranks`` processes (one per rank; a gloo process group on 127.0.0.1, a free
port) times, on every rank, ``--steps`` calls of each candidate, after ``--warmup`` untimed
ones. The candidates take turns: rounds of ``--batch`` calls of each, back to back after a
barrier, the order rotating from one round to the next, so that the load of a shared machine
hits all of them alike:

* ``all_reduce 8 B (floor)``: ``dist.all_reduce`` of one int64 on a gloo group of its own —
  the least any agreement between the ranks can cost;
* ``maybe_save (saves nothing)``: ``ckpt.maybe_save(progress, stop=stop)`` at steps off the
  interval (``Policy(every_steps=10**9)``), the call the documented loop makes every step;
* ``stop.sync()``: the stop agreement alone;
* ``sync + maybe_save``: the loop that called both.

Each row is the median per call of the slowest rank (each rank's median, then the largest),
with its 10th-90th percentile range on that rank, and the ratio to the floor. ``--step-ms``
gives the step the cost is compared with (125 ms: nanoGPT's on this machine, 2 ranks).

    .venv/bin/python benchmarks/step_cost.py --ranks 2,4 --steps 3000

Every child is ended: each has ``--timeout`` seconds to finish, then it is killed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CANDIDATES = (
    "all_reduce 8 B (floor)",
    "maybe_save (saves nothing)",
    "stop.sync()",
    "sync + maybe_save",
)


def _timed(
    calls: dict[str, Callable[[], object]], steps: int, warmup: int, batch: int
) -> dict[str, list[float]]:
    import torch.distributed as dist

    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_no in range(max(1, steps // batch)):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            dist.barrier()
            for _ in range(batch):
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
    return times


def worker(root: Path, steps: int, warmup: int, batch: int) -> dict[str, Any]:
    """One rank: every candidate, timed; its per-call times in seconds."""
    import torch
    import torch.distributed as dist

    import pitstop

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend="gloo")
    flag = torch.zeros(1, dtype=torch.int64)
    model = torch.nn.Linear(4, 4)
    stop = pitstop.StopRequest()
    ckpt = pitstop.Checkpointer(
        root / "run", model=model, policy=pitstop.Policy(every_steps=10**9), timeout_s=120
    )
    progress = ckpt.resume()

    def maybe_save() -> None:
        nonlocal progress
        progress = progress.advance()
        ckpt.maybe_save(progress, stop=stop)

    def both() -> None:
        stop.sync()
        maybe_save()

    calls: dict[str, Callable[[], object]] = {
        CANDIDATES[0]: lambda: dist.all_reduce(flag, group=group),
        CANDIDATES[1]: maybe_save,
        CANDIDATES[2]: stop.sync,
        CANDIDATES[3]: both,
    }
    out = _timed(calls, steps, warmup, batch)
    ckpt.close()
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_job(
    ranks: int, steps: int, warmup: int, batch: int, timeout: float
) -> list[dict[str, Any]]:
    """Launch ``ranks`` workers; each rank's times."""
    with tempfile.TemporaryDirectory(prefix="pitstop-step-cost-") as tmp:
        root = Path(tmp)
        port = _free_port()
        children = []
        for rank in range(ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            out = root / f"rank{rank}.json"
            command = [sys.executable, __file__, "--worker", str(out), "--dir", str(root)]
            command += ["--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch)]
            children.append((subprocess.Popen(command, env=env), out))
        try:
            for child, _ in children:
                child.wait(timeout=timeout)
        finally:
            for child, _ in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        codes = [child.returncode for child, _ in children]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        return [json.loads(out.read_text()) for _, out in children]


def rows_of(ranks: int, per_rank: list[dict[str, Any]], step_ms: float) -> list[dict[str, Any]]:
    rows = []
    floor = None
    for name in CANDIDATES:
        medians = [statistics.median(times[name]) for times in per_rank]
        slowest = max(range(len(per_rank)), key=lambda r: medians[r])
        deciles = statistics.quantiles(per_rank[slowest][name], n=10)
        median = medians[slowest]
        floor = floor if floor is not None else median
        rows.append(
            {
                "ranks": ranks,
                "candidate": name,
                "median_us": median * 1e6,
                "p10_us": deciles[0] * 1e6,
                "p90_us": deciles[-1] * 1e6,
                "x_floor": median / floor,
                "step_pct": 100 * median / (step_ms / 1000),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], step_ms: float) -> None:
    print(f"| ranks | candidate | median µs | p10-p90 µs | x floor | % of a {step_ms:g} ms step |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['ranks']} | {r['candidate']} | {r['median_us']:.0f} | "
            f"{r['p10_us']:.0f}-{r['p90_us']:.0f} | {r['x_floor']:.2f} | {r['step_pct']:.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=2000, help="timed calls per candidate")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls first")
    parser.add_argument("--batch", type=int, default=100, help="calls of a candidate per turn")
    parser.add_argument("--step-ms", type=float, default=125.0, help="the step compared with")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        times = worker(Path(args.dir), args.steps, args.warmup, args.batch)
        Path(args.worker).write_text(json.dumps(times))
        return 0
    if args.steps < 10:
        parser.error("--steps must be at least 10 (the percentiles need them)")
    world_sizes = [int(n) for n in args.ranks.split(",")]
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    rows: list[dict[str, Any]] = []
    for ranks in world_sizes:
        batch = min(args.batch, args.steps)
        per_rank = run_job(ranks, args.steps, args.warmup, batch, args.timeout)
        rows += rows_of(ranks, per_rank, args.step_ms)
    print_table(rows, args.step_ms)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
