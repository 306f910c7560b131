# What a training run tells the person watching it.
#
# Rules: the trainer calls a Reporter at fixed points (started, stepped, evaluated, published,
# finished, close); the base class does nothing, so a library user gets silence by default.
# PlainReporter prints one line per event (a progress line every log_every updates): for logs,
# pipes and --quiet. RichReporter draws a progress bar (absolute step / target step and the
# loss) and prints event lines above it: for a terminal; a save (any byte task of
# pitstop.shell.format.progress) that runs for more than about a second gets a bar of its own below
# it, bytes written / total and the rate, gone when the save ends. Each line a Reporter prints
# is flushed at once, so a process reading the output sees it as it happens. close() is safe
# to call twice and after finished().
# How: rich.console.Console for both; rich.progress.Progress for the bar.

"""Progress reporting for the reference trainer: silent, plain lines, or a rich progress bar."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress, TaskID

from pitstop.bars import ByteBars, delay_s, make_progress
from pitstop.formatting import format_size
from pitstop.shell.format import progress as events

if TYPE_CHECKING:
    from pitstop.core.records import Progress as RunProgress
    from pitstop.shell.checkpoint import Checkpoint
    from pitstop.train.records import TrainState

__all__ = ["PlainReporter", "Reporter", "RichReporter"]


def _updates(count: int) -> str:
    return f"{count} new update{'' if count == 1 else 's'}"


def _metrics(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{key} {value:.6g}" for key, value in sorted(metrics.items()))


class Reporter:
    """Receives a run's events; every method does nothing here. Subclass to report."""

    def started(
        self,
        *,
        restored: RunProgress,
        target_step: int | None,
        resumed_from: Path | None,
    ) -> None:
        """The run starts at ``restored`` (``resumed_from`` is the checkpoint file, if any) and
        ends at absolute step ``target_step`` (``None``: unknown)."""

    def stepped(self, progress: RunProgress, *, loss: float, lr: float | None) -> None:
        """One optimizer update finished; ``loss`` is its mean training loss."""

    def evaluated(self, progress: RunProgress, metrics: Mapping[str, float]) -> None:
        """An evaluation at ``progress`` returned ``metrics``."""

    def published(self, checkpoint: Checkpoint, *, size: int, blocked: float) -> None:
        """A checkpoint file was published; saving it kept training waiting ``blocked`` s."""

    def finished(self, state: TrainState) -> None:
        """The run ended normally or by a stop request."""

    def close(self) -> None:
        """The run is over (also after an error); release the display."""


class PlainReporter(Reporter):
    """One plain line per event, and a progress line every ``log_every`` updates."""

    def __init__(self, console: Console | None = None, *, log_every: int = 1) -> None:
        self.console = console if console is not None else Console(highlight=False)
        self.log_every = max(1, log_every)
        self._target: int | None = None

    def line(self, text: str) -> None:
        """Print ``text`` as it is (no markup, no wrapping)."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()

    def started(
        self,
        *,
        restored: RunProgress,
        target_step: int | None,
        resumed_from: Path | None,
    ) -> None:
        self._target = target_step
        if resumed_from is not None:
            self.line(
                f"resumed from {resumed_from} at step {restored.step} (epoch {restored.epoch})"
            )
        elif restored.step:
            self.line(f"resumed at step {restored.step} (epoch {restored.epoch})")
        else:
            self.line("starting fresh at step 0")
        if target_step is not None:
            self.line(f"target: step {target_step} ({_updates(target_step - restored.step)})")

    def stepped(self, progress: RunProgress, *, loss: float, lr: float | None) -> None:
        if progress.step % self.log_every and progress.step != self._target:
            return
        of = f"/{self._target}" if self._target is not None else ""
        rate = f" lr {lr:.4g}" if lr is not None else ""
        self.line(f"step {progress.step}{of} epoch {progress.epoch} loss {loss:.6g}{rate}")

    def evaluated(self, progress: RunProgress, metrics: Mapping[str, float]) -> None:
        self.line(f"eval at step {progress.step}: {_metrics(metrics)}")

    def published(self, checkpoint: Checkpoint, *, size: int, blocked: float) -> None:
        detail = f" {checkpoint.detail}" if checkpoint.detail else ""
        self.line(
            f"saved {checkpoint.path} ({checkpoint.reason.value}{detail}, {format_size(size)}, "
            f"blocked training {blocked:.3f} s)"
        )

    def finished(self, state: TrainState) -> None:
        new = _updates(state.new_updates)
        if state.stop_reason is not None:
            self.line(
                f"stopped by {state.stop_reason} at step {state.step} "
                f"(epoch {state.epoch}, {new}); final evaluation skipped"
            )
            return
        metrics = f": {_metrics(state.metrics)}" if state.metrics else ""
        self.line(f"finished at step {state.step} (epoch {state.epoch}, {new}){metrics}")


class RichReporter(PlainReporter):
    """A progress bar (absolute step / target, loss) with event lines printed above it."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__(console)
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._saves = contextlib.ExitStack()

    def started(
        self,
        *,
        restored: RunProgress,
        target_step: int | None,
        resumed_from: Path | None,
    ) -> None:
        super().started(restored=restored, target_step=target_step, resumed_from=resumed_from)
        self._bar = make_progress(self.console, transient=False)
        self._task = self._bar.add_task(
            "[bold]train[/bold] step", total=target_step, completed=restored.step, loss="-"
        )
        self._bar.start()
        saves = ByteBars(self.console, delay_s(), shared=self._bar)
        self._saves.callback(saves.close)
        self._saves.enter_context(events.watching(saves))

    def stepped(self, progress: RunProgress, *, loss: float, lr: float | None) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=progress.step, loss=f"{loss:.4g}")

    def finished(self, state: TrainState) -> None:
        self.close()
        super().finished(state)

    def close(self) -> None:
        self._saves.close()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
