# What a `checkpoint` argument means.
#
# Rules: every public function that takes a checkpoint accepts a checkpoint file, a pointer in
# a checkpoint directory (`run/checkpoints/best`, whether or not the filesystem has symlinks),
# or a checkpoint directory (meaning its `last`). A pointer or directory is resolved by scanning
# the directory and asking the core — the symlink itself is never blindly followed. With
# fallback (loading), a corrupt target falls back along the core's resume order with a warning;
# without it (verifying), the target itself is checked. Readers take no lock: when a live run's
# retention deletes the target while it is being resolved or read, the pointer is read again /
# the directory scanned again (at most RESOLVE_ATTEMPTS times) and the newest valid checkpoint
# taken; a checkpoint deleted while it was read is "gone" (CheckpointNotFound), never "corrupt".
# A writer's resume on an object store takes the scan its open made under the lease, if unchanged.
# How: scan + choose_resume from pitstop.shell.store.directory.

"""Resolving a checkpoint argument (file, pointer or directory) to one checkpoint file."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pitstop.core.metadata import (
    entry_from_meta,
    pointers_from_latest_json,
    policy_from_latest_json,
)
from pitstop.core.naming import (
    LATEST_JSON,
    NOT_A_CHECKPOINT,
    POINTER_NAMES,
    checkpoint_name,
    parse_checkpoint,
    parse_sharded_name,
)
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, NoCheckpoint, PointerName, Policy
from pitstop.core.s3.objects import is_object_url
from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.shell.format import fileformat
from pitstop.shell.format.untrusted import held
from pitstop.shell.store.directory import (
    CheckpointDirectory,
    choose_resume,
    is_sharded_path,
    read_latest_json,
    scan,
    vanished,
    verify_any,
)
from pitstop.shell.store.storage import (
    FileKind,
    LocalStorage,
    RemoteStorage,
    Storage,
    reader_cache,
)
from pitstop.shell.store.tiers import TieredDirectory

if TYPE_CHECKING:
    from pitstop.shell.store.objectstore import ObjectStorage

__all__ = [
    "RESOLVE_ATTEMPTS",
    "find_resume",
    "is_sharded_checkpoint",
    "manifest_path",
    "own_pointer",
    "pointer_on_disk",
    "read_resolved",
    "recorded_policy",
    "resolve_checkpoint",
    "split_argument",
    "split_object_url",
    "verify",
]


RESOLVE_ATTEMPTS = 16
"""How many times a reader resolves a pointer or directory again when the checkpoint it found
was deleted before it could be read (a live run publishing and pruning meanwhile)."""

T = TypeVar("T")


def recorded_policy(directory: Path) -> Policy | None:
    """The retention policy and Best metric a directory's ``latest.json`` records, if any."""
    data, _ = read_latest_json(LocalStorage(directory))  # None when missing or refused
    return policy_from_latest_json(data)


def _is_regular(path: Path) -> bool:
    """Whether ``path`` itself (not a symlink's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (a checkpoint's name, and a
    manifest in it) rather than a directory of checkpoints."""
    return (
        parse_sharded_name(path.name) is not NOT_A_CHECKPOINT
        and path.is_dir()
        and (path / MANIFEST_NAME).exists()
    )


def manifest_path(path: Path) -> Path:
    """The file holding ``path``'s manifest: itself, or a sharded directory's manifest."""
    return path / MANIFEST_NAME if is_sharded_path(path) else path


def split_argument(checkpoint: str | os.PathLike[str]) -> tuple[Path, PointerName | None]:
    """``(directory, pointer)`` for a pointer or directory argument, ``(file, None)`` for a file.

    Raises :class:`~pitstop.errors.CheckpointNotFound` when the argument names nothing.
    """
    path = Path(checkpoint)
    if held(path) or is_sharded_checkpoint(path):  # (held: read into memory from s3://)
        return path, None
    if path.name in POINTER_NAMES and path.is_symlink() and path.parent.is_dir():
        return path.parent, PointerName(path.name)  # even one whose target is a directory
    if path.is_dir():
        return path, PointerName.LAST
    if path.name in POINTER_NAMES and path.parent.is_dir() and not _is_regular(path):
        # a symlink, a name only latest.json holds, or a FIFO or device in a pointer's place:
        # the directory says where the pointer goes
        return path.parent, PointerName(path.name)
    if path.is_file():
        return path, None
    raise CheckpointNotFound(f"no checkpoint at {path}: not a file, pointer or directory")


def pointer_on_disk(storage: Storage, pointer: PointerName) -> tuple[str | None, str]:
    """The checkpoint name ``pointer`` holds on disk — its symlink, else its entry in
    ``latest.json`` — and which of the two it was read from; ``(None, "")``: neither names one.

    This is what the pointer says even when that file is truncated or gone: what verifying the
    pointer must check, never falling back past it.
    """
    if storage.kind(pointer.value) is FileKind.SYMLINK:
        target = storage.read_link(pointer.value)
        if parse_checkpoint(target) is not NOT_A_CHECKPOINT:
            return target, "symlink"
    data, _ = read_latest_json(storage)
    if data is not None:
        named = pointers_from_latest_json(data)[0].target(pointer)
        if named is not NO_CHECKPOINT:
            return named, "latest.json"
    return None, ""


def _missing_target(storage: Storage, pointer: PointerName, named: str, source: str) -> str:
    """Why ``pointer`` (read from ``source``: its symlink or ``latest.json``) names nothing."""
    if source == "symlink":
        where = f"{storage.path(pointer.value)} points to"
    else:
        where = f"{storage.path(LATEST_JSON)} says {pointer.value} is"
    return f"{where} {storage.path(named)}, which does not exist"


def resolve_checkpoint(
    checkpoint: str | os.PathLike[str],
    *,
    fallback: bool = True,
    verify: Callable[[Path], None] = verify_any,
) -> Path:
    """Return the checkpoint file that ``checkpoint`` names.

    ``fallback``: when the pointer's target does not verify, use the next candidate of the
    resume order (with a warning) instead of returning the corrupt file; ``verify(path)``
    is the check (a caller may pass one that also loads, reading the file once). Without
    it, the file the pointer names on disk (:func:`pointer_on_disk`), even a damaged one;
    with no pointer on disk, the directory's reconciled one.
    Raises :class:`~pitstop.errors.CheckpointNotFound` when nothing matches, and (without
    ``fallback``) when the pointer names a checkpoint that does not exist, naming both.
    """
    if is_object_url(checkpoint):
        assert isinstance(checkpoint, str)
        return _resolve_object(checkpoint, fallback=fallback, verify=verify)
    directory, pointer = split_argument(checkpoint)
    if pointer is None:
        return directory
    storage = LocalStorage(directory)
    if not fallback:
        named = _pointer_target(storage, pointer)
        if named is not None:
            return named
    policy = recorded_policy(directory)
    best = None if policy is None else policy.best
    for attempt in range(RESOLVE_ATTEMPTS):
        found = scan(storage, best)
        if not fallback:
            if found.gone and attempt + 1 < RESOLVE_ATTEMPTS:
                continue  # the listing was overtaken by a prune: take a fresh one
            target = found.pointers.target(pointer)
            if target is NO_CHECKPOINT:
                raise CheckpointNotFound(f"{directory} has no {pointer.value} checkpoint")
            return storage.path(target)
        choice = choose_resume(storage, found, pointer, best, verify=verify)
        if choice.gone and attempt + 1 < RESOLVE_ATTEMPTS:
            continue  # a candidate was pruned while it was tried: a newer one is there
        if choice.path is not None:
            return choice.path
        detail = f" ({len(choice.skipped)} corrupt)" if choice.skipped else ""
        if choice.gone:
            detail += f" ({len(choice.gone)} deleted while being read, {RESOLVE_ATTEMPTS} scans)"
        raise CheckpointNotFound(f"{directory} has no valid {pointer.value} checkpoint{detail}")
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _pointer_target(storage: Storage, pointer: PointerName) -> Path | None:
    """The path of the checkpoint ``pointer`` names on disk (``None``: no pointer on disk).

    A named checkpoint that does not exist is read again while the pointer moves meanwhile (a
    live run published a newer one and pruned this one); one it keeps naming is
    :class:`~pitstop.errors.CheckpointNotFound`, naming the pointer and the file. The answer
    is what one look found: a checkpoint that existed when it was looked at is returned even
    if a live run prunes it a moment later (the read that follows finds it gone and resolves
    again, :func:`read_resolved`); it is never looked at a second time and taken for missing
    while the pointer has moved on.
    """
    named, source = pointer_on_disk(storage, pointer)
    for _ in range(RESOLVE_ATTEMPTS):
        if named is None:
            return None
        if storage.kind(named) is not FileKind.MISSING:
            return storage.path(named)
        again, again_source = pointer_on_disk(storage, pointer)
        if again == named:  # it names a missing checkpoint and keeps naming it
            break
        named, source = again, again_source
    if named is None:
        return None
    raise CheckpointNotFound(_missing_target(storage, pointer, named, source))


def read_resolved(
    checkpoint: str | os.PathLike[str],
    read: Callable[[Path], T],
    *,
    fallback: bool = False,
) -> tuple[Path, T]:
    """Resolve ``checkpoint`` (as :func:`resolve_checkpoint`) and ``read(path)`` it.

    A pointer or directory whose checkpoint is deleted while it is read (a live run's retention)
    is resolved again, at most :data:`RESOLVE_ATTEMPTS` times. A checkpoint that was deleted
    while it was read is :class:`~pitstop.errors.CheckpointNotFound` saying so, never
    :class:`~pitstop.errors.CheckpointCorrupt`.
    """
    # A file (or an object URL, fetched whole) is read once; a pointer or directory again.
    a_file = is_object_url(checkpoint) or split_argument(checkpoint)[1] is None
    for attempt in range(RESOLVE_ATTEMPTS):
        path = resolve_checkpoint(checkpoint, fallback=fallback)
        try:
            return path, read(path)
        except (CheckpointCorrupt, OSError) as exc:
            if not vanished(path):
                raise
            if a_file or attempt + 1 == RESOLVE_ATTEMPTS:
                raise CheckpointNotFound(
                    f"{path} was deleted while it was being read (a live run's retention "
                    f"pruned it): {exc}"
                ) from exc
    raise AssertionError("unreachable")  # the last attempt returns or raises


def split_object_url(url: str) -> tuple[str, str | PointerName]:
    """``(prefix URL, checkpoint name)`` for ``s3://…/step_…[.pitstop]``, ``(prefix URL,
    pointer)`` for ``s3://…/best`` (``last``, ``final``), and ``(url, LAST)`` for a prefix."""
    head, _, last = url.rstrip("/").rpartition("/")
    if head.startswith("s3:/") and head != "s3:/":
        if last in POINTER_NAMES:
            return head, PointerName(last)
        if parse_checkpoint(last) is not NOT_A_CHECKPOINT:  # a file's or a sharded one's
            return head, last
    return url, PointerName.LAST


def _resolve_object(url: str, *, fallback: bool, verify: Callable[[Path], None]) -> Path:
    """:func:`resolve_checkpoint` for an ``s3://`` URL: the checkpoint it names, fetched to a
    local file of this process (removed at exit) that ``verify`` checks before it is used. A
    pointer or prefix whose checkpoint a live writer deleted meanwhile is resolved again (at
    most RESOLVE_ATTEMPTS times); a checkpoint named by its name is not."""
    from pitstop.shell.store.objectstore import ObjectStorage

    prefix, what = split_object_url(url)
    storage = ObjectStorage(prefix, cache=reader_cache())
    for attempt in range(RESOLVE_ATTEMPTS):
        last_try = attempt + 1 == RESOLVE_ATTEMPTS or not isinstance(what, PointerName)
        try:
            return _resolve_object_once(storage, prefix, what, fallback, verify, last_try)
        except FileNotFoundError as exc:
            if last_try:
                raise CheckpointNotFound(f"no checkpoint at {url}: {exc.strerror or exc}") from None
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _resolve_object_once(
    storage: ObjectStorage,
    prefix: str,
    what: str | PointerName,
    fallback: bool,
    verify: Callable[[Path], None],
    last_try: bool,
) -> Path:
    """One attempt of :func:`_resolve_object`; ``FileNotFoundError`` when what it chose was
    deleted before it was read (a checkpoint gone while tried, unless ``last_try``)."""
    if not isinstance(what, PointerName):
        return storage.fetch(what)
    if not fallback:
        named, _ = pointer_on_disk(storage, what)
        if named is not None:
            return storage.fetch(named)
    data, _ = read_latest_json(storage)
    policy = policy_from_latest_json(data)
    best = None if policy is None else policy.best
    found = scan(storage, best)
    if fallback:
        choice = choose_resume(storage, found, what, best, verify=verify)
        if choice.path is not None:
            return choice.path
        if choice.gone and not last_try:
            raise FileNotFoundError(f"{prefix}: {len(choice.gone)} deleted while being read")
        detail = f" ({len(choice.skipped)} corrupt)" if choice.skipped else ""
        raise CheckpointNotFound(f"{prefix} has no valid {what.value} checkpoint{detail}")
    target = found.pointers.target(what)
    if target is NO_CHECKPOINT:
        raise CheckpointNotFound(f"{prefix} has no {what.value} checkpoint")
    return storage.fetch(target)


def verify(checkpoint: str | os.PathLike[str]) -> Path:
    """Check every byte of ``checkpoint``; raise :class:`~pitstop.errors.CheckpointCorrupt`.

    A pointer or directory is checked at its target, without falling back (a target that
    does not exist is :class:`~pitstop.errors.CheckpointNotFound`, naming the pointer and the
    file). Returns the path of the file that was verified.
    """
    check_path(checkpoint, argument="verify checkpoint", to=CHECKPOINT_PATH)
    return read_resolved(checkpoint, verify_any)[0]


def own_pointer(
    directory: CheckpointDirectory, source: str | os.PathLike[str]
) -> PointerName | None:
    """The pointer of ``directory`` that ``source`` names — a pointer name, or a path to one
    of the directory's own pointers (resumed from it, fresh if it has none) — else ``None``."""
    names = {p.value for p in PointerName}
    if isinstance(source, str) and source in names:
        return PointerName(source)
    path = Path(source)
    if path.name in names and path.parent.resolve() == directory.path.resolve():
        return PointerName(path.name)
    return None


def find_resume(
    directory: CheckpointDirectory,
    source: str | os.PathLike[str],
    *,
    verify: Callable[[Path], None] = verify_any,
) -> tuple[Path | None, CheckpointEntry | NoCheckpoint]:
    """What ``Checkpointer.resume(source)`` restores: a verified file and its entry.

    ``source`` is a pointer name of ``directory`` (or a path to one of its own pointers: fresh
    when it has none), or any checkpoint argument, which must verify (no fallback).
    ``verify(path)`` checks each candidate, raising ``CheckpointCorrupt`` (the resume path
    passes one that loads the file in the same pass, so the file is read once).
    """
    pointer = own_pointer(directory, source)
    best = directory.policy.best
    if pointer is not None and isinstance(directory, TieredDirectory):  # both tiers
        path, entry = directory.choose(pointer, verify)
        held = directory.catalog or directory.remote.directory.catalog
        if path is None and pointer is not PointerName.LAST and held:
            raise CheckpointNotFound(f"{directory.path} has no valid {pointer.value} checkpoint")
        return path, entry
    if pointer is not None:
        source = pointer.value
        storage, found = directory.storage, directory.opened
        if not (  # an object store's scan at open, under its lease, while this writer changed
            isinstance(storage, RemoteStorage)  # nothing: no other writer commits or deletes
            and found is not None  # there meanwhile (readers, local directories: a scan)
            and (found.catalog, found.pointers) == (directory.catalog, directory.pointers)
        ):
            found = scan(storage, best)
        choice = choose_resume(storage, found, PointerName(source), best, verify=verify)
        if choice.path is None and source != PointerName.LAST.value and found.catalog:
            raise CheckpointNotFound(f"{directory.path} has no valid {source} checkpoint")
        return choice.path, choice.entry
    path = resolve_checkpoint(source, fallback=False)
    verify(path)
    meta = fileformat.read_manifest(manifest_path(path)).meta
    name = path.name if parse_checkpoint(path.name) is not NOT_A_CHECKPOINT else None
    if name is None:
        progress = meta.get("progress")
        step = progress.get("step") if isinstance(progress, Mapping) else None
        name = checkpoint_name(step) if isinstance(step, int) else path.name
    return path, entry_from_meta(name, meta)
