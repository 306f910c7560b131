"""The multi-process harness (tests/multirank.py) and the DDP script on one rank.

These need no multi-rank support from pitstop: when tests/e2e/test_multirank.py fails and
these pass, the failure is pitstop's, not the harness's or the script's.
"""

from __future__ import annotations

import re
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from multirank import Job, JobFailed, JobTimeout, alive
from pitstop.shell import fileformat
from trees import assert_same

needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

ALL_REDUCE = """
import datetime, os
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group(
    "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world}: sum {int(total.item())}", flush=True)
dist.destroy_process_group()
"""

# Prints its pid and a child's, then blocks (for at most 10 minutes: never forever). With
# --rank-0-fails or --rank-0-leaves, rank 0 exits at once instead (1 or 0); the child it
# leaves behind still holds its output pipe open.
BLOCKER = """
import os, subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait(600)"])
print(f"ready {os.getpid()} {child.pid}", flush=True)
if os.environ.get("RANK") == "0" and "--rank-0-fails" in sys.argv:
    sys.exit(1)
if os.environ.get("RANK") == "0" and "--rank-0-leaves" in sys.argv:
    print("bye", flush=True)
    sys.exit(0)
threading.Event().wait(600)
"""


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def ready_pids(job: Job, rank: int) -> tuple[int, int]:
    line = job.wait_for(rank, re.compile(r"^ready \d+ \d+$"))
    _, own, child = line.split()
    return int(own), int(child)


@needs_gloo
@pytest.mark.parametrize("torchrun", [False, True], ids=["direct", "torchrun"])
def test_an_all_reduce_job(tmp_path: Path, torchrun: bool) -> None:
    with Job(script(tmp_path, "all_reduce.py", ALL_REDUCE), ranks=2, torchrun=torchrun) as job:
        assert job.wait_for(1, "rank 1 of 2: sum 3") == "rank 1 of 2: sum 3"
        finished = job.wait().check()
    assert "rank 0 of 2: sum 3" in finished.lines(0)
    assert "rank 1 of 2: sum 3" in finished.lines(1)
    assert "rank 1" not in finished.outputs[0]  # each rank's lines are its own
    if not torchrun:
        assert finished.codes == {0: 0, 1: 0}
        assert finished.lines(0) == ["rank 0 of 2: sum 3"]


def fail_inside_a_job(job: Job, started: list[int]) -> None:
    """Collect every pid of a running blocker job, then fail as a test would."""
    with job:
        for rank in range(job.ranks):
            own, child = ready_pids(job, rank)
            assert job.pid(rank) == own
            started += [own, child]
        if job.launcher_pid is not None:
            started.append(job.launcher_pid)
        assert all(alive(pid) for pid in started)
        raise RuntimeError("the test failed")  # the processes must not outlive it


@pytest.mark.parametrize("torchrun", [False, True], ids=["direct", "torchrun"])
def test_leaving_the_block_kills_every_process(tmp_path: Path, torchrun: bool) -> None:
    blocker = script(tmp_path, "blocker.py", BLOCKER)
    started: list[int] = []
    with pytest.raises(RuntimeError, match="the test failed"):
        fail_inside_a_job(Job(blocker, ranks=2, torchrun=torchrun), started)
    assert len(started) == (5 if torchrun else 4)
    assert not [pid for pid in started if alive(pid)]


def test_signal_and_kill_reach_one_rank(tmp_path: Path) -> None:
    blocker = script(tmp_path, "blocker.py", BLOCKER)
    with Job(blocker, ranks=2, drain=0.2) as job:
        ready_pids(job, 0)
        _, child = ready_pids(job, 1)
        job.signal(0, signal.SIGTERM)
        job.kill(1)
        finished = job.wait()
    assert finished.codes == {0: -signal.SIGTERM, 1: -signal.SIGKILL}
    assert not alive(child)  # kill() takes the rank's process group with it


def test_a_wait_past_its_timeout_fails_with_the_output(tmp_path: Path) -> None:
    blocker = script(tmp_path, "blocker.py", BLOCKER)
    with Job(blocker, ranks=1) as job:
        own, _ = ready_pids(job, 0)
        with pytest.raises(JobTimeout, match=r"(?s)did not print 'never'.*\| ready "):
            job.wait_for(0, "never", timeout=0.2)
        with pytest.raises(JobTimeout, match=r"(?s)did not end within.*\| ready "):
            job.wait(timeout=0.2)
    assert not alive(own)


def test_output_that_ends_without_the_marker_fails_at_once(tmp_path: Path) -> None:
    blocker = script(tmp_path, "blocker.py", BLOCKER)
    with Job(blocker, "--rank-0-leaves", ranks=1, drain=0.2) as job:
        # The timeout is far beyond what the test takes: it must fail once the rank has
        # exited (and its output had ``drain`` seconds to arrive), not time out — although
        # the child it left keeps the pipe open.
        with pytest.raises(JobFailed, match=r"(?s)output ended without 'never'.*\| bye"):
            job.wait_for(0, "never", timeout=600)
        finished = job.wait(timeout=600)
    assert finished.codes == {0: 0}
    assert finished.lines(0)[-1] == "bye"


def test_a_rank_that_outlives_a_failed_one_is_killed_after_the_grace(tmp_path: Path) -> None:
    blocker = script(tmp_path, "blocker.py", BLOCKER)
    with Job(blocker, "--rank-0-fails", ranks=2, drain=0.2) as job:
        finished = job.wait(grace=0.2)
    assert finished.codes == {0: 1, 1: -signal.SIGKILL}
    assert finished.killed == {1}
    with pytest.raises(AssertionError, match="killed by the harness after another rank failed"):
        finished.check()


# --- the DDP script itself, on one rank (no multi-rank support needed) ----------------------

DDP_LOOP = Path(__file__).with_name("ddp_loop.py")
ONE_RANK = ("--no-meter", "--target", "6", "--every", "2")  # no per_rank= argument


def one_rank(directory: Path, out: Path, *options: str) -> dict[str, Any]:
    with Job(DDP_LOOP, "--dir", directory, "--out", out, *ONE_RANK, *options, ranks=1) as job:
        job.wait().check()
    loaded: dict[str, Any] = fileformat.load(Path(f"{out}.rank0.pitstop"))
    return loaded


@needs_gloo
@pytest.mark.slow  # test_multirank.py stops and resumes the same script on 2 ranks by default
def test_the_ddp_script_stops_and_resumes_exactly_on_one_rank(tmp_path: Path) -> None:
    straight = one_rank(tmp_path / "straight", tmp_path / "straight")
    directory = tmp_path / "ckpt"
    hold = ("--report", "--hold-at", "3", "--hold-rank", "0")
    with Job(
        DDP_LOOP, "--dir", directory, "--out", tmp_path / "first", *ONE_RANK, *hold, ranks=1
    ) as job:
        job.wait_for(0, "step 3")
        job.signal(0, signal.SIGTERM)
        job.wait().check()
    first: dict[str, Any] = fileformat.load(tmp_path / "first.rank0.pitstop")
    assert (first["progress"][0], first["stop_reason"]) == (3, "SIGTERM")
    second = one_rank(directory, tmp_path / "second")
    assert second["resumed"]["progress"] == first["progress"][:3]
    assert first["batches"] + second["batches"] == straight["batches"]
    for key in ("model", "ema", "optimizer", "scheduler", "draws", "progress"):
        assert_same(straight[key], second[key], key)
