# CRC-32 of large buffers on several threads. The one-thread CRC is the fastest implementation
# installed: ISA-L's (the `isal` package, a dependency where it has wheels: 4-5x zlib 1.2's
# speed, with the CPU's carry-less multiply), else zlib's; both compute the same CRC-32 (the
# gzip polynomial) and release the GIL, so pieces of one buffer checksummed on different
# threads run in parallel; crc32_combine (zlib's algorithm:
# multiply crc(A) by x^(8·len(B)) modulo the CRC polynomial, then add crc(B)) joins the pieces'
# CRCs into the CRC of the whole, so the stored value is the plain CRC-32 of the blob — the file
# format does not change with the number of threads.

"""Parallel CRC-32: the checksums of checkpoint blobs, computed on a pool of helper threads."""

from __future__ import annotations

import functools
import os
import queue
import threading
import zlib
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "ENGINE",
    "PIECE",
    "Checksummer",
    "CrcJob",
    "crc32",
    "crc32_combine",
    "crc32_update",
    "default_threads",
]

PIECE: Final = 8 << 20
"""Bytes per unit of work: a buffer is checksummed in pieces of this size, in parallel."""


def _fastest() -> tuple[str, Callable[[Any, int], int]]:
    try:
        from isal import isal_zlib
    except ImportError:  # a platform without its wheel: the standard library's
        return "zlib", zlib.crc32
    return "isal", isal_zlib.crc32


_ENGINE, _crc32 = _fastest()
ENGINE: Final[str] = _ENGINE
"""The implementation :func:`crc32_update` uses here: ``"isal"`` (ISA-L) or ``"zlib"``."""


def crc32_update(data: Any, crc: int = 0) -> int:
    """The CRC-32 of ``data`` (a bytes-like object) continuing ``crc``, on the calling thread,
    with the fastest implementation installed (:data:`ENGINE`); zlib's result, always."""
    return _crc32(data, crc)


_POLY: Final = 0xEDB88320  # the CRC-32 polynomial, bit-reversed (as zlib uses it)
_X0: Final = 1 << 31  # the polynomial 1 (x^0) in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a(x)·b(x) modulo the CRC polynomial, reflected (zlib's multmodp)."""
    m = _X0
    product = 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> tuple[int, ...]:
    # x^(2^k) modulo the polynomial for k = 0..31.
    power = _X0 >> 1  # x^1
    table = [power]
    for _ in range(31):
        power = _multmodp(power, power)
        table.append(power)
    return tuple(table)


_X2N: Final = _powers()


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> int:
    """x^(8·length) modulo the polynomial: what appending ``length`` zero bytes multiplies by."""
    power = _X0
    k = 3  # 8 · length = length · 2^3
    while length:
        if length & 1:
            power = _multmodp(_X2N[k & 31], power)
        length >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``.

    The same result as zlib's ``crc32_combine``; ``length2`` may be 0.
    """
    if length2 < 0:
        raise ValueError(f"length2 must be >= 0, got {length2}")
    return _multmodp(_shift(length2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def default_threads() -> int:
    """Threads worth using for checksums here: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


class CrcJob:
    """The CRC-32 of one buffer, computed piece by piece; :meth:`result` waits for it."""

    def __init__(self, view: memoryview) -> None:
        self.pieces = [view[start : start + PIECE] for start in range(0, view.nbytes, PIECE)]
        self._crcs = [0] * len(self.pieces)
        self._left = len(self.pieces)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not self._left:
            self._done.set()

    def run_piece(self, index: int, *, skip: bool = False) -> None:
        """Checksum piece ``index`` (on whichever thread calls this); ``skip`` drops it."""
        try:
            if skip:
                raise RuntimeError("the checksum was cancelled")
            crc = crc32_update(self.pieces[index])
        except BaseException as exc:  # handed to result(); the thread goes on
            with self._lock:
                self._error = self._error or exc
        else:
            self._crcs[index] = crc
        with self._lock:
            self._left -= 1
            if not self._left:
                self._done.set()

    def result(self) -> int:
        """Wait until every piece is checksummed; return the CRC-32 of the whole buffer."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        crc = 0  # the CRC-32 of nothing
        for piece, piece_crc in zip(self.pieces, self._crcs, strict=True):
            crc = crc32_combine(crc, piece_crc, piece.nbytes)
        return crc


class Checksummer:
    """A pool of threads computing CRC-32s; use as a context manager.

    ``threads=0`` computes each CRC on the calling thread, inside :meth:`start`; so does a pool
    whose threads cannot be started (``RuntimeError`` from ``Thread.start``). Leaving the
    ``with`` block waits for the threads to end — pieces not yet started are dropped — so no
    thread reads a buffer after the block: the caller may free it. Plain threads rather than a
    ``concurrent.futures`` executor, which refuses work once the interpreter starts to exit
    (when a Checkpointer left open still publishes its last save).
    """

    def __init__(self, threads: int) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        self._work: queue.SimpleQueue[tuple[CrcJob, int] | None] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"pitstop-crc-{i}", daemon=True)
            for i in range(threads)
        ]
        started = 0
        try:
            for thread in self._threads:
                thread.start()
                started += 1
        except BaseException as exc:  # end the threads that did start
            for _ in range(started):
                self._work.put(None)
            for thread in self._threads[:started]:
                thread.join()
            self._threads = []
            if not isinstance(exc, RuntimeError):
                raise
            # No new threads now (Python >= 3.12 at interpreter exit, when a Checkpointer left
            # open publishes its last save; or none left): compute in line, like threads=0.

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            job, index = item
            job.run_piece(index, skip=self._cancelled.is_set())

    def start(self, view: memoryview) -> CrcJob:
        """Begin the CRC-32 of ``view``; the buffer must stay alive until the job's result."""
        job = CrcJob(view)
        if not self._threads:
            for index in range(len(job.pieces)):
                job.run_piece(index)
            return job
        for index in range(len(job.pieces)):
            self._work.put((job, index))
        return job

    def __enter__(self) -> Checksummer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._cancelled.set()
        for _ in self._threads:
            self._work.put(None)
        for thread in self._threads:
            thread.join()


def crc32(view: memoryview, threads: int | None = None) -> int:
    """The CRC-32 of ``view``, on up to ``threads`` threads (default: :func:`default_threads`)."""
    count = default_threads() if threads is None else threads
    if view.nbytes < 2 * PIECE or count <= 1:
        return crc32_update(view)
    with Checksummer(min(count, -(-view.nbytes // PIECE))) as pool:
        return pool.start(view).result()
