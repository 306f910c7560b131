# Snapshots for saving in the background: the state copied once into reused host buffers.
#
# Rules: a snapshot copies each storage the tree's tensors use — once, however many tensors
# share it — into a host staging buffer, and rebuilds the tree's containers around views of
# those buffers with the original offsets and strides. So the snapshot holds exactly what the
# live state held at the call (later in-place updates cannot leak into it), tied weights stay
# tied, and writing the snapshot yields the same file as writing the live state. Buffers are
# allocated once and reused across saves (pinned, when the state is on CUDA); a pool hands
# back a buffer of the exact size a storage needs, so an unchanged model reuses every buffer.
# Copies from CUDA are non-blocking on a side stream; `ready()` waits for them.
# How: one walk to find storages and their used byte ranges, one copy per storage, one walk
# to rebuild the tree.

"""Staging: copy a state tree into reusable host buffers, preserving storage sharing."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Final

import torch

from pitstop.shell.fileformat import ALIGNMENT

__all__ = ["StagingPool", "storage_keys"]

_StorageKey = tuple[str, int | None, int]


def _storage_key(tensor: torch.Tensor) -> _StorageKey:
    return (tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr())


def storage_keys(tensors: Any) -> frozenset[_StorageKey]:
    """The storages behind ``tensors`` (any iterable of tensors), for ``snapshot(defer=...)``."""
    return frozenset(_storage_key(t) for t in tensors if t.numel())


class StagingPool:
    """Host buffers for snapshots, reused across saves; one snapshot in use at a time."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = collections.defaultdict(list)
        self._lent: list[tuple[tuple[int, bool], torch.Tensor]] = []
        self._events: list[Any] = []
        self._after: dict[int | None, Any] = {}
        self.allocated_bytes = 0

    def _take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        key = (nbytes, pinned)
        free = self._free[key]
        buffer = free.pop() if free else None
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.allocated_bytes += nbytes
        self._lent.append((key, buffer))
        return buffer

    def release(self) -> None:
        """Return every buffer of the last snapshot to the pool (its writer is done)."""
        for key, buffer in self._lent:
            self._free[key].append(buffer)
        self._lent.clear()
        self._events.clear()

    def ready(self) -> None:
        """Wait until the last snapshot's device-to-host copies have landed."""
        for event in self._events:
            event.synchronize()

    def snapshot(
        self, tree: Any, *, defer: frozenset[_StorageKey] = frozenset()
    ) -> tuple[Any, Callable[[], None]]:
        """Copy ``tree``'s tensors into staging buffers; return the tree over those copies.

        Containers are rebuilt (dict, list, tuple, set, frozenset, OrderedDict); other leaves
        are kept as they are. Storages in ``defer`` (see :func:`storage_keys`) are not copied
        yet: the returned function copies them, and must run before the snapshot is read and
        before those storages change. Call :meth:`release` once the snapshot has been written.
        """
        if self._lent:
            raise RuntimeError("the previous snapshot is still in use; release() it first")
        self._after = {}  # device index -> the caller's stream position at this call
        ranges: dict[_StorageKey, list[int]] = {}
        sources: dict[_StorageKey, torch.Tensor] = {}

        def visit(tensor: torch.Tensor) -> None:
            if tensor.numel() == 0:
                return
            key = _storage_key(tensor)
            itemsize = tensor.element_size()
            first = int(tensor.storage_offset()) * itemsize
            last = first + itemsize * (
                1
                + sum(
                    (int(n) - 1) * int(s)
                    for n, s in zip(tensor.shape, tensor.stride(), strict=True)
                )
            )
            start = first & -ALIGNMENT  # keep the alignment the file format relies on
            span = ranges.get(key)
            ranges[key] = (
                [start, last] if span is None else [min(span[0], start), max(span[1], last)]
            )
            sources.setdefault(key, tensor)

        _walk(tree, visit)

        staged: dict[_StorageKey, tuple[torch.Tensor, int]] = {}
        copies_now: list[tuple[torch.Tensor, torch.Tensor]] = []
        copies_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, (start, stop) in ranges.items():
            source = sources[key]
            buffer = self._take(stop - start, pinned=source.device.type == "cuda")
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

        seen: dict[int, torch.Tensor] = {}

        def replace(original: torch.Tensor) -> torch.Tensor:
            known = seen.get(id(original))
            if known is not None:
                return known
            tensor = original.detach()
            if tensor.numel() == 0:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype)
            else:
                buffer, start = staged[_storage_key(tensor)]
                itemsize = tensor.element_size()
                offset = int(tensor.storage_offset()) - start // itemsize
                copy = torch.empty(0, dtype=tensor.dtype).set_(
                    buffer.untyped_storage(), offset, tensor.shape, tensor.stride()
                )
            if tensor.is_conj():
                copy = copy.conj()
            if tensor.is_neg():
                copy = torch._neg_view(copy)
            seen[id(original)] = copy
            return copy

        return _rebuild(tree, replace), lambda: self._copy(copies_later, guard=False)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, guard: bool = True) -> None:
        """Copy each source into its buffer; from CUDA, non-blocking on a side stream.

        ``guard``: make each device's current stream wait for the copies, so that work queued
        after this call (the next forward pass) cannot change a tensor before it is copied.
        Deferred copies run on the writer thread without it: the optimizer step pre-hook
        holds back the only work that changes them until they have landed.
        """
        streams: dict[int | None, Any] = {}
        for buffer, source in pairs:
            if source.device.type != "cuda":
                buffer.copy_(source)
                continue
            stream = streams.get(source.device.index)
            if stream is None:
                stream = torch.cuda.Stream(device=source.device)  # type: ignore[no-untyped-call]
                # After everything the caller queued before snapshot(), on whatever stream it
                # uses — also when this runs later, on the writer thread.
                stream.wait_event(self._after[source.device.index])
                streams[source.device.index] = stream
            with torch.cuda.stream(stream):
                buffer.copy_(source, non_blocking=True)
        for index, stream in streams.items():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            self._events.append(event)
            if guard:
                torch.cuda.current_stream(index).wait_stream(stream)


def _walk(tree: Any, visit: Callable[[torch.Tensor], None]) -> None:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            visit(node.detach())
        elif isinstance(node, dict):
            stack.extend(value for value in node.values() if type(value) not in _ATOMS)
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend(item for item in node if type(item) not in _ATOMS)


# Leaves with nothing to copy. Checked inline, since RNG states are long tuples of ints (the
# Python stream's is 625 of them) and snapshot() runs while the training loop waits.
_ATOMS: Final = frozenset({int, float, bool, str, bytes, type(None)})


def _rebuild(node: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    kind = type(node)
    if kind in _ATOMS:
        return node
    if isinstance(node, torch.Tensor):
        return replace(node)
    if isinstance(node, dict):
        items = [
            (key, value if type(value) in _ATOMS else _rebuild(value, replace))
            for key, value in node.items()
        ]
        return collections.OrderedDict(items) if kind is collections.OrderedDict else dict(items)
    if kind is list:
        return [item if type(item) in _ATOMS else _rebuild(item, replace) for item in node]
    if isinstance(node, torch.Size):
        return node
    if kind is tuple:
        return tuple(item if type(item) in _ATOMS else _rebuild(item, replace) for item in node)
    if kind is set:
        return {_rebuild(item, replace) for item in node}
    if kind is frozenset:
        return frozenset(_rebuild(item, replace) for item in node)
    return node
