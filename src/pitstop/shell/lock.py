# One writer per checkpoint directory.
#
# Rules: the writer holds an exclusive, non-blocking flock on `.lock` for its lifetime and
# writes its host, pid and run id into it. A second writer gets DirectoryLocked naming the
# holder. The kernel drops a flock when its process dies, so a lock left by a dead writer is
# simply taken over (with a warning naming the dead holder) — no guessing from pids, and no
# window in which two live writers both hold it. Closing removes `.lock`.
# How: open-or-create `.lock`, flock(LOCK_EX | LOCK_NB), then check that the path still names
# the inode we locked (a holder may have removed it between our open and our flock).

"""The directory lock: one writer per checkpoint directory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from pitstop.core.naming import LOCK_NAME
from pitstop.errors import DirectoryLocked

__all__ = ["DirectoryLock"]

log = logging.getLogger("pitstop")

_MAX_LOCK_BYTES = 4096


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unknown writer"
    return (
        f"run {holder.get('run_id', '?')} (pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')})"
    )


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
        """Take the lock, or raise :class:`~pitstop.errors.DirectoryLocked` naming the holder."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
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
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed .lock between our open and flock: try again

        previous = _read_holder(fd)
        if previous:
            log.warning(
                "took over the lock of %s from %s, which is no longer running",
                self.path.parent,
                _describe(previous),
            )
        record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id}
        data = json.dumps(record).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Remove ``.lock`` and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(fd)

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
