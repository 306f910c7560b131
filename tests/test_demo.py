"""`pitstop demo` — the main job of `make demo` — works from any directory, for real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

import pitstop
from pitstop.shell.directory import scan
from pitstop.shell.storage import LocalStorage


def test_the_demo_pauses_resumes_and_matches_the_straight_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pitstop", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "sending SIGTERM to the child" in out
    # The signal lands once the child reports step 17; it stops after the window it is in.
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", out)
    assert stopped is not None, out
    step = int(stopped.group(1))
    assert 17 <= step < 40
    assert f"resumed at step {step}, made {40 - step} updates" in out
    assert "bitwise equal" in out
    assert "resume.png" in out or "matplotlib is not installed" in out

    resumed = tmp_path / "runs" / "demo" / "resumed" / "checkpoints"
    found = scan(LocalStorage(resumed))
    assert found.pointers.final == "step_000000000040.pitstop"
    straight = pitstop.load(tmp_path / "runs" / "demo" / "straight" / "checkpoints" / "final")
    again = pitstop.load(resumed / "final")
    for kind in ("raw", "ema"):
        assert straight["weights"][kind].keys() == again["weights"][kind].keys()
        for name, tensor in straight["weights"][kind].items():
            assert torch.equal(tensor, again["weights"][kind][name]), (kind, name)
