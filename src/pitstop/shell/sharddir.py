# A sharded checkpoint directory on disk: its files' checksums, its manifest, its publish and
# its deletion.
#
# Rules: a directory is a checkpoint once its manifest (`manifest.pitstop`, a pitstop file whose
# meta holds the layout) is in it, and the manifest is written last: by publish_file (temp
# name, fsync, rename, directory fsync), so that the names of every file the ranks wrote are
# durable with it. Then the temp directory is renamed to its final name and the parent fsynced.
# A deletion takes the manifest out first, durably, so whatever a crash leaves of the rest is
# no checkpoint. Each rank's table of the files it wrote takes their sizes and CRC-32s from what
# its writer's streams noted as they wrote and fsynced them (pitstop.shell.dcpwrite); a file
# without a note is fsynced and read back instead. A verification compares size (before
# reading a byte) and CRC-32 against the layout, and names the file that fails. Every file
# read is opened as untrusted input (regular files only, symlinks not followed).
# How: CRC-32 pieces on pitstop.shell.checksums' pool, joined with crc32_combine.

"""Sharded checkpoint directories: file tables, verify, write the manifest, publish, delete."""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from pitstop.core.sharded import (
    MANIFEST_NAME,
    ShardedLayout,
    ShardFile,
    file_problem,
    layout_from_wire,
    layout_to_wire,
)
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell import fileformat
from pitstop.shell.checksums import PIECE, Checksummer, CrcJob, crc32_combine, default_threads
from pitstop.shell.publish import publish_file
from pitstop.shell.storage import LocalStorage, Storage
from pitstop.shell.untrusted import open_untrusted

__all__ = [
    "delete_sharded",
    "file_table",
    "publish_sharded",
    "read_layout",
    "verify_sharded",
    "write_manifest",
]

_WINDOW = 4  # pieces of one file whose CRC may be in flight at once


# --- checksums --------------------------------------------------------------------------------


def _crc_file(file: BinaryIO, pool: Checksummer) -> tuple[int, int]:
    """The size and CRC-32 of ``file``, read once, its pieces checksummed on ``pool``."""
    crc = size = 0
    pending: collections.deque[tuple[CrcJob, int]] = collections.deque()
    while piece := file.read(PIECE):
        pending.append((pool.start(memoryview(piece)), len(piece)))
        size += len(piece)
        while len(pending) > _WINDOW:
            job, length = pending.popleft()
            crc = crc32_combine(crc, job.result(), length)
    for job, length in pending:
        crc = crc32_combine(crc, job.result(), length)
    return size, crc


def file_table(
    directory: Path,
    names: Iterable[str],
    rank: int,
    noted: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[ShardFile, ...]:
    """The table of the files ``names`` of ``directory`` that ``rank`` wrote.

    A file in ``noted`` (``{name: (size, crc32)}``, taken as it was written and fsynced:
    pitstop.shell.dcpwrite) is listed from there; any other is fsynced and read back to be
    checksummed. Raises :class:`~pitstop.errors.SaveError` naming the file that could not be.
    """
    storage = LocalStorage(directory)
    noted = noted or {}
    table = []
    with contextlib.ExitStack() as stack:
        pool: Checksummer | None = None
        for name in names:
            if name in noted:
                size, crc = noted[name]
                table.append(ShardFile(name=name, size=size, crc32=crc, rank=rank))
                continue
            if pool is None:
                pool = stack.enter_context(Checksummer(default_threads()))
            try:
                with open_untrusted(storage.path(name), follow_symlinks=False) as file:
                    storage.sync_file(file)
                    size, crc = _crc_file(file, pool)
            except (OSError, ValueError) as exc:
                raise SaveError(
                    f"could not fsync and checksum {storage.path(name)}: {exc}"
                ) from exc
            table.append(ShardFile(name=name, size=size, crc32=crc, rank=rank))
    return tuple(table)


def verify_sharded(
    directory: str | os.PathLike[str], layout: ShardedLayout, names: Iterable[str] | None = None
) -> None:
    """Check the size and CRC-32 of the files ``names`` (default: every file ``layout`` lists).

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the first file that is missing,
    has another size, fails its checksum, or is not in the layout at all.
    """
    root = Path(directory)
    wanted = [f.name for f in layout.files] if names is None else sorted(set(names))
    with Checksummer(default_threads()) as pool:
        for name in wanted:
            try:
                expected = layout.file(name)
            except KeyError:
                raise CheckpointCorrupt(f"{root}: the manifest lists no file {name}") from None
            try:
                file = open_untrusted(root / name, follow_symlinks=False)
            except FileNotFoundError:
                problem = file_problem(expected, None, None)
            except (OSError, ValueError) as exc:
                raise CheckpointCorrupt(f"{root}: {name} cannot be read: {exc}") from exc
            else:
                with file:
                    found = os.fstat(file.fileno()).st_size
                    size, crc = (found, None) if found != expected.size else _crc_file(file, pool)
                problem = file_problem(expected, size, crc)
            if problem is not None:
                raise CheckpointCorrupt(f"{root}: {problem}")


# --- publishing -------------------------------------------------------------------------------


def write_manifest(
    directory: str | os.PathLike[str],
    layout: ShardedLayout,
    meta: Mapping[str, object],
    tree: object = None,
    *,
    token: str | None = None,
) -> None:
    """Rank 0: write ``manifest.pitstop`` into the finished ``directory``, last, durably.

    A pitstop file holding ``tree`` (replicated state: scheduler, RNG, ...) and ``meta``, with
    the layout under ``"sharded"``. Its publish fsyncs the directory, so the names of every
    rank's files are durable once it returns.
    """
    prepared = fileformat.prepare({} if tree is None else tree)
    full = {**meta, "sharded": layout_to_wire(layout)}
    publish_file(
        LocalStorage(directory),
        MANIFEST_NAME,
        token or secrets.token_hex(6),
        lambda file, sync: fileformat.write(file, prepared, full, sync=sync),
    )


def publish_sharded(storage: Storage, temp: str, name: str) -> None:
    """Rank 0: rename the finished temp directory ``temp`` to ``name``, then fsync the parent.

    Raises :class:`~pitstop.errors.SaveError`; then neither ``temp`` nor ``name`` is left.
    """
    renamed = False
    try:
        storage.replace(temp, name)
        renamed = True
        storage.sync_directory()
    except OSError as exc:
        shutil.rmtree(storage.path(name if renamed else temp), ignore_errors=True)
        with contextlib.suppress(OSError):
            storage.sync_directory()
        raise SaveError(f"could not publish {storage.path(name)}: {exc}") from exc


def delete_sharded(storage: Storage, name: str) -> None:
    """Delete the sharded checkpoint ``name``: its manifest first, durably (from then on it is
    no checkpoint, whatever a crash leaves of the rest), then the directory."""
    inside = LocalStorage(storage.path(name))
    with contextlib.suppress(FileNotFoundError):
        inside.remove(MANIFEST_NAME)
        inside.sync_directory()
    shutil.rmtree(inside.root)
    storage.sync_directory()


# --- reading ----------------------------------------------------------------------------------


def read_layout(directory: str | os.PathLike[str]) -> tuple[ShardedLayout, Mapping[str, Any]]:
    """The layout and meta in a sharded checkpoint's manifest (no tensor bytes are read).

    Raises :class:`~pitstop.errors.CheckpointCorrupt` for a missing or bad manifest.
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = fileformat.read_manifest(path)
    except OSError as exc:
        raise CheckpointCorrupt(f"{directory}: no readable {MANIFEST_NAME}: {exc}") from exc
    return layout_from_wire(manifest.meta.get("sharded"), f"{path}: sharded"), manifest.meta
