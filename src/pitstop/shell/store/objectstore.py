# A checkpoint directory on object storage (s3://bucket/prefix), behind the Storage protocol.
#
# Rules: the layout, the commit record, the lease and the retry schedule are the core's
# (pitstop.core.s3.objects). The publish sequence maps onto objects: a checkpoint file's temp
# file is a stream (s3client.Upload) whose bytes go up to a data object of its own as they are
# written, only its header and tail kept in a local file (a cache directory of this process; its
# fsync: nothing to do); its rename to the final name completes that upload (nothing is visible
# before), then creates the commit object with a conditional put (If-None-Match: *) — one that
# loses the race raises, its data object removed; a checkpoint that replaces one of its name
# swaps the commit object by its ETag (If-Match); a failed publish aborts the stream's upload.
# Pointer symlinks and
# latest.json are objects replaced by compare-and-swap on the ETag this process last saw, so a
# writer that lost its lease cannot move them. A listing names committed checkpoints only (the
# commit objects, never a data object); removing a checkpoint deletes its commit object first,
# then its data. A scan's listing (listed) reads every commit object, pointer and latest.json it
# names at once, each once, and the scan asks those reads; the commits stay known to the fetch
# that follows (one whose commit moved meanwhile is gone, not corrupt). Reading one (fetch)
# downloads its data object by ranged, parallel GETs into memory, every blob's CRC-32 checked as
# it arrives (pitstop.shell.store.objectread) — nothing live is touched before every one matched
# (in a file of the cache where other ranks read it: in_memory False; which do, readers). The
# requests are pitstop.shell.store.s3client's. Every client error becomes an OSError naming the
# URL; a missing bucket and refused credentials say so. A remote tier's upload names the local
# file that holds the checkpoint (upload_from), so its publish uploads that file, never a copy.
# A sharded checkpoint's commit object stands for its directory (kind, size, listing); its files
# are fetched into a local folder by the same ranged GETs, all at once (fetch_files: each
# file's size and CRC-32 checked against its commit as it arrives); its upload is
# pitstop.shell.store.shardobjects', its commit the same conditional put (write_commit).
# How: obstore (pip install pitstop[s3]), imported on first use.

"""Object storage: a checkpoint directory at ``s3://bucket/prefix``."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

from pitstop.core.naming import (
    LATEST_JSON,
    POINTER_NAMES,
    TEMP_PREFIX,
    EntryKind,
    classify,
    is_checkpoint_name,
    is_file_name,
    is_sharded_name,
    temp_token,
)
from pitstop.core.ranks import DirectoryGroups
from pitstop.core.s3.objects import (
    ENTRY_KEYS,
    Commit,
    data_name,
    decode_commit,
    deletion_order,
    encode_commit,
)
from pitstop.core.s3.uploads import stream_plan
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat
from pitstop.shell.store.objectread import download, download_files, let_go, pool
from pitstop.shell.store.s3client import SMALL, Requests, StoreError, Upload
from pitstop.shell.store.storage import FileKind, LocalStorage

__all__ = ["ObjectStorage", "StoreError"]


class ObjectStorage(Requests):
    """A checkpoint directory at ``s3://bucket/prefix``; temp files live in ``cache``."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(url, storage_options)
        self._own_cache = cache is None
        self.cache = Path(cache if cache is not None else tempfile.mkdtemp(prefix="pitstop-s3-"))
        self._local = LocalStorage(self.cache, mode=0o600)
        self.in_memory = True
        """A fetched checkpoint file is held in memory (False: in a file of the cache, where
        the other ranks sharing the directory read it)."""
        self.as_blobs = False
        """...held in memory as its checked blobs, for one load: the resume's (objectread)."""
        self.readers: DirectoryGroups | None = None
        """Which ranks read which one's fetch (each group's first rank fetches into its own
        cache; pitstop.shell.nodes); ``None``: each rank reads its own (one rank)."""
        self._links: dict[str, str] = {}  # temp pointer name -> the checkpoint it names
        self._sources: dict[str, Path] = {}  # checkpoint name -> the local file its upload reads
        self._uploads: dict[str, Upload] = {}  # temp name -> its stream, until committed
        self._scan = threading.local()  # .read: what listed() read, on this thread, in its block
        self._commits: dict[str, tuple[str | None, Commit]] = {}  # the last listing's: ETag, record

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def __str__(self) -> str:
        return self.url

    def commit(self, name: str) -> Commit:
        """The commit object of checkpoint ``name`` (``FileNotFoundError``: not committed)."""
        return self._decode(name, self.get(name))

    def _decode(self, name: str, raw: bytes) -> Commit:
        try:
            return decode_commit(name, raw)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{self.location.url(name)}: {exc}") from None

    # --- a listing read at once -------------------------------------------------------

    @contextlib.contextmanager
    def listed(self) -> Iterator[list[str]]:
        """:meth:`names`, every commit object, pointer and ``latest.json`` listed read at once
        (in parallel, once each); in the block, on this thread, ``kind``, ``size``,
        ``read_meta``, ``read_link`` and ``read_bytes`` answer from what was read (a name not
        listed is missing). The commits read stay known to :meth:`fetch` until the next listing
        (while their ETag is the one this process last saw)."""
        objects, _ = self.listing()
        wanted = [n for n in objects if n in POINTER_NAMES or n == LATEST_JSON or _committed(n)]
        self._commits.clear()
        self._scan.read = dict(zip(wanted, pool().map(self._try_get, wanted), strict=True))
        try:
            yield self._with_local(wanted)
        finally:
            self._scan.read = None

    def _try_get(self, name: str) -> bytes | OSError:
        try:
            return self.get(name)
        except OSError as exc:  # raised where it is asked for (missing: FileNotFoundError)
            return exc

    def _read(self, name: str, limit: int = SMALL) -> bytes | None:
        """The bytes of ``name`` the open listing read (``None``: no listing open here, or a
        name it does not stand for); raises as its GET did (not listed: ``FileNotFoundError``)."""
        read: dict[str, bytes | OSError] | None = getattr(self._scan, "read", None)
        if read is None or name in self._links or classify(name) is EntryKind.TEMP:
            return None
        found = read.get(name)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.location.url(name)} is not listed")
        if isinstance(found, OSError):
            raise found
        if len(found) > limit:
            raise ValueError(f"{self.location.url(name)} is larger than {limit} bytes")
        return found

    def _commit_read(self, name: str) -> Commit:
        """The commit of ``name``: as the open listing read it, or as the last listing did (its
        ETag still the one last seen), else read now."""
        raw = self._read(name)
        if raw is not None:
            commit = self._decode(name, raw)
            self._commits[name] = (self.etag(name), commit)
            return commit
        carried = self._commits.get(name)
        if carried is None or carried[0] != self.etag(name):
            return self.commit(name)
        return carried[1]

    # --- Storage ----------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """Where ``name`` is, or would be, in the local cache (temp files, fetched copies)."""
        return self._local.path(name)

    def names(self) -> list[str]:
        """The committed checkpoints, pointers and ``latest.json``, and local temp files."""
        objects, _ = self.listing()
        return self._with_local(
            [n for n in objects if n in POINTER_NAMES or n == LATEST_JSON or _committed(n)]
        )

    def _with_local(self, listed: list[str]) -> list[str]:
        local = {n for n in self._local.names() if not _is_sharded(n)}  # not fetched copies
        return sorted(set(listed) | local | set(self._links))

    def kind(self, name: str) -> FileKind:
        """A commit object is a regular file (a sharded one's: a directory), a pointer object a
        symlink."""
        if name in self._links:
            return FileKind.SYMLINK
        if classify(name) is EntryKind.TEMP:
            return self._local.kind(name)
        if name in POINTER_NAMES:
            kind = FileKind.SYMLINK
        elif name == LATEST_JSON or _is_file(name):
            kind = FileKind.REGULAR
        elif _is_sharded(name):  # its commit object stands for the directory
            kind = FileKind.DIRECTORY
        else:
            return FileKind.MISSING
        try:
            there = self._read(name) is not None or self.head(name) is not None
        except FileNotFoundError:
            there = False
        return kind if there else FileKind.MISSING

    def size(self, name: str) -> int:
        """A checkpoint's size, as its commit records."""
        if classify(name) is EntryKind.TEMP:
            return self._local.size(name)
        if _committed(name):
            return self._commit_read(name).size
        meta = self.head(name)
        if meta is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.location.url(name)} does not exist")
        return int(meta["size"])

    def create_exclusive(self, name: str) -> BinaryIO:
        """A new local temp file in the cache; a checkpoint file's (unless :meth:`upload_from`
        names its source) is a stream that uploads it as it is written (s3client.Upload)."""
        file = self._local.create_exclusive(name)
        target = name.rpartition("-")[2]
        if not name.startswith(TEMP_PREFIX) or not _is_file(target) or target in self._sources:
            return file
        file.close()
        data = data_name(target, temp_token(name, target))
        self._uploads[name] = Upload(self, data, self._local.path(name), stream_plan())
        return cast(BinaryIO, self._uploads[name])

    def sync_file(self, file: BinaryIO) -> None:
        """fsync the local temp file (a stream: nothing to do; its upload makes it durable)."""
        if not isinstance(file, Upload):
            self._local.sync_file(file)

    def replace(self, source: str, target: str) -> None:
        """Publish the temp ``source`` as ``target``: upload and commit a checkpoint, or swap a
        pointer or ``latest.json``."""
        if source in self._links:
            self.swap(target, self._links[source].encode("utf-8"))
            del self._links[source]
        elif target == LATEST_JSON:
            self.swap(target, self._local.read_bytes(source, SMALL))
            self._local.remove(source)
        elif _is_file(target):
            self._commit(source, target)
            self._local.remove(source)
        else:  # a sharded checkpoint is committed by pitstop.shell.store.shardobjects
            raise OSError(errno.EINVAL, f"{self.location.url(target)}: not a checkpoint name")

    def upload_from(self, name: str, path: Path | None) -> None:
        """The publish of checkpoint ``name`` uploads the local file ``path`` (a checkpoint
        published in a local directory), not its temp file; ``None``: its temp file again."""
        if path is None:
            self._sources.pop(name, None)
        else:
            self._sources[name] = path

    def _commit(self, source: str, target: str) -> None:
        """Upload ``source`` (or the file :meth:`upload_from` names; a stream: complete its
        upload) to a data object of its own, then write its commit."""
        local = self._sources.get(target) or self._local.path(source)
        data = data_name(target, temp_token(source, target))
        upload = self._uploads.pop(source, None)
        try:
            if upload is not None:
                upload.finish()
            meta = fileformat.read_manifest(local).meta
            if upload is None:
                self.put(data, local, "overwrite")
        except BaseException:
            with contextlib.suppress(OSError):
                self.delete(data)
            raise
        entry = {k: meta[k] for k in ENTRY_KEYS if k in meta}
        self.write_commit(Commit(name=target, data=data, size=local.stat().st_size, entry=entry))

    def write_commit(self, commit: Commit) -> None:
        """Write ``commit`` by one conditional PUT: a create, or the swap of this writer's own
        earlier commit of its name (by its ETag), whose data objects go after (a failed one
        removes its own): of two writers committing one name, one wins."""
        name, old = commit.name, None
        try:
            seen = self.etag(name)  # a commit this process read or wrote
            if seen is not None:
                with contextlib.suppress(FileNotFoundError):  # (gone: created anew)
                    old = self.commit(name)
                if old is not None and self.etag(name) != seen:
                    raise FileExistsError(
                        errno.EEXIST, f"{self.location.url(name)} was replaced by another writer"
                    )
            self.put(name, encode_commit(commit), "create" if old is None else {"e_tag": seen})
        except BaseException:
            for obj in commit.objects():
                with contextlib.suppress(OSError):
                    self.delete(obj)
            raise
        if old is not None and old.data != commit.data:
            for obj in deletion_order(old)[1:]:
                with contextlib.suppress(OSError):
                    self.delete(obj)

    def sync_directory(self) -> None:
        """Nothing to do: each put is durable when it returns."""

    def symlink(self, target: str, name: str) -> None:
        """Note the temp pointer ``name`` -> ``target``; its replace puts it."""
        self._links[name] = target

    def read_link(self, name: str) -> str:
        """The checkpoint name the pointer object ``name`` holds."""
        if name in self._links:
            return self._links[name]
        raw = self._read(name, 4096)
        return (raw if raw is not None else self.get(name, 4096)).decode("utf-8", "replace").strip()

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The object ``name`` (``ValueError`` when larger than ``limit``)."""
        if classify(name) is EntryKind.TEMP:
            return self._local.read_bytes(name, limit)
        raw = self._read(name, limit)
        return raw if raw is not None else self.get(name, limit)

    def remove(self, name: str) -> None:
        """Remove ``name``: a checkpoint's commit object first, then its data."""
        if self._links.pop(name, None) is not None:
            return
        if classify(name) is EntryKind.TEMP:
            if (upload := self._uploads.pop(name, None)) is not None:
                upload.abort()
            self._local.remove(name)
            return
        if not _committed(name):
            self.delete(name)
            return
        for obj in deletion_order(self.commit(name)):
            self.delete(obj)

    # --- reading ----------------------------------------------------------------------

    def read_meta(self, name: str) -> Mapping[str, Any]:
        """The catalog fields of checkpoint ``name``, from its commit object alone."""
        return self._commit_read(name).entry

    def fetch(self, name: str) -> Path:
        """Read checkpoint ``name`` into memory, every blob's CRC-32 checked as it arrives
        (objectread); its local path in the cache, where it is read until :meth:`release`.
        ``CheckpointCorrupt`` naming the URL when it does not verify; ``FileNotFoundError`` when
        its commit is gone or replaced meanwhile. A sharded checkpoint: its local folder, every
        file fetched (:meth:`fetch_files`). The commit the last listing read is not read again."""
        if _is_sharded(name):
            self.fetch_files(name)
            return self._local.path(name)
        commit, path = self._commit_read(name), self._local.path(name)
        with self._gone_if_moved(name):
            return download(self, name, commit, path, memory=self.in_memory, blobs=self.as_blobs)

    @contextlib.contextmanager
    def _gone_if_moved(self, name: str) -> Iterator[None]:
        """A read of ``name`` that fails as corrupt raises ``FileNotFoundError`` instead when
        its commit is no longer the one read (deleted or replaced while it was read)."""
        seen = self.etag(name)
        try:
            yield
        except CheckpointCorrupt:
            try:
                meta = self.head(name)
            except OSError:  # cannot tell: corrupt, as it read
                meta = {"e_tag": seen}
            if meta is None or meta.get("e_tag") != seen:
                url = self.location.url(name)
                raise FileNotFoundError(errno.ENOENT, f"{url} was removed while read") from None
            raise

    def fetch_files(
        self, name: str, files: Collection[str] | None = None
    ) -> dict[str, tuple[int, int]]:
        """Download ``files`` of the committed sharded checkpoint ``name`` (default: every one,
        the manifest among them) into its local folder (the cache's ``name``), all at once,
        each file's size and CRC-32 checked against its commit as it arrives; ``{file: (size,
        CRC-32)}`` of what arrived. ``CheckpointCorrupt`` naming the URL and the file for one
        the commit does not list, or one missing, short or failing its checksum."""
        commit = self._commit_read(name)
        listed = {f.name: f for f in commit.files}
        wanted = sorted(listed if files is None else set(files))
        for file in wanted:
            if file not in listed:
                raise CheckpointCorrupt(f"{self.location.url(name)}: its commit lists no {file}")
        chosen = [listed[f] for f in wanted]
        with self._gone_if_moved(name):
            return download_files(self, name, commit.data, chosen, self._local.path(name))

    def release(self) -> None:
        """Free the checkpoint the last fetch holds in memory (tensors loaded from it keep
        their own memory)."""
        let_go(self.cache)

    def close(self) -> None:
        """Free the fetched checkpoint; remove the local cache, if this object made it."""
        self.release()
        if self._own_cache:
            shutil.rmtree(self.cache, ignore_errors=True)

    @contextlib.contextmanager
    def fetched(self, name: str) -> Iterator[Path]:
        """``name`` fetched for the duration of the block."""
        path = self.fetch(name)
        try:
            yield path
        finally:
            if path.is_dir():  # a sharded checkpoint's folder
                shutil.rmtree(path, ignore_errors=True)
            else:
                self.release()


# what a name is: a checkpoint file's, a sharded checkpoint's, either's (a commit object's)
_is_file, _is_sharded, _committed = is_file_name, is_sharded_name, is_checkpoint_name
