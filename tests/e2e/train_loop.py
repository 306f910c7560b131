"""A custom training loop that uses pitstop, run as a real process by the end-to-end tests.

It trains an MLP with dropout and BatchNorm through AdamW, an LR schedule (warm-up + cosine, or
ReduceLROnPlateau), an AveragedModel EMA, a GradScaler, gradient accumulation, and shuffled
map-style data through ResumableSampler + DataLoader(num_workers=...). It can stop itself
mid-run (a stop request at a given micro-batch, or a real signal from the test) and resume.
It writes what a test compares — every state dict, the batches it trained on, and draws from
each RNG after training — as a pitstop file (so reading it never unpickles).

    python train_loop.py --dir D --target 12 --out result.pitstop [--stop-at-micro 7]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

import pitstop
from pitstop.shell.format import fileformat

SAMPLES, BATCH = 40, 4  # 10 micro-batches per epoch


def warmup_cosine(step: int) -> float:
    warmup, horizon = 3, 40
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / horizon)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-at-micro", type=int, default=-1)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scheduler", choices=["cosine", "plateau"], default="cosine")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ddp-port", type=int, default=0)
    parser.add_argument("--async-save", choices=["off", "on", "overlap"], default="off")
    parser.add_argument("--report", action="store_true", help="print 'step N' after each update")
    args = parser.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    if args.ddp_port:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}", rank=0, world_size=1
        )

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator)
    data = TensorDataset(
        x, x.sum(1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    )
    raw = nn.Sequential(
        nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
    )
    model: nn.Module = raw
    if args.ddp_port:
        model = nn.parallel.DistributedDataParallel(raw)
    if args.compile:
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(raw.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        if args.scheduler == "cosine"
        else torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1, factor=0.5)
    )
    ema = AveragedModel(raw, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    sampler = pitstop.ResumableSampler(len(data), BATCH, seed=123)
    loader = DataLoader(
        data,
        batch_sampler=sampler,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(2),  # iterator seeds never touch the global RNG
    )
    stop = pitstop.StopRequest()
    batches: list[list[float]] = []

    with (
        pitstop.Checkpointer(
            args.dir,
            model=model,
            ema=ema,
            state={
                "optimizer": optimizer,
                "scheduler": scheduler,
                "scaler": scaler,
                "sampler": sampler,
            },
            policy=pitstop.Policy(every_steps=3, keep_last=2),
            config={"lr": 0.05, "accum": args.accum, "scheduler": args.scheduler},
        ) as ckpt,
        stop.catch_signals(),
    ):
        progress = ckpt.resume()
        micro = progress.step * args.accum
        done = progress.step >= args.target
        while not done:
            sampler.set_position(progress, accumulate=args.accum)
            loss_sum = torch.zeros(())
            for inputs, targets in loader:
                batches.append(inputs[:, 0].tolist())
                loss = nn.functional.mse_loss(model(inputs), targets) / args.accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
                micro += 1
                if micro == args.stop_at_micro:
                    stop.request("test")
                if micro % args.accum:
                    continue  # a stop waits for the end of the accumulation window
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if args.scheduler == "cosine":
                    scheduler.step()
                else:
                    scheduler.step(loss_sum.item())
                ema.update_parameters(raw)
                loss_sum = torch.zeros(())
                progress = progress.advance(samples=BATCH * args.accum)
                ckpt.maybe_save(progress, stop=stop)
                if args.report:
                    print(f"step {progress.step}", flush=True)
                if stop or progress.step >= args.target:
                    done = True
                    break
            else:
                progress = progress.next_epoch()
        ckpt.finish(progress, stop=stop)

    result = {
        "model": raw.state_dict(),
        "ema": ema.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "scaler": scaler.state_dict(),
        "batches": batches,
        "progress": [progress.step, progress.epoch, progress.batch_in_epoch, progress.samples],
        "stop_reason": stop.reason,
        "draws": [torch.rand(3), random.random(), float(np.random.rand())],
    }
    with open(args.out, "wb") as f:
        fileformat.write(f, fileformat.prepare(result), {})
    if args.ddp_port:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
