"""A training loop reading through torchdata's StatefulDataLoader with 2 worker processes.

Run as a real process by tests/e2e/test_data_state.py. The data draws from Python's, NumPy's
and torch's random generators inside the workers (a random augmentation in ``__getitem__``,
or noise in an endless stream's ``__iter__``), wrapped in ``pitstop.WorkerRNG``; the loader is
a Checkpointer component. It can stop itself after a given step and resume. It writes the
batches it trained on, the weights and the progress as a pitstop file (never unpickled).
Started as one rank of several (``WORLD_SIZE`` > 1, by tests/multirank.py's Job) it joins a
gloo group, trains a DDP model, reads its own shard (a DistributedSampler for map-style data,
its own positions of the stream) and writes ``OUT.rank<r>``.

    python data_loop.py --kind map|stream --dir D --target 14 --out result.pitstop [--stop-at 6]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import pitstop
from pitstop.shell.format import fileformat

SAMPLES, BATCH = 24, 4  # map-style: 6 batches per epoch


def noise() -> float:
    """A draw from each of the three generators a worker has."""
    return random.random() + float(np.random.rand()) + float(torch.rand(()))


class Augmented(Dataset[torch.Tensor]):
    """Map-style: sample i, randomly augmented in the worker that reads it."""

    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = self.x[index] + 0.1 * noise()
        return torch.cat([torch.tensor([float(index)]), sample])


class Stream(IterableDataset[torch.Tensor]):
    """Endless: worker w of rank r (of R) reads positions r * workers + w + k * workers * R;
    its state is its position k."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.position = 0  # this worker's count of samples yielded
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            index = self.rank * workers + worker + self.position * workers * self.world
            self.position += 1
            yield torch.tensor([float(index), index % 7 + noise(), noise(), 0.0, 1.0])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["map", "stream"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--snapshot-every", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    torch.manual_seed(0)
    dataset = pitstop.WorkerRNG(Augmented() if args.kind == "map" else Stream(rank, world))
    sampler = None
    if world > 1 and args.kind == "map":  # each rank its shard; the loader replays its position
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=args.kind == "map" and sampler is None,
        sampler=sampler,
        num_workers=2,
        generator=torch.Generator().manual_seed(2 + rank),  # each rank's workers their own
        snapshot_every_n_steps=args.snapshot_every,
    )
    net = nn.Linear(4, 1)
    model: nn.Module = DistributedDataParallel(net) if world > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stop = pitstop.StopRequest()
    batches: list[list[float]] = []

    with pitstop.Checkpointer(
        args.dir,
        model=model,
        state={"optimizer": optimizer, "loader": loader},
        policy=pitstop.Policy(every_steps=4, keep_last=2),
    ) as ckpt:
        progress = ckpt.resume()
        while progress.step < args.target and not stop:
            if sampler is not None:
                sampler.set_epoch(progress.epoch)
            for batch in loader:
                batches.append(batch.flatten().tolist())
                loss = (model(batch[:, 1:]) - batch[:, :1]).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                progress = progress.advance(samples=len(batch))
                if progress.step == args.stop_at:
                    stop.request("test")
                ckpt.maybe_save(progress, stop=stop)
                if stop or progress.step >= args.target:
                    break
            else:
                progress = progress.next_epoch()
        ckpt.finish(progress, stop=stop)

    if world > 1:
        dist.destroy_process_group()
    result = {
        "model": net.state_dict(),
        "batches": batches,
        "progress": [progress.step, progress.epoch, progress.batch_in_epoch],
        "stop_reason": stop.reason,
    }
    with open(args.out if world == 1 else f"{args.out}.rank{rank}", "wb") as f:
        fileformat.write(f, fileformat.prepare(result), {})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
