"""Parallel CRC-32: combining pieces gives zlib's CRC of the whole, on any number of threads."""

from __future__ import annotations

import errno
import importlib.util
import os
import platform
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dirtools import save, snapshot
from pitstop.core.records import Policy
from pitstop.errors import SaveError
from pitstop.shell.format import checksums, fileformat, filewrite
from pitstop.shell.format.checksums import PIECE, Checksummer, crc32, crc32_combine, crc32_update
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import LocalStorage


@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 0xFFFFFFFF))
def test_combine_equals_the_crc_of_the_concatenation(a: bytes, b: bytes, start: int) -> None:
    assert crc32_combine(zlib.crc32(a, start), zlib.crc32(b), len(b)) == zlib.crc32(a + b, start)


@given(st.integers(0, 1 << 40), st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF))
def test_combine_is_associative_over_long_lengths(n: int, c1: int, c2: int) -> None:
    # (A+B)+C == A+(B+C) for any lengths, with B's CRC c2 and C all zero bytes of length n.
    zero = zlib.crc32(bytes(1000))
    left = crc32_combine(crc32_combine(c1, c2, n), zero, 1000)
    right = crc32_combine(c1, crc32_combine(c2, zero, 1000), n + 1000)
    assert left == right


@given(st.binary(max_size=5000), st.integers(0, 0xFFFFFFFF), st.integers(0, 64))
def test_the_fast_crc_is_zlibs(data: bytes, start: int, skip: int) -> None:
    view = memoryview(data)[skip:]
    assert crc32_update(view, start) == zlib.crc32(view, start)
    assert crc32_update(view) == zlib.crc32(view)


def test_the_fast_crc_is_used_where_isal_is_installed() -> None:
    # pitstop depends on it on x86-64 and arm64; elsewhere the standard library's zlib is used.
    wheels = platform.machine() in {"x86_64", "AMD64", "aarch64", "arm64"}
    expected = "isal" if wheels or importlib.util.find_spec("isal") is not None else "zlib"
    assert expected == checksums.ENGINE


def test_files_written_with_one_crc_engine_verify_with_the_other(tmp_path: Path) -> None:
    # Without isal (its import blocked), a process falls back on zlib: its files verify here,
    # and this process's files verify there.
    state = {"w": torch.arange(3 * PIECE // 4 + 5, dtype=torch.float32)}
    here = tmp_path / "here.pitstop"
    with here.open("wb") as file:
        fileformat.write(file, fileformat.prepare(state), {})
    there = tmp_path / "there.pitstop"
    script = (
        "import sys; sys.modules['isal'] = None\n"
        "import torch\n"
        "from pitstop.shell.format import checksums, fileformat\n"
        "assert checksums.ENGINE == 'zlib', checksums.ENGINE\n"
        f"fileformat.verify({str(here)!r})\n"
        f"w = torch.arange({3 * PIECE // 4 + 5}, dtype=torch.float32)\n"
        f"with open({str(there)!r}, 'wb') as f:\n"
        "    fileformat.write(f, fileformat.prepare({'w': w}), {})\n"
        "print('zlib ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "zlib ok"
    fileformat.verify(there)
    loaded = fileformat.load(there)
    assert isinstance(loaded, dict)
    assert torch.equal(loaded["w"], state["w"])
    assert there.read_bytes() == here.read_bytes()


def test_combine_rejects_a_negative_length() -> None:
    with pytest.raises(ValueError, match="length2"):
        crc32_combine(0, 0, -1)


def _data(nbytes: int) -> memoryview:
    generator = torch.Generator().manual_seed(nbytes)
    tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return memoryview(tensor.numpy()).cast("B")


@pytest.mark.parametrize("threads", [0, 1, 3])
@pytest.mark.parametrize("nbytes", [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345])
def test_pool_crc_equals_zlib(threads: int, nbytes: int) -> None:
    view = _data(nbytes)
    with Checksummer(threads) as pool:
        jobs = [pool.start(view), pool.start(view[nbytes // 3 :])]
        assert jobs[0].result() == zlib.crc32(view)
        assert jobs[1].result() == zlib.crc32(view[nbytes // 3 :])
    assert crc32(view, threads) == zlib.crc32(view)


def test_an_error_in_a_piece_is_raised_by_result() -> None:
    strided = memoryview(bytearray(3 * PIECE))[::2]  # zlib refuses non-contiguous buffers
    with Checksummer(2) as pool:
        job = pool.start(strided)
        with pytest.raises(BufferError):
            job.result()


def test_leaving_the_block_on_an_error_ends_every_thread() -> None:
    view = _data(4 * PIECE)

    def start_then_fail() -> None:
        with Checksummer(2) as pool:
            for _ in range(20):
                pool.start(view)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        start_then_fail()
    assert not [t for t in threading.enumerate() if t.name.startswith("pitstop-crc")]


def test_negative_thread_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="threads"):
        Checksummer(-1)


# --- in the file writer -----------------------------------------------------------------------


def _big_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(1 << 19, generator=generator) for i in range(5)}  # 10 MiB


def test_a_large_file_is_synced_once_after_its_data_and_reads_back(tmp_path: Path) -> None:
    prepared = fileformat.prepare(_big_state())
    path = tmp_path / "f.pitstop"
    sizes: list[int] = []
    with open(path, "wb") as file:
        written = fileformat.write(
            file, prepared, {}, sync=lambda: sizes.append(os.fstat(file.fileno()).st_size)
        )
    assert sizes == [prepared.data_end]  # after the data, before the manifest
    assert written == path.stat().st_size
    fileformat.verify(path)
    loaded = fileformat.load(path)
    assert isinstance(loaded, dict)
    for key, tensor in _big_state().items():
        assert torch.equal(loaded[key], tensor)


def test_a_small_file_is_not_synced_early(tmp_path: Path) -> None:
    calls: list[int] = []
    with open(tmp_path / "f.pitstop", "wb") as file:
        fileformat.write(
            file, fileformat.prepare({"x": torch.ones(4)}), {}, sync=lambda: calls.append(1)
        )
    assert calls == []


def test_device_chunks_are_checksummed_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    # The path for tensors off the CPU, run on a CPU tensor with small host copies.
    monkeypatch.setattr(filewrite, "_DEVICE_CHUNK", PIECE + 4096)
    tensor = torch.randn(3 * PIECE // 4 + 1000)
    prepared = fileformat.prepare({"x": tensor})
    (span,) = prepared.spans
    raw = filewrite._raw_bytes(tensor, span)

    class Buffer:
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, chunk: memoryview) -> int:
            self.data += chunk
            return chunk.nbytes

    buffer = Buffer()
    sink = filewrite._Sink(buffer)  # type: ignore[arg-type]
    with Checksummer(2) as pool:
        crc = filewrite._write_from_device(sink, raw, span, pool)
    expected = bytes(memoryview(tensor.numpy()).cast("B"))
    assert bytes(buffer.data) == expected
    assert crc == zlib.crc32(expected)


class _FailingSync(LocalStorage):
    """Fails the first fsync of a checkpoint file that is still being written."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.armed = False

    def sync_file(self, file: BinaryIO) -> None:
        if self.armed and os.fstat(file.fileno()).st_size == self.data_end:
            self.armed = False
            raise OSError(errno.EIO, "injected fault in the early fsync")
        super().sync_file(file)

    data_end = -1


def test_a_failed_early_sync_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    storage = _FailingSync(tmp_path)
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=1), storage=storage) as directory:
        save(directory, 1, tree=_big_state())
        before = snapshot(tmp_path)
        storage.data_end = fileformat.prepare(_big_state()).data_end
        storage.armed = True
        with pytest.raises(SaveError, match="injected fault in the early fsync"):
            save(directory, 2, tree=_big_state())
        assert not storage.armed, "the early fsync should have run"
        assert snapshot(tmp_path) == before


def test_default_threads_is_within_bounds() -> None:
    assert 1 <= checksums.default_threads() <= 8


def test_a_pool_whose_threads_cannot_start_computes_in_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_start = threading.Thread.start
    calls: list[str] = []

    def start(self: threading.Thread) -> None:
        calls.append(self.name)
        if len(calls) == 3:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    view = _data(3 * PIECE + 1)
    with Checksummer(4) as pool:
        # The two threads that did start were ended before the pool computed anything.
        assert not [t for t in threading.enumerate() if t.name.startswith("pitstop-crc")]
        assert pool.start(view).result() == zlib.crc32(view)
    assert calls == ["pitstop-crc-0", "pitstop-crc-1", "pitstop-crc-2"]


def test_an_interrupt_while_starting_threads_ends_them_and_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_start = threading.Thread.start
    calls: list[str] = []

    def start(self: threading.Thread) -> None:
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        Checksummer(3)
    assert not [t for t in threading.enumerate() if t.name.startswith("pitstop-crc")]


def test_a_large_file_is_written_without_new_threads_when_none_can_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python >= 3.12 refuses new threads at interpreter exit, when a Checkpointer left open
    # still publishes its last save: the writer then checksums and syncs on its own thread.
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    prepared = fileformat.prepare(_big_state())
    path = tmp_path / "f.pitstop"
    synced: list[int] = []
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with open(path, "wb") as file:
        fileformat.write(
            file, prepared, {}, sync=lambda: synced.append(os.fstat(file.fileno()).st_size)
        )
    monkeypatch.undo()
    assert synced == [prepared.data_end]
    fileformat.verify(path)
