"""Save and load speed of one checkpoint file, against torch.save/torch.load and the disk.

One process, one state (~64 float32 tensors), side by side:

* save to durable: pitstop (prepare + write + fsync + rename + directory fsync), ``torch.save``
  then fsync, and the physical limit — ``write`` of the same tensor bytes then ``fsync``
  (the ratios' base), and the same with write-behind (every 2 MiB handed to the kernel's
  writeback as it is written, ``pitstop.shell.format.writebehind``: what pitstop's save does), which
  is faster than the plain limit because the disk starts before the last byte is written;
* load, every page touched, from a cold page cache (the file's pages are dropped with
  ``posix_fadvise(DONTNEED)`` first): ``pitstop.load`` (memory-mapped), ``torch.load``
  (``weights_only=True``, ``mmap=False``), and the limit — ``readinto`` of the whole file into a
  buffer allocated beforehand.

Each figure is the median of ``--repeats`` runs after one warm-up, the candidates taking turns
so that the disk's noise hits all of them alike; ratios are to the limit.

    .venv/bin/python benchmarks/save_load.py --size-mib 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pitstop.core.metadata import entry_meta
from pitstop.core.records import CheckpointEntry, Progress, SaveReason
from pitstop.shell.format import checksums, fileformat
from pitstop.shell.format.writebehind import KICK, WriteBehind
from pitstop.shell.store.publish import publish_file
from pitstop.shell.store.storage import LocalStorage

PAGE = os.sysconf("SC_PAGE_SIZE")


def make_state(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of about ``total_bytes`` in all, with random contents."""
    per = total_bytes // count // 4
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.randn(per, generator=generator) for i in range(count)}


def drop_cache(path: Path) -> None:
    """Evict ``path``'s (clean) pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def touch(tensors: object) -> int:
    """Read one byte of every page of every tensor in ``tensors``."""
    total = 0
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            flat = item.reshape(-1).view(torch.uint8)
            total += int(flat[::PAGE].sum())
        elif isinstance(item, dict):
            stack.extend(item.values())
    return total


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Step = tuple[Callable[[], object], Callable[[], object]]  # (untimed setup, timed work)


def timed_round_robin(steps: dict[str, Step], repeats: int) -> dict[str, float]:
    """Median seconds of each step's work, the steps taking turns so disk noise hits all alike."""
    for setup, work in steps.values():
        setup()
        work()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (setup, work) in steps.items():
            setup()
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    state = make_state(args.size_mib << 20, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(args.dir or tempfile.mkdtemp(prefix="pitstop-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    storage = LocalStorage(root)
    entry = CheckpointEntry(progress=Progress(step=1), seq=1, reason=SaveReason.MANUAL)
    pitstop_file, torch_file, raw_file, behind_file = (
        root / entry.name,
        root / "torch_state.pt",
        root / "raw.bin",
        root / "behind.bin",
    )

    def pitstop_save() -> None:
        prepared = fileformat.prepare(state)
        publish_file(
            storage,
            entry.name,
            "bench",
            lambda f, sync: fileformat.write(f, prepared, entry_meta(entry), sync=sync),
        )

    def torch_save() -> None:
        torch.save(state, torch_file)
        fsync_path(torch_file)

    def raw_write() -> None:
        fd = os.open(raw_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for tensor in state.values():
                view = memoryview(tensor.numpy()).cast("B")
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written : written + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_write_behind() -> None:
        fd = os.open(behind_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            behind, position = WriteBehind(fd, behind_file), 0
            for tensor in state.values():
                view = memoryview(tensor.numpy()).cast("B")
                written = 0
                while written < len(view):
                    step = os.write(fd, view[written : written + KICK])
                    written += step
                    position += step
                    behind.wrote(position)
            os.fsync(fd)
        finally:
            os.close(fd)

    def pitstop_load() -> None:
        touch(fileformat.load(pitstop_file))

    def torch_load() -> None:
        touch(torch.load(torch_file, weights_only=True, map_location="cpu"))

    buffer = bytearray(nbytes)  # allocated and faulted in once: the limit copies, nothing else

    def raw_read() -> None:
        with open(raw_file, "rb", buffering=0) as f:
            f.readinto(buffer)

    rows = []

    def remove(path: Path) -> Callable[[], None]:
        # Every save writes a new file, as pitstop does for each step; the old one's deletion
        # (retention's job, after the save) is not part of the figure, for any candidate.
        return lambda: path.unlink(missing_ok=True)

    def drop(path: Path) -> Callable[[], None]:
        return lambda: drop_cache(path)

    saves = timed_round_robin(
        {
            "write+fsync (limit)": (remove(raw_file), raw_write),
            "write-behind + fsync": (remove(behind_file), raw_write_behind),
            "pitstop save (durable)": (remove(pitstop_file), pitstop_save),
            "torch.save + fsync": (remove(torch_file), torch_save),
        },
        args.repeats,
    )
    loads = timed_round_robin(
        {
            "readinto (limit)": (drop(raw_file), raw_read),
            "pitstop.load (mmap, touched)": (drop(pitstop_file), pitstop_load),
            "torch.load (touched)": (drop(torch_file), torch_load),
        },
        args.repeats,
    )
    gib = nbytes / (1 << 30)
    print(f"state: {args.tensors} float32 tensors, {nbytes / (1 << 20):.0f} MiB; dir {root}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"pitstop's CRC-32: {checksums.ENGINE}"
    )
    print()
    print("| operation | seconds | GiB/s | x limit |")
    print("|---|---:|---:|---:|")
    for group in (saves, loads):
        limit = next(iter(group.values()))
        for name, seconds in group.items():
            print(f"| {name} | {seconds:.3f} | {gib / seconds:.2f} | {seconds / limit:.2f} |")
            rows.append({"operation": name, "seconds": seconds, "bytes": nbytes})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    for path in (pitstop_file, torch_file, raw_file, behind_file):
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
