# The catch-up's first round on every rank: the copies the core's copies_first starts before any
# check, and every other holder's verify, in one round; what each holds agreed in it.
#
# Rules: each rank takes its part of the copies in order, every message exchanged whatever
# failed before (so no peer waits in vain): a sender sends with every piece checked as it is
# read (what is wrong with its own copy kept, not raised: the copy still goes out whole, and its
# receiver finds the same), a receiver receives as a catch-up does (every byte checked as it
# lands, loaded, published); a rank in no copy verifies its own copy if its directory lists the
# checkpoint. A sender whose copy passed then loads it without a second check, beside its
# receivers' loads. What each holds (pitstop.core.ranks.catchup's Held) is gathered in one
# round; a copy that failed on its way while its sender's copy was good is raised on every rank
# (the copy's own error, as a copy made after the checks raises it); otherwise each rank's
# answer is as after a verify, for the choice to go on (catch_up over what is valid now).
# How: the caller's callables for the file work; Ranks.all_gather_each, then Ranks.each only
# when a copy failed.

"""The catch-up's first round: copies that start before the checks, agreed on every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from pitstop.core.ranks import Transfer
from pitstop.core.ranks.catchup import Held, copy_failed
from pitstop.shell.ranks.distributed import Ranks

__all__ = ["first_round"]


def first_round(
    ranks: Ranks,
    transfers: Sequence[Transfer],
    *,
    verify: Callable[[bool], bool | str] | None,
    send: Callable[[int], str | None],
    receive: Callable[[int], object],
) -> list[bool | str]:
    """Every rank: its part of ``transfers`` (``send(target)``: sent, every piece checked as it
    was read; what is wrong with this rank's copy, or ``None``; ``receive(source)``: received,
    checked, loaded and published, or raise), else ``verify(arrived)`` of its own copy (True, or
    what is wrong; ``None``: its directory does not list it). Each rank's answer, as after a
    verify: True (it holds the checkpoint, checked whole), what is wrong with its own copy, or
    False. A copy that failed on its way from a good sender is raised on every rank."""
    failure: list[BaseException] = []

    def part() -> tuple[str, str]:
        mine = [move for move in transfers if ranks.rank in (move.source, move.target)]
        if not mine:
            got = verify(False) if verify is not None else False
            return (Held.VALID.value, "") if got is True else (Held.INVALID.value, got or "")
        problem: str | None = None
        for move in mine:  # every copy exchanged whatever failed before: no peer waits in vain
            try:
                if move.source == ranks.rank:
                    problem = problem or send(move.target)
                else:
                    receive(move.source)
            except Exception as exc:  # failed on its way: the stream, a write, a check
                failure.append(exc)
        if problem is not None:  # its own copy is bad: its receivers' failure is explained
            return Held.INVALID.value, problem
        if failure:
            return Held.FAILED.value, str(failure[0]) or type(failure[0]).__name__
        if mine[0].source == ranks.rank and verify is not None:  # loaded, checked as it was read
            got = verify(True)
            return (Held.VALID.value, "") if got is True else (Held.INVALID.value, str(got))
        return Held.VALID.value, ""

    said = ranks.all_gather_each(part)
    held = [Held(kind) for kind, _ in said]
    if copy_failed(transfers, held):  # the copy's own error, on every rank
        ranks.each(partial(_raise_first, failure))
    return [
        True if h is Held.VALID else (text or False) if h is Held.INVALID else False
        for h, (_, text) in zip(held, said, strict=True)
    ]


def _raise_first(failure: list[BaseException]) -> None:
    """Raise the first of ``failure`` (this rank's copy that failed), if any."""
    if failure:
        raise failure[0]
