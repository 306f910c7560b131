# Ranks that share no directory: finding out which do, and what travels between their writers.
#
# Rules: which ranks share a checkpoint directory is found out at open, never guessed from host
# names: every rank writes a probe file of its own (a random token in its name) into the
# directory, the ranks exchange their tokens (one all-gather), each looks which tokens it finds,
# the sightings are exchanged (a second), and the core groups them (pitstop.core.ranks:
# directory_groups). Every rank then removes its own probe — after the second round, so that no
# rank looks for a probe already gone. Each group's lowest rank writes its directory's copy of
# every checkpoint: every rank's own part (RNG streams, per-rank components) reaches every writer
# (an all-gather, where one directory needs a gather to rank 0 alone; the writers' plans agreed in
# it), and the save counts once every writer has published it (agreed in one more round). A copy
# sent with ``stream`` (every catch-up copy) travels over a direct TCP stream when both
# writers agree to one (pitstop.shell.ranks.stream), PIECE bytes at a time, one piece in memory
# on each side (the kernel's socket buffers overlap them); header and trailer stay on the group,
# so a failed read or a broken stream still ends both sides with the same error. Otherwise it
# travels from one writer to another in chunks of CHUNK bytes, double-buffered: the sender reads
# chunk k+1 while chunk k travels, the receiver writes chunk k while chunk k+1 travels (memory
# bounded by two chunks on each side; one message in flight each way, so they arrive in order),
# with a CRC-32 of the whole (the format's fastest engine: ISA-L where installed) compared before
# the caller may publish — or, for a checkpoint file, its manifest and footer sent first and
# every chunk checked as it lands against them (pitstop.shell.ranks.arrival: the file's own
# checksums, so a byte changed on the way or on the sender's disk is caught in the one pass
# that writes it, and no second read checks it); the receiver writes each chunk where it
# belongs (seeking once, after the tail sent first), hands what it wrote to the disk's
# writeback as it goes (WriteBehind), drains every chunk even when its own write or check
# fails, and a sender that cannot read sends zeros and says so at the end, so that neither side
# is left waiting for the other.
# How: point-to-point isend/irecv on pitstop's own gloo group, each wait bounded by its timeout
# like every collective of pitstop's (Ranks._named, Ranks._wait; in one piece: gloo closes a pair
# whose message outlives a wait); the files are the caller's (the store's atomic writer publishes
# what is received, once the caller's check of it passed).

"""Peers: which ranks share a directory; every rank's part to every writer; copies between them."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, Generic, TypeVar

import attrs
import torch

from pitstop.core.ranks import OK, DirectoryGroups, Outcome, agree, directory_groups
from pitstop.errors import CheckpointCorrupt, PitstopError, SaveError
from pitstop.shell.format.checksums import crc32_update
from pitstop.shell.format.writebehind import WriteBehind
from pitstop.shell.ranks.collectives import PART_BOX
from pitstop.shell.ranks.distributed import Ranks, raise_outcome
from pitstop.shell.ranks.packing import pack_state, unpack_state
from pitstop.shell.ranks.stream import receive_exactly, receiver_stream, sender_stream

__all__ = [
    "CHUNK",
    "PIECE",
    "PROBE_PREFIX",
    "Sightings",
    "gather_to_writers",
    "look_on_writers",
    "probe_groups",
    "receive",
    "send",
]

T = TypeVar("T")

log = logging.getLogger("pitstop.transfer")

PROBE_PREFIX: Final = ".pitstop-probe-"
"""The start of a probe file's name (a foreign name to the scan: never a checkpoint)."""

CHUNK: Final = 8 << 20
"""Bytes of a copy sent in one message (each side holds two; 32 MiB measured no faster)."""

PIECE: Final = 1 << 20
"""Bytes of a copy read, sent, received, written and checked at a time on a stream (each side
holds one; the kernel's socket buffers overlap the sides; 1 MiB beat 8 MiB in a raw loopback
copy: each piece is still in the cache when it is checked and written)."""


def probe_groups(
    ranks: Ranks, directory: Path, then: Callable[[list[int]], object] | None = None
) -> DirectoryGroups:
    """Every rank: which ranks share ``directory`` (created if missing), found out with probe
    files and agreed in two all-gathers (one rank: one group, nothing written). ``then``: run
    with the ranks this one saw, before the second round, which agrees its outcome too (a
    failure of it on any rank raised on every rank)."""
    if not ranks.many:
        return DirectoryGroups.one(1)
    token = uuid.uuid4().hex
    probe = directory / f"{PROBE_PREFIX}{token}"

    def write() -> str:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "xb") as f:
            f.write(token.encode())
        return token

    try:
        tokens = ranks.all_gather_each(write)

        def sighting() -> tuple[list[int], Outcome]:
            seen = [r for r, t in enumerate(tokens) if (directory / f"{PROBE_PREFIX}{t}").exists()]
            if then is not None:
                _, outcome, own[0] = ranks._attempt(lambda: then(seen))
                return seen, outcome
            return seen, OK

        own: list[BaseException | None] = [None]
        sightings = ranks.all_gather_each(sighting)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    groups = directory_groups([seen for seen, _ in sightings], directory=str(directory))
    agreed = agree([outcome for _, outcome in sightings])  # then's, once the sightings agree
    raise_outcome(agreed, own=own[0] if agreed == sightings[ranks.rank][1] else None)
    return groups


def gather_to_writers(
    ranks: Ranks,
    groups: DirectoryGroups,
    value: object,
    work: Callable[[list[Any]], T],
    first: Callable[[], object] = lambda: None,
) -> T | None:
    """Every rank: ``first()``, then every rank's tree (``value``) to every writer (agreed), which
    runs ``work(trees)`` (its own as it is, the rest unpacked), agreed too; ``None`` off writers."""
    packed = ranks.all_gather_each(lambda: (first(), pack_state(value))[1], box=PART_BOX)
    writes = groups.writes(ranks.rank)

    def write() -> T | None:
        if not writes:
            return None
        trees = [value if r == ranks.rank else unpack_state(p) for r, p in enumerate(packed)]
        return work(trees)

    return ranks.each(write)


@attrs.frozen
class Sightings(Generic[T]):
    """What each directory's writer found (:func:`look_on_writers`): per rank, a path or what
    was wrong, and the thing found (``None``: nothing); the writers that found it, in order."""

    found: list[tuple[str, T | None]]
    writers: tuple[int, ...]
    holders: list[int]

    @property
    def said(self) -> str:
        """Each writer's finding, for an error naming every node's."""
        return "; ".join(f"rank {w}'s node: {self.found[w][0]}" for w in self.writers)


def look_on_writers(
    ranks: Ranks, groups: DirectoryGroups, look: Callable[[], tuple[str, T | None]]
) -> Sightings[T]:
    """Every rank: ``look()`` on each directory's writer (its node's finding: a path and what
    it holds there, or what is wrong and ``None``), every finding to every rank; a failure of
    ``look`` on any writer raised on every rank."""
    writes = groups.writes(ranks.rank)
    found: list[tuple[str, T | None]] = ranks.all_gather_each(look if writes else _nothing)
    holders = [w for w in groups.writers if found[w][1] is not None]
    return Sightings(found, tuple(groups.writers), holders)


def _nothing() -> tuple[str, None]:
    return "", None


def _post(ranks: Ranks, tensor: torch.Tensor, peer: int, *, sending: bool) -> Any:
    """Start one point-to-point message on pitstop's group; :func:`_done` waits for it."""
    dist = torch.distributed
    with ranks._named(f"a send to rank {peer}" if sending else f"a receive from rank {peer}"):
        return (dist.isend if sending else dist.irecv)(tensor, peer, group=ranks._group)


def _done(ranks: Ranks, work: Any, peer: int, *held: torch.Tensor, sending: bool) -> None:
    """Wait for a message :func:`_post` started, bounded by pitstop's timeout; ``held``: the
    buffers gloo may still touch (kept, as every collective's are, even when the wait fails)."""
    try:
        with ranks._named(f"a send to rank {peer}" if sending else f"a receive from rank {peer}"):
            ranks._wait(work, sliced=False)  # gloo: a slice that times out ends the pair
    finally:
        ranks._hold(*held)


def _exchange(ranks: Ranks, tensor: torch.Tensor, peer: int, *, sending: bool) -> None:
    """One point-to-point message on pitstop's group, bounded by its timeout."""
    _done(ranks, _post(ranks, tensor, peer, sending=sending), peer, tensor, sending=sending)


def _give(ranks: Ranks, tensor: torch.Tensor, peer: int) -> None:
    _exchange(ranks, tensor, peer, sending=True)


def _take(ranks: Ranks, tensor: torch.Tensor, peer: int) -> None:
    _exchange(ranks, tensor, peer, sending=False)


def _buffers(ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two chunk buffers of one side of a copy sent as ``ranges`` (one for one range)."""
    first = torch.empty(max([n for _, n in ranges] + [1]), dtype=torch.uint8)
    return first, (torch.empty_like(first) if len(ranges) > 1 else first)


def _ranges(size: int, first: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` of each message of a copy of ``size`` bytes: bytes ``first``
    on first (a checkpoint's manifest and footer), then the bytes before them, ``chunk`` at most
    each."""
    first = max(0, min(first, size))
    return [
        (offset, min(chunk, stop - offset))
        for start, stop in ((first, size), (0, first))
        for offset in range(start, stop, chunk)
    ]


class _Reader:
    """The sender's file, read a chunk at a time into the caller's buffer; once a read fails
    (or with no file), zeros and what went wrong."""

    def __init__(self, file: BinaryIO | None, size: int, where: str) -> None:
        self.file, self.size, self.where = file, size, where
        self.at = 0  # where the file stands
        self.failed = "" if file is not None else "it could not be opened"

    def fill(self, part: torch.Tensor, offset: int) -> memoryview:
        """Bytes ``offset`` on of the file into ``part`` (zeros once a read failed)."""
        view = part.numpy().data
        if not self.failed and self.file is not None:
            try:
                if offset != self.at:
                    self.file.seek(offset)
                got = self.file.readinto(view)  # type: ignore[attr-defined]
                self.at = offset + (got or 0)
                if got != part.numel():
                    raise OSError(f"{self.where} ended at byte {self.at} of {self.size}")
            except OSError as exc:
                self.failed = str(exc) or type(exc).__name__
        if self.failed:
            part.zero_()
        return view


def send(
    ranks: Ranks,
    target: int,
    file: BinaryIO | None,
    size: int,
    where: str,
    chunk: int = CHUNK,
    *,
    first: int = 0,
    crc: bool = True,
    stream: bool = False,
) -> None:
    """The writer ``ranks.rank``: send ``size`` bytes of ``file`` to ``target`` in messages of
    ``chunk`` bytes, each read while the one before travels, bytes ``first`` on first, then
    those before them (``file`` ``None``, or one that fails to read: zeros, and the receiver is
    told it failed, after every message); ``crc``: with the CRC-32 of the whole (else 0, for a
    receiver that checks what arrives itself). ``stream`` (the receiver's too): over a direct
    socket, when both sides agree to one (pitstop.shell.ranks.stream), in pieces of
    :data:`PIECE`."""
    _exchange(ranks, torch.tensor([size, first], dtype=torch.int64), target, sending=True)
    whole, reader = 0, _Reader(file, size, where)
    sock = sender_stream(ranks, target, _give, _take) if stream and size else None
    if sock is not None:
        with sock:
            part = torch.empty(min(PIECE, size), dtype=torch.uint8)
            for offset, n in _ranges(size, first, PIECE):
                view = reader.fill(part[:n], offset)
                whole = crc32_update(view, whole) if crc and not reader.failed else whole
                try:
                    sock.sendall(view)
                except OSError as exc:
                    reader.failed = f"the stream to rank {target} broke: {exc}"
                    break
    else:
        ranges = _ranges(size, first, chunk)
        buffers = _buffers(ranges)
        travelling: Any = None  # the message of the chunk before, still on its way
        for k, (offset, n) in enumerate(ranges):
            part = buffers[k % 2][:n]
            view = reader.fill(part, offset)
            whole = crc32_update(view, whole) if crc and not reader.failed else whole
            if travelling is not None:
                _done(ranks, travelling, target, *buffers, sending=True)
            travelling = _post(ranks, part, target, sending=True)
        if travelling is not None:
            _done(ranks, travelling, target, *buffers, sending=True)
    failed = reader.failed
    trailer = torch.tensor([whole, int(bool(failed))], dtype=torch.int64)  # CRCs fit 63 bits
    _exchange(ranks, trailer, target, sending=True)
    if failed or file is None:
        raise SaveError(f"rank {ranks.rank} could not send {where}: {failed}")


class _Landing:
    """Where the receiver's chunks land: written into ``file`` where they belong, handed to the
    writeback, checked by ``look`` (else a CRC-32 of the whole is kept); the first failure
    kept (:attr:`problem`), and later chunks dropped."""

    def __init__(
        self,
        file: BinaryIO,
        where: str,
        first: int,
        look: Callable[[memoryview, int], object] | None,
    ) -> None:
        self.file, self.where, self.first, self.look = file, where, first, look
        self.behind = WriteBehind.of(file)  # the disk starts on the copy as it comes
        self.whole = 0
        self.at = 0  # where the file stands
        self.problem: PitstopError | None = None  # raised once every chunk is in

    def land(self, data: memoryview, offset: int) -> None:
        """Write and check the chunk ``data`` of bytes ``offset`` on."""
        if self.problem is not None:
            return
        if self.look is None:
            self.whole = crc32_update(data, self.whole)
        try:
            if offset != self.at:
                self.file.seek(offset)
            self.file.write(data)
            self.at = offset + data.nbytes
            if offset < self.first or self.first == 0:  # the tail sent first: with the fsync
                self.behind.wrote(self.at)
            if self.look is not None:
                self.look(data, offset)
        except OSError as exc:
            self.problem = SaveError(f"could not write {self.where}: {exc}")
        except CheckpointCorrupt as exc:
            self.problem = exc


def receive(
    ranks: Ranks,
    source: int,
    file: BinaryIO,
    where: str,
    chunk: int = CHUNK,
    *,
    look: Callable[[memoryview, int], object] | None = None,
    stream: bool = False,
) -> int:
    """The writer ``ranks.rank``: receive what ``source`` :func:`send` s (``chunk``,
    ``stream``: as sent) into ``file``, each chunk written where it belongs while the next one
    travels; its size. ``look(bytes, offset)``: each chunk checked once written, in the order
    sent (its CheckpointCorrupt ends the writing; no CRC-32 of the whole is compared then).
    Every chunk is received whatever fails here (the sender never waits in vain); then a failed
    write or check, a failed sender or stream, or a CRC that differs is raised."""
    header = torch.zeros(2, dtype=torch.int64)
    _exchange(ranks, header, source, sending=False)
    size, first = int(header[0]), int(header[1])
    landing = _Landing(file, where, first, look)
    sock = receiver_stream(ranks, source, _give, _take) if stream and size else None
    if stream and size:
        over = "a direct stream" if sock is not None else "pitstop's group (no stream agreed)"
        log.info("rank %d receives %s from rank %d over %s", ranks.rank, where, source, over)
    if sock is not None:
        with sock:
            view = memoryview(bytearray(min(PIECE, size)))
            for offset, n in _ranges(size, first, PIECE):
                try:
                    receive_exactly(sock, view[:n])
                except OSError as exc:  # the sender hears of it: its next send fails
                    broke = f"the stream from rank {source} broke while receiving {where}: {exc}"
                    landing.problem = landing.problem or SaveError(broke)
                    break
                landing.land(view[:n], offset)
    else:
        ranges = _ranges(size, first, chunk)
        buffers = _buffers(ranges)
        travelling = (
            _post(ranks, buffers[0][: ranges[0][1]], source, sending=False) if ranges else None
        )
        for k, (offset, n) in enumerate(ranges):
            _done(ranks, travelling, source, *buffers, sending=False)
            if k + 1 < len(ranges):  # the next chunk travels while this one is written
                ahead = ranges[k + 1][1]
                travelling = _post(ranks, buffers[(k + 1) % 2][:ahead], source, sending=False)
            landing.land(buffers[k % 2][:n].numpy().data, offset)
    trailer = torch.zeros(2, dtype=torch.int64)
    _exchange(ranks, trailer, source, sending=False)
    if int(trailer[1]):
        raise SaveError(f"rank {source} could not send {where} to rank {ranks.rank}")
    if landing.problem is not None:
        raise landing.problem
    if look is None and int(trailer[0]) != landing.whole:
        raise CheckpointCorrupt(
            f"{where} from rank {source}: CRC-32 {landing.whole:08x} received, "
            f"{int(trailer[0]):08x} sent"
        )
    return size
