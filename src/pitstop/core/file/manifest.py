# What a checkpoint file says about itself: its manifest, the manifest's tables, and their checks.
#
# Rules: a file is [64-byte header][data: blobs, each ALIGNMENT-aligned][msgpack manifest]
# [40-byte footer], all little-endian (docs/file-format.md has every byte). The header and the
# footer are pitstop.core.file.framing's (packed and checked there; their names are re-exported
# here, so this module stays the one place for a file's structure); the footer carries the
# manifest's CRC-32. A reader accepts only what a writer of its versions produces: a manifest that
# starts with the map it must be and ends where the footer starts, blobs that follow each other in
# order without overlap or unaccounted bytes, descriptors whose every element lies inside their
# blob, dtypes from the reader's allow-list. Every failure is a CheckpointCorrupt naming the file
# and the offending field.
# How: the manifest is decoded by the shell (its tree holds torch values) and handed here as a
# plain document, whose tables are checked field by field and become records. The value tree
# is checked by the function the shell passes in, which also reports the key paths that use
# each tensor, for messages.

"""The checkpoint file's manifest tables: packing, checking, records (and the framing's names)."""

from __future__ import annotations

import reprlib
import zlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, Protocol

import attrs

from pitstop.core.file.framing import (
    FOOTER_MAGIC,
    FOOTER_SIZE,
    FORMAT_VERSION,
    HEADER_MAGIC,
    HEADER_SIZE,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_NODES,
    OLDEST_VERSION,
    Footer,
    check_footer,
    check_header,
    check_size,
    pack_footer,
    pack_header,
)
from pitstop.core.file.layout import align
from pitstop.errors import CheckpointCorrupt

__all__ = [
    "ALIGNMENT",
    "FOOTER_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_MAGIC",
    "HEADER_SIZE",
    "MANIFEST_KEYS",
    "MANIFEST_START",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_NODES",
    "MAX_NDIM",
    "OLDEST_VERSION",
    "Blob",
    "Footer",
    "Manifest",
    "TensorDescriptor",
    "TreeCheck",
    "blob_table",
    "check_footer",
    "check_header",
    "check_manifest_bytes",
    "check_manifest_start",
    "check_size",
    "descriptor_table",
    "pack_footer",
    "pack_header",
    "parse_manifest",
    "parse_meta",
]

ALIGNMENT: Final = 64
MAX_NDIM: Final = 64
MANIFEST_KEYS: Final = ("format", "tree", "tensors", "blobs", "meta")
"""The manifest map's keys, in the order a writer packs them."""
MANIFEST_START: Final = b"\x85\xa6format"
"""The first bytes of every manifest: a msgpack map of the five keys, "format" first."""

_BLOB_KEYS: Final = ("offset", "length", "crc32")
_TENSOR_KEYS: Final = ("blob", "offset", "dtype", "shape", "stride", "storage_offset")
_I64: Final = 1 << 63


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
    ``stride`` are as torch reports them (strides in elements); ``dtype`` is the dtype's name
    (``"float32"``).
    """

    blob: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def numel(self) -> int:
        """The number of elements."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@attrs.frozen(kw_only=True, eq=False)
class Manifest:
    """What a checkpoint file says about itself, checked; no tensor bytes were read.

    ``tree`` is the stored tree with a placeholder where each tensor is
    (``pitstop.shell.format.treecheck.TensorRef``; ``tensors[ref.index]`` describes it);
    ``tensor_paths[i]`` lists the key paths of tensor ``i``; ``meta`` is the writer's meta
    mapping as written.
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


class TreeCheck(Protocol):
    """Checks a decoded value tree; returns, per tensor index, the key paths that use it.

    ``tensor_count=None``: no tensor may appear. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the key path of a bad value.
    """

    def __call__(
        self, tree: object, *, root: str, tensor_count: int | None
    ) -> tuple[tuple[str, ...], ...]: ...


# --- the manifest's bytes, where the footer places them ---------------------------------------


def check_manifest_start(start: bytes, footer: Footer, *, name: str) -> None:
    """Check the first bytes of the manifest ``footer`` places (a reader that must not hold a
    large manifest before it is known to be one looks at these first)."""
    if start != MANIFEST_START[: len(start)] or len(start) != len(MANIFEST_START):
        raise CheckpointCorrupt(
            f"{name}: the footer places a {footer.manifest_length}-byte manifest at byte "
            f"{footer.manifest_offset}, but no manifest starts there"
        )


def check_manifest_bytes(data: bytes, footer: Footer, *, name: str) -> None:
    """Check the manifest bytes ``data`` against the length and CRC-32 ``footer`` gives."""
    start, stop = footer.manifest_offset, footer.manifest_offset + footer.manifest_length
    if len(data) != footer.manifest_length:
        raise CheckpointCorrupt(f"{name}: the file ended early reading bytes {start}..{stop}")
    if zlib.crc32(data) != footer.manifest_crc32:
        raise CheckpointCorrupt(f"{name}: manifest (bytes {start}..{stop}) fails its checksum")


# --- the manifest's tables --------------------------------------------------------------------


def descriptor_table(tensors: Sequence[TensorDescriptor]) -> list[dict[str, object]]:
    """The manifest's ``tensors`` array for ``tensors``, as plain values to pack."""
    return [
        {
            "blob": d.blob,
            "offset": d.offset,
            "dtype": d.dtype,
            "shape": list(d.shape),
            "stride": list(d.stride),
            "storage_offset": d.storage_offset,
        }
        for d in tensors
    ]


def blob_table(blobs: Sequence[Blob]) -> list[dict[str, object]]:
    """The manifest's ``blobs`` array for ``blobs``, as plain values to pack."""
    return [{"offset": b.offset, "length": b.length, "crc32": b.crc32} for b in blobs]


def parse_manifest(
    doc: object,
    *,
    name: str,
    size: int,
    version: int,
    offset: int,
    itemsizes: Mapping[str, int],
    check_tree: TreeCheck,
) -> Manifest:
    """Check a decoded manifest ``doc`` of file ``name`` and return it as a :class:`Manifest`.

    ``size`` is the file's size, ``version`` its header's, ``offset`` where the manifest (and
    so the data region's end) is. ``itemsizes`` is the reader's dtype allow-list: the bytes per
    element of each tensor dtype it can build, by name. ``check_tree`` checks the value trees
    (``tree`` and ``meta``). Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the file
    and the offending field.
    """
    try:
        return _parse(doc, name, size, version, offset, itemsizes, check_tree)
    except CheckpointCorrupt as error:
        raise CheckpointCorrupt(f"{name}: manifest: {error}") from error


def _parse(
    doc: object,
    name: str,
    size: int,
    version: int,
    offset: int,
    itemsizes: Mapping[str, int],
    check_tree: TreeCheck,
) -> Manifest:
    if type(doc) is not dict:
        raise CheckpointCorrupt(
            f"expected a map with keys {sorted(MANIFEST_KEYS)}, got {type(doc).__qualname__}"
        )
    _check_head(doc, set(doc), version)
    raw_tensors = _array(doc["tensors"], "tensors")
    tensor_paths = check_tree(doc["tree"], root="", tensor_count=len(raw_tensors))
    assert len(tensor_paths) == len(raw_tensors), "check_tree names the users of every tensor"
    meta = _meta(doc["meta"], check_tree)
    blobs = _parse_blobs(_array(doc["blobs"], "blobs"), data_end=offset)
    tensors = tuple(
        _parse_tensor(
            entry, f"tensors[{i}] ({', '.join(tensor_paths[i]) or 'unused'})", blobs, itemsizes
        )
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


def parse_meta(
    fields: Mapping[str, object],
    keys: set[object],
    *,
    name: str,
    version: int,
    check_tree: TreeCheck,
) -> Mapping[str, object]:
    """Check the ``format`` and ``meta`` of a manifest read in part (what a directory scan
    reads: the other fields are skipped, not decoded) and return the meta. ``keys``: every key
    the manifest map holds. The same checks :func:`parse_manifest` makes of those two fields;
    raises :class:`~pitstop.errors.CheckpointCorrupt` naming the file and the field."""
    try:
        _check_head(fields, keys, version)
        return MappingProxyType(_meta(fields["meta"], check_tree))
    except CheckpointCorrupt as error:
        raise CheckpointCorrupt(f"{name}: manifest: {error}") from error


def _check_head(doc: Mapping[str, object], keys: set[object], version: int) -> None:
    if keys != set(MANIFEST_KEYS):
        raise CheckpointCorrupt(
            f"expected a map with keys {sorted(MANIFEST_KEYS)}, got {sorted(map(_show, keys))}"
        )
    if type(doc["format"]) is not int or doc["format"] != version:
        raise CheckpointCorrupt(
            f"format {_show(doc['format'])} disagrees with the header ({version})"
        )


def _meta(meta: object, check_tree: TreeCheck) -> dict[str, object]:
    if type(meta) is not dict or not all(type(k) is str for k in meta):
        raise CheckpointCorrupt("meta must be a map with str keys")
    check_tree(meta, root="meta", tensor_count=None)
    return meta


def _show(value: object) -> str:
    # Bounded in length and depth, whatever a hostile manifest holds.
    return reprlib.repr(value)


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
        raise CheckpointCorrupt(f"{what} must be an int in [0, {limit}), got {_show(value)}")
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


def _parse_tensor(
    entry: object, what: str, blobs: Sequence[Blob], itemsizes: Mapping[str, int]
) -> TensorDescriptor:
    fields = _fields(entry, _TENSOR_KEYS, what)
    blob = _uint(fields["blob"], f"{what}.blob", len(blobs))
    name = fields["dtype"]
    if type(name) is not str or name not in itemsizes:
        raise CheckpointCorrupt(f"{what}.dtype {_show(name)} is not a known tensor dtype")
    shape = _array(fields["shape"], f"{what}.shape")
    stride = _array(fields["stride"], f"{what}.stride")
    if len(shape) > MAX_NDIM or len(stride) != len(shape):
        raise CheckpointCorrupt(
            f"{what}: shape {_show(shape)} and stride {_show(stride)} must have the same length, "
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
    itemsize = itemsizes[name]
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
