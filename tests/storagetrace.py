"""A Storage that records every operation, and a checker of the durable-publish order.

``RecordingStorage`` wraps another Storage (normally a ``LocalStorage``) and appends one ``Op``
per step to ``ops``: ``create``, ``write`` (each write to a file it created), ``sync_file``,
``close``, ``replace``, ``symlink``, ``remove``, ``sync_directory``. ``drop`` names sync calls to
skip (neither done nor recorded), so a test can prove that ``durability_problems`` notices each
missing fsync.

``durability_problems(ops)`` says what in a trace breaks the publish guarantees
(docs/guarantees.md): a file is renamed into place only once every byte written to it is
fsynced and it is closed; a rename is followed by a directory fsync before the call ends; a
pointer (``last``/``best``/``final``, ``latest.json``) moves only after the new checkpoint's
rename is durable; a checkpoint is deleted only after every rename before it is durable, and no
pointer moves after a deletion.

``OsSpy`` records each ``os.fsync`` and ``os.replace`` below every Storage; ``StuckLeftovers``
fails chosen renames and every removal, so a failed publish leaves its temp entries behind.
"""

from __future__ import annotations

import errno
import functools
import io
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, cast

from pitstop.core.naming import TEMP_PREFIX, EntryKind, classify
from pitstop.shell.store.storage import FileKind, LocalStorage, Storage


class Op(NamedTuple):
    """One storage operation: ``kind`` on ``name`` (and ``target`` for replace and symlink).

    ``sync_directory`` names the entry whose change it follows (the last one renamed or
    removed), so a test can drop "the directory fsync after the rename of X".
    """

    kind: str
    name: str = ""
    target: str = ""


def final_name(name: str) -> str:
    """The name a temp file or temp symlink is published as (``.tmp-<token>-<name>``)."""
    if not name.startswith(TEMP_PREFIX):
        return name
    return name[len(TEMP_PREFIX) :].split("-", 1)[1]


class _RecordingFile(io.RawIOBase):
    """A file created by RecordingStorage: each write and the close are recorded."""

    def __init__(self, inner: BinaryIO, name: str, ops: list[Op]) -> None:
        super().__init__()
        self.inner, self.name_in_directory, self._ops = inner, name, ops

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.inner.seekable()

    def write(self, data: Any) -> int:
        self._ops.append(Op("write", self.name_in_directory))
        return self.inner.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def fileno(self) -> int:
        return self.inner.fileno()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes first
            self._ops.append(Op("close", self.name_in_directory))
            self.inner.close()


class RecordingStorage:
    """``inner`` with every operation recorded in ``ops``; syncs for which ``drop(op)`` is true
    are skipped."""

    def __init__(
        self,
        inner: Storage,
        ops: list[Op] | None = None,
        drop: Callable[[Op], bool] | None = None,
    ) -> None:
        self.inner = inner
        self.ops: list[Op] = [] if ops is None else ops
        self.drop = drop if drop is not None else (lambda op: False)
        self._last_change = ""

    def __repr__(self) -> str:
        return f"RecordingStorage({self.inner!r})"

    # What only reads is passed through unrecorded.
    def path(self, name: str) -> Path:
        return self.inner.path(name)

    def names(self) -> list[str]:
        return self.inner.names()

    def kind(self, name: str) -> FileKind:
        return self.inner.kind(name)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def read_link(self, name: str) -> str:
        return self.inner.read_link(name)

    def read_bytes(self, name: str, limit: int) -> bytes:
        return self.inner.read_bytes(name, limit)

    # What changes the directory or makes it durable is recorded.
    def create_exclusive(self, name: str) -> BinaryIO:
        file = self.inner.create_exclusive(name)
        self.ops.append(Op("create", name))
        return cast(BinaryIO, _RecordingFile(file, name, self.ops))

    def sync_file(self, file: BinaryIO) -> None:
        recording = cast(_RecordingFile, file)
        op = Op("sync_file", recording.name_in_directory)
        if self.drop(op):
            return
        self.inner.sync_file(recording.inner)
        self.ops.append(op)

    def replace(self, source: str, target: str) -> None:
        self.inner.replace(source, target)
        self.ops.append(Op("replace", source, target))
        self._last_change = target

    def sync_directory(self) -> None:
        op = Op("sync_directory", self._last_change)
        if self.drop(op):
            return
        self.inner.sync_directory()
        self.ops.append(op)

    def symlink(self, target: str, name: str) -> None:
        self.inner.symlink(target, name)
        self.ops.append(Op("symlink", name, target))

    def remove(self, name: str) -> None:
        self.inner.remove(name)
        self.ops.append(Op("remove", name))
        self._last_change = name


def recording_local_storage(ops: list[Op]) -> Callable[..., RecordingStorage]:
    """A stand-in for the ``LocalStorage`` class that records into ``ops``."""

    def make(root: Any, **options: Any) -> RecordingStorage:
        return RecordingStorage(LocalStorage(root, **options), ops)

    return make


def _is_pointer(name: str) -> bool:
    return classify(name) in {EntryKind.POINTER, EntryKind.LATEST_JSON}


def _is_checkpoint(name: str) -> bool:
    return classify(name) is EntryKind.CHECKPOINT


def durability_problems(ops: Iterable[Op]) -> list[str]:
    """Everything in the trace ``ops`` (one save or one file write) that breaks the publish
    order; empty when it is durable."""
    problems: list[str] = []
    created: set[str] = set()
    unsynced_bytes: set[str] = set()  # written to since their last fsync (or never fsynced)
    still_open: set[str] = set()
    unsynced_entries: list[str] = []  # renamed into place since the last directory fsync
    deleted: list[str] = []
    for op in ops:
        if op.kind == "create":
            created.add(op.name)
            unsynced_bytes.add(op.name)
            still_open.add(op.name)
        elif op.kind == "write":
            unsynced_bytes.add(op.name)
        elif op.kind == "sync_file":
            unsynced_bytes.discard(op.name)
        elif op.kind == "close":
            still_open.discard(op.name)
        elif op.kind == "sync_directory":
            unsynced_entries.clear()
        elif op.kind in {"replace", "remove"}:
            entry = op.target if op.kind == "replace" else op.name
            source = op.name if op.kind == "replace" else ""
            if source in created:
                if source in unsynced_bytes:
                    problems.append(f"{entry} renamed into place before its data was fsynced")
                if source in still_open:
                    problems.append(f"{entry} renamed into place while still open")
            if op.kind == "remove" and entry.startswith(TEMP_PREFIX):
                continue  # a failed step's leftover, not an entry of the directory
            if _is_pointer(entry):
                problems += [
                    f"pointer {entry} moved before the rename of {pending} was durable"
                    for pending in unsynced_entries
                    if _is_checkpoint(pending)
                ]
                problems += [f"pointer {entry} moved after {gone} was deleted" for gone in deleted]
            if op.kind == "remove" and _is_checkpoint(entry):
                problems += [
                    f"{entry} deleted before the rename of {pending} was durable"
                    for pending in unsynced_entries
                ]
                deleted.append(entry)
                continue  # a deletion need not be durable: retention plans it again
            unsynced_entries.append(entry)
    problems += [f"the rename of {entry} was never made durable" for entry in unsynced_entries]
    return problems


def phases(ops: Sequence[Op]) -> list[tuple[str, str]]:
    """The trace as ``(kind, final name)`` steps, consecutive writes to a file as one and a
    sync that more writes to the same file follow (an early sync) left out."""
    steps: list[tuple[str, str]] = []
    for index, op in enumerate(ops):
        name = final_name(op.target if op.kind == "replace" else op.name)
        if op.kind == "sync_directory":
            name = ""
        later = ops[index + 1 :]
        if op.kind == "sync_file" and any(o == Op("write", op.name) for o in later):
            continue
        if steps and steps[-1] == (op.kind, name) and op.kind == "write":
            continue
        steps.append((op.kind, name))
    return steps


class OsSpy:
    """Records, below every Storage, each ``os.fsync`` (the inode it synced, and its size then)
    and each ``os.replace`` (the inode renamed, and where to), through ``monkeypatch``; from
    any thread (DCP's writer threads, pitstop's fsync helper)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.synced_size: dict[int, int] = {}  # inode -> its size at its last fsync
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            status = os.fstat(fd)
            self.calls.append(("fsync", status.st_ino))
            self.synced_size[status.st_ino] = status.st_size
            real_fsync(fd)

        def replace(source: Any, target: Any, **options: Any) -> None:
            inode = os.lstat(source).st_ino
            real_replace(source, target, **options)
            self.calls.append(("replace", inode, Path(target)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def problems(self, path: Path) -> list[str]:
        """What is not durable about the last rename onto ``path``."""
        renames = [i for i, c in enumerate(self.calls) if c[0] == "replace" and c[2] == path]
        if not renames:
            return [f"{path} was never renamed into place"]
        index = renames[-1]
        inode = self.calls[index][1]
        problems = []
        if ("fsync", inode) not in self.calls[:index]:
            problems.append(f"{path}: its data was not fsynced before the rename")
        if ("fsync", os.stat(path.parent).st_ino) not in self.calls[index + 1 :]:
            problems.append(f"{path.parent}: the directory was not fsynced after the rename")
        return problems


class StuckLeftovers:
    """Through ``monkeypatch``: while ``armed``, every ``os.replace`` onto a name in ``onto``
    fails with EIO, and nothing can be removed (``os.unlink`` and ``os.rmdir`` fail too), so a
    failed publish cannot take its temp entries out again."""

    def __init__(self, monkeypatch: Any, *onto: str) -> None:
        self.armed = True
        replace, unlink, rmdir = os.replace, os.unlink, os.rmdir

        def stuck(real: Callable[..., None], *args: Any, **options: Any) -> None:
            if self.armed and (real is not replace or os.path.basename(args[1]) in onto):
                raise OSError(errno.EIO, "injected fault", args[0])
            real(*args, **options)

        monkeypatch.setattr(os, "replace", functools.partial(stuck, replace))
        monkeypatch.setattr(os, "unlink", functools.partial(stuck, unlink))
        monkeypatch.setattr(os, "rmdir", functools.partial(stuck, rmdir))
