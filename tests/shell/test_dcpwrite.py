"""The file table of a sharded save comes from CRCs taken as DCP writes
(pitstop.shell.sharded.dcpwrite).

A small FSDP2 model (DTensor parameters, AdamW state: tensors and byte values) is saved in
one process on a 1-rank gloo group, with write_sharded and with async_write_sharded. Checked:
every file the table lists — DCP's `.metadata` included — has the size and CRC-32 of its bytes
on disk, and the table was made without reading any file back; a save through the
Checkpointer fsyncs every file whole, the directory before its rename and the parent after,
before a pointer moves. The streams themselves: a
seek, an unknown call or a failed write leaves a file unnoted (and the table re-reads it), a
rename moves a note, a removal drops it.
"""

from __future__ import annotations

import array
import errno
import os
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import pitstop
from onerank import NEEDS_GLOO, sharded_model
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardedLayout, sharded_name
from pitstop.errors import SaveError
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sharded import dcpwrite
from pitstop.shell.sharded.dcpio import DCP_METADATA, Writer, own_failure
from pitstop.shell.sharded.dcpwrite import CrcFileSystem
from pitstop.shell.sharded.engine import async_write_sharded, make_stager, write_sharded
from pitstop.shell.store import sharddir
from storagetrace import OsSpy

pytestmark = NEEDS_GLOO


def on_disk(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, zlib.crc32(p.read_bytes())) for p in directory.iterdir()}


def no_reread(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> tuple[int, int]:
        raise AssertionError("the file table read a file back")

    monkeypatch.setattr(sharddir, "_crc_file", refuse)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_the_table_holds_each_files_size_and_crc_on_disk_without_a_reread(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    model, optimizer = sharded_model()
    temp = tmp_path / "temp"
    no_reread(monkeypatch)
    layout: ShardedLayout
    if how == "sync":
        layout = write_sharded(temp, model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    else:
        pending = async_write_sharded(
            temp,
            model,
            {"optimizer": optimizer},
            ranks=Ranks(0, 1),
            group=group,
            stager=make_stager(model),
        )
        layout = pending.result(timeout=120)
    table = {f.name: (f.size, f.crc32) for f in layout.files}
    assert table == on_disk(temp)
    assert DCP_METADATA in table
    assert {f.rank for f in layout.files} == {0}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpointer_save_makes_every_file_and_name_durable_before_a_pointer_moves(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Through the public Checkpointer (in the background too, published by ``ckpt.wait()``):
    every file of the published directory (DCP's and the manifest) was fsynced with all its
    bytes; the directory itself was fsynced (the names of its files) before it was renamed
    into place, and its parent after, before ``last`` moved."""
    spy = OsSpy(monkeypatch)
    model, optimizer = sharded_model()
    root = tmp_path / "checkpoints"
    state = {"optimizer": optimizer}
    with pitstop.Checkpointer(root, model=model, state=state, async_save=async_save) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
        ckpt.wait()
    published = root / sharded_name(1)
    files = sorted(published.iterdir())
    assert {f.name for f in files} >= {MANIFEST_NAME, DCP_METADATA, "__0_0.distcp"}
    for file in files:
        status = file.stat()
        assert spy.synced_size.get(status.st_ino) == status.st_size, file.name
    assert spy.problems(published) == []  # fsynced before its rename, the parent after
    renamed = [i for i, c in enumerate(spy.calls) if c[0] == "replace" and c[2] == published]
    parent = os.stat(root).st_ino
    synced = next(i for i, c in enumerate(spy.calls) if i > renamed[-1] and c == ("fsync", parent))
    moved = [i for i, c in enumerate(spy.calls) if c[0] == "replace" and c[2] == root / "last"]
    assert moved, spy.calls
    assert moved[0] > synced  # the pointer moved once the rename was durable


def test_the_writer_hands_rank_0_every_file_dcp_wrote_and_its_rider(
    group: Any, tmp_path: Path
) -> None:
    """One process, rank 0: the table DCP's results carried to the writer's ``finish`` lists
    every file in the directory (``.metadata`` too) with its size and CRC-32 as on disk, the
    rider came with it, and DCP's metadata holds none of it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model, optimizer = sharded_model()
    (tmp_path / "d").mkdir()
    writer = Writer(tmp_path / "d", rider=lambda: {"rng": 7})
    metadata = save({"o": get_optimizer_state_dict(model, optimizer)}, storage_writer=writer)
    (files,) = writer.ranks_files
    assert (files.rank, files.rider) == (0, {"rng": 7})
    assert {f.name: (f.size, f.crc32) for f in files.table} == on_disk(tmp_path / "d")
    assert DCP_METADATA in on_disk(tmp_path / "d")
    assert not [i.fqn for i in metadata.storage_data if i.fqn.startswith("pitstop")]
    assert writer.failure is None


def test_a_rider_that_fails_is_this_rank_s_write_failure(group: Any, tmp_path: Path) -> None:
    """The rider raises: DCP's write fails (on every rank) with that rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model, optimizer = sharded_model()
    (tmp_path / "d").mkdir()

    def rider() -> None:
        raise OSError("no part")

    writer = Writer(tmp_path / "d", rider=rider)
    with pytest.raises(CheckpointException) as caught:
        save({"o": get_optimizer_state_dict(model, optimizer)}, storage_writer=writer)
    assert own_failure(caught.value, 0, writer) is writer.failure
    assert isinstance(writer.failure, OSError)
    assert not writer.ranks_files
    elsewhere = own_failure(caught.value, 1, writer)  # as rank 1 would raise it
    assert isinstance(elsewhere, SaveError)
    assert str(elsewhere) == "rank 0: OSError: no part"


# --- the streams ----------------------------------------------------------------------------------


def test_a_stream_notes_what_was_written(tmp_path: Path) -> None:
    fs = CrcFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"head")
        assert stream.tell() == 4
        stream.write(memoryview(array.array("f", range(6))))  # 24 bytes, not of format B
        stream.close()  # as DCP closes its data files, inside the block
    assert fs.written(tmp_path) == on_disk(tmp_path) == {"a": (28, on_disk(tmp_path)["a"][1])}


@pytest.mark.parametrize("call", ["seek", "writelines", "truncate"])
def test_a_stream_that_did_anything_else_is_not_noted_and_is_reread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    spy = OsSpy(monkeypatch)
    fs = CrcFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"0123456789")
        if call == "seek":  # 10 + 4 + 6 bytes written, the file 20 long, the position 20
            stream.seek(8)
            stream.write(b"abcd")
            stream.seek(14)
            stream.write(b"efghij")
        elif call == "writelines":
            stream.writelines([b"ab"])
        else:
            stream.flush()
            stream.truncate(3)
    assert fs.written(tmp_path) == {}
    (entry,) = sharddir.file_table(tmp_path, ["a"], 0, fs.written(tmp_path))
    assert (entry.size, entry.crc32) == on_disk(tmp_path)["a"]
    status = (tmp_path / "a").stat()
    assert spy.synced_size[status.st_ino] == status.st_size  # fsynced whole all the same,
    assert spy.calls.count(("fsync", status.st_ino)) == 1  # once: by the table, as it reads


def test_a_failed_write_leaves_no_note(tmp_path: Path) -> None:
    fs = CrcFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"first")
    assert "a" in fs.written(tmp_path)

    def fail() -> None:
        with fs.create_stream(tmp_path / "a", "wb") as stream:
            stream.write(b"second")
            raise RuntimeError("DCP failed")

    with pytest.raises(RuntimeError, match="DCP failed"):
        fail()
    assert fs.written(tmp_path) == {}


def test_a_write_that_raises_leaves_no_note_even_when_the_caller_goes_on(tmp_path: Path) -> None:
    fs = CrcFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"kept")
        with pytest.raises((BufferError, TypeError, ValueError)):
            stream.write(memoryview(b"not contiguous")[::2])
        stream.write(b"more")
    assert fs.written(tmp_path) == {}


def test_a_rename_moves_the_note_and_a_removal_drops_it(tmp_path: Path) -> None:
    fs = CrcFileSystem()
    with fs.create_stream(tmp_path / "x.tmp", "wb") as stream:
        stream.write(b"metadata")
    fs.rename(tmp_path / "x.tmp", tmp_path / "x")
    assert fs.written(tmp_path) == on_disk(tmp_path) == {"x": (8, zlib.crc32(b"metadata"))}
    fs.rm_file(tmp_path / "x")
    assert fs.written(tmp_path) == {}


def test_the_table_mixes_noted_and_reread_files(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"written elsewhere")
    noted = {"noted": (3, zlib.crc32(b"abc"))}
    (tmp_path / "noted").write_bytes(b"abc")
    table = sharddir.file_table(tmp_path, ["noted", "plain"], 1, noted)
    assert {f.name: (f.size, f.crc32) for f in table} == on_disk(tmp_path)
    assert {f.rank for f in table} == {1}


class FullDisk:
    """A data file on a disk with room for ``room`` more bytes: the real file's ``write``
    writes what fits, then raises ENOSPC, as write(2) does; everything else is the file's."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > self.room:
            if self.room:
                self.file.write(view[: self.room])
                self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= view.nbytes
        return int(self.file.write(view))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


@pytest.mark.parametrize("room", [0, 700])
def test_a_full_disk_is_named(
    group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """A data file's write fails with ENOSPC after ``room`` bytes (torch.save's zip writer
    then fails with "unexpected pos ..."): the SaveError says the disk is full, and where."""
    model, optimizer = sharded_model()
    real = dcpwrite._CrcStream.__init__

    def init(stream: Any, file: Any, *args: Any) -> None:
        full = Path(file.name).suffix == ".distcp"
        real(stream, FullDisk(file, room) if full else file, *args)

    monkeypatch.setattr(dcpwrite._CrcStream, "__init__", init)
    with pytest.raises(SaveError) as caught:
        write_sharded(tmp_path / "temp", model, {"optimizer": optimizer}, ranks=Ranks(0, 1))
    message = str(caught.value)
    assert "no space left on the device (ENOSPC) writing " in message, message
    assert str(tmp_path / "temp" / "__0_0.distcp") in message, message
