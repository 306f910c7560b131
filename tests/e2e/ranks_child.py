"""One rank of tests/e2e/test_ranks.py: pitstop's collectives with values of every size.

Each rank all-gathers (with the default box and with ``PART_BOX``), gathers to rank 0 and
broadcasts values from empty to far past each box (``pitstop.shell.ranks.collectives``), the ranks'
sizes differing, and checks what it got; then ``gather_then_lead`` (and the same round begun
by ``begin`` on rank 0 before any other rank's value is sent) with a failure on each side, and
a Ctrl-C in a round's work on one rank, which every rank raises; a Checkpointer whose directory
rank 0 cannot lock raises on every rank, and the next one opens.
Every kind of value that travels comes back the same type, and one that cannot travel is
refused by every rank in the same round.
It prints ``ok <n>`` (n: the values checked) and exits 0, or raises.
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import pitstop
from pitstop.core.ranks import Outcome
from pitstop.core.records import NO_CHECKPOINT, Progress, SaveReason
from pitstop.errors import ConfigError, DirectoryLocked, SaveError
from pitstop.shell.ranks.collectives import BROADCAST_BOX, GATHER_BOX, PART_BOX
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.store.lock import DirectoryLock

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ranks = Ranks.current(timeout_s=60)
edges = sorted({b + d for b in (GATHER_BOX, BROADCAST_BOX, PART_BOX) for d in (-64, 0, 1)})
sizes = (0, 1, *edges, 1 << 20)


@functools.cache
def value(r: int, size: int) -> tuple[int, bytes]:
    return r, bytes((r * 7 + i) % 251 for i in range(size))


checked = 0
for size in sizes:
    for other in sizes:  # rank 0 sends ``size`` bytes, every other rank ``other``
        mine = value(rank, size if rank == 0 else other)
        expected = [value(r, size if r == 0 else other) for r in range(world)]
        assert ranks.all_gather(mine) == expected, (size, other)
        assert ranks.all_gather(mine, box=PART_BOX) == expected, (size, other)
        assert ranks.broadcast(mine if rank == 0 else None) == value(0, size), size
        assert ranks.gather(mine, box=PART_BOX) == (expected if rank == 0 else []), (size, other)
        checked += 4

# gather_then_lead: rank 0 gets every rank's result; its work's result reaches every rank.
ran: list[list[int]] = []


def lead(results: list[int]) -> str:
    ran.append(results)
    return f"sum {sum(results)}"


assert ranks.gather_then_lead(lambda: rank + 10, lead) == f"sum {sum(range(10, 10 + world))}"
assert ran == ([list(range(10, 10 + world))] if rank == 0 else [])
checked += 1

# begin(): rank 0's round starts without waiting for any other rank's value (they begin only
# once rank 0's begin() has returned: a barrier on the default group between), and lead()
# ends it as gather_then_lead does. A begin() that waited would hang until the timeout.
if rank == 0:
    begun = ranks.begin(lambda: rank + 20)
    dist.barrier()
else:
    dist.barrier()
    begun = ranks.begin(lambda: rank + 20)
assert begun.value == rank + 20
assert begun.lead(lambda results: f"sum {sum(results)}") == f"sum {sum(range(20, 20 + world))}"
checked += 1


def raised(call: Callable[[], object], kind: type[BaseException] = Exception) -> BaseException:
    """The exception of ``kind`` that ``call()`` raised (an AssertionError if none)."""
    try:
        call()
    except kind as exc:
        return exc
    raise AssertionError(f"no {kind.__name__}")


def fail_on_last() -> int:
    if rank == world - 1:
        raise ConfigError("the last rank's own failure")
    return rank


# The failing rank raises its own error; the others the same class, naming it.
failed = raised(lambda: ranks.gather_then_lead(fail_on_last, lead))
own = "the last rank's own failure"
assert type(failed) is ConfigError, repr(failed)
assert str(failed) == (own if rank == world - 1 else f"rank {world - 1}: {own}"), str(failed)
assert len(ran) == (1 if rank == 0 else 0)  # the work did not run
checked += 1


def refuse(results: list[int]) -> str:
    raise OSError(28, "No space left on device")


# Rank 0's work fails: its own OSError there, a SaveError naming it elsewhere.
failed = raised(lambda: ranks.gather_then_lead(lambda: rank, refuse))
assert type(failed) is (OSError if rank == 0 else SaveError), repr(failed)
if rank != 0:
    assert str(failed) == "rank 0: OSError: [Errno 28] No space left on device", str(failed)
checked += 1


def ctrl_c(*_: object) -> object:
    raise KeyboardInterrupt


# A Ctrl-C in rank 0's work reaches every rank (before, the others waited for rank 0 until the
# timeout): its own interrupt there, one naming rank 0 elsewhere.
stopped = raised(lambda: ranks.lead(ctrl_c), KeyboardInterrupt)
assert str(stopped) == ("" if rank == 0 else "rank 0: interrupted (Ctrl-C)"), str(stopped)
checked += 1


def last_interrupted_first_fails() -> int:
    if rank == world - 1:
        raise KeyboardInterrupt("Ctrl-C on the last rank")
    if rank == 0:
        raise SaveError("rank 0's own failure")
    return rank


# An interrupt anywhere outranks a failure elsewhere: every rank stops.
stopped = raised(lambda: ranks.each(last_interrupted_first_fails), KeyboardInterrupt)
assert str(stopped).endswith("Ctrl-C on the last rank"), str(stopped)
ran.clear()
stopped = raised(
    lambda: ranks.gather_then_lead(last_interrupted_first_fails, lead), KeyboardInterrupt
)
assert str(stopped).endswith("Ctrl-C on the last rank"), str(stopped)
assert not ran  # the work did not run
checked += 2


# Every kind of value that travels comes back the same type on every rank, in every collective
# (pitstop.shell.ranks.valuecodec: a tuple a tuple, a Path a Path, a record its own class).
def kinds(r: int) -> tuple[object, ...]:
    return (
        [r, 1 << 70, 0.5, None, True, "r\udcff", b"b"],
        {"k": (1, 2), 3: frozenset({4}), (5,): {6}},
        Path(f"/r{r}"),
        NO_CHECKPOINT,
        SaveReason.STOP,
        Outcome(kind="SaveError", error="e", rank=r),
        Progress(step=r),
    )


def same_types(got: object, sent: object) -> bool:
    if type(got) is not type(sent) or got != sent:
        return False
    if isinstance(sent, (list, tuple)):
        return all(same_types(a, b) for a, b in zip(got, sent, strict=True))  # type: ignore[call-overload]
    if isinstance(sent, dict):
        return all(same_types(got[k], v) for k, v in sent.items())  # type: ignore[index]
    return True


every = [kinds(r) for r in range(world)]
assert same_types(ranks.all_gather(kinds(rank)), every)
assert same_types(ranks.broadcast(kinds(rank)), kinds(0))
assert same_types(ranks.gather(kinds(rank)), every if rank == 0 else [])
assert same_types(ranks.all_gather_each(lambda: kinds(rank)), every)
checked += 4

# A value that cannot travel is refused where it is sent, and its round still completes: every
# rank raises the same error (before, the others waited for the sender until the timeout).
unsendable = "is a builtins.object, which cannot travel between ranks"
refused = raised(lambda: ranks.all_gather(object() if rank == world - 1 else rank), TypeError)
assert str(refused).startswith(f"rank {world - 1}: value {unsendable}"), str(refused)
refused = raised(lambda: ranks.broadcast(object() if rank == 0 else None), TypeError)
assert str(refused).startswith(f"rank 0: value {unsendable}"), str(refused)
# A round's result that cannot travel is that rank's failure, raised as any other of a round.
for refusing in (
    lambda: ranks.all_gather_each(lambda: object() if rank == world - 1 else rank),
    lambda: ranks.gather_then_lead(lambda: object() if rank == world - 1 else rank, lead),
):
    refused = raised(refusing)
    assert type(refused) is SaveError, repr(refused)
    assert str(refused).startswith(f"rank {world - 1}: TypeError: the result {unsendable}")
for refusing in (
    lambda: ranks.lead(object),
    lambda: ranks.gather_then_lead(lambda: rank, lambda results: [object()]),
):
    refused = raised(refusing)
    assert type(refused) is SaveError, repr(refused)
    assert str(refused).startswith("rank 0: TypeError: the result"), str(refused)
checked += 6

# A Checkpointer whose directory rank 0 cannot lock (another run holds it) raises the same class
# on every rank; once it is free, the next one opens, saves and leaves nothing locked.
root = ranks.broadcast(tempfile.mkdtemp(prefix="pitstop-ranks-") if rank == 0 else None)
other_run = DirectoryLock(root, "another run")
if rank == 0:
    other_run.acquire()
model = torch.nn.Linear(1, 1)
locked = raised(lambda: pitstop.Checkpointer(root, model=model, timeout_s=60), DirectoryLocked)
assert type(locked) is DirectoryLocked, repr(locked)
other_run.release()
with pitstop.Checkpointer(root, model=model, timeout_s=60) as opened:
    opened.save(pitstop.Progress(step=1))
assert [p.name for p in Path(root).iterdir() if p.name == ".lock"] == []
checked += 2
ranks.all_gather(None)  # every rank has looked: rank 0 removes the directory
if rank == 0:
    shutil.rmtree(root)
print(f"ok {checked}", flush=True)
dist.destroy_process_group()
