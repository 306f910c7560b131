"""One writer per directory, with real processes: a live holder blocks, a dead one is taken over."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pitstop.errors import DirectoryLocked
from pitstop.shell.lock import DirectoryLock

HOLDER = """
import sys
from pitstop.shell.lock import DirectoryLock
lock = DirectoryLock(sys.argv[1], run_id="child-run")
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the parent closes stdin (or kills us)
lock.release()
print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process that holds the lock of ``tmp_path`` until told to stop."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "locked"
            yield child
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=60)


def test_a_second_writer_is_refused_with_the_holder_named(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(DirectoryLocked) as info:
        DirectoryLock(tmp_path, run_id="parent-run").acquire()
    message = str(info.value)
    assert "child-run" in message
    assert f"pid {holder.pid}" in message
    assert str(tmp_path) in message


def test_a_released_lock_can_be_taken(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    out, _ = holder.communicate("", timeout=60)
    assert out.strip() == "released"
    assert not (tmp_path / ".lock").exists()
    with DirectoryLock(tmp_path, run_id="parent-run") as lock:
        assert lock.held


def test_the_lock_of_a_killed_writer_is_taken_over_with_a_warning(
    tmp_path: Path, holder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    assert (tmp_path / ".lock").exists()  # a killed writer cannot clean up
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        lock = DirectoryLock(tmp_path, run_id="parent-run")
        lock.acquire()
    try:
        assert f"from run child-run (pid {holder.pid}" in caplog.text
        assert "parent-run" in (tmp_path / ".lock").read_text()
    finally:
        lock.release()


def test_release_is_idempotent_and_reacquire_works(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path, run_id="a")
    lock.acquire()
    lock.acquire()  # already held: nothing happens
    lock.release()
    lock.release()
    assert not lock.held
    with DirectoryLock(tmp_path, run_id="b"), pytest.raises(DirectoryLocked, match="run b"):
        DirectoryLock(tmp_path, run_id="c").acquire()
