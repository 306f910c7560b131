"""An open checkpoint file's reads, and a resume's bytes leaving the page cache behind it."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import pitstop
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import blobread
from pitstop.shell.format import fileformat as ff
from pitstop.shell.format.blobfile import BlobFile, byte_view, drop_cached
from pitstop.shell.format.hostmem import new_aligned_bytes
from pitstop.shell.resumeread import ResumeRead
from pitstop.shell.state.capture import LiveState

PAGE = mmap.PAGESIZE

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
    reason="reads the page cache's state with Linux's mincore",
)


def _resident(path: Path, start: int, stop: int) -> tuple[int, int]:
    """(pages in the page cache, pages) among the whole pages of bytes ``start..stop`` of
    ``path``, as mincore(2) sees them through a map of the file that touches none of them."""
    first, last = -(-start // PAGE) * PAGE, stop // PAGE * PAGE
    pages = max(0, (last - first) // PAGE)
    if not pages:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), last, access=mmap.ACCESS_COPY)
        try:
            window = (ctypes.c_char * last).from_buffer(mapped)
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.addressof(window) + first, last - first, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            del window
        finally:
            mapped.close()
    return sum(v & 1 for v in vector), pages


def _drop_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_file(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(1 << 20):
            pass


def _dropping_works(path: Path) -> bool:
    """Whether this filesystem lets a file's pages leave the cache (tmpfs keeps them)."""
    size = path.stat().st_size
    _drop_file(path)  # fsynced: only clean pages can go
    _read_file(path)
    with open(path, "rb") as file:
        drop_cached(file.fileno(), 0, size)
    cached, pages = _resident(path, 0, size)
    return cached <= pages // 4


WIDTH = 1448  # 8 MiB a weight, so each moment spans two of the pass's 4 MiB chunks
HUGE = 2 << 20  # the largest folio a page cache uses here


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def _trained() -> tuple[nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def _fresh() -> tuple[nn.Module, torch.optim.AdamW]:
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _cached(path: Path, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """(pages in the page cache, pages) over the whole pages of ``ranges`` of ``path``."""
    counts = [_resident(path, start, stop) for start, stop in ranges]
    return sum(c for c, _ in counts), sum(p for _, p in counts)


def _blob_ranges(path: Path, prefix: str) -> list[tuple[int, int]]:
    """The byte ranges of the blobs whose tensors' key paths start with ``prefix``."""
    manifest = ff.read_manifest(path)
    ranges = set()
    for tensor, key in zip(manifest.tensors, manifest.tensor_paths, strict=True):
        name = ".".join(str(k) for k in key)
        blob = manifest.blobs[tensor.blob]
        if name.startswith(prefix) and blob.length >= 4 * PAGE:
            ranges.add((blob.offset, blob.stop))
    assert ranges, f"{path} has no blob under {prefix}"
    return sorted(ranges)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, optimizer = _trained()
    with pitstop.Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        path = ckpt.save(pitstop.Progress(step=1)).path
    if not _dropping_works(path):
        pytest.skip(f"{tmp_path}'s filesystem keeps every page of a file in memory (tmpfs)")
    _drop_file(path)
    return path


def _direct_source(way: str, tmp_path: Path) -> Callable[[BlobFile], int | None] | None:
    """What BlobFile.open_direct gives in the test's ``way`` (``None``: the real one)."""
    if way == "through the cache":  # no O_DIRECT here (tmpfs, another OS)
        return lambda _: None
    if way == "refused":  # every read past the cache raises (a directory's descriptor)
        return lambda _: os.open(tmp_path, os.O_RDONLY)
    if way == "reads nothing":  # every read past the cache ends at once
        return lambda _: os.open(os.devnull, os.O_RDONLY)
    return None


@pytest.mark.parametrize(
    ("readers", "way"),
    [
        (1, "one reader"),
        (3, "past the cache"),
        (3, "through the cache"),
        (3, "refused"),
        (3, "reads nothing"),
    ],
)
def test_a_one_process_resume_leaves_only_the_weights_in_the_page_cache(
    saved: Path, readers: int, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The optimizer's moments are read into memory of their own, which the optimizer keeps:
    # past the page cache (O_DIRECT) where the pass runs on several threads and the
    # filesystem lets it, or through it, each chunk leaving the cache once it is read. The
    # weights are copied from the page cache into the model after the check, so they stay.
    monkeypatch.setattr(blobread, "default_threads", lambda: readers)
    source = _direct_source(way, saved.parent)
    if source is not None:
        monkeypatch.setattr(BlobFile, "open_direct", source)
    direct: list[tuple[bool, int]] = []  # (past the cache, bytes asked for) of each read
    read_direct = BlobFile.read_direct

    def spy(self: BlobFile, fd: int, view: memoryview, offset: int, need: int) -> None:
        direct.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), need))
        read_direct(self, fd, view, offset, need)

    monkeypatch.setattr(BlobFile, "read_direct", spy)
    model, optimizer = _fresh()
    with pitstop.Checkpointer(saved.parent, model=model, state={"optimizer": optimizer}) as c:
        assert c.resume() == pitstop.Progress(step=1)
    expected_model, expected_optimizer = _trained()
    for key, value in expected_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for param, expected in zip(model.parameters(), expected_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], expected_optimizer.state[expected][key])
    # A large folio that a moment shares with a neighbour the resume maps (a step count) stays
    # whole, and the drop is a hint: a page the kernel still reads ahead, or holds locked under
    # I/O on a loaded machine, stays (22% once in a loaded CI run, through the cache). Never most
    # of them: without the drop every one stays.
    moments = _blob_ranges(saved, "state.optimizer.state")
    cached, pages = _cached(saved, moments)
    assert cached <= pages // 2, f"{cached} of the moments' {pages} pages still cached"
    # The page where two chunks of a moment meet is in neither chunk whole (blobs are not
    # page-aligned): it goes with the whole moment, once that is read. The drop is a hint, and
    # a page the kernel is still reading ahead when it comes may stay (seen once in a loaded
    # run, 1 page of 4): one may stay, never most (without the drop, every one does).
    meets = [
        _resident(saved, meet // PAGE * PAGE, meet // PAGE * PAGE + PAGE)
        for start, stop in moments
        for meet in range(start + blobread.CHUNK, stop - HUGE, blobread.CHUNK)
    ]
    assert len(meets) >= 4
    assert all(pages == 1 for _, pages in meets)
    assert sum(cached for cached, _ in meets) <= 1, f"meet pages still cached: {meets}"
    cached, pages = _cached(saved, _blob_ranges(saved, "weights.raw"))
    assert cached == pages, f"only {cached} of the weights' {pages} pages cached"
    if way == "past the cache":  # every byte of every moment, from its first whole page on
        assert all(past for past, _ in direct)
        assert sum(n for _, n in direct) == sum(
            stop - start // PAGE * PAGE for start, stop in moments
        )
    elif way == "one reader":
        assert not direct


def test_with_more_ranks_the_moments_stay_cached_for_the_others(saved: Path) -> None:
    # Rank 0 chooses the checkpoint (reading it, checked); every other rank then reads the same
    # file: dropping behind would send each of them to the disk.
    model, optimizer = _fresh()
    live = LiveState(model=model, ema=None, components={"optimizer": optimizer}, config=None)
    ResumeRead(live, rank=0, world_size=2).verify(saved)
    cached, pages = _cached(saved, _blob_ranges(saved, "state.optimizer.state"))
    assert cached == pages, f"only {cached} of the moments' {pages} pages cached"


def test_a_read_fills_the_view_or_names_the_missing_bytes(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with pitstop.Checkpointer(tmp_path, model=model, state={"optimizer": optimizer}) as ckpt:
        path = ckpt.save(pitstop.Progress(step=1)).path
    manifest = ff.read_manifest(path)
    size = path.stat().st_size
    target = torch.zeros(100, dtype=torch.uint8)
    with open(path, "rb") as file:
        reader = BlobFile(file.fileno(), manifest, advance=None)
        reader.read_into(byte_view(target), 256)
        assert bytes(target.tolist()) == path.read_bytes()[256:356]
        stop = re.escape(f"{path}: the file ended early reading bytes {size}..{size + 44}")
        with pytest.raises(CheckpointCorrupt, match=stop):
            reader.read_into(byte_view(target), size - 56)


def test_drop_cached_lets_a_range_go_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"\x01" * (64 * PAGE))
    _drop_file(path)
    _read_file(path)
    assert _resident(path, 0, 64 * PAGE) == (64, 64)
    with open(path, "rb") as file:
        drop_cached(file.fileno(), 0, 64 * PAGE)
        closed = os.dup(file.fileno())
    os.close(closed)
    drop_cached(closed, 0, PAGE)  # a hint: a descriptor that cannot take it changes nothing
    cached, _ = _resident(path, 0, 64 * PAGE)
    if cached == 64:
        pytest.skip(f"{tmp_path}'s filesystem keeps every page of a file in memory (tmpfs)")
    assert cached == 0


@pytest.mark.parametrize("skew", [0, 64, PAGE - 1])
def test_aligned_memory_puts_the_first_byte_skew_bytes_into_a_page(skew: int) -> None:
    tensor, pages = new_aligned_bytes(3 * PAGE, skew)
    assert tensor.numel() == 3 * PAGE
    assert tensor.data_ptr() % PAGE == skew
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    assert whole.data_ptr() == tensor.data_ptr() - skew  # the view starts on the page
    assert whole.numel() % PAGE == 0
    assert whole.numel() >= skew + tensor.numel()
    tensor.fill_(7)  # the same memory, seen both ways
    assert int(whole[skew : skew + 3 * PAGE].sum()) == 7 * 3 * PAGE


@pytest.mark.parametrize("skew", [-1, PAGE])
def test_aligned_memory_refuses_a_skew_outside_a_page(skew: int) -> None:
    with pytest.raises(ValueError, match=f"skew must be within a page .*, got {skew}"):
        new_aligned_bytes(PAGE, skew)


def test_a_placed_blob_at_the_end_of_the_file_is_read_past_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last blob's last page runs past the end of the file: the read past the cache comes
    # back short there, which is no error as long as every byte of the blob is in.
    monkeypatch.setattr(blobread, "default_threads", lambda: 3)
    generator = torch.Generator().manual_seed(1)
    tree = {"small": torch.randn(10, generator=generator)}
    tree["big"] = torch.randn((3 << 20) // 4 + 3, generator=generator)  # just over 3 MiB
    path = tmp_path / "c.pitstop"
    with open(path, "wb") as file:
        ff.write(file, ff.prepare(tree), {})
    manifest = ff.read_manifest(path)
    last = max(manifest.blobs, key=lambda b: b.stop)
    assert manifest.blob_users(manifest.blobs.index(last)) == "big"
    assert path.stat().st_size < -(-last.stop // PAGE) * PAGE  # its last page is not all there
    cpu = torch.device("cpu")
    loaded = ff.load(path, place=lambda k: cpu if k == ("big",) else None, drop_placed=True)
    assert isinstance(loaded, dict)
    assert torch.equal(loaded["big"], tree["big"])
    assert torch.equal(loaded["small"], tree["small"])
