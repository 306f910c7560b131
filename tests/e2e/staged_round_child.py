"""One rank of tests/e2e/test_staged_round.py: a background sharded save copied during its round.

Two ranks, FSDP2 on gloo, a Checkpointer with ``async_save`` (``--overlap``: ``"overlap"``)
and a long ``timeout_s`` (a rank left waiting for another fails the test by its job timeout).
Every rank notes, in order, each staging of its shards (``stage``), each copy its stager
makes (``copy``: in overlap mode a save's copy of the parameters and optimizer state is a
second one, made after the call by pitstop's thread or the next optimizer step), each plan
(``plan``, rank 0 only) and each round begun (``round``), and prints them as
``events <call>|<list as JSON>`` after each call.

``--scene order`` (the default): ``save`` at step 1 (explicit: foreseen), ``wait``; a
``maybe_save`` at step 2 (no interval: not foreseen, nothing written); ``finish`` at step 2
(foreseen: the final save writes); ``finish`` again at step 2 (foreseen, but the step is
saved: only the ``final`` pointer moves); an optimizer step (``step``: in overlap mode its
pre-hook must not make the copy of the staging that call dropped); ``close``; prints
``checkpoints <names as JSON>`` and ``temps <n>``.

``--scene interrupt --interrupt-rank R``: rank R's copy of the step-1 save raises
KeyboardInterrupt; each rank prints ``interrupted <message as JSON>`` (or ``saved 1``) and
its events; then ``wait`` prints ``wait error <message as JSON>`` or ``wait ok``; then a save
at step 2, ``close``, ``checkpoints`` and ``temps`` as above. ``--scene late``: the same, but
the step-1 save is a ``maybe_save`` that every rank but R passes a stop request: rank R does
not foresee the save, so its copy (interrupted) is made after the round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sharded_loop import exit_before_teardown, exit_code, say
from torch import nn
from torch.distributed.fsdp import fully_shard

import pitstop
from pitstop.shell import saving, shardsave
from pitstop.shell.ranks import distributed
from pitstop.shell.sharded import shardstage

events: list[str] = []


def note(owner: Any, name: str, event: str) -> None:
    real = getattr(owner, name)

    def noted(*args: Any, **kwargs: Any) -> Any:
        events.append(event)
        return real(*args, **kwargs)

    setattr(owner, name, noted)


def interrupt_copy() -> None:
    """This rank's next copy of its shards raises KeyboardInterrupt (once)."""
    real = shardstage.stage_sharded

    def stage_sharded(*args: Any, **kwargs: Any) -> Any:
        shardstage.stage_sharded = real
        raise KeyboardInterrupt("Ctrl-C during the copy")

    shardstage.stage_sharded = stage_sharded


def report(call: str) -> None:
    say(f"events {call}|{json.dumps(events)}")
    events.clear()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--scene", choices=["order", "interrupt", "late"], default="order")
    parser.add_argument("--interrupt-rank", type=int, default=0)
    parser.add_argument("--overlap", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train_step() -> None:
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        train_step()
        note(shardsave.ShardedSaves, "stage", "stage")
        note(saving.Saver, "plan", "plan")
        note(distributed.Ranks, "begin", "round")
        note(shardstage.KeptStager, "stage", "copy")
        ckpt = pitstop.Checkpointer(
            args.dir,
            model=model,
            state={"optimizer": optimizer},
            policy=pitstop.Policy(keep_last=None),
            async_save="overlap" if args.overlap else True,
            timeout_s=600,
        )
        events.clear()
        if args.scene == "order":
            ckpt.save(pitstop.Progress(step=1))
            report("save")
            ckpt.wait()
            train_step()
            events.clear()
            say(f"maybe {ckpt.maybe_save(pitstop.Progress(step=2))}")
            report("maybe_save")
            ckpt.finish(pitstop.Progress(step=2))
            report("finish")
            ckpt.finish(pitstop.Progress(step=2))
            report("finish again")
            train_step()
            report("step")
        else:
            if rank == args.interrupt_rank:
                interrupt_copy()
            try:
                if args.scene == "late":  # only the other rank's stop makes this a save
                    stop = rank != args.interrupt_rank
                    ckpt.maybe_save(pitstop.Progress(step=1), stop=stop)
                else:
                    ckpt.save(pitstop.Progress(step=1))
                say("saved 1")
            except KeyboardInterrupt as exc:
                say(f"interrupted {json.dumps(str(exc))}")
            report("save")
            try:
                ckpt.wait()
                say("wait ok")
            except pitstop.SaveError as exc:
                say(f"wait error {json.dumps(str(exc))}")
            train_step()
            ckpt.save(pitstop.Progress(step=2))
        ckpt.close()
        names = [c.path.name for c in ckpt.checkpoints()]
        say(f"checkpoints {json.dumps(names)}")
        temps = [p for p in Path(args.dir).iterdir() if p.name.startswith(".tmp-")]
        say(f"temps {len(temps)}")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_before_teardown(exit_code(main))
