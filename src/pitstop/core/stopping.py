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

"""Stop requests: what a rank heard, what the ranks agreed, and what a loop sees."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from pitstop.core.ranks import SECONDHAND

__all__ = [
    "NOT_REQUESTED",
    "StopState",
    "agree_codes",
    "agreed",
    "heard",
    "offer_code",
    "offered_reason",
    "visible",
]

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
