# A sharded checkpoint directory on disk: its files' checksums, its manifest, its publish and
# its deletion.
#
# Rules: a directory is a checkpoint once its manifest (`manifest.pitstop`, a pitstop file whose
# meta holds the layout) is in it, and the manifest is written last: by publish_file (temp
# name, fsync, rename, directory fsync), so that the names of every file the ranks wrote are
# durable with it. Then the temp directory is renamed to its final name and the parent fsynced;
# a checkpoint of that name it replaces is moved aside first (a directory cannot be renamed over
# another) and removed only once the new one is in place and durable. A failure part-way is
# settled as pitstop.core.replacement says, from what is under each name: the real name holds
# the old checkpoint or the new one, never neither; opening a directory settles what a writer
# that died left aside the same way (put back, or removed once the new one is in place).
# A deletion takes the manifest out first, durably, so whatever a crash leaves of the rest is
# no checkpoint. Each rank's table of the files it wrote takes their sizes and CRC-32s from what
# its writer's streams noted as they wrote and fsynced them (pitstop.shell.sharded.dcpwrite); a file
# without a note is fsynced and read back instead. A verification compares size (before
# reading a byte) and CRC-32 against the layout, and names the file that fails. Every file
# read is opened as untrusted input (regular files only, symlinks not followed). On object
# storage there is no rename: the manifest is written into the staging folder and the
# checkpoint is committed by one conditional PUT (pitstop.shell.store.shardobjects).
# How: CRC-32 pieces on pitstop.shell.format.checksums' pool, joined with crc32_combine.

"""Sharded checkpoint directories: file tables, verify, write the manifest, publish, delete."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from pitstop.core.naming import NOT_A_CHECKPOINT, parse_aside
from pitstop.core.replacement import Found, Holds, Settlement, settle_replacement
from pitstop.core.sharding.layoutwire import layout_from_wire, layout_to_wire
from pitstop.core.sharding.shardcover import part_here
from pitstop.core.sharding.sharded import (
    MANIFEST_NAME,
    ShardedLayout,
    ShardFile,
    file_problem,
)
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.format.checksums import (
    PIECE,
    Checksummer,
    CrcJob,
    crc32_combine,
    default_threads,
)
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.publish import delete_sharded, publish_file
from pitstop.shell.store.shardobjects import publish_objects
from pitstop.shell.store.storage import FileKind, LocalStorage, Storage

__all__ = [
    "Part",
    "clear_leftover",
    "file_table",
    "part_held",
    "prefetch",
    "publish_sharded",
    "read_layout",
    "verify_sharded",
    "write_manifest",
]

_WINDOW = 4  # pieces of one file whose CRC may be in flight at once

log = logging.getLogger("pitstop")


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
    pitstop.shell.sharded.dcpwrite) is listed from there; any other is fsynced and read back to be
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
    directory: str | os.PathLike[str],
    layout: ShardedLayout,
    names: Iterable[str] | None = None,
    *,
    arrived: Mapping[str, tuple[int, int]] | None = None,
) -> None:
    """Check the size and CRC-32 of the files ``names`` (default: every file ``layout`` lists).

    ``arrived``: ``{file: (size, CRC-32)}`` of files whose bytes were checksummed as they were
    downloaded (pitstop.shell.store.objectread.download_files): compared with the layout
    without reading them again. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the
    first file that is missing, has another size, fails its checksum, or is not in the layout.
    """
    root = Path(directory)
    wanted = [f.name for f in layout.files] if names is None else sorted(set(names))
    arrived = arrived or {}
    with Checksummer(default_threads()) as pool:
        for name in wanted:
            try:
                expected = layout.file(name)
            except KeyError:
                raise CheckpointCorrupt(f"{root}: the manifest lists no file {name}") from None
            if name in arrived:
                problem = file_problem(expected, *arrived[name])
                if problem is not None:
                    raise CheckpointCorrupt(f"{root}: {problem}")
                continue
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


def prefetch(
    directory: str | os.PathLike[str], regions: Iterable[tuple[str, int, int]]
) -> threading.Thread | None:
    """Ask the OS to start reading ``regions`` of the files of ``directory`` — ``(name,
    start, length)``, a length of 0 to the end — into the page cache now
    (``POSIX_FADV_WILLNEED``, where it has it), from a thread of its own, returned (the
    hint itself can take milliseconds: the caller goes on with other work before it reads
    them). Only a hint: a file that cannot be opened is left for the read to name."""
    if not hasattr(os, "posix_fadvise"):
        return None
    root = Path(directory)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for name, start, length in regions:
        wanted.setdefault(name, []).append((start, length))

    def hint() -> None:
        for name, spans in wanted.items():
            try:
                with open_untrusted(root / name, follow_symlinks=False) as file:
                    for start, length in spans:
                        os.posix_fadvise(file.fileno(), start, length, os.POSIX_FADV_WILLNEED)
            except (OSError, ValueError):
                continue

    thread = threading.Thread(target=hint, name="pitstop-prefetch", daemon=True)
    thread.start()
    return thread


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


def publish_sharded(
    storage: Storage,
    temp: str,
    name: str,
    *,
    aside: str | None = None,
    replaced: Callable[[], None] | None = None,
    manifest: Callable[[Path], None] | None = None,
) -> None:
    """Rank 0: rename the finished temp directory ``temp`` to ``name``, then fsync the parent.

    ``manifest(directory)``, if given, first writes the manifest into ``temp`` (last, durably).
    ``aside``: ``name`` holds a checkpoint this one replaces; it is moved to ``aside`` first
    and removed once the new one is durable (if that fails, a warning: the directory's next
    open removes it). ``replaced()`` is called once the new one has taken its place for good.
    Raises :class:`~pitstop.errors.SaveError` naming ``name``, the failed step and what
    ``name`` holds then: the old checkpoint (put back), nothing (no checkpoint was there), or —
    once the new one had replaced the old one — the new one; the temp directory is gone.
    """
    path = storage.path(name)
    step = f"write the manifest of the new {path}"
    if isinstance(storage, ObjectStorage):  # no rename: one conditional commit (shardobjects)
        publish_objects(storage, temp, name, replaced=replaced, manifest=manifest)
        return
    try:
        if manifest is not None:
            manifest(storage.path(temp))  # its own errors are SaveErrors naming the manifest
        if aside is not None:
            step = f"move {path} aside"
            storage.replace(name, aside)
        step = f"rename the new {path} into place"
        storage.replace(temp, name)
        step = f"fsync the directory of {path}"
        storage.sync_directory()
        if aside is not None and replaced is not None:
            replaced()
    except BaseException as exc:
        note = _settle(storage, temp, name, aside, replaced)
        if isinstance(exc, Exception) and not isinstance(exc, SaveError):
            raise SaveError(f"could not {step}: {exc}{note}") from exc
        raise
    if aside is not None:
        _remove_quietly(storage, aside, name)


def _found(storage: Storage, name: str) -> Found:
    """What is under ``name``: a sharded checkpoint (a directory with its manifest), missing,
    anything else, or unknown (it could not be looked at)."""
    try:
        kind = storage.kind(name)
        if kind is FileKind.MISSING:
            return Found.MISSING
        if kind is not FileKind.DIRECTORY:
            return Found.INCOMPLETE
        manifest = LocalStorage(storage.path(name)).kind(MANIFEST_NAME)
    except (OSError, ValueError):
        return Found.UNKNOWN
    return Found.COMPLETE if manifest is FileKind.REGULAR else Found.INCOMPLETE


def _settle(
    storage: Storage,
    temp: str,
    name: str,
    aside: str | None,
    replaced: Callable[[], None] | None,
) -> str:
    """Carry out the core's settlement of a publish of ``temp`` as ``name`` that failed; what
    the error adds about what ``name`` holds then."""
    plan = settle_replacement(
        replacing=aside is not None,
        temp=_found(storage, temp),
        aside=Found.MISSING if aside is None else _found(storage, aside),
        final=_found(storage, name),
    )
    path, holds, note = storage.path(name), plan.holds, ""
    if plan.remove_temp:
        shutil.rmtree(storage.path(temp), ignore_errors=True)
    if plan.remove_final:
        try:
            delete_sharded(storage, name)
        except OSError as exc:
            if _found(storage, name) is Found.COMPLETE:  # its manifest could not be removed
                holds = Holds.NEW
                note = f"; {path} could not be taken out again ({exc}): it stays, complete"
    if aside is not None and plan.restore:
        try:
            storage.replace(aside, name)
        except OSError as exc:
            holds = Holds.NOTHING
            note = (
                f"; the old checkpoint could not be put back ({exc}): it is whole, at "
                f"{storage.path(aside)}, and the directory's next open puts it back as {path}"
            )
    if aside is not None and plan.remove_aside:
        _remove_quietly(storage, aside, name)
    with contextlib.suppress(OSError):
        storage.sync_directory()
    if holds is Holds.NEW and replaced is not None:
        replaced()
    return note or _holds_note(plan, holds, path)


def _holds_note(plan: Settlement, holds: Holds, path: Path) -> str:
    if holds is Holds.NEW:
        return (
            f"; {path} holds the new checkpoint, complete (the one it replaced is gone; the "
            "rename may not be durable)"
        )
    if holds is Holds.OLD and plan.restore:
        return f"; {path} holds the old checkpoint again, as before"
    if holds is Holds.UNKNOWN:
        return (
            f"; {path} holds what this save did not put there, or could not be looked at: it "
            "is left as it is"
        )
    return ""


def _remove_quietly(storage: Storage, aside: str, name: str) -> None:
    """Remove the old checkpoint moved to ``aside``, the new ``name`` in place; a failure is
    logged (the directory's next open removes what is left)."""
    try:
        delete_sharded(storage, aside)
    except OSError as exc:
        log.warning(
            "could not remove %s, the checkpoint the new %s replaced (the directory's next "
            "open removes it): %s",
            storage.path(aside),
            storage.path(name),
            exc,
        )


def clear_leftover(storage: Storage, name: str) -> None:
    """Opening a directory for writing (under its lock): settle the temp entry ``name`` a
    writer that died left. A checkpoint it was replacing, moved aside, is put back when its
    name is free and removed when the new one is in place (as the core's settlement says); any
    other temp file or directory is removed. Raises :class:`~pitstop.errors.SaveError` naming
    both paths when one cannot be put back."""
    final = parse_aside(name)
    path = storage.path(name)
    if final is NOT_A_CHECKPOINT:
        log.warning("removing %s, left by a writer that died", path)
        with contextlib.suppress(FileNotFoundError):
            if storage.kind(name) is FileKind.DIRECTORY:
                shutil.rmtree(path)  # a sharded save's
            else:
                storage.remove(name)
        return
    aside, held = _found(storage, name), _found(storage, final)
    plan = settle_replacement(replacing=True, temp=Found.MISSING, aside=aside, final=held)
    if plan.restore:
        log.warning(
            "putting %s back as %s: a save that was replacing it stopped part-way",
            path,
            storage.path(final),
        )
        try:
            storage.replace(name, final)
            storage.sync_directory()
        except OSError as exc:
            raise SaveError(
                f"could not put {path} back as {storage.path(final)} (it is the checkpoint of "
                f"that name, moved aside by a save that stopped part-way): {exc}"
            ) from exc
    elif plan.remove_aside:
        log.warning("removing %s: %s replaced it", path, storage.path(final))
        delete_sharded(storage, name)
    else:
        log.warning(
            "leaving %s as it is: it is the checkpoint %s, moved aside by a save that stopped "
            "part-way, and cannot go back (that name is taken by no checkpoint, or one of the "
            "two could not be looked at); put it back by hand",
            path,
            storage.path(final),
        )


# --- reading ----------------------------------------------------------------------------------


def read_layout(
    directory: str | os.PathLike[str], manifest: fileformat.Manifest | None = None
) -> tuple[ShardedLayout, Mapping[str, Any]]:
    """The layout and meta in a sharded checkpoint's manifest (no tensor bytes are read), or
    in ``manifest``, that manifest already read.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` for a missing or bad manifest.
    """
    path = Path(directory) / MANIFEST_NAME
    if manifest is None:
        try:
            manifest = fileformat.read_manifest(path)
        except OSError as exc:
            raise CheckpointCorrupt(f"{directory}: no readable {MANIFEST_NAME}: {exc}") from exc
    where = f"{path}: sharded"
    layout = layout_from_wire(manifest.meta.get("sharded"), where, itemsizes=fileformat.ITEMSIZES)
    return layout, manifest.meta


Part = tuple[int, int, tuple[int, ...], tuple[str, ...]]
"""What one directory holds of a sharded checkpoint: files here, files listed, the ranks that
wrote those absent, and their names."""


def part_held(directory: str | os.PathLike[str]) -> Part:
    """What ``directory`` holds of the files its manifest lists (present, not checked: a node
    of a job whose ranks share no directory holds its own ranks' files). Raises
    :class:`~pitstop.errors.CheckpointCorrupt` for a missing or bad manifest."""
    root = Path(directory)
    layout, _ = read_layout(root)
    files = [(f.name, f.rank) for f in layout.files]
    present = {name for name, _ in files if os.path.lexists(root / name)}
    here, listed, ranks = part_here(files, present)
    return here, listed, ranks, tuple(sorted(n for n, _ in files if n not in present))
