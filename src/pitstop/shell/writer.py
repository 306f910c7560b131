# The background writer: one save in flight, and no error ever lost.
#
# Rules: jobs run one at a time on a single thread, in order; submit() waits for the job in
# flight before handing over the next (so staging buffers and the directory's state are never
# shared by two saves). An exception in a job is kept and raised from the next call that
# checks — check(), submit(), wait() or close() — exactly once. A job in flight when the process
# dies never publishes a partial file: jobs publish through temp files and atomic renames.
# How: a worker thread and a condition variable; the thread is a daemon so that a hard exit
# never hangs on it (the temp file it leaves is removed when the directory is next opened).

"""BackgroundWriter: runs saves on a thread, one at a time, and re-raises their errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["BackgroundWriter"]

log = logging.getLogger("pitstop")


class BackgroundWriter:
    """A single worker thread for checkpoint writes."""

    def __init__(self, name: str = "pitstop-writer") -> None:
        self._lock = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        with self._lock:
            return self._busy

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._lock.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                job()
            except BaseException as exc:  # kept for the caller, never lost
                with self._lock:
                    self._error = exc
            with self._lock:
                self._job = None
                self._busy = False
                self._lock.notify_all()

    def check(self) -> None:
        """Raise the error of a finished job, if one failed (once)."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> float:
        """Wait for the job in flight; raise its error. Returns the seconds waited."""
        started = time.perf_counter()
        with self._lock:
            while self._busy:
                self._lock.wait()
        self.check()
        return time.perf_counter() - started

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` in the background, after the job in flight (whose error is raised)."""
        waited = self.wait()
        if waited > 0.001:
            log.info("waited %.3fs for the previous save to finish", waited)
        with self._lock:
            if self._closed:
                raise RuntimeError("the background writer is closed")
            self._job = job
            self._busy = True
            self._lock.notify_all()

    def close(self) -> None:
        """Finish the job in flight, stop the thread, and raise any error it left."""
        try:
            self.wait()
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._thread.join()
