"""How fast the checksum candidates are, and what checksumming costs a checkpoint write.

Measures, on one in-memory buffer of random bytes:

* the stdlib checksum candidates: ``zlib.crc32`` (whole buffer and 2 MiB chunks),
  ``zlib.adler32``, and ``hashlib`` md5 / sha1 / sha256 / blake2b for scale;
* ``zlib.crc32`` over 2 MiB chunks in 2 and 4 threads (it releases the GIL on large buffers);
* pitstop's own CRC-32 (``pitstop.shell.format.checksums``: ISA-L's where the ``isal`` package is
  installed, else zlib's), in one call and on its pool;
* writing the buffer to a file in 2 MiB chunks (no fsync, so page-cache speed): without a
  checksum, with the CRC computed before each write, with the CRC computed in a helper
  thread beside each write (what ``pitstop.shell.format.fileformat.write`` did at first), and with
  the whole write first and then the CRC on ``pitstop.shell.format.checksums``' thread pool, in
  8 MiB pieces joined by ``crc32_combine`` (what it does now; with an fsync to wait for, the
  checksums run while it does, which this CPU-only measurement leaves out);
* ``fileformat`` itself: prepare + write, ``verify``, and ``load`` (mmap + blob CRC check) of
  one uint8 tensor of the buffer's size.

It prints the best of ``--repeats`` runs as GB/s (10^9 bytes per second). No timing is asserted.

Usage::

    .venv/bin/python benchmarks/checksum_speed.py [--mib 512] [--repeats 5] [--dir /tmp]
                                                  [--json results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

with warnings.catch_warnings():  # torch warns when numpy is absent; it is not needed here
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch

from pitstop.shell.format import checksums, fileformat

CHUNK = 2 << 20  # the chunk size fileformat.write uses


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _chunks(view: memoryview) -> list[memoryview]:
    return [view[i : i + CHUNK] for i in range(0, view.nbytes, CHUNK)]


def _crc_chunks(view: memoryview) -> int:
    crc = 0
    for chunk in _chunks(view):
        crc = zlib.crc32(chunk, crc)
    return crc


def _crc_threads(view: memoryview, threads: int) -> list[int]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(zlib.crc32, _chunks(view)))


def _write(view: memoryview, path: Path, mode: str) -> int:
    crc = 0
    with open(path, "wb") as file:
        if mode == "after":
            for chunk in _chunks(view):
                file.write(chunk)
            crc = checksums.crc32(view)
        elif mode == "beside":
            with ThreadPoolExecutor(1) as pool:
                for chunk in _chunks(view):
                    pending = pool.submit(zlib.crc32, chunk, crc)
                    file.write(chunk)
                    crc = pending.result()
        else:
            for chunk in _chunks(view):
                if mode == "before":
                    crc = zlib.crc32(chunk, crc)
                file.write(chunk)
    path.unlink()
    return crc


def _pitstop_write(tensor: torch.Tensor, path: Path, *, keep: bool = False) -> None:
    with open(path, "wb") as file:
        fileformat.write(file, fileformat.prepare({"x": tensor}), {})
    if not keep:  # like _write: truncating a big file on the next open would be timed too
        path.unlink()


def _pitstop_load(path: Path) -> None:
    tree = fileformat.load(path)
    assert isinstance(tree, dict)


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="buffer size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the test files go")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)

    size = args.mib << 20
    data = os.urandom(size)
    view = memoryview(data)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        target = Path(tmp) / "bench.bin"
        checkpoint = Path(tmp) / "bench.pitstop"
        cases: dict[str, Callable[[], object]] = {
            "zlib.crc32 (one call)": lambda: zlib.crc32(view),
            "zlib.crc32 (2 MiB chunks)": lambda: _crc_chunks(view),
            "zlib.crc32 (2 MiB chunks, 2 threads)": lambda: _crc_threads(view, 2),
            "zlib.crc32 (2 MiB chunks, 4 threads)": lambda: _crc_threads(view, 4),
            f"pitstop crc32_update ({checksums.ENGINE}, one call)": lambda: checksums.crc32_update(
                view
            ),
            f"pitstop crc32 ({checksums.ENGINE}, the pool)": lambda: checksums.crc32(view),
            "zlib.adler32": lambda: zlib.adler32(view),
            "hashlib.md5": lambda: hashlib.md5(view).digest(),
            "hashlib.sha1": lambda: hashlib.sha1(view).digest(),
            "hashlib.sha256": lambda: hashlib.sha256(view).digest(),
            "hashlib.blake2b": lambda: hashlib.blake2b(view).digest(),
            "write, no checksum": lambda: _write(view, target, "none"),
            "write, crc32 before each write": lambda: _write(view, target, "before"),
            "write, crc32 beside each write": lambda: _write(view, target, "beside"),
            "write, then crc32 on the pool": lambda: _write(view, target, "after"),
            "fileformat prepare+write": lambda: _pitstop_write(tensor, checkpoint),
        }
        reads: dict[str, Callable[[], object]] = {
            "fileformat verify": lambda: fileformat.verify(checkpoint),
            "fileformat load (verify=True)": lambda: _pitstop_load(checkpoint),
        }
        for name, run in cases.items():
            results[name] = size / _best_seconds(run, args.repeats) / 1e9
        _pitstop_write(tensor, checkpoint, keep=True)
        for name, run in reads.items():
            results[name] = size / _best_seconds(run, args.repeats) / 1e9

    print(
        f"# {args.mib} MiB, best of {args.repeats}; zlib {zlib.ZLIB_RUNTIME_VERSION}, "
        f"pitstop's CRC-32: {checksums.ENGINE}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    width = max(map(len, results))
    for name, rate in results.items():
        print(f"{name:<{width}}  {rate:6.2f} GB/s")
    if args.json is not None:
        args.json.write_text(json.dumps({"mib": args.mib, "gb_per_s": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
