"""Checkpoint files written byte by byte, as a hostile or foreign writer would: for tests."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgpack


def assemble(
    path: Path,
    manifest: bytes,
    data: bytes = b"",
    *,
    version: int = 1,
    flags: int = 0,
    manifest_offset: int | None = None,
    manifest_length: int | None = None,
) -> Path:
    """Write a file of ``manifest`` after ``data``, its header and footer valid (or as the
    keywords say) and return its path."""
    head = struct.pack("<8sII44s", b"PITSTOP\0", version, flags, bytes(44))
    offset = 64 + len(data) if manifest_offset is None else manifest_offset
    length = len(manifest) if manifest_length is None else manifest_length
    foot = struct.pack("<8sIIQQI", b"\0POTSTIP", version, 0, offset, length, zlib.crc32(manifest))
    path.write_bytes(
        head
        + struct.pack("<I", zlib.crc32(head))
        + data
        + manifest
        + foot
        + struct.pack("<I", zlib.crc32(foot))
    )
    return path


def tensor_ref(index: int) -> msgpack.ExtType:
    """The manifest's reference to row ``index`` of its tensor table."""
    return msgpack.ExtType(7, msgpack.packb(index))


DATA = struct.pack("<2f", 1.5, -2.0)


def document(**changes: object) -> dict[str, object]:
    """A valid manifest for ``DATA`` (one float32 tensor ``x``), with ``changes`` made."""
    doc: dict[str, object] = {
        "format": 1,
        "tree": {"x": tensor_ref(0)},
        "tensors": [
            {
                "blob": 0,
                "offset": 0,
                "dtype": "float32",
                "shape": [2],
                "stride": [1],
                "storage_offset": 0,
            }
        ],
        "blobs": [{"offset": 64, "length": 8, "crc32": zlib.crc32(DATA)}],
        "meta": {},
    }
    doc.update(changes)
    return doc


def packed(doc: object) -> bytes:
    """``doc`` as msgpack."""
    data: bytes = msgpack.packb(doc, use_bin_type=True)
    return data
