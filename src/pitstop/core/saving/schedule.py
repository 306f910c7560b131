# When to save.
#
# Rules:
# * interval: the step is an exact multiple of every_steps (step 0 never is: nothing trained);
# * time: every_seconds passed since the last write (the clock is an argument, never read here),
#   checked by maybe_save only (a time save at the end would be a final save in disguise);
# * best: the reported Best metric strictly improves on the best pointer's value — only at a
#   step after 0 (before any update there is nothing to compare: an evaluation before training
#   is no candidate) and only for a call that carries the metric;
# * stop: a stop was requested; final: the normal end of the run (finish) with save_final;
# * manual: Checkpointer.save() always writes.
# A step already written in this timeline is never written twice: a later reason at the same
# step (the final end, an improved metric) only moves pointers to the file already there.
# "Already written" means the directory's newest checkpoint is this run's save of this step;
# after a resume from an older checkpoint it is not, so the restored step can be saved again.
# With save_final=False the end writes only what an interval, best or stop would, so the seed's
# "final-step gap" table holds. A stop at a step already saved writes nothing: the run's
# position is already durable, and the file keeps the reason it was first saved for.
# How: decide_save collects the reasons that fire, then chooses write / move pointers / nothing,
# and returns the schedule state to adopt once the shell has carried the decision out.

"""The save schedule: which calls write a checkpoint, why, and which pointers move."""

from __future__ import annotations

import enum

import attrs

from pitstop.core.records import (
    NO_CHECKPOINT,
    REASON_PRIORITY,
    Catalog,
    CheckpointEntry,
    Metrics,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.errors import ConfigError

__all__ = [
    "Call",
    "SaveDecision",
    "ScheduleState",
    "decide_save",
    "foresees_write",
    "resumed_state",
]


class Call(enum.Enum):
    """Which Checkpointer call asks the schedule."""

    MAYBE = "maybe_save"  # once per step from the training loop; the policy decides
    FINISH = "finish"  # the end of the run (normal or stopped)
    MANUAL = "save"  # an explicit save: always writes


@attrs.frozen(kw_only=True)
class ScheduleState:
    """What the schedule remembers between calls.

    ``last_saved_step``: the step of the directory's newest checkpoint when this run wrote it
    (or resumed from it: see :func:`resumed_state`), else ``NO_CHECKPOINT``.
    ``timer_start``: the clock reading (seconds, monotonic) the ``every_seconds`` timer counts
    from. ``reached_step``: the step this run resumed at or last wrote; a call at an earlier
    step is refused (progress that went backwards, such as a ``resume()`` whose result was
    not used, would otherwise move ``last`` back to a step the run has trained past).
    """

    timer_start: float
    last_saved_step: int | NoCheckpoint = NO_CHECKPOINT
    reached_step: int = 0


def resumed_state(
    catalog: Catalog, resumed: CheckpointEntry | NoCheckpoint, *, now: float, step: int = 0
) -> ScheduleState:
    """Return the schedule state of a run that resumed from ``resumed`` at clock ``now``, at
    ``step`` (the restored progress's step, wherever it came from).

    The restored step counts as already saved only when ``resumed`` is the directory's newest
    checkpoint. After a resume from an older one (an abandoned timeline follows it), ``last``
    is another timeline's file, so a stop or final end at the restored step must write again.
    """
    newest = catalog.newest()
    if resumed is NO_CHECKPOINT or newest is NO_CHECKPOINT or newest.name != resumed.name:
        return ScheduleState(timer_start=now, reached_step=step)
    return ScheduleState(timer_start=now, last_saved_step=resumed.step, reached_step=step)


@attrs.frozen(kw_only=True)
class SaveDecision:
    """What one call should do.

    ``write``: write a new checkpoint of the current step. ``moves``: pointers that go to the
    current step's checkpoint (always ``last`` when writing). ``best_value``: the best metric
    value after the decision. ``state``: the schedule state once the decision is carried out.
    """

    write: bool
    reasons: frozenset[SaveReason]
    moves: frozenset[PointerName]
    best_value: float | None
    state: ScheduleState

    @property
    def reason(self) -> SaveReason:
        """The reason recorded in the checkpoint: the most telling of ``reasons``."""
        for reason in REASON_PRIORITY:
            if reason in self.reasons:
                return reason
        raise ValueError("a decision with no reasons has no recorded reason")

    @property
    def acts(self) -> bool:
        """Whether the decision writes a file or moves a pointer."""
        return self.write or bool(self.moves)


def decide_save(
    policy: Policy,
    state: ScheduleState,
    pointers: Pointers,
    *,
    call: Call,
    progress: Progress,
    now: float,
    metrics: Metrics | None = None,
    stop: bool = False,
    manual_reason: SaveReason = SaveReason.MANUAL,
) -> SaveDecision:
    """Decide what ``call`` at ``progress`` should do under ``policy``.

    ``pointers`` supplies the best value so far; ``now`` is the caller's monotonic clock;
    ``stop`` says a stop has been requested. ``manual_reason``: what an explicit save records
    (``FINAL`` also moves the ``final`` pointer); ``BEST`` is the metric's to decide.
    """
    if manual_reason is SaveReason.BEST:
        raise ConfigError(
            "a save's reason cannot be 'best': the best pointer follows Policy.best's metric "
            "(pass metrics= to maybe_save)"
        )
    reasons: set[SaveReason] = set()
    step = progress.step
    if step < state.reached_step:
        raise ConfigError(
            f"{call.value}: progress went backwards: step {step}, but this run is at step "
            f"{state.reached_step} (resumed or saved there); pass the Progress that resume() "
            f"returned and advance it"
        )
    if call is Call.MANUAL:
        reasons.add(manual_reason)
    if policy.every_steps is not None and step > 0 and step % policy.every_steps == 0:
        reasons.add(SaveReason.INTERVAL)
    if (
        policy.every_seconds is not None
        and call is Call.MAYBE
        and step > 0
        and now - state.timer_start >= policy.every_seconds
    ):
        reasons.add(SaveReason.TIME)
    best_value = pointers.best_value
    if (
        policy.best is not None
        and step > 0
        and metrics is not None
        and policy.best.metric in metrics
    ):
        value = metrics[policy.best.metric]
        if policy.best.improves(value, best_value):
            reasons.add(SaveReason.BEST)
            best_value = value
    if stop:
        reasons.add(SaveReason.STOP)
    elif call is Call.FINISH and policy.save_final:
        reasons.add(SaveReason.FINAL)

    already_saved = state.last_saved_step == step
    write = bool(reasons) and (call is Call.MANUAL or not already_saved)
    moves = {PointerName.LAST} if write else set()
    if SaveReason.FINAL in reasons:
        moves.add(PointerName.FINAL)
    if SaveReason.BEST in reasons:
        moves.add(PointerName.BEST)
    next_state = (
        ScheduleState(timer_start=now, last_saved_step=step, reached_step=step) if write else state
    )
    return SaveDecision(
        write=write,
        reasons=frozenset(reasons),
        moves=frozenset(moves),
        best_value=best_value,
        state=next_state,
    )


def foresees_write(policy: Policy, call: Call, step: int, *, stop: bool = False) -> bool:
    """Whether one rank can tell, before rank 0 decides, that a ``call`` at ``step`` writes a
    checkpoint: an explicit save, the end of a run that saves its final state, a stop this
    rank requested, or a step of the interval. Exactly the decisions of :func:`decide_save`
    that need neither rank 0's schedule nor every rank's inputs: each of them writes unless
    the step is saved already (an explicit save writes even then), and any other write is for
    the time, the best metric or another rank's stop. A rank that foresees a background
    sharded save copies its shards while the ranks agree (pitstop.shell.savecall)."""
    return (
        call is Call.MANUAL
        or stop
        or (call is Call.FINISH and policy.save_final)
        or (policy.every_steps is not None and step > 0 and step % policy.every_steps == 0)
    )
