# Reading a checkpoint from object storage: ranged, parallel GETs into memory, each blob's
# CRC-32 checked as its bytes arrive.
#
# Rules: the data object's size must be the one its commit records (the tail's response says
# it: no request of its own). Its tail (footer and manifest; a second GET only for a manifest
# larger than the tail read) is requested first, and the RANGE-sized GETs of the rest right
# after it, without waiting (WORKERS at a time; the first holds the header); header, footer and
# manifest are checked as a local file's are (fileread.read_manifest) while those run. Each
# range is streamed, every CHUNK written where it belongs (its pages mapped) as it arrives (the
# copy overlaps the transfer); then, on its thread (once the manifest is checked: a range that
# arrived first waits for it), each piece of a blob it holds has its CRC-32 computed and every
# padding byte it holds is checked to be zero; a blob whose bytes are all in is compared with
# its manifest's CRC-32 at once, and the first one that fails stops the read (CheckpointCorrupt
# naming the URL and the blob; the requests still queued are cancelled). So every byte is
# checked as a local verify checks it, once, while the network is still busy.
# Where the bytes go: an anonymous memory file (memfd), held under the checkpoint's local path
# (pitstop.shell.format.untrusted.hold) once every check passed, and vouched for — the
# resume's read then loads it without checking it again, and every other reader opens it as a
# file. Nothing is written to a disk and nothing is left behind by a killed process; where
# there is no memfd (not Linux) a temp file of the cache is written and renamed instead.
# Memory: the checkpoint's size (the memory file, until its reader is done: the storage holds
# one at a time per cache, released by the next fetch, by the storage's release() after a
# resume, or by close()) plus at most WORKERS * RANGE bytes of responses in flight (in the
# whole process: its downloads share one pool).
# A sharded checkpoint's files (download_files) are read the same way, every part of every
# file in flight at once, into temp files of its local folder, each renamed once whole: each
# part's CRC-32 computed on its thread as it arrives, the file's joined from its parts in
# order and compared with the commit's record (size, CRC-32) when its last part is in, the
# first that fails stopping the read. The (size, CRC-32) of what arrived is returned, so the
# resume compares it with the manifest without reading the files again.
# How: one thread pool of WORKERS per process; obstore's GETs and streams release the GIL,
# os.pwrite, madvise (by ctypes: hostmem.advise) and the CRC-32 (format.checksums) too. A read
# that fails cancels its queued GETs and waits for the running ones
# before its memory file is closed.

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
from pitstop.core.sharding.sharded import ShardFile, file_problem
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat
from pitstop.shell.format.blobfile import PieceCheck
from pitstop.shell.format.checksums import crc32_combine, crc32_update
from pitstop.shell.format.hostmem import advise
from pitstop.shell.format.untrusted import hold, premap, release, vouch

_T = TypeVar("_T")
_J = TypeVar("_J")


class ObjectStorage(Protocol):
    """What a download needs of pitstop.shell.store.objectstore.ObjectStorage."""

    location: Location
    client: Any

    def call(self, what: str, name: str, request: Callable[[Any], _T]) -> _T: ...
    def head(self, name: str) -> dict[str, Any] | None: ...


__all__ = ["CHUNK", "RANGE", "TAIL", "WORKERS", "download", "download_files", "let_go", "pool"]

RANGE: Final = 8 << 20
"""Bytes per ranged GET."""

WORKERS: Final = 16
"""Ranged GETs in flight at once."""

CHUNK: Final = 1 << 20
"""Bytes of a streamed range written at a time, as they arrive."""

TAIL: Final = 1 << 20
"""Bytes read from the end of the object first: the footer and, usually, the whole manifest."""

_POPULATE_READ: Final = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.13 names it

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
    objects: ObjectStorage, name: str, commit: Commit, target: Path, *, memory: bool = True
) -> Path:
    """Read checkpoint ``name`` of ``objects`` (its ``commit`` as read) into memory held at
    ``target`` (its local path in the cache), every byte checked as it arrives; ``target``. Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the URL (a missing or short data object,
    a bad manifest, a blob failing its CRC-32, a padding byte not zero) with nothing held.
    ``memory=False``: into a file of the cache, for other processes to read (ranks that share
    the directory read rank 0's download), checked the same way as it arrives."""
    url = objects.location.url(name)
    if commit.size < HEADER_SIZE + FOOTER_SIZE:
        raise CheckpointCorrupt(f"{url}: {commit.size} bytes, too few for a checkpoint file")
    let_go(target.parent)
    memory = memory and hasattr(os, "memfd_create")
    if memory:
        fd = os.memfd_create(f"pitstop-{name}", os.MFD_CLOEXEC)
        where = target
        hold(where, fd)  # owned there from now on; opened by the manifest's check
    else:  # no anonymous memory file here: a temp file of the cache, renamed when checked
        target.parent.mkdir(parents=True, exist_ok=True)
        where = target.with_name(f"{TEMP_PREFIX}fetch{uuid.uuid4().hex[:8]}-{name}")
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, commit.size)
        read = _Download(objects, commit.data, fd, url)
        if memory:  # the first load's map, its pages mapped as they are written (premap)
            read.mapping = mmap.mmap(fd, commit.size, access=mmap.ACCESS_COPY)
        read.run(where, commit.size)
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
    """One checkpoint's read: its manifest, then its data region, checked as it arrives."""

    def __init__(self, objects: ObjectStorage, data: str, fd: int, url: str) -> None:
        self.objects, self.data, self.fd, self.url = objects, data, fd, url
        self.mapping: mmap.mmap | None = None  # a private map of the file, pages mapped as written
        self.key = objects.location.key(data)

    def get(self, start: int, end: int) -> Any:
        """Bytes ``start..end`` of the data object."""
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

    def stream(
        self, start: int, end: int, header: concurrent.futures.Future[bytes] | None = None
    ) -> list[tuple[memoryview, int]]:
        """Bytes ``start..end``, each chunk written as it arrives (:meth:`put`), as ``(bytes,
        offset)`` chunks; ``header`` (a range from 0) gets the header once its bytes are in."""
        client, key, span = self.objects.client, self.key, (start, end)

        def request(o: Any) -> list[tuple[memoryview, int]]:
            chunks, at = [], start
            for chunk in o.get(client, key, options={"range": span}).stream(min_chunk_size=CHUNK):
                chunks.append((self.put(chunk, at), at))
                at += len(chunk)
                if header is not None and not header.done() and at >= HEADER_SIZE:
                    header.set_result(os.pread(self.fd, HEADER_SIZE, 0))
            return chunks

        chunks = self.objects.call("read", self.data, request)
        if sum(view.nbytes for view, _ in chunks) != end - start:
            raise CheckpointCorrupt(f"{self.url}: bytes {start}..{end} of {self.data} came short")
        return chunks

    def run(self, where: Path, size: int) -> None:
        """Read and check the whole object (``size`` bytes, as its commit says) into the memory
        file held at ``where``: its tail, then its ranges from byte 0 (the first holds the
        header), all at once; the manifest checked here once tail and header are in."""
        tail = max(HEADER_SIZE, size - TAIL)
        ends = pool().submit(self.tail, tail, size)
        header, ready = concurrent.futures.Future[bytes](), threading.Event()
        checks: list[PieceCheck] = []

        def look(view: memoryview, at: int) -> list[tuple[int, int, int, int]]:
            ready.wait()  # set once the manifest is checked or has failed
            skip = min(view.nbytes, max(0, HEADER_SIZE - at))  # the header: checked by first()
            view, at = view[skip:], at + skip
            stop = checks[0].manifest.manifest_offset if checks else at
            return checks[0].piece(view[: stop - at], at) if stop > at else []

        def arrive(span: tuple[int, int]) -> list[tuple[int, int, int, int]]:
            try:
                chunks = self.stream(*span, header if span[0] == 0 else None)
            except BaseException as exc:  # the header's wait ends with the range's failure
                if span[0] == 0 and not header.done():
                    header.set_exception(exc)
                raise
            return [found for view, at in chunks for found in look(view, at)]

        def first() -> None:
            try:
                end = self.put(self.size(ends, size), tail)
                manifest = self.manifest(where, size, tail, header.result(), end)
                checks.append(PieceCheck(manifest, self.url))
            finally:
                ready.set()
            if manifest.manifest_offset > tail:  # the tail read holds data bytes too
                checks[0].note(checks[0].piece(end[: manifest.manifest_offset - tail], tail))

        ranges = range_reads(tail, max(RANGE, HEADER_SIZE))  # the first holds the header
        try:
            _spans(ranges, arrive, lambda f: checks[0].note(f), first)
        finally:
            ready.set()
            concurrent.futures.wait([ends])
        checks[0].finish()

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
        self, where: Path, size: int, tail: int, header: bytes, end: memoryview
    ) -> Manifest:
        """The manifest, with ``header`` and ``end`` (the bytes from ``tail``) in the memory
        file: header, footer and manifest checked as a local file's."""
        try:
            version = check_header(header, name=self.url)
            footer = check_footer(
                end[-FOOTER_SIZE:].tobytes(), name=self.url, size=size, version=version
            )
            if footer.manifest_offset < tail:
                self.put(self.get(footer.manifest_offset, tail), footer.manifest_offset)
            return fileformat.read_manifest(where)
        except CheckpointCorrupt as exc:
            raise CheckpointCorrupt(f"{self.url}: {exc}") from None


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
            f.name: _Download(objects, f"{folder}/{f.name}", fds[f.name], url) for f in files
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
