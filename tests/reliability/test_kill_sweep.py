"""Suite 1 — kill -9 sweep (Lightning #688/#19970, transformers #35782, flax #1200).

A real child process (forked from the fork server, tests/reliability/forkserver.py) trains and
saves every step with a Checkpointer in each mode — sync, async, overlap — and is killed with
SIGKILL at a random instant (a random delay after it has resumed, independent of where its
steps begin and end), then at each storage operation of a save (each publish boundary). The
next child resumes from what the last one left, so one directory lives through the whole
sweep. After every kill:

* the lock never blocks the next run (this process opens the directory for writing, then the
  next child does);
* leftovers are cleaned: no temp file survives that open;
* every checkpoint-named file verifies, and holds its own step's weights; every pointer on disk
  names one of them;
* resume restores a step >= the last one whose save returned (sync) or whose ``wait()``
  returned (async, overlap), with exactly that step's weights.

30 random instants per mode by default, 1000 under ``-m slow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from pitstop.core.naming import LATEST_JSON, TEMP_PREFIX
from pitstop.core.records import NO_CHECKPOINT, PointerName
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, choose_resume
from reliability.forkclient import ForkServer

MODES = ("sync", "async", "overlap")
HORIZON_S = 0.05  # kills land within this long after a child resumed: a dozen saves or so


def _weights(path: Path) -> set[float]:
    tree = fileformat.load(path)
    assert isinstance(tree, dict)
    raw = tree["weights"]["raw"]
    return {float(v) for t in raw.values() for v in (t.min(), t.max())}


_CHECKED: set[tuple[str, int, int, int]] = set()  # files whose contents were checked already


def _check_contents(file: Path, step: int) -> None:
    """Verify ``file`` and check it holds step ``step``'s weights (once per file version: a
    published file is never changed in place, only replaced by a new inode)."""
    stat = file.stat()
    key = (str(file), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if key in _CHECKED:
        return
    fileformat.verify(file)
    assert _weights(file) == {float(step)}, f"{file.name} holds another step"
    _CHECKED.add(key)


def check_directory(path: Path, durable: int) -> int:
    """Every guarantee a kill must leave; returns the step a resume restores."""
    directory = CheckpointDirectory(path)
    found = directory.open()  # the lock never blocks the next run
    try:
        names = directory.storage.names()
        assert not [n for n in names if n.startswith(TEMP_PREFIX)], "a temp file survived"
        assert not found.unreadable, f"a partial file under a final name: {found.unreadable}"
        for entry in found.catalog:
            _check_contents(path / entry.name, entry.step)
        for pointer in PointerName:
            link = path / pointer.value
            if link.is_symlink():
                assert (path / os.readlink(link)).is_file(), f"{pointer.value} dangles"
        if (path / LATEST_JSON).exists():
            latest = json.loads((path / LATEST_JSON).read_text())
            for target in latest["pointers"].values():
                assert target is None or (path / target).is_file(), f"latest.json -> {target}"
        choice = choose_resume(directory.storage, found, PointerName.LAST)
    finally:
        directory.close()
    if choice.entry is NO_CHECKPOINT:
        assert durable == 0, f"step {durable} was durable, then lost"
        return 0
    assert choice.entry.step >= durable, f"resume gives {choice.entry.step} < {durable}"
    return choice.entry.step


def _kill(server: ForkServer, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def one_life(
    server: ForkServer, path: Path, mode: str, durable: int, delay: float
) -> tuple[int, int]:
    """Run a child until it is killed ``delay`` s after resuming; return the step it resumed
    and the last step it made durable."""
    server.send(do="train", dir=str(path), mode=mode)
    pid = server.expect("pid", timeout=60)["child"]
    try:
        resumed = 0
        while True:
            event = server.event(60)
            assert event is not None, f"the child said nothing:\n{server.stderr()}"
            if event["event"] == "resumed":
                resumed = event["step"]
                assert resumed >= durable, f"resumed {resumed} < durable {durable}"
                want = [float(resumed)] if resumed else [0.0]
                assert event["values"] == want, f"resumed weights {event['values']}"
                break
            if event["event"] == "exit":
                pid = 0
                raise AssertionError(f"the child ended before it resumed:\n{server.stderr()}")
        deadline_events = []
        deadline = time.monotonic() + delay
        while (event := server.event(deadline - time.monotonic())) is not None:
            deadline_events.append(event)  # what the child says until the instant comes
            if event["event"] == "exit":
                pid = 0
                break
        if pid:
            _kill(server, pid)
        while pid:
            event = server.event(60)
            assert event is not None, "no exit after SIGKILL"
            deadline_events.append(event)
            if event["event"] == "exit":
                pid = 0
        status = next(e for e in deadline_events if e["event"] == "exit")["status"]
        assert os.WIFSIGNALED(status), f"the child ended ({status}):\n{server.stderr()}"
        assert os.WTERMSIG(status) == signal.SIGKILL
        made = [e["step"] for e in deadline_events if e["event"] in {"returned", "waited"}]
        return resumed, max([durable, *made])
    finally:
        if pid:
            _kill(server, pid)
            while (event := server.event(60)) is not None and event["event"] != "exit":
                pass


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "instants", [pytest.param(30, id="30"), pytest.param(1000, id="1000", marks=pytest.mark.slow)]
)
def test_kill_at_random_instants(
    forkserver: ForkServer, fast_dir: Path, mode: str, instants: int
) -> None:
    path = fast_dir / "run"
    rng = random.Random(f"{mode}-{instants}")
    durable = 0
    kills = 0
    moved = 0
    for _ in range(instants):
        resumed, durable = one_life(forkserver, path, mode, durable, rng.uniform(0, HORIZON_S))
        kills += 1
        restored = check_directory(path, durable)
        moved += restored > resumed
    assert kills == instants
    assert moved >= instants // 4, "many lives should publish something before the kill"


@pytest.mark.parametrize("mode", MODES)
def test_kill_at_each_publish_boundary(forkserver: ForkServer, fast_dir: Path, mode: str) -> None:
    """Two saves per life; the life is killed just before its storage operation k, for
    every k until a life finishes unharmed: every boundary of every file of a save."""
    path = fast_dir / "run"
    durable = 0
    for op in range(1, 200):
        server = forkserver
        server.send(do="train", dir=str(path), mode=mode, kill_at=op, steps=2)
        resumed, durable = _boundary_life(server, durable)
        check_directory(path, durable)
        if durable == resumed + 2:  # the child finished: op was past the last boundary
            break
    assert op >= 20  # two saves of about a dozen operations each


def _boundary_life(server: ForkServer, durable: int) -> tuple[int, int]:
    events = []
    while (event := server.event(60)) is not None:
        events.append(event)
        if event["event"] == "exit":
            break
    else:
        raise AssertionError(f"the child did not end:\n{server.stderr()}")
    status = event["status"]
    done = any(e["event"] == "done" for e in events)
    assert (done and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or (
        os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    ), f"the child ended otherwise ({status}):\n{server.stderr()}"
    resumed = next(e["step"] for e in events if e["event"] == "resumed")
    assert resumed >= durable
    made = [e["step"] for e in events if e["event"] in {"returned", "waited", "done"}]
    made = [m for m in made if m is not None]
    finished = [e["step"] for e in events if e["event"] == "done"]
    return resumed, max([durable, *(finished or made)]) if (finished or made) else durable
