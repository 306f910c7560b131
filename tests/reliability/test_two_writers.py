"""Suite 6 — two writers: races for one directory, a dead holder, files that never mix.

* Threads (100 races by default, 1000 under ``-m slow``) and processes forked at once (20 / 200)
  race to open one directory for writing: exactly one wins; every other gets DirectoryLocked
  naming the live winner (its run id and pid), never "an unknown writer" nor a previous, dead
  holder. The winner saves; a loser cannot.
* A holder killed with SIGKILL leaves its lock to be taken over, with a warning naming it.
* Every checkpoint in the directory afterwards was written whole by the winner of its race.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from dirtools import save
from pitstop.core.records import Policy
from pitstop.errors import DirectoryLocked, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.storage import LocalStorage
from reliability.forkclient import ForkServer

POLICY = Policy(keep_last=3)


def _race(path: Path, names: list[str]) -> tuple[dict[str, str], dict[str, CheckpointDirectory]]:
    """Open ``path`` from one thread per run id, all released at once."""
    barrier = threading.Barrier(len(names))
    outcome: dict[str, str] = {}
    opened = {name: CheckpointDirectory(path, policy=POLICY, run_id=name) for name in names}

    def go(name: str) -> None:
        barrier.wait(timeout=30)
        try:
            opened[name].open()
        except DirectoryLocked as error:
            outcome[name] = str(error)
        else:
            outcome[name] = "won"

    threads = [threading.Thread(target=go, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a racer hung"
    return outcome, opened


@pytest.mark.parametrize(
    "races", [pytest.param(100, id="100"), pytest.param(1000, id="1000", marks=pytest.mark.slow)]
)
def test_threads_racing_for_a_directory(fast_dir: Path, races: int) -> None:
    path = fast_dir / "run"
    winners: dict[int, str] = {}
    for race in range(races):
        names = [f"a{race}", f"b{race}"]
        outcome, opened = _race(path, names)
        won = [n for n in names if outcome[n] == "won"]
        assert len(won) == 1, f"race {race}: {outcome}"
        winner = won[0]
        for name in names:
            if name != winner:
                assert f"locked by run {winner} (pid {os.getpid()}" in outcome[name], outcome
                with pytest.raises(SaveError, match="not open for writing"):
                    save(opened[name], race + 1)
        save(opened[winner], race + 1, meta={"writer": winner})
        winners[race + 1] = winner
        opened[winner].close()
    found = scan(LocalStorage(path))
    assert [e.step for e in found.catalog] == sorted(winners)[-3:]
    for entry in found.catalog:  # files never mix: each is its winner's, whole
        file = path / entry.name
        fileformat.verify(file)
        assert fileformat.read_manifest(file).meta["writer"] == winners[entry.step]


@pytest.mark.parametrize(
    "races", [pytest.param(20, id="20"), pytest.param(200, id="200", marks=pytest.mark.slow)]
)
def test_processes_racing_for_a_directory(
    forkserver: ForkServer, fast_dir: Path, races: int
) -> None:
    for race in range(races):
        path = fast_dir / f"run{race % 3}"  # a directory again and again, and several
        forkserver.send(do="race", dir=str(path), count=3)
        results = _outcomes(forkserver, 3)
        won = [r for r in results if r["event"] == "won"]
        assert len(won) == 1, f"race {race}: {results}"
        winner = won[0]
        for result in results:
            if result is not winner:
                assert (
                    f"locked by run racer{winner['index']} (pid {winner['pid']}"
                    in (result["message"])
                ), result
        for _ in range(3):
            exit_event = forkserver.expect("exit", timeout=60)
            assert os.WIFEXITED(exit_event["status"])
            assert os.WEXITSTATUS(exit_event["status"]) == 0
        assert not (path / ".lock").exists()  # the winner released it


def _outcomes(server: ForkServer, count: int) -> list[dict[str, Any]]:
    """The next ``count`` won/lost events."""
    results: list[dict[str, Any]] = []
    while len(results) < count:
        event = server.event(60)
        assert event is not None, f"a racer said nothing:\n{server.stderr()}"
        assert event["event"] != "exit", f"a racer ended early: {event}\n{server.stderr()}"
        if event["event"] in {"won", "lost"}:
            results.append(event)
    return results


def test_a_dead_holders_lock_is_taken_over(
    forkserver: ForkServer, fast_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = fast_dir / "run"
    forkserver.send(do="hold", dir=str(path), run_id="doomed")
    pid = forkserver.expect("pid")["child"]
    try:
        forkserver.expect("held", pid=pid)
        with pytest.raises(DirectoryLocked, match=rf"locked by run doomed \(pid {pid}"):
            CheckpointDirectory(path).open()
    finally:
        os.kill(pid, signal.SIGKILL)
    forkserver.expect("exit")
    assert (path / ".lock").exists()  # a killed writer cannot clean up
    with caplog.at_level(logging.WARNING, logger="pitstop"), CheckpointDirectory(path) as taken:
        save(taken, 1)
    assert f"from run doomed (pid {pid}" in caplog.text
    assert "no longer running" in caplog.text
