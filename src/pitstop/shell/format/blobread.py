# Reading a checkpoint's data region once, every blob checksummed as it is read.
#
# Rules: the file is read front to back, once, in CHUNK-sized preads on the calling thread; the
# CRC-32 of each chunk runs on pitstop.shell.format.checksums' pool (the one saves use) while the
# next chunk is read, and the chunks' CRCs are joined (crc32_combine) into each blob's. Nothing is
# returned before every blob read has matched its CRC-32 (and, for a whole-file check, every padding
# byte is zero): a caller builds nothing live from a read that raised. Where the bytes go is the
# caller's choice, per blob:
#   * MAPPED (the default): read through a few bounce buffers only to be checked; they stay in
#     the page cache, so the tensors the caller then builds over a map of the file, and the
#     copy from them into live tensors, run at memory speed. No anonymous memory but the
#     bounce buffers (BOUNCE * CHUNK bytes).
#   * the CPU device: read straight into a new storage of private memory — for tensors that
#     are kept as they are (an optimizer's state), which then never fault or copy on write.
#     Its memory is advised for huge pages before it is first touched
#     (pitstop.shell.format.hostmem).
#   * a CUDA device: read into pinned bounce buffers, each chunk's host-to-device copy (on a
#     side stream: DeviceCopies, below) overlapping the read of the next one, into a new device
#     storage. Every copy is waited for before the pass returns or raises
#     (tests/shell/test_cuda.py runs it on a GPU). The copies' rules: memory a copy writes
#     into is allocated on the device's current stream, and the side stream waits for that
#     stream after every allocation (the caching allocator hands out memory freed there at
#     once, while kernels queued there may still use it); a bounce buffer is read into again
#     only once the copy out of it is done; drain() waits for every copy queued, before the
#     pass returns and before an error leaves it, so no copy writes into device memory freed
#     and handed out again. tests/shell/test_blobread_device.py runs the pass against a
#     stand-in that carries out each copy only once it is waited for.
# How: a bounded FIFO of chunks whose CRC is in flight; a bounce buffer is reused only once
# its chunk's CRC (and copy to the device) is done; an error cancels the pool's queued work.
# Where no blob goes to a CUDA device and there is more than one core, the pass is parallel
# instead (pitstop.shell.format.parallelread). drop_placed (the caller's choice: the core's
# drop_behind): what is read into a placed blob's own memory leaves the page cache behind the
# read (pitstop.shell.format.blobfile).

"""Read a checkpoint file's blobs once, checking each one's CRC-32 as it is read."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from pitstop.core.file.manifest import HEADER_SIZE, Manifest
from pitstop.shell.format.blobfile import Advance, BlobFile, blob_corrupt, byte_view
from pitstop.shell.format.checksums import Checksummer, CrcJob, crc32_combine, default_threads
from pitstop.shell.format.hostmem import new_host_bytes, scratch_bytes
from pitstop.shell.format.parallelread import read_in_parallel

if TYPE_CHECKING:
    import torch

__all__ = ["BOUNCE", "CHUNK", "Copy", "CudaCopies", "DeviceCopies", "blob_corrupt", "read_blobs"]

CHUNK: Final = 4 << 20
"""Bytes per read: one pread, one CRC job (and on CUDA one host-to-device copy) per chunk."""

BOUNCE: Final = 4
"""Bounce buffers (and chunks whose CRC may be in flight at once)."""

# --- copies to a device ------------------------------------------------------------------------


class Copy(Protocol):
    """One copy in flight."""

    def synchronize(self) -> None:
        """Return once the copy is done."""


class DeviceCopies(Protocol):
    """What reading onto one device needs: bounce buffers, device memory, ordered copies."""

    def bounce(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8) that copies to the device can start from."""

    def new_target(self, nbytes: int) -> torch.Tensor:
        """New device memory of ``nbytes`` (uint8) that the copies may write into."""

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Copy:
        """Queue ``target.copy_(source)``; the returned Copy is done once it has landed."""

    def drain(self) -> None:
        """Return once every copy queued is done."""


class CudaCopies:
    """:class:`DeviceCopies` for one CUDA device: pinned buffers, one side stream."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self._stream: Any = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def bounce(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_target(self, nbytes: int) -> torch.Tensor:
        import torch

        target = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return target

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Copy:
        import torch

        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
            done: Copy = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)  # type: ignore[attr-defined]
        return done

    def drain(self) -> None:
        self._stream.synchronize()


device_copies: Callable[[torch.device], DeviceCopies] = CudaCopies
"""How a pass copies to a device that is not the CPU (a stand-in in tests)."""


@attrs.define
class _Slot:
    """One bounce buffer and what still uses it: a CRC job, a host-to-device copy.

    ``buffer``: the tensor a copy to a device starts from (``None``: only read to be checked).
    """

    buffer: torch.Tensor | None
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


class _Reader(BlobFile):
    """One pass over the blobs of one open file, the CRCs on ``pool``."""

    def __init__(
        self,
        fd: int,
        manifest: Manifest,
        pool: Checksummer,
        *,
        check: bool,
        advance: Advance | None,
        drop: bool = False,
    ) -> None:
        super().__init__(fd, manifest, advance=advance, drop=drop)
        self.pool, self.check = pool, check
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
                if device is None:  # only to be checked: no tensor, no torch
                    slots.append(_Slot(None, scratch_bytes(CHUNK)))
                else:
                    buffer = self.copies_to(device).bounce(CHUNK)
                    slots.append(_Slot(buffer, byte_view(buffer)))
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

    def blob(self, index: int, device: torch.device | None) -> torch.UntypedStorage | None:
        """Read blob ``index``: to be mapped later (``None``), into memory, or to a device."""
        blob = self.manifest.blobs[index]
        if blob.length == 0:
            if self.check and blob.crc32 != 0:
                raise blob_corrupt(self.manifest, index)
            if device is None:
                return None
            if device.type == "cpu":
                import torch

                return torch.empty(0, dtype=torch.uint8).untyped_storage()
            return self.copies_to(device).new_target(0).untyped_storage()
        if device is not None and device.type == "cpu":
            target = new_host_bytes(blob.length)
            whole = byte_view(target)
            for start in range(0, blob.length, CHUNK):
                view = whole[start : start + CHUNK]
                self.read_placed(view, blob.offset + start)
                self.submit(index, view, start + view.nbytes == blob.length)
                self.progress(view.nbytes)
            self.dropped(index)
            return target.untyped_storage()
        copies = None if device is None else self.copies_to(device)
        on_device = None if copies is None else copies.new_target(blob.length)
        for start in range(0, blob.length, CHUNK):
            slot = self.slot(device)
            nbytes = min(CHUNK, blob.length - start)
            view = slot.view[:nbytes]
            if device is None:
                self.read_into(view, blob.offset + start)
            else:
                self.read_placed(view, blob.offset + start)
            slot.job = self.submit(index, view, start + nbytes == blob.length)
            if copies is not None and on_device is not None:
                assert slot.buffer is not None  # a device's bounce buffer is a tensor
                slot.copied = copies.copy(on_device[start : start + nbytes], slot.buffer[:nbytes])
            self.progress(nbytes)
        if on_device is None:
            return None
        self.dropped(index)
        return on_device.untyped_storage()


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
    drop_placed: bool = False,
) -> dict[int, torch.UntypedStorage]:
    """Read blobs ``blobs`` of ``manifest``'s open ``file`` once, each checked as it is read.

    ``places`` maps a blob to the device its bytes are read onto (the CPU: private memory);
    a blob it does not name is only read to be checked, and left in the page cache for a map
    of the file. Returns the storages of the placed blobs. ``check=False`` skips the CRC-32s
    (only placed blobs are read then). ``padding``: also check that every byte between the
    header and the first blob and between blobs is zero — with every blob, that is every byte
    of the data region. ``advance(nbytes)`` hears of progress. ``drop_placed``: each chunk
    of a placed blob leaves the page cache once it is read (for a file no other process reads
    after this one). Raises
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
        whole = BlobFile(fd, manifest, advance=advance, drop=drop_placed)
        return read_in_parallel(whole, order, placed, count=count, chunk=CHUNK, padding=padding)
    with Checksummer(count if check else 0) as pool:
        reader = _Reader(fd, manifest, pool, check=check, advance=advance, drop=drop_placed)
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
