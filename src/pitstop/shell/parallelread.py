# The checking read pass on every core: where every placed blob goes to the CPU.
#
# Rules: as many threads as asked (the caller's one among them) take the file's chunks in file
# order, each reading one into its place — a placed blob's new memory (pitstop.shell.hostmem),
# or a bounce buffer of its own for a blob that is only checked — and computing its CRC-32
# itself, so that faulting in new memory, copying and checksumming share the cores. Nothing is
# returned before every thread has stopped and every blob's CRC (the chunks' joined with
# crc32_combine) has matched, compared in blob order; the first error of any thread is raised
# on the calling one. Padding is checked on the calling thread before the threads start.
# Where the reader drops placed blobs behind it (a job of one process: nobody else reads the
# file), a placed blob of DIRECT_FROM bytes or more is read past the page cache (O_DIRECT,
# pitstop.shell.blobfile) into page-aligned memory of its own, in page-aligned chunks that
# may take in a neighbour's bytes at the blob's ends (never checked as its own: each chunk's
# CRC-32 covers the blob's bytes only); the page cache's readahead is then turned off for
# the pass (POSIX_FADV_RANDOM), so that reading a small mapped blob between two placed ones
# does not read the placed ones through the cache as well.
# How: an iterator of chunk numbers that the threads share (next() is atomic under the GIL),
# one slot per chunk for its CRC.

"""The checking read pass of pitstop.shell.blobread, on several threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import torch

from pitstop.core.manifest import HEADER_SIZE
from pitstop.shell.blobfile import BlobFile, blob_corrupt, byte_view
from pitstop.shell.checksums import crc32_combine, crc32_update
from pitstop.shell.hostmem import PAGE, new_aligned_bytes, new_host_bytes

__all__ = ["DIRECT_FROM", "read_in_parallel"]

DIRECT_FROM: Final = 1 << 20
"""Placed blobs from this size on are read past the page cache, where the reader drops them."""


@attrs.frozen
class _Chunk:
    """One pread of the parallel pass: bytes ``start..start + nbytes`` of blob ``blob``."""

    blob: int
    start: int
    nbytes: int
    direct: tuple[int, int] | None = None  # read past the cache: (file offset, bytes), aligned


@attrs.define
class _Plan:
    """What the threads read: the chunks in file order, and where placed blobs go."""

    chunks: list[_Chunk] = attrs.Factory(list)
    targets: dict[int, memoryview] = attrs.Factory(dict)  # a placed blob's own bytes
    pages: dict[int, tuple[int, memoryview]] = attrs.Factory(dict)  # past the cache: from
    storages: dict[int, torch.UntypedStorage] = attrs.Factory(dict)


def _plan(
    reader: BlobFile,
    direct: int | None,
    order: Sequence[int],
    placed: Mapping[int, torch.device],
    *,
    chunk: int,
    padding: bool,
) -> _Plan:
    """Check the padding, make the placed blobs' memory and cut every blob into chunks (a
    blob read past the cache: page-aligned chunks, each checksummed over the blob's bytes)."""
    plan = _Plan()
    cursor = HEADER_SIZE
    for index in order:
        blob = reader.manifest.blobs[index]
        if padding:
            reader.check_padding(cursor, blob.offset, index)
        cursor = blob.stop
        if index in placed and direct is not None and blob.length >= DIRECT_FROM:
            first = blob.offset - blob.offset % PAGE
            last = -(-blob.stop // PAGE) * PAGE
            target, whole = new_aligned_bytes(blob.length, blob.offset - first)
            plan.storages[index], plan.targets[index] = target.untyped_storage(), byte_view(target)
            plan.pages[index] = first, whole
            for at in range(first, last, chunk):
                start, stop = max(at, blob.offset), min(at + chunk, blob.stop)
                read = (at, min(chunk, last - at))
                plan.chunks.append(_Chunk(index, start - blob.offset, stop - start, read))
            continue
        if index in placed:
            target = new_host_bytes(blob.length)
            plan.storages[index], plan.targets[index] = target.untyped_storage(), byte_view(target)
        plan.chunks += [
            _Chunk(index, at, min(chunk, blob.length - at)) for at in range(0, blob.length, chunk)
        ]
    return plan


def read_in_parallel(
    reader: BlobFile,
    order: Sequence[int],
    placed: Mapping[int, torch.device],
    *,
    count: int,
    chunk: int,
    padding: bool,
) -> dict[int, torch.UntypedStorage]:
    """Read and check blobs ``order`` of ``reader``'s file (every padding byte before each,
    with ``padding``) on ``count`` threads, this one among them, in ``chunk``-byte preads;
    each blob ``placed`` names (every one on the CPU) into new memory of its own. Returns
    those blobs' storages; raises :class:`~pitstop.errors.CheckpointCorrupt` naming the first
    blob that fails, after every thread has stopped."""
    with reader.past_the_cache() as direct:
        plan = _plan(reader, direct, order, placed, chunk=chunk, padding=padding)
        if plan.pages:  # no readahead through the blobs read past the cache
            os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_RANDOM)
        crcs = _read(reader, direct, plan, count=count, chunk=chunk)
    for index in plan.targets:
        reader.dropped(index)
    joined: dict[int, int] = {}
    for piece, crc in zip(plan.chunks, crcs, strict=True):
        joined[piece.blob] = crc32_combine(joined.get(piece.blob, 0), crc, piece.nbytes)
    for index in order:
        if joined.get(index, 0) != reader.manifest.blobs[index].crc32:
            raise blob_corrupt(reader.manifest, index)
    return plan.storages


def _read(
    reader: BlobFile, direct: int | None, plan: _Plan, *, count: int, chunk: int
) -> list[int]:
    """Read ``plan``'s chunks on ``count`` threads; each chunk's CRC-32, in order."""
    lock = threading.Lock()
    manifest, advance = reader.manifest, reader.advance
    chunks, targets = plan.chunks, plan.targets
    crcs = [0] * len(chunks)
    turns = iter(range(len(chunks)))  # next() on it is atomic under the GIL
    failed: list[BaseException] = []

    def work() -> None:
        bounce = torch.empty(chunk, dtype=torch.uint8)
        own = byte_view(bounce)
        try:
            for turn in turns:
                if failed:
                    return
                piece = chunks[turn]
                place = targets.get(piece.blob)
                blob = manifest.blobs[piece.blob]
                at = blob.offset + piece.start
                if piece.direct is not None and direct is not None and place is not None:
                    first, whole = plan.pages[piece.blob]
                    offset, nbytes = piece.direct
                    window = whole[offset - first : offset - first + nbytes]
                    reader.read_direct(direct, window, offset, min(nbytes, blob.stop - offset))
                    view = place[piece.start : piece.start + piece.nbytes]
                elif place is None:
                    view = own[: piece.nbytes]
                    reader.read_into(view, at)
                else:
                    view = place[piece.start : piece.start + piece.nbytes]
                    reader.read_placed(view, at)
                crcs[turn] = crc32_update(view)
                if advance is not None:
                    with lock:
                        advance(piece.nbytes)
        except BaseException as exc:  # raised below, on the calling thread
            failed.append(exc)

    helpers: list[threading.Thread] = []
    for i in range(count - 1):
        helper = threading.Thread(target=work, name=f"pitstop-read-{i}")
        try:
            helper.start()
        except RuntimeError:  # no new threads now (at interpreter exit): fewer readers
            break
        helpers.append(helper)
    try:
        work()
    finally:
        for helper in helpers:
            helper.join()
    if failed:
        raise failed[0]
    return crcs
