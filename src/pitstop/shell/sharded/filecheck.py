# A shard file's check (its size and CRC-32, against the manifest), on the calling thread or on
# a thread of its own started before the read is planned.
#
# Rules: a file is opened once (never through a link: open_untrusted) and read once, through one
# buffer, each piece checksummed as it arrives; the descriptor is kept open for the read that
# follows, so what is copied later is the file that was checked. The early check (Started) opens its
# files on the calling thread — a missing one is known at once — and reads them on its own thread
# while the caller plans the read (DCP's planning, the manifest's tree: CPU work, the disk busy
# meanwhile): a resume's disk read then starts as soon as the manifest is read
# (core.sharding.sharded.early_checks says which files). What it found about a file is asked for by
# name (waiting for it), and only for a file the read needs: a file the plan does not read is
# checked to no purpose, and its problem never reported; a file whose size has changed since its
# check (cut while the rank planned) is refused then. How far each file has been read is told as
# it goes (read_past waits for it), so the caller finds what lies in the pages read so far while
# the rest is read. Closing stops the thread at its next piece,
# waits for it, and closes the files; closing twice is harmless.
# How: functions over a directory and its layout; Started is a context manager whose exit is
# close(), so the caller's ExitStack that keeps the files open owns it.

"""Checking a sharded checkpoint's files (size, CRC-32), now or on a thread started early."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Final

from pitstop.core.sharding.sharded import ShardedLayout, ShardFile, file_problem
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.checksums import crc32_update
from pitstop.shell.format.untrusted import open_untrusted

__all__ = ["PIECE", "Started", "checked_file"]

PIECE: Final = 1 << 20
"""Bytes a file's check reads at a time, into one buffer."""

_LOOK_AGAIN_S: Final = 0.05
"""How often a wait for the check's progress looks again whether its thread has ended."""


def _opened(directory: Path, layout: ShardedLayout, name: str, files: ExitStack) -> int:
    """``name`` opened (kept open in ``files``): its descriptor; CheckpointCorrupt where the
    manifest lists no such file or it is missing."""
    try:
        expected = layout.file(name)
    except KeyError:
        raise CheckpointCorrupt(f"{directory}: the manifest lists no file {name}") from None
    try:
        file = files.enter_context(open_untrusted(directory / name, follow_symlinks=False))
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{directory}: {file_problem(expected, None, None)}") from None
    return file.fileno()


def _check(
    directory: Path,
    expected: ShardFile,
    fd: int,
    scratch: bytearray,
    stopped: threading.Event | None = None,
    read: Callable[[int], None] | None = None,
) -> None:
    """Check the open file ``fd`` against ``expected``, read once through ``scratch``;
    CheckpointCorrupt naming what is wrong (OSError where it cannot be read). ``stopped``:
    set when the caller no longer needs the answer (the read ends at the next piece);
    ``read(at)``: told after each piece how far the file has been read."""
    size, crc = os.fstat(fd).st_size, None
    if size == expected.size:
        crc, at, view = 0, 0, memoryview(scratch)
        while got := os.preadv(fd, [view], at):
            if stopped is not None and stopped.is_set():
                return
            crc = crc32_update(view[:got], crc)
            at += got
            if read is not None:
                read(at)
        size = at
    problem = file_problem(expected, size, crc)
    if problem is not None:
        raise CheckpointCorrupt(f"{directory}: {problem}")


def checked_file(
    directory: Path, layout: ShardedLayout, name: str, files: ExitStack, scratch: bytearray
) -> int:
    """Open ``name`` (kept open in ``files``) and check its size and CRC-32, read once
    through ``scratch``; its descriptor. CheckpointCorrupt naming what is wrong."""
    fd = _opened(directory, layout, name, files)
    _check(directory, layout.file(name), fd, scratch)
    return fd


class Started:
    """The check of ``names`` (files of ``layout`` in ``directory``), opened now and read on a
    thread of its own: :meth:`verified` waits for one file's and raises what it found."""

    def __init__(self, directory: Path, layout: ShardedLayout, names: Iterable[str]) -> None:
        self._directory, self._layout = directory, layout
        self._files = ExitStack()
        self._stopped = threading.Event()
        self._found: dict[str, BaseException | None] = {}
        self._read: dict[str, int] = {}  # how far each file has been read
        self._moved = threading.Condition()
        self._ended = False
        self.opened: dict[str, int] = {}
        """The descriptor of each file opened (kept open until :meth:`close`)."""
        self.names = tuple(names)
        """The files it checks."""
        for name in self.names:
            try:
                self.opened[name] = _opened(directory, layout, name, self._files)
            except (CheckpointCorrupt, OSError) as exc:
                self._found[name] = exc
        work = [(layout.file(n), fd) for n, fd in self.opened.items()]
        scratch = bytearray(PIECE)  # this thread's memory (a new thread's arena is new memory)
        self._thread = threading.Thread(
            target=self._run, args=(work, scratch), name="pitstop-filecheck", daemon=True
        )
        self._thread.start()

    def _run(self, work: list[tuple[ShardFile, int]], scratch: bytearray) -> None:
        try:
            for expected, fd in work:
                if self._stopped.is_set():
                    return
                told = partial(self._moving, expected.name)
                try:
                    _check(self._directory, expected, fd, scratch, self._stopped, told)
                except (CheckpointCorrupt, OSError) as exc:
                    self._found[expected.name] = exc
                else:
                    if not self._stopped.is_set():  # read to its end
                        self._found[expected.name] = None
                self._moving(expected.name, expected.size)
        finally:
            self._moving("", 0)  # ended: nobody waits for more

    def _moving(self, name: str, at: int) -> None:
        with self._moved:
            if name:
                self._read[name] = at
            else:
                self._ended = True
            self._moved.notify_all()

    def read_past(self, name: str, end: int) -> None:
        """Wait until the check of ``name`` (one of :attr:`names`) has read its first ``end``
        bytes — they are in the page cache then — or has ended (checked, failed or
        stopped), whichever is first; :meth:`verified` says how it ended."""
        with self._moved:
            while self._read.get(name, 0) < end and not self._ended:
                self._moved.wait(_LOOK_AGAIN_S)

    def verified(self, name: str) -> None:
        """Wait for the check of ``name`` (one of :attr:`names`); raise what it found wrong —
        or that the file has another size now than when it was checked."""
        self._thread.join()
        if name not in self._found:
            raise ValueError(f"{self._directory}: {name} was not checked (closed first?)")
        found = self._found[name]
        if found is not None:
            raise found
        expected = self._layout.file(name)  # still the file checked (cut since: refused)
        problem = file_problem(expected, os.fstat(self.opened[name]).st_size, expected.crc32)
        if problem is not None:
            raise CheckpointCorrupt(f"{self._directory}: {problem}")

    def close(self) -> None:
        """Stop the check, wait for its thread, close the files (a second call does nothing)."""
        self._stopped.set()
        self._thread.join()
        self._files.close()

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
