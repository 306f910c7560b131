# A local checkpoint directory with a remote tier (an s3:// prefix) behind it.
#
# Rules: a save publishes locally exactly as without a tier; then its file is hard-linked into
# the tier's cache (a temp entry of the local directory, removed by the next open if this process
# dies; the local retention may delete the original meanwhile) and queued. One thread uploads the
# queue in order, each by the object store's own publish (data, conditional-put commit, pointers
# and latest.json by compare-and-swap, retention), as the core's plan_arrival says (its seq kept;
# the tier's own Policy retires). The prefix is opened (its lease taken) by the first upload or
# resume, never by the constructor. A failed upload loses nothing local: logged, kept, raised by
# the Checkpointer's next call (the core's waits_for_uploads); the next upload tries again. A
# resume tries the core's tiered_resume_order over both catalogs until one verifies, and copies a
# remote one it restored into the local directory once it succeeded (adopt), with its seq; the
# remote tier then catches up on the upload thread (plan_catch_up). A sharded checkpoint is
# staged by hard links and committed as one on s3:// is; on nodes sharing no directory each
# node's writer uploads its ranks' files and rank 0 commits once all are listed (shardobjects).
# A sharded resume's remote candidate is first downloaded here (bring_sharded: checked, renamed).
# How: RemoteTier (the prefix's directory, a queue, a thread) and TieredDirectory, handing it each.

"""The remote tier: local publish first, upload in the background, its own retention."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from pitstop.core.naming import aside_name, temp_name, temp_token
from pitstop.core.records import (
    NO_CHECKPOINT,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    PointerName,
    Policy,
)
from pitstop.core.saving.plan import SavePlan, plan_arrival, plan_catch_up
from pitstop.core.saving.pointers import Tier, resume_order, tiered_resume_order
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.store import shardobjects
from pitstop.shell.store.atomic import write_atomically
from pitstop.shell.store.directory import CheckpointDirectory, WriteCheckpoint, scan, verify_any
from pitstop.shell.store.lease import ObjectLease
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.sharddir import file_table, publish_sharded
from pitstop.shell.store.storage import FileKind, Storage, fetch

__all__ = ["RemoteTier", "TieredDirectory"]

log = logging.getLogger("pitstop")

_Upload = tuple[CheckpointEntry, Path]  # a published checkpoint and its staged hard link


class RemoteTier:
    """The remote tier of a local checkpoint directory: ``url`` (``s3://bucket/prefix``) with
    its own lease, pointers and retention (``policy``); its files are cached in ``cache``."""

    def __init__(
        self,
        url: str,
        *,
        policy: Policy,
        cache: Path,
        storage_options: Mapping[str, Any] | None,
        protect: bool,
    ) -> None:
        self.objects = ObjectStorage(url, storage_options=storage_options, cache=cache)
        self.url = self.objects.url
        self.cache = cache
        run_id = uuid.uuid4().hex[:12]
        lease = ObjectLease(self.objects, run_id)
        self.directory = CheckpointDirectory(
            cache, policy=policy, storage=self.objects, run_id=run_id, protect=protect, lock=lease
        )
        self._cond = threading.Condition()
        self._opening = threading.Lock()  # opening takes requests: never under _cond
        self._queue: collections.deque[_Upload] = collections.deque()
        self._busy = False  # an upload is under way
        self._opened = False
        self._adopted = False
        self._closed = False
        self._errors: list[BaseException] = []  # failures not raised yet, oldest first
        self._thread: threading.Thread | None = None
        self._staged = 0
        self._catching: tuple[Catalog, Callable[[str], Path]] | None = None  # a catch-up to do
        self.nodes: shardobjects.NodeUploads | None = None  # nodes sharing no directory

    # --- the loop's side --------------------------------------------------------------------

    def stage(self, entry: CheckpointEntry, path: Path) -> None:
        """Queue the upload of ``entry``, just published at ``path`` (never raises: a failure is
        kept for the next call, the local checkpoint stays)."""
        try:
            staged = self._link(entry, path)
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._work, name="pitstop-upload", daemon=True
                    )
                    self._thread.start()
                self._queue.append((entry, staged))
                self._cond.notify_all()
        except Exception as exc:
            self._failed(entry, exc)

    def _link(self, entry: CheckpointEntry, path: Path) -> Path:
        """``path`` staged in the cache (a hard link: the same filesystem, no copy)."""
        self._staged += 1
        staged = self.cache / f"staged-{self._staged}-{entry.name}"
        self.cache.mkdir(parents=True, exist_ok=True)
        if entry.sharded:  # a directory: its files, each hard-linked
            shardobjects.stage_links(path, staged)
            return staged
        try:
            os.link(path, staged)
        except FileNotFoundError:
            raise
        except OSError:
            shutil.copyfile(path, staged)
        return staged

    def catch_up(self, local: Catalog, where: Callable[[str], Path]) -> None:
        """Upload, in the background and before any save queued later, the checkpoints of
        ``local`` (at ``where(name)``) the remote tier lacks and keeps (the core's
        plan_catch_up): an upload that failed, or was queued when a process was killed."""
        with self._cond:
            self._catching = (local, where)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="pitstop-upload", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def settle(self, *, block: bool) -> None:
        """``block``: wait until every queued upload is done; then raise the failure of one that
        failed (a :class:`~pitstop.errors.SaveError` naming the step and the URL), once."""
        with self._cond:
            while block and self._pending():
                self._cond.wait()
            errors, self._errors = self._errors, []
        if len(errors) == 1:
            raise errors[0]
        if errors:
            more = f"; and {len(errors) - 1} more upload(s) failed (see the log)"
            raise SaveError(f"{errors[0]}{more}") from errors[0]

    def _pending(self) -> bool:
        """Whether an upload is queued or under way (on a thread still running: under _cond)."""
        alive = self._thread is not None and self._thread.is_alive()
        return alive and (bool(self._queue) or self._busy or self._catching is not None)

    def opened(self) -> CheckpointDirectory:
        """The remote prefix's directory, opened (its lease taken, scanned) on first use.
        Raises :class:`~pitstop.errors.SaveError` naming the URL when it cannot be."""
        with self._opening:
            if not self._opened:
                self.directory.open()
                self._opened = True
                if self._adopted:
                    self.directory.adopt()
            return self.directory

    def adopt(self) -> None:
        """The run resumed: the remote checkpoints found are its own to replace and retire."""
        self._adopted = True
        if self._opened:
            self.directory.adopt()

    def tiers(self, name: str, seq: int) -> tuple[str, ...]:
        """The tiers ``name`` (save ``seq``) is held by as far as this process knows."""
        entry = self.directory.catalog.get(name)
        held = entry is not NO_CHECKPOINT and entry.seq == seq
        return (Tier.LOCAL.value, Tier.REMOTE.value) if held else (Tier.LOCAL.value,)

    def close(self) -> None:
        """Wait for the queued uploads, stop the thread, release the lease, remove the cache."""
        with self._cond:
            while self._pending():
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        try:
            self.directory.close()
        finally:
            shutil.rmtree(self.cache, ignore_errors=True)

    # --- the upload thread ------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._catching is None and not self._closed:
                    self._cond.wait()
                catching, self._catching = self._catching, None
                if catching is None and not self._queue:
                    return
                self._busy = True
            if catching is not None:
                self._catch_up(*catching)
                continue
            with self._cond:
                entry, staged = self._queue.popleft()
            try:
                self._send(entry, staged)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, entry: CheckpointEntry, staged: Path) -> None:
        """Upload one staged checkpoint (a failure kept for the next call); its link removed."""
        try:
            self._upload(entry, staged)
        except Exception as exc:
            self._failed(entry, exc)
        finally:
            if staged.is_dir():  # a sharded checkpoint's (its commit removes it too)
                shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                staged.unlink()

    def _catch_up(self, local: Catalog, where: Callable[[str], Path]) -> None:
        """The upload thread: upload what plan_catch_up says, oldest first."""
        todo: tuple[CheckpointEntry, ...] = ()
        try:  # another node's writer lists the prefix without its lease (rank 0's)
            peer = self.nodes is not None and not self.nodes.commits
            found = scan(self.objects).catalog if peer else self.opened().catalog
            todo = plan_catch_up(local, found, self.directory.policy)
        except Exception as exc:  # the remote tier cannot be reached: raised at the next call
            error = SaveError(f"catching up the remote tier {self.url} failed: {exc}")
            error.__cause__ = exc
            log.error("%s", error)
            with self._cond:
                self._errors.append(error)
        for entry in todo:
            try:
                staged = self._link(entry, where(entry.name))
            except FileNotFoundError:
                continue  # retired locally meanwhile
            log.info("catching up: %s was not uploaded to %s", entry.name, self.url)
            self._send(entry, staged)
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _upload(self, entry: CheckpointEntry, staged: Path) -> None:
        if self.nodes is not None and not self.nodes.commits:  # its ranks' files; rank 0 commits
            self.nodes.send(self.objects, entry, staged)
            return
        directory, nodes = self.opened(), self.nodes
        plan = plan_arrival(directory.catalog, entry, directory.policy)
        if entry.sharded:  # its files, then the one commit (shardobjects.publish_objects)
            temp = directory.sharded_temp(entry) if nodes is None else nodes.temp(entry)
            os.replace(staged, self.objects.path(temp))
            if nodes is not None:  # once every node's writer has uploaded its files
                nodes.wait(self.objects, temp)
            deleted = directory.publish_sharded(plan, entry, None, None, {}, temp=temp)
        else:
            self.objects.upload_from(entry.name, staged)
            try:
                deleted = directory.execute(plan, lambda file, entry, sync: None)
            finally:
                self.objects.upload_from(entry.name, None)
        retired = f"; retired {', '.join(deleted)}" if deleted else ""
        log.info("uploaded %s to the remote tier %s%s", entry.name, self.url, retired)

    def _failed(self, entry: CheckpointEntry, exc: Exception) -> None:
        message = (
            f"upload of step {entry.step} ({entry.name}) to the remote tier {self.url} failed: "
            f"{exc}; the local checkpoint is kept"
        )
        log.error("%s", message)
        error = SaveError(message)
        error.__cause__ = exc
        with self._cond:
            self._errors.append(error)


class TieredDirectory(CheckpointDirectory):
    """A local checkpoint directory whose every published checkpoint is also uploaded to
    ``remote``; a resume chooses from both tiers."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        remote_url: str,
        remote_policy: Policy,
        storage_options: Mapping[str, Any] | None,
        policy: Policy,
        storage: Storage | None,
        protect: bool,
    ) -> None:
        super().__init__(path, policy=policy, storage=storage, protect=protect)
        cache = self.path / temp_name("remote-tier", self.run_id)
        self.remote = RemoteTier(
            remote_url,
            policy=remote_policy,
            cache=cache,
            storage_options=storage_options,
            protect=protect,
        )
        self._arrived: tuple[CheckpointEntry, Path] | None = None
        self.uploads = True
        """Whether this directory's checkpoints are uploaded (``False``: another writer's are)."""
        self.incomplete: set[str] = set()  # found incomplete across the nodes: not caught up

    def execute(self, plan: SavePlan, write: WriteCheckpoint) -> list[str]:
        """Carry ``plan`` out locally; once its checkpoint is published, queue its upload."""
        try:
            return super().execute(plan, write)
        finally:
            entry = plan.entry
            if self.uploads and entry is not NO_CHECKPOINT and self.carried_out(plan):
                self.remote.stage(entry, self.storage.path(entry.name))

    def choose(
        self, pointer: PointerName, verify: Callable[[Path], None] = verify_any
    ) -> tuple[Path | None, CheckpointEntry | NoCheckpoint]:
        """The checkpoint a resume from ``pointer`` restores, from either tier (the core's
        tiered_resume_order), verified; ``(None, NO_CHECKPOINT)``: neither holds one."""
        for name, entry, remote in self.tiered_order(pointer):
            storage = self.remote.directory.storage if remote else self.storage
            try:
                path = fetch(storage, name)  # the remote tier's: downloaded, then checked
                verify(path)
            except (CheckpointCorrupt, OSError) as exc:
                where = f" (the remote tier {self.remote.url})" if remote else ""
                log.warning("resume skips a checkpoint that does not verify%s: %s", where, exc)
                continue
            if remote:
                log.info("resume takes %s from the remote tier %s", name, self.remote.url)
                self._arrived = (entry, path)
            return path, entry
        return None, NO_CHECKPOINT

    def tiered_order(self, pointer: PointerName) -> list[tuple[str, CheckpointEntry, bool]]:
        """The candidates of both tiers for ``pointer`` (the core's tiered_resume_order), each
        name with its entry and whether it is the remote tier's (a sharded run's resume:
        :meth:`bring_sharded` makes it local first). Opens the remote tier."""
        best = self.policy.best
        local = scan(self.storage, best)
        found = scan(self.remote.opened().storage, best)
        order = tiered_resume_order(
            (local.catalog, local.pointers), (found.catalog, found.pointers), pointer, best
        )
        listed = [(n, (found if t is Tier.REMOTE else local).catalog.get(n), t) for t, n in order]
        return [(n, e, t is Tier.REMOTE) for n, e, t in listed if isinstance(e, CheckpointEntry)]

    def bring_sharded(
        self, name: str, listed: CheckpointEntry | None = None, only: shardobjects.Wanted = None
    ) -> str | None:
        """Rank 0 (a node's writer: given its entry ``listed``, no lease): copy the remote tier's
        sharded checkpoint ``name`` here: downloaded into a temp folder, checked, renamed into
        place (or, given ``only``: shardobjects.download_sharded's, moved into this directory's
        copy of the same save); pointers move at :meth:`adopt`. ``None``, or what failed."""
        entry = listed or self.remote.opened().catalog.get(name)
        assert entry is not NO_CHECKPOINT
        temp = self.sharded_temp(entry)
        root, path = self.storage.path(temp), self.storage.path(name)
        try:
            took = shardobjects.download_sharded(self.remote.objects, name, root, file_table, only)
            there = self.storage.kind(name) is not FileKind.MISSING
            if took and only is not None and there:
                shardobjects.place_files(root, path)
            elif took:
                aside = aside_name(name, temp_token(temp, name)) if there else None
                publish_sharded(self.storage, temp, name, aside=aside)
        except (CheckpointCorrupt, OSError, SaveError) as exc:
            return f"{name} from the remote tier {self.remote.url}: {exc}"
        self.rescan()
        self._arrived = (entry, path)
        said = ", ".join(took) or "nothing (it holds what it needs)"  # one line, in the log
        log.info("resume takes %s of %s from the remote tier %s", said, name, self.remote.url)
        return None

    def remote_order(self, pointer: PointerName) -> list[tuple[str, CheckpointEntry]]:
        """The remote tier's resume order for ``pointer``, each name with its entry: listed
        without its lease (a reader's listing; the lease is the uploader's)."""
        best = self.policy.best
        found = scan(self.remote.objects, best)
        order = resume_order(found.catalog, found.pointers, pointer, best)
        entries = [(name, found.catalog.get(name)) for name in order]
        return [(name, e) for name, e in entries if isinstance(e, CheckpointEntry)]

    def download(self, name: str) -> Path:
        """Copy checkpoint ``name`` from the remote tier into this directory (downloaded to the
        cache, then published atomically, as a peer's copy is); its path, unchecked. No lease."""
        path = self.storage.path(name)
        with self.remote.objects.fetched(name) as fetched:

            def copy(file: BinaryIO) -> None:
                with open_untrusted(fetched) as source:  # read into memory, checked
                    shutil.copyfileobj(source, file, 8 << 20)

            write_atomically(path, copy)
        self.rescan()
        return path

    def adopt(self) -> None:
        """The run resumed: both tiers' checkpoints are its own; a remote checkpoint it resumed
        from is copied into the local directory (with its seq: the next save follows it) by the
        one atomic writer, then the memory it was read into is freed."""
        super().adopt()
        arrived, self._arrived = self._arrived, None
        try:
            if arrived is not None:
                self._copy_in(*arrived)
        finally:
            self.remote.adopt()  # frees the remote checkpoint read into memory
        if self.uploads:  # the one uploader's (rank 0's, on nodes that share no directory)
            self.remote.catch_up(self.catalog.without(self.incomplete), self.storage.path)

    def _copy_in(self, entry: CheckpointEntry, path: Path) -> None:
        def copy(file: Any, entry: CheckpointEntry, sync: Callable[[], None]) -> None:
            with open_untrusted(path) as source:  # the copy the resume read (into memory)
                shutil.copyfileobj(source, file, 8 << 20)

        plan = plan_arrival(self.catalog, entry, self.policy)
        if entry.sharded:  # in this directory already (bring_sharded): its pointers move
            plan = attrs.evolve(plan, entry=NO_CHECKPOINT)
        try:
            super().execute(plan, copy)
        except (SaveError, OSError) as exc:
            log.warning("could not copy %s from the remote tier here: %s", entry.name, exc)

    def close(self) -> None:
        """Wait for the uploads, release the remote lease, then the local lock."""
        try:
            self.remote.close()
        finally:
            super().close()
