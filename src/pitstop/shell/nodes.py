# Ranks whose checkpoint directories differ (nodes with disks of their own): opening every
# directory, choosing one checkpoint for every rank, and catching a directory up before a resume.
#
# Rules: at open, the ranks find out which of them share the directory (pitstop.shell.ranks.peers:
# a probe, agreed; never guessed from host names) — a local directory only: an object store is one
# place for every rank, rank 0 alone its writer (its lease), but what it fetches lands in its cache:
# the same probe, in the caches' parent, finds which ranks see rank 0's cache (ObjectStorage.
# readers), and after rank 0's resume choice the first rank of each other group fetches it into
# its own cache (checked as it arrives) for its group (fetch_for_readers). Each directory's writer
# (its group's lowest rank; the core's DirectoryGroups) locks, scans and writes its directory —
# a local one (no remote tier) in the probe's second round, as its own sighting shows it a writer
# (writes_as_seen), closed again when the sightings or another writer's open fail; with one
# group that is rank 0 alone, as before. Sharded state is
# pitstop.shell.sharded.acrossnodes' (each node its ranks' shards, in the background too:
# pitstop.shell.shardsave); with a remote tier every node's writer uploads its node's files and
# rank 0 commits (shardobjects.NodeUploads; a resume falls back on it: acrossnodes). A background
# save (async_save) is written by every writer's own writer thread; how it ended is agreed at the
# next call that settles it (pitstop.shell.lifetime).
# A resume of a pointer (``last``, ``best``, ``final``) is one decision for every rank: every
# writer lists its directory's resume order, the core merges them (newest first for ``last``),
# and the ranks try the candidates in that order; each writer verifies its own copy (every byte,
# loaded in the same pass), and the first candidate that verifies in at least one directory is
# chosen. A directory whose copy is missing or does not verify receives the copy of a directory
# that has it (the core's catch_up), over a direct stream the two writers agree to (else
# torch.distributed: pitstop.shell.ranks.peers), into a temp file, every byte checked against
# the file's own manifest as it lands (pitstop.shell.ranks.arrival) and then loaded for the
# resume without a second checking read, before the store's atomic writer publishes it — a copy
# that changed on its way, or on its sender's disk, is never published. A directory that does
# not even list the candidate (a wiped or replaced node) gets its copy at once, before any check
# (the core's copies_first, pitstop.core.ranks.catchup): its sender checks every piece as it
# reads it for sending (arrival's send_checked: the receiver's checks) and loads its copy after,
# beside the receiver's load; what each holds is agreed in that round (a sender whose copy
# proved bad: skipped, as after a failed verify; a copy failed on its way: raised everywhere).
# With a remote tier (remote=), rank 0 alone uploads (one upload per checkpoint, under the
# prefix's one lease; every node's copy is the same bytes), rank 0 lists the remote tier too and
# its names join the merged order (last among equals), and a checkpoint no directory holds whole
# is downloaded from the remote tier by each writer that lacks it (no lease: reading only),
# published, verified, its pointers written as a save would; a writer whose download failed
# then gets a peer's copy. A resume from an explicit path (a file, not a pointer of the
# directory) is looked for by every writer on its own node (resolved as it is given, verified
# every byte, loaded in the same pass); the first writer whose copy verifies is the holder, and
# every writer whose node lacks that file, or holds a copy that does not verify, receives the
# holder's copy at the same path (its folder made if missing), over the same checked transfer.
# On no node: one CheckpointNotFound on every rank naming the path and what each node found.
# How: functions over the Ranks, the core's DirectoryGroups and the CheckpointDirectory; every
# step's outcome agreed (Ranks.each), so one rank's failure is raised on every rank.

"""Nodes: directories the ranks do not share — opened by each one's writer, caught up on resume."""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from pathlib import Path
from typing import Any, cast

from pitstop.core.ranks import (
    REMOTE,
    DirectoryGroups,
    catch_up,
    entry_to_wire,
    merged_order,
    writes_as_seen,
)
from pitstop.core.ranks.catchup import copies_first
from pitstop.core.records import PointerName
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.shell.ranks.arrival import send_checked
from pitstop.shell.ranks.catchup import first_round
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.peers import look_on_writers, probe_groups
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.sharded.acrossnodes import Listed, listed_order, receive_file, send_file
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.resolve import find_resume
from pitstop.shell.store.shardobjects import NodeUploads
from pitstop.shell.store.storage import RemoteStorage
from pitstop.shell.store.tiers import TieredDirectory

__all__ = ["choose_across", "choose_path_across", "fetch_for_readers", "open_directories"]

log = logging.getLogger("pitstop")


def open_directories(
    ranks: Ranks, directory: CheckpointDirectory, *, sharded: bool
) -> DirectoryGroups:
    """Every rank: find out which ranks share ``directory``, and open it on each writer (a
    failure raised on every rank)."""
    groups = DirectoryGroups.one(ranks.world_size)
    probed = ranks.many and not isinstance(directory.storage, RemoteStorage)
    # a plain local directory: each writer opens it in the probe's second round
    opened: list[bool] | None = (
        [] if probed and not isinstance(directory, TieredDirectory) else None
    )
    try:
        if probed:
            then = None if opened is None else partial(_open_seen, directory, ranks.rank, opened)
            groups = probe_groups(ranks, directory.path, then)
    except BaseException:  # another rank's open failed, or the sightings disagree
        if opened:
            directory.close()
        raise
    if not groups.shared and isinstance(directory, TieredDirectory):  # one upload each: rank 0's
        directory.uploads = ranks.leader
        if sharded:  # and each node's writer its node's files, into rank 0's data folder
            _share_remote(ranks, groups, directory)
    if groups.shared and ranks.many:  # every rank reads what rank 0 fetched: a file, not memory
        remote = directory.remote.objects if isinstance(directory, TieredDirectory) else None
        for objects in (directory.storage, remote):
            if isinstance(objects, ObjectStorage):
                objects.in_memory = False
        if isinstance(directory.storage, ObjectStorage):  # who sees whose cache: a probe
            readers = probe_groups(ranks, directory.storage.cache.parent)
            directory.storage.readers = readers
            directory.storage.in_memory = len(readers.groups[readers.group_of(ranks.rank)]) == 1
    if opened is not None:
        pass  # opened by its writers already
    elif groups.shared:
        ranks.lead(lambda: _open(directory))  # only rank 0 locks and reads the directory
    else:
        try:
            ranks.each(lambda: _open(directory) if groups.writes(ranks.rank) else None)
            if isinstance(directory, TieredDirectory) and directory.remote.nodes is not None:
                ranks.each(lambda: directory.remote.opened() if ranks.leader else None)
        except BaseException:  # another writer's open failed: this one's lock goes too
            directory.close()
            raise
    return groups


def _share_remote(ranks: Ranks, groups: DirectoryGroups, directory: TieredDirectory) -> None:
    """Sharded state with a remote tier on nodes that share no directory: every node's writer
    uploads the files its node's ranks wrote into one data folder per checkpoint (named by rank
    0's run id, agreed here), and rank 0, which opens the prefix (its lease, its orphans
    cleared) before any save, commits each once the listing shows every file."""
    token = ranks.all_gather_each(lambda: directory.remote.directory.run_id)[0]
    mine = groups.groups[groups.group_of(ranks.rank)]
    nodes = NodeUploads(token, mine, commits=ranks.leader, patience=ranks.timeout_s)
    directory.remote.nodes = nodes
    directory.uploads = groups.writes(ranks.rank)


def fetch_for_readers(ranks: Ranks, directory: CheckpointDirectory, path: Path) -> Path:
    """Every rank: where it reads the checkpoint ``path`` that rank 0 chose and fetched into
    its cache — rank 0's file where the ranks share its cache's machine; else the file its
    group's first rank fetched into its own cache (checked as it arrives), for its group. A
    failed fetch is raised on every rank."""
    storage = directory.storage
    if not isinstance(storage, ObjectStorage) or storage.readers is None:
        return path
    readers, objects = storage.readers, storage
    if readers.shared:
        return path

    def fetch() -> str | None:
        if ranks.leader:
            return str(path)
        if not readers.writes(ranks.rank):
            return None
        group = list(readers.groups[readers.group_of(ranks.rank)])
        log.info("resume: rank %d fetches %s for ranks %s", ranks.rank, path.name, group)
        return str(objects.fetch(path.name))

    return Path(cast(str, ranks.all_gather_each(fetch)[readers.writer(ranks.rank)]))


def _open(directory: CheckpointDirectory) -> None:  # what it finds stays on its writer
    directory.open()


def _open_seen(
    directory: CheckpointDirectory, rank: int, opened: list[bool], seen: list[int]
) -> None:
    """Open ``directory`` where ``rank`` writes it, as the probe files it ``seen`` say (noted in
    ``opened``)."""
    if writes_as_seen(rank, seen):
        directory.open()
        opened.append(True)


def choose_across(
    directory: CheckpointDirectory,
    pointer: PointerName,
    reading: ResumeRead,
    ranks: Ranks,
    groups: DirectoryGroups,
) -> tuple[Path | None, tuple[Any, ...] | None]:
    """Every rank: the checkpoint a resume of ``pointer`` restores and its entry (as it
    travels), in every directory once this returns; ``(None, None)``: none anywhere."""
    writes = groups.writes(ranks.rank)
    lists = ranks.all_gather_each(lambda: listed_order(directory, pointer) if writes else None)
    orders = [cast(Listed, lists[w]) for w in groups.writers]
    tiered = directory if isinstance(directory, TieredDirectory) else None
    remote = ranks.lead(partial(_remote_listed, tiered, pointer)) if tiered else []
    seqs = [[(name, wire[1] if wire else 0) for name, wire in order] for order, _ in orders]
    seqs.append([(name, wire[1]) for name, wire in remote])  # the remote tier's last
    mine = {name for name, _ in cast(Listed, lists[ranks.rank])[0]} if writes else set()
    for name in merged_order(seqs, newest_first=pointer is PointerName.LAST):
        path = directory.storage.path(name)
        first = copies_first(groups, [name in dict(order) for order, _ in orders])
        if first:  # a directory lacks it: its copy starts now, checked as it is read and lands
            verify = partial(_verified, path, reading) if name in mine else None
            send = partial(send_checked, ranks, path=path)
            take = partial(_receive, ranks, path=path, reading=reading, directory=directory)
            answers = first_round(ranks, first, verify=verify, send=send, receive=take)
        else:
            checked = partial(_verified, path, reading) if name in mine else lambda: False
            answers = ranks.all_gather_each(checked)  # a fault other than a bad copy: everywhere
        valid = [answers[w] is True for w in groups.writers]
        _warn_invalid(ranks, groups, name, answers, "rank {}'s directory")
        transfers = catch_up(groups, valid, remote=name in dict(remote))
        if transfers is not None and any(m.source == REMOTE for m in transfers):
            assert tiered is not None
            targets = {m.target for m in transfers}
            work = partial(_downloaded, tiered, name, reading)
            got = ranks.all_gather_each(work if ranks.rank in targets else lambda: False)
            _warn_invalid(ranks, groups, name, got, "the remote tier's copy (for rank {})")
            valid = [ok or got[w] is True for w, ok in zip(groups.writers, valid, strict=True)]
            transfers = catch_up(groups, valid)  # a failed download: from a node that has it
        if transfers is None:
            continue
        if ranks.leader:
            for move in transfers:
                log.info(
                    "resume: rank %d's directory lacks a valid %s: rank %d sends it",
                    move.target,
                    name,
                    move.source,
                )
        if transfers:
            ranks.each(partial(_move, transfers, path, reading, ranks, directory))
        holder = [
            o
            for (o, _), w in zip(orders, groups.writers, strict=True)
            if answers[w] is True and name in dict(o)
        ]
        if holder:
            return path, dict(holder[0])[name]  # the entry as a directory holding it lists it
        return path, ranks.lead(partial(_catalog_wire, directory, name))  # rank 0's copy
    if pointer is not PointerName.LAST and (remote or any(found for _, found in orders)):
        raise CheckpointNotFound(f"{directory.path} has no valid {pointer.value} checkpoint")
    return None, None


def choose_path_across(
    directory: CheckpointDirectory,
    source: str | os.PathLike[str],
    reading: ResumeRead,
    ranks: Ranks,
    groups: DirectoryGroups,
) -> tuple[Path, tuple[Any, ...] | None]:
    """Every rank: the checkpoint file ``source`` names (an explicit path, no fallback) and its
    entry (as it travels), on every node once this returns: a node without a valid copy at that
    path receives one from a node that has it. Raises
    :class:`~pitstop.errors.CheckpointNotFound` on every rank when no node holds it valid."""
    seen = look_on_writers(ranks, groups, partial(_found, directory, source, reading))
    found, holders = seen.found, seen.holders
    if not holders:
        raise CheckpointNotFound(
            f"resume({str(source)!r}): no node holds a valid checkpoint there ({seen.said}); the "
            "ranks share no checkpoint directory, so the path must exist on at least one node "
            "(any node lacking it receives a copy)"
        )
    path, wire = Path(found[holders[0]][0]), found[holders[0]][1]
    valid = [found[w][1] is not None and found[w][0] == str(path) for w in groups.writers]
    transfers = catch_up(groups, valid)
    assert transfers is not None  # one writer holds it
    if ranks.leader:
        for move in transfers:
            log.info(
                "resume: rank %d's node lacks %s: rank %d sends it", move.target, path, move.source
            )
    ranks.each(partial(_move, transfers, path, reading, ranks, directory))
    return path, wire


def _found(
    directory: CheckpointDirectory, source: str | os.PathLike[str], reading: ResumeRead
) -> tuple[str, tuple[Any, ...] | None]:
    """A writer's look for ``source`` on its node: the file and its entry (as it travels), the
    file verified and loaded for the read; else what is wrong and ``None``."""
    try:
        path, entry = find_resume(directory, source, verify=reading.verify)
    except (CheckpointCorrupt, CheckpointNotFound, OSError) as exc:
        return str(exc) or type(exc).__name__, None
    assert path is not None  # an explicit path: found, or raised
    return str(path), entry_to_wire(entry)


def _remote_listed(tiered: TieredDirectory, pointer: PointerName) -> list[tuple[str, Any]]:
    """Rank 0: the remote tier's resume order, each name with its entry as it travels."""
    return [(name, entry_to_wire(entry)) for name, entry in tiered.remote_order(pointer)]


def _catalog_wire(directory: CheckpointDirectory, name: str) -> tuple[Any, ...] | None:
    """Rank 0: ``name``'s entry in its directory's catalog, as it travels."""
    return entry_to_wire(directory.catalog.get(name))


def _warn_invalid(
    ranks: Ranks, groups: DirectoryGroups, name: str, answers: list[Any], where: str
) -> None:
    """Rank 0: a warning for each writer whose copy of ``name`` did not verify."""
    if ranks.leader:
        for writer in groups.writers:
            if isinstance(answers[writer], str):
                shown = where.format(writer)
                log.warning("resume: %s does not verify in %s: %s", name, shown, answers[writer])


def _downloaded(tiered: TieredDirectory, name: str, reading: ResumeRead) -> bool | str:
    """A writer whose directory lacks ``name``: its copy from the remote tier, published into
    the directory and verified (every byte, loaded for the read): True, or what is wrong (a
    copy that does not verify is removed again)."""
    path = tiered.storage.path(name)
    try:
        tiered.download(name)
        reading.verify(path)
    except (CheckpointCorrupt, OSError) as exc:
        with contextlib.suppress(OSError):
            path.unlink()
        tiered.rescan()
        return str(exc) or type(exc).__name__
    tiered.rescan(repoint=True)  # its pointers, as a save would leave them
    log.info("resume: %s taken from the remote tier %s", name, tiered.remote.url)
    return True


def _verified(path: Path, reading: ResumeRead, arrived: bool = False) -> bool | str:
    """A writer's check of its copy of ``path`` (``arrived``: checked as it was read already,
    only loaded): True, or what is wrong with it."""
    try:
        reading.verify(path, arrived=arrived)
    except (CheckpointCorrupt, OSError) as exc:
        return str(exc) or type(exc).__name__
    return True


def _receive(
    ranks: Ranks, source: int, path: Path, reading: ResumeRead, directory: CheckpointDirectory
) -> None:
    """Receive ``source``'s copy of ``path``, every byte checked as it lands, loaded for the
    read, then published (its pointers as a save leaves them)."""
    with contextlib.suppress(OSError):  # an explicit path's folder: else drained
        path.parent.mkdir(parents=True, exist_ok=True)
    load = partial(reading.verify, known_as=path, arrived=True)
    receive_file(ranks, source, path, load, checkpoint=True)
    directory.rescan(repoint=path == directory.storage.path(path.name))


def _move(
    transfers: Any, path: Path, reading: ResumeRead, ranks: Ranks, directory: CheckpointDirectory
) -> None:
    """This rank's part of the copies to send: each pair in order, every message exchanged
    whatever failed before (so no peer waits in vain); the first failure raised at the end."""
    failed: BaseException | None = None
    for move in transfers:
        try:
            if ranks.rank == move.source:
                send_file(ranks, move.target, path, checkpoint=True)
            elif ranks.rank == move.target:
                _receive(ranks, move.source, path, reading, directory)
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
