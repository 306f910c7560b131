# Opening the files of a checkpoint directory, every one of which is untrusted input.
#
# Rules: every reader of a file pitstop did not just write itself — a checkpoint, latest.json,
# the lock holder's record, a file a pointer names — opens it here, and only here. What is
# opened must be a regular file: a FIFO would block the open or the read forever, a device
# (/dev/zero, /dev/urandom) never ends, a directory is no file; each is refused before it is
# read, with an error naming the path and what it is. Where a caller gives a size limit, a
# larger file is refused from its size alone, before one byte is read, so a 2 GiB sparse
# latest.json costs nothing; and a file that grows while it is read is cut at limit + 1 bytes,
# which is refused too.
# Inside a checkpoint directory only the pointers may be symlinks (pitstop.core.naming's
# entry_components is that rule): a checkpoint file, a sharded checkpoint directory and every
# file in one are opened without following a link, whatever the caller asks, so a link out of
# the run is refused here, for every reader at once.
# How: stat first (lstat when symlinks are not followed), so a device is never even opened;
# then open with O_NONBLOCK (an open of a FIFO swapped in since the stat returns at once) and
# O_NOFOLLOW where asked, and fstat the descriptor, the only check that cannot race. A file in
# a sharded checkpoint directory is opened relative to a descriptor of that directory, itself
# opened with O_NOFOLLOW, so the directory cannot be swapped for a link in between either.
# A file held in memory (hold: an anonymous memory file, such as a checkpoint downloaded from
# object storage) is opened under the path it was held at, by reopening its descriptor: every
# reader works on it unchanged, and nothing of it is on a disk or left behind by a killed
# process. vouch() records that every byte of one was checked as it arrived (checked() asks).
# Its writer may also leave a private, copy-on-write map of it whose pages it mapped as they
# were written (premap): the first load takes it (take_map) and copies from it without a page
# fault; later loads map the file afresh, so what one load's tensors change no other sees.
# A checkpoint may instead be held as its manifest and its blobs' bytes, every one checked as it
# arrived (hold_blobs: the buffers of an object store's responses, no file at all): the format's
# reader answers read_manifest from it, and its first load takes the buffers (take_blobs) and
# builds its tensors over them; nothing else opens it.
# Memory is freed on one thread of the process (free_later), never by the caller's.

"""open_untrusted and read_untrusted: the one way pitstop opens a file it reads."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pitstop.core.file.manifest import Manifest
from pitstop.core.naming import entry_components

__all__ = [
    "FileTooLarge",
    "NotRegularFile",
    "checked",
    "describe_mode",
    "free_later",
    "held",
    "held_manifest",
    "hold",
    "hold_blobs",
    "open_untrusted",
    "premap",
    "read_untrusted",
    "release",
    "take_blobs",
    "take_map",
    "vouch",
]

_CHUNK = 1 << 20
_LINK_RULE = "inside a checkpoint directory only the pointers last, best and final may be links"


_HELD: dict[str, tuple[int, bool]] = {}  # path -> (descriptor of a memory file, checked)
_MAPS: dict[str, mmap.mmap] = {}  # path -> a private map of the memory file held there
_BLOBS: dict[str, tuple[Manifest, dict[int, memoryview] | None]] = {}  # path -> held blobs
_HELD_LOCK = threading.Lock()


def hold(path: str | os.PathLike[str], fd: int) -> None:
    """Hold the open memory file ``fd`` (its ownership too) under ``path``: what opening
    ``path`` opens from now on, until :func:`release`. Not checked yet."""
    with _HELD_LOCK:
        old = _HELD.pop(os.fspath(path), None)
        _MAPS.pop(os.fspath(path), None)
        _HELD[os.fspath(path)] = (fd, False)
    if old is not None:
        os.close(old[0])


def hold_blobs(
    path: str | os.PathLike[str], manifest: Manifest, blobs: dict[int, memoryview]
) -> None:
    """Hold the checkpoint ``path`` as its ``manifest`` and its ``blobs``' bytes (by index, every
    one checked): what :func:`held_manifest` and the first :func:`take_blobs` answer, until
    :func:`release`."""
    with _HELD_LOCK:
        _BLOBS[os.fspath(path)] = (manifest, blobs)


def held_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of the checkpoint held as blobs at ``path`` (``None``: none is)."""
    with _HELD_LOCK:
        found = _BLOBS.get(os.fspath(path))
    return None if found is None else found[0]


def take_blobs(path: str | os.PathLike[str]) -> dict[int, memoryview] | None:
    """The blobs of the checkpoint held at ``path``, once: a later call raises ``OSError``
    (its first load's tensors own them); ``None``: no checkpoint is held there as blobs."""
    with _HELD_LOCK:
        found = _BLOBS.get(os.fspath(path))
        if found is None:
            return None
        _BLOBS[os.fspath(path)] = (found[0], None)
    if found[1] is None:
        raise OSError(errno.EBUSY, f"{path} was loaded once from memory; fetch it again to reload")
    return found[1]


def vouch(path: str | os.PathLike[str]) -> None:
    """Record that every byte of the memory file held at ``path`` was checked."""
    with _HELD_LOCK:
        fd, _ = _HELD[os.fspath(path)]
        _HELD[os.fspath(path)] = (fd, True)


def premap(path: str | os.PathLike[str], mapping: mmap.mmap) -> None:
    """Keep ``mapping`` (private, copy-on-write: ``mmap.ACCESS_COPY``'s flags) of the memory
    file held at ``path`` for the first load of it (:func:`take_map`)."""
    with _HELD_LOCK:
        _MAPS[os.fspath(path)] = mapping


def take_map(path: str | os.PathLike[str]) -> mmap.mmap | None:
    """The map :func:`premap` left for the memory file held at ``path``, once (``None``:
    none, or taken)."""
    with _HELD_LOCK:
        return _MAPS.pop(os.fspath(path), None)


def held(path: str | os.PathLike[str]) -> bool:
    """Whether a memory file, or a checkpoint's blobs, are held at ``path``."""
    with _HELD_LOCK:
        return os.fspath(path) in _HELD or os.fspath(path) in _BLOBS


def checked(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a memory file every byte of which was checked (:func:`vouch`), or
    a checkpoint's checked blobs."""
    with _HELD_LOCK:
        return _HELD.get(os.fspath(path), (0, False))[1] or os.fspath(path) in _BLOBS


def release(path: str | os.PathLike[str]) -> None:
    """Close the memory file held at ``path``, or drop the blobs held there, if any (tensors
    over them keep theirs). The free (about 0.1 s for 512 MiB) runs on a thread of its own."""
    with _HELD_LOCK:
        found = _HELD.pop(os.fspath(path), None)
        _MAPS.pop(os.fspath(path), None)  # unmapped once no tensor over it is left
        blobs = _BLOBS.pop(os.fspath(path), None)  # freed once no tensor over them is left
    if blobs is not None and blobs[1] is not None:
        free_later(blobs[1].clear)
    if found is not None:
        free_later(lambda: os.close(found[0]))


_FREEING: list[tuple[int, concurrent.futures.ThreadPoolExecutor]] = []  # (pid, its thread)


def free_later(action: Callable[[], object]) -> None:
    """Run ``action`` (a free of memory: a close, a drop of the last reference to a map) on
    this process's one freeing thread, without waiting for it (no thread is started per call:
    a start waits for the thread to run, milliseconds on a busy machine)."""
    with _HELD_LOCK:
        if not _FREEING or _FREEING[0][0] != os.getpid():  # (a forked child makes its own)
            _FREEING[:] = [(os.getpid(), concurrent.futures.ThreadPoolExecutor(1, "pitstop-free"))]
        freeing = _FREEING[0][1]
    freeing.submit(action)


def _open_held(path: Path) -> int | None:
    """A new descriptor of the memory file held at ``path`` (its own offset), or ``None``."""
    with _HELD_LOCK:
        found = _HELD.get(os.fspath(path))
        if found is None:
            return None
        return os.open(f"/proc/self/fd/{found[0]}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


class NotRegularFile(OSError):
    """A path that must name a regular file names a FIFO, a device, a directory, a socket or
    a symlink (where symlinks are not followed)."""


class FileTooLarge(ValueError):
    """A file is larger than its reader accepts."""


def describe_mode(mode: int) -> str:
    """Say what kind of file ``mode`` (an ``st_mode``) is: ``"a FIFO"``, ``"a directory"``..."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _check(path: Path, st: os.stat_result, limit: int | None) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise NotRegularFile(errno.ELOOP, f"{path} is a symlink; it is not followed ({_LINK_RULE})")
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(
            errno.EINVAL,
            f"{path} is {describe_mode(st.st_mode)}, not a regular file; it is not read",
        )
    if limit is not None and st.st_size > limit:
        raise FileTooLarge(
            f"{path} is {st.st_size} bytes, larger than the {limit} bytes it may hold; "
            "it is not read"
        )


def open_untrusted(
    path: str | os.PathLike[str], *, limit: int | None = None, follow_symlinks: bool = True
) -> BinaryIO:
    """Open ``path`` for reading (buffered), if it is a regular file of at most ``limit`` bytes.

    ``follow_symlinks=False``: a symlink is refused rather than followed. A checkpoint file, or
    a file in a sharded checkpoint directory, is never reached through a link (that directory
    included), whatever ``follow_symlinks`` says. Raises :class:`NotRegularFile` (an
    ``OSError``) for anything but a regular file, :class:`FileTooLarge` (a ``ValueError``) for
    a file over ``limit``, and ``OSError`` for what the open itself reports; never blocks.
    """
    target = Path(path)
    fd = _open_held(target)
    if fd is not None:
        return _checked_open(target, fd, limit)
    entries = entry_components(target.parts)
    follow = follow_symlinks and entries == 0
    folder = _entry_folder(target) if entries == 2 else None
    name: str | Path = target.name if folder is not None else target
    try:
        _check(target, os.stat(name, dir_fd=folder, follow_symlinks=follow), limit)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        if not follow:
            flags |= getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(name, flags, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP and not follow:
                raise NotRegularFile(
                    errno.ELOOP, f"{target} is a symlink; it is not followed ({_LINK_RULE})"
                ) from None
            raise
    finally:
        if folder is not None:
            os.close(folder)
    return _checked_open(target, fd, limit)


def _checked_open(target: Path, fd: int, limit: int | None) -> BinaryIO:
    """``fd`` as a file, if what it opened is a regular file of at most ``limit`` bytes."""
    try:
        _check(target, os.fstat(fd), limit)  # what was opened, whatever the path names now
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _entry_folder(target: Path) -> int:
    """A descriptor of the sharded checkpoint directory holding ``target``, opened without
    following a link (one is refused, naming it)."""
    folder = target.parent
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(folder, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(folder):
            raise NotRegularFile(
                errno.ELOOP, f"{folder} is a symlink; it is not followed ({_LINK_RULE})"
            ) from None
        raise


def read_untrusted(
    path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = False
) -> bytes:
    """Return the contents of the regular file ``path``, at most ``limit`` bytes of them.

    Refused as :func:`open_untrusted` refuses; a file that grows past ``limit`` while it is
    read raises :class:`FileTooLarge` after reading ``limit + 1`` bytes at most. Symlinks are
    not followed unless asked.
    """
    with open_untrusted(path, limit=limit, follow_symlinks=follow_symlinks) as file:
        parts: list[bytes] = []
        left = limit + 1
        while left > 0:
            part = file.read(min(left, _CHUNK))
            if not part:
                break
            parts.append(part)
            left -= len(part)
    data = b"".join(parts)
    if len(data) > limit:
        raise FileTooLarge(f"{path} grew past the {limit} bytes it may hold while it was read")
    return data
