# How a resume chooses a sharded checkpoint (a DCP directory) in one directory every rank sees,
# or on object storage: every rank together tries rank 0's resume order until a candidate
# verifies on every rank.
#
# Rules: rank 0 sends the resume order (in the round a resume settles its save in flight; both
# tiers' with a remote tier: a remote candidate is copied into the directory by rank 0, checked
# and published by its rename, before the ranks try it); each rank starts checking the files it
# wrote as soon as it read the manifest, on a thread, while it plans (core.sharding.sharded.
# early_checks; pitstop.shell.sharded.filecheck); those it reads (writer_checks) it verifies,
# telling the files its read plan names in the same round: where every file read is read by its
# writer (writers_read) that was all; else each file read is verified once, by one of its
# readers (share_checks), with where each item this rank reads lies in its file (pitstop.shell.
# sharded.rawread.check_read: nothing live touched) and the run compared with the replicated
# tree (read beside), all agreed in one round — and all move to the next candidate when any rank
# found a problem; where a rank's state does not fit the layout, the files are verified alone.
# On object storage each rank downloads, into a local folder of its own, the candidate's
# manifest, plans its read, then downloads the files its plan names (rank 0: DCP's `.metadata`
# too), each checked as it arrives; its folder is removed when the candidate is skipped. In a
# local directory each rank starts on the checkpoint its pointer links to even before the order
# arrives (pitstop.shell.sharded.candidate.guess), used only if that is the candidate.
# How: functions over the directory, the ranks and the live state; the resume's reader is a
# Reading (pitstop.shell.resumeread.ResumeRead is one).

"""Choosing a sharded checkpoint to resume: the candidates in order, each checked on every rank."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pitstop.core.ranks import OK, agree, entry_to_wire
from pitstop.core.records import PointerName
from pitstop.core.saving.pointers import resume_order
from pitstop.core.sharding.sharded import MANIFEST_NAME, writer_checks, writers_read
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.shell.ranks.distributed import Ranks, outcome_of, raise_outcome
from pitstop.shell.sharded import candidate
from pitstop.shell.sharded.candidate import Planned
from pitstop.shell.state.capture import LiveState
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.sharddir import prefetch, verify_sharded
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.sharded.engine import ShardedPlan
    from pitstop.shell.sharded.filecheck import Started
    from pitstop.shell.sharded.rawread import Checked

__all__ = ["Reading", "choose_sharded"]

log = logging.getLogger("pitstop")


class Reading(Protocol):
    """What the choice needs of the resume's reader."""

    def verify(self, path: Path, *, shards: bool = True, known_as: Path | None = None) -> None:
        """Verify the checkpoint ``path`` (its manifest, with ``shards`` its shard files)."""

    def read_beside(self, path: Path) -> Callable[[], str | None]:
        """Start reading ``path``'s replicated tree; the callable waits for it (its problem)."""


def _candidates(
    directory: CheckpointDirectory, pointer: PointerName
) -> tuple[list[tuple[Path, tuple[Any, ...] | None, bool]], bool]:
    """Rank 0: the resume order for ``pointer``, each with its entry as it travels and
    whether it is a remote tier's (made local before it is tried), and whether the directory
    (or its remote tier) holds any checkpoint at all."""
    path = directory.storage.path
    if isinstance(directory, TieredDirectory):  # both tiers, a remote candidate made local
        both = directory.tiered_order(pointer)
        return [(path(n), entry_to_wire(e), remote) for n, e, remote in both], bool(both)
    best = directory.policy.best
    found = scan(directory.storage, best)
    order = resume_order(found.catalog, found.pointers, pointer, best)
    wires = [(path(n), entry_to_wire(found.catalog.get(n)), False) for n in order]
    return wires, bool(found.catalog)


def _problem(
    path: Path,
    reading: Reading,
    planned: Planned,
    shares: tuple[tuple[str, ...], ...] | None,
    ranks: Ranks,
    remote: ObjectStorage | None = None,
) -> str | None:
    """What this rank finds wrong with candidate ``path`` (``None``: its part verifies), where
    its files are not checked as DCP reads them (a file checkpoint, a state that does not fit).

    Rank 0 checks the manifest whole (and a plain file whole) and DCP's ``.metadata``; every
    file some rank's DCP read plan names is checked by one of those ranks, in parallel (on
    object storage: by each rank that downloads it, ``shares`` None)."""
    plan, problem = planned
    if problem is not None:
        return problem
    try:
        if ranks.leader:
            reading.verify(path, shards=False)
        if plan is not None:
            mine = _checks(plan, shares[ranks.rank] if shares is not None else None, ranks)
            # downloaded: each file checksummed as it arrived, compared here, not read again
            arrived = remote.fetch_files(path.name, mine) if remote is not None else None
            verify_sharded(path, plan.layout, mine, arrived=arrived)
    except (CheckpointCorrupt, OSError) as exc:
        return str(exc)
    return None


def _checks(plan: ShardedPlan, mine: tuple[str, ...] | None, ranks: Ranks) -> tuple[str, ...]:
    """The files this rank verifies of ``plan``'s checkpoint: ``mine`` (``None``: every file
    its plan reads) and (rank 0) DCP's own metadata, which no rank reads (a DCP tool would)."""
    from pitstop.shell.sharded.dcpio import DCP_METADATA

    mine = plan.files if mine is None else mine
    if ranks.leader:
        mine = (*mine, *(f.name for f in plan.layout.files if f.name == DCP_METADATA))
    return mine


Compare = Callable[[Path, "ShardedPlan"], tuple[Any, Any]]
"""A resume's comparison of a candidate with this rank's run: what it keeps here, and what it
tells every rank."""

Compared = tuple[Any, list[Any]] | None
"""What :data:`Compare` kept here and what every rank told (``None``: not compared)."""

_Round = tuple["Checked | None", Any, Any, "BaseException | None", list[tuple[Any, ...]]]
"""A checks' round on this rank: its checked read, what ``compare`` kept, its outcome and
error here, and what every rank told (its problem, whether a check found it, its outcome,
what ``compare`` told, and what else it told)."""


def _check_round(
    plan: ShardedPlan | None,
    checks: tuple[str, ...],
    ranks: Ranks,
    beside: Callable[[], str | None] | None,
    compare: Callable[[], tuple[Any, Any]] | None,
    tells: Any = None,
    started: Started | None = None,
) -> _Round:
    """Every rank: :func:`~pitstop.shell.sharded.rawread.check_read` of ``checks`` (none with
    no ``plan``: ``started`` is then closed) and, where it found nothing wrong, ``compare()``,
    gathered in one round with ``tells``. Nothing live touched; nothing raised yet."""
    from pitstop.shell.sharded.rawread import check_read

    checked, own, checking = None, None, False
    if plan is not None:
        checked, own, checking = check_read(plan.directory, plan, checks, beside, started)
    elif started is not None:
        started.close()
    kept, told, outcome, error = None, None, OK, None
    if own is None and compare is not None:
        try:
            kept, told = compare()
        except (Exception, KeyboardInterrupt) as exc:  # heard by every rank, as Ranks.each does
            outcome, error = outcome_of(exc, ranks.rank), exc
    return checked, kept, outcome, error, ranks.all_gather((own, checking, outcome, told, tells))


def _check_agreed(
    done: _Round, compared: bool
) -> tuple[Checked | None, list[str | None], Compared]:
    """Every rank, after :func:`_check_round`: the checked read (``None`` where any rank found
    a problem), every rank's problem — only the checks' where a check found one (another
    rank's read of a damaged file says nothing more) — and what ``compare`` kept and told,
    when every check passed; its error on any rank is then raised on every rank (the files
    closed). Nothing live touched."""
    checked, kept, outcome, error, found = done
    if any(problem is not None and by_check for problem, by_check, *_ in found):
        problems = [problem if by_check else None for problem, by_check, *_ in found]
    else:
        problems = [problem for problem, *_ in found]
    agreed = agree([o for _, _, o, _, _ in found])
    if checked is not None and (any(problems) or not agreed.ok):
        checked.close()
        checked = None
    if any(problems) or not compared:
        return checked, problems, None
    raise_outcome(agreed, own=error if agreed == outcome else None)
    return checked, problems, (kept, [t for _, _, _, t, _ in found])


def _beside(
    path: Path, reading: Reading, planned: Planned, started: Started | None
) -> Callable[[], str | None] | None:
    """The manifest's tree read on a thread (where the state fits): its wait. The plan's other
    files hinted to the disk: whole where none was ``started`` (a reshard), else its regions."""
    plan = planned[0]
    if plan is None:
        return None
    early = set(started.names) if started is not None else set()
    whole = [(name, 0, 0) for name in plan.files]
    later = [r for r in plan.regions if r[0] not in early] if early else whole
    if later:  # the disk reads them while the ranks agree
        prefetch(path, later)
    # the manifest's tree, its GIL-bound part off the check
    return reading.read_beside(path) if candidate.fits(planned) else None


def _fetched(
    storage: ObjectStorage, name: str, live: LiveState, ranks: Ranks
) -> tuple[Path, Planned]:
    """This rank's local folder of candidate ``name`` (fresh: its manifest downloaded) and its
    plan of it."""
    path = storage.path(name)
    shutil.rmtree(path, ignore_errors=True)
    try:
        storage.fetch_files(name, (MANIFEST_NAME,))
    except (CheckpointCorrupt, OSError) as exc:
        return path, (None, str(exc))
    return path, candidate.planned(path, live, ranks)


def choose_sharded(
    directory: CheckpointDirectory,
    pointer: PointerName,
    reading: Reading,
    live: LiveState,
    ranks: Ranks,
    compare: Compare | None = None,
    lead: Callable[[Callable[[], Any]], Any] | None = None,
) -> tuple[Path | None, tuple[Any, ...] | None, ShardedPlan | None, Checked | None, Compared]:
    """Every rank: try rank 0's resume order until a candidate verifies on every rank (with
    this rank's plan of it, and its checked read where every rank's state fits); all ranks
    move on together, rank 0 warning about each one skipped and why (and where). ``compare``:
    run on every rank with the candidate a checked read verified on that rank, agreed in the
    check's round (what it keeps here and what every rank told, or its error on every rank).
    ``lead``: how rank 0's resume order reaches every rank (default ``ranks.lead``; a resume's
    folds it into the round that settles the save in flight). Meanwhile each rank starts on
    the checkpoint its pointer links to (pitstop.shell.sharded.candidate.guess)."""
    guessed = candidate.guess(directory, pointer, ranks)  # the disk reads while the order comes
    try:
        return _tried(directory, pointer, reading, live, ranks, compare, lead, guessed)
    finally:
        if guessed is not None:  # a start no candidate took
            guessed.close()


def _tried(
    directory: CheckpointDirectory,
    pointer: PointerName,
    reading: Reading,
    live: LiveState,
    ranks: Ranks,
    compare: Compare | None,
    lead: Callable[[Callable[[], Any]], Any] | None,
    guessed: candidate.Guess | None,
) -> tuple[Path | None, tuple[Any, ...] | None, ShardedPlan | None, Checked | None, Compared]:
    """:func:`choose_sharded`, with this rank's start on a guessed candidate."""
    candidates, any_found = (lead or ranks.lead)(partial(_candidates, directory, pointer))
    storage = directory.storage
    remote = storage if isinstance(storage, ObjectStorage) else None
    for path, wire, tiered in candidates:
        checked = None
        if tiered:  # the remote tier's: rank 0 copies it into the directory first
            assert isinstance(directory, TieredDirectory)
            problem = ranks.lead(partial(directory.bring_sharded, path.name))
            if problem is not None:
                if ranks.leader:
                    log.warning("resume skips a checkpoint that does not verify: %s", problem)
                continue
        if remote is not None:  # this rank's own copy: the manifest first; each checks its own
            path, planned = _fetched(remote, path.name, live, ranks)
            files = planned[0].files if planned[0] is not None else ()
            ranks.all_gather(files)
            problems = ranks.all_gather(_problem(path, reading, planned, None, ranks, remote))
        else:  # the files it wrote are read and checked while it plans
            planned, started = candidate.started(path, live, ranks, guessed)
            try:
                beside = _beside(path, reading, planned, started)
            except BaseException:
                if started is not None:
                    started.close()
                raise
            plan, fits = planned[0], candidate.fits(planned)
            files = plan.files if plan is not None else ()
            here = None if compare is None or plan is None else partial(compare, path, plan)
            mine = None  # its own files first: enough where their writers read them all
            if fits and plan is not None:
                mine = writer_checks(plan.layout, files, ranks.rank, ranks.world_size)
            hopeful = plan if mine is not None else None
            done = _check_round(
                hopeful,
                _checks(hopeful, mine, ranks) if hopeful is not None else (),
                ranks,
                beside,
                here if hopeful is not None else None,
                (files, fits),
                started,
            )
            gathered = [t for *_, t in done[-1]]
            reads = [f for f, _ in gathered]
            streamed = all(fits for _, fits in gathered)
            if streamed and plan is not None and writers_read(plan.layout, reads):
                checked, problems, compared = _check_agreed(done, compare is not None)
                if checked is not None:  # checked on every rank: read when applied
                    return path, wire, plan, checked, compared
            elif streamed and plan is not None:  # each file read, once, by one of its readers
                if done[0] is not None:
                    done[0].close()
                shares = candidate.shares(planned, reads)
                mine_shared = shares[ranks.rank] if shares is not None else None
                checks = _checks(plan, mine_shared, ranks)
                done = _check_round(plan, checks, ranks, beside, here)
                checked, problems, compared = _check_agreed(done, compare is not None)
                if checked is not None:
                    return path, wire, plan, checked, compared
            else:
                if done[0] is not None:
                    done[0].close()
                if beside is not None:
                    beside()  # read again by the checks below: not at the same time
                shares = candidate.shares(planned, reads)
                problems = ranks.all_gather(_problem(path, reading, planned, shares, ranks))
        found: dict[str, list[int]] = {}
        for rank, problem in enumerate(problems):
            if problem is not None:
                found.setdefault(problem, []).append(rank)
        if not found:
            return path, wire, planned[0], checked, None
        if remote is not None:
            shutil.rmtree(path, ignore_errors=True)
        if ranks.leader or remote is not None:  # one line per problem, with the ranks that found it
            for problem, where in found.items():
                ranks_found = ", ".join(map(str, where))
                log.warning(
                    "resume skips a checkpoint that does not verify (rank %s): %s",
                    ranks_found,
                    problem,
                )
    if pointer is not PointerName.LAST and any_found:
        raise CheckpointNotFound(f"{directory.path} has no valid {pointer.value} checkpoint")
    return None, None, None, None, None
