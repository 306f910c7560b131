# The checkpoint file: one file per checkpoint, read without ever running code.
#
# Rules: [64-byte header][data: each storage span once, 64-byte aligned, zero padding between]
# [msgpack manifest][40-byte footer], all little-endian; docs/file-format.md has every byte.
# A file without a valid footer is incomplete. Where tensor bytes go is decided by
# pitstop.core.layout; this module only carries the layout out. Nothing is written until the
# whole tree has been checked (SaveError names the key path). CRC-32 checksums are computed
# from the tensors' memory, never by reading the file back: for CPU tensors on several threads
# once the data is written, while the file's fsync runs (pitstop.shell.checksums).
# Reading never unpickles: the manifest is msgpack with allow-listed ext codes and dtype names,
# and every descriptor is checked against the file before a tensor is built over it. verify()
# accounts for every byte of the file, so any single changed byte is detected.
# How: prepare() walks the tree and plans the layout; write() streams header, spans, manifest
# and footer to an open file; read_manifest() reads only header, footer and manifest; load()
# memory-maps the data region copy-on-write and builds tensors over the blobs it needs.

"""The pitstop checkpoint file format: write, read, load and verify one checkpoint file."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import BinaryIO, Final

import attrs
import msgpack
import torch

from pitstop.core.layout import Span, TensorExtent, align, layout_tensors
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint, SaveError
from pitstop.shell.checksums import Checksummer, crc32, crc32_combine, default_threads
from pitstop.shell.treecodec import (
    TENSOR_DTYPES,
    TensorRef,
    check_tree,
    dtype_name,
    encode_tree,
    resolve,
    show_path,
    subtree,
    tensor_refs,
    unpack,
)

__all__ = [
    "ALIGNMENT",
    "FOOTER_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_MAGIC",
    "HEADER_SIZE",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "Blob",
    "Manifest",
    "Prepared",
    "TensorDescriptor",
    "TensorRef",
    "check_blobs",
    "load",
    "prepare",
    "read_manifest",
    "verify",
    "write",
]

FORMAT_VERSION: Final = 1
HEADER_MAGIC: Final = b"PITSTOP\0"
FOOTER_MAGIC: Final = b"\0POTSTIP"
HEADER_SIZE: Final = 64
FOOTER_SIZE: Final = 40
ALIGNMENT: Final = 64
MAX_MANIFEST_BYTES: Final = 1 << 30
MAX_NDIM: Final = 64

# magic, version, flags, reserved, crc32 of the 60 bytes before it
_HEADER: Final = struct.Struct("<8sII44sI")
# magic, version, flags, manifest offset, manifest length, manifest crc32, crc32 of the 36 before
_FOOTER: Final = struct.Struct("<8sIIQQII")
assert _HEADER.size == HEADER_SIZE
assert _FOOTER.size == FOOTER_SIZE

_MANIFEST_KEYS: Final = frozenset({"format", "tree", "tensors", "blobs", "meta"})
_BLOB_KEYS: Final = ("offset", "length", "crc32")
_TENSOR_KEYS: Final = ("blob", "offset", "dtype", "shape", "stride", "storage_offset")
_U64: Final = 1 << 64
_I64: Final = 1 << 63

# Writing: bytes go out in chunks of _CHUNK. Files with at least _PARALLEL_MIN bytes of data
# are checksummed on a pool of threads (pitstop.shell.checksums); smaller ones inline.
# Tensors off the CPU are copied to host memory _DEVICE_CHUNK bytes at a time.
_CHUNK: Final = 2 << 20
_PARALLEL_MIN: Final = 4 << 20
_DEVICE_CHUNK: Final = 64 << 20


# --- records ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Blob:
    """One storage span in the data region: ``length`` bytes at file ``offset``, and its CRC-32."""

    offset: int
    length: int
    crc32: int

    @property
    def stop(self) -> int:
        """The file offset just past the blob."""
        return self.offset + self.length


@attrs.frozen(kw_only=True)
class TensorDescriptor:
    """How one tensor is rebuilt over its blob.

    ``offset`` is the byte offset of its first element within blob ``blob``;
    ``storage_offset`` is the same in elements (``offset // itemsize``); ``shape`` and
    ``stride`` are as torch reports them (strides in elements).
    """

    blob: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The tensor's dtype."""
        return TENSOR_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        """The number of elements."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count


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

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (without padding) the file will hold."""
        return sum(span.length for span in self.spans)


@attrs.frozen(kw_only=True, eq=False)
class Manifest:
    """What a checkpoint file says about itself, checked; no tensor bytes were read.

    ``tree`` is the stored tree with :class:`~pitstop.shell.treecodec.TensorRef` where tensors
    are (``tensors[ref.index]`` describes each); ``tensor_paths[i]`` lists the key paths of
    tensor ``i``; ``meta`` is the caller's meta mapping as written.
    """

    path: str
    size: int
    version: int
    manifest_offset: int
    blobs: tuple[Blob, ...]
    tensors: tuple[TensorDescriptor, ...]
    tensor_paths: tuple[tuple[str, ...], ...]
    tree: object
    meta: Mapping[str, object]

    def blob_users(self, blob: int) -> str:
        """Name the tensors stored in blob ``blob``, for messages."""
        paths = [
            p for i, d in enumerate(self.tensors) if d.blob == blob for p in self.tensor_paths[i]
        ]
        if not paths:
            return "no tensor"
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        return ", ".join(paths[:3]) + more


# --- writing ----------------------------------------------------------------------------------


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
    encoded = encode_tree(tree, on_tensor=collector.add)
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
    )


class _Collector:
    """Collects the tree's tensors, once per tensor object, with the bytes each one uses."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []  # detached, conj/neg resolved
        self.paths: list[str] = []
        self.extents: list[TensorExtent] = []
        self.firsts: list[int] = []  # byte offset of each tensor's first element in its storage
        self._index: dict[int, int] = {}
        self._originals: list[torch.Tensor] = []  # keeps id()s unique while collecting

    def add(self, tensor: torch.Tensor, path: str) -> int:
        known = self._index.get(id(tensor))
        if known is not None:
            return known
        index = len(self.tensors)
        stored = _storable(tensor, path)
        try:
            extent, first = _extent(stored, index)
        except RuntimeError as error:  # a tensor without accessible storage
            raise SaveError(
                f"{show_path(path)}: cannot read the tensor's storage: {error}"
            ) from error
        self._index[id(tensor)] = index
        self._originals.append(tensor)
        self.tensors.append(stored)
        self.paths.append(path)
        self.extents.append(extent)
        self.firsts.append(first)
        return index


def _storable(tensor: torch.Tensor, path: str) -> torch.Tensor:
    where = show_path(path)
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise SaveError(
            f"{where}: tensor subclass {type(tensor).__qualname__} is not supported; "
            f"store a plain tensor"
        )
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise SaveError(f"{where}: {tensor.layout} tensors are not supported, only dense ones")
    if tensor.is_quantized:
        raise SaveError(f"{where}: quantized tensors are not supported")
    if tensor.device.type == "meta":
        raise SaveError(f"{where}: a tensor on the meta device has no data to save")
    if dtype_name(tensor.dtype) not in TENSOR_DTYPES:
        raise SaveError(f"{where}: tensors of dtype {tensor.dtype} are not supported")
    if tensor.dim() > MAX_NDIM:
        raise SaveError(f"{where}: {tensor.dim()} dimensions is more than {MAX_NDIM}")
    stored = tensor.detach()
    if stored.is_conj():
        stored = stored.resolve_conj()
    if stored.is_neg():
        stored = stored.resolve_neg()
    return stored


def _extent(tensor: torch.Tensor, index: int) -> tuple[TensorExtent, int]:
    """Return the extent of ``tensor`` in its storage, and its first element's byte offset."""
    storage = tensor.untyped_storage()
    if tensor.numel() == 0 or storage.nbytes() == 0:
        # No bytes: its own zero-length blob (data_ptr may be 0 for every empty tensor).
        return TensorExtent(storage=("empty", index), start=0, stop=0), 0
    itemsize = tensor.element_size()
    first = int(tensor.storage_offset()) * itemsize
    last = int(tensor.storage_offset()) + sum(
        (int(dim) - 1) * int(step) for dim, step in zip(tensor.shape, tensor.stride(), strict=True)
    )
    identity = (tensor.device.type, tensor.device.index, storage.data_ptr())
    # The span starts on a multiple of ALIGNMENT within the storage, so every tensor keeps its
    # alignment relative to the storage when it is memory-mapped back.
    return TensorExtent(
        storage=identity, start=first & -ALIGNMENT, stop=(last + 1) * itemsize
    ), first


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
    tree but no tensors) and comes back as :attr:`Manifest.meta`.

    ``sync``, when given, makes the bytes written so far durable (an fsync): it runs on a
    helper thread once the data region is written, while the checksums of CPU tensors are
    computed on the other cores, so that a durable save costs about the disk's time rather than
    the disk's plus the checksums'. Tensors off the CPU are checksummed as they are copied to
    host memory. :class:`~pitstop.errors.SaveError` for bad meta is raised before a byte is
    written; I/O errors (``sync``'s included) propagate as :class:`OSError`.
    """
    meta_bytes = _encode_meta(meta)
    tables = [_descriptor_table(prepared.tensors), _blob_table(prepared.spans, None)]
    bound = len(prepared.tree) + len(meta_bytes) + sum(map(len, tables)) + 64
    if bound > MAX_MANIFEST_BYTES:
        raise SaveError(
            f"the manifest would take about {bound} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a reader accepts; store large values as tensors"
        )
    sink = _Sink(file)
    sink.put(_pack_header())
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
    manifest = b"".join(
        (
            packer.pack_map_header(len(_MANIFEST_KEYS)),
            packer.pack("format"),
            packer.pack(FORMAT_VERSION),
            packer.pack("tree"),
            prepared.tree,
            packer.pack("tensors"),
            tables[0],
            packer.pack("blobs"),
            _blob_table(prepared.spans, crcs),
            packer.pack("meta"),
            meta_bytes,
        )
    )
    manifest_offset = sink.position
    sink.put(manifest)
    sink.put(_pack_footer(manifest_offset, len(manifest), zlib.crc32(manifest)))
    return sink.position


def _encode_meta(meta: Mapping[str, object]) -> bytes:
    if not isinstance(meta, Mapping):
        raise SaveError(f"meta must be a mapping of str to values, got {type(meta).__qualname__}")
    for key in meta:
        if type(key) is not str:
            raise SaveError(f"meta keys must be str, got {key!r}")
    return encode_tree(dict(meta), on_tensor=None, root="meta")


def _descriptor_table(tensors: Sequence[TensorDescriptor]) -> bytes:
    packed: bytes = msgpack.packb(
        [
            {
                "blob": d.blob,
                "offset": d.offset,
                "dtype": d.dtype,
                "shape": list(d.shape),
                "stride": list(d.stride),
                "storage_offset": d.storage_offset,
            }
            for d in tensors
        ],
        use_bin_type=True,
    )
    return packed


def _blob_table(spans: Sequence[Span], crcs: Sequence[int] | None) -> bytes:
    # crcs=None: the largest the table can get (every crc32 packed in full), for the size bound.
    checksums = crcs if crcs is not None else [0xFFFFFFFF] * len(spans)
    packed: bytes = msgpack.packb(
        [
            {"offset": span.offset, "length": span.length, "crc32": crc}
            for span, crc in zip(spans, checksums, strict=True)
        ],
        use_bin_type=True,
    )
    return packed


def _pack_header() -> bytes:
    body = _HEADER.pack(HEADER_MAGIC, FORMAT_VERSION, 0, bytes(44), 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _pack_footer(manifest_offset: int, manifest_length: int, manifest_crc: int) -> bytes:
    body = _FOOTER.pack(
        FOOTER_MAGIC, FORMAT_VERSION, 0, manifest_offset, manifest_length, manifest_crc, 0
    )[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


class _Sink:
    """Writes everything it is given to ``file``, counting bytes."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.position = 0

    def put(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            written = self._file.write(view)
            if written is None or written <= 0:  # a non-blocking raw file that took nothing
                raise SaveError(f"the file accepted no bytes at offset {self.position}")
            view = view[written:]
            self.position += written


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


# --- reading ----------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check a checkpoint's header, footer and manifest; no tensor bytes are read.

    Cheap enough for directory scans. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming
    the file and what is wrong (an incomplete file has no valid footer).
    """
    name = os.fspath(path)
    with open(name, "rb") as file:
        return _read_manifest(file, name)


def load(
    path: str | os.PathLike[str],
    *,
    select: Sequence[str | int] | None = None,
    verify: bool = True,
) -> object:
    """Return the stored tree, or the subtree at key path ``select``, with CPU tensors.

    Tensors are memory-mapped copy-on-write: writing to them never changes the file. Tensors
    that shared storage when saved share one storage again. Only the blobs the selection needs
    are touched; with ``verify=True`` (the default) each of them is checked against its CRC-32
    first. Raises :class:`~pitstop.errors.CheckpointCorrupt` for a bad file and
    :class:`~pitstop.errors.IncompatibleCheckpoint` when ``select`` names no stored value.
    """
    if isinstance(select, (str, bytes)):
        raise TypeError(f"select is a sequence of keys, such as ('weights', 'ema'); got {select!r}")
    name = os.fspath(path)
    with open(name, "rb") as file:
        manifest = _read_manifest(file, name)
        node = manifest.tree
        if select is not None:
            try:
                node = subtree(node, select)
            except KeyError as missing:
                raise IncompatibleCheckpoint(
                    [f"{name}: the stored tree has no {missing.args[0]}"]
                ) from None
        needed = sorted({ref.index for ref in tensor_refs(node)})
        tensors = _materialize(file, manifest, needed, verify=verify) if needed else {}
    return resolve(node, tensors)


def verify(path: str | os.PathLike[str]) -> None:
    """Check every byte of a checkpoint file.

    Checks the header, the footer, the manifest and its checksum, every descriptor, every blob's
    CRC-32, that every padding byte is zero and that no byte is unaccounted for — so any single
    changed byte, and any truncation, is detected. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the file and what failed.
    """
    name = os.fspath(path)
    with open(name, "rb") as file:
        manifest = _read_manifest(file, name)
        with (
            mmap.mmap(file.fileno(), manifest.manifest_offset, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as data,
        ):
            cursor = HEADER_SIZE
            for index, blob in enumerate(manifest.blobs):
                with data[cursor : blob.offset] as padding:
                    if any(padding):
                        where = cursor + next(i for i, b in enumerate(padding) if b)
                        raise CheckpointCorrupt(
                            f"{name}: padding byte at offset {where} (before blob {index}) "
                            f"is not zero"
                        )
                _check_blob(data, manifest, index)
                cursor = blob.stop


def _read_manifest(file: BinaryIO, name: str) -> Manifest:
    size = os.fstat(file.fileno()).st_size
    if size < HEADER_SIZE + FOOTER_SIZE + 1:
        raise CheckpointCorrupt(
            f"{name}: {size} bytes is too small for a checkpoint; the file is incomplete"
        )
    version = _check_header(_read_at(file, 0, HEADER_SIZE, name), name)
    offset, length, checksum = _check_footer(
        _read_at(file, size - FOOTER_SIZE, FOOTER_SIZE, name), name, size, version
    )
    data = _read_at(file, offset, length, name)
    if zlib.crc32(data) != checksum:
        raise CheckpointCorrupt(
            f"{name}: manifest (bytes {offset}..{offset + length}) fails its checksum"
        )
    try:
        return _parse_manifest(data, name=name, size=size, version=version, offset=offset)
    except CheckpointCorrupt as error:  # the parser does not know the file's name
        raise CheckpointCorrupt(f"{name}: manifest: {error}") from error


def _read_at(file: BinaryIO, offset: int, length: int, name: str) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise CheckpointCorrupt(
            f"{name}: the file ended early reading bytes {offset}..{offset + length}"
        )
    return data


def _check_header(header: bytes, name: str) -> int:
    magic, version, flags, reserved, checksum = _HEADER.unpack(header)
    if magic != HEADER_MAGIC:
        raise CheckpointCorrupt(f"{name}: not a pitstop checkpoint (header magic {magic!r})")
    if zlib.crc32(header[:-4]) != checksum:
        raise CheckpointCorrupt(f"{name}: header fails its checksum")
    if not 1 <= version <= FORMAT_VERSION:
        raise CheckpointCorrupt(
            f"{name}: format version {version} is not one this pitstop reads "
            f"(1..{FORMAT_VERSION}); a newer pitstop may read it"
        )
    if flags or any(reserved):
        raise CheckpointCorrupt(f"{name}: header has unknown flags or reserved bytes set")
    return int(version)


def _check_footer(footer: bytes, name: str, size: int, version: int) -> tuple[int, int, int]:
    magic, footer_version, flags, offset, length, checksum, own = _FOOTER.unpack(footer)
    if magic != FOOTER_MAGIC:
        raise CheckpointCorrupt(f"{name}: no footer at the end of the file; the file is incomplete")
    if zlib.crc32(footer[:-4]) != own:
        raise CheckpointCorrupt(f"{name}: footer fails its checksum")
    if footer_version != version or flags:
        raise CheckpointCorrupt(
            f"{name}: footer says format {footer_version} (flags {flags:#x}), header says {version}"
        )
    if length > MAX_MANIFEST_BYTES:
        raise CheckpointCorrupt(
            f"{name}: footer claims a {length}-byte manifest; "
            f"at most {MAX_MANIFEST_BYTES} is allowed"
        )
    footer_start = size - FOOTER_SIZE
    if length < 1 or offset < HEADER_SIZE or offset + length != footer_start:
        raise CheckpointCorrupt(
            f"{name}: footer places the manifest at bytes {offset}..{offset + length}, but it must "
            f"end where the footer starts ({footer_start}) and begin after the header"
        )
    return int(offset), int(length), int(checksum)


def _parse_manifest(data: bytes, *, name: str, size: int, version: int, offset: int) -> Manifest:
    doc = unpack(data)
    if type(doc) is not dict or set(doc) != _MANIFEST_KEYS:
        keys = sorted(map(repr, doc)) if type(doc) is dict else type(doc).__qualname__
        raise CheckpointCorrupt(f"expected a map with keys {sorted(_MANIFEST_KEYS)}, got {keys}")
    if type(doc["format"]) is not int or doc["format"] != version:
        raise CheckpointCorrupt(f"format {doc['format']!r} disagrees with the header ({version})")
    raw_tensors = _array(doc["tensors"], "tensors")
    tensor_paths = check_tree(doc["tree"], root="", tensor_count=len(raw_tensors))
    meta = doc["meta"]
    if type(meta) is not dict or not all(type(k) is str for k in meta):
        raise CheckpointCorrupt("meta must be a map with str keys")
    check_tree(meta, root="meta", tensor_count=None)
    blobs = _parse_blobs(_array(doc["blobs"], "blobs"), data_end=offset)
    tensors = tuple(
        _parse_tensor(entry, f"tensors[{i}] ({', '.join(tensor_paths[i]) or 'unused'})", blobs)
        for i, entry in enumerate(raw_tensors)
    )
    return Manifest(
        path=name,
        size=size,
        version=version,
        manifest_offset=offset,
        blobs=blobs,
        tensors=tensors,
        tensor_paths=tensor_paths,
        tree=doc["tree"],
        meta=MappingProxyType(meta),
    )


def _array(value: object, what: str) -> list[object]:
    if type(value) is not list:
        raise CheckpointCorrupt(f"{what} must be an array, got {type(value).__qualname__}")
    return value


def _fields(entry: object, keys: Sequence[str], what: str) -> dict[str, object]:
    if type(entry) is not dict or set(entry) != set(keys):
        raise CheckpointCorrupt(f"{what} must be a map with keys {list(keys)}")
    return entry


def _uint(value: object, what: str, limit: int = _I64) -> int:
    if type(value) is not int or not 0 <= value < limit:
        raise CheckpointCorrupt(f"{what} must be an int in [0, {limit}), got {value!r}")
    return value


def _parse_blobs(entries: list[object], *, data_end: int) -> tuple[Blob, ...]:
    blobs = []
    cursor = HEADER_SIZE
    for i, entry in enumerate(entries):
        fields = _fields(entry, _BLOB_KEYS, f"blobs[{i}]")
        blob = Blob(
            offset=_uint(fields["offset"], f"blobs[{i}].offset"),
            length=_uint(fields["length"], f"blobs[{i}].length"),
            crc32=_uint(fields["crc32"], f"blobs[{i}].crc32", 1 << 32),
        )
        expected = align(cursor, ALIGNMENT)
        if blob.offset != expected:
            raise CheckpointCorrupt(
                f"blobs[{i}] starts at byte {blob.offset}, but must start at {expected}: blobs "
                f"follow each other in order, {ALIGNMENT}-byte aligned, without overlap"
            )
        if blob.stop > data_end:
            raise CheckpointCorrupt(
                f"blobs[{i}] (bytes {blob.offset}..{blob.stop}) runs past the data region, "
                f"which ends at {data_end}"
            )
        blobs.append(blob)
        cursor = blob.stop
    if cursor != data_end:
        raise CheckpointCorrupt(
            f"bytes {cursor}..{data_end} between the last blob and the manifest are unaccounted for"
        )
    return tuple(blobs)


def _parse_tensor(entry: object, what: str, blobs: Sequence[Blob]) -> TensorDescriptor:
    fields = _fields(entry, _TENSOR_KEYS, what)
    blob = _uint(fields["blob"], f"{what}.blob", len(blobs))
    name = fields["dtype"]
    if type(name) is not str or name not in TENSOR_DTYPES:
        raise CheckpointCorrupt(f"{what}.dtype {name!r} is not a known tensor dtype")
    shape = _array(fields["shape"], f"{what}.shape")
    stride = _array(fields["stride"], f"{what}.stride")
    if len(shape) > MAX_NDIM or len(stride) != len(shape):
        raise CheckpointCorrupt(
            f"{what}: shape {shape!r:.80} and stride {stride!r:.80} must have the same length, "
            f"at most {MAX_NDIM}"
        )
    descriptor = TensorDescriptor(
        blob=blob,
        offset=_uint(fields["offset"], f"{what}.offset"),
        dtype=name,
        shape=tuple(_uint(d, f"{what}.shape") for d in shape),
        stride=tuple(_uint(s, f"{what}.stride") for s in stride),
        storage_offset=_uint(fields["storage_offset"], f"{what}.storage_offset"),
    )
    itemsize = TENSOR_DTYPES[name].itemsize
    if descriptor.offset != descriptor.storage_offset * itemsize:
        raise CheckpointCorrupt(
            f"{what}: byte offset {descriptor.offset} is not storage_offset "
            f"{descriptor.storage_offset} x itemsize {itemsize}"
        )
    if descriptor.numel >= _I64:
        raise CheckpointCorrupt(f"{what}: shape {descriptor.shape} has too many elements")
    end = descriptor.offset
    if descriptor.numel:
        last = sum((d - 1) * s for d, s in zip(descriptor.shape, descriptor.stride, strict=True))
        end += (last + 1) * itemsize
    if end > blobs[blob].length:
        raise CheckpointCorrupt(
            f"{what}: needs bytes {descriptor.offset}..{end} of blob {blob}, which holds "
            f"{blobs[blob].length}"
        )
    return descriptor


def _check_blob(data: memoryview, manifest: Manifest, index: int) -> None:
    blob = manifest.blobs[index]
    with data[blob.offset : blob.stop] as view:
        _check_crc(manifest, index, view)


def _check_crc(manifest: Manifest, index: int, data: bytes | memoryview) -> None:
    blob = manifest.blobs[index]
    if len(data) != blob.length or crc32(memoryview(data)) != blob.crc32:
        raise CheckpointCorrupt(
            f"{manifest.path}: blob {index} (bytes {blob.offset}..{blob.stop}, holding "
            f"{manifest.blob_users(index)}) fails its checksum"
        )


def check_blobs(manifest: Manifest, indices: Iterable[int]) -> None:
    """Check the CRC-32 of the blobs ``indices`` of ``manifest``'s file, and only those.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the blob and its tensors.
    """
    with open(manifest.path, "rb") as file:
        for index in sorted(set(indices)):
            blob = manifest.blobs[index]
            file.seek(blob.offset)
            _check_crc(manifest, index, file.read(blob.length))


def _materialize(
    file: BinaryIO, manifest: Manifest, needed: Sequence[int], *, verify: bool
) -> dict[int, torch.Tensor]:
    """Build tensors ``needed`` over a copy-on-write map of the file's data region."""
    if sys.byteorder != "little":
        raise IncompatibleCheckpoint(
            [f"{manifest.path}: this host is big-endian; pitstop files hold little-endian bytes"]
        )
    blobs = sorted({manifest.tensors[i].blob for i in needed})
    # ACCESS_COPY: a private, writable mapping, so torch.frombuffer does not warn and writes to
    # loaded tensors never reach the file. Each blob becomes its own storage; torch keeps the
    # mapping alive for as long as any tensor over it lives.
    mapped = mmap.mmap(file.fileno(), manifest.manifest_offset, access=mmap.ACCESS_COPY)
    storages: dict[int, torch.UntypedStorage] = {}
    with memoryview(mapped) as data:
        for index in blobs:
            if verify:
                _check_blob(data, manifest, index)
    for index in blobs:
        blob = manifest.blobs[index]
        if blob.length == 0:
            storages[index] = torch.empty(0, dtype=torch.uint8).untyped_storage()
        else:
            storages[index] = torch.frombuffer(
                mapped, dtype=torch.uint8, count=blob.length, offset=blob.offset
            ).untyped_storage()
    tensors: dict[int, torch.Tensor] = {}
    for i in needed:
        d = manifest.tensors[i]
        try:
            # (a uint8 view, not torch.empty(dtype=...): that warns for complex32)
            tensors[i] = (
                torch.empty(0, dtype=torch.uint8)
                .view(d.torch_dtype)
                .set_(storages[d.blob], d.storage_offset, d.shape, d.stride)
            )
        except RuntimeError as error:
            raise CheckpointCorrupt(
                f"{manifest.path}: tensor {', '.join(manifest.tensor_paths[i])} cannot be built: "
                f"{error}"
            ) from error
    return tensors
