"""pitstop's own collectives between real processes (gloo, 2 and 4 ranks): every value comes back
whole and of the same type, in one round when it fits a box and in two when any rank's does not;
a value that cannot travel is refused by every rank, in step; an error on any
rank of a gather-then-lead is raised on every rank, and a Ctrl-C in one rank's work on every
rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multirank import Job

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)


# Four ranks (slow: four processes on CI's two cores): several ranks' values too big for the
# gather's box reach rank 0 one after another, and the last rank's failure is not rank 1's.
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_values_of_every_size_travel_whole_between_ranks(ranks: int) -> None:
    with Job(Path(__file__).with_name("ranks_child.py"), ranks=ranks, timeout=240) as job:
        finished = job.wait()
    finished.check()
    assert {finished.lines(rank)[-1] for rank in range(ranks)} == {"ok 595"}


def test_a_copy_travels_whole_between_two_writers_and_a_failure_ends_both_sides() -> None:
    # pitstop.shell.ranks.peers: a nodes' catch-up copy, in chunks; tests/e2e/peers_child.py
    with Job(Path(__file__).with_name("peers_child.py"), ranks=2, timeout=120) as job:
        finished = job.wait()
    finished.check()
    assert {finished.lines(rank)[-1] for rank in range(2)} == {"ok 7"}
