# What a collective that did not complete says: the call, the round, the ranks that did not come.
#
# Rules: a collective of pitstop's (or StopRequest.sync()'s) that fails — gloo's timeout, or a
# peer's connection closed — becomes one CollectiveError on every rank that can still speak,
# naming the call (``maybe_save at step 12``), the round within it, which ranks did not arrive
# and where the others were, and what to check (the same calls on every rank; timeout_s). Which
# ranks arrived is asked of the job's store (torch.distributed's default store, which every
# rank reaches): each failing rank posts where it failed, then waits a few seconds for the
# others' posts; a rank that posted nothing did not arrive (it left the loop, crashed, or is
# stuck in other work). The store is asked on a daemon thread with a bound, so a store that is
# gone (rank 0's process ended) costs that bound, never a hang; then the message says the ranks
# could not be asked. Nothing of this runs unless a collective failed.
# How: keys ``pitstop/failed/<group>/<rank>`` in the default store; store.wait with a timeout.

"""Naming a failed collective: which call, which round, which ranks did not arrive."""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

from pitstop.errors import CollectiveError

__all__ = ["named_failure", "peer_failure"]

PROBE_S = 5.0
"""At most how long a failing rank waits to hear where the other ranks failed."""


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _ask(prefix: str, rank: int, world: int, mine: str, wait_s: float) -> dict[int, str] | None:
    """Post where this rank failed; return where each rank that posted within ``wait_s``
    failed (``None``: the store could not be asked)."""
    answer: list[dict[int, str]] = []

    def ask() -> None:
        store = _store()
        store.set(f"{prefix}/{rank}", mine)
        others = [f"{prefix}/{r}" for r in range(world) if r != rank]
        with contextlib.suppress(Exception):  # some never posted: looked at one by one below
            store.wait(others, datetime.timedelta(seconds=wait_s))
        found = {rank: mine}
        for r in range(world):
            key = f"{prefix}/{r}"
            if r != rank and store.check([key]):
                found[r] = store.get(key).decode("utf-8", "replace")
        answer.append(found)

    thread = threading.Thread(target=ask, name="pitstop-failure-probe", daemon=True)
    thread.start()
    thread.join(wait_s + 2.0)
    return answer[0] if answer else None


def peer_failure(group: str, rank: int, world: int) -> str | None:
    """Where another rank of ``group`` failed (``"rank 1 failed at ..."``), if one posted it;
    ``None`` if none did or the store cannot be asked. One look, no wait."""
    prefix = f"pitstop/failed/{group}"
    try:
        store = _store()
        for r in range(world):
            key = f"{prefix}/{r}"
            if r != rank and store.check([key]):
                return f"rank {r} failed at {store.get(key).decode('utf-8', 'replace')}"
    except Exception:  # the store is gone with its rank: the collective's own error will come
        return None
    return None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def named_failure(
    call: str,
    what: str,
    cause: BaseException,
    *,
    round_no: int = 1,
    group: str = "sync",
    timeout_s: float | None = None,
    probe_s: float = PROBE_S,
) -> CollectiveError:
    """The error a rank raises when ``what`` (a collective of ``call``, its ``round_no``-th)
    failed with ``cause``: where every rank that can be asked was, and what to check."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = f"{call}, round {round_no} ({what})"
    try:
        found = _ask(f"pitstop/failed/{group}", rank, world, mine, probe_s)
    except Exception:  # the store is gone with its rank: say so below
        found = None
    if found is None:
        where = "the other ranks could not be asked where they were (the job's store is gone)"
        missing: list[int] = []
    else:
        missing = [r for r in range(world) if r not in found]
        same = [r for r, at in found.items() if at == mine and r != rank]
        elsewhere = [f"rank {r} at {at}" for r, at in sorted(found.items()) if at != mine]
        parts = [f"{_ranks(missing)} did not arrive"] if missing else []
        if same:
            parts.append(f"{_ranks(same)} failed at the same round")
        parts += [f"{e} failed" for e in elsewhere]
        where = "; ".join(parts) or "every rank arrived"
    limit = f" within timeout_s={timeout_s:g}" if timeout_s is not None else ""
    message = (
        f"{call}: {what} (round {round_no} of the call) did not complete on rank {rank}"
        f"{limit}: {where}. Check that every rank makes the same pitstop calls in the same "
        f"order — a rank that leaves the training loop on its own (acting on a flag the others "
        f"did not agree on, or an exception) strands the others — and that timeout_s covers "
        f"the longest one rank may wait for another. ({type(cause).__name__}: {cause})"
    )
    return CollectiveError(message, missing)
