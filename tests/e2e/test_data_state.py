"""Exact resume of DataLoader workers' randomness: StatefulDataLoader + WorkerRNG, real processes.

Each run is a fresh Python process (tests/e2e/data_loop.py) reading through a
StatefulDataLoader with 2 worker processes, whose data draws from Python's, NumPy's and
torch's generators in the workers. Train straight, or stop mid-epoch and resume in a new
process: the resumed run trains on exactly the straight run's remaining batches and ends with
bitwise-equal weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_random_data_in_workers_resumes_exactly(tmp_path: Path, kind: str) -> None:
    assert_resumes_exactly(tmp_path, 9, "--kind", kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_snapshots_every_few_steps_still_resume_exactly(tmp_path: Path, kind: str) -> None:
    # The state is the last snapshot (step 6) plus 3 steps the loader replays on resume.
    assert_resumes_exactly(tmp_path, 9, "--kind", kind, "--snapshot-every", "3")
