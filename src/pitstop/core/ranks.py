# Agreement between ranks: one decision, one outcome, the same on every rank.
#
# Rules: every rank makes the same Checkpointer calls; rank 0 (the writer) decides and the others
# follow, so nothing depends on which rank looks. A call's inputs are merged: a stop requested on
# any rank stops every rank, with the first real reason by rank order (a rank that only heard
# of it through StopRequest.sync() says so, and loses to the rank that got the signal); the
# clock and the metrics are rank 0's (every_seconds and Best are decided once). An outcome —
# success, or an error on any rank — is agreed too: the error of the lowest failing rank is
# raised on every rank, so no rank is left waiting in a collective. A checkpoint written by W
# ranks holds W slots of per-rank state (RNG streams, per-rank components); another world size
# cannot continue them, and says so with both sizes.
# How: frozen records and pure functions; the shell moves them between ranks.

"""Merging the ranks' inputs and outcomes into one decision every rank shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, NoCheckpoint

__all__ = [
    "INTERRUPTED",
    "OK",
    "CallInput",
    "Outcome",
    "agree",
    "entry_from_wire",
    "entry_to_wire",
    "merge_inputs",
    "per_rank_message",
    "stop_origin",
]

SECONDHAND = "another rank requested a stop"
"""The reason StopRequest.sync() gives a rank that did not request the stop itself."""


@attrs.frozen(kw_only=True)
class CallInput:
    """What one rank brings to a save call."""

    stop: bool = False
    reason: str = ""
    metrics: Mapping[str, float] | None = None
    now: float = 0.0


def merge_inputs(inputs: Sequence[CallInput]) -> CallInput:
    """The call every rank acts on: any rank's stop, the first real reason, rank 0's rest."""
    if not inputs:
        raise ValueError("no ranks to merge")
    stopping = [i for i in inputs if i.stop]
    reasons = [i.reason for i in stopping if i.reason and i.reason != SECONDHAND]
    reason = reasons[0] if reasons else (stopping[0].reason if stopping else "")
    first = inputs[0]
    return CallInput(stop=bool(stopping), reason=reason, metrics=first.metrics, now=first.now)


def stop_origin(inputs: Sequence[CallInput]) -> int | None:
    """The rank whose reason :func:`merge_inputs` keeps (``None``: no rank stops): the first
    with a real reason, else the first that stops."""
    stopping = [rank for rank, i in enumerate(inputs) if i.stop]
    real = [rank for rank in stopping if inputs[rank].reason not in ("", SECONDHAND)]
    return real[0] if real else (stopping[0] if stopping else None)


@attrs.frozen(kw_only=True)
class Outcome:
    """How a call ended on one rank: ``error`` is empty on success.

    ``kind``: the error's class name (a pitstop error, or the builtin it came from);
    ``error``: its message; ``rank``: where it happened.
    """

    kind: str = ""
    error: str = ""
    rank: int = 0

    @property
    def ok(self) -> bool:
        """Whether the call succeeded."""
        return not self.error and not self.kind

    @property
    def interrupted(self) -> bool:
        """Whether the call was interrupted on its rank (Ctrl-C: a ``KeyboardInterrupt``)."""
        return self.kind == INTERRUPTED


INTERRUPTED = "KeyboardInterrupt"
"""The kind of an outcome interrupted on its rank (whatever subclass of it was raised)."""

OK = Outcome()


def agree(outcomes: Sequence[Outcome]) -> Outcome:
    """The outcome every rank raises: the lowest interrupted rank's (a Ctrl-C on any rank
    stops every rank, whatever failed elsewhere), else the lowest failing rank's, or OK."""
    for outcome in outcomes:
        if outcome.interrupted:
            return outcome
    for outcome in outcomes:
        if not outcome.ok:
            return outcome
    return OK


def per_rank_message(stored: int, live: int, names: Sequence[str], *, allowed: bool = False) -> str:
    """Why a checkpoint of ``stored`` ranks cannot continue ``live`` ranks' per-rank state —
    or, ``allowed`` (a ``resume(strict=False)``), what that resume does instead."""
    state = ", ".join(["RNG streams", *(f"component {n!r}" for n in sorted(names))])
    sizes = f"world size is {stored} in the checkpoint, {live} in the run"
    if allowed:
        return (
            f"{sizes}: the weights, the optimizer and the other replicated state are restored; "
            f"the per-rank state ({state}) starts fresh"
        )
    return (
        f"{sizes}: per-rank state ({state}) cannot continue; resume(strict=False) loads the "
        f"weights, the optimizer and the other replicated state and starts the per-rank state "
        f"fresh"
    )


def entry_to_wire(entry: CheckpointEntry | NoCheckpoint) -> tuple[Any, ...] | None:
    """``entry`` as plain values that can travel between ranks (``None``: no checkpoint)."""
    if entry is NO_CHECKPOINT:
        return None
    metrics = dict(entry.metrics)
    return (entry.progress, entry.seq, entry.reason.value, entry.detail, metrics, entry.sharded)


def entry_from_wire(wire: tuple[Any, ...] | None) -> CheckpointEntry | NoCheckpoint:
    """The entry :func:`entry_to_wire` sent."""
    if wire is None:
        return NO_CHECKPOINT
    progress, seq, reason, detail, metrics, sharded = wire
    return CheckpointEntry(
        progress=progress,
        seq=seq,
        reason=reason,
        detail=detail,
        metrics=metrics,
        sharded=sharded,
    )
