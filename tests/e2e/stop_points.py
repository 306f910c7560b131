"""The documented multi-rank stop loop, with a real SIGTERM landing at every point of a step.

Run as real processes (torchrun, or tests/multirank.py's direct launch) by
tests/e2e/test_stop_agreement.py. One job runs many scenarios in turn, each on a fresh
directory, model and optimizer: in scenario ``(loop, rank, step, point)`` rank ``rank`` sends
itself SIGTERM (``signal.raise_signal``: a real signal, handled by the StopRequest's handler)
at ``point`` of step ``step`` of the loop ``loop``:

* ``docs`` — docs/distributed.md's loop, exactly::

      ckpt.maybe_save(progress, stop=stop)
      if stop:
          break

* ``sync`` — the same with ``stop.sync()`` before ``maybe_save`` (the loop the docs used to
  show; it must be right too).

The points: ``step`` (before the forward pass), ``sync`` (after ``stop.sync()``),
``save`` (after ``maybe_save``), ``check`` (after ``if stop: break`` did not break). Each rank
prints, per scenario, ``result {json}``: the step it left the loop at, its stop reason, and
(rank 0) the newest checkpoint's step, reason and detail after ``finish``.

    python stop_points.py --dir D --scenarios JSON [--no-ddp] [--die-at N --die-rank R]

``--die-at N --die-rank R`` (the kill test): rank R prints ``holding N`` after step N's
update and blocks until the test kills it (-9); the others go on into ``maybe_save`` and must
raise a CollectiveError naming the call and rank R. A PitstopError prints
``error <Type> <message as JSON>`` and exits 3. Every collective is bounded (the process
group's timeout, the Checkpointer's ``timeout_s``), so a stranded rank fails instead of hanging.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import pitstop

TIMEOUT_S = 30.0  # every collective: the process group's and the Checkpointer's
HOLD_LIMIT_S = 120.0  # a held rank gives up (exit 4) if it is not killed by then
EXIT_PITSTOP_ERROR = 3


def _here(point: str, step: int, spec: dict[str, Any], rank: int) -> None:
    """Raise SIGTERM on this rank if the scenario says so for ``point`` of ``step``."""
    if rank == spec["rank"] and (point, step) == (spec["point"], spec["step"]):
        signal.raise_signal(signal.SIGTERM)


def scenario(
    root: Path, index: int, spec: dict[str, Any], rank: int, ddp: bool, target: int
) -> dict[str, Any]:
    """Run one scenario on every rank; what this rank saw."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model: nn.Module = DistributedDataParallel(net) if ddp else net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    loop = spec["loop"]
    stop = pitstop.StopRequest()
    left: int | None = None
    with (
        pitstop.Checkpointer(
            root / f"s{index}",
            model=model,
            state={"optimizer": optimizer},
            policy=pitstop.Policy(every_steps=1000),
            timeout_s=TIMEOUT_S,
        ) as ckpt,
        stop.catch_signals(),
    ):
        progress = ckpt.resume()
        while progress.step < target:
            _here("step", progress.step + 1, spec, rank)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress = progress.advance()
            if loop == "sync":
                stop.sync()
                _here("sync", progress.step, spec, rank)
            ckpt.maybe_save(progress, stop=stop)
            _here("save", progress.step, spec, rank)
            if stop:
                left = progress.step
                break
            _here("check", progress.step, spec, rank)
        ckpt.finish(progress, stop=stop)
        newest = ckpt.checkpoints()[-1] if rank == 0 and ckpt.checkpoints() else None
    return {
        "scenario": index,
        "rank": rank,
        "left": left,
        "reason": stop.reason,
        "newest": None
        if newest is None
        else [newest.step, newest.reason.value, getattr(newest, "detail", None)],
    }


def _hold(step: int) -> None:
    """Print ``holding N`` and block until killed (bounded: exit 4 after HOLD_LIMIT_S)."""
    print(f"holding {step}", flush=True)
    read, _ = os.pipe()
    select.select([read], [], [], HOLD_LIMIT_S)
    print("hold: nobody killed this rank", flush=True)
    os._exit(4)


def die_scenario(root: Path, rank: int, die_at: int, die_rank: int) -> None:
    """The kill test: rank ``die_rank`` is killed between rounds, after step ``die_at``."""
    net = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    stop = pitstop.StopRequest()
    with pitstop.Checkpointer(
        root / "die", model=net, state={"optimizer": optimizer}, timeout_s=TIMEOUT_S
    ) as ckpt:
        progress = ckpt.resume()
        while True:
            net(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            progress = progress.advance()
            print(f"step {progress.step}", flush=True)
            if rank == die_rank and progress.step == die_at:
                _hold(progress.step)
            ckpt.maybe_save(progress, stop=stop)
            if stop:
                break


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--scenarios", default="[]", help="JSON list of scenario specs")
    parser.add_argument("--target", type=int, default=4)
    parser.add_argument("--no-ddp", action="store_true")
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=1)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        if args.die_at is not None:
            die_scenario(args.dir, rank, args.die_at, args.die_rank)
        else:
            for index, spec in enumerate(json.loads(args.scenarios)):
                seen = scenario(args.dir, index, spec, rank, not args.no_ddp, args.target)
                print("result " + json.dumps(seen), flush=True)
        dist.destroy_process_group()
    except pitstop.PitstopError as exc:
        print(f"error {type(exc).__name__} {json.dumps(str(exc))}", flush=True)
        return EXIT_PITSTOP_ERROR
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip C++ static teardown (gloo's threads; see tests/e2e/ddp_loop.py)
