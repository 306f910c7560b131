"""One rank of tests/e2e/test_peer_copy.py: what a catch-up copy guards, between real processes.

* Waits far longer than a wait slice: pitstop's slices are made 1 ms here, and a copy of many
  chunks whose sender starts late still arrives whole (gloo closes a pair whose send or receive
  outlives a wait, so a point-to-point message is waited for in one piece).
* A byte flipped in transit: rank 0 speaks the copy's wire protocol itself (peers' header, the
  stream declined in the handshake, chunks on the group, trailer) and flips one byte of a chunk
  after its CRC-32 was taken — loopback TCP never flips one, so the test does; rank 1's
  receive_file raises the CRC mismatch, nothing is published and no temp file is left.
* A sender whose file changed on its disk after it was checked: its CRC-32 of the whole is of
  the changed bytes, so only the format's check of the received copy (before it is published)
  finds it; nothing is published.
* A checkpoint sent as a catch-up sends it (its manifest first, every chunk checked against it
  as it lands, no second read and no CRC-32 of the whole): over three chunks it arrives whole;
  a byte flipped in transit (the sender's reads flip it, after its own check) or on the
  sender's disk is caught by that check, naming the blob; nothing is published.
* Every copy takes the direct stream (the receiver says so) unless a side refuses it: the
  sender's node with streams off, or a receiver that cannot listen — then both take the
  group, agreed, and the copy arrives whole; a sender whose reads fail mid-stream ends both
  sides with its SaveError.
* A directory that caught up (each rank a directory of its own, rank 1's deleted before the
  resume) holds its pointers, as a save would leave them: the next open finds ``last``.

Prints ``ok <n>`` and exits 0, or raises.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import shutil
import sys
import zlib
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

import pitstop
from pitstop.core.ranks.stream import OFFER_BYTES
from pitstop.errors import SaveError
from pitstop.shell.format.fileread import load, read_manifest, verify
from pitstop.shell.format.filewrite import prepare, write
from pitstop.shell.ranks import arrival, collectives
from pitstop.shell.ranks.arrival import CheckedReads, tail_start
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.ranks.peers import send
from pitstop.shell.sharded.acrossnodes import receive_file, send_file
from pitstop.shell.store.directory import CheckpointDirectory

rank = int(os.environ["RANK"])
root = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
ranks = Ranks(rank, 2, group, timeout_s=60)
CHUNK = 8 << 20  # peers.CHUNK: receive_file uses it
checked = 0


def ahead(file: Any) -> dict[str, Any]:
    """How a catch-up sends a checkpoint ``file``: its manifest first, no CRC-32 of the whole."""
    return {
        "first": tail_start(file, os.fstat(file.fileno()).st_size),
        "crc": False,
        "stream": True,
    }


class Heard(logging.Handler):
    """The receiver's word on how each copy travelled (pitstop.transfer, INFO)."""

    said: ClassVar[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())

    @classmethod
    def last(cls) -> str:
        return cls.said[-1] if cls.said else "nothing said"


transfer_log = logging.getLogger("pitstop.transfer")
transfer_log.addHandler(Heard())
transfer_log.setLevel(logging.INFO)


# Waits far longer than a slice: the sender builds its copy only once rank 1 waits for it.
collectives.WAIT_SLICE_S = 0.001
source, target = root / "node0" / "long.bin", root / "node1" / "long.bin"
if rank == 0:
    source.parent.mkdir(parents=True)
    source.write_bytes(bytes(range(256)) * (3 * CHUNK // 256 + 1000))
    send_file(ranks, 1, source)
else:
    receive_file(ranks, 0, target)
    assert target.read_bytes() == bytes(range(256)) * (3 * CHUNK // 256 + 1000)
    assert Heard.last().endswith("over a direct stream"), Heard.last()
collectives.WAIT_SLICE_S = 1.0
checked += 1


def nothing_published(directory: Path, name: str, work: object) -> str:
    """Rank 1: the SaveError ``work()`` raises; ``directory`` holds no ``name`` and no temp."""
    before = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    try:
        work()  # type: ignore[operator]
    except SaveError as exc:
        after = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
        assert after == before, (before, after)
        assert name not in after, after
        return str(exc)
    raise AssertionError(f"receiving {name} raised no SaveError")


# A byte flipped in transit: rank 0 sends as peers.send does, one byte flipped after its CRC.
data = bytes((i * 31 + 7) % 256 for i in range(2 * CHUNK + 5))
if rank == 0:
    dist.send(torch.tensor([len(data), 0], dtype=torch.int64), 1, group=group)  # size, first
    dist.recv(torch.zeros(OFFER_BYTES, dtype=torch.uint8), 1, group=group)  # a stream offered,
    dist.send(torch.tensor([0], dtype=torch.int64), 1, group=group)  # not taken: the group
    dist.recv(torch.zeros(1, dtype=torch.int64), 1, group=group)  # the verdict
    for offset in range(0, len(data), CHUNK):
        part = torch.frombuffer(bytearray(data[offset : offset + CHUNK]), dtype=torch.uint8)
        if offset == CHUNK:
            part[1234] ^= 0x10
        dist.send(part, 1, group=group)
    dist.send(torch.tensor([zlib.crc32(data), 0], dtype=torch.int64), 1, group=group)
else:
    said = nothing_published(
        root / "node1", "flipped.bin", lambda: receive_file(ranks, 0, root / "node1/flipped.bin")
    )
    assert "CRC-32" in said, said
    assert "from rank 0" in said, said
checked += 1

# The sender's file changed on its disk after it was checked: the receiver's check finds it.
source, target = root / "node0" / "changed.pitstop", root / "node1" / "changed.pitstop"
if rank == 0:
    with open(source, "wb") as file:
        write(file, prepare({"w": torch.arange(100_000, dtype=torch.float32)}), {})
    verify(source)
    with open(source, "r+b") as file:  # one byte of the data region, after the check
        file.seek(1000)
        byte = file.read(1)
        file.seek(1000)
        file.write(bytes([byte[0] ^ 0x01]))
    send_file(ranks, 1, source)
else:
    said = nothing_published(
        target.parent, target.name, lambda: receive_file(ranks, 0, target, verify)
    )
    assert "changed.pitstop" in said, said
    print(said, flush=True)
checked += 1


# A checkpoint sent as a catch-up sends it (manifest first, checked as it lands: no CRC-32 of
# the whole): over three chunks, it arrives whole; a byte changed in transit (the sender's
# reads flip one, after its own check) or on the sender's disk is caught by the receiver's
# check against the file's own manifest as it arrives, and nothing is published.
class Flipping(io.FileIO):
    """A file whose reads flip the byte at ``at`` (what a bad link does to the copy)."""

    at = 0

    def readinto(self, buffer: Any) -> int:
        start = self.tell()
        got = super().readinto(buffer) or 0
        if start <= self.at < start + got:
            memoryview(buffer).cast("B")[self.at - start] ^= 0x20
        return got


tree = {"w": torch.arange(5 << 20, dtype=torch.float32), "b": torch.ones(100)}  # 3 chunks


def source_bytes(case: str) -> bytes:
    """Rank 1: the bytes rank 0 wrote for ``case`` (the directories are one disk here)."""
    return (root / "node0" / f"ckpt-{case}.pitstop").read_bytes()


for case in ("whole", "transit", "disk"):
    source = root / "node0" / f"ckpt-{case}.pitstop"
    target = root / "node1" / f"ckpt-{case}.pitstop"
    if rank == 0:
        with open(source, "wb") as file:
            write(file, prepare(tree), {})
        verify(source)
        if case == "transit":  # a byte of the data region past the first chunk, as it travels
            Flipping.at = CHUNK + 4321
            with Flipping(source, "rb") as flipping:
                send(ranks, 1, flipping, source.stat().st_size, str(source), **ahead(flipping))
        else:
            if case == "disk":  # one byte of the data region, after the check
                with open(source, "r+b") as file:
                    file.seek(2 * CHUNK + 99)
                    byte = file.read(1)
                    file.seek(2 * CHUNK + 99)
                    file.write(bytes([byte[0] ^ 0x01]))
            send_file(ranks, 1, source, checkpoint=True)
    elif case == "whole":
        receive_file(ranks, 0, target, checkpoint=True)
        verify(target)
        assert load(target, verify=False)["w"].equal(tree["w"])
        assert target.read_bytes() == source_bytes(case), "not bitwise the sender's copy"
    else:
        said = nothing_published(
            target.parent, target.name, partial(receive_file, ranks, 0, target, checkpoint=True)
        )
        assert "fails its checksum" in said, said  # the blob's CRC-32, as it landed
        assert "from rank 0" in said, said
        print(said, flush=True)
    if rank == 1:
        assert Heard.last().endswith("over a direct stream"), Heard.last()
    checked += 1

# The stream refused, by either side: both take the group, agreed, and the copy arrives whole.
# The sender's node turns streams off (it will not connect to the receiver's offer); the
# receiver's node cannot listen (an address that is not its own: nothing offered).
source = root / "node0" / "ckpt-whole.pitstop"
for case, who, name, value in (
    ("no connect", 0, "PITSTOP_PEER_STREAM", "0"),
    ("no listen", 1, "PITSTOP_PEER_ADDRESS", "192.0.2.1"),  # TEST-NET-1: never this host's
):
    target = root / "node1" / f"ckpt-{case.replace(' ', '-')}.pitstop"
    if rank == who:
        os.environ[name] = value
    if rank == 0:
        send_file(ranks, 1, source, checkpoint=True)
    else:
        receive_file(ranks, 0, target, checkpoint=True)
        assert target.read_bytes() == source_bytes("whole"), case
        assert Heard.last().endswith("pitstop's group (no stream agreed)"), (case, Heard.last())
    os.environ.pop(name, None)
    checked += 1


# A sender whose reads fail half-way, over the stream: both sides end with a clear error.
class Failing(io.FileIO):
    """A file whose reads fail once past byte ``at`` (a disk going bad under the sender)."""

    at = CHUNK + 77

    def readinto(self, buffer: Any) -> int:
        if self.tell() > self.at:
            raise OSError(5, "Input/output error (the test's)")
        return super().readinto(buffer) or 0


target = root / "node1" / "ckpt-failing.pitstop"
if rank == 0:
    with Failing(source, "rb") as failing:
        sent: SaveError | None = None
        try:
            send(ranks, 1, failing, source.stat().st_size, str(source), **ahead(failing))
        except SaveError as exc:
            sent = exc
        assert sent is not None, "a sender that could not read raised no SaveError"
        assert "could not send" in str(sent), sent
        assert "Input/output error" in str(sent), sent
else:
    said = nothing_published(
        target.parent, target.name, partial(receive_file, ranks, 0, target, checkpoint=True)
    )
    assert "rank 0 could not send" in said, said
    assert Heard.last().endswith("over a direct stream"), Heard.last()
checked += 1

# A catch-up sender whose copy cannot be opened (gone since it was listed) says so as its own
# copy's finding, not a failed copy; its receiver hears it and publishes nothing.
target = root / "node1" / "ckpt-gone.pitstop"
if rank == 0:
    found = arrival.send_checked(ranks, 1, root / "node0" / "ckpt-gone.pitstop")
    assert found is not None, "a sender without its file found nothing wrong"
    assert "ckpt-gone.pitstop" in found, found
else:
    said = nothing_published(
        target.parent, target.name, partial(receive_file, ranks, 0, target, checkpoint=True)
    )
    assert "rank 0 could not send" in said, said
checked += 1

# A directory that caught up gets its pointers, as a save would: the next open finds `last`.
node = root / f"run{rank}"  # a directory of each rank's own: the ranks share none
model = torch.nn.Linear(4, 4)
ckpt = pitstop.Checkpointer(node, model=model)
ckpt.save(pitstop.Progress(step=3))
ckpt.close()
dist.barrier()
if rank == 1:
    shutil.rmtree(node)  # a new machine
ckpt = pitstop.Checkpointer(node, model=model)
assert ckpt.resume() is not None
ckpt.close()
directory = CheckpointDirectory(node)
found = directory.open()
directory.close()
assert found.pointers.last == "step_000000000003.pitstop", found.pointers
assert not found.warnings, found.warnings  # not "pointer last is missing"
assert (node / "last").is_symlink()
assert (node / "latest.json").exists()
checked += 1


# A replaced node catches up at once, before any check; the sender checks its copy as it reads
# it for sending. Its newest copy is bad (a byte of the weights flipped on its disk): both
# sides find it (the sender as it reads, the receiver as it lands), nothing of it is published
# or loaded, and both fall back to the checkpoint before it, copied the same way.
def weights_at(step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(step)
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()}


def newest_blob(path: Path) -> int:
    """The file offset of a byte inside the first blob of the checkpoint ``path``."""
    manifest = read_manifest(path)
    return manifest.blobs[manifest.tensors[0].blob].offset + 1


node = root / f"later{rank}"
ckpt = pitstop.Checkpointer(node, model=model)
for step in (3, 5):
    model.load_state_dict(weights_at(step))
    ckpt.save(pitstop.Progress(step=step))
ckpt.close()
newest = node / "step_000000000005.pitstop"
dist.barrier()
if rank == 1:
    shutil.rmtree(node)  # a new machine
else:  # rank 0's newest copy goes bad on its disk
    data = bytearray(newest.read_bytes())
    data[newest_blob(newest)] ^= 0x01
    newest.write_bytes(bytes(data))
with torch.no_grad():
    model.weight.fill_(7.0)
ckpt = pitstop.Checkpointer(node, model=model)
resumed = ckpt.resume()
ckpt.close()
assert resumed.step == 3, resumed  # the bad newest copy skipped on both nodes
for key, value in weights_at(3).items():
    assert model.state_dict()[key].equal(value), key
if rank == 1:
    assert sorted(p.name for p in node.glob("*.pitstop")) == ["step_000000000003.pitstop"]
    assert not list(node.glob(".pitstop-*")), list(node.iterdir())  # no temp file left
    assert Heard.last().endswith("over a direct stream"), Heard.last()
checked += 1


# The same copy changed on its way (the sender's reads flip a byte after its own check: a bad
# link): the receiver's check finds it before anything is published or loaded, and the copy's
# error is raised on every rank; the live state is untouched.
class FlippedAfterCheck(CheckedReads):
    """The sender's checked reads, one byte flipped after the check (at ``at``)."""

    flip = 0

    def readinto(self, buffer: Any) -> int:
        start = self.at
        got = super().readinto(buffer)
        if start <= self.flip < start + got:
            memoryview(buffer).cast("B")[self.flip - start] ^= 0x20
        return got


if rank == 1:
    shutil.rmtree(node)
else:
    newest.unlink()  # step 3 is the newest now, whole on rank 0's node
    FlippedAfterCheck.flip = newest_blob(node / "step_000000000003.pitstop")
    arrival.CheckedReads = FlippedAfterCheck  # type: ignore[misc]
with torch.no_grad():
    model.weight.fill_(7.0)
ckpt = pitstop.Checkpointer(node, model=model)
failed: SaveError | None = None
try:
    ckpt.resume()
except SaveError as exc:
    failed = exc
finally:
    ckpt.close()
    arrival.CheckedReads = CheckedReads  # type: ignore[misc]
assert failed is not None, "a copy changed on its way was resumed"
for named in ("from rank 0", "fails its checksum"):  # the receiver's finding, on both ranks
    assert named in str(failed), failed
assert bool((model.weight == 7.0).all()), "the live state was touched"
if rank == 1:
    assert not list(node.glob("*.pitstop")), list(node.iterdir())  # nothing published
checked += 1

dist.barrier()
print(f"ok {checked}", flush=True)
dist.destroy_process_group()
os._exit(0)
