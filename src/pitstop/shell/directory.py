# A checkpoint directory: scanning it, writing to it, and choosing what to resume from.
#
# Rules: scanning reads names (classified by the core) and each checkpoint's footer and manifest
# (never its tensor bytes), builds the catalog, and hands the pointers found on disk — symlinks
# and latest.json, both untrusted — to the core to reconcile. A symlink is only followed when
# its target is a plain checkpoint file name of this directory that is a regular file. Writing
# happens under the directory lock: leftover temp files of dead writers are removed on opening;
# a save is carried out exactly as the core planned it — checkpoint, then pointers, then
# retention's deletions — and a failure in the pointer phase rolls the directory back to how it
# was. Choosing a resume point tries the core's resume order until a file verifies, warning
# about each one skipped. A sharded checkpoint is a directory (pitstop.shell.sharddir): listed
# once its manifest reads back, published by writing the manifest last and renaming the temp
# directory, deleted manifest first; a dead writer's temp directory is removed on opening.
# How: a Storage underneath, so a fault-injecting fake can stand in for the disk.

"""Checkpoint directories: scan, save as planned, and choose a checkpoint to resume from."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import BinaryIO

import attrs

from pitstop.core.guard import (
    RESERVED_NAMES,
    carried_forward_warning,
    foreign_save_problem,
    reserved_entry_problem,
)
from pitstop.core.metadata import (
    checked_best_value,
    entry_from_meta,
    entry_meta,
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
    temp_name,
)
from pitstop.core.plan import SavePlan
from pitstop.core.pointers import reconcile_pointers
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
)
from pitstop.core.resume import resume_order
from pitstop.core.sharded import MANIFEST_NAME, ShardedLayout
from pitstop.errors import CheckpointCorrupt, PitstopError, SaveError
from pitstop.shell import fileformat
from pitstop.shell.lock import DirectoryLock
from pitstop.shell.publish import delete_checkpoints, publish_file, publish_pointers
from pitstop.shell.storage import FileKind, LocalStorage, Storage

__all__ = [
    "LATEST_JSON_LIMIT",
    "CheckpointDirectory",
    "ResumeChoice",
    "Scan",
    "choose_resume",
    "is_sharded_path",
    "read_latest_json",
    "scan",
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
    """

    catalog: Catalog
    pointers: Pointers
    unreadable: Mapping[str, str]
    sizes: Mapping[str, int]
    warnings: tuple[str, ...]


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
    kind = storage.kind(LATEST_JSON)
    if kind is FileKind.MISSING:
        return None, None
    if kind is not FileKind.REGULAR:
        return None, f"{storage.path(LATEST_JSON)} is a {kind.value}; ignored"
    try:
        return json.loads(storage.read_bytes(LATEST_JSON, LATEST_JSON_LIMIT).decode("utf-8")), None
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{storage.path(LATEST_JSON)} is unreadable ({exc}); ignored"


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
    """Scan the directory behind ``storage``: catalog, reconciled pointers, and warnings."""
    warnings: list[str] = []
    entries: list[CheckpointEntry] = []
    unreadable: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for name in storage.names():
        if classify(name) is not EntryKind.CHECKPOINT:
            continue
        if parse_sharded_name(name) is not NOT_A_CHECKPOINT:
            _scan_sharded(storage, name, entries, unreadable, sizes)
            continue
        if storage.kind(name) is not FileKind.REGULAR:
            unreadable[name] = f"not a regular file ({storage.kind(name).value})"
            continue
        try:
            manifest = fileformat.read_manifest(storage.path(name))
            entries.append(entry_from_meta(name, manifest.meta))
            sizes[name] = storage.size(name)
        except (CheckpointCorrupt, OSError) as exc:
            unreadable[name] = str(exc)
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
    )


def _scan_sharded(
    storage: Storage,
    name: str,
    entries: list[CheckpointEntry],
    unreadable: dict[str, str],
    sizes: dict[str, int],
) -> None:
    """A sharded checkpoint directory is listed once its manifest reads back (it is written
    last: a directory without one, or with a bad one, is no checkpoint)."""
    from pitstop.shell.sharddir import read_layout  # sharddir publishes through this package

    if storage.kind(name) is not FileKind.DIRECTORY:
        unreadable[name] = f"not a directory ({storage.kind(name).value})"
        return
    try:
        layout, meta = read_layout(storage.path(name))
        entries.append(entry_from_meta(name, meta))
        manifest = os.stat(storage.path(name) / MANIFEST_NAME).st_size
        sizes[name] = manifest + sum(f.size for f in layout.files)
    except (CheckpointCorrupt, OSError) as exc:
        unreadable[name] = str(exc)


def is_sharded_path(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is a sharded directory: a directory, and not named
    like a checkpoint file (``step_….pitstop`` is read as a file, whatever is there)."""
    return parse_name(path.name) is NOT_A_CHECKPOINT and path.is_dir()


def verify_any(path: Path) -> None:
    """Check every byte of the checkpoint at ``path``: a file, or a sharded directory (every
    file its manifest lists, and the manifest itself)."""
    if is_sharded_path(path):
        from pitstop.shell.sharddir import read_layout, verify_sharded

        fileformat.verify(path / MANIFEST_NAME)
        layout, _ = read_layout(path)
        verify_sharded(path, layout)
        return
    fileformat.verify(path)


@attrs.frozen(kw_only=True)
class ResumeChoice:
    """The checkpoint a resume uses (``NO_CHECKPOINT``: start fresh), and what it skipped."""

    entry: CheckpointEntry | NoCheckpoint
    path: Path | None
    skipped: Mapping[str, str]


def choose_resume(
    storage: Storage,
    found: Scan,
    source: PointerName,
    best: Best | None = None,
    verify: Callable[[Path], None] = verify_any,
) -> ResumeChoice:
    """Try the core's resume order for ``source`` until a checkpoint verifies.

    Each skipped checkpoint is logged as a warning naming it and why it was skipped.
    """
    skipped: dict[str, str] = {}
    for name in resume_order(found.catalog, found.pointers, source, best):
        path = storage.path(name)
        try:
            verify(path)
        except (CheckpointCorrupt, OSError) as exc:
            skipped[name] = str(exc)
            log.warning("resume skips a checkpoint that does not verify: %s", exc)
            continue
        entry = found.catalog.get(name)
        return ResumeChoice(entry=entry, path=path, skipped=skipped)
    return ResumeChoice(entry=NO_CHECKPOINT, path=None, skipped=skipped)


def _subject(plan: SavePlan, before: Pointers) -> tuple[int | str, str]:
    """The step and the checkpoint file name a save is about, for its messages."""
    entry = plan.entry
    if entry is not NO_CHECKPOINT:
        return entry.step, entry.name
    moved = [
        plan.pointers.target(p) for p in PointerName if plan.pointers.target(p) != before.target(p)
    ]
    for target in (*moved, plan.pointers.last):
        if target is not NO_CHECKPOINT:
            step = parse_checkpoint(target)
            return (step if step is not NOT_A_CHECKPOINT else "?"), target
    return "?", "no checkpoint"


WriteCheckpoint = Callable[[BinaryIO, CheckpointEntry, Callable[[], None]], object]


class CheckpointDirectory:
    """A checkpoint directory opened for writing: locked, scanned, and kept in step with disk."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        storage: Storage | None = None,
        run_id: str | None = None,
        protect: bool = False,
    ) -> None:
        self.path = Path(path)
        self.storage: Storage = storage if storage is not None else LocalStorage(self.path)
        self.policy = policy if policy is not None else Policy()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.protect = protect
        """Refuse to save over the checkpoints found at open until :meth:`adopt` (a run that
        did not resume must not replace another run's checkpoints)."""
        self._lock = DirectoryLock(self.path, self.run_id)
        self._symlinks = True
        self._foreign: tuple[CheckpointEntry | NoCheckpoint, int] = (NO_CHECKPOINT, 0)
        self._had_latest = True  # whether latest.json is on disk (a rollback leaves it so)
        self._told_carried = False
        self._pending_sharded: tuple[ShardedLayout, object, Mapping[str, object]] | None = None
        self.catalog = Catalog()
        self.pointers = Pointers()

    def open(self) -> Scan:
        """Lock the directory, check it can be written, remove dead writers' temp files, scan it.

        Raises :class:`~pitstop.errors.SaveError` naming the path and what to do when an entry
        every save replaces (``last``, ``best``, ``final``, ``latest.json``) is a directory.
        """
        self._lock.acquire()
        try:
            self._check_reserved()
            for name in self.storage.names():
                if classify(name) is EntryKind.TEMP:
                    log.warning("removing %s, left by a writer that died", self.storage.path(name))
                    with contextlib.suppress(FileNotFoundError):
                        if self.storage.kind(name) is FileKind.DIRECTORY:
                            shutil.rmtree(self.storage.path(name))  # a sharded save's
                        else:
                            self.storage.remove(name)
            found = scan(self.storage, self.policy.best)
        except BaseException:
            self._lock.release()
            raise
        for warning in found.warnings:
            log.warning("%s", warning)
        self.catalog, self.pointers = found.catalog, found.pointers
        self._foreign = (found.catalog.newest(), len(found.catalog))
        self._had_latest = self.storage.kind(LATEST_JSON) is not FileKind.MISSING
        return found

    def _check_reserved(self) -> None:
        for name in sorted(RESERVED_NAMES):
            kind = self.storage.kind(name)
            problem = reserved_entry_problem(name, kind.value, str(self.storage.path(name)))
            if problem is not None:
                raise SaveError(problem)

    def adopt(self) -> None:
        """The run resumed (or asked to): the checkpoints found at open are its own to replace."""
        self._foreign = (NO_CHECKPOINT, 0)

    def check(self, plan: SavePlan) -> None:
        """Raise :class:`~pitstop.errors.SaveError` if ``plan`` may not be carried out.

        With ``protect``, a directory that held checkpoints at open refuses every save until
        :meth:`adopt`, naming its newest step and the ways out. Nothing is written.
        """
        if not self.protect:
            return
        newest, count = self._foreign
        found = None if newest is NO_CHECKPOINT else (newest.step, newest.name)
        problem = foreign_save_problem(found, directory=str(self.path), count=count)
        if problem is not None:
            step, name = _subject(plan, self.pointers)
            raise SaveError(f"refusing to save step {step} ({name}): {problem}")

    def note_carried(self, names: Collection[str], source: object) -> None:
        """Warn once, naming them, about components ``source`` holds that were never registered
        (each save carries their stored state forward unchanged)."""
        if self._told_carried:
            return
        message = carried_forward_warning(names, str(source))
        if message is not None:
            self._told_carried = True
            log.warning("%s", message)

    def close(self) -> None:
        """Release the directory lock."""
        self._lock.release()

    def __enter__(self) -> CheckpointDirectory:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def execute(self, plan: SavePlan, write: WriteCheckpoint) -> list[str]:
        """Carry out ``plan``: publish its checkpoint with ``write``, then pointers, then deletions.

        ``write(file, entry, sync)`` writes the whole checkpoint file (``sync`` as in
        :data:`~pitstop.shell.publish.WriteFile`). On :class:`SaveError` the
        directory is as it was before the call. Returns the names retention deleted.
        """
        step, name = _subject(plan, self.pointers)
        if not self._lock.held:
            raise SaveError(
                f"could not save step {step} ({self.storage.path(name)}): {self.path} is not "
                "open for writing (call open() first)"
            )
        self.check(plan)
        try:
            self._publish(plan, write)
        except SaveError as exc:  # whichever file failed, the message names the save
            raise SaveError(
                f"could not save step {step} ({self.storage.path(name)}): {exc}"
            ) from exc
        deleted = delete_checkpoints(self.storage, plan.retention.delete)
        self.catalog = plan.catalog.without(deleted)
        self.pointers = plan.pointers
        return deleted

    def _publish(self, plan: SavePlan, write: WriteCheckpoint) -> None:
        entry = plan.entry
        if entry is not NO_CHECKPOINT and entry.sharded:
            self._publish_directory(plan, entry)
        elif entry is not NO_CHECKPOINT:
            publish_file(
                self.storage, entry.name, self.run_id, lambda f, sync: write(f, entry, sync)
            )
        try:
            self._symlinks = publish_pointers(
                self.storage,
                plan.catalog,
                plan.pointers,
                token=self.run_id,
                policy=self.policy,
                symlinks=self._symlinks,
            )
        except BaseException:
            self._roll_back(plan)
            raise
        self._had_latest = True

    def publish(
        self,
        plan: SavePlan,
        entry: CheckpointEntry,
        prepare: Callable[[], fileformat.Prepared],
        meta: Mapping[str, object],
    ) -> None:
        """Write ``entry``'s checkpoint file from ``prepare()`` and ``meta``; carry ``plan`` out."""
        started = time.perf_counter()
        prepared = prepare()
        self.execute(
            plan,
            lambda file, entry, sync: fileformat.write(
                file, prepared, {**meta, **entry_meta(entry)}, sync=sync
            ),
        )
        log.info(
            "saved %s (%s): %.3fs to durable",
            self.storage.path(entry.name),
            entry.reason.value,
            time.perf_counter() - started,
        )

    def sharded_temp(self, entry: CheckpointEntry) -> str:
        """The temp directory every rank writes ``entry``'s shards into (rank 0 names it)."""
        return temp_name(entry.name, self.run_id)

    def publish_sharded(
        self,
        plan: SavePlan,
        entry: CheckpointEntry,
        layout: ShardedLayout,
        tree: object,
        meta: Mapping[str, object],
    ) -> None:
        """Rank 0: the shards of ``entry`` are written into :meth:`sharded_temp`: write the
        manifest (``layout``, the replicated ``tree``, ``meta``) last, rename the directory
        into place, fsync the parent; then carry ``plan`` out as for a file."""
        started = time.perf_counter()
        self._pending_sharded = (layout, tree, {**meta, **entry_meta(entry)})
        try:
            self.execute(plan, lambda file, entry, sync: None)
        finally:
            self._pending_sharded = None
        log.info(
            "saved %s (%s, sharded): %.3fs to durable",
            self.storage.path(entry.name),
            entry.reason.value,
            time.perf_counter() - started,
        )

    def _publish_directory(self, plan: SavePlan, entry: CheckpointEntry) -> None:
        from pitstop.shell.sharddir import delete_sharded, publish_sharded, write_manifest

        pending = self._pending_sharded
        temp = self.sharded_temp(entry)
        if pending is None:
            raise SaveError(f"{self.storage.path(temp)}: no shards were written")
        layout, tree, meta = pending
        try:
            write_manifest(self.storage.path(temp), layout, meta, tree, token=self.run_id)
        except BaseException:
            shutil.rmtree(self.storage.path(temp), ignore_errors=True)
            raise
        old = None
        if plan.replaces and self.storage.kind(entry.name) is FileKind.DIRECTORY:
            old = temp_name(entry.name, self.run_id + "-old")  # out of the way, still whole
            self.storage.replace(entry.name, old)
        publish_sharded(self.storage, temp, entry.name)
        if old is not None:
            delete_sharded(self.storage, old)

    def repoint(self, plan: SavePlan) -> None:
        """Carry out a plan that writes no file, only moves pointers."""
        self.execute(plan, lambda file, entry, sync: None)

    def _roll_back(self, plan: SavePlan) -> None:
        """Undo a save whose pointers failed: old pointers back, then the new file out (in this
        order, so that no pointer ever names a missing file, even after a crash in between)."""
        try:
            publish_pointers(
                self.storage,
                self.catalog,
                self.pointers,
                token=self.run_id,
                policy=self.policy,
                symlinks=self._symlinks,
                latest=self._had_latest,  # a directory that had no latest.json gets none
            )
        except PitstopError as exc:
            log.error("could not restore the pointers of %s: %s", self.path, exc)
        entry = plan.entry
        if entry is not NO_CHECKPOINT and not plan.replaces:
            with contextlib.suppress(OSError):
                if entry.sharded:
                    from pitstop.shell.sharddir import delete_sharded

                    delete_sharded(self.storage, entry.name)
                else:
                    self.storage.remove(entry.name)
                    self.storage.sync_directory()
