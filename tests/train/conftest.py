"""Fixtures for the trainer tests: runs that several tests read, computed once."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # trainkit and pausing_pitstop live here

import trainkit


@pytest.fixture(scope="session")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/smoke.yaml trained from scratch to --max-steps 10: the uninterrupted run."""
    out = tmp_path_factory.mktemp("straight")
    done = trainkit.train(trainkit.SMOKE, out, "--max-steps", "10")
    (out / "stdout.txt").write_text(done.stdout)
    return out


@pytest.fixture(scope="session")
def resume_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The seed's two-step resume demonstration, run verbatim in a fresh working directory.

    Returns the working directory and the two commands' stdout.
    """
    work = tmp_path_factory.mktemp("demo")
    (work / "configs").mkdir()
    shutil.copy(trainkit.SMOKE, work / "configs" / "smoke.yaml")
    outputs = []
    for command in trainkit.DEMO_COMMANDS:
        done = trainkit.run_verbatim(command, cwd=work)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout)
    return work, outputs
