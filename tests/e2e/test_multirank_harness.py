"""The multi-process harness (tests/multirank.py) and the DDP script on one rank.

These need no multi-rank support from pitstop: when tests/e2e/test_multirank.py fails and
these pass, the failure is pitstop's, not the harness's or the script's.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from multirank import LAUNCHER, Job, JobFailed, JobTimeout, alive
from pitstop.shell.format import fileformat
from teejoin import TeeJoiner
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


# --- torchrun's --tee: a line it forwards in parts is still one line of its rank ------------


class Recorder(io.StringIO):
    """A TextIO that keeps each write and lets a test wait until some text has come."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.written = threading.Condition()

    def write(self, text: str) -> int:
        with self.written:
            self.writes.append(text)
            count = super().write(text)
            self.written.notify_all()
        return count

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        with self.written:
            if not self.written.wait_for(lambda: text in self.getvalue(), timeout):
                pytest.fail(f"torchrun's tailer did not forward {text!r}: {self.writes!r}")


def torn_tee_writes(tmp_path: Path) -> list[str]:
    """What torchrun writes to its stdout when it catches rank 1 between print()'s writes.

    torch's own tailer (the code behind ``torchrun --tee``) on two log files: rank 1 has
    written ``ready 11 12`` but not yet its newline (under ``PYTHONUNBUFFERED=1`` the text
    and the newline are two writes); rank 0 prints a line; then rank 1's newline comes.
    """
    logs = {rank: tmp_path / f"{rank}_stdout.log" for rank in (0, 1)}
    files = {rank: open(path, "w", buffering=1) for rank, path in logs.items()}  # noqa: SIM115
    out = Recorder()
    tailer = TailLog("default", {rank: str(path) for rank, path in logs.items()}, out)
    try:
        tailer.start()
        files[1].write("ready 11 12")
        files[1].flush()
        out.wait_for("[default1]:ready 11 12")  # forwarded without its newline
        files[0].write("ready 21 22\n")
        out.wait_for("[default0]:ready 21 22\n")
        files[1].write("\n")
        out.wait_for("[default1]:\n")
    finally:
        tailer.stop()
        for f in files.values():
            f.close()
    return out.writes


class Replay(Job):
    """A torchrun job whose launcher only makes the writes in ``writes`` and exits: a JSON
    list of ``["stdout" or "stderr", text]``, each flushed at once."""

    def __init__(self, writes: Path) -> None:
        super().__init__(writes, ranks=2, torchrun=True, drain=0.2)

    def _launcher_command(self, log_dir: str) -> list[str]:
        replay = (
            "import json, sys\n"
            "for name, text in json.loads(open(sys.argv[1]).read()):\n"
            "    getattr(sys, name).write(text)\n"
            "    getattr(sys, name).flush()\n"
        )
        return [sys.executable, "-c", replay, str(self.script)]


def test_a_line_torchrun_forwards_in_parts_reaches_its_rank_whole(tmp_path: Path) -> None:
    writes = torn_tee_writes(tmp_path)
    # torch 2.13 forwards the part: read line by line, rank 1's line would hold rank 0's and
    # rank 0 would have none; so test_leaving_the_block_kills_every_process[torchrun] lost a
    # rank's "ready" line on a loaded machine.
    assert writes == ["[default1]:ready 11 12", "[default0]:ready 21 22\n", "[default1]:\n"]
    # Meanwhile torchrun's stderr carries its own lines and the ranks' stderr: a part on
    # stdout is never continued by them.
    on_stderr = ["torchrun's own line\n", "[default1]:a warning\n"]
    replay = [("stdout", writes[0]), *(("stderr", text) for text in on_stderr)]
    replay += [("stdout", text) for text in writes[1:]]
    (tmp_path / "writes.json").write_text(json.dumps(replay))
    with Replay(tmp_path / "writes.json") as job:
        assert job.wait_for(1, re.compile(r"^ready \d+ \d+$")) == "ready 11 12"
        assert job.wait_for(0, re.compile(r"^ready \d+ \d+$")) == "ready 21 22"
        finished = job.wait().check()
        assert job.lines(LAUNCHER) == ["torchrun's own line"]
    assert finished.lines(0) == ["ready 21 22"]
    assert sorted(finished.lines(1)) == ["a warning", "ready 11 12"]


LINE = st.text(st.characters(exclude_characters="\n\r["), max_size=12)


@st.composite
def tee_streams(draw: st.DrawFn) -> tuple[dict[int, list[str]], list[str], str]:
    """Each rank's lines, torchrun's own, and a stream that forwards the ranks' lines in
    parts (each with the rank's prefix, the newline with the last), interleaved at random;
    torchrun's own lines come between whole writes of its own (a write of its own is whole)."""
    ranks = {rank: draw(st.lists(LINE, max_size=4)) for rank in range(3)}
    own = draw(st.lists(LINE, max_size=3))
    queues: dict[int, list[str]] = {LAUNCHER: [f"{line}\n" for line in own]}
    for rank, lines in ranks.items():
        queues[rank] = []
        for line in lines:
            # Where the tailer found the end of the file: never at a part's start (readline
            # returns something), perhaps just before the newline (the last part is "").
            cuts = draw(st.sets(st.integers(1, len(line)), max_size=3)) if line else set()
            edges = [0, *sorted(cuts)]
            parts = [line[a:b] for a, b in itertools.pairwise(edges)] + [line[edges[-1] :]]
            queues[rank] += [f"[default{rank}]:{part}" for part in parts[:-1]]
            queues[rank].append(f"[default{rank}]:{parts[-1]}\n")
    stream: list[str] = []
    while any(queues.values()):
        ready = [key for key, queue in queues.items() if queue]
        if not stream or stream[-1].endswith("\n"):
            choices = ready
        else:  # a part without its newline: only ranks' writes can follow it
            choices = [key for key in ready if key != LAUNCHER] or ready
        stream.append(queues[draw(st.sampled_from(sorted(choices)))].pop(0))
    return ranks, own, "".join(stream)


@given(tee_streams())
def test_the_tee_joiner_gives_every_rank_its_lines(
    case: tuple[dict[int, list[str]], list[str], str],
) -> None:
    ranks, own, stream = case
    joiner = TeeJoiner(ranks, LAUNCHER)
    got: dict[int, list[str]] = {key: [] for key in [*ranks, LAUNCHER]}
    for line in io.StringIO(stream):  # as the harness reads a pipe: line by line
        for key, text in joiner.feed(line.rstrip("\r\n")):
            got[key].append(text)
    for key, text in joiner.close():
        got[key].append(text)
    assert got == {**ranks, LAUNCHER: own}


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
