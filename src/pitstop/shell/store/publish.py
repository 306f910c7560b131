# Making files appear in a checkpoint directory durably and atomically.
#
# Rules (the publish sequence): exclusive temp file in the same directory → write → fsync →
# close → rename to the final name → fsync the directory. Pointers (relative symlinks, then
# latest.json) are replaced the same way, only after the checkpoint they name is durable.
# Deletions planned by retention run only after that; a sharded checkpoint (a directory) is
# retired by one atomic rename to a temp name the scan ignores, fsynced, before its files are
# removed, so a reader that takes no lock sees it whole or not at all. Any error aborts the
# step with SaveError: the temp file is removed, and a new file renamed into place whose
# directory fsync failed is taken out again, so what was published before stays exactly as it
# was. A file that replaced
# one of the same name is the exception: the rename took the old one away for good, so the new
# one — complete, and fsynced before the rename — stays, and the error says so (taking it out
# too would leave neither). A failed fsync is never retried on the same descriptor and then
# published (its data may be lost: the kernel can drop the dirty pages and clear the error).
# How: each step is one Storage call, so a fault-injecting Storage can fail any of them.

"""Publishing: atomic, durable creation and replacement of checkpoint files and pointers."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import secrets
import shutil
from collections.abc import Callable, Iterable
from typing import BinaryIO

from pitstop.core.metadata import latest_json
from pitstop.core.naming import LATEST_JSON, EntryKind, classify, temp_name
from pitstop.core.records import NO_CHECKPOINT, Catalog, PointerName, Pointers, Policy
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import SaveError
from pitstop.shell.store.storage import FileKind, RemoteStorage, Storage

__all__ = [
    "PublishedInterrupted",
    "RetentionInterrupted",
    "WriteFile",
    "delete_checkpoints",
    "delete_sharded",
    "publish_file",
    "publish_pointers",
    "remove_checkpoint",
]

log = logging.getLogger("pitstop")

# errno values that mean "this filesystem has no symlinks" rather than "this symlink failed".
_NO_SYMLINKS = frozenset(
    {errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
)


WriteFile = Callable[[BinaryIO, Callable[[], None]], object]
"""``write(file, sync)`` puts a file's contents into ``file``. It may call ``sync()`` to make
what it has written so far durable early (for example while it computes checksums);
:func:`publish_file` syncs the whole file after it in any case."""


def publish_file(
    storage: Storage,
    name: str,
    token: str,
    write: WriteFile,
    *,
    replaced: Callable[[], None] | None = None,
) -> None:
    """Publish ``name`` with the contents ``write`` puts into a file, durably and atomically.

    Raises :class:`~pitstop.errors.SaveError` naming the file and the failed step; then
    neither ``name`` nor its temp file has changed from before the call — unless the new file
    had already replaced an existing ``name`` (only the directory fsync after the rename
    failed, or an interrupt came after it): then ``name`` holds the new contents, complete and
    fsynced, and the message says so. ``replaced()`` is called the moment that happens.
    """
    temp = temp_name(name, token)
    step = "create"
    renamed = replacing = False
    try:
        file = storage.create_exclusive(temp)
        try:
            step = "write"
            write(file, functools.partial(storage.sync_file, file))
            step = "fsync"
            storage.sync_file(file)
        finally:
            file.close()
        step = "rename"
        replacing = storage.kind(name) is not FileKind.MISSING
        storage.replace(temp, name)
        renamed = True
        if replacing and replaced is not None:
            replaced()
        step = "fsync the directory of"
        storage.sync_directory()
    except BaseException as exc:
        kept = renamed and replacing  # the old file is gone: the new one is all there is
        _undo(storage, temp, name if renamed and not kept else None)
        if isinstance(exc, Exception) and not isinstance(exc, SaveError):
            note = (
                f"; {storage.path(name)} holds the new file, complete and fsynced (the file it "
                "replaced is gone; the rename may not be durable)"
                if kept
                else ""
            )
            raise SaveError(f"could not {step} {storage.path(name)}: {exc}{note}") from exc
        raise


def _undo(storage: Storage, temp: str, published: str | None) -> None:
    """Best-effort removal of what a failed publish left behind: the temp file, and
    ``published``, a new name renamed into place."""
    for leftover in (temp, published):
        if leftover is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            if storage.kind(leftover) is not FileKind.MISSING:
                storage.remove(leftover)
    with contextlib.suppress(OSError):
        storage.sync_directory()


def publish_pointers(
    storage: Storage,
    catalog: Catalog,
    pointers: Pointers,
    *,
    token: str,
    policy: Policy,
    symlinks: bool = True,
    latest: bool = True,
) -> bool:
    """Replace the pointer symlinks and ``latest.json`` with ``pointers``.

    Each symlink is created under a temp name and renamed over the old one; ``latest.json``
    is published like a checkpoint (``latest=False``: removed instead — a rollback to a
    directory that had none). Returns whether symlinks could be used (a filesystem without
    them keeps only ``latest.json``).
    """
    for pointer in PointerName:
        target = pointers.target(pointer)
        try:
            if target is NO_CHECKPOINT:
                if storage.kind(pointer.value) is FileKind.SYMLINK:
                    storage.remove(pointer.value)
                continue
            if not symlinks:
                continue
            if (
                storage.kind(pointer.value) is FileKind.SYMLINK
                and storage.read_link(pointer.value) == target
            ):
                continue
            temp = temp_name(pointer.value, token)
            try:
                storage.symlink(target, temp)
            except OSError as exc:
                if exc.errno not in _NO_SYMLINKS:
                    raise
                symlinks = False
                log.warning("%s: symlinks unsupported; pointers go to latest.json only", storage)
                continue
            try:
                storage.replace(temp, pointer.value)
            except BaseException:
                with contextlib.suppress(OSError):
                    storage.remove(temp)
                raise
        except OSError as exc:
            raise SaveError(
                f"could not point {storage.path(pointer.value)} at {target}: {exc}"
            ) from exc

    if not latest:
        try:
            if storage.kind(LATEST_JSON) is not FileKind.MISSING:
                storage.remove(LATEST_JSON)
                storage.sync_directory()
        except OSError as exc:
            raise SaveError(f"could not remove {storage.path(LATEST_JSON)}: {exc}") from exc
        return symlinks
    contents = json.dumps(latest_json(catalog, pointers, policy), indent=2) + "\n"
    publish_file(storage, LATEST_JSON, token, lambda f, _: f.write(contents.encode("utf-8")))
    return symlinks


class PublishedInterrupted(KeyboardInterrupt):
    """A Ctrl-C that landed once a save and its pointers were published. It is a
    :class:`KeyboardInterrupt` to the user; the save that raises it is done (its caller records
    it as published)."""


class RetentionInterrupted(PublishedInterrupted):
    """A Ctrl-C that landed in a save's retention — after the save and its pointers were
    published; the next save's retention deletes what is left."""


def delete_checkpoints(
    storage: Storage, names: Iterable[str], deleted: list[str] | None = None
) -> list[str]:
    """Delete the checkpoints ``names`` (retention's plan), then fsync the directory.

    A deletion that fails is logged, not raised: the checkpoint stays and the next save's
    retention plans it again. Returns the names actually deleted, appended to ``deleted`` (if
    given) as each goes, so that a caller interrupted part-way (``KeyboardInterrupt``) knows
    which are gone — the one in progress included, if the interrupt came just after it went.
    """
    deleted = [] if deleted is None else deleted
    for name in names:
        try:
            remove_checkpoint(storage, name)
            deleted.append(name)
        except OSError as exc:
            log.warning("retention could not delete %s: %s", storage.path(name), exc)
        except BaseException:
            if _gone(storage, name):
                deleted.append(name)
            raise
    if deleted:
        with contextlib.suppress(OSError):
            storage.sync_directory()
    return deleted


def _gone(storage: Storage, name: str) -> bool:
    """Whether ``name`` is no checkpoint any more: removed (a sharded one retired to a temp
    name), or a sharded directory without its manifest (what remains of it is not listed)."""
    with contextlib.suppress(OSError, ValueError):
        kind = storage.kind(name)
        if kind is FileKind.DIRECTORY and not isinstance(storage, RemoteStorage):
            return not (storage.path(name) / MANIFEST_NAME).exists()
        return kind is FileKind.MISSING
    return False


def remove_checkpoint(storage: Storage, name: str) -> None:
    """Remove the checkpoint ``name``: a file, or a sharded checkpoint's directory (manifest
    first). One already gone is no error. The caller fsyncs the directory."""
    with contextlib.suppress(FileNotFoundError):
        if isinstance(storage, RemoteStorage):  # its commit object first, then its data
            storage.remove(name)
        elif storage.kind(name) is FileKind.DIRECTORY:
            delete_sharded(storage, name)
        else:
            storage.remove(name)


def delete_sharded(storage: Storage, name: str) -> None:
    """Delete the sharded checkpoint ``name``: first retired out of the catalog by one atomic
    rename to a temp name (fsynced: from then on it is no checkpoint, and a reader sees it whole
    or not at all), then its files. A crash part-way leaves a temp directory the next open
    removes. ``name`` already a temp name (one moved aside) is removed as it is."""
    retired = name
    if classify(name) is EntryKind.CHECKPOINT:
        retired = temp_name(name, f"retired{secrets.token_hex(4)}")
        storage.replace(name, retired)
        storage.sync_directory()
    try:
        shutil.rmtree(storage.path(retired))
    except OSError as exc:
        if retired == name:
            raise
        log.warning(
            "could not remove %s, the retired %s (the directory's next open removes it): %s",
            storage.path(retired),
            storage.path(name),
            exc,
        )
    storage.sync_directory()
