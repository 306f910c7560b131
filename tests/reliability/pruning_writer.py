"""A live run for readers to race: saves every step with ``keep_last=1``; a real process.

    python pruning_writer.py DIR SAVES

Saves steps 1..SAVES through the public Checkpointer (each save publishes a new checkpoint,
moves the pointers and deletes the one before), printing ``saved <step>`` after each.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import pitstop


def main(directory: str, saves: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    policy = pitstop.Policy(every_steps=1, keep_last=1, save_final=False)
    progress = pitstop.Progress()
    with pitstop.Checkpointer(
        directory, model=model, state={"optimizer": optimizer}, policy=policy
    ) as ckpt:
        for _ in range(saves):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress = progress.advance(samples=4)
            ckpt.maybe_save(progress)
            print(f"saved {progress.step}", flush=True)
        ckpt.finish(progress)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
