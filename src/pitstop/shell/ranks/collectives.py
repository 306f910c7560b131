# The collectives of pitstop's own process group: all-gather, broadcast, gather to rank 0 and
# the one-integer flags, each named, waited for and held.
#
# Rules: pitstop's collectives run on a process group of its own (gloo, so CPU objects travel
# whatever backend the loop uses), and only ever from the loop's thread — never from the
# background writer, so a collective of pitstop can never interleave with the loop's own on one
# group (KempnerForge #104). Every collective has a timeout: a rank that never arrives becomes
# an error, not a hang.
# How: a value is encoded as msgpack, a closed set of types (pitstop.shell.ranks.valuecodec:
# nothing is ever unpickled; one that cannot travel is refused by every rank in the same
# round), and travels in a fixed box (pitstop.shell.ranks.boxes): one collective per all_gather
# or broadcast, where torch's object collectives take two (the sizes, then the data); a larger
# value takes a second round, which every rank knows of from the sizes in the first. An
# all-gather's box is received once per rank, so it is small (a call's inputs); the once-a-save
# round that carries every rank's part (its RNG streams, a per-rank component) is a gather to
# rank 0 instead, the only rank that needs them, with a point-to-point send for a part too big
# for its box.
# Every collective is named: the Checkpointer tells its Ranks which call it is in
# (Collectives.call), the collectives count their rounds, and one that fails (gloo's timeout, a
# peer gone) is a CollectiveError naming the call, the round and the ranks that did not arrive
# (pitstop.shell.ranks.roundfailure) on every rank that can still speak.
# The tensors of pitstop's last collective stay referenced (by this module) until the next
# one: in torch 2.4's gloo, a worker thread that drops the last reference to a finished
# collective's tensor takes the GIL, and destroy_process_group joins those threads holding it
# — a job's teardown hung (about one run in two) when the Checkpointer, and with it the
# tensors, had gone first.

"""Collectives: pitstop's named, bounded all-gather, broadcast, gather and flags."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Generic, TypeVar

import attrs
import torch

from pitstop import errors
from pitstop.shell.ranks.boxes import HEADER, boxed_value, bytes_tensor, dumps, loads, size_of
from pitstop.shell.ranks.roundfailure import named_failure, peer_failure

__all__ = ["BROADCAST_BOX", "GATHER_BOX", "PART_BOX", "WAIT_SLICE_S", "Collectives"]

T = TypeVar("T")

GATHER_BOX: Final = 1 << 10
"""Bytes of an encoded value an all-gather sends in one collective (a larger one takes a
second): a call's inputs fit. Every rank receives one box per rank, so it stays small."""

BROADCAST_BOX: Final = 4 << 10
"""Bytes of an encoded value a broadcast sends in one collective: a plan, an outcome fit."""

PART_BOX: Final = 32 << 10
"""The box of the once-a-save rounds that carry every rank's own part (its RNG streams and a
sampler's state: about 13 KiB on the CPU)."""

_HELD: list[tuple[object, ...]] = []
"""The tensors of this process's last collective of pitstop (see the rules above)."""


def _abort(group: Any) -> None:
    """Abort pitstop's ``group`` after one of its collectives failed here (where this torch
    can): its connections close, so a rank still waiting on this one in the same round fails
    at once and can say where it was, instead of at its timeout. On a daemon thread, never
    waited for: an abort that blocks costs nothing here."""
    abort = getattr(group, "abort", None)
    if not callable(abort):
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            abort()

    threading.Thread(target=run, name="pitstop-abort", daemon=True).start()


WAIT_SLICE_S: Final = 1.0
"""How often a rank waiting in a collective looks whether another rank of the group failed."""

_GROUPS = itertools.count(1)
"""Numbers pitstop's process groups in the order they are made (the same on every rank)."""


class Collectives:
    """This process's place in the job, and pitstop's collectives on its own group."""

    def __init__(
        self, rank: int, world_size: int, group: Any = None, *, timeout_s: float = 600.0
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._number = next(_GROUPS) if group is not None else 0
        self._call = "a pitstop call"
        self._round = 0
        self._packed = torch.zeros(1, dtype=torch.int64)  # flags()' one integer, reused
        self.failed: errors.CollectiveError | None = None
        """The first collective that failed here: the ranks are out of step for good, so
        every later collective fails at once (and close() ends each rank on its own)."""

    def call(self, name: str) -> None:
        """Name the call whose collectives follow (``"maybe_save at step 12"``): a collective
        that fails names it, and its round within it."""
        self._call, self._round = name, 0

    @contextlib.contextmanager
    def _named(self, what: str) -> Iterator[None]:
        """One collective of the call: its failure (a timeout, a peer gone) as a
        CollectiveError naming the call, this round and the ranks that did not arrive."""
        self._round += 1
        if self.failed is not None:
            raise errors.CollectiveError(
                f"{self._call}: {what} not attempted: an earlier collective failed ({self.failed})",
                self.failed.missing,
            )
        try:
            yield
        except RuntimeError as exc:
            _abort(self._group)  # the ranks still waiting on this one fail now, not at timeout
            self.failed = named_failure(
                self._call,
                what,
                exc,
                round_no=self._round,
                group=str(self._number),
                timeout_s=self._timeout.total_seconds(),
            )
            raise self.failed from exc

    def _wait(self, work: Any, *, sliced: bool = True) -> None:
        """Wait for a collective this rank started (``timeout_s`` at most), in slices: between
        two, a rank that failed in this group (gone, or out of step) fails this one too, at
        once, so that no rank waits for the timeout once another knows the round is lost.
        A point-to-point message (``sliced=False``) is waited for in one piece: gloo closes
        the pair whose send or receive outlives a wait (a peer that fails aborts the group,
        which ends this wait too)."""
        assert work is not None  # None only on a rank outside the group, never pitstop's own
        timeout = self._timeout.total_seconds()
        if not sliced:
            work.wait(self._timeout)
            return
        started = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - started)
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, min(WAIT_SLICE_S, left))))
                return
            except RuntimeError as exc:
                if left <= WAIT_SLICE_S or "timed out" not in str(exc).lower():
                    raise  # the collective's own failure, or the whole timeout spent
            failed = peer_failure(str(self._number), self.rank, self.world_size)
            if failed is not None:
                raise RuntimeError(failed)

    def _hold(self, *tensors: object) -> None:
        """Keep ``tensors`` (the collective just run) until the next collective, here or in
        another Ranks (so also after this one is gone: a job's teardown follows its last)."""
        _HELD[:] = [tensors]

    @property
    def leader(self) -> bool:
        """Whether this rank decides and writes (rank 0)."""
        return self.rank == 0

    @property
    def timeout_s(self) -> float:
        """How long one of pitstop's collectives may wait, in seconds."""
        return self._timeout.total_seconds()

    @property
    def many(self) -> bool:
        """Whether there is more than one rank."""
        return self.world_size > 1

    def all_gather(self, value: T, *, box: int = GATHER_BOX) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank (in one collective when every
        encoded value fits ``box`` bytes, in two otherwise)."""
        if not self.many:
            return [value]
        data = dumps(value, self.rank)
        boxed = boxed_value(data, box)
        boxes = [torch.empty_like(boxed) for _ in range(self.world_size)]
        with self._named("an all-gather"):
            self._wait(torch.distributed.all_gather(boxes, boxed, group=self._group, async_op=True))
        self._hold(boxes, boxed)
        sizes = [size_of(b) for b in boxes]
        if max(sizes) <= box:  # one round: every value fitted its box
            return [loads(b[HEADER : HEADER + n]) for b, n in zip(boxes, sizes, strict=True)]
        # Every rank saw the same sizes, so every rank takes this second round.
        whole = bytes_tensor(data, max(sizes))
        wholes = [torch.empty_like(whole) for _ in range(self.world_size)]
        with self._named("an all-gather's second part"):
            self._wait(
                torch.distributed.all_gather(wholes, whole, group=self._group, async_op=True)
            )
        self._hold(wholes, whole)
        return [loads(w[:n]) for w, n in zip(wholes, sizes, strict=True)]

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (in one collective when it fits BROADCAST_BOX)."""
        if not self.many:
            return value
        data = dumps(value, self.rank) if self.leader else b""
        boxed = boxed_value(data, BROADCAST_BOX)
        with self._named("rank 0's broadcast"):
            self._wait(torch.distributed.broadcast(boxed, src=0, group=self._group, async_op=True))
        self._hold(boxed)
        size = size_of(boxed)
        if size <= BROADCAST_BOX:  # one round: it fitted the box
            return loads(boxed[HEADER : HEADER + size])  # type: ignore[no-any-return]
        whole = bytes_tensor(data, size)  # the header told every rank a second round comes
        with self._named("rank 0's broadcast's second part"):
            self._wait(torch.distributed.broadcast(whole, src=0, group=self._group, async_op=True))
        self._hold(whole)
        return loads(whole)  # type: ignore[no-any-return]

    def gather(self, value: T, *, box: int = GATHER_BOX) -> list[T]:
        """Every rank's ``value``, in rank order, on rank 0 (its own as it is; an empty list
        elsewhere): one collective when every encoded value fits ``box`` bytes; a value that
        does not then travels on its own, from its rank to rank 0 (which knows which from the
        sizes). Rank 0 receives one box per rank; no other rank receives anything."""
        if not self.many:
            return [value]
        return self._gathered(self._send(value, box))

    def _send(self, value: T, box: int) -> _Gathering[T]:
        """Start :meth:`gather`'s collective (its box on its way; it runs on gloo's threads)."""
        data = dumps(value, self.rank)
        boxed = boxed_value(data, box)
        boxes = [torch.empty_like(boxed) for _ in range(self.world_size)] if self.leader else None
        with self._named("a gather to rank 0"):
            work = torch.distributed.gather(
                boxed, gather_list=boxes, dst=0, group=self._group, async_op=True
            )
        self._round -= 1  # its wait (in _gathered) is the same round
        self._hold(boxes, boxed)
        return _Gathering(value, data, boxed, boxes, work, box)

    def _gathered(self, sent: _Gathering[T]) -> list[T]:
        """End the collective :meth:`_send` started: :meth:`gather`'s result."""
        dist = torch.distributed
        with self._named("a gather to rank 0"):
            self._wait(sent.work)
        data, boxes, box = sent.data, sent.boxes, sent.box
        self._hold(boxes, sent.boxed)
        if not self.leader:
            if len(data) > box:  # rank 0 saw the size and waits for it
                whole = bytes_tensor(data, len(data))
                with self._named("a send to rank 0"):
                    self._wait(dist.isend(whole, dst=0, group=self._group), sliced=False)
                self._hold(whole)
            return []
        assert boxes is not None
        values: list[T] = [sent.value]
        received: list[torch.Tensor] = []
        for rank, got in enumerate(boxes[1:], start=1):
            size = size_of(got)
            if size <= box:
                values.append(loads(got[HEADER : HEADER + size]))
            else:
                whole = torch.empty(size, dtype=torch.uint8)
                with self._named(f"a receive from rank {rank}"):
                    self._wait(dist.irecv(whole, src=rank, group=self._group), sliced=False)
                received.append(whole)
                values.append(loads(whole))
        if received:
            self._hold(boxes, sent.boxed, received)
        return values

    def flags(self, values: Sequence[bool]) -> list[bool]:
        """Whether any rank set each of ``values`` (at most four): one all-reduce of one
        integer, the cheapest agreement there is (each flag counted in 16 bits of its own)."""
        if not self.many:
            return list(values)
        packed = self._packed
        packed[0] = sum(int(bool(v)) << (16 * i) for i, v in enumerate(values))
        dist = torch.distributed
        with self._named("the call's all-reduce"):
            self._wait(dist.all_reduce(packed, group=self._group, async_op=True))
        self._hold(packed)
        total = int(packed[0])
        return [bool((total >> (16 * i)) & 0xFFFF) for i in range(len(values))]

    def any_failed_later(self, failed: bool) -> Callable[[float], bool]:
        """Start, without waiting for it, the round that tells every rank whether any rank
        ``failed``; the callable it returns waits for that round (``timeout`` s at most; from
        any thread: the collective itself was started here, on the calling thread) and says
        whether any rank did."""
        if not self.many:
            return lambda timeout: failed
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        dist = torch.distributed
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._hold(flag)

        def wait(timeout: float) -> bool:
            work.wait(datetime.timedelta(seconds=timeout))
            return bool(flag.item())

        return wait


@attrs.frozen
class _Gathering(Generic[T]):
    """A :meth:`Collectives.gather` under way: this rank's value, its encoding, rank 0's boxes."""

    value: T
    data: bytes
    boxed: torch.Tensor
    boxes: list[torch.Tensor] | None
    work: Any
    box: int
