# A checkpoint directory opened for writing (scanning it and choosing a resume point are
# pitstop.shell.store.scanning's, re-exported here).
#
# Rules: scanning reads names (classified by the core) and each checkpoint's footer and manifest
# (never its tensor bytes), builds the catalog, and hands the pointers found on disk — symlinks and
# latest.json, both untrusted — to the core to reconcile. A symlink is only followed when its target
# is a plain checkpoint file name of this directory that is a regular file. Writing happens under
# the directory lock: leftover temp files of dead writers are removed on opening; a save is carried
# out exactly as the core planned it — checkpoint, then pointers, then retention's deletions — and a
# failure in the pointer phase rolls the directory back to how it was (a file that replaced one of
# its name stays: the rename took the old one away, and the catalog holds the new one from that
# moment; so does a new file when the old pointers cannot be put back: one of them may name it). The
# catalog follows each deletion, so an interrupted retention leaves it as the disk is. Choosing a
# resume point tries the core's resume order until a file verifies, warning about each one skipped.
# A sharded checkpoint is a directory (pitstop.shell.store.sharddir): listed once its manifest reads
# back, published by writing the manifest last and renaming the temp directory (one it replaces
# moved aside first: a failure part-way leaves the old or the new one under the name), deleted by
# an atomic rename to a temp name first (readers see it whole or not at all); opening removes
# dead writers' temp directories and settles what they had moved aside.
# How: a Storage underneath, so a fault-injecting fake can stand in for the disk.

"""Checkpoint directories: scan, save as planned, and choose a checkpoint to resume from."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import BinaryIO

from pitstop.core.guard import (
    RESERVED_NAMES,
    carried_forward_warning,
    foreign_save_problem,
    reserved_entry_problem,
)
from pitstop.core.metadata import (
    entry_meta,
)
from pitstop.core.naming import (
    LATEST_JSON,
    EntryKind,
    aside_name,
    attempt_token,
    classify,
    temp_name,
)
from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    Pointers,
    Policy,
)
from pitstop.core.saving.plan import SavePlan, plan_subject, rollback_removals
from pitstop.core.sharding.sharded import ShardedLayout
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store import sharddir
from pitstop.shell.store.lock import DirectoryLock
from pitstop.shell.store.publish import (
    RetentionInterrupted,
    delete_checkpoints,
    publish_file,
    publish_pointers,
    remove_checkpoint,
)
from pitstop.shell.store.scanning import (
    LATEST_JSON_LIMIT,
    ResumeChoice,
    Scan,
    choose_resume,
    gone_while_read,
    is_sharded_path,
    named_by_pointers,
    read_latest_json,
    scan,
    vanished,
    verify_any,
)
from pitstop.shell.store.sharddir import clear_leftover, publish_sharded
from pitstop.shell.store.storage import (
    FileKind,
    LocalStorage,
    RemoteStorage,
    Storage,
    WriterLock,
)

__all__ = [
    "LATEST_JSON_LIMIT",
    "CheckpointDirectory",
    "ResumeChoice",
    "Scan",
    "choose_resume",
    "gone_while_read",
    "is_sharded_path",
    "read_latest_json",
    "scan",
    "vanished",
    "verify_any",
]

log = logging.getLogger("pitstop")


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
        lock: WriterLock | None = None,
    ) -> None:
        self.path = Path(path)
        self.storage: Storage = storage if storage is not None else LocalStorage(self.path)
        self.policy = policy if policy is not None else Policy()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.protect = protect
        """Refuse to save over the checkpoints found at open until :meth:`adopt` (a run that
        did not resume must not replace another run's checkpoints)."""
        self._lock: WriterLock = lock if lock is not None else DirectoryLock(self.path, self.run_id)
        self._attempts = itertools.count(1)  # each publish's temp names are its own
        self._symlinks = True
        self._foreign: tuple[CheckpointEntry | NoCheckpoint, int] = (NO_CHECKPOINT, 0)
        self._had_latest = True  # whether latest.json is on disk (a rollback leaves it so)
        self._told_carried = False
        self._pending_sharded: (
            tuple[str, ShardedLayout | None, object, Mapping[str, object]] | None
        ) = None
        self._carried: SavePlan | None = None  # the last plan published, pointers and all
        self.catalog, self.pointers = Catalog(), Pointers()
        self.opened: Scan | None = None  # the scan open() made under the lock

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
                    clear_leftover(self.storage, name)
            found = scan(self.storage, self.policy.best)
            had_latest = self.storage.kind(LATEST_JSON) is not FileKind.MISSING
        except BaseException:  # whatever failed, the directory is not left locked
            self._lock.release()
            raise
        for warning in found.warnings:
            log.warning("%s", warning)
        self.catalog, self.pointers, self.opened = found.catalog, found.pointers, found
        self._foreign = (found.catalog.newest(), len(found.catalog))
        self._had_latest = had_latest
        return found

    def _check_reserved(self) -> None:
        for name in sorted(RESERVED_NAMES):
            kind = self.storage.kind(name)
            problem = reserved_entry_problem(name, kind.value, str(self.storage.path(name)))
            if problem is not None:
                raise SaveError(problem)

    def rescan(self, *, repoint: bool = False) -> None:
        """Read the catalog and pointers again: a checkpoint was put here from elsewhere (a
        peer's copy, received before a resume); ``repoint``: and write the pointers the core
        derives from it (``last``: the newest), as a save would."""
        found = scan(self.storage, self.policy.best)
        self.catalog, self.pointers = found.catalog, found.pointers
        if repoint and found.catalog:
            self._symlinks = self._pointers(self.catalog, self.pointers)
            self._had_latest = True

    def _pointers(self, catalog: Catalog, pointers: Pointers, *, latest: bool = True) -> bool:
        """Write ``pointers`` of ``catalog``: the links, and latest.json (``latest=False``: it is
        removed, as in a directory that had none); whether links could be used."""
        return publish_pointers(
            self.storage,
            catalog,
            pointers,
            token=self._token(),
            policy=self.policy,
            symlinks=self._symlinks,
            latest=latest,
        )

    def adopt(self) -> None:
        """The run resumed (or asked to): the checkpoints found at open are its own to replace;
        an object store frees the checkpoint the resume read into memory."""
        self._foreign = (NO_CHECKPOINT, 0)
        if isinstance(self.storage, RemoteStorage):
            self.storage.release()

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
            step, name = plan_subject(plan, self.pointers)
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
        """Release the directory lock (and an object store's local cache)."""
        try:
            self._lock.release()
        finally:
            if isinstance(self.storage, RemoteStorage):
                self.storage.close()

    def __enter__(self) -> CheckpointDirectory:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def execute(self, plan: SavePlan, write: WriteCheckpoint) -> list[str]:
        """Carry out ``plan``: publish its checkpoint with ``write``, then pointers, then deletions.

        ``write(file, entry, sync)`` writes the whole checkpoint file (``sync`` as in
        :data:`~pitstop.shell.store.publish.WriteFile`). On :class:`SaveError` the
        directory is as it was before the call; on
        :class:`~pitstop.shell.store.publish.RetentionInterrupted` (a Ctrl-C in retention) the save
        is published and the catalog lists what retention left. Returns the names it deleted.
        """
        step, name = plan_subject(plan, self.pointers)
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
        self.catalog, self.pointers = plan.catalog, plan.pointers  # published, pointers too
        self._carried = plan
        deleted: list[str] = []
        try:
            delete_checkpoints(self.storage, plan.retention.delete, deleted)
        except KeyboardInterrupt as interrupt:  # Ctrl-C: raised as one the save survived
            raise RetentionInterrupted(*interrupt.args) from None
        finally:  # an interrupt (Ctrl-C) part-way: the catalog still lists what is left
            self.catalog = plan.catalog.without(deleted)
        return deleted

    def carried_out(self, plan: SavePlan) -> bool:
        """Whether ``plan``'s checkpoint and pointers are published (by the last
        :meth:`execute`): a caller interrupted after that (a Ctrl-C in the retention, in the
        log line, on the way back) knows its save is done."""
        return self._carried is plan

    def _publish(self, plan: SavePlan, write: WriteCheckpoint) -> None:
        entry = plan.entry
        if entry is not NO_CHECKPOINT and entry.sharded:
            self._publish_directory(plan, entry)
        elif entry is not NO_CHECKPOINT:
            publish_file(
                self.storage,
                entry.name,
                self._token(),
                lambda f, sync: write(f, entry, sync),
                replaced=lambda: self._replaced(entry),
            )
        try:
            self._symlinks = self._pointers(plan.catalog, plan.pointers)
        except BaseException as exc:
            kept = self._roll_back(plan)
            if kept is not None and isinstance(exc, Exception):
                raise SaveError(f"{exc}; {kept}") from exc
            raise
        self._had_latest = True

    def _replaced(self, entry: CheckpointEntry) -> None:
        """``entry``'s file has taken the place of the old file of its name, for good (even if
        the save fails from here on): the catalog holds it, not the file that is gone."""
        self.catalog = self.catalog.with_entry(entry)

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

    def _token(self) -> str:
        """The temp-name token of one attempt at a publish: no other attempt of this run's has
        it, so a temp entry a failed one could not remove never blocks it (open() removes it)."""
        return attempt_token(self.run_id, next(self._attempts))

    def sharded_temp(self, entry: CheckpointEntry) -> str:
        """A new temp directory name for one attempt at ``entry`` (rank 0 names it, every rank
        writes its shards into it); each call gives another."""
        return temp_name(entry.name, self._token())

    def publish_sharded(
        self,
        plan: SavePlan,
        entry: CheckpointEntry,
        layout: ShardedLayout | None,
        tree: object,
        meta: Mapping[str, object],
        *,
        temp: str,
    ) -> list[str]:
        """Rank 0: the shards of ``entry`` are written into ``temp`` (:meth:`sharded_temp`):
        write the manifest (``layout``, the replicated ``tree``, ``meta``; ``layout`` None: it
        is in ``temp`` already, a copy from another tier) last, rename the directory into
        place, fsync the parent; then carry ``plan`` out as for a file. What it deleted."""
        started = time.perf_counter()
        self._pending_sharded = (temp, layout, tree, {**meta, **entry_meta(entry)})
        try:
            deleted = self.execute(plan, lambda file, entry, sync: None)
        finally:
            self._pending_sharded = None
        log.info(
            "saved %s (%s, sharded): %.3fs to durable",
            self.storage.path(entry.name),
            entry.reason.value,
            time.perf_counter() - started,
        )
        return deleted

    def _publish_directory(self, plan: SavePlan, entry: CheckpointEntry) -> None:
        pending = self._pending_sharded
        if pending is None:
            raise SaveError(f"{self.storage.path(entry.name)}: no shards were written")
        temp, layout, tree, meta = pending
        aside = None  # the checkpoint it replaces goes out of the way, still whole
        remote = isinstance(self.storage, RemoteStorage)  # there: its commit is swapped instead
        if plan.replaces and not remote and self.storage.kind(entry.name) is FileKind.DIRECTORY:
            aside = aside_name(entry.name, self._token())
        manifest = None
        if layout is not None:
            manifest = partial(
                sharddir.write_manifest, layout=layout, meta=meta, tree=tree, token=self._token()
            )
        publish_sharded(
            self.storage,
            temp,
            entry.name,
            aside=aside,
            replaced=lambda: self._replaced(entry),
            manifest=manifest,
        )

    def repoint(self, plan: SavePlan) -> None:
        """Carry out a plan that writes no file, only moves pointers."""
        self.execute(plan, lambda file, entry, sync: None)

    def _roll_back(self, plan: SavePlan) -> str | None:
        """Undo a save whose pointers failed: old pointers back, then the new file out (in this
        order, so that no pointer ever names a missing file, even after a crash in between) —
        as the core's :func:`rollback_removals` says. If the pointers cannot be put back and one
        on disk may name the new file, it stays (it is complete and durable): returns what the
        error must say about that (``None``: the directory is as it was)."""
        problem = None
        try:
            self._pointers(self.catalog, self.pointers, latest=self._had_latest)
        except Exception as exc:
            problem = str(exc)
            log.error("could not restore the pointers of %s: %s", self.path, exc)
        except BaseException:  # interrupted while restoring: the new file stays, listed
            self.catalog = plan.catalog
            raise
        entry = plan.entry
        named = False
        if problem is not None and entry is not NO_CHECKPOINT:  # does one name the new file?
            on_disk = named_by_pointers(self.storage)
            named = on_disk is None or entry.name in on_disk
        removed = []
        for name in rollback_removals(plan, named_on_disk=named):
            try:
                remove_checkpoint(self.storage, name)
                removed.append(name)
            except OSError as exc:
                log.warning("could not remove %s again: %s", self.storage.path(name), exc)
        if removed:
            with contextlib.suppress(OSError):
                self.storage.sync_directory()
        self.catalog = plan.catalog.without(removed)  # what stays is listed: it is on disk
        if not named or entry is NO_CHECKPOINT:
            return None
        return (
            f"the pointers could not be put back ({problem}), so {self.storage.path(entry.name)} "
            "stays: it is complete and durable, and no pointer names a missing file"
        )
