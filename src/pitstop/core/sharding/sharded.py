# Sharded checkpoints: what a checkpoint directory written through torch.distributed.checkpoint
# (DCP) holds, as pitstop records it in the directory's manifest.
#
# Rules: a sharded checkpoint is a directory `step_<12 digits>/` holding DCP's files (each
# rank's `__<rank>_<n>.distcp`, rank 0's `.metadata`) and pitstop's `manifest.pitstop`, which
# is written last. The manifest's layout names every DCP file with its size, CRC-32 and writing
# rank, and repeats DCP's metadata — each stored value's key, key path, dtype, global shape and
# where each of its chunks lies (file, start, length) — so a reader never unpickles DCP's
# `.metadata`: it is checksummed like the rest, never read. A layout read back is untrusted:
# every field is type-checked and cross-checked (pitstop.core.sharding.shardcover: each tensor value
# covered exactly once by its chunks, its chunks' bytes enough for their elements, its dtype
# known; key paths non-empty, unique, none both a leaf and a subtree; chunks inside a listed
# file, file names plain and unique), each problem a CheckpointCorrupt naming the key path:
# pitstop.core.sharding.layoutwire's layout_from_wire is the one check every reader's layout
# passes before anything is allocated.
# The files a rank reads are the files its chunks lie in; before any rank reads, each of them is
# verified once, by one of the ranks that read it (share_checks: ranks read bits of many files —
# replicated values are stored once — so each checking all it reads would read the checkpoint
# about once per rank). What is live is compared with what is stored before any tensor is
# touched, every difference listed. A resume's ranks may start checking the checkpoint their
# pointer links to before rank 0's resume order arrives (guessed_first: a plain sharded name
# only); the start is used only for the candidate it guessed (guess_holds), else dropped.
# How: frozen records and pure functions; the shell turns DCP's objects into these and back.

"""Sharded (DCP) checkpoint directories: their names, layout records and pure checks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs

from pitstop.core.naming import parse_sharded_name, sharded_name
from pitstop.core.sharding.shardcover import DIRECTORIES, cover_problem, paths_problem
from pitstop.errors import CheckpointCorrupt

__all__ = [
    "FRESH_OPTIMIZERS",
    "MANIFEST_NAME",
    "LiveValue",
    "ShardFile",
    "ShardedLayout",
    "StoredChunk",
    "StoredValue",
    "adopts_without_round",
    "cover_problem",
    "early_checks",
    "file_problem",
    "files_for",
    "fresh_optimizers",
    "guess_holds",
    "guessed_first",
    "layout_differences",
    "parse_sharded_name",
    "regions_for",
    "sharded_meta",
    "sharded_name",
    "share_checks",
    "writer_checks",
    "writers_read",
]

MANIFEST_NAME: Final = "manifest.pitstop"
"""pitstop's manifest inside a sharded checkpoint directory (a pitstop file; written last)."""
FRESH_OPTIMIZERS: Final = "fresh_optimizers"
"""The manifest meta key naming the optimizers that had no state when the save began: DCP
stored the zeroed state it gave them to save, which a resume takes away again."""


def _plain(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in {"", ".", ".."}
        and not any(c in name for c in "/\\\0")
    )


def _ints(value: object, *, minimum: int = 0) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= minimum for v in value)


def _check(ok: bool, where: str, what: str, value: object) -> None:
    if not ok:
        raise CheckpointCorrupt(f"{where} must be {what}, got {value!r}")


@attrs.frozen(kw_only=True)
class ShardFile:
    """One file of the directory: its name, size in bytes, CRC-32, and the rank that wrote it."""

    name: str
    size: int
    crc32: int
    rank: int

    def __attrs_post_init__(self) -> None:
        _check(_plain(self.name), "ShardFile.name", "a plain file name", self.name)
        _check(_ints((self.size, self.rank)), f"{self.name}: size and rank", "ints >= 0", self)
        _check(
            _ints((self.crc32,)) and self.crc32 <= 0xFFFFFFFF,
            "ShardFile.crc32",
            "a CRC-32",
            self.crc32,
        )


@attrs.frozen(kw_only=True)
class StoredChunk:
    """Where one chunk of a stored value lies: its offsets and sizes in the value, and the
    ``length`` bytes at ``start`` of ``file`` (a non-tensor value: one chunk, ``()`` and ``()``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@attrs.frozen(kw_only=True)
class StoredValue:
    """One value DCP stored, under its flattened key ``fqn`` (``model.0.weight``).

    ``path``: its key path in the saved tree (``("model", "0.weight")``); ``dtype``: the tensor
    dtype's name, ``None`` for a non-tensor value (stored as bytes); ``shape``: the global shape.
    """

    fqn: str
    path: tuple[str | int, ...]
    dtype: str | None
    shape: tuple[int, ...]
    chunks: tuple[StoredChunk, ...]


@attrs.frozen(kw_only=True)
class LiveValue:
    """What a live value the load would fill is: dtype name (``None``: not a tensor) and shape."""

    dtype: str | None
    shape: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class ShardedLayout:
    """Everything pitstop records about a sharded checkpoint's DCP files."""

    world_size: int
    dcp_version: str
    files: tuple[ShardFile, ...]
    values: tuple[StoredValue, ...]

    def __attrs_post_init__(self) -> None:
        _check(
            type(self.world_size) is int and self.world_size >= 1,
            "sharded.world_size",
            "an int >= 1",
            self.world_size,
        )
        sizes = {f.name: f.size for f in self.files}
        _check(len(sizes) == len(self.files), "sharded.files", "unique names", self.files)
        fqns = {v.fqn for v in self.values}
        _check(len(fqns) == len(self.values), "sharded.values", "unique keys", sorted(fqns))
        for value in self.values:
            _check_value(value, sizes)
        problem = paths_problem(v.path for v in self.values)
        _check(problem is None, "sharded.values", "key paths each a leaf", problem)

    def file(self, name: str) -> ShardFile:
        """The listed file ``name``; ``KeyError`` if the layout lists none."""
        for file in self.files:
            if file.name == name:
                return file
        raise KeyError(name)

    @property
    def fqns(self) -> frozenset[str]:
        """The flattened keys of every stored value."""
        return frozenset(v.fqn for v in self.values)


def _check_value(value: StoredValue, sizes: Mapping[str, int]) -> None:
    """A stored value's chunks cover it exactly once and lie inside a listed file."""
    where = f"sharded.values[{value.fqn!r}]"
    if value.dtype is None:
        _check(value.shape == () and len(value.chunks) == 1, where, "one chunk", value.chunks)
    problem = cover_problem(value.shape, [(c.offsets, c.sizes) for c in value.chunks])
    _check(problem is None, where, f"covered exactly once by its chunks, not {problem}", value)
    for chunk in value.chunks:
        end = sizes.get(chunk.file, -1)
        _check(chunk.start + chunk.length <= end, where, "chunks inside a listed file", chunk)


def files_for(
    layout: ShardedLayout, reads: Iterable[tuple[str, tuple[int, ...] | None]]
) -> tuple[str, ...]:
    """The files holding the chunks ``reads`` names, as ``(fqn, offsets)`` (``None``: a
    non-tensor value), sorted: what a rank that reads them must verify first."""
    return tuple(sorted({file for file, _, _ in regions_for(layout, reads)}))


def regions_for(
    layout: ShardedLayout, reads: Iterable[tuple[str, tuple[int, ...] | None]]
) -> tuple[tuple[str, int, int], ...]:
    """Where the chunks ``reads`` names (as for :func:`files_for`) are: ``(file, start,
    length)`` each, in the order of ``reads``."""
    where = {
        (v.fqn, c.offsets if v.dtype is not None else None): (c.file, c.start, c.length)
        for v in layout.values
        for c in v.chunks
    }
    found = []
    for fqn, offsets in reads:
        key = (fqn, tuple(offsets) if offsets is not None else None)
        if key not in where:
            raise CheckpointCorrupt(f"sharded layout has no chunk {fqn} at {offsets}")
        found.append(where[key])
    return tuple(found)


def share_checks(
    layout: ShardedLayout, reads: Sequence[Iterable[str]]
) -> tuple[tuple[str, ...], ...]:
    """Which rank verifies which file, sorted per rank: ``reads[r]`` names the files rank
    ``r`` will read. Each file some rank reads is verified by exactly one rank that reads it
    — the one with the fewest bytes to verify so far, its writer on a tie, then the lowest
    rank; the largest files are given out first. A file no rank reads is verified by none."""
    sizes = {f.name: f.size for f in layout.files}
    writers = {f.name: f.rank for f in layout.files}
    readers: dict[str, list[int]] = {}
    for rank, names in enumerate(reads):
        for name in names:
            if name not in sizes:
                raise CheckpointCorrupt(f"sharded layout lists no file {name!r}")
            if rank not in readers.setdefault(name, []):
                readers[name].append(rank)
    load = [0] * len(reads)
    shares: list[list[str]] = [[] for _ in reads]
    for name in sorted(readers, key=lambda n: (-sizes[n], n)):
        rank = min(readers[name], key=lambda r: (load[r], r != writers[name], r))
        load[rank] += sizes[name]
        shares[rank].append(name)
    return tuple(tuple(sorted(share)) for share in shares)


def writer_checks(
    layout: ShardedLayout, names: Iterable[str], rank: int, world_size: int
) -> tuple[str, ...] | None:
    """The files of ``names`` (those rank ``rank`` of ``world_size`` reads) it verifies before
    the ranks have told each other what they read: the ones it wrote, sorted; ``None`` where
    one of them was written by no rank of the run (:func:`writers_read` cannot hold). Where
    :func:`writers_read` holds, every file some rank reads is verified so, exactly once."""
    writers = {f.name: f.rank for f in layout.files}
    names = set(names)
    if any(writers.get(n, -1) not in range(world_size) for n in names):
        return None
    return tuple(sorted(n for n in names if writers[n] == rank))


def early_checks(layout: ShardedLayout, rank: int, world_size: int) -> tuple[str, ...]:
    """The files rank ``rank`` of ``world_size`` starts verifying as soon as it has read the
    manifest, before it has planned its read: the ones it wrote, sorted — where the run has
    the world size that saved (a reshard reads other files: none then). They hold every file
    :func:`writer_checks` gives it; one its plan does not read is checked to no purpose only."""
    if layout.world_size != world_size:
        return ()
    return tuple(sorted(f.name for f in layout.files if f.rank == rank))


def guessed_first(target: str) -> str | None:
    """The sharded checkpoint a rank starts checking before rank 0's resume order arrives:
    the one its pointer links to (``target``, as read from the link, untrusted) — only a
    plain ``step_<digits>`` name; ``None`` for anything else (a file, a path, a foreign
    name), and the rank waits for the order instead."""
    return target if isinstance(parse_sharded_name(target), int) else None


def guess_holds(guessed: str | None, candidate: str) -> bool:
    """Whether the start on ``guessed`` (:func:`guessed_first`) serves ``candidate``, the
    checkpoint the ranks try now: the same name only (else it is dropped, and the candidate
    read as if nothing had been guessed)."""
    return guessed is not None and guessed == candidate


def adopts_without_round(
    *, checked_read: bool, one_directory: bool, adopting_reads_nothing: bool
) -> bool:
    """Whether rank 0 works out its schedule after a sharded resume in the apply's round and
    keeps it with no round of its own once the round that agrees every rank's copy agreed:
    only where that round ends the resume (a ``checked_read``: the copy is the last step that
    can fail, so a failed resume never turns the first save's refusal off), in
    ``one_directory`` every rank shares (rank 0 its one writer), whose adopting
    ``reads_nothing`` (a plain local directory: not a tiered one, not an object store).
    Elsewhere it has a round of its own after the resume."""
    return checked_read and one_directory and adopting_reads_nothing


def writers_read(layout: ShardedLayout, reads: Sequence[Iterable[str]]) -> bool:
    """Whether every file some rank reads (``reads[r]``: rank ``r``'s) is read by the rank
    that wrote it too — so that each rank's :func:`writer_checks` verify them all."""
    writers = {f.name: f.rank for f in layout.files}
    read = [set(names) for names in reads]
    return all(
        writers.get(n, -1) in range(len(read)) and n in read[writers[n]]
        for names in read
        for n in names
    )


def sharded_meta(
    meta: dict[str, object], fresh: Sequence[str], homes: Sequence[Sequence[int]] = ()
) -> dict[str, object]:
    """A sharded checkpoint's manifest ``meta`` naming the optimizers that had no state when
    its save began (``fresh``, under :data:`FRESH_OPTIMIZERS`), and the ranks sharing each
    directory (``homes``, under ``DIRECTORIES``: where they do not all share one)."""
    meta = {**meta, DIRECTORIES: [list(g) for g in homes]} if homes else meta
    return {**meta, FRESH_OPTIMIZERS: list(fresh)} if fresh else meta


def fresh_optimizers(meta: Mapping[str, object]) -> tuple[str, ...]:
    """The names under :data:`FRESH_OPTIMIZERS` in a manifest's (untrusted) meta; none when
    it has no such key. Raises :class:`~pitstop.errors.CheckpointCorrupt` for anything but a
    list of names."""
    value = meta.get(FRESH_OPTIMIZERS, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointCorrupt(f"manifest {FRESH_OPTIMIZERS}: a list of names, not {value!r}")
    return tuple(value)


def file_problem(
    expected: ShardFile, size: int | None, crc32: int | None, said: str = "the manifest"
) -> str | None:
    """What is wrong with a file found with ``size`` and ``crc32`` (``None``: missing);
    ``said``: where ``expected`` comes from (the manifest, or a commit object)."""
    if size is None:
        return f"{expected.name} (written by rank {expected.rank}) is missing"
    if size != expected.size:
        return f"{expected.name} is {size} bytes, {said} says {expected.size}"
    if crc32 != expected.crc32:
        return (
            f"{expected.name} fails its checksum: CRC-32 {crc32:#010x}, {said} says "
            f"{expected.crc32:#010x}"
        )
    return None


def layout_differences(layout: ShardedLayout, live: Mapping[str, LiveValue]) -> list[str]:
    """Every difference between the values a load would fill (by flattened key) and what
    ``layout`` stores, among the top-level components ``live`` covers (a model-only load
    ignores a stored optimizer). Empty when the load fits."""
    stored = {v.fqn: v for v in layout.values}
    components = {_head(fqn) for fqn in live}
    problems = []
    for fqn, value in sorted(live.items()):
        have = stored.get(fqn)
        if have is None:
            problems.append(f"{fqn}: not in the checkpoint")
        elif (have.dtype is None) != (value.dtype is None):
            kind = "a tensor" if have.dtype is not None else "not a tensor"
            problems.append(f"{fqn}: the checkpoint holds {kind} here")
        elif value.dtype is not None and (have.dtype, have.shape) != (value.dtype, value.shape):
            problems.append(
                f"{fqn}: the checkpoint holds {have.dtype}{list(have.shape)}, the live value is "
                f"{value.dtype}{list(value.shape)}"
            )
    unexpected = sorted(f for f in stored if _head(f) in components and f not in live)
    problems += [f"{fqn}: in the checkpoint, not in the live state" for fqn in unexpected]
    return problems


def _head(fqn: str) -> str:
    return fqn.split(".", 1)[0]
