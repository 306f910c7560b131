"""One writer per directory, with real processes: a live holder blocks, a dead one is taken over."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pitstop.errors import DirectoryLocked, SaveError
from pitstop.shell.store.lock import DirectoryLock

HOLDER = """
import sys
from pitstop.shell.store.lock import DirectoryLock
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


# --- the holder's record is readable whenever the lock is held ---------------------------------


def _second_writer_during_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[DirectoryLock, list[BaseException]]:
    """Writer "first" takes the lock; in the instant after its flock and before its record is
    written, writer "second" tries (on its own thread). Returns the first lock and what the
    second one raised."""
    from pitstop.shell.store import lock as lock_module

    real = lock_module.os.ftruncate
    errors: list[BaseException] = []
    seconds: list[threading.Thread] = []

    def second() -> None:
        try:
            DirectoryLock(tmp_path, run_id="second").acquire()
        except BaseException as error:
            errors.append(error)

    def ftruncate(fd: int, length: int) -> None:
        if not seconds:  # the first writer's own record write: hold still while "second" tries
            thread = threading.Thread(target=second)
            seconds.append(thread)
            thread.start()
            thread.join(timeout=0.5)  # without a gate it is refused here, in the window
        real(fd, length)

    monkeypatch.setattr(lock_module.os, "ftruncate", ftruncate)
    first = DirectoryLock(tmp_path, run_id="first")
    first.acquire()
    monkeypatch.setattr(lock_module.os, "ftruncate", real)
    seconds[0].join(timeout=60)
    assert not seconds[0].is_alive()
    return first, errors


def test_a_writer_starting_at_the_same_instant_names_the_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, errors = _second_writer_during_the_window(tmp_path, monkeypatch)
    try:
        assert len(errors) == 1
        assert isinstance(errors[0], DirectoryLocked)
        assert f"locked by run first (pid {os.getpid()}" in str(errors[0])
    finally:
        first.release()


def test_a_writer_starting_during_a_takeover_names_the_new_holder_not_the_dead_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".lock").write_text('{"host": "gone", "pid": 999999, "run_id": "dead-run"}')
    first, errors = _second_writer_during_the_window(tmp_path, monkeypatch)
    try:
        assert len(errors) == 1
        message = str(errors[0])
        assert "locked by run first" in message
        assert "dead-run" not in message
    finally:
        first.release()


# --- a .lock that is not a regular file --------------------------------------------------------


def test_a_lock_symlink_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / ".lock")
    with pytest.raises(SaveError, match=r"\.lock is a symlink, not pitstop's lock file"):
        DirectoryLock(run, run_id="x").acquire()
    assert victim.read_text() == "do not truncate me"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_a_fifo_or_a_directory_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    lock = tmp_path / ".lock"
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    with pytest.raises(SaveError, match=r"\.lock is a (FIFO|directory), not pitstop's lock file"):
        DirectoryLock(tmp_path, run_id="x").acquire()


def test_a_checkpoint_directory_that_is_a_file_is_a_pitstop_error(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("a file")
    with pytest.raises(SaveError, match="is not a directory"):
        DirectoryLock(path, run_id="x").acquire()


def test_a_lock_whose_file_cannot_be_removed_is_still_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = DirectoryLock(tmp_path, run_id="a")
    lock.acquire()
    real = os.unlink

    def refused(path: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "unlink", refused)
    with pytest.raises(PermissionError):
        lock.release()
    monkeypatch.setattr(os, "unlink", real)
    assert not lock.held
    with DirectoryLock(tmp_path, run_id="b") as again:  # the same process takes it again
        assert again.held


# --- a checkpoint directory that cannot be created or written ----------------------------------


def _refuse(monkeypatch: pytest.MonkeyPatch, name: str, refused_path: Path, error: int) -> None:
    """Make ``os.<name>`` fail with ``error`` for ``refused_path`` (as the kernel would for a
    directory the user may not write into, a read-only or a full filesystem)."""
    real = getattr(os, name)

    def refused(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fsdecode(path) == str(refused_path):
            raise OSError(error, os.strerror(error), os.fsdecode(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, refused)


@pytest.mark.parametrize("error", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_a_checkpoint_directory_that_cannot_be_created_is_a_pitstop_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Before, mkdir's PermissionError (or any OSError but "a file is in the way") came out
    raw, naming neither the checkpoint directory nor pitstop."""
    directory = tmp_path / "locked" / "run" / "checkpoints"
    _refuse(monkeypatch, "mkdir", tmp_path / "locked", error)  # mkdir -p fails at the first
    with pytest.raises(SaveError) as raised:
        DirectoryLock(directory, run_id="x").acquire()
    message = str(raised.value)
    assert message.startswith(f"could not create the checkpoint directory {directory}: ")
    assert os.strerror(error) in message
    assert f"({tmp_path / 'locked'})" in message  # the parent that could not be made
    assert not (tmp_path / "locked").exists()


def test_a_checkpoint_directory_whose_lock_cannot_be_created_is_a_pitstop_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that exists but cannot be written (read-only, not the user's)."""
    _refuse(monkeypatch, "open", tmp_path / ".lock", errno.EACCES)
    lock = DirectoryLock(tmp_path, run_id="x")
    with pytest.raises(SaveError) as raised:
        lock.acquire()
    assert str(raised.value) == (
        f"could not open the lock file {tmp_path / '.lock'}: Permission denied; the checkpoint "
        "directory must be writable"
    )
    assert not lock.held
