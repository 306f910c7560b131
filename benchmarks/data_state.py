"""What WorkerRNG costs a training step: the workers' random state in every loader snapshot.

For each worker count in ``--workers``, two torchdata ``StatefulDataLoader``s over the same
map-style dataset (a sample of ``--sample`` floats with a random transform in ``__getitem__``),
both snapshotting every batch (``snapshot_every_n_steps=1``, torchdata's default, the most a
snapshot can cost):

* ``StatefulDataLoader``: the dataset as it is;
* ``StatefulDataLoader + WorkerRNG``: the dataset wrapped in ``pitstop.WorkerRNG``, so every
  snapshot also carries the worker's Python, NumPy and torch random state.

The loop takes a batch (``next()``, timed), then spends ``--work-ms`` on its "step" (a sleep:
the workers run meanwhile, as they do while a model trains). The candidates take turns:
rounds of ``--batch`` steps of each, the order alternating from round to round, both loaders'
workers alive throughout. Each row: the median ``next()`` per step with its 10th-90th
percentiles, the added cost over the loader without ``WorkerRNG``, that as a share of a
``--step-ms`` step, and the size of ``loader.state_dict()`` in pitstop's file format (what a
save stores of it).

    .venv/bin/python benchmarks/data_state.py --workers 2,4 --steps 2000 --batch 100

Every worker process is ended with its loader's iterator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

CANDIDATES = ("StatefulDataLoader", "StatefulDataLoader + WorkerRNG")


class Augmented(Dataset[torch.Tensor]):
    """``length`` samples of ``size`` floats, each with a random flip and noise."""

    def __init__(self, length: int, size: int) -> None:
        self.length, self.size = length, size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = torch.full((self.size,), float(index))
        if random.random() < 0.5:
            sample = -sample
        return sample + torch.randn(self.size)


def _loader(workers: int, steps: int, batch_size: int, size: int, wrapped: bool) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    import pitstop

    dataset: Dataset[torch.Tensor] = Augmented(steps * batch_size, size)
    if wrapped:
        dataset = pitstop.WorkerRNG(dataset)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        snapshot_every_n_steps=1,
        generator=torch.Generator().manual_seed(0),
    )


def _stored_bytes(state: Any) -> int:
    """The size of ``state`` written in pitstop's file format (what a save stores of it)."""
    from pitstop.shell.format import fileformat

    with tempfile.TemporaryFile() as f:
        fileformat.write(f, fileformat.prepare({"loader": state}), {})
        return f.tell()


def measure(
    workers: int, steps: int, warmup: int, batch: int, batch_size: int, size: int, work_ms: float
) -> dict[str, Any]:
    """Both candidates with ``workers`` workers, in turns: per-step times and state sizes."""
    total = steps + warmup
    loaders = {
        name: _loader(workers, total, batch_size, size, wrapped=name != CANDIDATES[0])
        for name in CANDIDATES
    }
    iterators: dict[str, Iterator[Any]] = {name: iter(loader) for name, loader in loaders.items()}
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    try:
        for name in CANDIDATES:
            for _ in range(warmup):
                next(iterators[name])
        names = list(CANDIDATES)
        for round_no in range(max(1, steps // batch)):
            order = names if round_no % 2 == 0 else names[::-1]
            for name in order:
                for _ in range(batch):
                    started = time.perf_counter()
                    next(iterators[name])
                    times[name].append(time.perf_counter() - started)
                    time.sleep(work_ms / 1000)  # the model's step: the workers run meanwhile
        state_bytes = {name: _stored_bytes(loader.state_dict()) for name, loader in loaders.items()}
    finally:
        for name in CANDIDATES:  # ends the workers
            shutdown = getattr(iterators[name], "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        iterators.clear()
    return {"times": times, "state_bytes": state_bytes}


def rows_of(workers: int, measured: dict[str, Any], step_ms: float) -> list[dict[str, Any]]:
    rows = []
    base = None
    for name in CANDIDATES:
        samples = measured["times"][name]
        median = statistics.median(samples)
        deciles = statistics.quantiles(samples, n=10) if len(samples) > 1 else [median, median]
        base = median if base is None else base
        rows.append(
            {
                "workers": workers,
                "candidate": name,
                "median_us": median * 1e6,
                "p10_us": deciles[0] * 1e6,
                "p90_us": deciles[-1] * 1e6,
                "added_us": (median - base) * 1e6,
                "step_pct": 100 * (median - base) / (step_ms / 1000),
                "state_bytes": measured["state_bytes"][name],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], step_ms: float) -> None:
    print(
        f"| workers | candidate | median µs | p10-p90 µs | added µs | % of a {step_ms:g} ms step "
        "| state bytes |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['candidate']} | {r['median_us']:.0f} | "
            f"{r['p10_us']:.0f}-{r['p90_us']:.0f} | {r['added_us']:.0f} | "
            f"{r['step_pct']:.3f} | {r['state_bytes']} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per candidate")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=100, help="steps of a candidate per turn")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    parser.add_argument("--sample", type=int, default=1024, help="floats per sample")
    parser.add_argument("--work-ms", type=float, default=5.0, help="the loop's step, slept")
    parser.add_argument("--step-ms", type=float, default=125.0, help="the step compared with")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        import torchdata  # noqa: F401
    except ImportError:
        parser.error("needs torchdata: pip install pitstop[data]")
    counts = [int(n) for n in args.workers.split(",")]
    if args.steps < 2 or any(n < 1 for n in counts):
        parser.error("--steps must be at least 2 and every --workers count at least 1")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    rows: list[dict[str, Any]] = []
    for workers in counts:
        measured = measure(
            workers,
            args.steps,
            args.warmup,
            min(args.batch, args.steps),
            args.batch_size,
            args.sample,
            args.work_ms,
        )
        rows += rows_of(workers, measured, args.step_ms)
    print_table(rows, args.step_ms)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
