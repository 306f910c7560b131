# A checkpoint file received from a peer, checked as its chunks land: one pass, no second read.
#
# Rules: the sender reads its file's header and footer (the core's framing checks) and sends
# the manifest and footer first (from the footer's manifest offset to the end), then the
# header and data region in order (pitstop.shell.ranks.peers: send's ``first``). Once the
# receiver has written the tail and the first chunk (the header), it reads the manifest from
# what it wrote, as a local file's is read (header, footer, manifest checksum, every
# descriptor); a manifest that starts after the bytes sent first is corrupt (data bytes sent
# first would go unchecked). Each data chunk after it is checked as the S3 download checks a
# range (pitstop.shell.format.blobfile.PieceCheck: each blob's CRC-32 joined from its pieces
# and compared with the manifest's once whole, every padding byte zero), and finish() asks
# that every blob was whole. So every byte is checked as a local verify checks it — against the
# file's own checksums, so a byte changed in transit or on the sender's disk is caught — in the
# pass that writes it; the resume then loads what was written without checking it again.
# A sender whose file has no valid header or footer sends it in order, and the receiver's
# manifest check fails.
# How: a callable ``look`` for peers.receive, the temp file flushed before its manifest is read.

"""Checking a checkpoint file as its chunks arrive from a peer, against its own manifest."""

from __future__ import annotations

import os
from typing import BinaryIO

from pitstop.core.file.manifest import FOOTER_SIZE, HEADER_SIZE, check_footer, check_header
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat
from pitstop.shell.format.blobfile import PieceCheck

__all__ = ["Arrival", "tail_start"]


def tail_start(file: BinaryIO, size: int) -> int:
    """Where the manifest of the checkpoint ``file`` (``size`` bytes) starts, as its header
    and footer say: the offset a peer sends from first. ``size`` when they are not valid (the
    file is sent in order, and its receiver's check fails)."""
    try:
        if size < HEADER_SIZE + FOOTER_SIZE:
            return size
        file.seek(0)
        version = check_header(file.read(HEADER_SIZE), name="")
        file.seek(size - FOOTER_SIZE)
        footer = check_footer(file.read(FOOTER_SIZE), name="", size=size, version=version)
    except (CheckpointCorrupt, OSError):
        return size
    finally:
        file.seek(0)
    return footer.manifest_offset


class Arrival:
    """The checks of one checkpoint file as :func:`~pitstop.shell.ranks.peers.receive` writes
    it into ``file`` (the temp file at ``path``); ``name``: the file in messages."""

    def __init__(self, file: BinaryIO, path: str | os.PathLike[str], name: str) -> None:
        self.file, self.path, self.name = file, path, name
        self.checks: PieceCheck | None = None
        self.first: int | None = None  # where the bytes sent first began

    def __call__(self, data: memoryview, offset: int) -> None:
        """Check the chunk ``data`` just written at ``offset``."""
        if self.first is None:
            self.first = offset  # the tail's start; the header's chunk when 0
        if offset == 0:
            self.checks = self._manifest()
        checks = self.checks
        if checks is None:
            return  # the tail: checked with the manifest
        stop = min(offset + data.nbytes, checks.manifest.manifest_offset)
        start = max(offset, HEADER_SIZE)
        if stop > start:
            checks.note(checks.piece(data[start - offset : stop - offset], start))

    def _manifest(self) -> PieceCheck:
        """The manifest, read from what was written: the tail and the header."""
        self.file.flush()
        try:
            manifest = fileformat.read_manifest(self.path)
        except CheckpointCorrupt as exc:
            raise CheckpointCorrupt(f"{self.name}: {exc}") from None
        first = self.first or 0
        if 0 < first < manifest.manifest_offset:  # data sent first would go unchecked
            raise CheckpointCorrupt(
                f"{self.name}: its manifest starts at byte {manifest.manifest_offset}, but the "
                f"bytes sent first began at {first}"
            )
        return PieceCheck(manifest, self.name)

    def finish(self) -> None:
        """Every blob arrived whole and matched (raise CheckpointCorrupt otherwise)."""
        if self.checks is None:
            raise CheckpointCorrupt(f"{self.name}: its header never arrived")
        self.checks.finish()
