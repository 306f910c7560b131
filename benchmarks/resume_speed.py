"""Resume speed: time to put a saved training state back into a live model and optimizer.

For each size in ``--sizes-mib`` (MiB of float32 parameters, in ``--tensors`` tensors, plus
AdamW's two moments: a file of about three times that), one state is saved once in every
candidate's format, then every candidate resumes it into a live model and optimizer, from a
cold page cache:

* ``readinto`` (the floor): the pitstop file read whole into a buffer allocated and faulted in
  beforehand — what the disk allows, with no checking and no copying;
* ``readinto`` with new memory (the second floor, a reference beside the first): the same
  read, but as many of its bytes as the optimizer's moments hold go into memory allocated in
  the clock (a private anonymous map advised for huge pages, as pitstop's own), the rest into
  memory faulted in beforehand — what any resume into a fresh optimizer pays at least, since
  its moments do not exist before it; the column "x new-mem floor" gives each candidate's
  ratio to it;
* ``torch.load`` + ``load_state_dict``: ``torch.load(weights_only=True, mmap=False)`` of the
  same state saved by ``torch.save``, then ``model.load_state_dict`` and
  ``optimizer.load_state_dict``;
* ``torch.distributed.checkpoint.load`` of the same state (``no_dist=True``: one process, no
  process group), through ``get_state_dict`` / ``set_state_dict`` as DCP's docs describe
  (DCP loads into tensors that exist, so ``get_state_dict`` first gives the fresh optimizer its
  state);
* safetensors ``load_file``, when safetensors is installed (the optimizer's tensors flattened
  into the same file; its param groups are the live optimizer's own);
* pitstop: ``Checkpointer(directory, model=..., state={"optimizer": ...}).resume()`` — open
  and lock the directory, choose the newest checkpoint that verifies, check it against the run,
  restore all or nothing.

Every candidate runs in a **fresh process** per run, as after a restart: the live model
(zeros) and a fresh AdamW (no state yet) are built, the files the candidate reads are fsynced
and dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), then the clock
runs from the first call to the end of a **write to every page** of every live tensor — the
parameters and the optimizer's moments — so that a candidate cannot look fast by leaving the
state mapped, unread or shared with the page cache (the first optimizer step writes every one
of those pages). A thread samples the process's anonymous memory (``RssAnon``) every 2 ms; the
figures are its peak above what the process held before, and the *transient*: that peak minus
what is left once the candidate's own temporaries are gone (the live state itself). pitstop's
target is a transient of at most 64 MiB: no second copy of the state.

Each figure is the median of ``--repeats`` runs after ``--warmups`` (1) runs of each candidate, the
candidates taking turns (in a rotated order each round) so that the disk's and the machine's
noise hit all of them alike; ratios are to the floor and to ``torch.load`` of the same round.

Each row also gives the process's CPU seconds (all its threads) over the same span: on a
shared machine a candidate that needs more CPU loses more to the other tenants.

``--phases`` also runs pitstop's resume with a clock around each of its phases (open and
lock, choose and verify — the checking read pass —, load and checks, components and RNG, the
copy into the model, the touch) and prints where the time goes. ``--read-strategies`` also
times the checking read pass alone six ways (pread with the CRC on the pool, pread with the
CRC inline, two threads each reading and checksumming, a memory map checksummed on the pool,
and the resume's own pass — the optimizer's state read into new memory — with 2 and with 4
readers). ``--baseline-src DIR`` adds a second pitstop row resumed with the package under
``DIR`` (another checkout's ``src/``), taking turns with this one: before and after, in one run.

``--device cuda`` builds the live model and optimizer on the GPU (a restarted run resuming onto
its accelerator): ``torch.load`` and safetensors load onto the device, the floor reads into
pinned memory and copies it to the device in one piece, and every clock stops once the device
is synchronized (there are no host pages to write then).

    .venv/bin/python benchmarks/resume_speed.py --sizes-mib 256,1024 --repeats 5 --phases
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
FLOOR = "readinto (floor)"
TORCH = "torch.load + load_state_dict"
DCP = "dcp.load"
SAFETENSORS = "safetensors load_file"
PITSTOP = "pitstop resume"
NEW_FLOOR = "readinto with new memory (second floor)"
BASELINE = "pitstop resume (--baseline-src)"
CANDIDATES = (FLOOR, NEW_FLOOR, TORCH, DCP, SAFETENSORS, PITSTOP)
# --read-strategies: the checking read pass alone, over the pitstop file, six ways
READ_POOL = "check pass: pread, CRC on the pool (pitstop)"
READ_INLINE = "check pass: pread, CRC inline (1 thread)"
READ_THREADS = "check pass: pread + CRC on 2 threads"
READ_MMAP = "check pass: mmap, CRC on the pool"
# the resume's own pass (the optimizer's state read into new memory) with 2 or 4 readers
READ_PLACED = "check pass + the optimizer's state into new memory ({} readers)"
STRATEGIES = (
    READ_POOL,
    READ_INLINE,
    READ_THREADS,
    READ_MMAP,
    READ_PLACED.format(2),
    READ_PLACED.format(4),
)
FLOORS = (FLOOR, NEW_FLOOR)  # they read the file and restore nothing
# the candidates that restore (and then touch) the state
RESUMES = tuple(c for c in (*CANDIDATES, BASELINE) if c not in FLOORS)
SLACK = 64 * MIB
_KEPT: list[Any] = []  # the second floor's memory: kept, as a resumed state is


def have_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


# --- the state ----------------------------------------------------------------------------------


class Model(nn.Module):
    """``count`` float32 parameters of ``per`` elements each."""

    def __init__(self, count: int, per: int, *, fill: Callable[[int], torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ParameterList(nn.Parameter(fill(per)) for _ in range(count))


def live_objects(size_mib: int, count: int, device: str = "cpu") -> tuple[Model, torch.optim.AdamW]:
    """What a restarted run builds before it resumes: a model (zeros, on ``device``) and a
    fresh AdamW."""
    per = (size_mib * MIB) // 4 // count
    model = Model(count, per, fill=lambda n: torch.zeros(n, device=device))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_files(
    root: Path, size_mib: int, count: int, candidates: Sequence[str] = ()
) -> dict[str, list[Path]]:
    """Save one trained state in the format of every one of ``candidates`` (all of them when
    empty; pitstop's file, which the floor reads, always); return the files each one reads."""
    wanted = set(candidates or CANDIDATES)
    import pitstop

    per = (size_mib * MIB) // 4 // count
    generator = torch.Generator().manual_seed(0)
    model = Model(count, per, fill=lambda n: torch.randn(n, generator=generator))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()  # the moments are real, not zeros
    optimizer.zero_grad(set_to_none=True)
    files: dict[str, list[Path]] = {}

    ckpt_dir = root / "pitstop"
    policy = pitstop.Policy(keep_last=None, save_final=False)
    with pitstop.Checkpointer(
        ckpt_dir, model=model, state={"optimizer": optimizer}, policy=policy
    ) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
    files[PITSTOP] = sorted(p for p in ckpt_dir.iterdir() if p.is_file())
    files[FLOOR] = [saved.path]

    if TORCH in wanted:
        torch_file = root / "state.pt"
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, torch_file)
        files[TORCH] = [torch_file]

    if DCP in wanted:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        dcp_dir = root / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.save(state, checkpoint_id=str(dcp_dir), no_dist=True)
        files[DCP] = sorted(p for p in dcp_dir.rglob("*") if p.is_file())

    if SAFETENSORS in wanted and have_safetensors():
        from safetensors.torch import save_file

        flat = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                flat[f"optim.{index}.{key}"] = value.contiguous()
        safe_file = root / "state.safetensors"
        save_file(flat, str(safe_file))
        files[SAFETENSORS] = [safe_file]
    for paths in files.values():
        for path in paths:
            fsync_path(path)
    return files


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """fsync ``path`` (DONTNEED drops only clean pages), then evict it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- one run, in a fresh process ------------------------------------------------------------------


def rss_anon() -> int:
    """This process's anonymous resident memory, in bytes (``RssAnon`` of /proc/self/status)."""
    with open("/proc/self/status", "rb") as status:
        for line in status:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """A thread sampling :func:`rss_anon` every ``interval_s`` while the block runs."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self.peak = rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def touch(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write one byte of every page of every parameter and every optimizer tensor (as the
    first optimizer step will): mapped, copy-on-write or lazily read state pays for it here."""
    tensors = [p.data for p in model.parameters()]
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue  # device memory: no pages of the host's to fault in
        flat = tensor.reshape(-1).view(torch.uint8)
        flat[::PAGE].add_(0)


def check_resumed(model: Model, optimizer: torch.optim.AdamW) -> None:
    """Fail loudly if a candidate did not actually restore the state."""
    first = model.layers[0]
    if not bool(first.detach().abs().sum() > 0):
        raise AssertionError("the parameters were not restored")
    state = optimizer.state.get(first, {})
    if "exp_avg" not in state or not bool(state["exp_avg"].abs().sum() > 0):
        raise AssertionError("the optimizer's moments were not restored")


def resume_with(
    candidate: str, root: Path, model: Model, optimizer: torch.optim.AdamW, device: str = "cpu"
) -> Callable[[], None]:
    """The timed work of ``candidate`` (its setup, untimed, is done here)."""
    if candidate == FLOOR:
        (path,) = json.loads((root / "files.json").read_text())[FLOOR]
        size = os.path.getsize(path)
        on_device = device != "cpu"
        # On a GPU: read into pinned memory, then one copy of it all to the device.
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=on_device)
        buffer[::PAGE].fill_(1)  # allocated and faulted in beforehand: the floor copies only
        target = torch.empty(size, dtype=torch.uint8, device=device) if on_device else None
        view = memoryview(buffer.numpy())

        def floor() -> None:
            with open(path, "rb", buffering=0) as file:
                done = 0
                while done < size:
                    done += file.readinto(view[done:]) or 0
            if target is not None:
                target.copy_(buffer, non_blocking=True)

        return floor
    if candidate == NEW_FLOOR:
        return floor_into_new_memory(root, optimizer)
    if candidate == TORCH:

        def torch_load() -> None:
            state = torch.load(root / "state.pt", weights_only=True, map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])

        return torch_load
    if candidate == DCP:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def dcp_load() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(root / "dcp"), no_dist=True)
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )

        return dcp_load
    if candidate == SAFETENSORS:
        from safetensors.torch import load_file

        def safetensors_load() -> None:
            flat = load_file(str(root / "state.safetensors"), device=device)
            model.load_state_dict(
                {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
            )
            stored: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in flat.items():
                if key.startswith("optim."):
                    _, index, name = key.split(".", 2)
                    stored.setdefault(int(index), {})[name] = value
            groups = optimizer.state_dict()["param_groups"]
            optimizer.load_state_dict({"state": stored, "param_groups": groups})

        return safetensors_load
    if candidate in (PITSTOP, BASELINE):
        import pitstop

        # pitstop's shell is imported at its first use, as torch's modules are with torch:
        # before the clock (a run with --phases imports it there anyway, to clock it).
        checkpointer = pitstop.Checkpointer

        def pitstop_resume() -> None:
            with checkpointer(
                root / "pitstop",
                model=model,
                state={"optimizer": optimizer},
                policy=pitstop.Policy(keep_last=None, save_final=False),
            ) as ckpt:
                progress = ckpt.resume()
            if progress.step != 1:
                raise AssertionError(f"pitstop resumed step {progress.step}, not 1")

        return pitstop_resume
    if candidate in STRATEGIES:
        return check_pass(candidate, root)
    raise ValueError(f"unknown candidate {candidate!r}")


def floor_into_new_memory(root: Path, optimizer: torch.optim.AdamW) -> Callable[[], None]:
    """The floor's read, its last bytes — as many as the optimizer's moments hold — into memory
    that is new in the clock: a private anonymous map advised for huge pages, kept until the
    run ends (as a resume's state is)."""
    (path,) = json.loads((root / "files.json").read_text())[FLOOR]
    size = os.path.getsize(path)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = 2 * sum(p.numel() * p.element_size() for p in params)  # exp_avg and exp_avg_sq
    old = torch.empty(size - fresh, dtype=torch.uint8)
    old[::PAGE].fill_(1)  # the weights' share: as the floor, faulted in beforehand
    _KEPT.append(old)  # as the live weights are: not counted as memory freed after the read

    def floor_new() -> None:
        region = mmap.mmap(-1, fresh, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        _KEPT.append(region)  # the state's memory outlives the read, as a resume's does
        with open(path, "rb", buffering=0) as file:
            for view in (memoryview(old.numpy()), memoryview(region)):
                done = 0
                while done < len(view):
                    done += file.readinto(view[done:]) or 0

    return floor_new


def check_pass(candidate: str, root: Path) -> Callable[[], None]:
    """The read pass that checks every blob of the pitstop file, one of six ways."""
    from pitstop.shell.format import blobread, fileformat
    from pitstop.shell.format.checksums import crc32

    (path,) = json.loads((root / "files.json").read_text())[FLOOR]
    if candidate == READ_POOL:
        return lambda: fileformat.verify(path)
    manifest = fileformat.read_manifest(path)
    if candidate in (READ_PLACED.format(2), READ_PLACED.format(4)):
        readers = int(candidate.rsplit("(", 1)[1].split()[0])
        blobread.default_threads = lambda: readers  # type: ignore[attr-defined]  # this run only
        cpu = torch.device("cpu")

        def placed() -> None:
            fileformat.load(
                path,
                verify="file",
                place=lambda key: cpu if key[:2] == ("state", "optimizer") else None,
            )

        return placed
    if candidate == READ_INLINE:

        def inline() -> None:
            with open(path, "rb") as file:
                blobread.read_blobs(file, manifest, range(len(manifest.blobs)), threads=0)

        return inline
    if candidate == READ_THREADS:
        from pitstop.shell.format.checksums import crc32_update

        def two_threads() -> None:
            chunk = blobread.CHUNK
            pieces = [
                (i, start)
                for i, blob in enumerate(manifest.blobs)
                for start in range(0, blob.length, chunk)
            ]
            crcs: dict[tuple[int, int], int] = {}
            fd = os.open(path, os.O_RDONLY)

            def run(mine: list[tuple[int, int]]) -> None:
                buffer = bytearray(chunk)
                view = memoryview(buffer)
                for i, start in mine:
                    blob = manifest.blobs[i]
                    n = min(chunk, blob.length - start)
                    os.preadv(fd, [view[:n]], blob.offset + start)
                    crcs[i, start] = crc32_update(view[:n])

            threads = [threading.Thread(target=run, args=(pieces[k::2],)) for k in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            os.close(fd)
            # (the CRCs are not combined and compared: this measures the read and the CRC only)

        return two_threads

    def mapped() -> None:
        import mmap

        with open(path, "rb") as file:
            size = manifest.manifest_offset
            with mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as data:
                view = memoryview(data)
                for blob in manifest.blobs:
                    crc32(view[blob.offset : blob.stop])
                view.release()

    return mapped


class Phases:
    """Clocks around named functions: inclusive seconds per phase, in first-call order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attribute: str, label: str) -> None:
        original = getattr(owner, attribute, None) if owner is not None else None
        if original is None:
            return
        seconds = self.seconds
        seconds.setdefault(label, 0.0)  # printed in the order wrapped

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, original))

    def undo(self) -> None:
        for action in reversed(self._undo):
            action()
        self._undo.clear()


def install_phases() -> Phases:
    """Clock pitstop's resume phases (whichever of these names the code has)."""
    import importlib

    def module(name: str) -> Any:  # None where this checkout has no such module
        for path in (name, name.rpartition(".")[2]):  # in its room, or an older flat shell's
            try:
                return importlib.import_module(f"pitstop.shell.{path}")
            except ImportError:
                continue
        return None

    directory, fileformat, fileread, resolve, restore, resuming = map(
        module,
        (
            "store.directory",
            "format.fileformat",
            "format.fileread",
            "store.resolve",
            "state.restore",
            "resuming",
        ),
    )
    if resuming is None:  # an older checkout: the resume lived in the manager
        resuming = module("manager")
    phases = Phases()
    phases.wrap(directory.CheckpointDirectory, "open", "open: lock + scan the directory")
    phases.wrap(resuming, "find_resume", "choose: scan + verify the newest checkpoint")
    phases.wrap(resolve, "choose_resume", "  of which choose_resume (the checking read pass)")
    phases.wrap(fileread, "read_blobs", "    of which read_blobs (read + CRC, every blob)")
    phases.wrap(resuming, "_load", "load: manifest + tensors + checks")
    phases.wrap(
        getattr(resuming, "Checkpointer", None), "_load", "load: manifest + tensors + checks"
    )
    phases.wrap(fileformat, "load", "  of which fileformat.load")
    phases.wrap(resuming, "differences", "  of which the checks (differences)")
    phases.wrap(restore.Restore, "prepare", "prepare: components + RNG")
    phases.wrap(restore.Restore, "commit", "commit: copy into the model")
    return phases


def worker(
    candidate: str, root: Path, size_mib: int, count: int, phases: bool, device: str = "cpu"
) -> dict[str, Any]:
    """One run of ``candidate`` in this (fresh) process; returns its figures."""
    model, optimizer = live_objects(size_mib, count, device)  # CUDA's context: made here
    work = resume_with(candidate, root, model, optimizer, device)
    done = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    clocks = install_phases() if phases else None
    every = json.loads((root / "files.json").read_text())
    files = every.get(PITSTOP if candidate == BASELINE else candidate, every[FLOOR])
    for path in files:
        drop_cache(Path(path))
    gc.collect()
    before = rss_anon()
    with PeakSampler() as sampler:
        cpu = time.process_time()
        start = time.perf_counter()
        work()
        done()  # every copy to the device has landed
        resumed = time.perf_counter()
        if candidate in RESUMES:
            touch(model, optimizer)
        end = time.perf_counter()
        cpu = time.process_time() - cpu
    del work
    gc.collect()
    after = rss_anon()
    if candidate in RESUMES:
        check_resumed(model, optimizer)
    row: dict[str, Any] = {
        "candidate": candidate,
        "seconds": end - start,
        "cpu_s": cpu,
        "touch_s": end - resumed,
        "anon_before": before,
        "anon_peak": sampler.peak,
        "anon_after": after,
    }
    if clocks is not None:
        row["phases"] = {**clocks.seconds, "touch (write every page)": end - resumed}
        clocks.undo()
    return row


def run_worker(
    candidate: str,
    root: Path,
    size_mib: int,
    count: int,
    phases: bool,
    baseline_src: str | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    env = dict(os.environ)
    if candidate == BASELINE and baseline_src:  # the same resume, another checkout's pitstop
        env["PYTHONPATH"] = os.pathsep.join(p for p in (baseline_src, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        __file__,
        "--worker",
        candidate,
        "--root",
        str(root),
        "--sizes-mib",
        str(size_mib),
        "--tensors",
        str(count),
        "--device",
        device,
    ]
    if phases:
        command.append("--phases")
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{candidate} failed:\n{done.stdout}\n{done.stderr}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


# --- the driver ----------------------------------------------------------------------------------


def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes-mib takes integers, got {text!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sizes-mib takes sizes >= 1, got {text!r}")
    return sizes


def rotated(items: list[str], by: int) -> list[str]:
    by %= len(items)
    return items[by:] + items[:by]


@contextlib.contextmanager
def bench_root(where: str | None) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="pitstop-resume-", dir=where))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(
    runs: dict[str, list[dict[str, Any]]], size_mib: int, file_bytes: int
) -> list[dict[str, Any]]:
    """One row per candidate: medians, ratios (each run to the same round's floor)."""
    rounds = len(runs[FLOOR])
    rows = []
    for candidate, samples in runs.items():
        seconds = [s["seconds"] for s in samples]
        to_floor = [s["seconds"] / runs[FLOOR][i]["seconds"] for i, s in enumerate(samples)]
        to_torch = (
            [s["seconds"] / runs[TORCH][i]["seconds"] for i, s in enumerate(samples)]
            if TORCH in runs
            else []
        )
        to_new = (
            [s["seconds"] / runs[NEW_FLOOR][i]["seconds"] for i, s in enumerate(samples)]
            if NEW_FLOOR in runs
            else []
        )
        peak = [s["anon_peak"] - s["anon_before"] for s in samples]
        transient = [s["anon_peak"] - max(s["anon_after"], s["anon_before"]) for s in samples]
        row: dict[str, Any] = {
            "size_mib": size_mib,
            "file_bytes": file_bytes,
            "candidate": candidate,
            "runs": rounds,
            "median_s": statistics.median(seconds),
            "cpu_s": statistics.median(s["cpu_s"] for s in samples),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "x_floor": statistics.median(to_floor),
            "x_floor_max": max(to_floor),
            "x_torch_load": statistics.median(to_torch) if to_torch else None,
            "x_torch_load_max": max(to_torch) if to_torch else None,
            "x_new_floor": statistics.median(to_new) if to_new else None,
            "x_new_floor_max": max(to_new) if to_new else None,
            "peak_anon_extra_bytes": max(peak),
            "transient_anon_bytes": max(transient),
            "seconds": seconds,
        }
        phase_runs = [s["phases"] for s in samples if "phases" in s]
        if phase_runs:
            labels = list(phase_runs[0])
            row["phases_s"] = {
                label: statistics.median(p.get(label, 0.0) for p in phase_runs) for label in labels
            }
        rows.append(row)
    return rows


def ratio(row: dict[str, Any], key: str) -> str:
    """``row``'s median ratio ``key`` and its largest, or a dash where it was not measured."""
    if row[key] is None:
        return "—"
    return f"{row[key]:.2f} ({row[key + '_max']:.2f})"


def print_table(rows: list[dict[str, Any]]) -> None:
    new = any(row["x_new_floor"] is not None for row in rows)
    print(
        "| state | candidate | median s | range s | CPU s | GB/s | x floor (max) "
        + ("| x new-mem floor (max) " if new else "")
        + "| x torch.load (max) | peak anon extra MiB | transient MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|" if new else "") + "---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['size_mib']} MiB + AdamW ({row['file_bytes'] / MIB:.0f} MiB file) "
            f"| {row['candidate']} | {row['median_s']:.3f} "
            f"| {row['min_s']:.3f}-{row['max_s']:.3f} | {row['cpu_s']:.3f} "
            f"| {row['file_bytes'] / row['median_s'] / 1e9:.2f} "
            f"| {ratio(row, 'x_floor')} "
            + (f"| {ratio(row, 'x_new_floor')} " if new else "")
            + f"| {ratio(row, 'x_torch_load')} "
            f"| {row['peak_anon_extra_bytes'] / MIB:.0f} "
            f"| {row['transient_anon_bytes'] / MIB:.0f} |"
        )


def print_phases(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if "phases_s" not in row:
            continue
        total = row["median_s"]
        print()
        print(f"{row['candidate']}, {row['size_mib']} MiB + AdamW: median seconds per phase")
        print()
        print("| phase | s | share |")
        print("|---|---:|---:|")
        for label, seconds in row["phases_s"].items():
            print(f"| {label} | {seconds:.3f} | {seconds / total:.0%} |")
        print(f"| total (resume + touch) | {total:.3f} | 100% |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=sizes_arg, default=[64])
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs per candidate")
    parser.add_argument("--phases", action="store_true", help="clock pitstop's resume phases")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the live model and optimizer are: cpu or cuda[:N] (the floor then reads "
        "into pinned memory and copies it to the device)",
    )
    parser.add_argument(
        "--read-strategies",
        action="store_true",
        help="also time the checking read pass alone, six ways (threads, pread, mmap, readers)",
    )
    parser.add_argument(
        "--candidates",
        default=",".join(CANDIDATES),
        help=f"comma-separated subset of: {', '.join(CANDIDATES)} (the floor always runs), "
        "and of --read-strategies' passes",
    )
    parser.add_argument(
        "--baseline-src",
        default=None,
        help="also resume with the pitstop package under this src/ directory (another "
        "checkout, e.g. a git worktree of an older commit), taking turns with this one",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        row = worker(
            args.worker, Path(args.root), args.sizes_mib[0], args.tensors, args.phases, args.device
        )
        print(json.dumps(row))
        return 0
    if args.repeats < 1 or args.warmups < 0:
        parser.error("--repeats must be >= 1 and --warmups >= 0")
    chosen = [c.strip() for c in args.candidates.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in (*CANDIDATES, *STRATEGIES)]
    if unknown:
        known = [*CANDIDATES, *STRATEGIES]
        parser.error(f"unknown --candidates {unknown}; choose from {known}")
    candidates = [c for c in CANDIDATES if c == FLOOR or c in chosen]
    if args.baseline_src:
        candidates.insert(candidates.index(PITSTOP) + 1 if PITSTOP in candidates else 1, BASELINE)
    candidates += [c for c in STRATEGIES if args.read_strategies or c in chosen]
    if SAFETENSORS in candidates and not have_safetensors():
        candidates.remove(SAFETENSORS)
    if NEW_FLOOR in candidates and args.device != "cpu":
        candidates.remove(NEW_FLOOR)  # its new memory is the host's: a CPU reference only

    from pitstop.shell.format.checksums import ENGINE

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"pitstop's CRC-32: {ENGINE}, {args.tensors} tensors; median of {args.repeats} after "
        f"{args.warmups} warm-up round(s), a fresh process per run, cold page cache, "
        f"live state on {args.device}"
        + (", every live page written after" if args.device == "cpu" else ", synchronized after")
    )
    if not have_safetensors():
        print("safetensors is not installed: no safetensors row")
    rows: list[dict[str, Any]] = []
    for size_mib in args.sizes_mib:
        with bench_root(args.dir) as root:
            files = make_files(root, size_mib, args.tensors, candidates)
            (root / "files.json").write_text(
                json.dumps({k: [str(p) for p in v] for k, v in files.items()})
            )
            file_bytes = os.path.getsize(files[FLOOR][0])
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in candidates}
            for _ in range(args.warmups):  # the first read of each file, untimed
                for c in candidates:
                    run_worker(
                        c, root, size_mib, args.tensors, False, args.baseline_src, args.device
                    )
            for round_ in range(args.repeats):
                for c in rotated(candidates, round_):
                    runs[c].append(
                        run_worker(
                            c,
                            root,
                            size_mib,
                            args.tensors,
                            args.phases and c in (PITSTOP, BASELINE),
                            args.baseline_src,
                            args.device,
                        )
                    )
            size_rows = summarize(runs, size_mib, file_bytes)
        print()  # each size's table as soon as it is done: a run stopped later keeps it
        print_table(size_rows)
        print_phases(size_rows)
        rows.extend(size_rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
