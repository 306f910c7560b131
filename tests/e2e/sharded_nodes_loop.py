"""An FSDP2 loop for simulated nodes (tests/nodes.py): stops on SIGTERM, resumes, reports.

The model, optimizer, schedule and EMA are tests/e2e/sharded_train.py's (each rank its own data
and dropout masks, from its own RNG stream, which pitstop saves per rank). Every ``--every``
steps ``maybe_save`` is called with the loop's StopRequest; a SIGTERM stops every rank at the
same step, saved with the stop's reason.

    python sharded_nodes_loop.py --dir D --target T --out OUT [--every 2] [--keep-last 3]
        [--hold-at N --hold-rank R] [--hang-manifest-at N --hang-rank R]
        [--async-save off|on|overlap] [--fail-shards-at N --fail-rank R] [--resume-from SOURCE]
        [--try-resume-from SOURCE] [--remote URL [--remote-keep-last K]]

``--hold-at N --hold-rank R``: after printing ``step N`` rank R waits until a signal has
reached it (so that the test's SIGTERM lands at that step). Each rank prints ``resumed <step>``
and ``step <n>``; ``--hang-manifest-at N``: rank R's (``--hang-rank``, default 0) manifest write of
the step-N save prints ``writing N`` and waits to be killed (its node's shards of step N stay in
their temp directory); a PitstopError prints ``error <Type> <message as JSON>`` and exits 3. Each
rank writes ``<OUT>.rank<R>.pitstop``: local shards and full tensors of the model, optimizer and
EMA, the schedule, the step it resumed from, the stop reason and draws from its RNG after.
After the resume each rank prints ``last <name>``: where its node's ``last`` pointer leads
(``last none``: there is none). ``--fail-shards-at N --fail-rank R``: rank R's DCP write of its
step-N shards raises OSError; a SaveError from a save call then prints ``save error <message as
JSON>`` and training goes on. ``--try-resume-from SOURCE``: first a resume from SOURCE that must
fail: it prints ``resume error <Type> <message as JSON>`` (one that succeeds exits 4).
``--remote URL``: a remote tier (``s3://``) behind ``--dir``, keeping its last K checkpoints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import select
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ddp_loop import (
    EXIT_TEST_HOOK,
    HOLD_LIMIT_S,
    _wait_for_a_signal,  # a held rank's bounded wait for its signal
)
from sharded_loop import exit_before_teardown, say, snapshot, write_result
from sharded_train import build, in_shards, inject

import pitstop
from pitstop.shell.store import sharddir

EXIT_PITSTOP_ERROR = 3


def hang_in_manifest(step: int) -> None:
    """This rank's manifest write of ``step`` says ``writing <step>`` and waits to be killed."""
    real = sharddir.write_manifest

    def write_manifest(directory: Any, layout: Any, meta: Any, *args: Any, **kw: Any) -> None:
        if meta["progress"]["step"] == step:
            say(f"writing {step}")
            select.select([os.pipe()[0]], [], [], HOLD_LIMIT_S)  # until the test kills it
            say("hang: nobody killed this rank")
            os._exit(EXIT_TEST_HOOK)
        real(directory, layout, meta, *args, **kw)

    sharddir.write_manifest = write_manifest  # type: ignore[assignment]


def goes_on(call: Any) -> None:
    """``call()``; a SaveError is printed (``save error <message as JSON>``) and training goes
    on."""
    try:
        call()
    except pitstop.SaveError as exc:
        say(f"save error {json.dumps(str(exc))}")


def train(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    model, optimizer, schedule, ema = build(True)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    if args.hang_manifest_at is not None and rank == args.hang_rank:
        hang_in_manifest(args.hang_manifest_at)
    if args.fail_shards_at is not None and rank == args.fail_rank:
        in_shards(args.fail_shards_at, lambda: inject(f"injected on rank {rank}"))
    holding = args.hold_at is not None and rank == args.hold_rank
    wakeup = -1
    if holding:
        wakeup, wakeup_w = os.pipe()
        os.set_blocking(wakeup, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    stop = pitstop.StopRequest()
    tier: dict[str, Any] = {}
    if args.remote is not None:
        tier = {"remote": args.remote, "remote_policy": pitstop.Policy(keep_last=args.remote_keep)}
    ckpt = pitstop.Checkpointer(
        args.dir,
        **tier,
        model=model,
        ema=ema,
        state={"optimizer": optimizer, "schedule": schedule},
        policy=pitstop.Policy(every_steps=args.every, keep_last=args.keep_last),
        timeout_s=args.pg_timeout,
        async_save={"off": False, "on": True, "overlap": "overlap"}[args.async_save],
    )
    if args.try_resume_from is not None:  # a resume that must fail first
        try:
            ckpt.resume(args.try_resume_from)
        except pitstop.PitstopError as exc:
            say(f"resume error {type(exc).__name__} {json.dumps(str(exc))}")
        else:
            raise SystemExit(EXIT_TEST_HOOK)
    progress = ckpt.resume(args.resume_from)
    say(f"resumed {progress.step}")
    last = Path(args.dir) / "last"
    say(f"last {last.readlink().name if last.is_symlink() else 'none'}")
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
            goes_on(partial(ckpt.maybe_save, progress, stop=stop))
    goes_on(partial(ckpt.finish, progress, stop=stop))
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
    parser.add_argument("--hang-manifest-at", type=int)
    parser.add_argument("--hang-rank", type=int, default=0)
    parser.add_argument("--resume-from", default="last", help="resume(SOURCE)")
    parser.add_argument("--try-resume-from", help="first a resume(SOURCE) that must fail")
    parser.add_argument("--async-save", choices=("off", "on", "overlap"), default="off")
    parser.add_argument("--fail-shards-at", type=int)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--remote", help="a remote tier: s3://bucket/prefix")
    parser.add_argument("--remote-keep-last", dest="remote_keep", type=int, default=2)
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
