# The checks a sharded layout's values must pass before any reader allocates or reads a byte.
#
# Rules: a layout read back is untrusted. Every tensor value's chunks cover its global shape
# exactly once (inside it, no two overlapping, their volumes adding up to its element count), so
# a tensor built from its extents and filled from its chunks has no element left as it was
# allocated; each chunk's bytes in its file are at least its elements' bytes (what DCP wrote:
# raw or torch.save'd), so a shape is bounded by the files' real (verified) sizes; a dtype is
# one the reader knows; key paths are non-empty, unique, and none is both a leaf and a subtree.
# How: pure functions over the layout's records; the overlap check sweeps along the dimension
# with the most distinct chunk offsets, comparing only chunks whose extents meet along it.
#
# A sharded checkpoint's files across directories the ranks do not share (nodes with disks of
# their own): each directory holds the files its ranks wrote (file_homes: a file's home is the
# directory of the rank that wrote it) and a manifest of its own. A checkpoint is complete when
# every file it lists — the manifest among them — is whole in at least one directory (the
# union); a file whole in none is missing, and then nothing moves (cover_nodes). When complete,
# each directory receives each file its ranks' reads need and it lacks, from a directory that
# holds it whole: the sources taken in turn, the one that has sent fewest first, so that
# several directories catching up share the senders. What one directory holds of a checkpoint
# is counted against the list (part_here), for a listing that says "partial". A checkpoint not
# complete across the directories that the remote tier holds: each directory downloads only the
# files every rank reads first (the manifest, DCP's metadata) that it lacks and the lost files
# (whole in no directory) its ranks wrote (tier_takes); the rest moves between directories.
# How: pure functions over file names, directory indexes and ranks.

"""Pure checks of a sharded layout's values (exact cover, dtypes, byte bounds, key paths),
and the cover of a sharded checkpoint's files by directories the ranks do not share."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Final

import attrs

__all__ = [
    "DIRECTORIES",
    "MAX_DIMS",
    "Box",
    "FileMove",
    "NodeCover",
    "cover_nodes",
    "cover_problem",
    "directories_of",
    "extent_problem",
    "file_homes",
    "not_on_every_directory",
    "part_here",
    "paths_problem",
    "tier_takes",
]

DIRECTORIES: Final = "directories"
"""The manifest meta key of a sharded checkpoint saved in directories the ranks do not share:
the ranks sharing each directory (a list of lists of ranks; each file lies in its writer's)."""
MAX_DIMS: Final = 64
"""The most dimensions a stored tensor value may have (torch allows 64)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk's ``(offsets, sizes)`` in its value's global shape."""


def _volume(sizes: Iterable[int]) -> int:
    volume = 1
    for size in sizes:
        volume *= size
    return volume


def cover_problem(shape: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """What keeps ``chunks`` from covering every element of ``shape`` exactly once, or ``None``.

    Chunks with no elements cover nothing and are allowed anywhere inside.
    """
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions (at most {MAX_DIMS})"
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"a {len(offsets)}-d chunk in a {len(shape)}-d value"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return f"a chunk at {list(offsets)} of {list(sizes)} outside its shape {list(shape)}"
    boxes = [(o, s) for o, s in chunks if _volume(s) > 0]
    covered = sum(_volume(s) for _, s in boxes)
    if covered != _volume(shape):
        return f"chunks holding {covered} elements of {_volume(shape)}"
    if len(boxes) == 1:  # all of it, in one chunk (a scalar, or any value on one rank)
        return None
    if len(shape) == 0:
        return f"{len(boxes)} chunks of one scalar"
    overlap = _overlap(boxes, len(shape))
    if overlap is not None:
        a, b = overlap
        return f"chunks at {list(a[0])} and {list(b[0])} overlapping (others leave a gap)"
    return None


def _overlap(boxes: Sequence[Box], dims: int) -> tuple[Box, Box] | None:
    """Two boxes that share an element, or ``None``."""
    axis = max(range(dims), key=lambda d: len({o[d] for o, _ in boxes}))
    ordered = sorted(boxes, key=lambda b: b[0][axis])
    for i, (offsets, sizes) in enumerate(ordered):
        end = offsets[axis] + sizes[axis]
        for other in ordered[i + 1 :]:
            if other[0][axis] >= end:
                break
            if all(
                o < p + t and p < o + s
                for o, s, p, t in zip(offsets, sizes, other[0], other[1], strict=True)
            ):
                return (offsets, sizes), other
    return None


def extent_problem(
    dtype: str, chunks: Sequence[tuple[Box, int]], itemsizes: Mapping[str, int]
) -> str | None:
    """What is wrong with a tensor value of ``dtype`` whose chunks (each with its byte
    ``length`` in its file) claim more elements than their bytes can hold, or ``None``."""
    itemsize = itemsizes.get(dtype)
    if itemsize is None:
        return f"an unknown dtype {dtype!r}"
    for (offsets, sizes), length in chunks:
        if _volume(sizes) * itemsize > length:
            return (
                f"a chunk at {list(offsets)} of {list(sizes)} {dtype} ({_volume(sizes) * itemsize}"
                f" bytes) stored in {length} bytes"
            )
    return None


def paths_problem(paths: Iterable[tuple[str | int, ...]]) -> str | None:
    """What is wrong with the values' key paths (empty, repeated, or one both a leaf and the
    root of others), or ``None``."""
    seen: set[tuple[str | int, ...]] = set()
    for path in paths:
        if not path:
            return "an empty key path"
        if path in seen:
            return f"the key path {list(path)} twice"
        seen.add(path)
    for path in seen:
        for end in range(1, len(path)):
            if path[:end] in seen:
                return f"the key path {list(path[:end])} both a value and holding {list(path)}"
    return None


# --- files across directories the ranks do not share ------------------------------------------


@attrs.frozen(kw_only=True)
class FileMove:
    """One file a directory receives: ``name``, from directory ``source`` to ``target``
    (indexes in the order of the directories' writers)."""

    name: str
    source: int
    target: int


@attrs.frozen(kw_only=True)
class NodeCover:
    """A sharded checkpoint across directories: the files whole in no directory (``missing``,
    sorted: then it is not complete and nothing moves), and the moves that give each
    directory what its ranks need (in order: every rank carries them out in this order)."""

    missing: tuple[str, ...]
    moves: tuple[FileMove, ...]

    @property
    def complete(self) -> bool:
        """Whether every listed file is whole in at least one directory."""
        return not self.missing


def cover_nodes(
    listed: Iterable[str],
    held: Sequence[Collection[str]],
    needed: Sequence[Collection[str]],
) -> NodeCover:
    """Which of the ``listed`` files is whole in no directory (``held[d]``: the files whole in
    directory ``d``), and, when none is missing, which files each directory ``d`` receives:
    those of ``needed[d]`` it does not hold. Raises ValueError for a needed file not listed."""
    if len(held) != len(needed):
        raise ValueError(f"{len(held)} directories hold files, {len(needed)} need them")
    names = set(listed)
    unknown = sorted(n for want in needed for n in want if n not in names)
    if unknown:
        raise ValueError(f"needed files the checkpoint does not list: {unknown}")
    missing = tuple(sorted(n for n in names if not any(n in h for h in held)))
    if missing:
        return NodeCover(missing=missing, moves=())
    sent = [0] * len(held)
    moves = []
    for target, want in enumerate(needed):
        for name in sorted(set(want)):
            if name in held[target]:
                continue
            source = min((d for d, h in enumerate(held) if name in h), key=lambda d: (sent[d], d))
            sent[source] += 1
            moves.append(FileMove(name=name, source=source, target=target))
    return NodeCover(missing=(), moves=tuple(moves))


def file_homes(
    files: Iterable[tuple[str, int]], groups: Sequence[Collection[int]]
) -> tuple[tuple[str, ...], ...]:
    """The files each directory holds as saved (``groups[d]``: the ranks that share directory
    ``d``): a file ``(name, rank)`` lies where its writing rank wrote it; sorted. Raises
    ValueError for a rank in no group."""
    homes: list[list[str]] = [[] for _ in groups]
    for name, rank in files:
        home = next((d for d, group in enumerate(groups) if rank in group), None)
        if home is None:
            raise ValueError(f"{name} was written by rank {rank}, which is in no directory")
        homes[home].append(name)
    return tuple(tuple(sorted(h)) for h in homes)


def directories_of(meta: Mapping[str, object]) -> tuple[tuple[int, ...], ...]:
    """The ranks sharing each directory, as an (untrusted) manifest meta records them under
    :data:`DIRECTORIES`; none when it has no such key (one directory for every rank). Raises
    ValueError for anything but a list of lists of ranks."""
    value = meta.get(DIRECTORIES, [])
    if not isinstance(value, list) or not all(
        isinstance(g, list) and all(type(r) is int and r >= 0 for r in g) for g in value
    ):
        raise ValueError(f"manifest {DIRECTORIES}: a list of lists of ranks, not {value!r}")
    return tuple(tuple(g) for g in value)


def part_here(
    files: Iterable[tuple[str, int]], present: Collection[str]
) -> tuple[int, int, tuple[int, ...]]:
    """What one directory holds of a checkpoint listing ``files`` (``(name, rank)``): how many
    of them are ``present``, how many are listed, and the ranks that wrote those absent."""
    listed = list(files)
    absent = sorted({rank for name, rank in listed if name not in present})
    here = sum(1 for name, _ in listed if name in present)
    return here, len(listed), tuple(absent)


def tier_takes(
    files: Iterable[tuple[str, int]],
    groups: Sequence[Collection[int]],
    index: int,
    held: Sequence[Collection[str]],
    every: Collection[str],
) -> tuple[str, ...]:
    """What directory ``index`` downloads of a checkpoint the remote tier holds (``files``: its
    ``(name, rank)`` rows) that is not complete across the directories (``groups[d]``: the
    ranks sharing directory ``d``; ``held[d]``: the files whole there): the files of ``every``
    it lacks (what each directory reads first: the manifest, DCP's metadata), and each file
    whole in no directory that its own ranks wrote — a file written by a rank in no group
    (another world size) is the first directory's. So each lost file is downloaded once, where
    its writer is, and every listed file is whole somewhere afterwards (the rest of the ranks'
    reads then move between directories: :func:`cover_nodes`); sorted."""
    ranks = {r for group in groups for r in group}
    mine, have = set(groups[index]), set(held[index])
    takes = {
        name
        for name, rank in files
        if (name in every and name not in have)
        or (
            not any(name in h for h in held)
            and (rank in mine or (index == 0 and rank not in ranks))
        )
    }
    return tuple(sorted(takes))


def not_on_every_directory(held: Sequence[Iterable[tuple[str, int]]]) -> set[str]:
    """The checkpoints some directory lacks (``held[d]``: the ``(name, seq)`` of each checkpoint
    directory ``d`` holds; one of the same name but another seq counts as lacking it): those a
    remote tier's catch-up from one directory must leave out, since the other directories'
    writers could never upload their parts of them."""
    rows = [set(h) for h in held]
    everywhere = set.intersection(*rows) if rows else set()
    return {name for row in rows for name, seq in row if (name, seq) not in everywhere}
