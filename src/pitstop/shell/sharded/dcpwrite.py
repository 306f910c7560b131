# The files a DCP save writes, checksummed as DCP closes them: each one's size is counted from
# the bytes DCP hands the stream, and its CRC-32 is taken from the file's own pages while its
# fsync runs, so the file table needs no re-read after the save.
#
# Rules: DCP (torch.distributed.checkpoint.filesystem) opens each file it writes with
# `fs.create_stream(path, "wb")` — its data files one thread at a time each (a file is never
# shared between threads), its `.metadata` as `.metadata.tmp`, then `fs.rename`s that — and
# writes it front to back through `write` (tensors by torch.save, whose zip writer refuses
# out-of-order writes; byte values and the metadata directly), asking `tell()` for offsets, never
# seeking. A file is noted only when all of that held: every byte went through `write`, whole;
# nothing else was called that could move or write the file (a seek, or any call this stream
# does not know, leaves it unnoted); on close its position and size equal the bytes counted; it
# was flushed and fsynced. On a clean close the fsync runs on a helper thread while this one
# computes the CRC-32 of the file's pages (a read-only map of what the page cache holds, which
# is what the fsync writes), so the checksum costs no time beside the disk's; while DCP writes,
# every few MiB go to the kernel's writeback (pitstop.shell.format.writebehind), so that fsync waits
# only for the file's tail. A file left
# unnoted is closed unsynced, and fsynced and re-read by the file table instead. The streams
# flush before they fsync (DCP's own fsync of `.metadata` comes before its buffer is flushed),
# which is why the writer turns DCP's sync_files off — one fsync per file, not two. Names
# become durable with the manifest's directory fsync (pitstop.shell.store.sharddir). The notes are
# shared by DCP's writer threads and read from the thread that builds the table: a lock guards
# them. The first error a write raised (ENOSPC on a full disk) is kept, naming its file, and the
# writer raises it in place of torch.save's own ("unexpected pos ...", which hides it).
# How: a FileSystem subclass whose write streams wrap the real file.

"""DCP's file system for pitstop's writer: write streams that note each file's size and CRC."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, BinaryIO, cast

from torch.distributed.checkpoint.filesystem import FileSystem

from pitstop.shell.format.checksums import crc32
from pitstop.shell.format.writebehind import WriteBehind

__all__ = ["CrcFileSystem", "Note"]


Note = tuple[int, int]
"""A file's ``(size, crc32)``."""


class _CrcStream:
    """A file opened for writing, passing each write on and counting its bytes.

    ``size`` holds only while :attr:`tracked`: any call that could move the file's position or
    write past this stream (a seek, ``writelines``, anything unknown) clears it. :meth:`close`
    flushes and checks the file, fsyncs it while it computes its CRC-32 (``crc``), then hands
    ``done`` its note (``None``: the file cannot be vouched for, and is left to the file table
    to fsync and re-read).
    """

    def __init__(
        self,
        file: BinaryIO,
        done: Callable[[Note | None], None],
        failed: Callable[[OSError], None],
    ) -> None:
        self._file, self._done, self._failed = file, done, failed
        self.size = self.crc = 0
        self.tracked = True
        self._behind = WriteBehind.of(file)  # the disk starts while DCP writes on

    def write(self, data: Any) -> int:
        """Write ``data`` (any contiguous buffer) to the file; its bytes are counted."""
        try:
            view = memoryview(data)
            written = self._file.write(view)
        except BaseException as exc:  # some of it may be in the file: no longer vouched for
            self.tracked = False
            if isinstance(exc, OSError):  # torch's zip writer hides it: kept for the writer
                self._failed(exc)
            raise
        if written != view.nbytes:  # a partial write: the bytes on disk are not those seen
            self.tracked = False
        else:
            self.size += written
            self._behind.wrote(self.size)
        return written

    def tell(self) -> int:
        """The file's position (DCP's offsets)."""
        return self._file.tell()

    def flush(self) -> None:
        """Flush the file's buffer to the OS."""
        self._file.flush()

    def fileno(self) -> int:
        """The file's descriptor, its buffer flushed first (so an fsync on it covers all)."""
        self._file.flush()
        return self._file.fileno()

    def writable(self) -> bool:
        """Always: the stream is for writing."""
        return True

    @property
    def closed(self) -> bool:
        """Whether the file is closed."""
        return self._file.closed

    def close(self) -> None:
        """Flush and check the file, fsync it while its CRC-32 is computed, close it, and hand
        ``done`` its note (once); a file that cannot be noted is closed unsynced (the file
        table fsyncs it)."""
        if self._file.closed:
            return
        with self._file:
            self._file.flush()
            position, fd = self._file.tell(), self._file.fileno()
            on_disk = os.fstat(fd).st_size
            clean = self.tracked and position == self.size == on_disk
            if clean:
                self.crc = _crc_while_syncing(fd, on_disk)
            # Else no fsync here: the file table fsyncs an unnoted file as it reads it back.
        self._done((self.size, self.crc) if clean else None)

    def abandon(self) -> None:
        """Close the file after a failed write: no fsync, no note."""
        self._file.close()

    def __enter__(self) -> _CrcStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Anything else (seek, truncate, writelines, ...) goes to the file, untracked from then on.
        if name == "_file":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        self.tracked = False
        return getattr(self._file, name)


def _crc_while_syncing(fd: int, size: int) -> int:
    """fsync ``fd`` on a helper thread while this one computes the CRC-32 of its ``size``
    bytes from the page cache (a read-only map: no copy); the CRC, once both are done."""
    failed: list[BaseException] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except BaseException as exc:  # raised below, on the calling thread
            failed.append(exc)

    helper = threading.Thread(target=sync, name="pitstop-fsync")
    try:
        helper.start()
    except RuntimeError:  # no new threads now (at interpreter exit): one after the other
        sync()
    try:
        crc = 0
        if size:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    crc = crc32(view)
                finally:
                    view.release()
    finally:
        if helper.ident is not None:
            helper.join()
    if failed:
        raise failed[0]
    return crc


class CrcFileSystem(FileSystem):
    """DCP's local file system, whose write streams note each file's size and CRC-32.

    A write stream closed (by DCP, as it closes its data files, or on leaving its block
    cleanly) is flushed, fsynced and, when it passed every check, noted; :meth:`written`
    gives the notes. A block left by an error closes the file unnoted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._notes: dict[Path, Note] = {}
        self.failure: OSError | None = None
        """The first error a write to a file raised (ENOSPC on a full disk), naming the file:
        torch.save's zip writer replaces it with its own ("unexpected pos ...")."""

    def _fail(self, path: Path, exc: OSError) -> None:
        with self._lock:
            if self.failure is None:
                number = exc.errno if exc.errno is not None else 0
                self.failure = OSError(number, exc.strerror or str(exc), os.fspath(path))

    def _note(self, path: Path, note: Note | None) -> None:
        with self._lock:
            if note is None:
                self._notes.pop(path, None)
            else:
                self._notes[path] = note

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        """A stream on ``path``; for ``"wb"``, one that checksums what is written to it."""
        if mode != "wb":
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        target = Path(path)
        self._note(target, None)
        # read too: its CRC-32 is taken from a map of it when it is closed
        stream = _CrcStream(
            target.open("w+b"),
            lambda note: self._note(target, note),
            lambda exc: self._fail(target, exc),
        )
        try:
            yield cast(io.IOBase, stream)
        except BaseException:
            stream.abandon()
            raise
        stream.close()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename ``path``; its note goes with it (DCP's ``.metadata.tmp``)."""
        super().rename(path, new_path)
        with self._lock:
            note = self._notes.pop(Path(path), None)
        self._note(Path(new_path), note)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` and its note."""
        super().rm_file(path)
        self._note(Path(path), None)

    def written(self, directory: Path) -> dict[str, Note]:
        """``{name: (size, crc32)}`` of the noted files directly in ``directory``."""
        with self._lock:
            return {p.name: note for p, note in self._notes.items() if p.parent == directory}
