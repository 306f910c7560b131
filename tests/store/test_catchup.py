"""A remote tier catches up, against a real S3 server on loopback (SeaweedFS, tests/s3server.py).

A tiered run whose uploads failed (the remote tier refused its credentials) is killed with
``kill -9``, its checkpoints only local; the next run on the directory resumes, and its remote
tier gains, in the background, the checkpoints it lacks that its retention keeps — and not the
ones its retention would retire at once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pitstop
from pitstop.core.naming import checkpoint_name
from s3server import CHILD_TIMEOUT_S, remote_steps
from tinyrun import trained

# Saves steps 1..3 to a tiered directory, then kills itself with SIGKILL: "failed" — its remote
# tier refuses its credentials (every upload fails and is kept for the next call); "queued" —
# the checkpoints carry 4 MiB of ballast (an upload takes a fraction of a second on the test
# server) and it is killed as soon as the third save returns, its uploads still queued.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    import torch
    import pitstop
    from tinyrun import trained, train_step
    model, optimizer = trained()
    if sys.argv[4] == "queued":
        model.register_buffer("ballast", torch.randn(1 << 20))
    ckpt = pitstop.Checkpointer(
        sys.argv[1], model=model, state={"optimizer": optimizer}, remote=sys.argv[2],
        policy=pitstop.Policy(keep_last=None),
    )
    progress = pitstop.Progress()
    for _ in range(3):
        train_step(model, optimizer)
        progress = progress.advance()
        ckpt.save(progress)
        if sys.argv[4] == "failed":
            try:
                ckpt.wait()
            except pitstop.SaveError:
                pass  # its upload failed (raised once, here); the local checkpoint stays
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def killed_run(local: Path, url: str, env: dict[str, str], how: str = "failed") -> None:
    """Run CHILD (``how``: its uploads "failed" or still "queued"); it dies by SIGKILL with
    steps 1..3 in the local directory, step 3 at least not uploaded."""
    tests = str(Path(__file__).resolve().parent.parent)
    refused = {"AWS_SECRET_ACCESS_KEY": "wrong-secret"} if how == "failed" else {}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(local), url, tests, how],
        env={**os.environ, **env, **refused},
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert sorted(p.name for p in local.glob("step_*")) == [checkpoint_name(s) for s in (1, 2, 3)]
    assert 3 not in remote_steps(url)


def reopened(
    local: Path, url: str, remote_policy: pitstop.Policy, how: str = "failed"
) -> list[int]:
    """Reopen the directory, resume, wait for the uploads: the remote tier's steps."""
    model, optimizer = trained(seed=3)
    if how == "queued":
        model.register_buffer("ballast", torch.zeros(1 << 20))
    with pitstop.Checkpointer(
        local,
        model=model,
        state={"optimizer": optimizer},
        remote=url,
        policy=pitstop.Policy(keep_last=None),
        remote_policy=remote_policy,
    ) as ckpt:
        assert ckpt.resume().step == 3
        ckpt.wait()  # the catch-up's uploads are done
        held = {c.step: c.tiers for c in ckpt.checkpoints()}
    steps = remote_steps(url)
    assert all(held[s] == ("local", "remote") for s in steps)
    return steps


@pytest.mark.parametrize("how", ["failed", pytest.param("queued", marks=pytest.mark.slow)])
def test_the_next_run_uploads_what_a_killed_run_did_not(
    local_tmp: Path, s3_url: str, s3_env: dict[str, str], how: str
) -> None:
    killed_run(local_tmp, s3_url, s3_env, how)
    assert reopened(local_tmp, s3_url, pitstop.Policy(keep_last=None), how) == [1, 2, 3]


def test_catching_up_never_uploads_what_the_remote_retention_retires(
    local_tmp: Path, s3_url: str, s3_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    killed_run(local_tmp, s3_url, s3_env)
    caplog.set_level(logging.INFO, logger="pitstop")
    assert reopened(local_tmp, s3_url, pitstop.Policy(keep_last=1)) == [3]
    uploaded = [r.getMessage() for r in caplog.records if "catching up" in r.getMessage()]
    assert len(uploaded) == 1  # steps 1 and 2 were never sent, only to be retired
    assert checkpoint_name(3) in uploaded[0]
