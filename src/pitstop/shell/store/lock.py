# One writer per checkpoint directory.
#
# Rules: the writer holds an exclusive, non-blocking flock on `.lock` for its lifetime and
# writes its host, pid and run id into it. A second writer gets DirectoryLocked naming the
# holder. The kernel drops a flock when its process dies, so a lock left by a dead writer is
# simply taken over (with a warning naming the dead holder) — no guessing from pids, and no
# window in which two live writers both hold it. Closing removes `.lock`.
# The holder's record is readable whenever the lock is held: taking the lock and writing the
# record happen under a gate, a flock on the directory itself, and a writer that finds the lock
# held reads the record under the same gate — so it never sees a lock just taken with no record
# yet ("an unknown writer"), nor one just taken over still naming the dead holder.
# `.lock` must be a regular file: it is opened without following symlinks and never blocks (a
# symlink to another file would have that file truncated; a FIFO would hang the open).
# How: under the gate, open-or-create `.lock`, flock(LOCK_EX | LOCK_NB), check that the path
# still names the inode we locked (a holder may have removed it between our open and our flock),
# write the record; leave the gate; fsync. A directory whose filesystem refuses a flock on a
# directory is locked without the gate.

"""The directory lock: one writer per checkpoint directory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pitstop.core.naming import LOCK_NAME
from pitstop.errors import DirectoryLocked, SaveError
from pitstop.shell.format.untrusted import describe_mode

__all__ = ["DirectoryLock"]

log = logging.getLogger("pitstop")

_MAX_LOCK_BYTES = 4096
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown writer"
    return (
        f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')})"
    )


def _reason(exc: OSError, subject: Path) -> str:
    """What ``exc`` says went wrong, and where, when that is not ``subject`` itself."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = exc.filename
    if where is None or os.fsdecode(where) == str(subject):
        return reason
    return f"{reason} ({os.fsdecode(where)})"


def _not_a_lock(path: Path, what: str) -> str:
    return (
        f"{path} is {what}, not pitstop's lock file; remove it (pitstop creates its own) "
        "or use another checkpoint directory"
    )


@contextlib.contextmanager
def _gate(directory: Path) -> Iterator[None]:
    """Hold the directory's gate: a blocking flock on the directory itself, held only while a
    writer takes the lock (microseconds), so taking it and reading it never interleave."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    except OSError:
        yield  # (a directory that cannot be opened fails at .lock, with its own error)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # a filesystem without flock on directories: no gate
            log.debug("no lock gate on %s: %s", directory, exc)
        yield
    finally:
        os.close(fd)  # drops the gate's flock


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, _MAX_LOCK_BYTES, 0)
        holder = json.loads(data.decode("utf-8")) if data else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class DirectoryLock:
    """The exclusive lock of one checkpoint directory, from :meth:`acquire` to :meth:`release`."""

    def __init__(self, directory: str | os.PathLike[str], run_id: str) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.run_id = run_id
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~pitstop.errors.DirectoryLocked` naming the holder.

        Raises :class:`~pitstop.errors.SaveError` when the directory cannot hold a lock: it is
        a file, it cannot be created (naming it and why: permission denied, a read-only
        filesystem), or its ``.lock`` is not a regular file.
        """
        if self._fd is not None:
            return
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise SaveError(
                f"{directory} is not a directory; a checkpoint directory must be one "
                "(give a directory path, or remove the file)"
            ) from None
        except OSError as exc:  # permission denied, a read-only filesystem, a full disk
            raise SaveError(
                f"could not create the checkpoint directory {directory}: {_reason(exc, directory)}"
            ) from exc
        with _gate(directory):
            fd, previous = self._take()
        if previous:
            log.warning(
                "took over the lock of %s from %s, which is no longer running",
                directory,
                _describe(previous),
            )
        try:
            os.fsync(fd)
        except OSError as exc:
            log.warning("could not fsync the lock file %s: %s", self.path, exc)
        self._fd = fd

    def _take(self) -> tuple[int, dict[str, Any]]:
        """Lock ``.lock`` and write our record in it; return the descriptor and the previous
        (dead) holder's record. Called under the gate."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DirectoryLocked(
                    f"{self.path.parent} is locked by {_describe(holder)}; one writer per "
                    f"checkpoint directory (lock file {self.path})"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed .lock between our open and flock: try again
        try:
            previous = _read_holder(fd)
            record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id}
            data = json.dumps(record).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd, previous

    def _open(self) -> int:
        """Open-or-create ``.lock``, refusing anything but a regular file (never blocking)."""
        flags = (
            os.O_RDWR
            | os.O_CREAT
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_NONBLOCK", 0)
            | getattr(os, "O_CLOEXEC", 0)
        )
        with contextlib.suppress(FileNotFoundError):  # a device is never even opened
            mode = os.lstat(self.path).st_mode
            if not stat.S_ISREG(mode):
                raise SaveError(_not_a_lock(self.path, describe_mode(mode)))
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno in {errno.ELOOP, errno.EISDIR, errno.ENXIO}:
                raise SaveError(_not_a_lock(self.path, "not a regular file")) from None
            raise SaveError(
                f"could not open the lock file {self.path}: {_reason(exc, self.path)}; the "
                "checkpoint directory must be writable"
            ) from exc
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise SaveError(_not_a_lock(self.path, describe_mode(mode)))
        return fd

    def release(self) -> None:
        """Remove ``.lock`` and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)  # the lock is dropped even when the file cannot be removed

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
