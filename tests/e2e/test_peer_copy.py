"""A catch-up copy between two real processes (gloo): waits longer than pitstop's wait slices
end whole, a byte flipped in transit is caught by the CRC-32 of the whole, a sender whose file
changed after it was checked is caught by the receiver's check before publishing — and in both
cases nothing is published; a directory that caught up holds its pointers.
tests/e2e/peer_copy_child.py is one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multirank import Job

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)


def test_a_copy_changed_on_its_way_or_on_its_senders_disk_is_never_published(
    tmp_path: Path,
) -> None:
    child = Path(__file__).with_name("peer_copy_child.py")
    with Job(child, tmp_path, ranks=2, timeout=180) as job:
        finished = job.wait()
    finished.check()
    assert {finished.lines(rank)[-1] for rank in range(2)} == {"ok 13"}
