# What one Trainer.train() call is asked to do, and where it ended.
#
# Rules: limits are cumulative and absolute (epochs, max_steps; at least one); accumulate >= 1
# micro-batches make one update; every bad field is a ConfigError naming it. TrainState keeps
# the absolute position reached and the one the call started from, so new work is their
# difference.
# How: frozen attrs records with the core's validators.

"""TrainConfig and TrainState: a train() call's request and its result."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from pitstop import ConfigError, Progress
from pitstop.core.saving.targets import RunTarget
from pitstop.core.validators import count_or_none, positive_int, positive_int_or_none

__all__ = ["TrainConfig", "TrainState"]


@attrs.frozen(kw_only=True)
class TrainConfig:
    """How long one :meth:`Trainer.train` call goes, and its loop's shape.

    ``epochs`` and ``max_steps`` are cumulative, absolute limits (``target = max(restored,
    requested)``); at least one is required. ``accumulate`` micro-batches make one optimizer
    update. ``eval_every``: evaluate every N updates (``None``: only at the end).
    """

    epochs: int | None = attrs.field(default=None, validator=count_or_none)
    max_steps: int | None = attrs.field(default=None, validator=count_or_none)
    accumulate: int = attrs.field(default=1, validator=positive_int)
    eval_every: int | None = attrs.field(default=None, validator=positive_int_or_none)

    def __attrs_post_init__(self) -> None:
        if self.epochs is None and self.max_steps is None:
            raise ConfigError(
                "TrainConfig needs epochs or max_steps (or both): the run needs an end"
            )


@attrs.frozen(kw_only=True)
class TrainState:
    """Where a :meth:`Trainer.train` call ended.

    ``progress``: the absolute position reached; ``restored``: where this call started (the
    resumed checkpoint's position, or step 0); ``stop_reason``: ``"SIGTERM"``, ``"SIGINT"`` or
    the text given to ``stop.request()``, ``None`` after a normal end; ``metrics``: the final
    evaluation (empty when stopped or without an evaluation); ``losses``: ``(step, loss)`` of
    every update this call made.
    """

    progress: Progress
    restored: Progress
    target: RunTarget
    stop_reason: str | None
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    losses: tuple[tuple[int, float], ...] = ()

    @property
    def step(self) -> int:
        """The absolute optimizer step reached."""
        return self.progress.step

    @property
    def epoch(self) -> int:
        """Completed epochs."""
        return self.progress.epoch

    @property
    def new_updates(self) -> int:
        """Optimizer updates this call made."""
        return self.progress.step - self.restored.step
