# Ranks that share no directory: finding out which do, and what travels between their writers.
#
# Rules: which ranks share a checkpoint directory is found out at open, never guessed from host
# names: every rank writes a probe file of its own (a random token in its name) into the
# directory, the ranks exchange their tokens (one all-gather), each looks which tokens it finds,
# the sightings are exchanged (a second), and the core groups them (pitstop.core.ranks:
# directory_groups). Every rank then removes its own probe — after the second round, so that no
# rank looks for a probe already gone. Each group's lowest rank writes its directory's copy of
# every checkpoint: every rank's own part (RNG streams, per-rank components) reaches every writer
# (an all-gather of the packed parts, where one directory needs a gather to rank 0 alone), and the
# save counts once every writer has published it (the outcome agreed in one more round). A copy
# travels from one writer to another in chunks of CHUNK bytes (memory bounded by one chunk on each
# side), with a CRC-32 of the whole (the format's fastest engine: ISA-L where installed); the
# receiver drains every chunk even when its own write fails, and a sender that cannot read sends
# zeros and says so at the end, so that neither side is left waiting for the other.
# How: point-to-point sends on pitstop's own gloo group, each bounded by its timeout like every
# collective of pitstop's (Ranks._named, Ranks._wait); the files are the caller's (the store's
# atomic writer publishes what is received).

"""Peers: which ranks share a directory; every rank's part to every writer; copies between them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeVar

import torch

from pitstop.core.ranks import DirectoryGroups, directory_groups
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format.checksums import crc32_update
from pitstop.shell.ranks.distributed import PART_BOX, Ranks
from pitstop.shell.ranks.packing import pack_state, unpack_state

__all__ = ["CHUNK", "PROBE_PREFIX", "gather_to_writers", "probe_groups", "receive", "send"]

T = TypeVar("T")

PROBE_PREFIX: Final = ".pitstop-probe-"
"""The start of a probe file's name (a foreign name to the scan: never a checkpoint)."""

CHUNK: Final = 8 << 20
"""Bytes of a copy sent in one message (what each side holds of it at a time)."""


def probe_groups(ranks: Ranks, directory: Path) -> DirectoryGroups:
    """Every rank: which ranks share ``directory`` (created if missing), found out with probe
    files and agreed in two all-gathers (one rank: one group, nothing written)."""
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
        seen = ranks.all_gather_each(
            lambda: [r for r, t in enumerate(tokens) if (directory / f"{PROBE_PREFIX}{t}").exists()]
        )
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return directory_groups(seen, directory=str(directory))


def gather_to_writers(
    ranks: Ranks, groups: DirectoryGroups, value: object, work: Callable[[list[Any]], T]
) -> T | None:
    """Every rank: every rank's state tree (``value``) to every writer, which runs
    ``work(trees)`` (its own tree as it is, the others unpacked: storage sharing intact); the
    outcome is agreed, so one writer's failure is raised on every rank. ``None`` off writers."""
    packed = ranks.all_gather_each(lambda: pack_state(value), box=PART_BOX)
    writes = groups.writes(ranks.rank)

    def write() -> T | None:
        if not writes:
            return None
        trees = [value if r == ranks.rank else unpack_state(p) for r, p in enumerate(packed)]
        return work(trees)

    return ranks.each(write)


def _exchange(ranks: Ranks, tensor: torch.Tensor, peer: int, *, sending: bool) -> None:
    """One point-to-point message on pitstop's group, bounded by its timeout."""
    dist = torch.distributed
    what = f"a send to rank {peer}" if sending else f"a receive from rank {peer}"
    with ranks._named(what):
        op = dist.isend if sending else dist.irecv
        ranks._wait(op(tensor, peer, group=ranks._group))
    ranks._hold(tensor)


def send(
    ranks: Ranks, target: int, file: BinaryIO | None, size: int, where: str, chunk: int = CHUNK
) -> None:
    """The writer ``ranks.rank``: send ``size`` bytes of ``file`` to ``target`` in messages of
    ``chunk`` bytes (``file`` ``None``, or one that fails to read: zeros, and the receiver is
    told it failed, after every message)."""
    header = torch.tensor([size], dtype=torch.int64)
    _exchange(ranks, header, target, sending=True)
    crc, failed = 0, "" if file is not None else "it could not be opened"
    buffer = torch.empty(min(chunk, max(size, 1)), dtype=torch.uint8)
    view = buffer.numpy().data
    for offset in range(0, size, chunk):
        n = min(chunk, size - offset)
        if not failed and file is not None:
            try:
                got = file.readinto(view[:n])  # type: ignore[attr-defined]
                if got != n:
                    raise OSError(f"{where} ended at byte {offset + (got or 0)} of {size}")
            except OSError as exc:
                failed = str(exc) or type(exc).__name__
        if failed:
            buffer[:n] = 0
        else:
            crc = crc32_update(view[:n], crc)
        _exchange(ranks, buffer[:n], target, sending=True)
    trailer = torch.tensor([crc, int(bool(failed))], dtype=torch.int64)  # a CRC fits in 63 bits
    _exchange(ranks, trailer, target, sending=True)
    if failed or file is None:
        raise SaveError(f"rank {ranks.rank} could not send {where}: {failed}")


def receive(ranks: Ranks, source: int, file: BinaryIO, where: str, chunk: int = CHUNK) -> int:
    """The writer ``ranks.rank``: receive what ``source`` :func:`send` s (``chunk``: as sent)
    into ``file``; its size. Every chunk is received whatever fails here (the sender never
    waits in vain); then a failed write, a failed sender or a CRC that differs is raised."""
    header = torch.zeros(1, dtype=torch.int64)
    _exchange(ranks, header, source, sending=False)
    size = int(header[0])
    crc, problem = 0, ""
    buffer = torch.empty(min(chunk, max(size, 1)), dtype=torch.uint8)
    for offset in range(0, size, chunk):
        n = min(chunk, size - offset)
        part = buffer[:n]
        _exchange(ranks, part, source, sending=False)
        if problem:
            continue
        data = part.numpy().data
        crc = crc32_update(data, crc)
        try:
            file.write(data)
        except OSError as exc:
            problem = f"could not write {where}: {exc}"
    trailer = torch.zeros(2, dtype=torch.int64)
    _exchange(ranks, trailer, source, sending=False)
    if int(trailer[1]):
        raise SaveError(f"rank {source} could not send {where} to rank {ranks.rank}")
    if problem:
        raise SaveError(problem)
    if int(trailer[0]) != crc:
        raise CheckpointCorrupt(
            f"{where} from rank {source}: CRC-32 {crc:08x} received, {int(trailer[0]):08x} sent"
        )
    return size
