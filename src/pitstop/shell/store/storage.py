# The file operations a checkpoint directory needs, behind a small protocol.
#
# Rules: every operation is one step that can fail on its own, so a fault-injecting fake can
# fail any step of a publish. Names are plain entry names inside the one directory — never
# paths — and LocalStorage refuses anything with a separator, so no operation can reach outside
# the directory. Temp files are created exclusively (O_EXCL) in the same directory, so a rename
# to the final name is atomic on a local filesystem. A reader opens a remote checkpoint as a
# local copy (fetch), in this process's read cache (reader_cache: made once, removed at exit).
# How: LocalStorage maps each step to one os call; nothing is cached.

"""Storage: the protocol for a checkpoint directory's file operations, and the local one."""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from pitstop.shell.format.untrusted import read_untrusted

__all__ = [
    "FileKind",
    "LocalStorage",
    "RemoteStorage",
    "Storage",
    "WriterLock",
    "fetch",
    "reader_cache",
]


class FileKind(enum.Enum):
    """What a directory entry is, without following symlinks."""

    REGULAR = "regular file"
    SYMLINK = "symlink"
    DIRECTORY = "directory"
    OTHER = "other"  # a fifo, socket, device
    MISSING = "missing"


@runtime_checkable
class Storage(Protocol):
    """The operations pitstop performs on a checkpoint directory."""

    def path(self, name: str) -> Path:
        """Return the full path of ``name`` (for messages, memory-mapping and readers)."""
        ...

    def names(self) -> list[str]:
        """Return the names of every entry in the directory."""
        ...

    def kind(self, name: str) -> FileKind:
        """Say what ``name`` is, without following symlinks."""
        ...

    def size(self, name: str) -> int:
        """Return the size in bytes of the regular file ``name``."""
        ...

    def create_exclusive(self, name: str) -> BinaryIO:
        """Create ``name`` for writing; fail if it exists."""
        ...

    def sync_file(self, file: BinaryIO) -> None:
        """Make ``file``'s data and size durable (fsync)."""
        ...

    def replace(self, source: str, target: str) -> None:
        """Atomically rename ``source`` to ``target``, replacing ``target`` if present."""
        ...

    def sync_directory(self) -> None:
        """Make the directory's entries (creations, renames, removals) durable."""
        ...

    def symlink(self, target: str, name: str) -> None:
        """Create the symlink ``name`` pointing to the relative ``target``."""
        ...

    def read_link(self, name: str) -> str:
        """Return the target of the symlink ``name``, as written."""
        ...

    def read_bytes(self, name: str, limit: int) -> bytes:
        """Return the contents of ``name``; raise ``ValueError`` if larger than ``limit``."""
        ...

    def remove(self, name: str) -> None:
        """Remove the entry ``name`` (a file or a symlink)."""
        ...


@runtime_checkable
class RemoteStorage(Storage, Protocol):
    """A Storage whose checkpoints are not local files (an object store): a listing reads each
    checkpoint's catalog fields from it, and a reader fetches a checkpoint to a local file."""

    def read_meta(self, name: str) -> Mapping[str, Any]:
        """The catalog fields of checkpoint ``name`` (as its manifest's meta holds them)."""
        ...

    def listed(self) -> contextlib.AbstractContextManager[list[str]]:
        """:meth:`names`, every entry they list read at once; within the block, on this
        thread, the reads of those entries answer from that (one request each per scan)."""
        ...

    def fetch(self, name: str) -> Path:
        """Read checkpoint ``name`` to where readers open it locally (memory, or a local
        file); its path. ``CheckpointCorrupt`` when a check it makes on the way fails."""
        ...

    def release(self) -> None:
        """Free what the last fetch holds (its reader is done)."""
        ...

    def close(self) -> None:
        """Free what it holds and remove the local files it made."""
        ...


def fetch(storage: Storage, name: str) -> Path:
    """A local file holding checkpoint ``name``: its own path, or a fetched copy."""
    return storage.fetch(name) if isinstance(storage, RemoteStorage) else storage.path(name)


_READER_CACHE: list[Path] = []


def reader_cache() -> Path:
    """The local directory this process fetches checkpoints to for reading (``load``,
    ``verify``, ``info``): made on first use, removed at exit (a loaded tensor maps its file)."""
    if not _READER_CACHE:
        path = Path(tempfile.mkdtemp(prefix="pitstop-s3-read-"))
        atexit.register(shutil.rmtree, path, True)
        _READER_CACHE.append(path)
    return _READER_CACHE[0]


class WriterLock(Protocol):
    """One writer per checkpoint directory: the local lock, or an object store's lease."""

    @property
    def held(self) -> bool:
        """Whether this writer holds it."""
        ...

    def acquire(self) -> None:
        """Take it, or raise :class:`~pitstop.errors.DirectoryLocked` naming the holder."""
        ...

    def release(self) -> None:
        """Give it back (idempotent)."""
        ...


class LocalStorage:
    """A directory on a local filesystem.

    ``mode``: the permissions new files are created with, less the umask (``0o644`` for a
    checkpoint directory's files; ``0o666`` makes them like any file the user creates).
    """

    def __init__(self, root: str | os.PathLike[str], *, mode: int = 0o644) -> None:
        self.root = Path(root)
        self.mode = mode

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, name: str) -> Path:
        """Return the full path of ``name``; ``name`` must be a plain entry name."""
        if not name or name in {".", ".."} or "/" in name or "\0" in name or os.sep in name:
            raise ValueError(f"not a plain entry name in {self.root}: {name!r}")
        return self.root / name

    def names(self) -> list[str]:
        """Return the names of every entry in the directory (none if it does not exist)."""
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def kind(self, name: str) -> FileKind:
        """Say what ``name`` is, without following symlinks."""
        try:
            mode = os.lstat(self.path(name)).st_mode
        except FileNotFoundError:
            return FileKind.MISSING
        if stat.S_ISREG(mode):
            return FileKind.REGULAR
        if stat.S_ISLNK(mode):
            return FileKind.SYMLINK
        if stat.S_ISDIR(mode):
            return FileKind.DIRECTORY
        return FileKind.OTHER

    def size(self, name: str) -> int:
        """Return the size in bytes of ``name`` (not following symlinks)."""
        return os.lstat(self.path(name)).st_size

    def create_exclusive(self, name: str) -> BinaryIO:
        """Create ``name`` (``mode`` less the umask) for unbuffered writing; fail if it exists."""
        self.root.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path(name), flags, self.mode)
        return os.fdopen(fd, "wb", buffering=0)

    def sync_file(self, file: BinaryIO) -> None:
        """fsync ``file``."""
        file.flush()
        os.fsync(file.fileno())

    def replace(self, source: str, target: str) -> None:
        """Atomically rename ``source`` over ``target``."""
        os.replace(self.path(source), self.path(target))

    def sync_directory(self) -> None:
        """fsync the directory itself."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def symlink(self, target: str, name: str) -> None:
        """Create the relative symlink ``name`` -> ``target``."""
        self.path(target)  # the target, too, must be a plain name in this directory
        os.symlink(target, self.path(name))

    def read_link(self, name: str) -> str:
        """Return the target of the symlink ``name``."""
        return os.readlink(self.path(name))

    def read_bytes(self, name: str, limit: int) -> bytes:
        """Read the regular file ``name`` (never a symlink, FIFO or device) of at most ``limit``
        bytes; anything else raises ``OSError`` or ``ValueError`` (larger), before it is read."""
        return read_untrusted(self.path(name), limit, follow_symlinks=False)

    def remove(self, name: str) -> None:
        """Remove ``name``."""
        os.unlink(self.path(name))
