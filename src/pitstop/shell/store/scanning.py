# Reading a checkpoint directory: what it holds, and which checkpoint a resume would use.
#
# Rules: scanning reads names (classified by the core) and each checkpoint's footer, manifest
# checksum and meta (never its tree, tables or tensor bytes: a scan costs about the manifests'
# bytes, whatever they hold), builds the catalog, and hands the pointers found on disk — symlinks
# and latest.json, both untrusted — to the core to reconcile. A symlink is only followed when
# its target is a plain checkpoint name of this directory. A sharded checkpoint (a directory,
# pitstop.shell.store.sharddir) is listed once its manifest reads back. Choosing a resume point
# tries the core's resume order until a candidate verifies, warning about each one skipped.
# On an object store the listing reads every entry it names at once (RemoteStorage.listed).
# Readers take no lock, so a live writer's retention may delete a checkpoint between the listing
# and the reading: one that fails to read and is no longer there is "gone" (``Scan.gone``,
# ``ResumeChoice.gone``), never "unreadable" or "corrupt": the scan starts over (the newer one
# was published before the prune), and a reader whose chosen checkpoint vanished scans again.
# How: a Storage underneath, so a fault-injecting fake can stand in for the disk.

"""Scanning a checkpoint directory and choosing the checkpoint to resume from."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from pitstop.core.metadata import (
    checked_best_value,
    entry_from_meta,
    pointers_from_latest_json,
)
from pitstop.core.naming import (
    LATEST_JSON,
    NOT_A_CHECKPOINT,
    EntryKind,
    classify,
    parse_checkpoint,
    parse_name,
    parse_sharded_name,
)
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    PointerName,
    Pointers,
)
from pitstop.core.saving.pointers import reconcile_pointers, resume_order
from pitstop.core.sharding.layoutwire import files_from_wire
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat
from pitstop.shell.format.untrusted import held
from pitstop.shell.store.storage import FileKind, RemoteStorage, Storage, fetch

__all__ = [
    "LATEST_JSON_LIMIT",
    "ResumeChoice",
    "Scan",
    "choose_resume",
    "gone_while_read",
    "is_sharded_path",
    "named_by_pointers",
    "read_latest_json",
    "scan",
    "vanished",
    "verify_any",
]

log = logging.getLogger("pitstop")

LATEST_JSON_LIMIT = 1 << 20
"""The largest latest.json a reader accepts (a real one is well under a kilobyte)."""


@attrs.frozen(kw_only=True)
class Scan:
    """What a checkpoint directory holds.

    ``catalog``: the checkpoints whose manifest reads back. ``pointers``: reconciled, so every
    target is in the catalog. ``unreadable``: checkpoint-named files left out, and why.
    ``sizes``: bytes per catalog entry. ``warnings``: everything ignored or repaired.
    ``gone``: checkpoints listed that were deleted before they could be read (a live run's
    retention): neither in the catalog nor unreadable; a reader that needs them scans again.
    """

    catalog: Catalog
    pointers: Pointers
    unreadable: Mapping[str, str]
    sizes: Mapping[str, int]
    warnings: tuple[str, ...]
    gone: frozenset[str] = frozenset()


def vanished(path: Path) -> bool:
    """Whether nothing is at ``path`` any more (not following a symlink): what a read that
    failed is told by — a checkpoint deleted while it was read is gone, not corrupt."""
    if held(path):  # a checkpoint read into memory
        return False
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def gone_while_read(storage: Storage, path: Path, error: BaseException) -> bool:
    """Whether a read of ``path`` that raised ``error`` failed because the checkpoint is gone
    (deleted meanwhile), not corrupt: nothing is at ``path`` any more — or, on an object
    store, its objects are not (another writer's retention deleted them)."""
    if isinstance(storage, RemoteStorage):
        return isinstance(error, FileNotFoundError)
    return vanished(path)


def _read_links(storage: Storage, warnings: list[str]) -> Pointers:
    targets: dict[PointerName, str | NoCheckpoint] = dict.fromkeys(PointerName, NO_CHECKPOINT)
    for pointer in PointerName:
        kind = storage.kind(pointer.value)
        if kind is FileKind.MISSING:
            continue
        if kind is not FileKind.SYMLINK:
            warnings.append(
                f"{storage.path(pointer.value)} is a {kind.value}, not a symlink; ignored"
            )
            continue
        target = storage.read_link(pointer.value)
        if parse_checkpoint(target) is NOT_A_CHECKPOINT:
            warnings.append(
                f"pointer {pointer.value} -> {target!r} is not a checkpoint file of this "
                "directory; ignored, never followed"
            )
            continue
        sharded = parse_sharded_name(target) is not NOT_A_CHECKPOINT
        wanted = FileKind.DIRECTORY if sharded else FileKind.REGULAR
        if storage.kind(target) is not wanted:
            what = "a directory" if sharded else "a regular file"
            warnings.append(f"pointer {pointer.value} -> {target} is not {what}; ignored")
            continue
        targets[pointer] = target
    return Pointers(
        last=targets[PointerName.LAST],
        best=targets[PointerName.BEST],
        final=targets[PointerName.FINAL],
    )


def read_latest_json(storage: Storage) -> tuple[object, str | None]:
    """Decode the directory's ``latest.json``: ``(data, None)``, or ``(None, why not)``.

    The one reader of ``latest.json``: a missing file is ``(None, None)``; anything but a
    regular file, a file over :data:`LATEST_JSON_LIMIT`, bytes that are not JSON, or JSON
    nested too deeply to decode is refused without being read whole, never raised.
    """
    remote = isinstance(storage, RemoteStorage)  # there: one GET, no HEAD first
    kind = FileKind.REGULAR if remote else storage.kind(LATEST_JSON)
    if kind is FileKind.MISSING:
        return None, None
    if kind is not FileKind.REGULAR:
        return None, f"{storage.path(LATEST_JSON)} is a {kind.value}; ignored"
    try:
        return json.loads(storage.read_bytes(LATEST_JSON, LATEST_JSON_LIMIT).decode("utf-8")), None
    except (OSError, ValueError, RecursionError) as exc:
        if remote and isinstance(exc, FileNotFoundError):
            return None, None
        return None, f"{storage.path(LATEST_JSON)} is unreadable ({exc}); ignored"


def named_by_pointers(storage: Storage) -> frozenset[str] | None:
    """Every name a pointer on disk holds — each symlink's target and each name in
    ``latest.json`` — as written, followed or not; ``None`` when that cannot be read whole."""
    names = set()
    try:
        for pointer in PointerName:
            if storage.kind(pointer.value) is FileKind.SYMLINK:
                names.add(storage.read_link(pointer.value))
        data, problem = read_latest_json(storage)
    except OSError:
        return None
    if problem is not None:
        return None
    if isinstance(data, Mapping):
        names |= pointers_from_latest_json(data)[0].targets()
        if isinstance(data.get("path"), str):
            names.add(data["path"])
    return frozenset(names)


def _read_latest_json(storage: Storage, warnings: list[str]) -> Pointers:
    data, problem = read_latest_json(storage)
    if problem is not None:
        warnings.append(problem)
    if data is None:
        return Pointers()
    pointers, problems = pointers_from_latest_json(data)
    warnings.extend(problems)
    return pointers


def scan(storage: Storage, best: Best | None = None) -> Scan:
    """Scan the directory behind ``storage``: catalog, reconciled pointers, and warnings.

    A checkpoint deleted between the listing and its reading (a live run's retention, which
    publishes the newer one first) makes the scan start over, at most ``SCAN_ATTEMPTS`` times,
    so that a listing taken just before a publish never comes back without the newer one.
    """
    for _ in range(SCAN_ATTEMPTS - 1):
        found = _scan_once(storage, best)
        if not found.gone:
            return found
    return _scan_once(storage, best)


SCAN_ATTEMPTS = 8
"""How many times a scan starts over when checkpoints vanish while it reads them."""


def _listed(storage: Storage) -> contextlib.AbstractContextManager[list[str]]:
    """The directory's names; an object store's every listed entry read at once (in parallel),
    the scan's reads answered from that: one request per entry, none before the listing."""
    if isinstance(storage, RemoteStorage):
        return storage.listed()
    return contextlib.nullcontext(storage.names())


def _scan_once(storage: Storage, best: Best | None) -> Scan:
    with _listed(storage) as names:
        return _scan_names(storage, best, names)


def _scan_names(storage: Storage, best: Best | None, names: list[str]) -> Scan:
    warnings: list[str] = []
    entries: list[CheckpointEntry] = []
    unreadable: dict[str, str] = {}
    sizes: dict[str, int] = {}
    gone: set[str] = set()
    for name in names:
        if classify(name) is not EntryKind.CHECKPOINT:
            continue
        if parse_sharded_name(name) is not NOT_A_CHECKPOINT:
            _scan_sharded(storage, name, entries, unreadable, sizes)
        else:
            _scan_file(storage, name, entries, unreadable, sizes)
        if name in unreadable and storage.kind(name) is FileKind.MISSING:
            del unreadable[name]  # deleted since it was listed: gone, not unreadable
            gone.add(name)
    for name, why in unreadable.items():
        warnings.append(f"skipping {storage.path(name)}: {why}")
    catalog = Catalog(entries=entries)
    links = _read_links(storage, warnings)
    manifest_pointers, problems = checked_best_value(
        _read_latest_json(storage, warnings), catalog, best
    )
    warnings.extend(problems)
    pointers, problems = reconcile_pointers(
        catalog, links=links, manifest=manifest_pointers, best=best
    )
    return Scan(
        catalog=catalog,
        pointers=pointers,
        unreadable=unreadable,
        sizes=sizes,
        warnings=(*warnings, *problems),
        gone=frozenset(gone),
    )


def _scan_file(
    storage: Storage,
    name: str,
    entries: list[CheckpointEntry],
    unreadable: dict[str, str],
    sizes: dict[str, int],
    wanted: FileKind = FileKind.REGULAR,
) -> None:
    """A checkpoint file is listed once its manifest reads back (its size taken first, so an
    entry is never listed without one); on object storage, once its commit object does."""
    kind = storage.kind(name)
    if kind is not wanted:
        unreadable[name] = f"not a regular file ({kind.value})"
        return
    try:
        size = storage.size(name)
        meta = (
            storage.read_meta(name)
            if isinstance(storage, RemoteStorage)
            else fileformat.read_meta(storage.path(name))
        )
        entries.append(entry_from_meta(name, meta))
        sizes[name] = size
    except (CheckpointCorrupt, OSError) as exc:
        unreadable[name] = str(exc)


def _scan_sharded(
    storage: Storage,
    name: str,
    entries: list[CheckpointEntry],
    unreadable: dict[str, str],
    sizes: dict[str, int],
) -> None:
    """A sharded checkpoint directory is listed once its manifest reads back (it is written
    last: a directory without one, or with a bad one, is no checkpoint): its meta and its
    layout's files; the layout's values are checked when it is read or verified."""
    kind = storage.kind(name)
    if kind is not FileKind.DIRECTORY:
        unreadable[name] = f"not a directory ({kind.value})"
        return
    if isinstance(storage, RemoteStorage):  # its commit object's record, no manifest read
        _scan_file(storage, name, entries, unreadable, sizes, kind)
        return
    path = storage.path(name) / MANIFEST_NAME
    try:
        manifest = os.lstat(path).st_size
        meta = fileformat.read_meta(path, skip=_SHARDED_VALUES)
        files = files_from_wire(meta.get("sharded"), f"{path}: sharded")
        entries.append(entry_from_meta(name, meta))
        sizes[name] = manifest + sum(f.size for f in files)
    except (CheckpointCorrupt, OSError) as exc:
        unreadable[name] = str(exc)


_SHARDED_VALUES = {"sharded": ("values",)}  # what a scan skips of a sharded manifest's meta


def is_sharded_path(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is a sharded directory: a directory, and not named
    like a checkpoint file (``step_….pitstop`` is read as a file, whatever is there)."""
    return parse_name(path.name) is NOT_A_CHECKPOINT and path.is_dir()


def verify_any(path: Path) -> None:
    """Check every byte of the checkpoint at ``path``: a file, or a sharded directory (every
    file its manifest lists, and the manifest itself)."""
    if is_sharded_path(path):
        from pitstop.shell.store.sharddir import read_layout, verify_sharded

        layout, _ = read_layout(path, fileformat.verify(path / MANIFEST_NAME))
        verify_sharded(path, layout)
        return
    fileformat.verify(path)


@attrs.frozen(kw_only=True)
class ResumeChoice:
    """The checkpoint a resume uses (``NO_CHECKPOINT``: start fresh), what it skipped (did not
    verify), and what was ``gone`` (deleted while it was being tried: a rescan finds newer)."""

    entry: CheckpointEntry | NoCheckpoint
    path: Path | None
    skipped: Mapping[str, str]
    gone: frozenset[str] = frozenset()


def choose_resume(
    storage: Storage,
    found: Scan,
    source: PointerName,
    best: Best | None = None,
    verify: Callable[[Path], None] = verify_any,
) -> ResumeChoice:
    """Try the core's resume order for ``source`` until a checkpoint verifies.

    Each skipped checkpoint is logged as a warning naming it and why it was skipped; one that
    fails because it was deleted meanwhile is ``gone`` instead (no warning: it is not corrupt).
    """
    skipped: dict[str, str] = {}
    gone = set(found.gone)
    for name in resume_order(found.catalog, found.pointers, source, best):
        path = storage.path(name)
        try:
            path = fetch(storage, name)  # an object store's: downloaded, then checked
            verify(path)
        except (CheckpointCorrupt, OSError) as exc:
            if gone_while_read(storage, path, exc):
                gone.add(name)
                continue
            skipped[name] = str(exc)
            log.warning("resume skips a checkpoint that does not verify: %s", exc)
            continue
        entry = found.catalog.get(name)
        return ResumeChoice(entry=entry, path=path, skipped=skipped, gone=frozenset(gone))
    return ResumeChoice(entry=NO_CHECKPOINT, path=None, skipped=skipped, gone=frozenset(gone))
