"""``async_save=True`` on ``s3://``, against a real S3 server on loopback (SeaweedFS,
tests/s3server.py): a run that saves in the background pauses (a stop request at step 3, its
last save published before ``finish`` returns), and a fresh process resumes it exactly — the
weights and optimizer state after 6 steps equal those of a run of 6 steps that never stopped.
"""

from __future__ import annotations

import textwrap

import pytest

from s3server import run_python

# python -c CHILD URL MODE: "straight" trains 6 steps; "pause" trains 3, saving each in the
# background, and stops; "resume" resumes (a different init) and trains to step 6. Each prints
# the digest of the weights and optimizer state, and the step it ended at.
CHILD = textwrap.dedent(
    """
    import hashlib, sys
    import torch
    from torch import nn
    import pitstop

    url, mode, background = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(1 if mode == "resume" else 0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    async_save = {"true": True, "overlap": "overlap"}[background]
    ckpt = pitstop.Checkpointer(
        url, model=model, state={"optimizer": optimizer}, async_save=async_save
    )
    progress = ckpt.resume() if mode == "resume" else pitstop.Progress()
    stop = pitstop.StopRequest()
    while progress.step < (3 if mode == "pause" else 6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(progress.step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress = progress.advance()
        if mode != "straight" and progress.step < 3:
            ckpt.save(progress)
    if mode == "pause":
        stop.request("paused")
    record = ckpt.finish(progress, stop=stop) if mode != "straight" else None
    ckpt.close()
    assert mode != "pause" or record.published
    h = hashlib.sha256()
    for tensor in [*model.state_dict().values(), *(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )]:
        h.update(tensor.detach().numpy().tobytes())
    print(progress.step, h.hexdigest())
    """
)


@pytest.mark.parametrize("background", ["true", pytest.param("overlap", marks=pytest.mark.slow)])
def test_a_background_save_pauses_and_resumes_exactly_in_a_fresh_process(
    s3_url: str, s3_env: dict[str, str], background: str
) -> None:
    straight = run_python(["-c", CHILD, s3_url + "-straight", "straight", background], s3_env)
    paused = run_python(["-c", CHILD, s3_url, "pause", background], s3_env)
    resumed = run_python(["-c", CHILD, s3_url, "resume", background], s3_env)
    assert paused.startswith("3 ")
    assert resumed.startswith("6 ")
    assert resumed == straight
