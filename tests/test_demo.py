"""`pitstop demo` — the main job of `make demo` — works from any directory, for real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

import pitstop
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage


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


def test_the_demo_says_what_it_is_doing_before_the_slow_imports(tmp_path: Path) -> None:
    """The first stage's line comes before torch is imported (seconds on a cold start), within
    a second of starting. The child reports the moment torch starts importing."""
    child = (
        "import sys\n"
        "class Tell:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print('<importing torch>', flush=True)\n"
        "sys.meta_path.insert(0, Tell())\n"
        "sys.argv = ['pitstop', 'demo']\n"
        "from pitstop.cli import main\n"
        "sys.exit(main())\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", child], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            first = process.stdout.readline()
            second = process.stdout.readline()
        finally:
            process.kill()
    assert first.startswith("1. training straight through to step 40"), first
    assert second == "<importing torch>\n", second


def test_the_multirank_demo_stops_one_rank_by_sigterm_and_resumes_bitwise(tmp_path: Path) -> None:
    """`pitstop demo --ranks 2`: two gloo ranks; a SIGTERM to rank 1 alone stops both at one
    step with one stop checkpoint; the resumed run equals the straight one bit for bit."""
    with subprocess.Popen(
        [sys.executable, "-m", "pitstop", "demo", "--ranks", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            first = process.stdout.readline()
            rest, _ = process.communicate(timeout=300)  # a bound on a hang, not a timing
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    out = first + rest
    assert process.returncode == 0, out
    assert first.startswith("1. training 2 ranks (gloo, one process each) straight"), out
    assert "sending SIGTERM to rank 1 (pid " in out, out
    stopped = re.findall(r"rank (\d): stopped at step (\d+) \((.*)\)", out)
    assert sorted(rank for rank, _, _ in stopped) == ["0", "1"], out
    assert len({step for _, step, _ in stopped}) == 1, out  # the same step on both ranks
    step = int(stopped[0][1])
    assert 17 <= step < 40
    assert {rank: why for rank, _, why in stopped}["1"] == "SIGTERM"
    name = f"step_{step:012d}.pitstop"
    assert f"checkpoints with reason stop: 1 — {name} (stop (SIGTERM))" in out, out
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step {step}" in out, out
    assert "bitwise equal:" in out, out

    root = tmp_path / "runs" / "demo-ranks"
    resumed = root / "resumed" / "checkpoints"
    infos = [pitstop.info(path) for path in sorted(resumed.glob("step_*.pitstop"))]
    stops = [c for c in infos if c.reason is pitstop.SaveReason.STOP]
    assert [(c.step, c.detail) for c in stops] == [(step, "SIGTERM")], infos
    assert scan(LocalStorage(resumed)).pointers.final == "step_000000000040.pitstop"
    straight = pitstop.load(root / "straight" / "checkpoints" / "final")["weights"]["raw"]
    again = pitstop.load(resumed / "final")["weights"]["raw"]
    assert straight.keys() == again.keys()
    for name_, tensor in straight.items():
        assert torch.equal(tensor, again[name_]), name_
