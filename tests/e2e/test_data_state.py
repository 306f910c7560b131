"""Exact resume of DataLoader workers' randomness: StatefulDataLoader + WorkerRNG, real processes.

Each run is a fresh Python process (tests/e2e/data_loop.py) reading through a
StatefulDataLoader with 2 worker processes, whose data draws from Python's, NumPy's and
torch's generators in the workers. Train straight, or stop mid-epoch and resume in a new
process: the resumed run trains on exactly the straight run's remaining batches and ends with
bitwise-equal weights. The same with 2 ranks (DDP on gloo, a Job of real processes): each
rank's loader state is its own, and each rank resumes its own shard exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from multirank import Job
from pitstop.shell.format import fileformat
from trees import assert_same

pytest.importorskip("torchdata")

SCRIPT = Path(__file__).with_name("data_loop.py")
TARGET = 14  # map-style: 6 batches per epoch, so the run spans 3 epochs


def run(directory: Path, out: Path, *extra: str) -> dict[str, Any]:
    """Run the loop to completion in a new process; return what it wrote."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded: dict[str, Any] = fileformat.load(out)
    return loaded


def assert_resumes_exactly(tmp_path: Path, stop_at: int, *options: str) -> None:
    common = ("--target", str(TARGET), *options)
    straight = run(tmp_path / "straight", tmp_path / "straight.pitstop", *common)
    first = run(tmp_path / "ckpt", tmp_path / "first.pitstop", *common, "--stop-at", str(stop_at))
    second = run(tmp_path / "ckpt", tmp_path / "second.pitstop", *common)
    assert first["stop_reason"] == "test"
    assert second["stop_reason"] is None
    assert len(first["batches"]) == stop_at
    assert first["batches"] == straight["batches"][:stop_at]
    assert second["batches"] == straight["batches"][stop_at:], "the resumed run read other data"
    assert_same(straight["model"], second["model"], "model")
    assert second["progress"] == straight["progress"]


# Step 9 is mid-epoch (epoch 1, batch 3) for the map-style data.
@pytest.mark.parametrize("kind", [pytest.param("map", marks=pytest.mark.slow), "stream"])
def test_random_data_in_workers_resumes_exactly(tmp_path: Path, kind: str) -> None:
    assert_resumes_exactly(tmp_path, 9, "--kind", kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param("map", marks=pytest.mark.slow), "stream"])
def test_snapshots_every_few_steps_still_resume_exactly(tmp_path: Path, kind: str) -> None:
    # The state is the last snapshot (step 6) plus 3 steps the loader replays on resume.
    assert_resumes_exactly(tmp_path, 9, "--kind", kind, "--snapshot-every", "3")


def run_ranks(directory: Path, out: Path, *extra: str) -> list[dict[str, Any]]:
    """Run the loop as 2 ranks (DDP) to completion; what each rank wrote."""
    with Job(SCRIPT, "--dir", directory, "--out", out, *extra, ranks=2, timeout=300) as job:
        job.wait().check()
    return [fileformat.load(Path(f"{out}.rank{rank}")) for rank in range(2)]


# Map-style with 2 ranks: 3 batches per rank per epoch; step 4 is mid-epoch (epoch 1, batch 1).
@pytest.mark.parametrize(
    ("kind", "stop_at"), [pytest.param("map", 4, marks=pytest.mark.slow), ("stream", 5)]
)
def test_two_ranks_resume_each_shard_exactly(tmp_path: Path, kind: str, stop_at: int) -> None:
    common = ("--kind", kind, "--target", "8")
    straight = run_ranks(tmp_path / "straight", tmp_path / "straight.pitstop", *common)
    first = run_ranks(
        tmp_path / "ckpt", tmp_path / "first.pitstop", *common, "--stop-at", str(stop_at)
    )
    second = run_ranks(tmp_path / "ckpt", tmp_path / "second.pitstop", *common)
    assert straight[0]["batches"] != straight[1]["batches"], "the ranks read the same data"
    for rank in range(2):
        assert first[rank]["stop_reason"] == "test"
        assert first[rank]["batches"] == straight[rank]["batches"][:stop_at]
        assert second[rank]["batches"] == straight[rank]["batches"][stop_at:], f"rank {rank}"
        assert_same(straight[rank]["model"], second[rank]["model"], f"rank {rank} model")
    assert_same(second[0]["model"], second[1]["model"], "the ranks' models")
