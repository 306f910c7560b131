# Write-behind: the disk starts on a file's bytes while the rest of the file is still being
# written, so the fsync at the end waits for the tail, not for the whole file.
#
# Rules: a file being written tells this helper how far it has got; each time another
# KICK bytes are in, the range not handed over yet goes to the kernel's writeback with
# sync_file_range(SYNC_FILE_RANGE_WRITE) — start writing those dirty pages, do not wait for them.
# It promises nothing about durability: the fsync that follows the write still comes, and
# still decides. Bytes a caller still buffers are not in the kernel yet; a kick that covers
# them starts nothing for them, and a later kick or the fsync does. An I/O error (EIO, ENOSPC)
# is raised as OSError at once, naming the file, as the fsync would raise it; any other
# refusal (a file system or OS without it: EINVAL, ESPIPE, ENOSYS) turns the helper off for
# that file. Where the C library has no sync_file_range (not Linux), it does nothing.
# How: ctypes calls the C library's function (it releases the GIL while the kernel queues the
# pages); one WriteBehind per open file.

"""Write-behind: hand a file's written bytes to the kernel's writeback as they come."""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any, Final

__all__ = ["AVAILABLE", "KICK", "WriteBehind"]

KICK: Final = 2 << 20
"""Bytes written between two hand-overs to the kernel's writeback."""

_SYNC_FILE_RANGE_WRITE: Final = 2  # <fcntl.h>: start write-out of dirty pages, do not wait
_FAILS_THE_WRITE: Final = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def _sync_file_range() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):  # not Linux (Windows: no CDLL(None))
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE: Final = _sync_file_range()
AVAILABLE: Final[bool] = _SYNC_FILE_RANGE is not None
"""Whether this OS has ``sync_file_range`` (Linux); without it :class:`WriteBehind` is idle."""


class WriteBehind:
    """Hands the bytes of one file open for writing to the kernel's writeback as they come.

    ``fd``: the file's descriptor (``None``: nothing to hand over, every call is a no-op).
    ``name``: the file, for the message of an I/O error. ``every``: bytes between hand-overs.
    """

    def __init__(self, fd: int | None, name: object = "", *, every: int = KICK) -> None:
        self._fd = fd if AVAILABLE else None
        self._name = name
        self._every = every
        self._handed = 0  # bytes [0, _handed) are handed to the writeback already

    @classmethod
    def of(cls, file: object, *, every: int = KICK) -> WriteBehind:
        """One for ``file`` (anything with ``fileno()``; otherwise an idle one)."""
        try:
            fd = file.fileno()  # type: ignore[attr-defined]
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
            fd = None
        return cls(fd if isinstance(fd, int) else None, getattr(file, "name", ""), every=every)

    @property
    def active(self) -> bool:
        """Whether it still hands bytes over (an OS or file system without it: no)."""
        return self._fd is not None

    def wrote(self, end: int) -> None:
        """The file's bytes up to offset ``end`` are written: hand them over once another
        ``every`` bytes have come since the last time."""
        if self._fd is None or end - self._handed < self._every:
            return
        start, self._handed = self._handed, end
        if _SYNC_FILE_RANGE(self._fd, start, end - start, _SYNC_FILE_RANGE_WRITE) == 0:
            return
        code = ctypes.get_errno()
        if code in _FAILS_THE_WRITE:
            raise OSError(code, f"could not write {self._name}: {os.strerror(code)}")
        self._fd = None  # this file system (or OS) will not: the fsync does it all
