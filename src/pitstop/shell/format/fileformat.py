# The checkpoint file: one file per checkpoint, read without ever running code.
#
# Rules: [64-byte header][data: each storage span once, 64-byte aligned, zero padding between]
# [msgpack manifest][40-byte footer], all little-endian; docs/file-format.md has every byte.
# A file without a valid footer is incomplete. The pieces, each with one reason to change:
#   pitstop.core.file.framing     header/footer structs: pure packing and checks
#   pitstop.core.file.manifest    the manifest's tables: pure checks
#   pitstop.core.file.layout      where tensor bytes go
#   pitstop.shell.format.treewalk   what a tree may hold (every path that saves one walks with it)
#   pitstop.shell.format.treecodec  the tree <-> msgpack
#   pitstop.shell.format.filewrite  prepare() and write(): check, lay out, stream, checksum
#   pitstop.shell.format.fileread   read_manifest(), read_meta(), load(), verify(), check_blobs()
# How: this module only gathers their public names, so callers import one place.

"""The pitstop checkpoint file format: write, read, load and verify one checkpoint file."""

from __future__ import annotations

from pitstop.core.file.manifest import (
    ALIGNMENT,
    FOOTER_MAGIC,
    FOOTER_SIZE,
    FORMAT_VERSION,
    HEADER_MAGIC,
    HEADER_SIZE,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_NODES,
    MAX_NDIM,
    Blob,
    Manifest,
    TensorDescriptor,
)
from pitstop.shell.format.fileread import (
    ITEMSIZES,
    check_blobs,
    load,
    read_manifest,
    read_meta,
    verify,
)
from pitstop.shell.format.filewrite import Prepared, prepare, write
from pitstop.shell.format.treecheck import TensorRef

__all__ = [
    "ALIGNMENT",
    "FOOTER_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_MAGIC",
    "HEADER_SIZE",
    "ITEMSIZES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_NODES",
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
    "read_meta",
    "verify",
    "write",
]
