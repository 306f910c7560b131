# Reading a checkpoint's data region once, every blob checksummed as it is read.
#
# Rules: the file is read front to back, once, in CHUNK-sized preads on the calling thread; the
# CRC-32 of each chunk runs on pitstop.shell.checksums' pool (the one saves use) while the next
# chunk is read, and the chunks' CRCs are joined (crc32_combine) into each blob's. Nothing is
# returned before every blob read has matched its CRC-32 (and, for a whole-file check, every
# padding byte is zero): a caller builds nothing live from a read that raised. Where the bytes
# go is the caller's choice, per blob:
#   * MAPPED (the default): read through a few bounce buffers only to be checked; they stay in
#     the page cache, so the tensors the caller then builds over a map of the file, and the
#     copy from them into live tensors, run at memory speed. No anonymous memory but the
#     bounce buffers (BOUNCE * CHUNK bytes).
#   * the CPU device: read straight into a new storage of private memory — for tensors that
#     are kept as they are (an optimizer's state), which then never fault or copy on write.
#     Its memory is advised for huge pages before it is first touched (pitstop.shell.hostmem).
#   * a CUDA device: read into pinned bounce buffers, each chunk's host-to-device copy (on a
#     side stream: pitstop.shell.devicecopy, whose rules it keeps) overlapping the read of the
#     next one, into a new device storage. Every copy is waited for before the pass returns or
#     raises. Not run on a GPU here: the development machine has none.
# How: a bounded FIFO of chunks whose CRC is in flight; a bounce buffer is reused only once
# its chunk's CRC (and copy to the device) is done; an error cancels the pool's queued work.
# Where no blob goes to a CUDA device and there is more than one core, the pass is parallel
# instead: as many threads as the checksum pool would have take the chunks in file order,
# each reading one into its place (or a bounce buffer of its own) and checksumming it itself,
# so faulting in new memory, copying and CRC-32 share the cores; the CRCs are compared, in
# blob order, once every chunk is in.

"""Read a checkpoint file's blobs once, checking each one's CRC-32 as it is read."""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import torch

from pitstop.core.manifest import HEADER_SIZE, Manifest
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.checksums import (
    Checksummer,
    CrcJob,
    crc32_combine,
    crc32_update,
    default_threads,
)
from pitstop.shell.devicecopy import Copy, CudaCopies, DeviceCopies
from pitstop.shell.hostmem import new_host_bytes

__all__ = ["BOUNCE", "CHUNK", "CPU", "blob_corrupt", "read_blobs"]

CHUNK: Final = 4 << 20
"""Bytes per read: one pread, one CRC job (and on CUDA one host-to-device copy) per chunk."""

BOUNCE: Final = 4
"""Bounce buffers (and chunks whose CRC may be in flight at once)."""

CPU: Final = torch.device("cpu")

device_copies: Callable[[torch.device], DeviceCopies] = CudaCopies
"""How a pass copies to a device that is not the CPU (a stand-in in tests)."""

Advance = Callable[[int], None]


def blob_corrupt(manifest: Manifest, index: int) -> CheckpointCorrupt:
    """The error for blob ``index`` of ``manifest`` failing its checksum."""
    blob = manifest.blobs[index]
    return CheckpointCorrupt(
        f"{manifest.path}: blob {index} (bytes {blob.offset}..{blob.stop}, holding "
        f"{manifest.blob_users(index)}) fails its checksum"
    )


@attrs.define
class _Slot:
    """One bounce buffer and what still uses it: a CRC job, a host-to-device copy."""

    buffer: torch.Tensor
    view: memoryview
    job: CrcJob | None = None
    copied: Copy | None = None  # the copy out of the buffer to a device

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


@attrs.define
class _Pending:
    """A chunk whose CRC is in flight."""

    blob: int
    job: CrcJob
    nbytes: int
    last: bool  # the blob's last chunk: its CRC can be compared once this one is in


class _Reader:
    """One pass over the blobs of one open file."""

    def __init__(
        self,
        fd: int,
        manifest: Manifest,
        pool: Checksummer,
        *,
        check: bool,
        advance: Advance | None,
    ) -> None:
        self.fd, self.manifest, self.pool = fd, manifest, pool
        self.check, self.advance = check, advance
        self.crcs: dict[int, int] = {}
        self.pending: collections.deque[_Pending] = collections.deque()
        self.slots: dict[torch.device | None, list[_Slot]] = {}  # None: host bounce buffers
        self.turn: dict[torch.device | None, int] = {}
        self.copies: dict[torch.device, DeviceCopies] = {}

    # -- bounce buffers ------------------------------------------------------------------------

    def slot(self, device: torch.device | None) -> _Slot:
        """The next bounce buffer for copies to ``device`` (``None``: only to be checked), free
        to be read into."""
        slots = self.slots.get(device)
        if slots is None:
            slots = self.slots[device] = []
            for _ in range(BOUNCE):
                buffer = (
                    torch.empty(CHUNK, dtype=torch.uint8)
                    if device is None
                    else self.copies_to(device).bounce(CHUNK)
                )
                slots.append(_Slot(buffer, _view(buffer)))
            self.turn[device] = 0
        slot = slots[self.turn[device] % BOUNCE]
        self.turn[device] += 1
        while slot.job is not None and any(p.job is slot.job for p in self.pending):
            self.settle_one()
        slot.wait()
        return slot

    # -- checksums -----------------------------------------------------------------------------

    def submit(self, blob: int, view: memoryview, last: bool) -> CrcJob | None:
        if not self.check:
            return None
        job = self.pool.start(view)
        self.pending.append(_Pending(blob, job, view.nbytes, last))
        while len(self.pending) > BOUNCE:
            self.settle_one()
        return job

    def settle_one(self) -> None:
        done = self.pending.popleft()
        crc = crc32_combine(self.crcs.get(done.blob, 0), done.job.result(), done.nbytes)
        self.crcs[done.blob] = crc
        if done.last and crc != self.manifest.blobs[done.blob].crc32:
            raise blob_corrupt(self.manifest, done.blob)

    def settle(self) -> None:
        while self.pending:
            self.settle_one()
        self.stop_copies()

    def stop_copies(self) -> None:
        """Wait for every host-to-device copy in flight — also when an error is on its way
        out: none may still write into device memory that is freed and handed out again."""
        for slots in self.slots.values():
            for slot in slots:
                slot.wait()
        for copies in self.copies.values():
            copies.drain()

    def copies_to(self, device: torch.device) -> DeviceCopies:
        copies = self.copies.get(device)
        if copies is None:
            copies = self.copies[device] = device_copies(device)
        return copies

    # -- reading -------------------------------------------------------------------------------

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from file ``offset``, or raise: the file ended early."""
        done = 0
        while done < view.nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointCorrupt(
                    f"{self.manifest.path}: the file ended early reading bytes "
                    f"{offset + done}..{offset + view.nbytes}"
                )
            done += got

    def check_padding(self, start: int, stop: int, before: int) -> None:
        """Check that bytes ``start..stop`` (the padding before blob ``before``) are zero."""
        if stop <= start:
            return
        view = memoryview(bytearray(stop - start))
        self.read_into(view, start)
        if any(view):
            where = start + next(i for i, b in enumerate(view) if b)
            raise CheckpointCorrupt(
                f"{self.manifest.path}: padding byte at offset {where} (before blob {before}) "
                f"is not zero"
            )
        self.progress(view.nbytes)

    def blob(self, index: int, device: torch.device | None) -> torch.UntypedStorage | None:
        """Read blob ``index``: to be mapped later (``None``), into memory, or to a device."""
        blob = self.manifest.blobs[index]
        if blob.length == 0:
            if self.check and blob.crc32 != 0:
                raise blob_corrupt(self.manifest, index)
            if device is None:
                return None
            if device.type == "cpu":
                return torch.empty(0, dtype=torch.uint8).untyped_storage()
            return self.copies_to(device).new_target(0).untyped_storage()
        if device is not None and device.type == "cpu":
            target = new_host_bytes(blob.length)
            whole = _view(target)
            for start in range(0, blob.length, CHUNK):
                view = whole[start : start + CHUNK]
                self.read_into(view, blob.offset + start)
                self.submit(index, view, start + view.nbytes == blob.length)
                self.progress(view.nbytes)
            return target.untyped_storage()
        copies = None if device is None else self.copies_to(device)
        on_device = None if copies is None else copies.new_target(blob.length)
        for start in range(0, blob.length, CHUNK):
            slot = self.slot(device)
            nbytes = min(CHUNK, blob.length - start)
            view = slot.view[:nbytes]
            self.read_into(view, blob.offset + start)
            slot.job = self.submit(index, view, start + nbytes == blob.length)
            if copies is not None and on_device is not None:
                slot.copied = copies.copy(on_device[start : start + nbytes], slot.buffer[:nbytes])
            self.progress(nbytes)
        return None if on_device is None else on_device.untyped_storage()

    def progress(self, nbytes: int) -> None:
        if self.advance is not None:
            self.advance(nbytes)


def _view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's own memory (kept alive by the
    caller): a ctypes array over it, as pitstop.shell.filewrite reads tensors."""
    return memoryview((ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr()))


def read_blobs(
    file: Any,
    manifest: Manifest,
    blobs: Sequence[int],
    *,
    places: Mapping[int, torch.device] | None = None,
    check: bool = True,
    padding: bool = False,
    advance: Advance | None = None,
    threads: int | None = None,
) -> dict[int, torch.UntypedStorage]:
    """Read blobs ``blobs`` of ``manifest``'s open ``file`` once, each checked as it is read.

    ``places`` maps a blob to the device its bytes are read onto (the CPU: private memory);
    a blob it does not name is only read to be checked, and left in the page cache for a map
    of the file. Returns the storages of the placed blobs. ``check=False`` skips the CRC-32s
    (only placed blobs are read then). ``padding``: also check that every byte between the
    header and the first blob and between blobs is zero — with every blob, that is every byte
    of the data region. ``advance(nbytes)`` hears of progress. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the first blob or byte that fails.
    """
    placed = places or {}
    order = sorted(set(blobs))
    if not check:
        order = [i for i in order if i in placed]
    storages: dict[int, torch.UntypedStorage] = {}
    if not order:
        return storages
    fd = file.fileno()
    first = manifest.blobs[order[0]].offset
    last = manifest.blobs[order[-1]].stop
    if hasattr(os, "posix_fadvise"):  # a longer readahead window for one sequential pass
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_SEQUENTIAL)
    count = default_threads() if threads is None else threads
    if check and count > 1 and all(d.type == "cpu" for d in placed.values()):
        return _read_in_parallel(fd, manifest, order, placed, count, padding, advance)
    with Checksummer(count if check else 0) as pool:
        reader = _Reader(fd, manifest, pool, check=check, advance=advance)
        cursor = HEADER_SIZE
        try:
            for index in order:
                blob = manifest.blobs[index]
                if padding:
                    reader.check_padding(cursor, blob.offset, index)
                storage = reader.blob(index, placed.get(index))
                if storage is not None:
                    storages[index] = storage
                cursor = blob.stop
            reader.settle()
        except BaseException:
            reader.stop_copies()  # before the device storages read so far are freed
            raise
    return storages


@attrs.frozen
class _Chunk:
    """One pread of the parallel pass: bytes ``start..start + nbytes`` of blob ``blob``."""

    blob: int
    start: int
    nbytes: int


def _read_in_parallel(
    fd: int,
    manifest: Manifest,
    order: Sequence[int],
    placed: Mapping[int, torch.device],
    count: int,
    padding: bool,
    advance: Advance | None,
) -> dict[int, torch.UntypedStorage]:
    """:func:`read_blobs` when every placed blob goes to the CPU: ``count`` threads (this
    one among them) take the chunks in file order, each reading one into its place (a new
    storage, or a bounce buffer of its own) and computing its CRC-32 itself, so faulting in
    new memory, copying and checksumming all run on every core; the CRCs are joined and
    compared, in blob order, once every chunk is in."""
    lock = threading.Lock()
    reader = _Reader(fd, manifest, Checksummer(0), check=True, advance=advance)  # padding
    targets: dict[int, memoryview] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    chunks: list[_Chunk] = []
    cursor = HEADER_SIZE
    for index in order:
        blob = manifest.blobs[index]
        if padding:
            reader.check_padding(cursor, blob.offset, index)
        cursor = blob.stop
        if index in placed:
            target = new_host_bytes(blob.length)
            storages[index], targets[index] = target.untyped_storage(), _view(target)
        chunks += [
            _Chunk(index, at, min(CHUNK, blob.length - at)) for at in range(0, blob.length, CHUNK)
        ]
    crcs = [0] * len(chunks)
    turns = iter(range(len(chunks)))  # next() on it is atomic under the GIL
    failed: list[BaseException] = []

    def work() -> None:
        bounce = torch.empty(CHUNK, dtype=torch.uint8)
        own = _view(bounce)
        try:
            for turn in turns:
                if failed:
                    return
                chunk = chunks[turn]
                place = targets.get(chunk.blob)
                view = (
                    own[: chunk.nbytes]
                    if place is None
                    else place[chunk.start : chunk.start + chunk.nbytes]
                )
                reader.read_into(view, manifest.blobs[chunk.blob].offset + chunk.start)
                crcs[turn] = crc32_update(view)
                if advance is not None:
                    with lock:
                        advance(chunk.nbytes)
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
    joined: dict[int, int] = {}
    for chunk, crc in zip(chunks, crcs, strict=True):
        joined[chunk.blob] = crc32_combine(joined.get(chunk.blob, 0), crc, chunk.nbytes)
    for index in order:
        if joined.get(index, 0) != manifest.blobs[index].crc32:
            raise blob_corrupt(manifest, index)
    return storages
