# Sharded checkpoints in directories the ranks do not share (nodes with disks of their own):
# choosing one that is complete across them, and giving each directory what its ranks read.
#
# Rules: at a save each directory's writer publishes the checkpoint in its own directory, which
# holds the files its ranks wrote and a manifest of its own (the same in every directory; its
# `directories` names the ranks sharing each one, so each file's directory is its writer's). A
# resume of a pointer is one decision for every rank: every writer lists its directory's resume
# order, the core merges them (newest first for `last`), and the ranks take the candidates in
# that order. For each, every writer checks its own copy — its manifest whole, and every file
# the manifest lists that its directory holds, every byte (so each file is read once, where it
# lies) — and the core (pitstop.core.sharding.shardcover.cover_nodes) judges the union: a file
# whole in no directory is missing, and the candidate is skipped with a warning naming its step and
# the missing files (with the ranks that wrote them). When none is complete but one was found, the
# resume is an error naming each step and its missing files, never a fresh start. A complete
# candidate is chosen: a directory without a whole manifest receives one first; then every rank
# plans its read (DCP's local plan) and each directory receives the files its ranks read and it
# lacks (replicated values are stored once, in one rank's file), from a directory holding them whole
# — over a direct stream the writers agree to, else torch.distributed (pitstop.shell.ranks.peers:
# chunked, CRC-32 checked), into a temp file
# published atomically, then checked against the manifest before any rank reads; a directory
# that received files then writes its pointers as a save would (``last``: its newest). A resume
# from an explicit path: each writer looks for its manifest there on its own node; the first
# writer's whole one makes it the one candidate, taken as above at the same path on every node
# (a node without it receives it); on no node, one CheckpointNotFound naming each node's finding.
# With a remote tier its checkpoints join the merged order (rank 0 lists them, without the
# lease); a candidate not complete across the directories that the remote tier holds gives each
# writer's directory what it lacks of it from there (pitstop.shell.sharded.fromtier), then is
# judged again.
# How: functions over the Ranks, the core's DirectoryGroups and the CheckpointDirectory; every
# step's outcome agreed (Ranks.each / all_gather_each), so one rank's failure is raised on every
# rank and every rank takes the same branch.

"""Sharded checkpoints across unshared directories: one complete choice, each fetching its lack."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import attrs

from pitstop.core.metadata import entry_from_meta
from pitstop.core.ranks import DirectoryGroups, entry_to_wire, merged_order
from pitstop.core.records import PointerName
from pitstop.core.saving.pointers import resume_order
from pitstop.core.sharding.shardcover import FileMove, cover_nodes, not_on_every_directory
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardedLayout
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.shell.format.fileread import verify as verify_file
from pitstop.shell.ranks.arrival import Arrival, tail_start
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.peers import look_on_writers, receive, send
from pitstop.shell.sharded.fromtier import remote_listed, take_from_tier
from pitstop.shell.store.atomic import write_atomically
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.resolve import resolve_checkpoint
from pitstop.shell.store.sharddir import read_layout, verify_sharded
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.sharded.engine import ShardedPlan

__all__ = [
    "Listed",
    "choose_sharded_across",
    "choose_sharded_path_across",
    "listed_order",
    "receive_file",
    "send_file",
]

log = logging.getLogger("pitstop")

Listed = tuple[list[tuple[str, tuple[Any, ...] | None]], list[tuple[str, int]]]
"""A writer's resume order, each name with its entry as it travels, and every checkpoint its
directory holds (name, seq)."""


def send_file(ranks: Ranks, target: int, path: Path, *, checkpoint: bool = False) -> None:
    """Send ``path`` to ``target`` (a file that cannot be opened: the receiver hears so);
    ``checkpoint``: a pitstop file, its manifest and footer first, for a receiver that checks
    it as it arrives (:func:`receive_file` with ``checkpoint``). Over a direct stream when the
    two sides agree to one (pitstop.shell.ranks.stream), else over the group."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        send(ranks, target, None, 0, str(path))
        return
    with file:
        size = os.fstat(file.fileno()).st_size
        first = tail_start(file, size) if checkpoint else 0
        send(ranks, target, file, size, str(path), first=first, crc=not checkpoint, stream=True)


class _Discard:
    """Where a copy goes that cannot be written: nowhere (its sender still sends it all)."""

    def write(self, data: object) -> None:
        """Drop ``data``."""

    def seek(self, offset: int) -> None:
        """Nowhere to go."""


def receive_file(
    ranks: Ranks,
    source: int,
    path: Path,
    check: Callable[[Path], object] | None = None,
    *,
    checkpoint: bool = False,
) -> None:
    """Receive ``source``'s copy into ``path``, published atomically (once ``check`` of the
    temp file, if given, passed); drained even when the temp file cannot be made, so that the
    sender is not left waiting. ``checkpoint``: a pitstop file sent by :func:`send_file` with
    ``checkpoint``, every byte checked against its own manifest as it arrives (so ``check``
    need not read it again)."""
    began = False
    temp: list[Path] = []

    def write(file: BinaryIO) -> None:
        nonlocal began
        began = True
        look = Arrival(file, temp[-1], f"{path} from rank {source}") if checkpoint else None
        receive(ranks, source, file, str(path), look=look, stream=True)
        if look is not None:
            look.finish()

    try:
        write_atomically(path, write, check=check, opened=temp.append)
    except BaseException:
        if not began:
            receive(ranks, source, _Discard(), str(path), stream=True)  # type: ignore[arg-type]
        raise


def listed_order(directory: CheckpointDirectory, pointer: PointerName) -> Listed:
    """A writer's resume order of ``pointer`` in its own directory, as it travels."""
    best = directory.policy.best
    found = scan(directory.storage, best)
    order = resume_order(found.catalog, found.pointers, pointer, best)
    listed = [(n, entry_to_wire(found.catalog.get(n))) for n in order]
    return listed, [(e.name, e.seq) for e in found.catalog]


def _manifest_problem(path: Path) -> str | None:
    """What is wrong with this directory's manifest of ``path`` (``None``: it is whole)."""
    try:
        verify_file(path / MANIFEST_NAME)
        read_layout(path)
    except FileNotFoundError:
        return f"{path / MANIFEST_NAME} is missing"
    except (CheckpointCorrupt, OSError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _held(path: Path, layout: ShardedLayout, manifest: bool) -> tuple[list[str], list[str]]:
    """The files ``layout`` lists that this directory holds whole (its manifest among them
    when ``manifest``), and what is wrong with each one it holds that is not whole."""
    whole, problems = [MANIFEST_NAME] if manifest else [], []
    for file in layout.files:
        if not os.path.lexists(path / file.name):
            continue
        try:
            verify_sharded(path, layout, [file.name])
        except CheckpointCorrupt as exc:
            problems.append(str(exc))
        else:
            whole.append(file.name)
    return whole, problems


def _move(
    moves: Sequence[FileMove],
    path: Path,
    layout: ShardedLayout,
    ranks: Ranks,
    writers: Sequence[int],
) -> None:
    """This rank's part of ``moves`` (directory indexes into ``writers``), each pair in order,
    every message exchanged whatever failed before (so no peer waits in vain); each file
    received is checked before it counts. The first failure raised at the end."""
    failed: BaseException | None = None
    for move in moves:
        source, target = writers[move.source], writers[move.target]
        try:
            if ranks.rank == source:
                send_file(ranks, target, path / move.name)
            elif ranks.rank == target:
                receive_file(ranks, source, path / move.name)
                if move.name == MANIFEST_NAME:
                    verify_file(path / MANIFEST_NAME)
                else:
                    verify_sharded(path, layout, [move.name])
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def _say(moves: Sequence[FileMove], name: str, ranks: Ranks, writers: Sequence[int]) -> None:
    """Rank 0 says, at INFO, which directory receives which file of ``name`` from which."""
    if ranks.leader:
        for move in moves:
            log.info(
                "resume: rank %d's directory lacks %s of %s: rank %d sends it",
                writers[move.target],
                move.name,
                name,
                writers[move.source],
            )


@attrs.frozen
class _Lost:
    """A candidate not complete across the directories: what is lost, in words, and the files
    each directory (in writer order) was found to hold whole."""

    said: str
    held: tuple[frozenset[str], ...]


def _missing(layout: ShardedLayout, names: Sequence[str]) -> str:
    """The missing files in words, each with the rank that wrote it."""
    ranks = {f.name: f.rank for f in layout.files}
    return ", ".join(
        f"{n} (written by rank {ranks[n]})" if n in ranks else f"{n} (pitstop's manifest)"
        for n in names
    )


def choose_sharded_across(
    directory: CheckpointDirectory,
    pointer: PointerName,
    ranks: Ranks,
    groups: DirectoryGroups,
    plan: Callable[[Path], ShardedPlan],
) -> tuple[Path | None, tuple[Any, ...] | None, ShardedPlan | None]:
    """Every rank: the sharded checkpoint a resume of ``pointer`` restores, its entry (as it
    travels) and this rank's read plan of it (``plan(path)``), every file that plan reads
    whole in this rank's directory once this returns; ``(None, None, None)``: none anywhere.
    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming each step and its missing files
    when checkpoints were found but none is complete across the directories."""
    writes = groups.writes(ranks.rank)
    lists = ranks.all_gather_each(lambda: listed_order(directory, pointer) if writes else None)
    orders = [cast(Listed, lists[w]) for w in groups.writers]
    seqs = [[(name, wire[1] if wire else 0) for name, wire in order] for order, _ in orders]
    tiered = directory if isinstance(directory, TieredDirectory) else None
    remote = dict(ranks.lead(partial(remote_listed, tiered, pointer)) if tiered else [])
    seqs.append([(name, wire[1]) for name, wire in remote.items()])  # the remote tier's
    if tiered is not None:  # rank 0's catch-up uploads what each node holds its part of
        tiered.incomplete = not_on_every_directory([held for _, held in orders])
    lost: list[str] = []  # each incomplete candidate: its step and missing files
    for name in merged_order(seqs, newest_first=pointer is PointerName.LAST):
        held = [dict(order) for order, _ in orders if name in dict(order)]  # on some node
        wire, path = held[0][name] if held else None, directory.storage.path(name)
        chosen = _candidate(directory, path, wire, ranks, groups, plan) if held else None
        if not isinstance(chosen, tuple) and tiered is not None and name in remote:
            wire = remote[name]  # not complete across the nodes: each writer downloads its lack
            seen = [dict(order).get(name) for order, _ in orders]  # another save's: replaced
            same = [w is None or w[1] == wire[1] for w in seen]
            found = chosen.held if chosen else (frozenset(),) * len(groups.writers)
            take_from_tier(tiered, name, wire, ranks, groups, found, same)
            chosen = _candidate(directory, path, wire, ranks, groups, plan)
        if not isinstance(chosen, tuple):
            lost.append(chosen.said if chosen else "")
            if tiered is not None:  # the catch-up would wait for its lost files
                tiered.incomplete.add(name)
            continue
        path, mine = chosen
        return path, wire, mine
    if lost:
        raise CheckpointCorrupt(
            f"{directory.path}: no checkpoint is complete across the nodes' directories (each "
            f"node holds its own ranks' shards); missing: {'; '.join(lost)}. Restore the lost "
            "files, or start fresh with an empty directory on every node"
        )
    if pointer is not PointerName.LAST and any(found for _, found in orders):
        raise CheckpointNotFound(f"{directory.path} has no valid {pointer.value} checkpoint")
    return None, None, None


def choose_sharded_path_across(
    directory: CheckpointDirectory,
    source: str | os.PathLike[str],
    ranks: Ranks,
    groups: DirectoryGroups,
    plan: Callable[[Path], ShardedPlan],
) -> tuple[Path, tuple[Any, ...] | None, ShardedPlan]:
    """Every rank: the sharded checkpoint ``source`` names (an explicit path, no fallback),
    its entry (as it travels) and this rank's read plan, every file that plan reads whole in
    this rank's node once this returns: a node without the path (or without a whole manifest
    there) receives the manifest and the files its ranks read at the same path. Raises
    :class:`~pitstop.errors.CheckpointNotFound` on every rank when no node holds its manifest
    whole, :class:`~pitstop.errors.CheckpointCorrupt` when its files are whole on no node."""
    seen = look_on_writers(ranks, groups, partial(_look, source))
    found, holders = seen.found, seen.holders
    if not holders:
        raise CheckpointNotFound(
            f"resume({str(source)!r}): no node holds a sharded checkpoint there whole "
            f"({seen.said}); the ranks share no checkpoint directory, so its manifest must be on "
            "at least one node (any node lacking it receives it, and the files its ranks read)"
        )
    path, wire = Path(found[holders[0]][0]), found[holders[0]][1]
    chosen = _candidate(directory, path, wire, ranks, groups, plan)
    if isinstance(chosen, _Lost):
        raise CheckpointCorrupt(
            f"resume({str(source)!r}): not complete across the nodes' directories; missing: "
            f"{chosen.said}. Restore the lost files, or resume another checkpoint"
        )
    return path, wire, chosen[1]


def _look(source: str | os.PathLike[str]) -> tuple[str, tuple[Any, ...] | None]:
    """A writer's look for the sharded checkpoint ``source`` on its node: its path and entry
    (as it travels) when its manifest is whole there; else what is wrong and ``None``."""
    try:
        path = resolve_checkpoint(source, fallback=False)
        problem = _manifest_problem(path)
        if problem is None:
            _, meta = read_layout(path)
            return str(path), entry_to_wire(entry_from_meta(path.name, meta))
    except (CheckpointCorrupt, CheckpointNotFound, OSError) as exc:
        problem = str(exc) or type(exc).__name__
    return problem, None


def _candidate(
    directory: CheckpointDirectory,
    path: Path,
    wire: tuple[Any, ...] | None,
    ranks: Ranks,
    groups: DirectoryGroups,
    plan: Callable[[Path], ShardedPlan],
) -> tuple[Path, ShardedPlan] | _Lost:
    """Every rank: candidate ``path`` chosen — its path and this rank's plan, each directory
    given what it lacks — or, when it is not complete across the directories, what is lost."""
    rank, writers = ranks.rank, groups.writers
    writes = groups.writes(rank)
    name = path.name
    step = f"step {wire[0].step if wire else '?'} ({name})"
    manifests = ranks.all_gather_each(lambda: _manifest_problem(path) if writes else "")
    whole = [manifests[w] is None for w in writers]
    if not any(whole):
        if ranks.leader:
            said = "; ".join(f"rank {w}'s directory: {manifests[w]}" for w in writers)
            log.warning("resume skips %s: no directory holds its manifest whole: %s", step, said)
        nothing = tuple(frozenset[str]() for _ in writers)
        return _Lost(f"{step}: {MANIFEST_NAME} (in no directory whole)", nothing)
    source = writers[whole.index(True)]
    layouts = ranks.all_gather_each(lambda: read_layout(path)[0] if rank == source else None)
    layout = cast(ShardedLayout, layouts[source])
    found = ranks.all_gather_each(
        lambda: _held(path, layout, manifests[rank] is None) if writes else None
    )
    held = [set(cast(tuple[list[str], list[str]], found[w])[0]) for w in writers]
    if ranks.leader:
        for w in writers:
            manifest = [] if manifests[w] is None else [manifests[w]]
            for problem in manifest + cast(tuple[list[str], list[str]], found[w])[1]:
                log.warning("resume: in rank %d's directory: %s", w, problem)
    listed = [f.name for f in layout.files] + [MANIFEST_NAME]
    cover = cover_nodes(listed, held, [{MANIFEST_NAME}] * len(writers))
    if not cover.complete:
        missing = _missing(layout, cover.missing)
        if ranks.leader:
            log.warning(
                "resume skips %s: not complete across the nodes' directories, %s whole in "
                "none of them",
                step,
                missing,
            )
        return _Lost(f"{step}: {missing}", tuple(frozenset(h) for h in held))
    moves = cover.moves  # the manifest first, to every directory without it whole
    _say(moves, name, ranks, writers)
    ranks.each(lambda: _move(moves, path, layout, ranks, writers))
    for move in moves:
        held[move.target].add(move.name)
    mine = ranks.each(lambda: plan(path))
    reads = ranks.all_gather(mine.files)
    needed = [{MANIFEST_NAME}.union(*(reads[r] for r in g)) for g in groups.groups]
    fetch = cover_nodes(listed, held, needed).moves
    _say(fetch, name, ranks, writers)
    ranks.each(lambda: _move(fetch, path, layout, ranks, writers))
    if (moves or fetch) and path == directory.storage.path(name):  # in the run's directory:
        got = {writers[m.target] for m in (*moves, *fetch)}  # a receiver's pointers, as a save
        ranks.each(lambda: directory.rescan(repoint=rank in got) if writes else None)
    return path, mine
