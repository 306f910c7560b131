# New host memory for the bytes a resume reads: tensors that stay as they are (an optimizer's
# moments) and that the read is the first to touch.
#
# Rules: the memory is torch's own (torch.empty), so the tensor behaves as any other. Where
# the kernel offers transparent huge pages (Linux, THP in "madvise" or "always" mode), the
# storage's whole pages are advised for them (madvise(MADV_HUGEPAGE)) before anything touches
# them: filling it then faults 2 MiB at a time instead of 4 KiB (512 MiB of new memory took
# 0.20 to 0.26 s instead of 0.39 to 0.44 s to fill by pread from the page cache on the
# development VM), and the optimizer's steps later touch it through fewer TLB entries. Where
# the kernel refuses (THP off, another OS), nothing changes.
# new_aligned_bytes is the same memory for a read that bypasses the page cache (O_DIRECT),
# which needs its buffer at the file offset's place within a page: a private anonymous map of
# whole pages, the tensor's bytes starting `skew` bytes into it (torch keeps the map alive for
# as long as the tensor lives).
# scratch_bytes is memory a read fills only to check it (a bounce buffer): an anonymous map, no
# tensor, so checking a file never needs torch.
# How: ctypes' madvise over the page-aligned interior of the storage, from 2 MiB on.

"""New CPU tensors for checkpoint bytes, advised for transparent huge pages; scratch buffers."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = [
    "HUGE_PAGE",
    "PAGE",
    "advise",
    "new_aligned_bytes",
    "new_host_bytes",
    "reused_scratch",
    "scratch_bytes",
]

HUGE_PAGE: Final = 2 << 20
"""A transparent huge page on x86-64 and most arm64 kernels: smaller tensors are not advised."""

_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_PAGE: Final = mmap.PAGESIZE
PAGE: Final = _PAGE
"""This machine's page size: what a read that bypasses the page cache aligns to."""


def _madvise() -> Callable[[int, int, int], int] | None:
    if _MADV_HUGEPAGE is None or not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        call = ctypes.CDLL(None, use_errno=True).madvise
        call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        call.restype = ctypes.c_int
        return call
    return None


_ADVISE: Final = _madvise()


def advise(mapping: mmap.mmap, start: int, length: int, advice: int) -> bool:
    """madvise(2) ``length`` bytes of the writable ``mapping`` from ``start`` (page-aligned)
    with ``advice``, the GIL released meanwhile (CPython's mmap.madvise holds it: 1-1.5 ms per
    8 MiB populated, which stalls every other thread); False where refused or not Linux."""
    if _ADVISE is None or start < 0 or start + length > len(mapping):
        return False
    anchor = ctypes.c_char.from_buffer(mapping)  # its address; the export ends with the call
    try:
        return bool(_ADVISE(ctypes.addressof(anchor) + start, length, advice) == 0)
    finally:
        del anchor


def new_host_bytes(length: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``length`` bytes, not yet touched; from :data:`HUGE_PAGE`
    on, its whole pages advised for transparent huge pages where the kernel offers them (a
    refusal changes nothing), so that filling it faults 2 MiB at a time."""
    import torch

    target = torch.empty(length, dtype=torch.uint8)
    if _ADVISE is not None and _MADV_HUGEPAGE is not None and length >= HUGE_PAGE:
        start = -(-target.data_ptr() // _PAGE) * _PAGE
        stop = (target.data_ptr() + length) // _PAGE * _PAGE
        _ADVISE(start, stop - start, _MADV_HUGEPAGE)
    return target


def new_aligned_bytes(length: int, skew: int) -> tuple[torch.Tensor, memoryview]:
    """A new uint8 CPU tensor of ``length`` bytes whose first byte lies ``skew`` bytes into a
    page, and a view of the whole pages that hold it (starting ``skew`` bytes before it) — for
    a read that bypasses the page cache, into the same pages; advised for transparent huge
    pages from :data:`HUGE_PAGE` on, as :func:`new_host_bytes` is."""
    if not 0 <= skew < _PAGE:
        raise ValueError(f"skew must be within a page (0..{_PAGE - 1}), got {skew}")
    span = -(-(skew + length) // _PAGE) * _PAGE
    region = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _MADV_HUGEPAGE is not None and length >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # a kernel without THP keeps 4 KiB pages
            region.madvise(_MADV_HUGEPAGE)
    import torch

    tensor = torch.frombuffer(region, dtype=torch.uint8, count=length, offset=skew)
    return tensor, memoryview(region)


_SPARE: list[mmap.mmap] = []
"""Scratch maps given back (at most _SPARE_MAX): reused, so a read pass's bounce buffers are
memory already faulted in, as the heap's reused memory is."""
_SPARE_MAX: Final = 8
_SPARE_LOCK = threading.Lock()


def scratch_bytes(length: int) -> memoryview:
    """A new writable buffer of ``length`` bytes, not yet touched, that no tensor is built
    over: a bounce buffer bytes are read into only to be checked (a private anonymous map,
    freed with its last view; no torch needed)."""
    region = mmap.mmap(-1, max(length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(region)[:length]


@contextlib.contextmanager
def reused_scratch(length: int) -> Iterator[memoryview]:
    """A writable buffer of ``length`` bytes that no tensor is built over, for the block: a
    bounce buffer bytes are read into only to be checked (a private anonymous map, reused
    across passes; no torch needed)."""
    with _SPARE_LOCK:
        region = next((r for r in _SPARE if len(r) >= length), None)
        if region is not None:
            _SPARE.remove(region)
    if region is None:
        region = mmap.mmap(-1, max(length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        yield memoryview(region)[:length]
    finally:
        with _SPARE_LOCK:
            if len(_SPARE) < _SPARE_MAX:
                _SPARE.append(region)
