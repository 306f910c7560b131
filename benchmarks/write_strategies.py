"""How to write a large checkpoint durably: where the checksum goes, and how many writer threads.

Writes the same bytes (``--mib`` of random float32, in 2 MiB ``write`` calls, as
``fileformat.write`` does) to a fresh file and fsyncs it, several ways:

* ``write+fsync``: no checksum — the floor;
* ``crc before each write``: CRC-32 of each chunk on the writing thread, then the write;
* ``crc beside each write``: a helper thread checksums each chunk while the main thread writes
  it (what ``fileformat.write`` did at first);
* ``crc during fsync, N threads``: write everything, then start the fsync on a helper thread
  and checksum on N threads (8 MiB pieces, ``pitstop.shell.format.checksums``) while it runs, then
  write a 4 KiB tail and fsync again (what ``fileformat.write`` does now, with its manifest);
* ``pwrite, N threads``: the floor again, the file cut into N parts written by N threads with
  ``os.pwrite`` — whether more writer threads reach the disk faster.

Every candidate writes a fresh file; after each run the file is dropped from the page cache
(``POSIX_FADV_DONTNEED``, untimed) and removed. The candidates take turns and the order rotates
from one round to the next, so that the disk's noise hits all alike; each figure is the median of
``--repeats`` runs after one warm-up round. No timing is asserted anywhere.

    .venv/bin/python benchmarks/write_strategies.py --mib 1024 --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pitstop.shell.format import checksums

CHUNK = 2 << 20
TAIL = bytes(4096)


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[i : i + CHUNK] for i in range(0, view.nbytes, CHUNK)]


@contextlib.contextmanager
def _fresh(path: Path) -> Iterator[int]:
    """A new file's descriptor, closed after the block."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    for chunk in _chunks(view):
        while chunk.nbytes:
            chunk = chunk[os.write(fd, chunk) :]


def floor(view: memoryview, path: Path) -> None:
    with _fresh(path) as fd:
        _write_all(fd, view)
        os.fsync(fd)


def crc_before(view: memoryview, path: Path) -> None:
    with _fresh(path) as fd:
        crc = 0
        for chunk in _chunks(view):
            crc = zlib.crc32(chunk, crc)
            _write_all(fd, chunk)
        os.fsync(fd)


def crc_beside(view: memoryview, path: Path) -> None:
    with _fresh(path) as fd, checksums.Checksummer(1) as pool:
        for chunk in _chunks(view):
            job = pool.start(chunk)
            _write_all(fd, chunk)
            job.result()  # one chunk at a time, as the helper thread did
        os.fsync(fd)


def crc_during_fsync(threads: int) -> Callable[[memoryview, Path], None]:
    def run(view: memoryview, path: Path) -> None:
        with _fresh(path) as fd:
            _write_all(fd, view)
            syncing = threading.Thread(target=os.fsync, args=(fd,))
            syncing.start()
            try:
                with checksums.Checksummer(threads) as pool:
                    pool.start(view).result()
            finally:
                syncing.join()
            _write_all(fd, memoryview(TAIL))
            os.fsync(fd)

    return run


def pwrite_threads(threads: int) -> Callable[[memoryview, Path], None]:
    def run(view: memoryview, path: Path) -> None:
        part = -(-view.nbytes // threads // CHUNK) * CHUNK
        with _fresh(path) as fd:

            def write_part(start: int) -> None:
                for offset in range(start, min(start + part, view.nbytes), CHUNK):
                    os.pwrite(fd, view[offset : min(offset + CHUNK, start + part)], offset)

            workers = [
                threading.Thread(target=write_part, args=(start,))
                for start in range(0, view.nbytes, part)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            os.fsync(fd)

    return run


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    path.unlink()


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes to write, in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", default="1,2,4", help="thread counts to try, e.g. 1,2,4")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    counts = sorted({int(n) for n in args.threads.split(",") if n.strip()})
    if args.mib < 1 or args.repeats < 1 or not counts or counts[0] < 1:
        parser.error("--mib, --repeats and every --threads count must be >= 1")

    tensor = torch.randn(args.mib << 18, generator=torch.Generator().manual_seed(0))
    view = memoryview((ctypes.c_ubyte * (args.mib << 20)).from_address(tensor.data_ptr()))
    candidates: dict[str, Callable[[memoryview, Path], None]] = {
        "write+fsync": floor,
        "crc before each write": crc_before,
        "crc beside each write": crc_beside,
    }
    for n in counts:
        candidates[f"crc during fsync, {n} thread(s)"] = crc_during_fsync(n)
    for n in counts:
        if n > 1:
            candidates[f"pwrite, {n} threads"] = pwrite_threads(n)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pitstop-write-") as tmp:
        order = list(candidates)
        for round_ in range(args.repeats + 1):
            turn = round_ % len(order)
            for name in order[turn:] + order[:turn]:
                path = Path(tmp) / "bench.bin"
                start = time.perf_counter()
                candidates[name](view, path)
                seconds = time.perf_counter() - start
                _drop(path)
                if round_:  # the first round warms up
                    times[name].append(seconds)

    print(
        f"# {args.mib} MiB, median of {args.repeats}; Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, zlib {zlib.ZLIB_RUNTIME_VERSION}"
    )
    print()
    print("| strategy | seconds | GiB/s | x write+fsync |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times["write+fsync"])
    rows = []
    for name, runs in times.items():
        seconds = statistics.median(runs)
        print(
            f"| {name} | {seconds:.3f} | {args.mib / 1024 / seconds:.2f} | {seconds / base:.2f} |"
        )
        rows.append({"strategy": name, "seconds": seconds, "ratio": seconds / base})
    if args.json is not None:
        args.json.write_text(json.dumps({"mib": args.mib, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
