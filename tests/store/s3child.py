"""A training run on an ``s3://`` prefix, in a process of its own (the tests' child).

``python s3child.py URL save STEPS``: train STEPS steps, saving after each, then print the
digest of the model and optimizer after STEPS more steps. ``... resume STEPS``: resume from
URL, then train STEPS more steps and print the same digest — equal to the saving run's when
the resume is exact. ``... loop BYTES``: save checkpoints of about BYTES bytes forever, printing
``saving N`` before each (a test kills it). The data of step ``s`` is seeded by ``s``.
``python s3child.py DIR MODE STEPS REMOTE``: the same on the local directory DIR with the remote
tier REMOTE (an ``s3://`` URL).
"""

from __future__ import annotations

import hashlib
import sys

import torch
from torch import nn

import pitstop


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().numpy().tobytes())
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                h.update(value.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    url, mode, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(1 if mode == "resume" else 0)  # a resume must not depend on its init
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    if mode == "loop":
        model.append(nn.Linear(arg // 4, 1, bias=False))  # about `arg` bytes of weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    remote = sys.argv[4] if len(sys.argv) > 4 else None
    ckpt = pitstop.Checkpointer(url, model=model, state={"optimizer": optimizer}, remote=remote)

    def train(progress: pitstop.Progress) -> pitstop.Progress:
        loss = model[:2](batch(progress.step)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return progress.advance()

    progress = pitstop.Progress()
    if mode == "save":
        for _ in range(arg):
            progress = train(progress)
            ckpt.save(progress)
    elif mode == "resume":
        progress = ckpt.resume()
    else:
        while True:
            progress = train(progress)
            print(f"saving {progress.step}", flush=True)
            ckpt.save(progress)
    for _ in range(arg):
        progress = train(progress)
    ckpt.close()
    print(f"step {progress.step} {digest(model, optimizer)}", flush=True)


if __name__ == "__main__":
    main()
