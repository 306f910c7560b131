# An open checkpoint file, read blob by blob into memory that already exists.
#
# Rules: a range is read whole or the read raises — a file that ends first is a
# CheckpointCorrupt naming the file and the bytes it lacks; padding between blobs must be zero.
# A caller that keeps the memory it read a blob into (a placed blob: an optimizer's state) may
# have the file's copy of those bytes leave the page cache behind the read (drop): it is not
# held twice, and the kernel reuses those pages for the next reads instead of finding new
# ones. Each chunk goes as soon as it is read, and the whole blob once it is all read (a large
# folio that two chunks share goes only then: the kernel drops a folio whole or not at all,
# and only whole pages inside the range). So a page that a neighbouring blob shares stays,
# and what a caller maps later is what it checked. The drop is a hint: a kernel or a
# filesystem that cannot drop the pages keeps them.
# Where the caller keeps a blob's bytes and nobody needs them cached, it may read them past
# the page cache instead (open_direct, read_direct: O_DIRECT, into page-aligned memory of
# its own; pitstop.shell.format.hostmem.new_aligned_bytes): no page is cached and dropped, no copy
# out of the cache. That descriptor is the same file, opened again through /proc/self/fd
# (never by name, which another writer may have replaced) and checked to be the same inode;
# where the OS or the filesystem refuses, or a read is refused part-way (an alignment the
# device wants bigger), the bytes are read through the page cache instead.
# PieceCheck checks a file that arrives in pieces, in any order (a download's ranged GETs):
# each piece's blob CRC-32s and padding on the thread that got it, joined per blob in order;
# blob_views then gives each blob's bytes from the pieces kept (a view of the one holding it,
# or, for a blob in several, joined: a copy).
# How: os.preadv into a memoryview over a tensor's own memory (a ctypes array over its data
# pointer); posix_fadvise(POSIX_FADV_DONTNEED) where the OS has it.

"""An open checkpoint file's blobs: whole reads, padding checks, dropping from the cache;
blobs checked from pieces as they arrive."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Final

from pitstop.core.file.manifest import Manifest
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.checksums import crc32_combine, crc32_update

if TYPE_CHECKING:
    import torch

__all__ = [
    "Advance",
    "BlobFile",
    "PieceCheck",
    "blob_corrupt",
    "blob_views",
    "byte_view",
    "drop_cached",
]

Advance = Callable[[int], None]

_DONTNEED: Final = getattr(os, "POSIX_FADV_DONTNEED", None)  # not on every OS


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's own memory (kept alive by the
    caller): a ctypes array over it, as pitstop.shell.format.filewrite reads tensors."""
    return memoryview((ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr()))


def drop_cached(fd: int, offset: int, nbytes: int) -> None:
    """Let the whole pages of bytes ``offset..offset + nbytes`` of ``fd`` leave the page cache
    (a hint: where the OS cannot, they stay)."""
    if _DONTNEED is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, nbytes, _DONTNEED)


def blob_corrupt(manifest: Manifest, index: int) -> CheckpointCorrupt:
    """The error for blob ``index`` of ``manifest`` failing its checksum."""
    blob = manifest.blobs[index]
    return CheckpointCorrupt(
        f"{manifest.path}: blob {index} (bytes {blob.offset}..{blob.stop}, holding "
        f"{manifest.blob_users(index)}) fails its checksum"
    )


class BlobFile:
    """The open file ``fd`` whose manifest is ``manifest``, read by one pass: ``drop`` — the
    bytes of placed blobs leave the page cache behind the read; ``advance(nbytes)`` hears of
    every byte read."""

    def __init__(
        self, fd: int, manifest: Manifest, *, advance: Advance | None, drop: bool = False
    ) -> None:
        self.fd, self.manifest, self.advance, self.drop = fd, manifest, advance, drop

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

    def open_direct(self) -> int | None:
        """The same file opened again to be read past the page cache (``O_DIRECT``), or
        ``None`` where that cannot be done here; the caller closes it."""
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return None
        try:
            direct = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | flag | os.O_CLOEXEC)
        except OSError:  # no /proc, or a filesystem without O_DIRECT (tmpfs)
            return None
        try:
            same, mine = os.fstat(direct), os.fstat(self.fd)
            if (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino):
                return direct
        except OSError:
            pass
        os.close(direct)
        return None

    @contextlib.contextmanager
    def past_the_cache(self) -> Iterator[int | None]:
        """Where this pass drops placed blobs behind it: the file opened again to be read past
        the page cache (:meth:`open_direct`), closed at the end; else ``None``."""
        direct = self.open_direct() if self.drop else None
        try:
            yield direct
        finally:
            if direct is not None:
                os.close(direct)

    def read_direct(self, direct: int, view: memoryview, offset: int, need: int) -> None:
        """Fill at least the first ``need`` bytes of ``view`` (page-aligned memory, ``offset``
        page-aligned) from file ``offset`` through ``direct``; what that read cannot give is
        read through the page cache, and a file that ends first raises."""
        done = 0
        with contextlib.suppress(OSError):  # refused (EINVAL: alignment): the cache's way
            while done < need:
                got = os.preadv(direct, [view[done:]], offset + done)
                if got <= 0:
                    break
                done += got
        if done < need:
            self.read_into(view[done:need], offset + done)

    def read_placed(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` (a placed blob's own memory) from file ``offset``; when dropping
        behind, those bytes then leave the page cache."""
        self.read_into(view, offset)
        if self.drop:
            drop_cached(self.fd, offset, view.nbytes)

    def dropped(self, index: int) -> None:
        """Placed blob ``index`` is read whole: when dropping behind, all of it leaves the
        page cache (the folios two of its chunks share included)."""
        if self.drop:
            blob = self.manifest.blobs[index]
            drop_cached(self.fd, blob.offset, blob.length)

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

    def progress(self, nbytes: int) -> None:
        """Tell ``advance`` of ``nbytes`` more read."""
        if self.advance is not None:
            self.advance(nbytes)


class PieceCheck:
    """The CRC-32s of a manifest's blobs, joined from pieces of the file checked as they
    arrive, in any order (a download's ranges): :meth:`piece` on any thread, :meth:`note` and
    :meth:`finish` on one."""

    def __init__(self, manifest: Manifest, url: str) -> None:
        self.manifest, self.url = manifest, url
        self.order = sorted(range(len(manifest.blobs)), key=lambda i: manifest.blobs[i].offset)
        self.starts = [manifest.blobs[i].offset for i in self.order]
        self.pieces: dict[int, dict[int, tuple[int, int]]] = {}  # blob -> at -> (crc, length)
        self.left = {i: b.length for i, b in enumerate(manifest.blobs)}

    def piece(self, view: memoryview, at: int) -> list[tuple[int, int, int, int]]:
        """``(blob, offset, crc, length)`` of each blob's piece in ``view`` (the bytes at file
        offset ``at``); every padding byte in it checked (on the calling thread)."""
        stop, found = at + view.nbytes, []
        cursor = at
        first = max(0, bisect.bisect_right(self.starts, at) - 1)
        for index in self.order[first:]:
            blob = self.manifest.blobs[index]
            if blob.offset >= stop:
                break
            if blob.stop <= at or blob.length == 0:
                continue
            lo, hi = max(blob.offset, at), min(blob.stop, stop)
            self.padding(view, at, cursor, lo, index)
            found.append((index, lo, crc32_update(view[lo - at : hi - at]), hi - lo))
            cursor = max(cursor, hi)
        self.padding(view, at, cursor, stop, None)
        return found

    def padding(self, view: memoryview, at: int, start: int, stop: int, before: int | None) -> None:
        """Bytes ``start..stop`` (file offsets, inside ``view`` at ``at``) must be zero."""
        if stop <= start:
            return
        raw = view[start - at : stop - at].tobytes()
        rest = raw.lstrip(b"\0")
        if rest:
            where = stop - len(rest)
            blob = f"before blob {before}" if before is not None else "after the last blob"
            raise CheckpointCorrupt(
                f"{self.url}: padding byte at offset {where} ({blob}) is not zero"
            )

    def note(self, found: list[tuple[int, int, int, int]]) -> None:
        """Take in a range's pieces; a blob whose bytes are all in is compared at once."""
        for index, at, crc, length in found:
            self.pieces.setdefault(index, {})[at] = (crc, length)
            self.left[index] -= length
            if self.left[index] == 0:
                self.compare(index)

    def compare(self, index: int) -> None:
        """Blob ``index``'s CRC-32, joined from its pieces in order, against the manifest's."""
        crc = 0
        for at in sorted(self.pieces.get(index, {})):
            piece, length = self.pieces[index][at]
            crc = crc32_combine(crc, piece, length)
        self.pieces.pop(index, None)
        if crc != self.manifest.blobs[index].crc32:
            raise CheckpointCorrupt(f"{self.url}: {blob_corrupt(self.manifest, index)}")

    def finish(self) -> None:
        """Every blob was compared (an empty one: its CRC-32 must be that of no bytes)."""
        for index, left in self.left.items():
            if left == 0 and self.manifest.blobs[index].length == 0:
                self.compare(index)
            elif left:
                raise CheckpointCorrupt(f"{self.url}: blob {index} was not read whole")


def blob_views(manifest: Manifest, got: Mapping[int, memoryview]) -> dict[int, memoryview]:
    """Each blob's bytes, by index, from the views ``got`` (by offset) of the data region:
    a view of the one that holds it, or joined from the pieces of several (a copy)."""
    starts = sorted(got)
    found: dict[int, memoryview] = {}
    for index, blob in enumerate(manifest.blobs):
        at = starts[max(0, bisect.bisect_right(starts, blob.offset) - 1)] if starts else 0
        if blob.length == 0:
            found[index] = memoryview(b"")
        elif blob.stop <= at + got[at].nbytes:
            found[index] = got[at][blob.offset - at : blob.stop - at]
        else:
            found[index] = _joined(got, at, blob.offset, blob.stop)
    return found


def _joined(got: Mapping[int, memoryview], at: int, start: int, stop: int) -> memoryview:
    """Bytes ``start..stop`` copied from the views ``got`` (by offset), from the one at ``at``."""
    joined, cursor = bytearray(stop - start), start
    while cursor < stop:
        piece = got[at][cursor - at : stop - at]
        joined[cursor - start : cursor - start + piece.nbytes] = piece
        cursor = at = cursor + piece.nbytes
    return memoryview(joined)
