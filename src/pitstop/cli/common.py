"""What the subcommands share: what a checkpoint argument names, and how failures read.

A checkpoint argument is a file, a pointer (``DIR/last``, ``DIR/best``, ``DIR/final``) or a
directory (its ``last``). :func:`named_target` says which file the pointer itself names on disk
(its symlink, else ``latest.json``) — what ``verify`` checks, never falling back;
:func:`loading_target` is the file loading uses (falling back past corrupt ones) and says how it
got there. :func:`os_error_message` turns an ``OSError`` into one line naming the user's path,
never a temp file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs

from pitstop.core.metadata import policy_from_latest_json
from pitstop.core.naming import (
    TEMP_PREFIX,
)
from pitstop.core.records import NO_CHECKPOINT, PointerName, Policy
from pitstop.core.s3.objects import is_object_url
from pitstop.errors import CheckpointNotFound
from pitstop.shell.store.directory import Scan, choose_resume, read_latest_json, scan
from pitstop.shell.store.resolve import (
    pointer_on_disk,
    recorded_policy,
    resolve_checkpoint,
    split_argument,
)
from pitstop.shell.store.storage import FileKind, LocalStorage, Storage, reader_cache

__all__ = [
    "Target",
    "loading_target",
    "named_target",
    "open_directory",
    "os_error_message",
    "split_argument",
]


@attrs.frozen(kw_only=True)
class Target:
    """The file a checkpoint argument names, and how it was found (for messages).

    ``via``: ``""`` for a file argument, else e.g. ``"best points to it"``. ``pointer``: the
    pointer followed (``None`` for a file). ``note``: what loading fell back from, if it did.
    """

    path: Path
    via: str = ""
    pointer: PointerName | None = None
    note: str = ""


def _scan(directory: Path) -> tuple[LocalStorage, Scan]:
    storage = LocalStorage(directory)
    policy = recorded_policy(directory)
    return storage, scan(storage, None if policy is None else policy.best)


def open_directory(
    directory: str, missing: Callable[[Path], str]
) -> tuple[Storage, Policy | None, str]:
    """``(storage, recorded policy, display name)`` of the checkpoint directory ``directory``
    (a local directory or an ``s3://`` prefix, whose checkpoints a reader fetches to this
    process's read cache); ``missing(path)`` is the message when a local one is no directory."""
    if is_object_url(directory):
        from pitstop.shell.store.objectstore import ObjectStorage

        objects = ObjectStorage(directory, cache=reader_cache())
        data, _ = read_latest_json(objects)
        return objects, policy_from_latest_json(data), objects.url
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointNotFound(missing(path))
    return LocalStorage(path), recorded_policy(path), str(path)


def named_target(checkpoint: str | os.PathLike[str]) -> Target:
    """The file ``checkpoint`` names, without falling back past a bad one.

    For a pointer (or a directory: its ``last``) this is the file the pointer names on disk —
    its symlink, else its entry in ``latest.json`` — even when that file is truncated or gone,
    so checking it finds the damage. With no pointer on disk, the directory's reconciled
    pointer (for ``last``: the most recently published readable checkpoint).
    """
    if is_object_url(checkpoint):  # fetched, unchecked (the caller checks it)
        return Target(path=resolve_checkpoint(checkpoint, fallback=False), via=str(checkpoint))
    path, pointer = split_argument(checkpoint)
    if pointer is None:
        return Target(path=path)
    storage = LocalStorage(path)
    named, source = pointer_on_disk(storage, pointer)
    if named is not None:
        who = pointer.value if source == "symlink" else f"latest.json's {pointer.value}"
        return Target(path=storage.path(named), via=f"{who} points to it", pointer=pointer)
    _, found = _scan(path)
    target = found.pointers.target(pointer)
    if target is NO_CHECKPOINT:
        raise CheckpointNotFound(f"{path} has no {pointer.value} checkpoint")
    how = (
        "the most recently published readable checkpoint"
        if pointer is PointerName.LAST
        else f"the reconciled {pointer.value}"
    )
    return Target(
        path=storage.path(target),
        via=f"{how}; no {pointer.value} pointer on disk",
        pointer=pointer,
    )


def loading_target(checkpoint: str | os.PathLike[str]) -> Target:
    """The file loading ``checkpoint`` uses: a pointer's target, or the previous valid one.

    ``note`` says when it is not the file the pointer names, and why (that file does not
    verify, is unreadable or missing). Verifying a candidate reads it whole.
    """
    if is_object_url(checkpoint):  # fetched, and verified before it is chosen
        return Target(path=resolve_checkpoint(checkpoint, fallback=True), via=str(checkpoint))
    path, pointer = split_argument(checkpoint)
    if pointer is None:
        return Target(path=path)
    storage, found = _scan(path)
    policy = recorded_policy(path)
    choice = choose_resume(storage, found, pointer, None if policy is None else policy.best)
    if choice.path is None:
        detail = f" ({len(choice.skipped)} corrupt)" if choice.skipped else ""
        raise CheckpointNotFound(f"{path} has no valid {pointer.value} checkpoint{detail}")
    named, _ = pointer_on_disk(storage, pointer)
    chosen = choice.path.name
    note = ""
    if named is not None and named != chosen:
        why = (
            choice.skipped.get(named)
            or found.unreadable.get(named)
            or (
                "it does not exist"
                if storage.kind(named) is FileKind.MISSING
                else "a newer checkpoint was published after it"
            )
        ).removeprefix(f"{storage.path(named)}: ")
        note = f"{path / pointer.value} names {named}, which was not used ({why}); used {chosen}"
    elif choice.skipped:
        note = (
            f"{path / pointer.value}: skipped {', '.join(choice.skipped)} (it does not verify); "
            f"used {chosen}"
        )
    return Target(path=choice.path, via=f"{pointer.value}", pointer=pointer, note=note)


def _is_temp(filename: object) -> bool:
    return isinstance(filename, (str, bytes, os.PathLike)) and os.path.basename(
        os.fsdecode(filename)
    ).startswith(TEMP_PREFIX)


def os_error_message(error: OSError, subject: str | os.PathLike[str] | None = None) -> str:
    """One line for ``error``, naming the user's path (``subject``), never a temp file.

    ``subject`` is the path the user gave the command (an output directory, a file to write);
    the path the error names is kept when it is the user's own or one inside it.
    """
    reason = error.strerror or str(error) or type(error).__name__
    filename = error.filename
    named = os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike)) else None
    if named is not None and _is_temp(named):
        named = None
    if subject is None:
        return f"{named}: {reason}" if named else reason
    where = os.fspath(subject)
    if named is None or named == where:
        return f"{where}: {reason}"
    return f"{where}: {reason} ({named})"


def scrub_temp_names(message: str, error: BaseException) -> str:
    """``message`` without the temp-file paths that the errors behind it name."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError):
            for filename in (cause.filename, cause.filename2):
                if _is_temp(filename):
                    name = os.fsdecode(filename)
                    message = message.replace(f": {name!r}", "").replace(f" -> {name!r}", "")
                    message = message.replace(f"{name!r} -> ", "").replace(name, "")
        cause = cause.__cause__ or cause.__context__
    return message
