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
# The sender of a catch-up copy checks its own copy the same way as it reads it for sending
# (CheckedReads: the same Arrival over the pieces read), so that it need not verify it before:
# a problem found is kept, not raised — the copy still goes out whole, and its receiver's check
# finds the same — and said once the copy is sent.
# How: a callable ``look`` for peers.receive, the temp file flushed before its manifest is read.

"""Checking a checkpoint file as its chunks arrive from a peer, against its own manifest."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO

from pitstop.core.file.manifest import FOOTER_SIZE, HEADER_SIZE, check_footer, check_header
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.format.blobfile import PieceCheck
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.peers import send

__all__ = ["Arrival", "CheckedReads", "send_checked", "tail_start"]


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


class CheckedReads:
    """The sender's checkpoint ``file`` (at ``path``), every piece read checked as an
    :class:`Arrival` checks it (``name``: the file in messages): what is wrong with it is kept
    (:attr:`problem`: a failed check or read), never raised by a read that succeeded, so the
    copy still goes out whole."""

    def __init__(self, file: BinaryIO, path: str | os.PathLike[str], name: str) -> None:
        self.file, self.look, self.at = file, Arrival(file, path, name), 0
        self.problem: str | None = None

    def seek(self, offset: int) -> int:
        """Move to ``offset``, as the file's own seek."""
        self.at = offset
        return self.file.seek(offset)

    def readinto(self, buffer: memoryview) -> int:
        """Read into ``buffer`` as the file's own readinto, then check what was read."""
        try:
            got = self.file.readinto(buffer) or 0  # type: ignore[attr-defined]
        except OSError as exc:
            self.problem = self.problem or f"{self.look.name}: {exc}"
            raise
        if got and self.problem is None:
            try:
                self.look(memoryview(buffer).cast("B")[:got], self.at)
            except CheckpointCorrupt as exc:
                self.problem = str(exc)
        self.at += got
        return got

    def finish(self) -> str | None:
        """What is wrong with the file as it was read whole (``None``: every check passed)."""
        if self.problem is None:
            try:
                self.look.finish()
            except CheckpointCorrupt as exc:
                self.problem = str(exc)
        return self.problem


def send_checked(ranks: Ranks, target: int, path: Path) -> str | None:
    """Send the checkpoint ``path`` to ``target`` (as send_file with ``checkpoint``), every
    piece checked as it is read (CheckedReads); what is wrong with this copy, or ``None``. A
    copy that failed on its way (not this file) raises."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        with contextlib.suppress(SaveError):  # its receiver hears it could not be opened
            send(ranks, target, None, 0, str(path))
        return str(exc) or type(exc).__name__
    with file:
        size = os.fstat(file.fileno()).st_size
        first = tail_start(file, size)
        reads = CheckedReads(file, path, str(path))
        try:
            send(ranks, target, reads, size, str(path), first=first, crc=False, stream=True)  # type: ignore[arg-type]
        except SaveError:
            if reads.problem is not None:  # its own read failed
                return reads.problem
            raise
        return reads.finish()
