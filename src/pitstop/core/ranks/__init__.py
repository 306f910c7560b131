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
#
# Which ranks share a checkpoint directory: found out, never guessed. Every rank writes a probe
# file of its own into the directory and every rank says which ranks' probes it sees (one
# all-gather); ranks that see each other's probes share a directory (a node's local disk, or
# one shared filesystem for the whole job). The sightings must be an equivalence (every rank
# sees its own probe, and two ranks that see each other see the same ranks): a directory shared
# in part is refused. Each group's lowest rank writes its directory's copy of every checkpoint
# (rank 0 among them); the others read their group's copy. A resume chooses among the
# checkpoints every directory lists (the newest first: the highest save sequence number), the
# first that verifies in at least one directory; a directory without a copy that verifies gets
# one from a directory that has it, over torch.distributed, before any rank reads it (the
# sources taken in turn, so that several directories catching up share the senders).
#
# A stop request as every rank sees it: heard on one rank, agreed by all, acted on by all.
#
# Rules: a rank *hears* a request (a signal, request()); the ranks *agree* on it in a collective
# (StopRequest.sync(), or the round of any save call that is given the stop). With one process
# there is nothing to agree: what was heard is the answer at once. With several, the answer a
# loop can see — bool(stop), stop.requested, stop.reason — is the last agreed one, and it
# changes only at an agreement, which every rank takes part in with the same result; so no
# interleaving of signals and calls lets two ranks see different answers between the same two
# agreements, and a loop that acts on what it sees leaves at the same step on every rank.
# A request heard after an agreement is held for the next one (never lost): a rank offers
# what it heard, and the agreed answer is true once any rank offered true; it then stays true.
# The agreed reason is the same on every rank: the lowest rank that heard the request itself
# names it — a save call's round carries every rank's reason as text (merge_inputs); a bare
# agreement (sync) carries a small code per rank (offer_code), a signal's name or "requested on
# rank R", so that it fits one all-reduce of a few integers.
# How: a frozen record and pure functions; pitstop.shell.stop keeps one record per StopRequest.

"""Agreement between ranks: inputs, outcomes and stop requests merged into one answer."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, NoCheckpoint
from pitstop.errors import ConfigError

__all__ = [
    "INTERRUPTED",
    "NOT_REQUESTED",
    "OK",
    "REMOTE",
    "CallInput",
    "DirectoryGroups",
    "Outcome",
    "StopState",
    "Transfer",
    "agree",
    "agree_codes",
    "agreed",
    "catch_up",
    "directory_groups",
    "entry_from_wire",
    "entry_to_wire",
    "heard",
    "merge_inputs",
    "merged_order",
    "offer_code",
    "offered_reason",
    "per_rank_message",
    "stop_origin",
    "visible",
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


NOT_REQUESTED = 0
"""The code of a rank that heard no request."""

_SIGNAL_CODES = {"SIGINT": 1, "SIGTERM": 2}
_TEXT = 3  # a request with a reason of the caller's own: only its rank knows the words
_NAMES = {code: name for name, code in _SIGNAL_CODES.items()}


@attrs.frozen(kw_only=True)
class StopState:
    """One rank's view of a stop request.

    ``heard``/``heard_reason``: this rank received a request (the first reason kept);
    ``agreed``/``agreed_reason``: the ranks' last agreed answer; ``ranks``: how many ranks
    took part in the last agreement (1 until one with several ranks happened).
    """

    heard: bool = False
    heard_reason: str = ""
    agreed: bool = False
    agreed_reason: str = ""
    ranks: int = 1


def heard(state: StopState, reason: str) -> StopState:
    """``state`` once this rank heard a request for ``reason`` (the first reason is kept)."""
    if state.heard:
        return state
    return attrs.evolve(state, heard=True, heard_reason=reason)


def agreed(state: StopState, *, stop: bool, reason: str, ranks: int) -> StopState:
    """``state`` after an agreement of ``ranks`` ranks whose answer is ``stop`` (``reason``):
    once agreed true it stays true, with the reason it was first agreed for."""
    if state.agreed:
        return attrs.evolve(state, ranks=max(state.ranks, ranks))
    return attrs.evolve(
        state, agreed=stop, agreed_reason=reason if stop else "", ranks=max(state.ranks, ranks)
    )


def visible(state: StopState, *, many: bool) -> tuple[bool, str | None]:
    """What a loop sees: with several ranks (``many``, or an agreement of several happened)
    the last agreed answer, else what this rank heard; and its reason (``None``: no stop)."""
    if many or state.ranks > 1:
        return state.agreed, (state.agreed_reason if state.agreed else None)
    return state.heard, (state.heard_reason if state.heard else None)


def offer_code(state: StopState) -> int:
    """What this rank brings to an agreement, as one small integer: ``NOT_REQUESTED``, a
    signal's code, or the code of a reason of the caller's own. A rank that already agreed on a
    stop offers it again, so that an agreement never takes a stop back."""
    if state.heard:
        return _SIGNAL_CODES.get(state.heard_reason, _TEXT)
    if state.agreed:
        return _SIGNAL_CODES.get(state.agreed_reason, _TEXT)
    return NOT_REQUESTED


def agree_codes(codes: Sequence[int]) -> tuple[bool, str]:
    """The agreement of every rank's :func:`offer_code` (``codes``, in rank order): whether to
    stop, and why — the same on every rank. The lowest rank that offered a request names it:
    a signal by its name, a reason of the caller's own as ``"requested on rank R"`` (its words
    travel only with a save call's inputs, which carry text)."""
    for origin, code in enumerate(codes):
        if code == NOT_REQUESTED:
            continue
        return True, _NAMES.get(code, f"requested on rank {origin}")
    return False, ""


def offered_reason(state: StopState) -> tuple[bool, str]:
    """What this rank brings to a save call's inputs: whether it asks to stop and why — its
    own reason when it heard the request itself, else ``SECONDHAND`` for a stop it only
    agreed to (so that the merge keeps the reason of the rank that heard it)."""
    if state.heard:
        return True, state.heard_reason
    if state.agreed:
        return True, SECONDHAND
    return False, ""


@attrs.frozen
class DirectoryGroups:
    """Which ranks share a checkpoint directory: ``groups``, each a tuple of ranks in order,
    the groups ordered by their lowest rank. Each group's lowest rank writes its directory."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def one(cls, world_size: int) -> DirectoryGroups:
        """Every rank of ``world_size`` sharing one directory."""
        return cls((tuple(range(world_size)),))

    @property
    def shared(self) -> bool:
        """Whether every rank sees one directory (one group)."""
        return len(self.groups) == 1

    @property
    def writers(self) -> tuple[int, ...]:
        """The rank that writes each group's directory, in group order."""
        return tuple(group[0] for group in self.groups)

    def group_of(self, rank: int) -> int:
        """The index of ``rank``'s group."""
        for index, group in enumerate(self.groups):
            if rank in group:
                return index
        raise ValueError(f"rank {rank} is in no group of {self.groups}")

    def writer(self, rank: int) -> int:
        """The rank that writes the directory ``rank`` sees."""
        return self.groups[self.group_of(rank)][0]

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes its directory."""
        return self.writer(rank) == rank


def directory_groups(seen: Sequence[Collection[int]], *, directory: str = "") -> DirectoryGroups:
    """The groups of ranks sharing a directory, from ``seen[r]``: the ranks whose probe files
    rank ``r`` found in ``directory``. Raises :class:`~pitstop.errors.ConfigError` naming the
    ranks when the sightings are no equivalence (a directory shared in part)."""
    sets = [frozenset(s) for s in seen]
    world = len(sets)
    for rank, mine in enumerate(sets):
        strangers = sorted(r for r in mine if not 0 <= r < world)
        if rank not in mine or strangers:
            raise ConfigError(
                f"rank {rank} did not find its own probe file in {directory} (it found "
                f"{sorted(mine)}): the checkpoint directory must be one directory that each "
                f"rank can write and read back"
            )
        for other in sorted(mine):
            if sets[other] != mine:
                raise ConfigError(
                    f"{directory} is shared in part: rank {rank} sees the probe files of ranks "
                    f"{sorted(mine)}, rank {other} those of ranks {sorted(sets[other])}; give "
                    f"every rank a directory that is either shared by the same ranks or its own"
                )
    groups = sorted({tuple(sorted(s)) for s in sets})
    return DirectoryGroups(tuple(groups))


def writes_as_seen(rank: int, seen: Collection[int]) -> bool:
    """Whether ``rank`` writes its directory, judged from ``seen`` alone (the ranks whose probe
    files it found there): the lowest of them, as :func:`directory_groups` makes it once agreed."""
    return rank in seen and min(seen) == rank


REMOTE = -1
"""The source of a :class:`Transfer` from the remote tier (no rank: the target downloads it)."""


@attrs.frozen
class Transfer:
    """One directory catching up: the writer ``source`` (or the remote tier, :data:`REMOTE`)
    sends its copy to the writer ``target``."""

    source: int
    target: int


def catch_up(
    groups: DirectoryGroups, valid: Sequence[bool], *, remote: bool = False
) -> tuple[Transfer, ...] | None:
    """The copies to send so that every directory holds a checkpoint: ``valid[i]`` says whether
    group ``i``'s copy verifies; ``remote``: whether the remote tier lists it. ``None``: no
    directory holds it whole, and no remote tier does. The senders are the groups that hold
    it, taken in turn; only when none does, each lacking directory downloads it from the
    remote tier (:data:`REMOTE`): a peer's copy is preferred, the remote tier is the last
    resort."""
    if len(valid) != len(groups.groups):
        raise ValueError(f"{len(valid)} answers for {len(groups.groups)} directories")
    holders = [writer for writer, ok in zip(groups.writers, valid, strict=True) if ok]
    if not holders:
        if not remote:
            return None
        holders = [REMOTE]
    lacking = [writer for writer, ok in zip(groups.writers, valid, strict=True) if not ok]
    return tuple(
        Transfer(source=holders[i % len(holders)], target=target)
        for i, target in enumerate(lacking)
    )


def merged_order(
    orders: Sequence[Sequence[tuple[str, int]]], *, newest_first: bool
) -> tuple[str, ...]:
    """One resume order from every directory's (``orders``: each a sequence of ``(name, seq)``
    in that directory's own order): every name once; ``newest_first`` (a resume of ``last``)
    by the highest save sequence number any directory gives it, else in the first directory's
    order, then the names only later ones list."""
    if newest_first:
        seqs: dict[str, int] = {}
        for order in orders:
            for name, seq in order:
                seqs[name] = max(seq, seqs.get(name, seq))
        return tuple(sorted(seqs, key=lambda n: (seqs[n], n), reverse=True))
    merged: dict[str, None] = {}
    for order in orders:
        for name, _ in order:
            merged.setdefault(name, None)
    return tuple(merged)
