"""A Storage that simulates power loss: what was not made durable may be lost, torn or garbled.

``CrashStorage`` is a Storage over a real directory (what the running process sees: its page
cache) that also logs, per operation, what a disk would have to persist: each write (inode,
offset, bytes), each directory operation (create, rename, symlink, remove) and each fsync. A
crash at event ``k`` (``crash_state``) keeps everything made durable before ``k`` — a file's
writes once it was fsynced, the directory's operations once the directory was fsynced — and
decides the fate of everything else, one pending operation at a time:

* a write is dropped, kept, torn (only the part before a 512-byte sector boundary reaches the
  disk) or garbled (one 512-byte sector of it holds noise);
* a directory operation is dropped or kept, independently of the others (a rename may persist
  without the creation of its source's name: the inode it moves is known).

``reorderings(k0, k1)`` enumerates every state a crash inside the epoch ``[k0, k1)`` can leave
when everything before ``k0`` persisted and the epoch's operations reached the disk in any
order, cut at any point (ALICE's model), deduplicated. ``materialize`` writes a state into a
real directory, where the real readers (scan, resume, verify) check it.
"""

from __future__ import annotations

import io
import itertools
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple, cast

from pitstop.shell.store.storage import FileKind, LocalStorage

SECTOR = 512

WriteFate = Literal["drop", "keep", "tear", "garble"]
DirFate = Literal["drop", "keep"]
WRITE_FATES: tuple[WriteFate, ...] = ("drop", "keep", "tear", "garble")
DIR_FATES: tuple[DirFate, ...] = ("drop", "keep")


class Event(NamedTuple):
    """One logged operation. ``kind``: write, sync_file, create, replace, symlink, remove,
    sync_dir. ``inode`` for writes, creates and syncs; ``name``/``target`` for directory ops."""

    kind: str
    inode: int = -1
    offset: int = 0
    data: bytes = b""
    name: str = ""
    target: str = ""


Entry = tuple[str, Any]  # ("file", inode) or ("link", target)
State = dict[str, tuple[str, bytes | str]]  # name -> ("file", bytes) or ("link", target)


class _File(io.RawIOBase):
    def __init__(self, inner: BinaryIO, storage: CrashStorage, inode: int) -> None:
        super().__init__()
        self.inner, self.storage, self.inode, self.position = inner, storage, inode, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        written = self.inner.write(chunk)
        assert written == len(chunk)
        self.storage.events.append(Event("write", self.inode, self.position, chunk))
        self.position += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = self.inner.seek(offset, whence)
        return self.position

    def tell(self) -> int:
        return self.position

    def fileno(self) -> int:
        return self.inner.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.inner.close()


class CrashStorage(LocalStorage):
    """A local directory whose every durable-relevant operation is logged in ``events``.

    fsyncs are logged, not performed (the live directory is only what the process sees).
    ``fail`` (optional) is called with each operation's name before it runs and may raise, so
    the same storage can inject faults too.
    """

    def __init__(self, root: Path, fail: Callable[[str, str], None] | None = None) -> None:
        super().__init__(root)
        self.events: list[Event] = []
        self.inodes: dict[str, int] = {}  # live name -> inode of a file created here
        self._next = 0
        self.fail = fail or (lambda op, name: None)
        # What the directory already holds is durable: the baseline every replay starts from.
        self.base_names: dict[str, Entry] = {}
        self.base_data: dict[int, bytearray] = {}
        for index, name in enumerate(self.names()):
            kind = self.kind(name)
            if kind is FileKind.SYMLINK:
                self.base_names[name] = ("link", self.read_link(name))
            elif kind is FileKind.REGULAR and name != ".lock":
                inode = -2 - index
                self.base_names[name] = ("file", inode)
                self.base_data[inode] = bytearray(self.path(name).read_bytes())
                self.inodes[name] = inode

    def create_exclusive(self, name: str) -> BinaryIO:
        self.fail("create", name)
        file = super().create_exclusive(name)
        inode = self._next
        self._next += 1
        self.inodes[name] = inode
        self.events.append(Event("create", inode, name=name))
        return cast(BinaryIO, _File(file, self, inode))

    def sync_file(self, file: BinaryIO) -> None:
        crash_file = cast(_File, file)
        self.fail("sync_file", "")
        self.events.append(Event("sync_file", crash_file.inode))

    def sync_directory(self) -> None:
        self.fail("sync_directory", "")
        self.events.append(Event("sync_dir"))

    def replace(self, source: str, target: str) -> None:
        self.fail("replace", target)
        kind = self.kind(source)
        link = self.read_link(source) if kind is FileKind.SYMLINK else ""
        super().replace(source, target)
        inode = self.inodes.pop(source, -1)
        if inode >= 0:
            self.inodes[target] = inode
        self.events.append(Event("replace", inode, name=source, target=target, data=link.encode()))

    def symlink(self, target: str, name: str) -> None:
        self.fail("symlink", name)
        super().symlink(target, name)
        self.events.append(Event("symlink", name=name, target=target))

    def remove(self, name: str) -> None:
        self.fail("remove", name)
        super().remove(name)
        self.inodes.pop(name, None)
        self.events.append(Event("remove", name=name))


# --- replaying the log ------------------------------------------------------------------------


class Replay(NamedTuple):
    names: dict[str, Entry]  # durable directory entries
    data: dict[int, bytearray]  # durable file contents
    pending_dir: list[int]  # event indices of directory operations not yet durable
    pending_writes: list[int]  # event indices of writes not yet durable


def _apply_dir(names: dict[str, Entry], event: Event) -> None:
    if event.kind == "create":
        names[event.name] = ("file", event.inode)
    elif event.kind == "symlink":
        names[event.name] = ("link", event.target)
    elif event.kind == "remove":
        names.pop(event.name, None)
    elif event.kind == "replace":
        moved = names.pop(event.name, None)
        if moved is None:  # the source's own creation did not persist; the inode is known
            moved = ("file", event.inode) if event.inode >= 0 else ("link", event.data.decode())
        names[event.target] = moved
    else:  # pragma: no cover - a bug in this module
        raise AssertionError(event)


def _apply_write(data: dict[int, bytearray], event: Event, chunk: bytes | None = None) -> None:
    body = event.data if chunk is None else chunk
    content = data.setdefault(event.inode, bytearray())
    end = event.offset + len(body)
    if len(content) < end:
        content.extend(bytes(end - len(content)))
    content[event.offset : end] = body


def replay(
    events: Sequence[Event], k: int, base: tuple[dict[str, Entry], dict[int, bytearray]] = ({}, {})
) -> Replay:
    """What is durable after the first ``k`` events, and what is pending (over ``base``: the
    names and contents durable before the first event)."""
    names: dict[str, Entry] = dict(base[0])
    data: dict[int, bytearray] = {inode: bytearray(c) for inode, c in base[1].items()}
    pending_dir: list[int] = []
    pending_writes: list[int] = []
    for index, event in enumerate(events[:k]):
        if event.kind == "write":
            pending_writes.append(index)
        elif event.kind == "sync_file":
            synced = [i for i in pending_writes if events[i].inode == event.inode]
            for i in synced:
                _apply_write(data, events[i])
            pending_writes = [i for i in pending_writes if events[i].inode != event.inode]
        elif event.kind == "sync_dir":
            for i in pending_dir:
                _apply_dir(names, events[i])
            pending_dir = []
        else:
            pending_dir.append(index)
    return Replay(names, data, pending_dir, pending_writes)


def _written(event: Event, fate: WriteFate, rng: random.Random) -> bytes | None:
    """What of a pending write reaches the disk: None (dropped) or the bytes at its offset."""
    if fate == "drop":
        return None
    if fate == "keep":
        return event.data
    start, stop = event.offset, event.offset + len(event.data)
    boundaries = list(range((start // SECTOR + 1) * SECTOR, stop, SECTOR))
    if fate == "tear":
        if not boundaries:
            return None
        return event.data[: rng.choice(boundaries) - start]
    sectors = [start, *boundaries]
    first = rng.choice(sectors)
    last = min(stop, (first // SECTOR + 1) * SECTOR)
    noisy = bytearray(event.data)
    noise = rng.randbytes(last - first)
    if noise == bytes(noisy[first - start : last - start]):  # noise that changes nothing
        noise = bytes(b ^ 0xFF for b in noise)
    noisy[first - start : last - start] = noise
    return bytes(noisy)


def _state(names: Mapping[str, Entry], data: Mapping[int, bytearray]) -> State:
    out: State = {}
    for name, (kind, value) in names.items():
        out[name] = ("link", value) if kind == "link" else ("file", bytes(data.get(value, b"")))
    return out


def crash_state(
    events: Sequence[Event],
    k: int,
    rng: random.Random,
    write_fate: Callable[[Event], WriteFate] | None = None,
    dir_fate: Callable[[Event], DirFate] | None = None,
    baseline: tuple[dict[str, Entry], dict[int, bytearray]] = ({}, {}),
) -> State:
    """The directory a power loss just before event ``k`` leaves (random fates by default)."""
    base = replay(events, k, baseline)
    names = dict(base.names)
    data = {inode: bytearray(content) for inode, content in base.data.items()}
    pick_write = write_fate or (lambda e: rng.choice(WRITE_FATES))
    pick_dir = dir_fate or (lambda e: rng.choice(DIR_FATES))
    for index in sorted([*base.pending_dir, *base.pending_writes]):
        event = events[index]
        if event.kind == "write":
            chunk = _written(event, pick_write(event), rng)
            if chunk is not None:
                _apply_write(data, event, chunk)
        elif pick_dir(event) == "keep":
            _apply_dir(names, event)
    return _state(names, data)


def epochs(events: Sequence[Event]) -> list[tuple[int, int]]:
    """The fsync epochs of ``events``: ``[k0, k1)`` spans between consecutive syncs."""
    cuts = [i + 1 for i, e in enumerate(events) if e.kind in {"sync_file", "sync_dir"}]
    starts = [0, *cuts]
    return [(a, b) for a, b in itertools.pairwise([*starts, len(events)]) if b > a]


def reorderings(events: Sequence[Event], k0: int, k1: int) -> Iterator[State]:
    """Every distinct state of a crash inside the epoch ``[k0, k1)``: all that came before
    persisted in order, and any subset of the epoch's operations persisted in any order."""
    names: dict[str, Entry] = {}
    data: dict[int, bytearray] = {}
    for event in events[:k0]:
        if event.kind == "write":
            _apply_write(data, event)
        elif event.kind not in {"sync_file", "sync_dir"}:
            _apply_dir(names, event)
    ops = [i for i in range(k0, k1) if events[i].kind not in {"sync_file", "sync_dir"}]
    seen_states: set[tuple[tuple[str, tuple[str, bytes | str]], ...]] = set()
    seen_nodes: set[tuple[frozenset[int], tuple[tuple[str, tuple[str, bytes | str]], ...]]] = set()

    def key(state: State) -> tuple[tuple[str, tuple[str, bytes | str]], ...]:
        return tuple(sorted(state.items()))

    def visit(
        done: frozenset[int], names: dict[str, Entry], data: dict[int, bytearray]
    ) -> Iterator[State]:
        state = _state(names, data)
        node = (done, key(state))
        if node in seen_nodes:
            return
        seen_nodes.add(node)
        if node[1] not in seen_states:
            seen_states.add(node[1])
            yield state
        for index in ops:
            if index in done:
                continue
            event = events[index]
            next_names = dict(names)
            next_data = {i: bytearray(c) for i, c in data.items()}
            if event.kind == "write":
                _apply_write(next_data, event)
            else:
                _apply_dir(next_names, event)
            yield from visit(done | {index}, next_names, next_data)

    yield from visit(frozenset(), names, data)


def materialize(state: State, root: Path) -> Path:
    """Write ``state`` into the new directory ``root``; return it."""
    root.mkdir(parents=True)
    for name, (kind, value) in state.items():
        if kind == "link":
            os.symlink(cast(str, value), root / name)
        else:
            (root / name).write_bytes(cast(bytes, value))
    return root
