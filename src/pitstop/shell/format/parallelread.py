# The checking read pass on every core: where every placed blob goes to the CPU.
#
# Rules: as many threads as asked (the caller's one among them) take the file's chunks in file
# order, each reading one into its place — a placed blob's new memory
# (pitstop.shell.format.hostmem), or a bounce buffer of its own for a blob that is only checked —
# and computing its CRC-32 itself, so that faulting in new memory, copying and checksumming share
# the cores. Nothing is returned before every thread has stopped and every blob's CRC (the chunks'
# joined with crc32_combine) has matched, compared in blob order; the first error of any thread is
# raised on the calling one. Padding is checked on the calling thread before the threads start.
# Which blobs are read past the page cache, and the chunks of each, the core decides
# (pitstop.core.file.layout): such a blob is read with O_DIRECT (pitstop.shell.format.blobfile) into
# page-aligned memory of its own (pitstop.shell.format.hostmem.new_aligned_bytes); the page cache's
# readahead is then turned off for the pass (POSIX_FADV_RANDOM), so that reading a small mapped blob
# between two such blobs does not read them through the cache as well.
# How: an iterator of chunk numbers that the threads share (next() is atomic under the GIL),
# one slot per chunk for its CRC.

"""The checking read pass of pitstop.shell.format.blobread, on several threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from pitstop.core.file.layout import BlobRead, plan_blob_reads, reads_past_cache
from pitstop.core.file.manifest import HEADER_SIZE
from pitstop.shell.format.blobfile import BlobFile, blob_corrupt, byte_view
from pitstop.shell.format.checksums import crc32_combine, crc32_update
from pitstop.shell.format.hostmem import PAGE, new_aligned_bytes, new_host_bytes, reused_scratch

if TYPE_CHECKING:
    import torch

__all__ = ["read_in_parallel"]


@attrs.frozen
class _Chunk:
    """One read of the parallel pass: ``read`` of blob ``blob``."""

    blob: int
    read: BlobRead


@attrs.define
class _Plan:
    """What the threads read: the chunks in file order, and where placed blobs go."""

    chunks: list[_Chunk] = attrs.Factory(list)
    targets: dict[int, memoryview] = attrs.Factory(dict)  # a placed blob's own bytes
    # a blob read past the cache: the file offset of its first page, and memory from there
    pages: dict[int, tuple[int, memoryview]] = attrs.Factory(dict)
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
        past = direct is not None and reads_past_cache(
            blob.length, placed=index in placed, dropping=reader.drop
        )
        reads = plan_blob_reads(blob.offset, blob.length, chunk=chunk, page=PAGE, direct=past)
        plan.chunks += [_Chunk(index, read) for read in reads]
        if index not in placed:
            continue
        first = reads[0].read_at if past else None  # the page the first read starts on
        if first is None:
            target = new_host_bytes(blob.length)
        else:
            target, whole = new_aligned_bytes(blob.length, blob.offset - first)
            plan.pages[index] = first, whole
        plan.storages[index], plan.targets[index] = target.untyped_storage(), byte_view(target)
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
        joined[piece.blob] = crc32_combine(joined.get(piece.blob, 0), crc, piece.read.nbytes)
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
        with reused_scratch(chunk) as own:
            _work(own)

    def _work(own: memoryview) -> None:
        try:
            for turn in turns:
                if failed:
                    return
                index, read = chunks[turn].blob, chunks[turn].read
                place = targets.get(index)
                blob = manifest.blobs[index]
                at = blob.offset + read.start
                if read.read_at is not None and direct is not None and place is not None:
                    first, whole = plan.pages[index]
                    window = whole[read.read_at - first : read.read_at - first + read.read_bytes]
                    need = min(read.read_bytes, blob.stop - read.read_at)
                    reader.read_direct(direct, window, read.read_at, need)
                    view = place[read.start : read.start + read.nbytes]
                elif place is None:
                    view = own[: read.nbytes]
                    reader.read_into(view, at)
                else:
                    view = place[read.start : read.start + read.nbytes]
                    reader.read_placed(view, at)
                crcs[turn] = crc32_update(view)
                if advance is not None:
                    with lock:
                        advance(read.nbytes)
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
