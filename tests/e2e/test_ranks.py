"""pitstop's own collectives between real processes (gloo, 2 ranks): every value comes back
whole, in one round when it fits a box and in two when any rank's does not; an error on any
rank of a gather-then-lead is raised on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multirank import Job

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)


def test_values_of_every_size_travel_whole_between_two_ranks() -> None:
    with Job(Path(__file__).with_name("ranks_child.py"), ranks=2, timeout=120) as job:
        finished = job.wait()
    finished.check()
    assert finished.lines(0)[-1] == finished.lines(1)[-1] == "ok 579"
