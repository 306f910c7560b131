"""Reading onto a device: every copy out of a bounce buffer lands before the buffer is read into
again, and before the pass returns or raises.

No GPU here, so the pass runs against a stand-in for CUDA's copies that carries each copy out
only when it is waited for (a stream may run it that late): a pass that reuses a buffer too
early copies the wrong chunk, one that returns without waiting leaves the memory unwritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import blobread
from pitstop.shell.format import fileformat as ff

DEVICE = torch.device("cuda", 0)  # only a name here: the stand-in allocates on the CPU
UNWRITTEN = 0xA5


class _Late:
    """Copies to one device, each carried out only once it (or one after it) is waited for."""

    made: ClassVar[list[_Late]] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        _Late.made.append(self)

    def bounce(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_target(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), UNWRITTEN, dtype=torch.uint8)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> _Landed:
        self.queued.append((target, source))  # the source is read when the copy runs
        return _Landed(self, len(self.queued))

    def run_until(self, count: int) -> None:
        while self.done < count:  # in order, as on one stream
            target, source = self.queued[self.done]
            target.copy_(source)
            self.done += 1

    def drain(self) -> None:
        self.run_until(len(self.queued))


class _Landed:
    def __init__(self, copies: _Late, count: int) -> None:
        self.copies, self.count = copies, count

    def synchronize(self) -> None:
        self.copies.run_until(self.count)


@pytest.fixture(autouse=True, params=[0, 2], ids=["crc-inline", "crc-on-2-threads"])
def late_copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks (many per blob, more than there are bounce buffers), the stand-in copies,
    and the CRCs inline or on a pool."""
    threads: int = request.param
    monkeypatch.setattr(blobread, "CHUNK", 4096)
    monkeypatch.setattr(blobread, "device_copies", _Late)
    monkeypatch.setattr(blobread, "default_threads", lambda: threads)
    _Late.made = []


def _file(tmp_path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    tree = {
        "big": torch.randn(10_000, generator=generator),  # 10 chunks
        "small": torch.randn(7, generator=generator),
        "mapped": torch.randn(3_000, generator=generator),
        "other": torch.randn(6_000, generator=generator),
        "empty": torch.empty(0),
    }
    path = tmp_path / "state.pitstop"
    with open(path, "wb") as file:
        ff.write(file, ff.prepare(tree), {})
    return path


def _blob(manifest: ff.Manifest, key: str) -> int:
    return manifest.tensors[manifest.tensor_paths.index((key,))].blob


def _read(path: Path, places: dict[int, torch.device]) -> dict[int, torch.UntypedStorage]:
    manifest = ff.read_manifest(path)
    with open(path, "rb") as file:
        return blobread.read_blobs(file, manifest, range(len(manifest.blobs)), places=places)


def test_every_chunk_lands_on_the_device_before_the_pass_returns(tmp_path: Path) -> None:
    path = _file(tmp_path)
    manifest = ff.read_manifest(path)
    raw = path.read_bytes()
    on_device = [_blob(manifest, k) for k in ("big", "small", "other", "empty")]
    places = dict.fromkeys(on_device, DEVICE)

    storages = _read(path, places)

    assert sorted(storages) == sorted(on_device)
    for index in on_device:
        blob = manifest.blobs[index]
        got = bytes(torch.empty(0, dtype=torch.uint8).set_(storages[index]).numpy())
        assert got == raw[blob.offset : blob.stop], f"blob {index}"
    assert [c.done for c in _Late.made] == [len(c.queued) for c in _Late.made]
    assert sum(len(c.queued) for c in _Late.made) > 2 * blobread.BOUNCE  # buffers reused


def test_a_torn_blob_raises_only_once_every_copy_is_done(tmp_path: Path) -> None:
    path = _file(tmp_path)
    manifest = ff.read_manifest(path)
    torn = manifest.blobs[_blob(manifest, "other")]  # read after "big" went to the device
    raw = bytearray(path.read_bytes())
    raw[torn.offset + 5_000] ^= 0x01
    path.write_bytes(bytes(raw))
    places = {_blob(manifest, k): DEVICE for k in ("big", "small", "other")}

    with pytest.raises(CheckpointCorrupt, match="fails its checksum"):
        _read(path, places)

    (copies,) = _Late.made
    assert copies.queued, "no copy was started: the test would prove nothing"
    assert copies.done == len(copies.queued)  # none still writing into memory about to be freed
