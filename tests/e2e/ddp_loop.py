"""A DDP training loop that uses pitstop, run as real processes (one per rank) by the tests.

Every rank makes the same calls on the same checkpoint directory. It trains a small MLP with
dropout (each rank its own dropout masks: the ranks' torch, Python and NumPy RNG streams are
seeded differently) through DistributedDataParallel on gloo, with AdamW, a LambdaLR warm-up,
an optional AveragedModel EMA, a per-rank component (``meter``: this rank's loss sum and
count, declared ``per_rank``), and map-style data read through a ResumableSampler sharded by
rank. It stops on SIGTERM/SIGINT (``maybe_save(progress, stop=stop)`` makes the ranks agree)
and resumes.

Each rank writes what a test compares to ``<out>.rank<R>.pitstop`` (a pitstop file, so
reading it never unpickles): every state dict (model, EMA, optimizer, scheduler, meter), the
batches it trained on, the state it resumed into, and draws from each RNG after training.

Rank and world size come from the environment (RANK, WORLD_SIZE; MASTER_ADDR and MASTER_PORT
through ``init_method="env://"``), as set by tests/multirank.py or torchrun. Without
WORLD_SIZE it runs as one plain process, no process group and no DDP.

    python ddp_loop.py --dir D --target 10 --out OUT [--report] [--every 3]
        [--async-save off|on|overlap] [--hold-at N --hold-rank R] [--fail-write-at N]
        [--hang-write-at N] [--no-resume-strict] [--no-ema] [--no-meter]
        [--resume-from SOURCE] [--try-resume-from SOURCE]

Test hooks (the write faults on rank 0, or ``--fault-rank R``, a writer of another node's
directory; the Checkpointer itself is never patched):
``--hold-at N --hold-rank R``: after printing ``step N`` rank R waits until a signal has
arrived (race-free, through signal.set_wakeup_fd), so a SIGTERM a test sends after seeing
``step N`` always lands before the run ends; the stop then takes effect at step N.
``--fail-write-at N``: the checkpoint write of step N raises OSError(ENOSPC).
``--hang-write-at N``: the checkpoint write of step N writes half a file, prints
``writing N`` and blocks, for a test to kill -9 it mid-save.
``--resume-from SOURCE``: ``resume(SOURCE)`` instead of ``resume()`` (``last``).
``--try-resume-from SOURCE``: first a resume from SOURCE that must fail: it prints
``resume error <Type> <message as JSON>`` (a resume that succeeds exits 4).
Each rank's result holds, with the state it resumed into, where its directory's ``last``
pointer led right after the resume (``resumed["last"]``).
A PitstopError from a Checkpointer call prints ``error <Type> <message as JSON>`` and exits 3.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import logging
import os
import random
import re
import select
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pitstop
from pitstop.shell.format import fileformat, filewrite

SAMPLES, BATCH, FEATURES = 40, 4, 4  # 2 ranks: 20 samples each, 5 batches per epoch
HOLD_LIMIT_S = 300.0  # a held rank gives up (exit 4) if no signal comes: never hang forever
MODES: dict[str, bool | str] = {"off": False, "on": True, "overlap": "overlap"}
EXIT_PITSTOP_ERROR = 3
EXIT_TEST_HOOK = 4

_write_file = fileformat.write  # the real writer; the write faults below wrap it


def last_pointer(directory: Path) -> str:
    """Where ``directory``'s ``last`` pointer leads, as this rank sees it (``""``: none)."""
    last = directory / "last"
    return last.readlink().name if last.is_symlink() else ""


def report(enabled: bool, text: str) -> None:
    if enabled:
        print(text, flush=True)


class RankMeter:
    """Per-rank state: this rank's loss sum and update count (different on every rank)."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def update(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double()
        self.count += 1

    bad_at: int | None = None  # --bad-meter-at: this count's state holds what no file can

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"loss_sum": self.loss_sum.clone(), "count": self.count}
        if self.count == self.bad_at:
            state["hook"] = object()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss_sum = state["loss_sum"].clone().to(torch.float64)
        self.count = int(state["count"])


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _step_of(file: object, meta: object) -> int | None:
    """The step of the checkpoint being written: from its manifest meta, else its file name."""
    progress = meta.get("progress") if isinstance(meta, Mapping) else None
    if isinstance(progress, Mapping) and isinstance(progress.get("step"), int):
        return int(progress["step"])
    match = re.search(r"step_(\d{12})", str(getattr(file, "name", "")))
    return int(match.group(1)) if match else None


def _wait_for_a_signal(wakeup: int, done: Any) -> None:
    """Block until ``done()`` is true; each signal wakes the select through ``wakeup``."""
    while not done():
        ready, _, _ = select.select([wakeup], [], [], HOLD_LIMIT_S)
        if not ready:
            print("hold: no signal came", flush=True)
            raise SystemExit(EXIT_TEST_HOOK)
        with contextlib.suppress(BlockingIOError):
            os.read(wakeup, 512)


def install_write_faults(fail_at: int | None, hang_at: int | None) -> None:
    """Make the checkpoint write of one step fail (ENOSPC) or hang half-way (kill -9 it)."""

    def faulty_write(file: Any, prepared: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
        step = _step_of(file, meta)
        if step is not None and step == fail_at:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at step {step})")
        written = _write_file(file, prepared, meta, *args, **kwargs)
        if step is not None and step == hang_at:
            file.flush()
            file.truncate(max(1, file.tell() // 2))  # half a file, as if the write was cut
            file.flush()
            print(f"writing {step}", flush=True)
            never = os.pipe()[0]
            select.select([never], [], [], HOLD_LIMIT_S)  # until the test kills this process
            print("hang: nobody killed this rank", flush=True)
            os._exit(EXIT_TEST_HOOK)
        return written

    fileformat.write = faulty_write  # type: ignore[assignment]
    filewrite.write = faulty_write  # type: ignore[assignment]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--target", type=int, required=True, help="absolute step to train to")
    parser.add_argument("--out", required=True, help="prefix of <out>.rank<R>.pitstop")
    parser.add_argument("--async-save", choices=sorted(MODES), default="off")
    parser.add_argument("--every", type=int, default=3, help="Policy.every_steps")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="print 'step N' after updates")
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--hold-rank", type=int, default=1)
    parser.add_argument("--fail-write-at", type=int, default=None)
    parser.add_argument("--hang-write-at", type=int, default=None)
    parser.add_argument("--resume-from", default="last")
    parser.add_argument("--try-resume-from", default=None)
    parser.add_argument("--fault-rank", type=int, default=0, help="the rank whose write faults")
    parser.add_argument("--remote", default=None, help="Checkpointer(remote=...): a remote tier")
    parser.add_argument("--resume-strict", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--meter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="register the per-rank 'meter' component (per_rank=('meter',))",
    )
    parser.add_argument(
        "--bad-meter-at",
        type=int,
        default=None,
        help="on rank 1, the meter's state at this step holds an object no checkpoint can",
    )
    parser.add_argument(
        "--bad-metric-at",
        type=int,
        default=None,
        help="on rank 1, pass maybe_save a metric that is not a number at this step",
    )
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument(
        "--log-transfers", action="store_true", help="say how each peer copy travelled (INFO)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.log_transfers:
        logging.getLogger("pitstop.transfer").setLevel(logging.INFO)
    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    world = int(os.environ["WORLD_SIZE"]) if distributed else 1
    if distributed:
        dist.init_process_group(
            "gloo",
            init_method="env://",  # MASTER_ADDR / MASTER_PORT, for both launchers
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.pg_timeout),
        )
    try:
        return train(args, rank, world, distributed)
    finally:
        if distributed and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # shown, but the run's own outcome is the exit code
                print(f"destroy_process_group: {type(exc).__name__}: {exc}", flush=True)


def train(args: argparse.Namespace, rank: int, world: int, distributed: bool) -> int:
    torch.manual_seed(0)  # the same data and initial weights on every rank
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
    model: nn.Module = DistributedDataParallel(net) if distributed else net
    # From here on each rank has its own streams: its own dropout masks and draws.
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)

    optimizer = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    ema = (
        AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        if args.ema
        else None
    )
    sampler = pitstop.ResumableSampler(SAMPLES, BATCH, seed=3, rank=rank, world_size=world)
    meter = RankMeter()
    if rank == 1:
        meter.bad_at = args.bad_meter_at
    state: dict[str, Any] = {"optimizer": optimizer, "sampler": sampler, "scheduler": scheduler}
    extra: dict[str, Any] = {}
    if args.remote is not None:
        extra["remote"] = args.remote
    if args.meter:
        state["meter"] = meter
        extra["per_rank"] = ("meter",)

    faults = args.fail_write_at is not None or args.hang_write_at is not None
    if rank == args.fault_rank and faults:
        install_write_faults(args.fail_write_at, args.hang_write_at)
    holding = args.hold_at is not None and rank == args.hold_rank
    wakeup = -1
    if holding:
        wakeup, wakeup_w = os.pipe()
        os.set_blocking(wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)

    stop = pitstop.StopRequest()
    batches: list[list[int]] = []
    ckpt = None
    try:
        ckpt = pitstop.Checkpointer(
            args.dir,
            model=model,
            ema=ema,
            state=state,
            policy=pitstop.Policy(every_steps=args.every, keep_last=args.keep_last),
            async_save=MODES[args.async_save],
            **extra,
        )
        if args.try_resume_from is not None:
            try:
                ckpt.resume(args.try_resume_from)
            except pitstop.PitstopError as exc:
                print(f"resume error {type(exc).__name__} {json.dumps(str(exc))}", flush=True)
            else:
                raise SystemExit(EXIT_TEST_HOOK)
        progress = ckpt.resume(args.resume_from, strict=args.resume_strict)
        report(args.report, f"resumed {progress.step}")
        resumed = {
            "progress": [progress.step, progress.epoch, progress.batch_in_epoch],
            "model": {k: v.clone() for k, v in net.state_dict().items()},
            "ema": None if ema is None else {k: v.clone() for k, v in ema.state_dict().items()},
            "optimizer": _clone(optimizer.state_dict()),
            "last": last_pointer(Path(args.dir)),
        }
        sampler.set_position(progress)
        with stop.catch_signals():
            while progress.step < args.target and not stop:
                sampler.set_position(progress)
                for indices in sampler:
                    batches.append(list(indices))
                    loss = nn.functional.mse_loss(model(x[indices]), y[indices])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    scheduler.step()
                    if ema is not None:
                        ema.update_parameters(net)
                    meter.update(loss)
                    progress = progress.advance(samples=len(indices) * world)
                    report(args.report, f"step {progress.step}")
                    if holding and progress.step == args.hold_at:
                        _wait_for_a_signal(wakeup, lambda: stop.requested_here)
                    bad = rank == 1 and progress.step == args.bad_metric_at
                    metrics = {"loss": "high" if bad else loss.item()}
                    saved = ckpt.maybe_save(progress, stop=stop, metrics=metrics)
                    if saved is not None:
                        report(args.report, f"saved {saved.step}")
                        report(args.report, f"save collectives {ckpt._ranks._round}")
                    if stop or progress.step >= args.target:
                        break
                else:
                    progress = progress.next_epoch()
        ckpt.finish(progress, stop=stop)
        report(args.report, f"finished {progress.step} stop={stop.reason}")
        closing, ckpt = ckpt, None
        closing.close()
    except pitstop.PitstopError as exc:
        print(f"error {type(exc).__name__} {json.dumps(str(exc))}", flush=True)
        return EXIT_PITSTOP_ERROR
    finally:
        if ckpt is not None:  # after an error: release the directory, keep the first error
            try:
                ckpt.close()
            except Exception as exc:
                print(f"close after the error: {type(exc).__name__}: {exc}", flush=True)

    result = {
        "rank": rank,
        "world_size": world,
        "model": net.state_dict(),
        "ema": None if ema is None else ema.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "meter": meter.state_dict(),
        "batches": batches,
        "progress": [progress.step, progress.epoch, progress.batch_in_epoch, progress.samples],
        "resumed": resumed,
        "stop_reason": stop.reason,
        "draws": [torch.rand(3), random.random(), float(np.random.rand())],
    }
    with open(f"{args.out}.rank{rank}.pitstop", "wb") as f:
        _write_file(f, fileformat.prepare(result), {})
    return 0


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The process group is destroyed and every file closed by now. Skip C++ static teardown:
    # on a loaded machine gloo's threads have aborted it ("terminate called without an active
    # exception", exit -6) after a run that had ended with the exit code the test checks.
    os._exit(code)
