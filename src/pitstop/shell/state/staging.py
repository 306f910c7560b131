# Snapshots for saving in the background: the state copied once into reused host buffers.
#
# Rules: a snapshot accepts and refuses exactly the trees a synchronous save does — it walks
# the tree with pitstop.shell.format.treewalk, so a value a checkpoint cannot hold is the same
# SaveError, naming the same key path, raised before a buffer is taken. It copies each storage
# the tree's tensors use — once, however many tensors share it — into a host staging buffer,
# and rebuilds the tree's containers (same types) around views of those buffers with the
# original offsets and strides. So the snapshot holds exactly what the live state held at the
# call (later in-place updates cannot leak into it), tied weights stay tied, and writing the
# snapshot yields the same file as writing the live state.
# Memory is bounded: a storage of n bytes takes a free buffer of at least n and at most
# n + slack(n) bytes (slack(n) = max(SLACK_MIN, n // SLACK_FRACTION)), else a new buffer of
# exactly n; every free buffer the snapshot does not take is dropped before any is allocated.
# So an unchanged model reuses every buffer, and after a snapshot the pool holds only that
# snapshot's buffers: at most the state's size plus slack(n) per storage, however the state
# grows or shrinks from save to save. Buffers are pinned when the state is on CUDA (a dropped
# one goes back to torch's caching host allocator). Copies from CUDA are non-blocking on a
# side stream; `ready()` waits for them.
# How: one walk (checks every value, rebuilds the containers with an empty placeholder tensor
# per tensor, and records the bytes each storage uses); buffers are matched or allocated; one
# copy per storage; each placeholder is then set to its view of its buffer.

"""Staging: copy a state tree into reusable host buffers, preserving storage sharing."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import Any, Final

import torch

from pitstop.core.file.manifest import ALIGNMENT
from pitstop.shell.format.treewalk import storage_of, walk

__all__ = ["SLACK_FRACTION", "SLACK_MIN", "StagingPool", "slack", "storage_keys"]

SLACK_MIN: Final = 4096
SLACK_FRACTION: Final = 8

_StorageKey = tuple[str, int | None, int]


def slack(nbytes: int) -> int:
    """How much larger than ``nbytes`` a reused buffer may be."""
    return max(SLACK_MIN, nbytes // SLACK_FRACTION)


def _storage_key(tensor: torch.Tensor) -> _StorageKey:
    return (tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr())


def storage_keys(tensors: Any) -> frozenset[_StorageKey]:
    """The storages behind ``tensors`` (any iterable of tensors), for ``snapshot(defer=...)``."""
    return frozenset(_storage_key(t) for t in tensors if t.numel())


def _placeholder(dtype: torch.dtype) -> torch.Tensor:
    # (a uint8 view for complex32, whose torch.empty warns that it is experimental)
    if dtype is torch.complex32:
        return torch.empty(0, dtype=torch.uint8).view(dtype)
    return torch.empty(0, dtype=dtype)


def _elements_spanned(tensor: torch.Tensor) -> int:
    """Elements from ``tensor``'s first to its last, inclusive (it has at least one)."""
    if tensor.is_contiguous():
        return tensor.numel()
    return 1 + sum(
        (int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True)
    )


class _Buffer:
    """One staging buffer: ``nbytes`` bytes of host memory, pinned or not."""

    __slots__ = ("nbytes", "pinned", "tensor")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.nbytes = nbytes
        self.pinned = pinned


def _match(free: list[_Buffer], needs: list[tuple[int, bool]]) -> list[_Buffer | None]:
    """For each ``(nbytes, pinned)`` need, a distinct free buffer that fits it, or None.

    A buffer fits a need of n bytes if it is as pinned and holds n to n + slack(n) bytes; an
    exact size is taken first (an unchanged state), else the smallest that fits.
    """
    exact: dict[tuple[int, bool], list[_Buffer]] = {}
    for buffer in free:
        exact.setdefault((buffer.nbytes, buffer.pinned), []).append(buffer)
    found: list[_Buffer | None] = [None] * len(needs)
    missed = []
    for index, need in enumerate(needs):
        same = exact.get(need)
        if same:
            found[index] = same.pop()
        else:
            missed.append(index)
    if missed:
        left = sorted((b for same in exact.values() for b in same), key=lambda b: b.nbytes)
        for pinned in (False, True):
            kind = [b for b in left if b.pinned is pinned]
            sizes = [b.nbytes for b in kind]
            for index in missed:
                nbytes, wanted = needs[index]
                if wanted is not pinned:
                    continue
                at = bisect.bisect_left(sizes, nbytes)
                if at < len(sizes) and sizes[at] <= nbytes + slack(nbytes):
                    del sizes[at]
                    found[index] = kind.pop(at)
    return found


class StagingPool:
    """Host buffers for snapshots, reused across saves; one snapshot in use at a time."""

    def __init__(self) -> None:
        self._free: list[_Buffer] = []  # the last snapshot's buffers, once released
        self._lent: list[_Buffer] = []  # the current snapshot's
        self._events: list[Any] = []
        self._after: dict[int | None, Any] = {}

    @property
    def allocated_bytes(self) -> int:
        """Bytes of staging buffers the pool holds now, lent or free."""
        return sum(b.nbytes for b in self._lent) + sum(b.nbytes for b in self._free)

    def release(self) -> None:
        """Return every buffer of the last snapshot to the pool (its writer is done)."""
        self._free.extend(self._lent)
        self._lent.clear()
        self._events.clear()

    def ready(self) -> None:
        """Wait until the last snapshot's device-to-host copies have landed."""
        for event in self._events:
            event.synchronize()

    def give_back(self) -> None:
        """The last snapshot will not be written (its save failed): once what was queued has
        landed, its buffers go back to the pool (an error waiting for them is not raised)."""
        with contextlib.suppress(Exception):
            self.ready()
        self.release()

    def _lend(self, needs: list[tuple[int, bool]]) -> list[torch.Tensor]:
        """A buffer for each ``(nbytes, pinned)`` need: reused where one fits, else new."""
        found = _match(self._free, needs)
        # What this snapshot does not take is dropped now, before anything is allocated.
        self._free = []
        self._lent = [b for b in found if b is not None]
        tensors = []
        for (nbytes, pinned), buffer in zip(needs, found, strict=True):
            if buffer is None:
                buffer = _Buffer(nbytes, pinned)
                self._lent.append(buffer)
            tensors.append(buffer.tensor if buffer.nbytes == nbytes else buffer.tensor[:nbytes])
        return tensors

    def snapshot(
        self, tree: Any, *, defer: frozenset[_StorageKey] = frozenset()
    ) -> tuple[Any, Callable[..., None]]:
        """Copy ``tree``'s tensors into staging buffers; return the tree over those copies.

        Containers are rebuilt with their exact types; other leaves are kept as they are.
        Raises :class:`~pitstop.errors.SaveError` naming the key path of a value a checkpoint
        cannot hold, as a synchronous save does, before any buffer is taken. Storages in
        ``defer`` (see :func:`storage_keys`) are not copied yet: the returned function,
        ``finish(guard=False)``, copies them, and must run before the snapshot is read and before
        those storages change (``guard``: later work on the calling thread's CUDA streams waits
        for the copies; call :meth:`ready` before reading them either way). Call
        :meth:`release` once the snapshot has been written.
        """
        if self._lent:
            raise RuntimeError("the previous snapshot is still in use; release() it first")
        ranges: dict[_StorageKey, list[int]] = {}  # storage -> [first, stop) byte range used
        sources: dict[_StorageKey, torch.Tensor] = {}
        views: list[tuple[torch.Tensor, torch.Tensor, _StorageKey]] = []  # placeholder, source

        def visit(tensor: torch.Tensor, path: str) -> torch.Tensor:
            key: _StorageKey | None = None
            # A placeholder, set to its view of its buffer once copied.
            copy = _placeholder(tensor.dtype)
            if tensor.numel() == 0:  # no bytes to copy; shape and strides as they were
                copy.set_(copy.untyped_storage(), 0, tensor.shape, tensor.stride())
            else:
                storage = storage_of(tensor, path)
                key = (
                    ("cpu", None, storage.data_ptr())
                    if tensor.is_cpu
                    else (tensor.device.type, tensor.device.index, storage.data_ptr())
                )
                itemsize = tensor.element_size()
                first = int(tensor.storage_offset()) * itemsize
                stop = first + itemsize * _elements_spanned(tensor)
                start = first & -ALIGNMENT  # keep the alignment the file format relies on
                span = ranges.get(key)
                if span is None:
                    ranges[key] = [start, stop]
                    sources[key] = tensor
                else:
                    span[0], span[1] = min(span[0], start), max(span[1], stop)
            if tensor.is_conj():
                copy = copy.conj()
            if tensor.is_neg():
                copy = torch._neg_view(copy)
            if key is not None:
                views.append((copy, tensor, key))
            return copy

        staged_tree = walk(tree, on_tensor=visit)  # SaveError here: nothing taken yet
        try:
            after = self._stage(ranges, sources, views, defer)
        except BaseException:
            self.ready()
            self.release()
            raise
        return staged_tree, after

    def _stage(
        self,
        ranges: dict[_StorageKey, list[int]],
        sources: dict[_StorageKey, torch.Tensor],
        views: list[tuple[torch.Tensor, torch.Tensor, _StorageKey]],
        defer: frozenset[_StorageKey],
    ) -> Callable[[], None]:
        """Take the buffers, copy (all but ``defer``) and point each placeholder at its copy."""
        self._after = {}  # device index -> the caller's stream position at this call
        keys = list(ranges)
        buffers = self._lend([(ranges[k][1] - ranges[k][0], sources[k].is_cuda) for k in keys])
        staged: dict[_StorageKey, tuple[torch.Tensor, int]] = {}
        copies_now: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, buffer in zip(keys, buffers, strict=True):
            source = sources[key]
            start, stop = ranges[key]
            raw = torch.empty(0, dtype=torch.uint8, device=source.device).set_(
                source.untyped_storage()
            )
            (copies_later if key in defer else copies_now).append((buffer, raw[start:stop]))
            staged[key] = (buffer, start)
            if source.device.type == "cuda" and source.device.index not in self._after:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(source.device))
                self._after[source.device.index] = event
        self._copy(copies_now)
        for copy, tensor, key in views:
            buffer, start = staged[key]
            offset = int(tensor.storage_offset()) - start // tensor.element_size()
            copy.set_(buffer.untyped_storage(), offset, tensor.shape, tensor.stride())

        def finish(guard: bool = False) -> None:
            self._copy(copies_later, guard=guard)

        return finish

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, guard: bool = True) -> None:
        """Copy each source into its buffer; from CUDA, non-blocking on a side stream.

        ``guard``: make each device's current stream wait for the copies, so that work queued
        after this call (the next forward pass) cannot change a tensor before it is copied.
        Without it (deferred copies, on the writer thread) this returns only once the copies
        have landed: the optimizer step pre-hook that holds back the only work that changes
        them waits for this call, not for the GPU. Copies queued before an error are waited
        for by :meth:`ready` as well.
        """
        streams: dict[int | None, Any] = {}
        try:
            for buffer, source in pairs:
                if source.device.type != "cuda":
                    buffer.copy_(source)
                    continue
                stream = streams.get(source.device.index)
                if stream is None:
                    stream = torch.cuda.Stream(device=source.device)  # type: ignore[no-untyped-call]
                    # After everything the caller queued before snapshot(), on whatever stream
                    # it uses — also when this runs later, on the writer thread.
                    stream.wait_event(self._after[source.device.index])
                    streams[source.device.index] = stream
                with torch.cuda.stream(stream):
                    buffer.copy_(source, non_blocking=True)
        finally:
            events = []
            for index, stream in streams.items():
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self._events.append(event)
                events.append(event)
                if guard:
                    torch.cuda.current_stream(index).wait_stream(stream)
        if not guard:
            for event in events:
                event.synchronize()
