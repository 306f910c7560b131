# How a checkpoint file is framed: its 64-byte header and its 40-byte footer.
#
# Rules: a file is [64-byte header][data][manifest][40-byte footer], all little-endian
# (docs/file-format.md has every byte). The header and the footer carry their own CRC-32; the
# footer also places the manifest (offset, length) and carries its CRC-32. A reader accepts
# only what a writer of versions 1..FORMAT_VERSION produces: the magics, no flags or reserved
# bytes, the same version in both, a manifest of at most MAX_MANIFEST_BYTES that begins after
# the header and ends where the footer starts — checked before anything is allocated. Every
# failure is a CheckpointCorrupt naming the file and the offending field.
# How: struct packing and checking of the two fixed-size records; what lies between them is
# pitstop.core.file.manifest's.

"""The checkpoint file's header and footer: packing and checking them."""

from __future__ import annotations

import struct
import zlib
from typing import Final

import attrs

from pitstop.errors import CheckpointCorrupt

__all__ = [
    "FOOTER_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_MAGIC",
    "HEADER_SIZE",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_NODES",
    "Footer",
    "check_footer",
    "check_header",
    "check_size",
    "pack_footer",
    "pack_header",
]

FORMAT_VERSION: Final = 2  # 2 adds NumPy values (tree ext 8 and 9); 1 is read too
OLDEST_VERSION: Final = 1
"""The version a file is written in when it needs nothing newer (no NumPy values): the oldest
pitstop that reads that version reads it."""
HEADER_MAGIC: Final = b"PITSTOP\0"
FOOTER_MAGIC: Final = b"\0POTSTIP"
HEADER_SIZE: Final = 64
FOOTER_SIZE: Final = 40
MAX_MANIFEST_BYTES: Final = 1 << 30
MAX_MANIFEST_NODES: Final = 1 << 24
"""The most values a manifest may hold, counting each map or array once and each of its items
(a map's keys and values both): 16,777,216. A reader stops decoding past it, so a manifest
costs at most about 50 bytes of memory per value (measured: docs/file-format.md)."""

# magic, version, flags, reserved, crc32 of the 60 bytes before it
_HEADER: Final = struct.Struct("<8sII44sI")
# magic, version, flags, manifest offset, manifest length, manifest crc32, crc32 of the 36 before
_FOOTER: Final = struct.Struct("<8sIIQQII")
assert _HEADER.size == HEADER_SIZE
assert _FOOTER.size == FOOTER_SIZE


@attrs.frozen(kw_only=True)
class Footer:
    """What a footer says: the format version and where the manifest is, with its CRC-32."""

    version: int
    manifest_offset: int
    manifest_length: int
    manifest_crc32: int


def pack_header(version: int = FORMAT_VERSION) -> bytes:
    """The 64-byte header of a file this pitstop writes (in format ``version``)."""
    body = _HEADER.pack(HEADER_MAGIC, version, 0, bytes(44), 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def pack_footer(
    manifest_offset: int, manifest_length: int, manifest_crc32: int, version: int = FORMAT_VERSION
) -> bytes:
    """The 40-byte footer placing a manifest of ``manifest_length`` bytes at ``manifest_offset``."""
    body = _FOOTER.pack(
        FOOTER_MAGIC, version, 0, manifest_offset, manifest_length, manifest_crc32, 0
    )[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def check_size(size: int, *, name: str) -> None:
    """Refuse a file of ``size`` bytes that cannot hold a header, a manifest and a footer."""
    if size < HEADER_SIZE + FOOTER_SIZE + 1:
        raise CheckpointCorrupt(
            f"{name}: {size} bytes is too small for a checkpoint; the file is incomplete"
        )


def check_header(header: bytes, *, name: str) -> int:
    """Check the 64 header bytes of file ``name``; return its format version."""
    if len(header) != HEADER_SIZE:
        raise CheckpointCorrupt(
            f"{name}: header is {len(header)} bytes, not {HEADER_SIZE}; the file is incomplete"
        )
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


def check_footer(footer: bytes, *, name: str, size: int, version: int) -> Footer:
    """Check the last 40 bytes of file ``name`` (``size`` bytes, header ``version``)."""
    if len(footer) != FOOTER_SIZE:
        raise CheckpointCorrupt(
            f"{name}: footer is {len(footer)} bytes, not {FOOTER_SIZE}; the file is incomplete"
        )
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
    return Footer(
        version=int(footer_version),
        manifest_offset=int(offset),
        manifest_length=int(length),
        manifest_crc32=int(checksum),
    )
