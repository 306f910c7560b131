# Reading one checkpoint file, without ever running code.
#
# Rules: what a valid file is, the core decides (pitstop.core.file.framing the header and footer,
# pitstop.core.file.manifest the manifest's tables); this module reads the bytes it needs and
# builds tensors. The manifest is msgpack
# with allow-listed ext codes and dtype names, never pickle; every descriptor is checked
# against the file before a tensor is built over it. verify() accounts for every byte of the
# file, so any single changed byte is detected; load() checks the CRC-32 of exactly the blobs
# it returns. Every failure is a CheckpointCorrupt naming the file and what is wrong.
# Every file is opened by pitstop.shell.format.untrusted.open_untrusted, so a FIFO or a device in a
# checkpoint's place is refused before a byte is read.
# How: read_manifest() reads only header, footer and manifest; verify() and a checked load()
# read the data they check once, front to back, each blob's CRC-32 computed as it is read
# (pitstop.shell.format.blobread); load() then builds tensors over a copy-on-write map of the data
# region — the page cache the read just filled — or, for the key paths its caller places,
# over the memory (or device) the bytes were read into. Only building tensors imports torch
# (and decoding a torch.dtype or torch.Size value): read_manifest(), verify() and check_blobs()
# check names, sizes and CRC-32s, so listing, inspecting and verifying never load it. A
# checkpoint held as its checked blobs (untrusted.hold_blobs: an object store's responses) is
# verified, its manifest read from there, its one load built over those buffers; manifest_of()
# checks a manifest read from elsewhere (an object's tail) as a file's.

"""Read one pitstop checkpoint file: its manifest, a subtree of tensors, or a full verify."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, Literal, TypeAlias

from pitstop.core.file.manifest import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MANIFEST_START,
    Footer,
    Manifest,
    check_footer,
    check_header,
    check_manifest_bytes,
    check_manifest_start,
    check_size,
    parse_manifest,
    parse_meta,
)
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint
from pitstop.shell.format import progress
from pitstop.shell.format.blobread import read_blobs
from pitstop.shell.format.checksums import crc32_update
from pitstop.shell.format.treecheck import (
    TensorRef,
    blob_places,
    build_tensors,
    check_dtypes,
    check_tree,
    from_held,
    resolve,
    subtree,
)
from pitstop.shell.format.treecodec import manifest_budget, partial_map, unpack, unpacker
from pitstop.shell.format.treewalk import ITEMSIZES, MAPPINGS, SEQUENCES
from pitstop.shell.format.untrusted import (
    NotRegularFile,
    held_manifest,
    open_untrusted,
    take_blobs,
    take_map,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ITEMSIZES",
    "KeyPath",
    "Place",
    "check_blobs",
    "load",
    "manifest_of",
    "read_manifest",
    "read_meta",
    "verify",
]

_HOLD_AFTER_CHECKING = 16 << 20  # a larger manifest is checksummed before it is held
_PIECE = 4 << 20

KeyPath = tuple[str | int, ...]
"""A stored value's key path from the root of the tree: ``("state", "optimizer", "state", 0)``."""

Place: TypeAlias = Callable[[KeyPath], "torch.device | None"]
"""Where :func:`load` puts a tensor, by its key path: ``None`` maps the file; a device (the
CPU included) reads the tensor's bytes into new memory there."""


def read_meta(
    path: str | os.PathLike[str], *, skip: Mapping[str, Collection[str]] | None = None
) -> Mapping[str, object]:
    """Read and check a checkpoint's header, footer, manifest checksum, format and meta: what a
    directory scan needs. The manifest's tree and tables are skipped, not decoded, so a scan
    costs about the manifest's bytes, whatever it holds; :func:`read_manifest`, :func:`load` and
    :func:`verify` decode and check the rest. ``skip={"sharded": ("values",)}`` also skips
    those entries of a meta map (a sharded layout's values: the scan lists its files).

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the file and what is wrong.
    """
    name = os.fspath(path)
    with _open(name) as file:
        data, version, _, _ = _manifest_bytes(file, name)
    fields: dict[str, object] = {}
    keys: set[object] = set()
    try:
        stream = unpacker(data, manifest_budget())
        for _ in range(stream.read_map_header()):
            key = stream.unpack()
            keys.add(key)
            if key == "format":
                fields[key] = stream.unpack()
            elif key == "meta":
                fields[key] = partial_map(stream, skip or {})
            else:
                stream.skip()
        if stream.tell() != len(data):
            raise CheckpointCorrupt(f"{len(data) - stream.tell()} bytes after the manifest's map")
    except CheckpointCorrupt as error:
        raise CheckpointCorrupt(f"{name}: manifest: {error}") from error
    except Exception as error:  # hostile bytes: whatever msgpack or a hook trips over
        raise CheckpointCorrupt(
            f"{name}: manifest: not a valid manifest encoding: {error!r}"
        ) from error
    return parse_meta(fields, keys, name=name, version=version, check_tree=check_tree)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check a checkpoint's header, footer and manifest; no tensor bytes are read.

    Cheap enough for directory scans. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming
    the file and what is wrong (an incomplete file has no valid footer).
    """
    name = os.fspath(path)
    held = held_manifest(name)  # a checkpoint held in memory as its blobs: checked already
    if held is not None:
        return held
    with _open(name) as file:
        return _read_manifest(file, name)


def load(
    path: str | os.PathLike[str],
    *,
    select: Sequence[str | int] | None = None,
    verify: bool | Literal["file"] = True,
    place: Place | None = None,
    drop_placed: bool = False,
) -> object:
    """Return the stored tree, or the subtree at key path ``select``, with CPU tensors.

    Tensors are memory-mapped copy-on-write: writing to them never changes the file. Tensors
    that shared storage when saved share one storage again. Only the blobs the selection needs
    are read; with ``verify=True`` (the default) each of them is checked against its CRC-32 as
    it is read, before any tensor is built. ``verify="file"`` checks every byte of the file in
    the same single pass, as :func:`verify` does, and loads from it. ``place(key_path)`` may
    put a tensor elsewhere: a device (``torch.device("cpu")`` included) gets a new tensor read
    straight into memory there — for tensors kept as they are rather than copied from — and
    ``None`` keeps it mapped; ``drop_placed`` lets the bytes read into such memory leave the
    page cache as they are read, or be read past it (for a file no other process reads after
    this one). Raises
    :class:`~pitstop.errors.CheckpointCorrupt` for a bad file and
    :class:`~pitstop.errors.IncompatibleCheckpoint` when ``select`` names no stored value.
    """
    if isinstance(select, (str, bytes)):
        raise TypeError(f"select is a sequence of keys, such as ('weights', 'ema'); got {select!r}")
    name = os.fspath(path)
    blobs = take_blobs(name)
    if blobs is not None:  # held in memory as its blobs, each checked as it arrived
        manifest = held_manifest(name)
        assert manifest is not None
        node, needed, devices = _wanted(manifest, select, place)
        return resolve(node, from_held(manifest, needed, devices, blobs))
    with _open(name) as file:
        manifest = _read_manifest(file, name)
        node, needed, devices = _wanted(manifest, select, place)
        tensors = _materialize(
            file, manifest, needed, devices, verify=verify, drop_placed=drop_placed
        )
    return resolve(node, tensors)


def _wanted(
    manifest: Manifest, select: Sequence[str | int] | None, place: Place | None
) -> tuple[object, list[int], dict[int, torch.device | None]]:
    """The subtree ``select`` names, its tensors' indices and where ``place`` puts each."""
    node = manifest.tree
    if select is not None:
        try:
            node = subtree(node, select)
        except KeyError as missing:
            raise IncompatibleCheckpoint(
                [f"{manifest.path}: the stored tree has no {missing.args[0]}"]
            ) from None
    paths: dict[int, KeyPath] = {}
    for index, key_path in _tensor_paths(node, tuple(select or ())):
        paths.setdefault(index, key_path)
    devices = {i: place(p) for i, p in paths.items()} if place is not None else {}
    return node, sorted(paths), devices


def _tensor_paths(tree: object, path: KeyPath) -> Iterator[tuple[int, KeyPath]]:
    """Each tensor reference of a checked tree, with its key path (the first, if shared)."""
    kind = type(tree)
    if kind is TensorRef:
        assert isinstance(tree, TensorRef)
        yield tree.index, path
    elif kind in MAPPINGS:
        assert isinstance(tree, dict)
        for key, value in tree.items():
            yield from _tensor_paths(value, (*path, key))
    elif kind in SEQUENCES:
        assert isinstance(tree, (list, tuple))
        for index, value in enumerate(tree):
            yield from _tensor_paths(value, (*path, index))


def verify(path: str | os.PathLike[str]) -> Manifest:
    """Check every byte of a checkpoint file.

    Checks the header, the footer, the manifest and its checksum, every descriptor, every blob's
    CRC-32, that every padding byte is zero and that no byte is unaccounted for — so any single
    changed byte, and any truncation, is detected (a checkpoint held as its blobs was, as they
    arrived). Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the file and what failed.
    Returns the manifest it checked."""
    name = os.fspath(path)
    held = held_manifest(name)
    if held is not None:
        return held
    with _open(name) as file:
        manifest = _read_manifest(file, name)
        _read_whole(file, manifest, {})
    return manifest


def _read_whole(
    file: BinaryIO,
    manifest: Manifest,
    places: Mapping[int, torch.device],
    *,
    drop_placed: bool = False,
) -> dict[int, torch.UntypedStorage]:
    """Check every blob and every padding byte in one pass; read blobs ``places`` names there."""
    with progress.task(f"verifying {manifest.path}", manifest.manifest_offset) as watched:
        return read_blobs(
            file,
            manifest,
            range(len(manifest.blobs)),
            places=places,
            padding=True,
            advance=watched.advance,
            drop_placed=drop_placed,
        )


def check_blobs(manifest: Manifest, indices: Iterable[int]) -> None:
    """Check the CRC-32 of the blobs ``indices`` of ``manifest``'s file, and only those.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the blob and its tensors.
    """
    with _open(manifest.path) as file:
        read_blobs(file, manifest, sorted(set(indices)))


def _open(name: str) -> BinaryIO:
    """Open a checkpoint file through the one reader of untrusted files: a FIFO, a device or a
    directory in its place is corrupt, refused before it is read."""
    try:
        return open_untrusted(name)
    except NotRegularFile as error:
        raise CheckpointCorrupt(f"{name}: not a checkpoint: {error.strerror}") from None


def _read_manifest(file: BinaryIO, name: str) -> Manifest:
    return _parsed(*_manifest_bytes(file, name), name)


def manifest_of(name: str, *, size: int, version: int, footer: Footer, data: bytes) -> Manifest:
    """The manifest of the file ``name`` (``size`` bytes, its header's ``version``, its checked
    ``footer``) from its bytes ``data`` (read from elsewhere: an object store's tail), checked
    as :func:`read_manifest` checks a file's; CheckpointCorrupt naming ``name``."""
    check_manifest_bytes(data, footer, name=name)
    return _parsed(data, version, footer, size, name)


def _parsed(data: bytes, version: int, footer: Footer, size: int, name: str) -> Manifest:
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
        itemsizes=ITEMSIZES,
        check_tree=check_tree,
    )


def _manifest_bytes(file: BinaryIO, name: str) -> tuple[bytes, int, Footer, int]:
    """The manifest's bytes, checked against the footer's checksum; the file's version, its
    footer and its size."""
    size = os.fstat(file.fileno()).st_size
    check_size(size, name=name)
    version = check_header(_read_at(file, 0, HEADER_SIZE, name), name=name)
    footer = check_footer(
        _read_at(file, size - FOOTER_SIZE, FOOTER_SIZE, name),
        name=name,
        size=size,
        version=version,
    )
    if footer.manifest_length > _HOLD_AFTER_CHECKING:
        _check_large_manifest(file, footer, name)
    data = _read_at(file, footer.manifest_offset, footer.manifest_length, name)
    check_manifest_bytes(data, footer, name=name)
    return data, version, footer, size


def _check_large_manifest(file: BinaryIO, footer: Footer, name: str) -> None:
    """Check a large manifest's start and checksum a piece at a time, so that a footer that
    claims one (over a sparse file, say) costs no memory before it is refused."""
    check_manifest_start(
        _read_at(file, footer.manifest_offset, len(MANIFEST_START), name), footer, name=name
    )
    crc = 0
    file.seek(footer.manifest_offset)
    left = footer.manifest_length
    while left:
        piece = file.read(min(left, _PIECE))
        if not piece:
            break
        crc = crc32_update(piece, crc)
        left -= len(piece)
    stop = footer.manifest_offset + footer.manifest_length
    if left or crc != footer.manifest_crc32:
        raise CheckpointCorrupt(
            f"{name}: manifest (bytes {footer.manifest_offset}..{stop}) fails its checksum"
        )


def _read_at(file: BinaryIO, offset: int, length: int, name: str) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise CheckpointCorrupt(
            f"{name}: the file ended early reading bytes {offset}..{offset + length}"
        )
    return data


def _materialize(
    file: BinaryIO,
    manifest: Manifest,
    needed: Sequence[int],
    devices: Mapping[int, torch.device | None],
    *,
    verify: bool | Literal["file"],
    drop_placed: bool,
) -> dict[int, torch.Tensor]:
    """Read and check what ``verify`` asks, then build tensors ``needed``: over a copy-on-write
    map of the file's data region, or over the storages placed blobs were read into."""
    import torch  # building tensors: the first use of torch in a read

    known = check_dtypes(manifest, needed)
    blobs = sorted({manifest.tensors[i].blob for i in needed})
    places = {b: d for b, d in blob_places(manifest, devices).items() if b in set(blobs)}
    if verify == "file":
        storages = _read_whole(file, manifest, places, drop_placed=drop_placed)
    else:
        storages = read_blobs(
            file, manifest, blobs, places=places, check=bool(verify), drop_placed=drop_placed
        )
    mapped_blobs = [i for i in blobs if i not in storages and manifest.blobs[i].length]
    # ACCESS_COPY: a private, writable mapping, so torch.frombuffer does not warn and writes to
    # loaded tensors never reach the file. Each blob becomes its own storage; torch keeps the
    # mapping alive for as long as any tensor over it lives.
    mapped = None
    if mapped_blobs:  # a memory file's writer may have left a map of it, its pages mapped
        mapped = take_map(manifest.path) or mmap.mmap(
            file.fileno(), manifest.manifest_offset, access=mmap.ACCESS_COPY
        )
    for index in blobs:
        blob = manifest.blobs[index]
        if index in storages:
            continue
        if blob.length == 0:
            storages[index] = torch.empty(0, dtype=torch.uint8).untyped_storage()
        else:
            storages[index] = torch.frombuffer(
                mapped, dtype=torch.uint8, count=blob.length, offset=blob.offset
            ).untyped_storage()
    return build_tensors(manifest, needed, storages, known)
