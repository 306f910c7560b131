# Absolute targets.
#
# Rules (the seed's "Absolute target behavior"): limits are cumulative positions, not counts of
# new work. target = max(restored, requested); new updates = target - restored. Raising a limit
# continues the run; a limit at or below the restored position does no updates. Epoch limits
# follow the same arithmetic. A sampler's position under gradient accumulation: Progress counts
# updates, a window of `accumulate` micro-batches makes one, so a run resumed after u updates of
# an epoch reads micro-batch u * accumulate next; a position past the epoch's micro-batches was
# made with other batching and is refused, naming the numbers.
# How: integer arithmetic; RunTarget bundles both limits and says when the run has reached them.

"""Absolute step and epoch targets for runs that resume."""

from __future__ import annotations

from typing import Any

import attrs

from pitstop.core.records import Progress
from pitstop.errors import ConfigError

__all__ = [
    "RunTarget",
    "micro_batch_position",
    "new_updates",
    "plan_run",
    "target_epoch",
    "target_step",
]


def _check(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return value


def target_step(restored: int, requested: int) -> int:
    """Return the absolute step a run resumed at ``restored`` should end at.

    ``max(restored, requested)``: a smaller request than the restored step does no updates.
    """
    return max(_check("restored", restored), _check("requested", requested))


def new_updates(restored: int, requested: int) -> int:
    """Return how many optimizer updates a run resumed at ``restored`` still does."""
    return target_step(restored, requested) - restored


def target_epoch(restored: int, requested: int) -> int:
    """Return the absolute epoch limit: ``max(restored, requested)``, as for steps."""
    return max(_check("restored epoch", restored), _check("requested epochs", requested))


def _limit(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _check(f"RunTarget.{attribute.name}", value)


@attrs.frozen(kw_only=True)
class RunTarget:
    """The absolute limits of a run; ``None`` means no limit of that kind."""

    step: int | None = attrs.field(default=None, validator=_limit)
    epoch: int | None = attrs.field(default=None, validator=_limit)

    def reached(self, progress: Progress) -> bool:
        """Return whether ``progress`` is at or past either limit."""
        return (self.step is not None and progress.step >= self.step) or (
            self.epoch is not None and progress.epoch >= self.epoch
        )

    def updates_left(self, progress: Progress) -> int | None:
        """Return the optimizer updates left before the step limit (``None``: no step limit)."""
        return None if self.step is None else max(0, self.step - progress.step)


def plan_run(restored: Progress, *, max_steps: int | None, epochs: int | None) -> RunTarget:
    """Return the absolute limits for a run resumed at ``restored``.

    ``max_steps`` and ``epochs`` are cumulative, as in the configuration; each becomes
    ``max(restored, requested)``.
    """
    if max_steps is not None:
        _check("max_steps", max_steps)
    if epochs is not None:
        _check("epochs", epochs)
    return RunTarget(
        step=None if max_steps is None else target_step(restored.step, max_steps),
        epoch=None if epochs is None else target_epoch(restored.epoch, epochs),
    )


def micro_batch_position(
    batch_in_epoch: int, *, accumulate: int, batches_per_epoch: int, epoch: int = 0
) -> int:
    """Return the batch of an epoch a sampler starts at after ``batch_in_epoch`` updates.

    ``batch_in_epoch`` counts optimizer updates (as :class:`Progress` does), each a window of
    ``accumulate`` loader batches, so the next batch to read is ``batch_in_epoch * accumulate``.
    It may equal ``batches_per_epoch`` (the epoch is finished); beyond it raises
    :class:`ConfigError` naming the numbers (and ``epoch``): that position was made with other
    batching or another accumulation.
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(f"accumulate must be an int >= 1, got {accumulate!r}")
    _check("batch_in_epoch", batch_in_epoch)
    _check("batches_per_epoch", batches_per_epoch)
    position = batch_in_epoch * accumulate
    if position > batches_per_epoch:
        bound = f"batches_per_epoch={batches_per_epoch}"
        if accumulate > 1:
            bound += f" // accumulate={accumulate} = {batches_per_epoch // accumulate}"
        raise ConfigError(
            f"batch_in_epoch must be an int in [0, {bound}], got {batch_in_epoch} (epoch {epoch})"
        )
    return position
