# Progress of long byte work — verifying, writing and exporting a checkpoint — for a watcher.
#
# Rules: the code doing the work opens a task (what, total bytes) and advances it; whoever
# watches (the CLI's progress bar) registers a listener for a while. With nobody watching, a
# task costs one check of an empty list. Listeners are called from whatever thread does the
# work (the background writer's too), so they must be thread-safe; one that raises is dropped,
# never allowed to fail the work it watches.
# How: a module-level list of listeners under a lock; a task fans each call out to the
# listeners registered when it began.

"""Byte-progress events from long checkpoint operations, for progress bars."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Protocol

__all__ = ["IDLE", "Listener", "Task", "task", "watching"]

log = logging.getLogger("pitstop")


class Listener(Protocol):
    """Hears about tasks: ``begin`` returns a handle that the other two calls get back."""

    def begin(self, description: str, total: int) -> object: ...

    def advance(self, handle: object, nbytes: int) -> None: ...

    def end(self, handle: object) -> None: ...


_lock = threading.Lock()
_listeners: list[Listener] = []


@contextlib.contextmanager
def watching(listener: Listener) -> Iterator[Listener]:
    """Register ``listener`` for the block's duration."""
    with _lock:
        _listeners.append(listener)
    try:
        yield listener
    finally:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)


class Task:
    """One piece of work of ``total`` bytes; a context manager that ends it."""

    def __init__(self, description: str, total: int) -> None:
        with _lock:
            listeners = list(_listeners)
        self._watchers: list[tuple[Listener, object]] = []
        for listener in listeners:
            with _guard(listener):
                self._watchers.append((listener, listener.begin(description, max(total, 0))))

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more done."""
        for listener, handle in self._watchers:
            with _guard(listener):
                listener.advance(handle, nbytes)

    def end(self) -> None:
        """The work is over (done or failed)."""
        watchers, self._watchers = self._watchers, []
        for listener, handle in watchers:
            with _guard(listener):
                listener.end(handle)

    def __enter__(self) -> Task:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end()


class _Idle(Task):
    """The task when nobody watches: every call does nothing."""

    def __init__(self) -> None:
        self._watchers = []

    def advance(self, nbytes: int) -> None:
        return None


IDLE: Task = _Idle()
"""The task nobody watches."""


def task(description: str, total: int) -> Task:
    """Begin a task of ``total`` bytes; use it as ``with task(...) as t: t.advance(n)``."""
    if not _listeners:  # read without the lock: a listener that arrives now misses one task
        return IDLE
    return Task(description, total)


@contextlib.contextmanager
def _guard(listener: Listener) -> Iterator[None]:
    """Run a listener call; a listener that raises is dropped, and the work goes on."""
    try:
        yield
    except Exception as exc:
        log.debug("progress listener %r failed and is dropped: %s", listener, exc)
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)
