# Reading a checkpoint from object storage: ranged, parallel GETs into memory, each blob's
# CRC-32 checked as its bytes arrive.
#
# Rules: the data object's size must be the one its commit records (the tail's response says
# it). Its header and tail (footer and, usually, the manifest: a second GET only for a manifest
# longer than TAIL) are requested at once and checked as a local file's are
# (fileread.manifest_of); then the data region's ranged GETs, WORKERS at a time, cut where the
# core says (pitstop.core.s3.reads: at blob starts, neighbours joined up to RANGE bytes). On its
# thread, as each range arrives, each blob piece it holds has its CRC-32 computed and every
# padding byte it holds is checked to be zero; a blob whose bytes are all in is compared with
# its manifest's CRC-32 at once, and the first that fails stops the read (CheckpointCorrupt
# naming the URL and the blob; the GETs still queued are cancelled). Where the bytes go:
#   * blobs=True (the resume's read): nowhere. obstore's buffers are kept (a blob of at most
#     SPLIT bytes arrives in one, so it is never copied; a longer one is joined from its
#     pieces) and held with the manifest under the checkpoint's local path once every check
#     passed (untrusted.hold_blobs): read_manifest answers from them, and the first load builds
#     its tensors over the buffers (the restore's copy into the live tensors is the one copy).
#   * else a memory file (memfd), each range written where it belongs as it arrives (its pages
#     mapped), held under that path (untrusted.hold) and vouched for once every check passed:
#     every reader opens it as a file. Without memfd (not Linux), or for other processes to
#     read (memory=False): a temp file of the cache, renamed once checked.
# Memory: the checkpoint's size (held until its reader is done: one per cache, released by the
# next fetch, by the storage's release() after a resume, or by close()) plus, into a file, at
# most WORKERS * RANGE bytes of responses in flight (the process's downloads share one pool).
# A sharded checkpoint's files (download_files) are read the same way, every part of every file
# in flight at once, into temp files of its local folder renamed once whole: each part's CRC-32
# computed on its thread as it arrives, the file's joined from its parts in order and compared
# with the commit's record (size, CRC-32) once its last part is in, the first that fails
# stopping the read; the (size, CRC-32) of what arrived is returned, so the resume compares it
# with the manifest without reading the files again.
# How: one pool of WORKERS threads per process; obstore's GETs release the GIL, os.pwrite,
# madvise (hostmem.advise) and the CRC-32 (format.checksums) too. A read that fails cancels its
# queued GETs and waits for the running ones before its memory is let go.

"""Downloading a checkpoint from object storage into memory, checked as it arrives."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from pitstop.core.file.manifest import (
    FOOTER_SIZE,
    HEADER_SIZE,
    Manifest,
    check_footer,
    check_header,
)
from pitstop.core.naming import TEMP_PREFIX
from pitstop.core.s3.objects import Commit, Location, range_reads
from pitstop.core.s3.reads import plan_reads
from pitstop.core.sharding.sharded import ShardFile, file_problem
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.blobfile import PieceCheck, blob_views
from pitstop.shell.format.checksums import crc32_combine, crc32_update
from pitstop.shell.format.fileread import manifest_of
from pitstop.shell.format.hostmem import advise
from pitstop.shell.format.untrusted import hold, hold_blobs, premap, release, vouch

_T = TypeVar("_T")
_J = TypeVar("_J")


class ObjectStorage(Protocol):
    """What a download needs of pitstop.shell.store.objectstore.ObjectStorage."""

    location: Location
    client: Any

    def call(self, what: str, name: str, request: Callable[[Any], _T]) -> _T: ...
    def head(self, name: str) -> dict[str, Any] | None: ...


__all__ = ["RANGE", "SPLIT", "TAIL", "WORKERS", "download", "download_files", "let_go", "pool"]

RANGE: Final = 8 << 20
"""Bytes per ranged GET: neighbouring blobs joined up to it; into a memory file, at most this."""

SPLIT: Final = 64 << 20
"""A blob held as its buffers is read by one GET up to this size (a longer one in pieces of
it, joined): the fewer copies against the more connections."""

WORKERS: Final = 16
"""Ranged GETs in flight at once."""

TAIL: Final = 256 << 10
"""Bytes read from the end of the object first: the footer and, usually, the whole manifest."""

_POPULATE_READ: Final = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.13 names it
_Arrived = tuple[int, memoryview, list[tuple[int, int, int, int]]]  # a range: where, bytes, pieces

_HELD: dict[Path, Path] = {}  # cache directory -> the checkpoint held in memory for it
_HELD_LOCK = threading.Lock()
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []  # the process's GET threads, made once


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The WORKERS threads every download (and listing's small reads) of this process shares
    (started once: a thread's start costs more than a GET on loopback)."""
    with _HELD_LOCK:
        if not _POOL:
            _POOL.append(concurrent.futures.ThreadPoolExecutor(WORKERS, "pitstop-get"))
        return _POOL[0]


def let_go(cache: Path) -> None:
    """Free the checkpoint held in memory for ``cache`` (tensors mapped from it keep theirs)."""
    with _HELD_LOCK:
        path = _HELD.pop(cache, None)
    if path is not None:
        release(path)


def download(
    objects: ObjectStorage,
    name: str,
    commit: Commit,
    target: Path,
    *,
    memory: bool = True,
    blobs: bool = False,
) -> Path:
    """Read checkpoint ``name`` of ``objects`` (its ``commit`` as read) into memory held at
    ``target`` (its local path in the cache), every byte checked as it arrives; ``target``. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the URL (a missing or short data object,
    a bad manifest, a blob failing its CRC-32, a padding byte not zero) with nothing held.
    ``blobs``: held as its manifest and obstore's buffers, for one load (the resume's).
    ``memory=False``: into a file of the cache, for other processes to read (ranks that share
    the directory read rank 0's download), checked the same way as it arrives."""
    url = objects.location.url(name)
    if commit.size < HEADER_SIZE + FOOTER_SIZE:
        raise CheckpointCorrupt(f"{url}: {commit.size} bytes, too few for a checkpoint file")
    let_go(target.parent)
    if blobs and memory:
        read = _Download(objects, commit.data, url)
        manifest, views = read.run(commit.size, lambda piece, _: memoryview(piece), SPLIT, True)
        hold_blobs(target, manifest, blob_views(manifest, views))
        with _HELD_LOCK:
            _HELD[target.parent] = target
        return target
    memory = memory and hasattr(os, "memfd_create")
    if memory:
        fd = os.memfd_create(f"pitstop-{name}", os.MFD_CLOEXEC)
        where = target
        hold(where, fd)  # owned there from now on
    else:  # no anonymous memory file here: a temp file of the cache, renamed when checked
        target.parent.mkdir(parents=True, exist_ok=True)
        where = target.with_name(f"{TEMP_PREFIX}fetch{uuid.uuid4().hex[:8]}-{name}")
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, commit.size)
        read = _Download(objects, commit.data, url, fd)
        if memory:  # the first load's map, its pages mapped as they are written (premap)
            read.mapping = mmap.mmap(fd, commit.size, access=mmap.ACCESS_COPY)
        read.run(commit.size, read.put, RANGE)
    except BaseException:
        if memory:
            release(where)
        else:
            os.close(fd)
            os.unlink(where)
        raise
    if memory:
        vouch(where)
        if read.mapping is not None:
            premap(where, read.mapping)
        with _HELD_LOCK:
            _HELD[target.parent] = target
    else:
        os.close(fd)
        os.replace(where, target)
    return target


def download_files(
    objects: ObjectStorage, name: str, folder: str, files: Sequence[ShardFile], target: Path
) -> dict[str, tuple[int, int]]:
    """Download the data objects ``folder/<file>`` of checkpoint ``name`` (a sharded one's
    ``files``, as its commit lists them) into the folder ``target``: every part of every file
    in flight at once (WORKERS ranged GETs), each part's CRC-32 computed on its own thread as
    it arrives and the file's, joined in order, compared with the commit's once its last part
    is in; each file written to a temp file renamed once whole and checked. ``{file: (size,
    CRC-32)}`` of what arrived, so a reader checks it against the manifest without reading it
    again. Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the URL and the file (one
    missing, of another size, or failing its checksum), with no temp file left."""
    url, names = objects.location.url(name), [f"{folder}/{f.name}" for f in files]
    sizes = list(pool().map(objects.head, names))  # every HEAD at once
    for file, meta in zip(files, sizes, strict=True):
        size = None if meta is None else int(meta["size"])
        if size != file.size:
            raise CheckpointCorrupt(f"{url}: {file_problem(file, size, None, 'its commit')}")
    target.mkdir(parents=True, exist_ok=True)
    temps = {f.name: target / f"{TEMP_PREFIX}fetch{uuid.uuid4().hex[:8]}-{f.name}" for f in files}
    fds: dict[str, int] = {}
    try:
        for file in files:
            fds[file.name] = os.open(
                temps[file.name], os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
            os.ftruncate(fds[file.name], file.size)
        _Files(objects, url, folder, files, fds).run(lambda f: os.replace(temps[f], target / f))
    finally:
        for done, fd in fds.items():
            os.close(fd)
            temps[done].unlink(missing_ok=True)  # renamed once whole and checked
    return {f.name: (f.size, f.crc32) for f in files}


class _Download:
    """One checkpoint's read: its header and tail, its manifest, then its data region, checked
    as it arrives."""

    def __init__(self, objects: ObjectStorage, data: str, url: str, fd: int = -1) -> None:
        self.objects, self.data, self.fd, self.url = objects, data, fd, url
        self.mapping: mmap.mmap | None = None  # a private map of the file, pages mapped as written
        self.key = objects.location.key(data)

    def get(self, start: int, end: int) -> Any:
        """Bytes ``start..end`` of the data object (obstore's buffer)."""
        client, key = self.objects.client, self.key
        return self.objects.call(
            "read", self.data, lambda o: o.get_range(client, key, start=start, end=end)
        )

    def put(self, piece: Any, at: int) -> memoryview:
        """Write ``piece`` at ``at`` in the memory file; its bytes as a view."""
        view = memoryview(piece).cast("B")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self.fd, view[done:], at + done)
        mapping = self.mapping
        if mapping is not None:  # map its pages now, not by faults in the load's copy
            start = at - at % mmap.PAGESIZE
            if not advise(mapping, start, at + view.nbytes - start, _POPULATE_READ):
                self.mapping = None  # a kernel before 5.14: the load's faults map them
        return view

    def run(
        self, size: int, sink: Callable[[Any, int], memoryview], split: int, keep: bool = False
    ) -> tuple[Manifest, dict[int, memoryview]]:
        """Read and check the whole object (``size`` bytes, as its commit says), each response
        given to ``sink(buffer, offset)`` (which keeps or writes it: its bytes as a view): header
        and tail at once, the manifest checked, then the data region's ranges (blobs longer
        than ``split`` in pieces); the manifest, and (``keep``) the data region's views by
        offset."""
        tail = max(HEADER_SIZE, size - TAIL)
        header, ends = pool().submit(self.get, 0, HEADER_SIZE), pool().submit(self.tail, tail, size)
        try:
            end = sink(self.size(ends, size), tail)
            manifest = self.manifest(size, tail, sink(header.result(), 0), end, sink)
        finally:
            concurrent.futures.wait([header, ends])
        check, got = PieceCheck(manifest, self.url), {}
        spans = [(b.offset, b.length) for b in manifest.blobs]
        reads = plan_reads(spans, HEADER_SIZE, manifest.manifest_offset, join=RANGE, split=split)

        def arrive(span: tuple[int, int]) -> _Arrived:
            view = sink(self.get(*span), span[0])
            if view.nbytes != span[1] - span[0]:
                raise CheckpointCorrupt(f"{self.url}: bytes {span[0]}..{span[1]} came short")
            return span[0], view, check.piece(view, span[0])

        def seen(found: _Arrived) -> None:
            if keep:
                got[found[0]] = found[1]
            check.note(found[2])

        _spans(reads, arrive, seen)
        check.finish()
        return manifest, got

    def tail(self, tail: int, size: int) -> Any:
        """obstore's response to the GET of bytes ``tail..size`` (it says the object's size)."""
        client, key = self.objects.client, self.key
        return self.objects.call(
            "read", self.data, lambda o: o.get(client, key, options={"range": (tail, size)})
        )

    def size(self, ends: concurrent.futures.Future[Any], size: int) -> Any:
        """The tail's bytes, once its response says the object is ``size`` bytes long."""
        try:
            found = ends.result()
            held = int(found.meta["size"])
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{self.url}: its data object {self.data} is missing") from None
        except OSError:  # a range past its end: shorter than its commit says?
            meta = self.objects.head(self.data)
            if meta is None or int(meta["size"]) == size:
                raise
            held = int(meta["size"])
        if held != size:
            raise CheckpointCorrupt(
                f"{self.url}: its data object holds {held} bytes, its commit says {size}"
            )
        return self.objects.call("read", self.data, lambda o: found.bytes())

    def manifest(
        self,
        size: int,
        tail: int,
        header: memoryview,
        end: memoryview,
        sink: Callable[[Any, int], memoryview],
    ) -> Manifest:
        """The manifest, from ``header`` and ``end`` (the bytes from ``tail``; a manifest that
        starts before them read now): header, footer and manifest checked as a local file's."""
        version = check_header(header.tobytes(), name=self.url)
        footer = check_footer(
            end[-FOOTER_SIZE:].tobytes(), name=self.url, size=size, version=version
        )
        start = footer.manifest_offset
        if start < tail:  # a manifest longer than the tail read
            data = sink(self.get(start, tail), start).tobytes() + end[:-FOOTER_SIZE].tobytes()
        else:
            data = end[start - tail : -FOOTER_SIZE].tobytes()
        return manifest_of(self.url, size=size, version=version, footer=footer, data=data)


def _spans(
    jobs: Sequence[_J],
    arrive: Callable[[_J], _T],
    seen: Callable[[_T], None],
    first: Callable[[], None] | None = None,
) -> None:
    """``arrive(job)`` for every job, WORKERS at a time on the process's GET threads; ``seen``
    takes what each returned, on this thread, in the order they end, after ``first()`` (run
    here while the jobs run). The first failure stops the rest: none queued starts, and none
    running still writes, once this returns."""
    futures = [pool().submit(arrive, job) for job in jobs]
    try:
        if first is not None:
            first()
        for done in concurrent.futures.as_completed(futures):
            seen(done.result())
    finally:
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)


class _Files:
    """Several files' ranged GETs at once, each file's CRC-32 joined from its parts in order."""

    def __init__(
        self,
        objects: ObjectStorage,
        url: str,
        folder: str,
        files: Sequence[ShardFile],
        fds: dict[str, int],
    ) -> None:
        self.url, self.files = url, {f.name: f for f in files}
        self.reads = {
            f.name: _Download(objects, f"{folder}/{f.name}", url, fds[f.name]) for f in files
        }
        self.parts: dict[str, dict[int, tuple[int, int]]] = {f.name: {} for f in files}
        self.left = {f.name: f.size for f in files}

    def run(self, done: Callable[[str], None]) -> None:
        """Read every file; ``done(file)`` once each is whole and checked."""
        for name, left in self.left.items():
            if left == 0:
                self.check(name, done)
        jobs = [(n, r) for n, f in self.files.items() for r in range_reads(f.size, RANGE)]

        def arrive(job: tuple[str, tuple[int, int]]) -> tuple[str, int, int, int]:
            name, (start, end) = job
            read = self.reads[name]
            return name, start, crc32_update(read.put(read.get(start, end), start)), end - start

        def seen(found: tuple[str, int, int, int]) -> None:
            name, start, crc, length = found
            self.parts[name][start] = (crc, length)
            self.left[name] -= length
            if self.left[name] == 0:
                self.check(name, done)

        _spans(jobs, arrive, seen)

    def check(self, name: str, done: Callable[[str], None]) -> None:
        """The file's CRC-32, joined from its parts in order, against its commit's."""
        crc = 0
        for at in sorted(self.parts[name]):
            piece, length = self.parts[name][at]
            crc = crc32_combine(crc, piece, length)
        expected = self.files[name]
        problem = file_problem(expected, expected.size, crc, "its commit")
        if problem is not None:
            raise CheckpointCorrupt(f"{self.url}: {problem}")
        done(name)
