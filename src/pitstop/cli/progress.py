"""Progress bars for the CLI's long work, on a terminal only.

``verify``, ``ls --check``, ``export``, ``prune`` and ``import`` wrap their work in
:func:`progress_bars`: a task (see :mod:`pitstop.shell.format.progress`) that runs for more than
about a second gets a transient bar — bytes done / total, the rate — drawn by
:class:`pitstop.bars.ByteBars`. When the console is not a terminal (piped, redirected), nothing
is drawn and the output is exactly what it would be without bars. ``train`` draws them inside
its own step bar (:class:`pitstop.train.report.RichReporter`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console

from pitstop.bars import ByteBars, delay_s
from pitstop.shell.format import progress as events

__all__ = ["progress_bars"]


@contextlib.contextmanager
def progress_bars(console: Console, *, enabled: bool = True) -> Iterator[None]:
    """Show bars for long work during the block, when ``console`` is a terminal."""
    if not enabled or not console.is_terminal:
        yield
        return
    bars = ByteBars(console, delay_s())
    try:
        with events.watching(bars):
            yield
    finally:
        bars.close()
