# Reading one checkpoint file, without ever running code.
#
# Rules: what a valid file is, pitstop.core.manifest decides (header, footer, the manifest's
# tables); this module reads the bytes it needs and builds tensors. The manifest is msgpack
# with allow-listed ext codes and dtype names, never pickle; every descriptor is checked
# against the file before a tensor is built over it. verify() accounts for every byte of the
# file, so any single changed byte is detected; load() checks the CRC-32 of exactly the blobs
# it returns. Every failure is a CheckpointCorrupt naming the file and what is wrong.
# How: read_manifest() reads only header, footer and manifest; load() memory-maps the data
# region copy-on-write and builds tensors over the blobs its selection needs.

"""Read one pitstop checkpoint file: its manifest, a subtree of tensors, or a full verify."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import BinaryIO, Final

import torch

from pitstop.core.manifest import (
    FOOTER_SIZE,
    HEADER_SIZE,
    Manifest,
    check_footer,
    check_header,
    check_manifest_bytes,
    check_size,
    parse_manifest,
)
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint
from pitstop.shell.checksums import crc32
from pitstop.shell.treecodec import (
    TENSOR_DTYPES,
    check_tree,
    resolve,
    subtree,
    tensor_refs,
    unpack,
)

__all__ = ["check_blobs", "load", "read_manifest", "verify"]

# The reader's dtype allow-list, as the core checks it: bytes per element, by name.
_ITEMSIZES: Final[Mapping[str, int]] = MappingProxyType(
    {name: dtype.itemsize for name, dtype in TENSOR_DTYPES.items()}
)


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


def check_blobs(manifest: Manifest, indices: Iterable[int]) -> None:
    """Check the CRC-32 of the blobs ``indices`` of ``manifest``'s file, and only those.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the blob and its tensors.
    """
    with open(manifest.path, "rb") as file:
        for index in sorted(set(indices)):
            blob = manifest.blobs[index]
            file.seek(blob.offset)
            _check_crc(manifest, index, file.read(blob.length))


def _read_manifest(file: BinaryIO, name: str) -> Manifest:
    size = os.fstat(file.fileno()).st_size
    check_size(size, name=name)
    version = check_header(_read_at(file, 0, HEADER_SIZE, name), name=name)
    footer = check_footer(
        _read_at(file, size - FOOTER_SIZE, FOOTER_SIZE, name),
        name=name,
        size=size,
        version=version,
    )
    data = _read_at(file, footer.manifest_offset, footer.manifest_length, name)
    check_manifest_bytes(data, footer, name=name)
    try:
        doc = unpack(data)
    except CheckpointCorrupt as error:  # the decoder does not know the file's name
        raise CheckpointCorrupt(f"{name}: manifest: {error}") from error
    return parse_manifest(
        doc,
        name=name,
        size=size,
        version=version,
        offset=footer.manifest_offset,
        itemsizes=_ITEMSIZES,
        check_tree=check_tree,
    )


def _read_at(file: BinaryIO, offset: int, length: int, name: str) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise CheckpointCorrupt(
            f"{name}: the file ended early reading bytes {offset}..{offset + length}"
        )
    return data


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
                .view(TENSOR_DTYPES[d.dtype])
                .set_(storages[d.blob], d.storage_offset, d.shape, d.stride)
            )
        except RuntimeError as error:
            raise CheckpointCorrupt(
                f"{manifest.path}: tensor {', '.join(manifest.tensor_paths[i])} cannot be built: "
                f"{error}"
            ) from error
    return tensors
