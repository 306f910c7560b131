"""One rank of ``pitstop demo --ranks N``: a small DDP job on gloo that pitstop checkpoints.

Every rank runs this module (``python -m pitstop.cli.demo_ranks``) as its own process, with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment (as
``pitstop demo --ranks N`` or ``torchrun`` set them). The ranks train an MLP with dropout
through ``DistributedDataParallel`` on gloo with AdamW, on a fixed synthetic regression task
read through a :class:`~pitstop.ResumableSampler` sharded by rank. Each rank seeds its torch,
Python and NumPy RNG streams differently, so each has its own dropout masks and its own draws.

Every rank makes the same pitstop calls on the same directory: ``Checkpointer(...)``,
``resume()``, ``maybe_save(progress, stop=stop)`` after each update, ``finish``, ``close``.
SIGTERM or SIGINT to any one rank's process stops every rank at the same step
(``maybe_save(progress, stop=stop)`` agrees it after each update): one checkpoint is
published, with the stop's reason.

At the end each rank writes ``<out>.rank<R>.json``: its step, its stop reason, a SHA-256 of
its live weights' bytes, and the exact bits (``float.hex``) of draws from its torch, Python
and (when installed) NumPy RNG streams taken after training — what the demo compares between runs.

    python -m pitstop.cli.demo_ranks --dir DIR --target 40 --out OUT [--pace 0.1]

Lines printed (every rank): ``resumed at step N`` / ``starting fresh``, ``step N loss L``,
``saved step N (reason)``, ``stopped at step N (reason)``, ``finished at step N``.
Exit status 0, or 3 with an ``error ...`` line when a pitstop call failed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pitstop.shell.checkpoint import Checkpoint

__all__ = ["EVERY_STEPS", "KEEP_LAST", "main"]

SAMPLES, FEATURES, HIDDEN, BATCH = 256, 8, 32, 8  # 2 ranks: 16 batches per epoch each
EVERY_STEPS = 10
"""The ranks' checkpoint interval (``Policy(every_steps=...)``)."""
KEEP_LAST = 5
"""Enough for ``pitstop ls`` to show the whole story (the stop's checkpoint included)."""
TIMEOUT_S = 60.0  # every collective: a rank that never arrives is an error, not a hang
EXIT_PITSTOP_ERROR = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pitstop.cli.demo_ranks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dir", required=True, help="the checkpoint directory (shared)")
    parser.add_argument("--target", type=int, required=True, help="the absolute last step")
    parser.add_argument("--out", required=True, help="each rank writes <out>.rank<R>.json")
    parser.add_argument(
        "--pace", type=float, default=0.0, help="seconds to sleep after each update (watching)"
    )
    return parser.parse_args(argv)


def _described(saved: Checkpoint) -> str:
    detail = f" ({saved.detail})" if saved.detail else ""
    return f"saved step {saved.step} ({saved.reason.value}{detail})"


def _digest(state: dict[str, Any]) -> str:
    """SHA-256 of the tensors' names, dtypes, shapes and bytes (sorted by name)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(bytes(tensor.reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()


def _numpy() -> Any:
    """NumPy, when it is installed (its global RNG is one of the streams pitstop restores)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _train(args: argparse.Namespace, rank: int, world: int) -> int:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import pitstop

    data = torch.Generator().manual_seed(0)  # the same task on every rank
    x = torch.randn(SAMPLES, FEATURES, generator=data)
    y = x @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(SAMPLES, 1, generator=data)

    torch.manual_seed(0)  # the same initial weights (DDP also broadcasts rank 0's)
    net = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, 1)
    )
    model = DistributedDataParallel(net)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks and draws
    random.seed(100 + rank)
    numpy = _numpy()
    if numpy is not None:  # pitstop restores its stream too: seeded, it is reproducible
        numpy.random.seed(100 + rank)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
    sampler = pitstop.ResumableSampler(SAMPLES, BATCH, seed=1, rank=rank, world_size=world)

    stop = pitstop.StopRequest()
    ckpt = pitstop.Checkpointer(
        args.dir,
        model=model,
        state={"optimizer": optimizer, "sampler": sampler},
        policy=pitstop.Policy(every_steps=EVERY_STEPS, keep_last=KEEP_LAST),
        timeout_s=TIMEOUT_S,
    )
    closing: pitstop.Checkpointer | None = ckpt
    try:
        progress = ckpt.resume()
        print(f"resumed at step {progress.step}" if progress.step else "starting fresh")
        last_saved: Path | None = None
        with stop.catch_signals():
            while progress.step < args.target and not stop:
                sampler.set_position(progress)
                for indices in sampler:
                    loss = nn.functional.mse_loss(model(x[indices]), y[indices])
                    optimizer.zero_grad()
                    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                    optimizer.step()
                    progress = progress.advance(samples=len(indices) * world)
                    print(f"step {progress.step} loss {loss.item():.6f}")
                    if args.pace:
                        time.sleep(args.pace)
                    saved = ckpt.maybe_save(progress, stop=stop)
                    if saved is not None:
                        print(_described(saved))
                        last_saved = saved.path
                    if stop or progress.step >= args.target:
                        break
                else:
                    progress = progress.next_epoch()
        if stop:
            print(f"stopped at step {progress.step} ({stop.reason})")
        saved = ckpt.finish(progress, stop=stop)  # the stop's or the end's save, once
        if saved is not None and saved.path != last_saved:
            print(_described(saved))
        closing = None
        ckpt.close()
    except pitstop.PitstopError as exc:
        print(f"error {type(exc).__name__}: {exc}")
        return EXIT_PITSTOP_ERROR
    finally:
        if closing is not None:  # after an error: release the directory, keep the first error
            try:
                closing.close()
            except Exception as exc:
                print(f"close after the error: {type(exc).__name__}: {exc}")
    print(f"finished at step {progress.step}")

    result = {
        "rank": rank,
        "world_size": world,
        "step": progress.step,
        "stop_reason": stop.reason,
        "weights_sha256": _digest(net.state_dict()),
        "draws": {
            "torch": [float(v).hex() for v in torch.rand(4).tolist()],
            "python": [random.random().hex() for _ in range(2)],
            "numpy": None if numpy is None else [float(v).hex() for v in numpy.random.rand(2)],
        },
    }
    path = Path(f"{args.out}.rank{rank}.json")
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(temporary, path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one rank (rank and world size from the environment); return the exit status."""
    args = _parse(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        return _train(args, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
