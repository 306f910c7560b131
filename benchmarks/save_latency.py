"""Save latency against every peer: how long a save holds the loop, and how long until durable.

One process, one state (~64 float32 tensors, on the CPU or with ``--device cuda`` on a GPU),
side by side, for each size in ``--sizes-mib``:

* physical limits, measured in the same run: ``copy_`` of the same tensors into buffers
  allocated (and faulted in) beforehand — pinned host buffers from CUDA — the floor for the
  *blocking* time; ``write`` of the same bytes into a fresh file then ``fsync`` of the file and
  of its directory, the floor for the time *to durable*;
* ``torch.save`` (default: no fsync, never durable by itself) and ``torch.save`` + fsync;
* ``torch.distributed.checkpoint.save`` and ``async_save`` (no process group: DCP saves as a
  single process when none is initialised; a one-process gloo group is started only if that
  fails), ``async_save`` three ways: as called with no stager (it makes a fresh
  ``DefaultStager`` per call, so new host buffers each time), with one ``DefaultStager`` kept
  across saves (its storages are cached and reused; pinned memory and non-blocking copies
  when the state is on CUDA) staging in the call, and the same with ``use_async_staging``
  (the copy runs on a staging thread; the loop must wait for ``staging_completion`` before it
  changes the state). DCP fsyncs its data files and its metadata file itself; the benchmark
  adds an fsync of the checkpoint directory and of its parent (the rename and the new
  directory entry), as every other candidate does;
* safetensors ``save_file`` + fsync, when safetensors is installed;
* pitstop: ``Checkpointer(async_save=False | True | "overlap").save(progress)``.

Figures per candidate:

* *call*: until the call returns;
* *blocking*: until the training loop may change the state again. For most candidates that is
  the call; for ``async_save`` with a staging thread it also waits for ``staging_completion``;
  for pitstop "overlap" it also runs ``optimizer.step()`` at once (its pre-hook waits until
  the snapshot copy is done: the stall when no forward/backward hides the copy); on CUDA every
  candidate ends with ``torch.cuda.synchronize()`` (the device-to-host copies have landed);
* *durable*: until the bytes and the name are on disk (fsynced file and directory); for the
  background writers, until their future / ``wait()`` returns, plus the directory fsyncs;
* *peak extra RSS*: resident memory above what the process held before the candidate was
  created — the buffers it keeps between saves plus the transient peak of one save. On Linux
  the kernel's peak counter (``VmHWM``) is reset by writing ``5`` to ``/proc/self/clear_refs``
  before each run and read after it; where that is refused, a helper thread samples ``VmRSS``
  every millisecond instead. Free heap memory is given back (``malloc_trim``) before each run
  so that one candidate cannot hide its peak in another's leftovers.

Every save writes a new file (or directory); the previous one is removed before the next run,
untimed. After each run, untimed, what it wrote is fsynced (a no-op but for ``torch.save``
without fsync) and dropped from the page cache, so that one candidate's dirty or cached pages
do not weigh on the next one's run. Each figure is the median of ``--repeats`` runs after one
warm-up, the candidates taking turns so that disk noise hits all of them alike; ratios are to
the floors.

    .venv/bin/python benchmarks/save_latency.py --sizes-mib 256,1024 --repeats 5
    .venv/bin/python benchmarks/save_latency.py --device cuda --sizes-mib 1024,4096 --json r.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pitstop

MIB = 1 << 20
GB = 1e9


# --- measuring ---------------------------------------------------------------------------------


@dataclass
class Timing:
    """One run of one candidate, in seconds from the call."""

    call_s: float
    blocking_s: float
    durable_s: float | None
    reported_blocking_s: float | None = None  # pitstop's own ckpt.last_blocking_s


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class Sampler:
    """Max RSS seen by a helper thread sampling every millisecond (where VmHWM can't reset)."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes())


class PeakMemory:
    """Peak RSS during a block, by VmHWM reset where the kernel allows it, else by sampling."""

    def __init__(self) -> None:
        self.method = "VmHWM reset via /proc/self/clear_refs" if reset_peak() else "sampler"
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        self._trim = getattr(libc, "malloc_trim", None)

    def settle(self) -> None:
        """Collect garbage and give free heap memory back, until RSS holds still (<= 2 s).

        Background threads (DCP's executor, a stager's callbacks) may drop their last
        reference to a staged copy a moment after the future completes; without waiting, that
        memory would be freed during the next candidate's run and hide its peak.
        """
        deadline = time.monotonic() + 2.0
        last = -1
        gc.collect()
        while True:
            if self._trim is not None:
                self._trim(0)
            now = rss_bytes()
            if abs(now - last) < 4 * MIB or time.monotonic() > deadline:
                return
            last = now
            time.sleep(0.02)

    @contextlib.contextmanager
    def peak(self) -> Iterator[list[int]]:
        """Yields a list that holds, after the block, the peak RSS in bytes during it."""
        out: list[int] = []
        sampler = None if self.method != "sampler" else Sampler()
        if sampler is None:
            reset_peak()
        try:
            yield out
        finally:
            out.append(sampler.stop() if sampler is not None else _status_kib("VmHWM") * 1024)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, tensor: torch.Tensor) -> None:
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    written = 0
    while written < len(view):
        written += os.write(fd, view[written : written + (64 << 20)])


# --- the state ---------------------------------------------------------------------------------


class Holder(nn.Module):
    """A module whose parameters are the benchmark's tensors (so that pitstop can save it)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        for i, tensor in enumerate(tensors):
            self.register_parameter(f"p{i:02d}", nn.Parameter(tensor, requires_grad=False))


def make_state(total_bytes: int, count: int, device: torch.device) -> Holder:
    """``count`` float32 tensors of about ``total_bytes`` in all, random, on ``device``."""
    per = max(1, total_bytes // count // 4)
    generator = torch.Generator(device=device).manual_seed(0)
    return Holder([torch.randn(per, generator=generator, device=device) for _ in range(count)])


# --- candidates --------------------------------------------------------------------------------


@dataclass
class Env:
    root: Path
    device: torch.device
    holder: Holder
    state: dict[str, torch.Tensor]
    nbytes: int
    shared: dict[str, Any] = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Candidate:
    """A way to save the state. ``setup`` runs untimed before each ``run``."""

    system = ""
    mode = ""
    path: Path | None = None  # what a run writes: a file or a directory
    file_bytes: int | None = None  # the size of the last file written, where one is noted

    def setup(self) -> None:
        """Remove what the previous run wrote (untimed)."""

    def evict(self) -> None:
        """After a run (untimed): flush what it wrote and drop it from the page cache.

        So that neither dirty pages (``torch.save`` without fsync) nor a page cache filled by
        every candidate's last file weigh on the runs that follow.
        """
        if self.path is None or not self.path.exists():
            return
        files = [self.path] if self.path.is_file() else list(self.path.rglob("*"))
        for file in files:
            if file.is_file() and not file.is_symlink():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def run(self) -> Timing:
        raise NotImplementedError

    def close(self) -> None:
        """Release buffers, threads and locks."""


class FloorCopy(Candidate):
    system, mode = "floor", "copy_ (preallocated)"

    def __init__(self, env: Env) -> None:
        self.env = env
        pinned = env.device.type == "cuda"
        self.buffers = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in env.state.values()
        ]
        for buffer in self.buffers:
            buffer.zero_()  # fault the pages in: the floor copies, it does not allocate
        env.shared["host"] = self.buffers  # the write floor writes these bytes on CUDA

    def run(self) -> Timing:
        env, cuda = self.env, self.env.device.type == "cuda"
        env.sync()
        start = time.perf_counter()
        for buffer, tensor in zip(self.buffers, env.state.values(), strict=True):
            buffer.copy_(tensor, non_blocking=cuda)
        env.sync()
        seconds = time.perf_counter() - start
        return Timing(seconds, seconds, None)


class FloorWrite(Candidate):
    system, mode = "floor", "write+fsync"

    def __init__(self, env: Env) -> None:
        self.env = env
        self.path = env.root / "floor.bin"

    def setup(self) -> None:
        self.path.unlink(missing_ok=True)

    def run(self) -> Timing:
        env = self.env
        host = env.shared["host"] if env.device.type == "cuda" else list(env.state.values())
        start = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for tensor in host:
                write_all(fd, tensor)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(env.root)
        seconds = time.perf_counter() - start
        return Timing(seconds, seconds, seconds)


class TorchSave(Candidate):
    system = "torch"

    def __init__(self, env: Env, *, fsync: bool) -> None:
        self.env, self.fsync = env, fsync
        self.mode = "save + fsync" if fsync else "save (no fsync)"
        self.path = env.root / ("torch_fsync.pt" if fsync else "torch.pt")

    def setup(self) -> None:
        self.path.unlink(missing_ok=True)

    def run(self) -> Timing:
        env = self.env
        env.sync()
        start = time.perf_counter()
        torch.save(env.state, self.path)
        call = time.perf_counter() - start
        if not self.fsync:
            return Timing(call, call, None)
        fsync_path(self.path)
        fsync_path(env.root)
        seconds = time.perf_counter() - start
        return Timing(seconds, seconds, seconds)


class SafetensorsSave(Candidate):
    system, mode = "safetensors", "save_file + fsync"

    def __init__(self, env: Env) -> None:
        from safetensors.torch import save_file

        self.env, self.save_file = env, save_file
        self.path = env.root / "state.safetensors"

    def setup(self) -> None:
        self.path.unlink(missing_ok=True)

    def run(self) -> Timing:
        env = self.env
        env.sync()
        start = time.perf_counter()
        self.save_file(env.state, str(self.path))
        fsync_path(self.path)
        fsync_path(env.root)
        seconds = time.perf_counter() - start
        return Timing(seconds, seconds, seconds)


class DcpSave(Candidate):
    system, mode = "dcp", "save"

    def __init__(self, env: Env) -> None:
        import torch.distributed.checkpoint as dcp

        self.env, self.dcp = env, dcp
        self.path = env.root / "dcp_save"

    def setup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def run(self) -> Timing:
        env = self.env
        env.sync()
        start = time.perf_counter()
        self.dcp.save(env.state, checkpoint_id=str(self.path))
        fsync_path(self.path)
        fsync_path(env.root)
        seconds = time.perf_counter() - start
        return Timing(seconds, seconds, seconds)


class DcpAsyncSave(Candidate):
    """``dcp.async_save``: ``stager`` is "default" (none given), "cached" or "staging thread"."""

    system = "dcp"

    def __init__(self, env: Env, stager: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from pitstop.shell.sharded.shardstage import stager_spent

        self.spent = stager_spent

        self.env, self.dcp = env, dcp
        cuda = env.device.type == "cuda"
        self.mode = {
            "default": "async_save (default)",
            "cached": "async_save (cached stager)",
            "staging thread": "async_save (cached stager, staging thread)",
        }[stager]
        self.path = env.root / f"dcp_async_{stager.replace(' ', '_')}"
        self.stager: Any = None
        if stager != "default":
            # The best this torch offers: one stager kept across saves (its host storages are
            # cached and reused), pinned memory and non-blocking copies when the state is on
            # CUDA. Shared memory is for the process executor only; this uses the thread one.
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=stager == "staging thread",
                use_non_blocking_copy=cuda,
            )
            self.make_stager = lambda: DefaultStager(options)
            self.stager = self.make_stager()

    def setup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def run(self) -> Timing:
        env = self.env
        if self.stager is not None and self.spent(self.stager):
            # torch 2.11's stager closes itself after each stage (pytorch#183413): a new one
            # for each save there, as a user of that torch must make (its cache is lost).
            self.stager.close()
            self.stager = self.make_stager()
        env.sync()
        start = time.perf_counter()
        result = self.dcp.async_save(
            env.state, checkpoint_id=str(self.path), async_stager=self.stager
        )
        call = time.perf_counter() - start
        staged = getattr(result, "staging_completion", None)  # an AsyncSaveResponse
        if staged is not None:
            staged.result()
            result = result.upload_completion
        env.sync()
        blocking = time.perf_counter() - start
        result.result()
        fsync_path(self.path)
        fsync_path(env.root)
        return Timing(call, blocking, time.perf_counter() - start)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class PitstopSave(Candidate):
    system = "pitstop"

    def __init__(self, env: Env, async_save: bool | str) -> None:
        self.env, self.async_save = env, async_save
        self.mode = {False: "sync", True: "async", "overlap": "overlap"}[async_save]
        self.directory = self.path = env.root / f"pitstop_{self.mode}"
        # An optimizer that changes nothing: overlap mode's pre-hook hangs on its step().
        self.optimizer = torch.optim.SGD(env.holder.parameters(), lr=0.0)
        self.ckpt = pitstop.Checkpointer(
            self.directory,
            model=env.holder,
            state={"optimizer": self.optimizer},
            policy=pitstop.Policy(keep_last=None, save_final=False),
            async_save=async_save,  # type: ignore[arg-type]
            overwrite=True,  # a scratch directory, reopened between rounds
        )
        self.step = 0

    def setup(self) -> None:
        # Keep only the newest file ("last" points at it); the older ones' deletion is not
        # part of the figure, as for every candidate (retention is off: keep_last=None).
        files = sorted(self.directory.glob("step_*.pitstop"))
        for old in files[:-1]:
            old.unlink()

    def run(self) -> Timing:
        env = self.env
        self.step += 1
        env.sync()
        start = time.perf_counter()
        self.ckpt.save(pitstop.Progress(step=self.step))
        call = time.perf_counter() - start
        if self.async_save == "overlap":
            self.optimizer.step()  # waits for the snapshot copy (pre-hook)
        env.sync()
        blocking = time.perf_counter() - start
        self.ckpt.wait()
        durable = time.perf_counter() - start
        newest = sorted(self.directory.glob("step_*.pitstop"))[-1]
        self.file_bytes = newest.stat().st_size
        return Timing(call, blocking, durable, self.ckpt.last_blocking_s)

    def close(self) -> None:
        self.ckpt.close()


# --- DCP without a process group (or with a one-process gloo group) ----------------------------


def dcp_ready(root: Path) -> tuple[bool, str]:
    """Whether DCP can save here; starts a one-process gloo group if it needs one."""
    if not torch.distributed.is_available():
        return False, "torch.distributed is not available in this build"
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:
        return False, f"torch.distributed.checkpoint cannot be imported: {exc}"
    probe = {"x": torch.zeros(4)}
    try:
        dcp.save(probe, checkpoint_id=str(root / "dcp_probe"))
        return True, "single process, no process group"
    except Exception as first:
        dist = torch.distributed
        if dist.is_initialized():
            return False, f"dcp.save failed: {first}"
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
            dcp.save(probe, checkpoint_id=str(root / "dcp_probe2"))
        except Exception as second:
            return False, f"dcp.save failed without a process group ({first}) and with ({second})"
        return True, f"one-process gloo group on port {port}"
    finally:
        for name in ("dcp_probe", "dcp_probe2"):
            shutil.rmtree(root / name, ignore_errors=True)


# --- running -----------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    mode: str
    size_bytes: int
    call_s: float
    blocking_s: float
    durable_s: float | None
    peak_rss_extra_bytes: int
    reported_blocking_s: float | None
    file_bytes: int | None


def candidates_for(env: Env, dcp_ok: bool, only: list[str]) -> list[Callable[[], Candidate]]:
    factories: list[tuple[str, Callable[[], Candidate]]] = [
        ("floor copy_", lambda: FloorCopy(env)),
        ("floor write+fsync", lambda: FloorWrite(env)),
        ("torch save (no fsync)", lambda: TorchSave(env, fsync=False)),
        ("torch save + fsync", lambda: TorchSave(env, fsync=True)),
    ]
    if _has_safetensors():
        factories.append(("safetensors save_file + fsync", lambda: SafetensorsSave(env)))
    if dcp_ok:
        factories.append(("dcp save", lambda: DcpSave(env)))
        for stager in ("default", "cached", "staging thread"):
            factories.append((f"dcp async_save {stager}", lambda s=stager: DcpAsyncSave(env, s)))
    for mode in (False, True, "overlap"):
        name = {False: "sync", True: "async", "overlap": "overlap"}[mode]
        factories.append((f"pitstop {name}", lambda m=mode: PitstopSave(env, m)))
    return [
        make
        for name, make in factories
        if name.startswith("floor") or not only or any(o in name for o in only)
    ]


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def measure(
    env: Env, factories: list[Callable[[], Candidate]], repeats: int, memory: PeakMemory
) -> list[Result]:
    """Warm up each candidate (its first save, also its memory baseline), then round-robin."""
    candidates: list[Candidate] = []
    peaks: list[int] = []
    retained: list[int] = []
    times: list[list[Timing]] = []
    try:
        for make in factories:
            memory.settle()
            before = rss_bytes()
            with memory.peak() as peak:
                candidate = make()
                candidate.setup()
                try:
                    candidate.run()  # warm-up: not timed; allocates what the candidate keeps
                except Exception as exc:  # e.g. another torch's DCP: reported, left out
                    print(
                        f"note: {candidate.system} {candidate.mode} failed its warm-up and is "
                        f"left out: {exc!r}",
                        flush=True,
                    )
                    candidate.setup()
                    candidate.close()
                    continue
                candidates.append(candidate)
                candidate.evict()
            memory.settle()
            peaks.append(peak[0] - before)
            retained.append(max(0, rss_bytes() - before))
            times.append([])
        for _ in range(repeats):
            for i, candidate in enumerate(candidates):
                candidate.setup()
                memory.settle()
                before = rss_bytes()
                with memory.peak() as peak:
                    timing = candidate.run()
                candidate.evict()
                times[i].append(timing)
                peaks[i] = max(peaks[i], peak[0] - before + retained[i])
    finally:
        for candidate in candidates:
            candidate.setup()
            candidate.close()

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    results = []
    for candidate, runs, peak_bytes in zip(candidates, times, peaks, strict=True):
        call = median([t.call_s for t in runs])
        blocking = median([t.blocking_s for t in runs])
        assert call is not None
        assert blocking is not None
        results.append(
            Result(
                system=candidate.system,
                mode=candidate.mode,
                size_bytes=env.nbytes,
                call_s=call,
                blocking_s=blocking,
                durable_s=median([t.durable_s for t in runs]),
                peak_rss_extra_bytes=max(0, peak_bytes),
                reported_blocking_s=median([t.reported_blocking_s for t in runs]),
                file_bytes=candidate.file_bytes,
            )
        )
    return results


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def print_table(results: list[Result]) -> None:
    copy = next(r for r in results if r.mode.startswith("copy_"))
    write = next(r for r in results if r.mode == "write+fsync")
    size = results[0].size_bytes
    print(
        "| system | mode | call s | blocking s | x copy floor | durable s | x write floor "
        "| GB/s | peak extra RSS MiB | x state |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        durable_ratio = None if r.durable_s is None else r.durable_s / write.blocking_s
        speed = size / GB / (r.durable_s if r.durable_s is not None else r.blocking_s)
        print(
            f"| {r.system} | {r.mode} | {_fmt(r.call_s)} | {_fmt(r.blocking_s)} "
            f"| {r.blocking_s / copy.blocking_s:.2f} | {_fmt(r.durable_s)} "
            f"| {_fmt(durable_ratio, 2)} | {speed:.2f} "
            f"| {r.peak_rss_extra_bytes / MIB:.0f} | {r.peak_rss_extra_bytes / size:.2f} |"
        )


def target_rows(results: list[Result]) -> list[tuple[str, str, str]]:
    """The issue's targets against this run: (target, measured, verdict)."""
    by = {(r.system, r.mode): r for r in results}
    copy = by.get(("floor", "copy_ (preallocated)"))
    write = by.get(("floor", "write+fsync"))
    torch_save = by.get(("torch", "save (no fsync)"))
    sync = by.get(("pitstop", "sync"))
    async_ = by.get(("pitstop", "async"))
    size = results[0].size_bytes
    rows: list[tuple[str, str, str]] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if async_ and copy:
        ratio = async_.blocking_s / copy.blocking_s
        rows.append(("async blocking <= 1.5x copy floor", f"{ratio:.2f}x", verdict(ratio <= 1.5)))
    if async_ and torch_save:
        ratio = async_.blocking_s / torch_save.blocking_s
        rows.append(("async blocking <= 0.1x torch.save", f"{ratio:.2f}x", verdict(ratio <= 0.1)))
    if sync and write and sync.durable_s is not None:
        ratio = sync.durable_s / write.blocking_s
        rows.append(
            ("sync time-to-durable <= 1.15x write+fsync", f"{ratio:.2f}x", verdict(ratio <= 1.15))
        )
    if async_:
        ratio = async_.peak_rss_extra_bytes / size
        rows.append(("async peak extra RSS <= 1.1x state", f"{ratio:.2f}x", verdict(ratio <= 1.1)))
    if sync:
        # The file's bytes beyond the tensors' own: header, padding, manifest, footer.
        limit = 64 * MIB + max(0, (sync.file_bytes or size) - size)
        rows.append(
            (
                f"sync peak extra RSS <= 64 MiB + manifest ({limit / MIB:.1f} MiB)",
                f"{sync.peak_rss_extra_bytes / MIB:.1f} MiB",
                verdict(sync.peak_rss_extra_bytes <= limit),
            )
        )
    return rows


def plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; no plot written to {path}")
        return False
    sizes = sorted({r.size_bytes for r in results})
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 6), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = [r for r in results if r.size_bytes == size]
        labels = [f"{r.system} {r.mode}" for r in rows]
        y = range(len(rows))
        ax.barh([i - 0.2 for i in y], [r.blocking_s for r in rows], height=0.4, label="blocking")
        ax.barh(
            [i + 0.2 for i in y],
            [r.durable_s or 0.0 for r in rows],
            height=0.4,
            label="to durable",
        )
        ax.set_yticks(list(y), labels)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (median)")
        ax.set_title(f"{size / MIB:.0f} MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot written to {path}")
    return True


def replay(path: Path, plot_path: Path | None) -> int:
    """Print the tables (and plot) of the rows an earlier ``--json`` run wrote."""
    rows = json.loads(path.read_text())
    results = [
        Result(
            system=row["system"],
            mode=row["mode"],
            size_bytes=row["size_bytes"],
            call_s=row["call_s"],
            blocking_s=row["blocking_s"],
            durable_s=row["durable_s"],
            peak_rss_extra_bytes=row["peak_rss_extra_bytes"],
            reported_blocking_s=row["reported_blocking_s"],
            file_bytes=None,
        )
        for row in rows
    ]
    for size in sorted({r.size_bytes for r in results}):
        print()
        print(f"### {size / MIB:.0f} MiB (from {path})")
        print()
        print_table([r for r in results if r.size_bytes == size])
    if plot_path is not None:
        plot(results, plot_path)
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes-mib: not a list of integers: {text!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sizes-mib: sizes must be >= 1 MiB, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=_sizes, default=[256, 1024], help="e.g. 256,1024")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, help="write a bar chart here (matplotlib)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--only", default="", help="comma list: run only candidates whose name contains one"
    )
    parser.add_argument(
        "--from-json",
        default=None,
        help="measure nothing: print the tables (and --plot) from rows an earlier --json wrote",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        return replay(Path(args.from_json), Path(args.plot) if args.plot else None)
    if args.repeats < 1 or args.tensors < 1:
        parser.error("--repeats and --tensors must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    own_root = args.dir is None
    root = Path(args.dir or tempfile.mkdtemp(prefix="pitstop-latency-"))
    root.mkdir(parents=True, exist_ok=True)
    memory = PeakMemory()
    dcp_ok, dcp_note = dcp_ready(root)
    # Everything imported so far is long-lived: keep it out of the collections settle() runs.
    gc.collect()
    gc.freeze()
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, pitstop "
        f"{pitstop.__version__}; {os.cpu_count()} CPUs ({_cpu_model()}), "
        f"{torch.get_num_threads()} torch threads"
    )
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"directory: {root}; peak RSS by {memory.method}")
    print(f"DCP: {dcp_note if dcp_ok else 'skipped — ' + dcp_note}")
    if not _has_safetensors():
        print("note: safetensors is not installed; its row is skipped")

    results: list[Result] = []
    try:
        # Every code path once on a tiny state, discarded: lazy imports, thread pools and
        # other one-time costs are not charged to the first candidate that happens to hit them.
        tiny = make_state(args.tensors * 1024, args.tensors, device)
        tiny_env = Env(root, device, tiny, dict(tiny.state_dict()), args.tensors * 1024)
        measure(tiny_env, candidates_for(tiny_env, dcp_ok, only), 1, memory)
        del tiny, tiny_env
        for size_mib in args.sizes_mib:
            holder = make_state(size_mib * MIB, args.tensors, device)
            state = dict(holder.state_dict())
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            env = Env(root=root, device=device, holder=holder, state=state, nbytes=nbytes)
            factories = candidates_for(env, dcp_ok, only)
            rows = measure(env, factories, args.repeats, memory)
            results += rows
            print()
            print(
                f"### {args.tensors} float32 tensors, {nbytes / MIB:.0f} MiB on {device}; "
                f"median of {args.repeats} after a warm-up"
            )
            print()
            print_table(rows)
            targets = target_rows(rows)
            if targets:
                print()
                print("| target | measured | verdict |")
                print("|---|---:|---|")
                for target, measured, verdict in targets:
                    print(f"| {target} | {measured} | {verdict} |")
            del env, state, holder, factories
            memory.settle()
    finally:
        gc.unfreeze()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        payload = [
            {
                "system": r.system,
                "mode": r.mode,
                "size_bytes": r.size_bytes,
                "blocking_s": r.blocking_s,
                "durable_s": r.durable_s,
                "peak_rss_extra_bytes": r.peak_rss_extra_bytes,
                "call_s": r.call_s,
                "reported_blocking_s": r.reported_blocking_s,
                "device": str(device),
                "repeats": args.repeats,
            }
            for r in results
        ]
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
