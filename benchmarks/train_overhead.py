"""What checkpointing costs a CPU training loop: wall-time overhead and the stall per save.

A fixed amount of work — an MLP (``--layers`` x Linear(``--hidden``, ``--hidden``) + ReLU, Adam,
so the whole state is about 135 MiB by default), ``--steps`` optimizer steps over the same
pre-generated batches — without checkpoints and in each pitstop mode (sync, async, overlap),
with ``Checkpointer.maybe_save`` after every step and ``Policy(every_steps=--every,
keep_last=2)``. Saves happen at every multiple of ``--every`` below ``--steps``; the last step
is not saved (a run's end costs the same in every mode, and a long run amortises it).

The modes run side by side, one save interval at a time, so that the load of a shared machine
hits all of them alike: interval r of every mode is timed from its save (the ``maybe_save``
after step r x every) through the ``--every`` steps that follow, to ``ckpt.wait()`` — so a
background write is charged to the mode that started it, and a write not finished within its
interval shows as the wait (where the next save would have waited for it in a plain loop).
The order of the modes rotates from one interval to the next. A second loop without
checkpoints, "none (control)", runs beside the others: its "overhead" is the noise of the run,
the resolution of every other percentage.

Figures, over ``--repeats`` passes (fresh models and checkpoint directories for each):

* overhead: the mode's total time over the loop without checkpoints, in percent; and, less
  sensitive to bursts of load, the median over intervals of the same ratio;
* stall per save: what the loop waited for each save — the ``maybe_save`` call, plus (overlap
  mode) the wait in the next ``optimizer.step()``, measured between two step pre-hooks
  registered around pitstop's own; ``last_blocking_s`` per save is shown beside it (pitstop's
  own figure, which leaves that wait out);
* against the copy floor: one ``copy_`` of the whole state (weights and Adam moments) into
  preallocated buffers, taken once per interval in the same run (median);
* CPU per save: the process's CPU time (user + system, every thread, the background writer's
  and its checksum threads' included) from the save call until ``ckpt.wait()`` returns,
  measured after the passes with the loop idle (the median of 3 saves) — what a save costs
  the machine, where the stall is what it costs the loop directly. (CPU time taken while the
  loop runs is too noisy to use: its threads spin at every barrier.)

    .venv/bin/python benchmarks/train_overhead.py            # --steps 300 --every 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pitstop

MIB = 1 << 20
MODES: dict[str, bool | str | None] = {
    "none": None,
    "none (control)": None,  # a second loop without checkpoints: the run's noise floor
    "sync": False,
    "async": True,
    "overlap": "overlap",
}


def make_model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)]
    )


class Floor:
    """One copy_ of a state into buffers allocated (and faulted in) beforehand."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.buffers = [torch.empty_like(t) for t in tensors]
        self.copy()
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def copy(self) -> float:
        start = time.perf_counter()
        for buffer, tensor in zip(self.buffers, self.tensors, strict=True):
            buffer.copy_(tensor)
        return time.perf_counter() - start


class Loop:
    """One training loop in one mode, advanced an interval at a time."""

    def __init__(
        self,
        mode: str,
        args: argparse.Namespace,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        directory: Path,
    ) -> None:
        self.mode, self.args, self.batches = mode, args, batches
        self.model = make_model(args.hidden, args.layers)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.progress = pitstop.Progress()
        self.saves = 0
        self.stall_s = 0.0  # maybe_save calls that saved + the next step's wait for the copy
        self.hook_wait_s = 0.0  # of stall_s: the waits in optimizer.step() after a save
        self.reported_s = 0.0  # sum of ckpt.last_blocking_s over the saves
        self.intervals: list[float] = []
        self._pre = 0.0
        self._after_save = False
        # pitstop's overlap hook is registered when the Checkpointer is made: between these two.
        self.optimizer.register_step_pre_hook(self._before)
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)
        self.ckpt = None
        if MODES[mode] is not None:
            self.ckpt = pitstop.Checkpointer(
                directory,
                model=self.model,
                state={"optimizer": self.optimizer},
                policy=pitstop.Policy(every_steps=args.every, keep_last=2, save_final=False),
                async_save=MODES[mode],  # type: ignore[arg-type]
            )
        self.optimizer.register_step_pre_hook(self._after)

    def _before(self, *_: object) -> None:
        self._pre = time.perf_counter()

    def _after(self, *_: object) -> None:
        if self._after_save:
            waited = time.perf_counter() - self._pre
            self.hook_wait_s += waited
            self.stall_s += waited
            self._after_save = False

    def _maybe_save(self) -> None:
        if self.ckpt is None or self.progress.step >= self.args.steps:
            return  # no checkpoints, or the last step (not saved in any mode)
        called = time.perf_counter()
        saved = self.ckpt.maybe_save(self.progress)
        if saved is not None:
            self.stall_s += time.perf_counter() - called
            self.reported_s += self.ckpt.last_blocking_s
            self.saves += 1
            self._after_save = True

    def interval(self, steps: int) -> float:
        """Time the save due now (if any), ``steps`` steps, and the drain of the save."""
        start = time.perf_counter()
        if self.progress.step > 0:
            self._maybe_save()  # the call after the previous interval's last step
        for i in range(steps):
            x, y = self.batches[self.progress.step % len(self.batches)]
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            self.progress = self.progress.advance(samples=x.shape[0])
            if i < steps - 1:
                self._maybe_save()
        if self.ckpt is not None:
            self.ckpt.wait()
        seconds = time.perf_counter() - start
        self.intervals.append(seconds)
        return seconds

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a checkpoint holds: weights and optimizer state."""
        tensors = list(self.model.state_dict().values())
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return tensors

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50, help="save every K steps")
    parser.add_argument("--repeats", type=int, default=2, help="passes, fresh models each")
    parser.add_argument("--modes", default="sync,async,overlap", help="besides 'none'")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    modes = ["none", "none (control)"]
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("sync", "async", "overlap"):
            parser.error(f"--modes: unknown mode {mode!r}; choose from sync, async, overlap")
        modes.append(mode)
    if min(args.hidden, args.layers, args.batch, args.steps, args.every, args.repeats) < 1:
        parser.error("--hidden, --layers, --batch, --steps, --every, --repeats must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    own_root = args.dir is None
    root = Path(args.dir or tempfile.mkdtemp(prefix="pitstop-overhead-"))
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.hidden, generator=generator),
            torch.randn(args.batch, args.hidden, generator=generator),
        )
        for _ in range(8)
    ]
    lengths = [min(args.every, args.steps - s) for s in range(0, args.steps, args.every)]

    totals = dict.fromkeys(modes, 0.0)
    ratios: dict[str, list[float]] = {mode: [] for mode in modes}
    stats = {mode: {"saves": 0, "stall": 0.0, "hook": 0.0, "reported": 0.0} for mode in modes}
    floors: list[float] = []
    state_bytes = 0
    try:
        warm = Loop("none", args, batches, root / "warm")  # warm-up, not counted
        warm.interval(min(5, args.steps))
        warm.close()
        for _ in range(args.repeats):
            loops = [Loop(mode, args, batches, root / f"ckpt_{i}") for i, mode in enumerate(modes)]
            floor: Floor | None = None
            try:
                for index, length in enumerate(lengths):
                    turn = index % len(loops)  # rotate: no mode always runs first
                    times = {
                        loop.mode: loop.interval(length) for loop in loops[turn:] + loops[:turn]
                    }
                    for mode, seconds in times.items():
                        totals[mode] += seconds
                        if index > 0:  # an interval that starts with a save
                            ratios[mode].append(seconds / times["none"])
                    if floor is None:  # Adam's moments exist after the first interval
                        floor = Floor(loops[0].state_tensors())
                        state_bytes = floor.nbytes
                    floors.append(floor.copy())
            finally:
                for loop in loops:
                    stat = stats[loop.mode]
                    stat["saves"] += loop.saves
                    stat["stall"] += loop.stall_s
                    stat["hook"] += loop.hook_wait_s
                    stat["reported"] += loop.reported_s
                    loop.close()
                del floor
        per_save = {mode: _cpu_per_save(mode, args, batches, root / "cpu") for mode in modes}
        cpu = {mode: seconds for mode, seconds in per_save.items() if seconds is not None}
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)

    copy_floor = statistics.median(floors)
    base = totals["none"]
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(
        f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}) + Adam: state "
        f"{state_bytes / MIB:.0f} MiB; {args.steps} steps of batch {args.batch}; a save every "
        f"{args.every} steps; {args.repeats} pass(es), modes interleaved per interval; "
        f"copy floor {copy_floor * 1000:.1f} ms"
    )
    print()
    print(
        "| mode | total s | overhead % | overhead % (median interval) | saves "
        "| stall per save ms | x copy floor | of which in optimizer.step() ms "
        "| last_blocking_s per save ms | CPU per save ms (loop idle) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for mode in modes:
        stat = stats[mode]
        saves = int(stat["saves"])
        per = max(saves, 1)
        stall, hook, reported = stat["stall"] / per, stat["hook"] / per, stat["reported"] / per
        overhead = (totals[mode] - base) / base * 100
        median_overhead = (statistics.median(ratios[mode]) - 1) * 100 if ratios[mode] else 0.0
        save_cpu = cpu.get(mode)
        if mode == "none (control)":
            print(
                f"| {mode} | {totals[mode]:.2f} | {overhead:+.1f} | {median_overhead:+.1f} "
                "| 0 | — | — | — | — | — |"
            )
        elif mode == "none":
            print(f"| none | {totals[mode]:.2f} | — | — | 0 | — | — | — | — | — |")
        else:
            print(
                f"| {mode} | {totals[mode]:.2f} | {overhead:+.1f} | {median_overhead:+.1f} "
                f"| {saves} | {stall * 1000:.1f} | {stall / copy_floor:.2f} | {hook * 1000:.1f} "
                f"| {reported * 1000:.1f} | {(save_cpu or 0.0) * 1000:.0f} |"
            )
        rows.append(
            {
                "mode": mode,
                "total_s": totals[mode],
                "overhead_pct": overhead,
                "overhead_median_interval_pct": median_overhead,
                "saves": saves,
                "stall_per_save_s": stall if saves else None,
                "hook_wait_per_save_s": hook if saves else None,
                "last_blocking_per_save_s": reported if saves else None,
                "cpu_per_save_s": save_cpu,
                "copy_floor_s": copy_floor,
                "state_bytes": state_bytes,
            }
        )
    by = {row["mode"]: row for row in rows}
    targets = []
    if "async" in by:
        pct = float(by["async"]["overhead_pct"])  # type: ignore[arg-type]
        noise = float(by["none (control)"]["overhead_pct"])  # type: ignore[arg-type]
        targets.append(
            (f"async overhead <= 3% (control: {noise:+.1f}%)", f"{pct:+.1f}%", pct <= 3.0)
        )
    if "overlap" in by and by["overlap"]["stall_per_save_s"] is not None:
        ratio = float(by["overlap"]["stall_per_save_s"]) / copy_floor  # type: ignore[arg-type]
        targets.append(
            ("overlap stall per save <= 0.25x copy floor", f"{ratio:.2f}x", ratio <= 0.25)
        )
    if targets:
        print()
        print("| target | measured | verdict |")
        print("|---|---:|---|")
        for target, measured, ok in targets:
            print(f"| {target} | {measured} | {'met' if ok else 'NOT met'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _cpu_per_save(
    mode: str,
    args: argparse.Namespace,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    path: Path,
) -> float | None:
    """Process CPU seconds from a save call until wait() returns, the loop idle; median of 3."""
    if MODES[mode] is None:
        return None
    loop = Loop(mode, args, batches, path)
    try:
        loop.interval(1)  # Adam's moments exist from the first step
        assert loop.ckpt is not None
        samples = []
        progress = loop.progress
        for _ in range(3):
            progress = progress.advance(samples=args.batch)
            before = _cpu_seconds()
            loop.ckpt.save(progress)
            loop.ckpt.wait()
            samples.append(_cpu_seconds() - before)
        return statistics.median(samples)
    finally:
        loop.close()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
