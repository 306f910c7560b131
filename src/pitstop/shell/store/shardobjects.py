# A sharded checkpoint (DCP's files and pitstop's manifest) on object storage.
#
# Rules: the objects and the commit record are the core's (pitstop.core.s3.objects). Every rank
# writes its shards through DCP into a local staging folder of its own (the ObjectStorage's cache
# directory: DCP's file writer, with its sizes and CRC-32s taken as it writes), then uploads the
# files it wrote to `.data/<token>/<name>/<file>` inside DCP's write step — so a failed upload is
# that rank's write failure, which DCP's gather of the results raises on every rank, and a save
# whose write returned has every rank's shards uploaded (upload_shards). Rank 0 then writes the
# manifest, uploads it and DCP's `.metadata`, lists the data folder and writes the one commit
# object only when the core says every file is there at its size (commit_sharded), as a file's
# (ObjectStorage.write_commit): a create (If-None-Match: *), or the swap of its own earlier
# commit of that name (If-Match), whose data objects are deleted after. A failed commit deletes
# this attempt's data objects (what cannot be deleted is an orphan the next writer's open
# removes). Reading (ObjectStorage.fetch_files): the
# commit's files, or only those named (a resume's rank: the manifest, then what its read plan
# needs), are downloaded to a local folder, each checked against its commit's size; the CRC-32s
# are checked by the reader (pitstop.shell.store.sharddir.verify_sharded) before DCP reads.
# A remote tier (pitstop.shell.store.tiers) stages a sharded checkpoint published in its local
# directory by hard links (stage_links; the local retention may delete it meanwhile) and
# commits it as rank 0 commits one (every file not listed yet is uploaded, then the commit); a
# resume that takes one from the remote tier downloads its files (all, or on nodes sharing no
# directory the ones a node lacks: the core's tier_takes) into a local temp folder
# (download_sharded: the checked download, then each file fsynced and its CRC-32 compared with
# the commit's, the folder fsynced), which the local directory then publishes by its rename
# (or, where the node holds part of the same save, each file moved in: place_files).
# On nodes sharing no directory each node's writer uploads its ranks' files (NodeUploads) and
# rank 0 commits once the listing shows them all (await_files, bounded by timeout_s); a writer
# whose upload failed leaves a failure object there (the core's failure_name, its cause as
# text), and rank 0's wait fails at its next listing, naming the rank and the cause.
# How: an ObjectStorage's requests; the staging folders are local files of this process.

"""Sharded checkpoints on ``s3://``: upload each rank's shards, commit them."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pitstop.core.naming import temp_name, temp_token
from pitstop.core.records import CheckpointEntry
from pitstop.core.s3.objects import (
    commit_problem,
    data_name,
    failed_uploads,
    failure_name,
    sharded_commit,
)
from pitstop.core.sharding.layoutwire import files_from_wire
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardFile, file_problem
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.format.checksums import crc32
from pitstop.shell.store.objectread import download_files
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.storage import FileKind, LocalStorage

__all__ = [
    "NodeUploads",
    "Wanted",
    "await_files",
    "commit_sharded",
    "download_sharded",
    "place_files",
    "publish_objects",
    "stage_links",
    "upload_node_files",
    "upload_shards",
]

log = logging.getLogger("pitstop")

Wanted = Callable[[Sequence[ShardFile]], Collection[str]] | None
"""Which of a commit's files a download takes (``None``: every one)."""


@attrs.frozen
class NodeUploads:
    """A node's writer's part in a sharded remote tier on nodes that share no directory:
    ``token`` (rank 0's run id, agreed) names one data folder per checkpoint for every node;
    ``ranks`` share this writer's directory; ``commits``: rank 0, which holds the lease and
    commits once the listing shows every file (waiting at most ``patience`` seconds)."""

    token: str
    ranks: tuple[int, ...]
    commits: bool
    patience: float
    seqs: dict[tuple[int, int], int] = attrs.field(factory=dict, eq=False)
    """``(step, own seq)`` of each save this writer followed: rank 0's seq of it (a node that
    caught up may number its saves otherwise than rank 0's directory)."""

    def follows(self, step: int, own: int, seq: int) -> None:
        """This writer's save of ``step`` numbered ``own`` here is rank 0's ``seq`` (the last
        64 saves kept: each is uploaded soon after it is published)."""
        self.seqs[(step, own)] = seq
        while len(self.seqs) > 64:
            del self.seqs[next(iter(self.seqs))]

    def temp(self, entry: CheckpointEntry) -> str:
        """The attempt at ``entry`` every node's writer uploads into (its name, rank 0's seq)."""
        seq = self.seqs.get((entry.step, entry.seq), entry.seq)
        return temp_name(entry.name, f"{self.token}-{seq}")

    def send(self, storage: ObjectStorage, entry: CheckpointEntry, staged: Path) -> None:
        """Another node's writer than rank 0's: upload its ranks' files of the sharded
        checkpoint ``entry`` staged at ``staged`` (:func:`upload_node_files`); a failure is
        left for rank 0 to see (:meth:`failed`), then raised."""
        if entry.sharded:
            try:
                upload_node_files(storage, self.temp(entry), staged, self.ranks)
            except Exception as exc:
                self.failed(storage, entry, exc)
                raise

    def failed(self, storage: ObjectStorage, entry: CheckpointEntry, exc: BaseException) -> None:
        """Another node's writer than rank 0's, whose upload of ``entry`` failed with ``exc``:
        say so in the attempt's data folder (the core's failure_name), where rank 0's
        :meth:`wait` sees it at its next listing and fails the commit at once. Best effort:
        a prefix that cannot be written leaves rank 0 waiting ``patience`` seconds at most."""
        if not entry.sharded:
            return
        temp = self.temp(entry)
        name = _final(temp)
        folder = data_name(name, temp_token(temp, name))
        rank = min(self.ranks)
        text = f"rank {rank}'s node could not upload its files of {name}: {exc}"
        try:
            storage.put(failure_name(folder, rank), text.encode(), "overwrite")
        except OSError as problem:
            log.warning("could not tell rank 0 that %s: %s", text, problem)

    def wait(self, storage: ObjectStorage, temp: str) -> None:
        """Rank 0: :func:`await_files` for the attempt ``temp``, ``patience`` at most."""
        await_files(storage, temp, self.patience)


def _final(temp: str) -> str:
    """The checkpoint name a temp folder ``.tmp-<token>-<name>`` is for."""
    return temp.rpartition("-")[2]


def upload_shards(storage: ObjectStorage, directory: Path, table: Iterable[ShardFile]) -> None:
    """Every rank, in DCP's write step: upload the files of ``table`` (the ones this rank
    wrote) from its local staging folder ``directory`` (``.tmp-<token>-<name>``) to the data
    objects of the checkpoint it will be. Raises ``OSError`` naming the object."""
    name = _final(directory.name)
    folder = data_name(name, temp_token(directory.name, name))
    for file in table:
        storage.put(f"{folder}/{file.name}", directory / file.name, "overwrite")


def _table(staged: Path) -> tuple[ShardFile, ...]:
    """Every rank's files, as the manifest staged in ``staged`` lists them."""
    meta = fileformat.read_manifest(staged / MANIFEST_NAME).meta
    return files_from_wire(meta.get("sharded"), f"{staged / MANIFEST_NAME}: sharded")


def upload_node_files(
    storage: ObjectStorage, temp: str, staged: Path, ranks: Iterable[int]
) -> list[str]:
    """A node's writer other than rank 0's: upload the files of the sharded checkpoint staged
    at ``staged`` that ``ranks`` (the ranks sharing its directory) wrote, into the data folder
    of the attempt ``temp`` that rank 0 commits (no lease taken: rank 0 holds it). Their names;
    raises ``OSError`` naming the object."""
    name = _final(temp)
    folder = data_name(name, temp_token(temp, name))
    mine = set(ranks)
    sent = []
    for file in _table(staged):
        if file.rank in mine and file.name != MANIFEST_NAME and (staged / file.name).is_file():
            storage.put(f"{folder}/{file.name}", staged / file.name, "overwrite")
            sent.append(file.name)
    return sent


def await_files(storage: ObjectStorage, temp: str, patience: float) -> None:
    """Rank 0, before it commits the attempt ``temp`` (staged in ``storage.path(temp)``): wait
    until the listing shows every file of the manifest's table it does not hold at its size
    (other nodes' writers upload them), for at most ``patience`` seconds; a writer whose upload
    failed said so in the data folder (:meth:`NodeUploads.failed`): then at once. Raises
    :class:`~pitstop.errors.SaveError` naming the checkpoint and each file still missing (and
    each failed writer's rank and cause)."""
    local = storage.path(temp)
    name = _final(temp)
    folder = data_name(name, temp_token(temp, name))
    others = [f for f in _table(local) if not (local / f.name).is_file()]
    deadline = time.monotonic() + patience
    pause = 0.05
    while True:
        listed = _listed(storage, folder)
        missing = [f for f in others if listed.get(f"{folder}/{f.name}") != f.size]
        if not missing:
            return
        lack = ", ".join(f"{f.name} (rank {f.rank}, {f.size} bytes)" for f in missing)
        failed = failed_uploads(folder, listed)
        if failed:
            said = "; ".join(_said(storage, key, rank) for rank, key in failed)
            raise SaveError(f"{storage.location.url(name)} is not committed: {said} ({lack})")
        if time.monotonic() >= deadline:
            raise SaveError(
                f"{storage.location.url(name)} is not committed: after {patience:.0f} s the "
                f"other nodes' writers had not uploaded {lack}; see their logs"
            )
        time.sleep(pause)  # another process's upload: nothing to wait on but the listing
        pause = min(pause * 2, 1.0)


def _said(storage: ObjectStorage, key: str, rank: int) -> str:
    """What node writer ``rank``'s failure object ``key`` says (its cause)."""
    try:
        return storage.get(key, 4096).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return f"rank {rank}'s node could not upload its files (its message unread: {exc})"


def publish_objects(
    storage: ObjectStorage,
    temp: str,
    name: str,
    *,
    replaced: Callable[[], None] | None = None,
    manifest: Callable[[Path], None] | None = None,
) -> None:
    """Rank 0: pitstop.shell.store.sharddir.publish_sharded on object storage — ``manifest``
    writes the manifest into the staging folder ``temp``, then :func:`commit_sharded` commits
    it by one conditional PUT, so ``name`` holds the old checkpoint or the new one (then
    ``replaced()`` is called, if one was there); the staging folder goes either way. Raises
    :class:`~pitstop.errors.SaveError` naming the checkpoint."""
    local = storage.path(temp)
    try:
        if manifest is not None:
            manifest(local)
        replacing = storage.kind(name) is not FileKind.MISSING
        meta = fileformat.read_manifest(local / MANIFEST_NAME).meta
        files = files_from_wire(meta.get("sharded"), f"{local / MANIFEST_NAME}: sharded")
        commit_sharded(storage, temp, name, files, meta)
    except Exception as exc:
        shutil.rmtree(local, ignore_errors=True)
        if isinstance(exc, SaveError):
            raise
        raise SaveError(f"could not commit {storage.location.url(name)}: {exc}") from exc
    if replacing and replaced is not None:
        replaced()


def _listed(storage: ObjectStorage, folder: str) -> dict[str, int]:
    """``{relative name: size}`` of every object under ``folder`` (relative to the prefix)."""
    prefix = storage.location.key(folder) + "/"
    cut = len(storage.location.prefix) + 1 if storage.location.prefix else 0

    def walk(o: Any) -> dict[str, int]:
        found = o.list(storage.client, prefix)
        return {str(m["path"])[cut:]: int(m["size"]) for chunk in found for m in chunk}

    return storage.call("list", folder, walk)


def commit_sharded(
    storage: ObjectStorage,
    temp: str,
    name: str,
    files: Iterable[ShardFile],
    meta: Mapping[str, Any],
) -> None:
    """Rank 0: publish the staged checkpoint ``temp`` (every rank's shards uploaded, the
    manifest written into it last; ``files``: every rank's, as its layout lists them;
    ``meta``: its manifest's) as ``name``: upload the manifest and what else of rank 0's is
    not uploaded yet, check the listing, write the commit. The local folder goes either way.
    Raises :class:`~pitstop.errors.SaveError` naming what is missing, ``FileExistsError``
    when another writer committed ``name``, ``OSError`` for a request that failed."""
    local = storage.path(temp)
    try:
        data = (local / MANIFEST_NAME).read_bytes()
        manifest = ShardFile(
            name=MANIFEST_NAME, size=len(data), crc32=crc32(memoryview(data)), rank=0
        )
        commit = sharded_commit(name, temp_token(temp, name), (*files, manifest), meta)
        listed = _listed(storage, commit.data)
        for file in commit.files:  # rank 0's own: .metadata and the manifest
            key = f"{commit.data}/{file.name}"
            if key not in listed and (local / file.name).is_file():
                storage.put(key, local / file.name, "overwrite")
                listed[key] = (local / file.name).stat().st_size
        problem = commit_problem(commit, listed)
        if problem is not None:
            raise SaveError(f"{storage.location.url(name)} is not committed: {problem}")
        storage.write_commit(commit)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def stage_links(source: Path, staged: Path) -> None:
    """Stage the sharded checkpoint published at ``source`` (a local directory) at ``staged``
    for its upload: every file hard-linked (copied where no link can be made), so the local
    retention may delete ``source`` meanwhile. ``FileNotFoundError``, nothing staged, when
    ``source`` (or its manifest) is gone."""
    staged.mkdir(parents=True)
    try:
        names = sorted(e.name for e in os.scandir(source) if e.is_file(follow_symlinks=False))
        if MANIFEST_NAME not in names:
            raise FileNotFoundError(f"{source / MANIFEST_NAME} is gone")
        for name in names:
            try:
                os.link(source / name, staged / name)
            except FileNotFoundError:
                raise
            except OSError:
                shutil.copyfile(source / name, staged / name)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def download_sharded(
    storage: ObjectStorage,
    name: str,
    root: Path,
    file_table: Callable[[Path, list[str], int], Iterable[ShardFile]],
    only: Wanted = None,
) -> tuple[str, ...]:
    """Download the committed sharded checkpoint ``name`` into the new local folder ``root``,
    ready to be published by a rename: every file (``only``: those it names of the commit's
    files) by the checked download (its size and CRC-32 as it arrives), then fsynced and its
    CRC-32 compared with the commit's again as it lies on the disk (``file_table``: sharddir's,
    which fsyncs and checksums files), then the folder fsynced. The names downloaded (none:
    ``root`` is not made). Raises
    :class:`~pitstop.errors.CheckpointCorrupt` naming the URL and the file, ``OSError`` or
    :class:`~pitstop.errors.SaveError` (a file that could not be fsynced); ``root`` goes then."""
    commit = storage.commit(name)
    wanted = set(only(commit.files)) if only is not None else {f.name for f in commit.files}
    files = [f for f in commit.files if f.name in wanted]
    if not files:
        return ()
    expected = {f.name: f for f in files}
    root.mkdir(parents=True)
    try:
        download_files(storage, name, commit.data, files, root)  # checked as they arrive
        for found in file_table(root, list(expected), 0):  # fsynced, and checked as they lie
            problem = file_problem(expected[found.name], found.size, found.crc32)
            if problem is not None:
                raise CheckpointCorrupt(f"{storage.location.url(name)}: {problem}")
        LocalStorage(root).sync_directory()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return tuple(sorted(expected))


def place_files(root: Path, target: Path) -> None:
    """Move every file of the folder ``root`` (downloaded, checked, fsynced) into the existing
    checkpoint folder ``target`` of the same save, each by a rename over any copy there, the
    manifest last; ``target`` fsynced, ``root`` removed."""
    names = sorted(os.listdir(root), key=lambda n: (n == MANIFEST_NAME, n))
    for name in names:
        os.replace(root / name, target / name)
    LocalStorage(target).sync_directory()
    shutil.rmtree(root, ignore_errors=True)
