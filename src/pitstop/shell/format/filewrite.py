# Writing one checkpoint file: the tree checked and laid out, then streamed to an open file.
#
# Rules: the bytes are those pitstop.core.file.framing, pitstop.core.file.manifest and
# docs/file-format.md describe; where tensor bytes go is decided by pitstop.core.file.layout, and
# this module only carries the layout out. Nothing is written until the whole tree has been checked
# (pitstop.shell.format.treewalk decides what it may hold; SaveError names the key path) and the
# manifest is known to fit a reader's limit. CRC-32 checksums are computed from the tensors' memory,
# never by reading the file back: for CPU tensors on several threads once the data is written, while
# the file's fsync runs (pitstop.shell.format.checksums); for tensors off the CPU beside each host
# copy. Every few MiB written go to the kernel's writeback at once
# (pitstop.shell.format.writebehind), so the disk works while the rest is written and the fsync
# waits only for the tail.
# How: prepare() walks the tree (encoding it) and plans the layout; write() streams header,
# spans, manifest and footer to an open file. Temp names, the final fsync and the rename are
# the caller's (pitstop.shell.store.publish).

"""Write one pitstop checkpoint file: prepare a tree, then stream it to an open file."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, Final

import attrs
import msgpack

from pitstop.core.file.layout import Span, TensorExtent, layout_tensors
from pitstop.core.file.manifest import (
    ALIGNMENT,
    FORMAT_VERSION,
    HEADER_SIZE,
    MANIFEST_KEYS,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_NODES,
    OLDEST_VERSION,
    Blob,
    TensorDescriptor,
    blob_table,
    descriptor_table,
    pack_footer,
    pack_header,
)
from pitstop.errors import SaveError
from pitstop.shell.format import progress
from pitstop.shell.format.checksums import Checksummer, crc32_combine, crc32_update, default_threads
from pitstop.shell.format.treecodec import count_values, dtype_name, encode_tree
from pitstop.shell.format.treewalk import storage_of
from pitstop.shell.format.writebehind import WriteBehind

if TYPE_CHECKING:
    import torch

__all__ = ["Prepared", "prepare", "write"]

# Bytes go out in chunks of _CHUNK. Files with at least _PARALLEL_MIN bytes of data are
# checksummed on a pool of threads (pitstop.shell.format.checksums); smaller ones inline. Tensors
# off the CPU are copied to host memory _DEVICE_CHUNK bytes at a time.
_CHUNK: Final = 2 << 20
_PARALLEL_MIN: Final = 4 << 20
_DEVICE_CHUNK: Final = 64 << 20


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """A tree checked and laid out, ready for :func:`write`.

    It holds references to the tree's tensors, not copies: :func:`write` reads their memory,
    so they must not change in between.
    """

    tree: bytes  # the msgpack encoding of the tree; tensors are indices into `tensors`
    tensors: tuple[TensorDescriptor, ...]
    paths: tuple[str, ...]  # the key path of each tensor (its first occurrence)
    spans: tuple[Span, ...]  # the storage spans, in file order: blob i is spans[i]
    sources: tuple[torch.Tensor, ...] = attrs.field(repr=False)  # a tensor over each span
    data_end: int  # file offset where the manifest starts
    version: int = OLDEST_VERSION  # the format version the tree needs (2: NumPy values)

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (without padding) the file will hold."""
        return sum(span.length for span in self.spans)


# --- prepare ----------------------------------------------------------------------------------


def prepare(tree: object) -> Prepared:
    """Check ``tree``, collect its tensors and lay them out.

    Touches no file. Raises :class:`~pitstop.errors.SaveError` naming the key path of any value
    that cannot be stored (an unsupported type, an int outside int64/uint64, a sparse or
    quantized tensor, ...), and on a big-endian host.
    """
    if sys.byteorder != "little":
        raise SaveError(
            f"this host is {sys.byteorder}-endian; pitstop writes little-endian tensor bytes "
            f"and refuses to write on a big-endian host"
        )
    collector = _Collector()
    numpy_seen = [False]
    encoded = encode_tree(tree, on_tensor=collector.add, numpy_seen=numpy_seen)
    layout = layout_tensors(collector.extents, alignment=ALIGNMENT, base=HEADER_SIZE)
    blob_of = {span.storage: i for i, span in enumerate(layout.spans)}
    sources: dict[int, torch.Tensor] = {}  # blob -> a tensor over its storage
    descriptors = []
    for tensor, extent, first in zip(
        collector.tensors, collector.extents, collector.firsts, strict=True
    ):
        blob = blob_of[extent.storage]
        sources.setdefault(blob, tensor)
        offset = first - layout.spans[blob].start
        descriptors.append(
            TensorDescriptor(
                blob=blob,
                offset=offset,
                dtype=dtype_name(tensor.dtype),
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                storage_offset=offset // tensor.element_size(),
            )
        )
    return Prepared(
        tree=encoded,
        tensors=tuple(descriptors),
        paths=tuple(collector.paths),
        spans=layout.spans,
        sources=tuple(sources[blob] for blob in range(len(layout.spans))),
        data_end=layout.end,
        version=FORMAT_VERSION if numpy_seen[0] else OLDEST_VERSION,
    )


class _Collector:
    """Collects the tree's tensors (the walk hands over each object once) and their bytes."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []  # detached, conj/neg resolved
        self.paths: list[str] = []
        self.extents: list[TensorExtent] = []
        self.firsts: list[int] = []  # byte offset of each tensor's first element in its storage

    def add(self, tensor: torch.Tensor, path: str) -> int:
        index = len(self.tensors)
        stored = tensor.detach()
        if stored.is_conj():
            stored = stored.resolve_conj()
        if stored.is_neg():
            stored = stored.resolve_neg()
        extent, first = _extent(stored, index, path)
        self.tensors.append(stored)
        self.paths.append(path)
        self.extents.append(extent)
        self.firsts.append(first)
        return index


def _extent(tensor: torch.Tensor, index: int, path: str) -> tuple[TensorExtent, int]:
    """Return the extent of ``tensor`` in its storage, and its first element's byte offset."""
    storage = storage_of(tensor, path)
    if tensor.numel() == 0 or storage.nbytes() == 0:
        # No bytes: its own zero-length blob (data_ptr may be 0 for every empty tensor).
        return TensorExtent(storage=("empty", index), start=0, stop=0), 0
    itemsize = tensor.element_size()
    first = int(tensor.storage_offset()) * itemsize
    last = int(tensor.storage_offset()) + (
        tensor.numel() - 1
        if tensor.is_contiguous()
        else sum(
            (int(dim) - 1) * int(step)
            for dim, step in zip(tensor.shape, tensor.stride(), strict=True)
        )
    )
    identity = (tensor.device.type, tensor.device.index, storage.data_ptr())
    # The span starts on a multiple of ALIGNMENT within the storage, so every tensor keeps its
    # alignment relative to the storage when it is memory-mapped back.
    return TensorExtent(
        storage=identity, start=first & -ALIGNMENT, stop=(last + 1) * itemsize
    ), first


# --- write ------------------------------------------------------------------------------------


def write(
    file: BinaryIO,
    prepared: Prepared,
    meta: Mapping[str, object],
    *,
    sync: Callable[[], None] | None = None,
) -> int:
    """Write a complete checkpoint file for ``prepared`` to ``file``; return the bytes written.

    ``file`` is an open binary file positioned at its start; the caller owns temp names, the
    final fsync and rename. ``meta`` is stored as given (str keys; the same value types as the
    tree but no tensors) and comes back as ``Manifest.meta``.

    ``sync``, when given, makes the bytes written so far durable (an fsync): it runs on a
    helper thread once the data region is written, while the checksums of CPU tensors are
    computed on the other cores, so that a durable save costs about the disk's time rather than
    the disk's plus the checksums'. Tensors off the CPU are checksummed as they are copied to
    host memory. :class:`~pitstop.errors.SaveError` for bad meta is raised before a byte is
    written; I/O errors (``sync``'s included) propagate as :class:`OSError`.
    """
    name = getattr(file, "name", None)
    label = f"writing {name}" if isinstance(name, str) else "writing a checkpoint"
    with progress.task(label, prepared.data_end) as watched:
        return _write(file, prepared, meta, sync, watched)


def _write(
    file: BinaryIO,
    prepared: Prepared,
    meta: Mapping[str, object],
    sync: Callable[[], None] | None,
    watched: progress.Task,
) -> int:
    meta_bytes = _encode_meta(meta)
    tables = [_packb(descriptor_table(prepared.tensors)), _blob_table(prepared.spans, None)]
    bound = len(prepared.tree) + len(meta_bytes) + sum(map(len, tables)) + 64
    if bound > MAX_MANIFEST_BYTES:
        raise SaveError(
            f"the manifest would take about {bound} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a reader accepts; store large values as tensors"
        )
    if 2 * bound > MAX_MANIFEST_NODES:  # n bytes of msgpack hold fewer than 2n values
        parts = (prepared.tree, meta_bytes, *tables)
        count = 1 + 2 * len(MANIFEST_KEYS) + sum(map(count_values, parts))
        if count > MAX_MANIFEST_NODES:
            raise SaveError(
                f"the manifest would hold {count:,} values (maps and lists, and their items), "
                f"more than the {MAX_MANIFEST_NODES:,} a reader decodes; store long lists of "
                f"numbers as tensors or NumPy arrays"
            )
    sink = _Sink(file, watched)
    sink.put(pack_header(prepared.version))
    crcs = [0] * len(prepared.spans)
    big = prepared.data_end >= _PARALLEL_MIN
    with Checksummer(default_threads() if big else 0) as pool:
        deferred: list[tuple[int, memoryview]] = []  # CPU spans: checksummed after the write
        for index, (span, source) in enumerate(zip(prepared.spans, prepared.sources, strict=True)):
            sink.put(bytes(span.offset - sink.position))  # zero padding up to the aligned span
            if span.length == 0:
                continue
            raw = _raw_bytes(source, span)
            if raw.device.type == "cpu":
                view = _host_view(raw, span.start, span.length)
                for chunk in _chunks(view):
                    sink.put(chunk)
                deferred.append((index, view))
            else:
                crcs[index] = _write_from_device(sink, raw, span, pool)
        if sink.position != prepared.data_end:
            raise SaveError(
                f"wrote {sink.position} bytes of data, the layout planned {prepared.data_end}"
            )
        with _in_background(sync if big else None):
            jobs = [(index, pool.start(view)) for index, view in deferred]
            for index, job in jobs:
                crcs[index] = job.result()
    packer = msgpack.Packer(use_bin_type=True)
    values = {
        "format": packer.pack(prepared.version),
        "tree": prepared.tree,
        "tensors": tables[0],
        "blobs": _blob_table(prepared.spans, crcs),
        "meta": meta_bytes,
    }
    manifest = b"".join(
        (
            packer.pack_map_header(len(MANIFEST_KEYS)),
            *(part for key in MANIFEST_KEYS for part in (packer.pack(key), values[key])),
        )
    )
    manifest_offset = sink.position
    sink.put(manifest)
    sink.put(pack_footer(manifest_offset, len(manifest), crc32_update(manifest), prepared.version))
    return sink.position


def _encode_meta(meta: Mapping[str, object]) -> bytes:
    if not isinstance(meta, Mapping):
        raise SaveError(f"meta must be a mapping of str to values, got {type(meta).__qualname__}")
    for key in meta:
        if type(key) is not str:
            raise SaveError(f"meta keys must be str, got {key!r}")
    return encode_tree(dict(meta), on_tensor=None, root="meta")


def _packb(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _blob_table(spans: Sequence[Span], crcs: Sequence[int] | None) -> bytes:
    # crcs=None: the largest the table can get (every crc32 packed in full), for the size bound.
    checksums = crcs if crcs is not None else [0xFFFFFFFF] * len(spans)
    return _packb(
        blob_table(
            [
                Blob(offset=span.offset, length=span.length, crc32=crc)
                for span, crc in zip(spans, checksums, strict=True)
            ]
        )
    )


class _Sink:
    """Writes everything it is given to ``file``, counting bytes (and telling ``watched``)."""

    def __init__(self, file: BinaryIO, watched: progress.Task = progress.IDLE) -> None:
        self._file = file
        self._watched = watched
        self._behind = WriteBehind.of(file)
        self.position = 0

    def put(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            written = self._file.write(view)
            if written is None or written <= 0:  # a non-blocking raw file that took nothing
                raise SaveError(f"the file accepted no bytes at offset {self.position}")
            view = view[written:]
            self.position += written
            self._watched.advance(written)
        self._behind.wrote(self.position)


@contextlib.contextmanager
def _in_background(work: Callable[[], None] | None) -> Iterator[None]:
    """Run ``work`` on a helper thread during the block; wait for it after; raise its error."""
    if work is None:
        yield
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            failure.append(exc)

    # A plain thread: executors refuse work once the interpreter starts to exit.
    thread = threading.Thread(target=run, name="pitstop-sync", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new threads now (Python >= 3.12 at interpreter exit): in order
        work()
        yield
        return
    try:
        yield
    finally:
        thread.join()
    if failure:
        raise failure[0]


def _raw_bytes(source: torch.Tensor, span: Span) -> torch.Tensor:
    """``source``'s whole storage as a flat uint8 tensor, checked against what prepare() saw."""
    storage = source.untyped_storage()
    identity = span.storage  # (device type, device index, data_ptr) for a non-empty span
    assert isinstance(identity, tuple)
    pointer = identity[2]
    if storage.data_ptr() != pointer or storage.nbytes() < span.stop:
        raise SaveError("a tensor's storage was replaced or resized between prepare() and write()")
    import torch

    return torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage)


def _write_from_device(sink: _Sink, raw: torch.Tensor, span: Span, pool: Checksummer) -> int:
    """Copy a span to host memory a piece at a time, write it, and return its CRC-32."""
    crc = 0
    for start in range(span.start, span.stop, _DEVICE_CHUNK):
        host = raw[start : min(start + _DEVICE_CHUNK, span.stop)].to("cpu")
        view = _host_view(host, 0, host.numel())
        job = pool.start(view)  # checksummed beside the write; `host` outlives the job
        try:
            for chunk in _chunks(view):
                sink.put(chunk)
        finally:
            piece = job.result()
        crc = crc32_combine(crc, piece, view.nbytes)
    return crc


def _host_view(raw: torch.Tensor, start: int, length: int) -> memoryview:
    # Zero-copy: a ctypes array over the tensor's own CPU memory (the caller keeps `raw` alive).
    return memoryview((ctypes.c_ubyte * length).from_address(raw.data_ptr() + start))


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, view.nbytes, _CHUNK):
        yield view[start : start + _CHUNK]
