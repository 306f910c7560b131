"""Rich progress bars for long byte work, shared by the CLI and the trainer's reports.

A task from :mod:`pitstop.shell.format.progress` (verifying a file, writing a checkpoint, exporting
weights) gets a bar — bytes done / total, the rate, the time left — once it has run for about a
second (``PITSTOP_PROGRESS_DELAY`` seconds when set), so short work prints nothing; the bar
goes away when the task ends. :func:`make_progress` builds a rich ``Progress`` whose columns
show such byte tasks and the trainer's step bar alike, so both can share one live display.
A neutral module (no torch), like :mod:`pitstop.formatting`: ``pitstop.train`` needs nothing
from ``pitstop.cli``.
"""

from __future__ import annotations

import os
import threading

import attrs
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from pitstop.core.naming import TEMP_PREFIX

__all__ = ["BYTES", "DEFAULT_DELAY_S", "ByteBars", "delay_s", "make_progress"]

DEFAULT_DELAY_S = 1.0
BYTES = "bytes"
"""The ``kind`` field of a byte task; any other task is counted in items (the train steps)."""


def delay_s() -> float:
    """How long a task runs before it gets a bar: about a second, or PITSTOP_PROGRESS_DELAY."""
    try:
        return max(0.0, float(os.environ.get("PITSTOP_PROGRESS_DELAY", DEFAULT_DELAY_S)))
    except ValueError:
        return DEFAULT_DELAY_S


class _Amount(ProgressColumn):
    """Bytes done / total for a byte task; ``done/total`` for any other."""

    _bytes = DownloadColumn(binary_units=True)
    _items = MofNCompleteColumn()

    def render(self, task: Task) -> RenderableType:
        return (self._bytes if task.fields.get("kind") == BYTES else self._items).render(task)


class _Detail(ProgressColumn):
    """The rate and the time left of a byte task; the ``loss`` field of any other."""

    _rate = TransferSpeedColumn()
    _left = TimeRemainingColumn()

    def render(self, task: Task) -> RenderableType:
        if task.fields.get("kind") == BYTES:
            return Text.assemble(self._rate.render(task), " ", self._left.render(task))
        loss = task.fields.get("loss")
        return Text(f"loss {loss}" if loss is not None else "")


def make_progress(console: Console, *, transient: bool) -> Progress:
    """A rich Progress showing byte tasks and step tasks (``kind`` and ``loss`` fields)."""
    return Progress(
        TextColumn("{task.description}"),
        _Amount(),
        BarColumn(),
        _Detail(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
    )


def _label(description: str) -> str:
    """``writing /a/.tmp-<token>-step_1.pitstop`` → ``writing step_1.pitstop``."""
    verb, _, path = description.partition(" ")
    name = os.path.basename(path) if path else ""
    if name.startswith(TEMP_PREFIX):
        name = name[len(TEMP_PREFIX) :].partition("-")[2] or name
    return f"{verb} {name}" if name else description


@attrs.define(eq=False)
class _Handle:
    description: str
    total: int
    done: int = 0
    task: TaskID | None = None
    timer: threading.Timer | None = None


class ByteBars:
    """A :class:`pitstop.shell.format.progress.Listener` drawing a bar per task after ``delay``.

    ``shared``: draw into this Progress (already started by its owner, who stops it);
    otherwise a transient one of its own is started for the first bar and stopped after the
    last. Thread-safe: tasks may advance on any thread.
    """

    def __init__(
        self,
        console: Console,
        delay: float = DEFAULT_DELAY_S,
        *,
        shared: Progress | None = None,
    ) -> None:
        self._console = console
        self._delay = delay
        self._shared = shared
        self._lock = threading.Lock()
        self._bars: Progress | None = shared
        self._open: set[_Handle] = set()

    def begin(self, description: str, total: int) -> object:
        handle = _Handle(description=_label(description), total=total)
        with self._lock:
            self._open.add(handle)
        if self._delay <= 0:
            self._show(handle)
        else:
            handle.timer = threading.Timer(self._delay, self._show, (handle,))
            handle.timer.daemon = True
            handle.timer.start()
        return handle

    def advance(self, handle: object, nbytes: int) -> None:
        assert isinstance(handle, _Handle)
        with self._lock:
            handle.done += nbytes
            if handle.task is not None and self._bars is not None:
                self._bars.update(handle.task, completed=min(handle.done, handle.total))

    def end(self, handle: object) -> None:
        assert isinstance(handle, _Handle)
        if handle.timer is not None:
            handle.timer.cancel()
        with self._lock:
            self._open.discard(handle)
            if handle.task is not None and self._bars is not None:
                self._bars.remove_task(handle.task)
                handle.task = None
                self._bars.refresh()  # gone at once, not at the next tick
            if not self._open and self._bars is not None and self._shared is None:
                self._bars.stop()
                self._bars = None

    def _show(self, handle: _Handle) -> None:
        with self._lock:
            if handle not in self._open:
                return
            if self._bars is None:
                self._bars = make_progress(self._console, transient=True)
                self._bars.start()
            handle.task = self._bars.add_task(
                handle.description,
                total=handle.total,
                completed=min(handle.done, handle.total),
                kind=BYTES,
            )
            self._bars.refresh()  # drawn at once, even if the task ends before the next tick

    def close(self) -> None:
        """End every task still open; stop the bars of its own."""
        with self._lock:
            handles = list(self._open)
        for handle in handles:
            self.end(handle)
        with self._lock:
            if self._bars is not None and self._shared is None:
                self._bars.stop()
                self._bars = None
