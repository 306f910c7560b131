"""An FSDP2 loop for simulated nodes (tests/nodes.py): stops on SIGTERM, resumes, reports.

The model, optimizer, schedule and EMA are tests/e2e/sharded_train.py's (each rank its own data
and dropout masks, from its own RNG stream, which pitstop saves per rank). Every ``--every``
steps ``maybe_save`` is called with the loop's StopRequest; a SIGTERM stops every rank at the
same step, saved with the stop's reason.

    python sharded_nodes_loop.py --dir D --target T --out OUT [--every 2] [--keep-last 3]
        [--hold-at N --hold-rank R]

``--hold-at N --hold-rank R``: after printing ``step N`` rank R waits until a signal has
reached it (so that the test's SIGTERM lands at that step). Each rank prints ``resumed <step>``
and ``step <n>``; a PitstopError prints ``error <Type> <message as JSON>`` and exits 3. Each
rank writes ``<OUT>.rank<R>.pitstop``: local shards and full tensors of the model, optimizer and
EMA, the schedule, the step it resumed from, the stop reason and draws from its RNG after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from ddp_loop import _wait_for_a_signal  # a held rank's bounded wait for its signal
from sharded_loop import exit_before_teardown, say, snapshot, write_result
from sharded_train import build

import pitstop

EXIT_PITSTOP_ERROR = 3


def train(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    model, optimizer, schedule, ema = build(True)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    holding = args.hold_at is not None and rank == args.hold_rank
    wakeup = -1
    if holding:
        wakeup, wakeup_w = os.pipe()
        os.set_blocking(wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    stop = pitstop.StopRequest()
    ckpt = pitstop.Checkpointer(
        args.dir,
        model=model,
        ema=ema,
        state={"optimizer": optimizer, "schedule": schedule},
        policy=pitstop.Policy(every_steps=args.every, keep_last=args.keep_last),
        timeout_s=args.pg_timeout,
    )
    progress = ckpt.resume()
    say(f"resumed {progress.step}")
    resumed = progress.step
    with stop.catch_signals():
        while progress.step < args.target and not stop:
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            ema.update_parameters(model)  # type: ignore[union-attr]
            optimizer.zero_grad()
            schedule.step()
            progress = progress.advance(samples=4 * world)
            say(f"step {progress.step}")
            if holding and progress.step == args.hold_at:
                _wait_for_a_signal(wakeup, lambda: stop.requested_here)
            ckpt.maybe_save(progress, stop=stop)
    ckpt.finish(progress, stop=stop)
    ckpt.close()
    say(f"finished {progress.step} stop={stop.reason}")
    out = snapshot(model, optimizer, ema)
    out["schedule"] = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
    out["resumed"] = resumed
    out["progress"] = progress.step
    out["stop_reason"] = stop.reason or ""
    out["draws"] = torch.rand(4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--hold-rank", type=int, default=1)
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout), rank=rank, world_size=world
    )
    try:
        try:
            result = train(args, rank, world)
        except pitstop.PitstopError as exc:
            say(f"error {type(exc).__name__} {json.dumps(str(exc))}")
            return EXIT_PITSTOP_ERROR
        write_result(args.out, rank, world, result)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_before_teardown(main())
