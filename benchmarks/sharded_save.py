"""Saving the same FSDP2 state: raw DCP (save, async_save) against pitstop (engine, Checkpointer).

Issue 13's benchmark. Two ranks (``--ranks``) run as real processes on gloo
(127.0.0.1, a free port); each builds the same model, ``--layers`` bias-free square Linear
layers each sharded with ``fully_shard``, sized so that weights plus AdamW's two moments (one
step on fixed gradients creates them) are about ``--mib`` MiB in all. Candidates, each writing
a new directory under one root:

* ``dcp save``: ``dcp.save`` with a ``FileSystemWriter`` (``sync_files=True``) of
  ``{"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}`` (built inside the
  clock, as pitstop builds the same dicts inside its call);
* ``dcp async_save``: ``dcp.async_save`` of the same, one ``DefaultStager`` kept across saves
  (pitstop's ``make_stager(model)``, the same stager as pitstop async), on a gloo group of its own;
* ``pitstop sync``: ``write_sharded`` to a temp name (every file checksummed as DCP writes it,
  then fsynced), then (rank 0) ``write_manifest`` and ``publish_sharded`` (manifest, rename,
  parent fsync);
* ``pitstop async``: ``async_write_sharded`` with that stager, then ``result()`` and the same
  publish;
* ``Checkpointer.save sync`` / ``async`` / ``overlap``: the public path, ``pitstop.Checkpointer``
  (one per mode, ``async_save=False`` / ``True`` / ``"overlap"``, retention off while timed)
  ``.save(progress)`` — the core's plan, the engine, every rank's RNG gathered with the
  write's (or the staging's) last round — and ``wait()``, which for ``async`` and ``overlap``
  is the later call that finishes DCP's save and publishes. ``overlap``'s call copies only
  what is not a parameter or optimizer state; no optimizer step follows here, so pitstop's
  thread copies the rest (in a loop, the next step may).

With ``--resume``, the candidates read back one checkpoint that the Checkpointer saved (sync)
instead, from a cold page cache (rank 0 drops every file's pages with
``posix_fadvise(DONTNEED)`` before each round), into the live model and optimizer:

* ``dcp load``: ``dcp.load`` of ``get_model_state_dict`` / ``get_optimizer_state_dict`` (DCP's
  own reader, its pickled ``.metadata`` included), then ``set_model_state_dict`` /
  ``set_optimizer_state_dict``;
* ``pitstop read_sharded``: the engine's restore — the manifest, the live state checked
  against its layout, every file this rank reads verified (size, CRC-32), a host copy of the
  rank's tensors kept for a failure, DCP's read, the apply;
* ``Checkpointer.resume``: the public path, ``pitstop.Checkpointer(...)`` and ``.resume()``
  — the gloo group, the directory probe and lock, the scan, the choice (each rank checks the
  files it wrote from the moment it read the manifest, while it plans its read), the checks'
  round, the replicated state, the apply, the copy of the checked records into the live
  tensors. The clock stops when ``resume()`` returns (the issue's measure: what a restarted
  job waits for before it trains); ``close()`` follows, outside the clock, and its own time
  is the table's last column (the worse rank's median), so that nothing is hidden.

Figures, in seconds from the call (the ranks leave a barrier just before it), the worse rank's:
*blocking* — until the call returns and the state is staged; *durable* — until the checkpoint
is on disk: DCP's call or future returned everywhere and rank 0 fsynced the directory and its
parent (DCP fsyncs its files, not the directory); pitstop: published. The ratio column is
durable over ``dcp save``'s durable (the issue's bound: 1.1 for sync, and async blocking over
``dcp async_save``'s). Medians of ``--repeats`` rounds, the candidates' order rotating from one
round to the next; what a run wrote is removed (untimed) before the next (the Checkpointers'
directories at the end).

    .venv/bin/python benchmarks/sharded_save.py --mib 1 --repeats 1      # a smoke run
    .venv/bin/python benchmarks/sharded_save.py --mib 256 --repeats 5 --json rows.json
    .venv/bin/python benchmarks/sharded_save.py --mib 256 --repeats 5 --resume

Every worker is ended: each wait has ``--timeout``, after which the workers' process groups
are killed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
CANDIDATES = (
    "dcp save",
    "dcp async_save",
    "pitstop sync",
    "pitstop async",
    "Checkpointer.save sync",
    "Checkpointer.save async",
    "Checkpointer.save overlap",
)
RESUME_CANDIDATES = ("dcp load", "pitstop read_sharded", "Checkpointer.resume")
RESULT = "@@result "  # rank 0's line with the figures, on its stdout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(args: argparse.Namespace) -> int:
    """One rank: build the state, run every candidate ``--repeats`` times, report on rank 0."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_saver import async_save, save
    from torch.distributed.fsdp import fully_shard

    import pitstop
    from pitstop.core.naming import temp_name
    from pitstop.shell.ranks.distributed import Ranks
    from pitstop.shell.sharded.engine import (
        async_write_sharded,
        make_stager,
        publish_sharded,
        write_manifest,
        write_sharded,
    )
    from pitstop.shell.store.storage import LocalStorage

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    ranks = Ranks(rank, world, dist.new_group(backend="gloo", timeout=timeout))
    dcp_group = dist.new_group(backend="gloo", timeout=timeout)  # async uploads' own group
    width = max(8, int(math.sqrt(args.mib * MIB / 3 / 4 / args.layers)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, width)).sum().backward()
    optimizer.step()
    root = Path(args.dir)
    if args.resume:
        rows = _resume_rounds(args, ranks, model, optimizer, root)
        if rank == 0:
            print(RESULT + json.dumps(rows), flush=True)
        dist.destroy_process_group()
        return 0
    stager = make_stager(model)
    policy = pitstop.Policy(keep_last=None)  # retention deletes nothing while timed
    checkpointers = {
        mode: pitstop.Checkpointer(
            root / f"checkpointer-{mode}",
            model=model,
            state={"optimizer": optimizer},
            policy=policy,
            async_save={"sync": False, "async": True, "overlap": "overlap"}[mode],
            timeout_s=args.timeout,
        )
        for mode in ("sync", "async", "overlap")
    }
    steps = iter(range(1, 1 << 30))

    def publish(parent: Path, name: str, layout: Any) -> None:
        def finish() -> None:
            write_manifest(parent / temp_name(name, "bench"), layout, {})
            publish_sharded(LocalStorage(parent), temp_name(name, "bench"), name)

        ranks.lead(finish)

    def run(candidate: str, target: Path) -> tuple[float, float]:
        temp = root / temp_name(target.name, "bench")
        dist.barrier()
        start = time.perf_counter()
        if candidate.startswith("dcp"):  # in the clock, as for pitstop (a loop calls both)
            state = {
                "model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer),
            }
        if candidate == "dcp save":
            save(state, checkpoint_id=target)
            blocking = time.perf_counter() - start
        elif candidate == "dcp async_save":
            response = async_save(
                state, checkpoint_id=target, async_stager=stager, process_group=dcp_group
            )
            staged = getattr(response, "staging_completion", None)  # an AsyncSaveResponse
            if staged is not None:  # a staging thread (with CUDA): the loop waits for the copy
                staged.result()
            blocking = time.perf_counter() - start
            getattr(response, "upload_completion", response).result()
        elif candidate.startswith("Checkpointer"):
            ckpt = checkpointers[candidate.rsplit(" ", 1)[1]]
            saved = ckpt.save(pitstop.Progress(step=next(steps)))
            blocking = time.perf_counter() - start
            ckpt.wait()  # async: published at this call, on every rank
            assert saved is not None
            target = saved.path  # removed below, untimed, as every candidate's output is
        elif candidate == "pitstop sync":
            layout = write_sharded(temp, model, {"optimizer": optimizer}, ranks=ranks)
            blocking = time.perf_counter() - start
            publish(root, target.name, layout)
        else:
            pending = async_write_sharded(
                temp, model, {"optimizer": optimizer}, ranks=ranks, group=dcp_group, stager=stager
            )
            blocking = time.perf_counter() - start
            publish(root, target.name, pending.result())
        if candidate.startswith("dcp"):
            dist.barrier()
            if rank == 0:
                _fsync_dir(target)
                _fsync_dir(target.parent)
        durable = time.perf_counter() - start
        dist.barrier()
        if rank == 0 and target.exists():
            shutil.rmtree(target)
        return blocking, durable

    figures: dict[str, list[tuple[float, float]]] = {c: [] for c in CANDIDATES}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for i in range(len(CANDIDATES)):
            candidate = CANDIDATES[(i + round_) % len(CANDIDATES)]
            blocking, durable = run(candidate, root / f"step_{round_:012d}")
            worst = ranks.all_gather((blocking, durable))
            if round_:
                figures[candidate].append((max(b for b, _ in worst), max(d for _, d in worst)))
    stager.close()
    for ckpt in checkpointers.values():
        ckpt.close()
    dist.barrier()
    if rank == 0:
        for ckpt in checkpointers.values():
            shutil.rmtree(ckpt.directory)
    if rank == 0:
        rows = []
        for candidate, runs in figures.items():
            rows.append(
                {
                    "candidate": candidate,
                    "blocking_s": statistics.median(b for b, _ in runs),
                    "durable_s": statistics.median(d for _, d in runs),
                }
            )
        print(RESULT + json.dumps(rows), flush=True)
    dist.destroy_process_group()
    return 0


def _drop_cache(directory: Path) -> None:
    """Every file of ``directory`` out of the page cache (its pages are clean: fsynced)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resume_rounds(
    args: argparse.Namespace, ranks: Any, model: Any, optimizer: Any, root: Path
) -> list[dict[str, Any]]:
    """Every rank: read one saved checkpoint back, each candidate in turn, from a cold cache;
    rank 0's rows (the others': [])."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    import pitstop
    from pitstop.shell.sharded.engine import read_sharded

    directory = root / "resume"
    state = {"optimizer": optimizer}
    with pitstop.Checkpointer(directory, model=model, state=state, timeout_s=args.timeout) as ckpt:
        saved = ckpt.save(pitstop.Progress(step=1))
    assert saved is not None
    checkpoint = saved.path

    def run(candidate: str) -> tuple[float, float]:
        if ranks.leader:
            _drop_cache(checkpoint)
        gc.collect()
        base = _peak_reset()
        dist.barrier()
        start = time.perf_counter()
        if candidate == "dcp load":
            loaded = {
                "model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer),
            }
            load(loaded, checkpoint_id=checkpoint)
            set_model_state_dict(model, loaded["model"])
            set_optimizer_state_dict(model, optimizer, loaded["optimizer"])
        elif candidate == "pitstop read_sharded":
            read_sharded(checkpoint, model, state, ranks=ranks)
        else:  # the clock stops when resume() returns; close() is timed on its own
            again = pitstop.Checkpointer(
                directory, model=model, state=state, timeout_s=args.timeout
            )
            try:
                assert again.resume().step == 1
                elapsed = time.perf_counter() - start
            finally:
                closing = time.perf_counter()
                again.close()
            return elapsed, (_status_kib("VmHWM") - base) / 1024, time.perf_counter() - closing
        elapsed = time.perf_counter() - start
        return elapsed, (_status_kib("VmHWM") - base) / 1024, None

    figures: dict[str, list[float]] = {c: [] for c in RESUME_CANDIDATES}
    peaks: dict[str, list[float]] = {c: [] for c in RESUME_CANDIDATES}
    closes: dict[str, list[float]] = {c: [] for c in RESUME_CANDIDATES}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for i in range(len(RESUME_CANDIDATES)):
            candidate = RESUME_CANDIDATES[(i + round_) % len(RESUME_CANDIDATES)]
            gathered = ranks.all_gather(run(candidate))
            if round_:
                figures[candidate].append(max(s for s, _, _ in gathered))
                peaks[candidate].append(max(m for _, m, _ in gathered))
                if gathered[0][2] is not None:
                    closes[candidate].append(max(c for _, _, c in gathered))
    dist.barrier()
    if not ranks.leader:
        return []
    shutil.rmtree(directory)
    return [
        {
            "candidate": c,
            "resume_s": statistics.median(r),
            "peak_mib": statistics.median(peaks[c]),
            "close_s": statistics.median(closes[c]) if closes[c] else None,
        }
        for c, r in figures.items()
    ]


def _status_kib(field: str) -> int:
    """This process's ``field`` of /proc/self/status, in KiB (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_reset() -> int:
    """Reset this process's peak resident size to its current one (Linux: clear_refs 5);
    the resident size now, in KiB, which a later peak is counted above."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _launch(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """Run the ranks; return rank 0's rows. Every worker is ended, whatever happens."""
    port = _free_port()
    procs = []
    try:
        for rank in range(args.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            command = [
                sys.executable,
                __file__,
                "--worker",
                "--dir",
                str(root),
                "--mib",
                str(args.mib),
                "--layers",
                str(args.layers),
                "--repeats",
                str(args.repeats),
                "--timeout",
                str(args.timeout),
                *(["--resume"] if args.resume else []),
            ]
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,  # rank 0 reports
                    text=True,
                    start_new_session=True,  # its own process group: killed as one
                )
            )
        out, _ = procs[0].communicate(timeout=args.timeout)
        for proc in procs[1:]:
            proc.wait(timeout=args.timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    rows: list[dict[str, Any]] = json.loads(lines[-1][len(RESULT) :])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="state size (weights + moments)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, every wait")
    parser.add_argument("--dir", help="where to write (default: a temp directory, removed)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--resume", action="store_true", help="read back instead of saving")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sharded-save-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = _launch(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    reference = {r["candidate"]: r for r in rows}
    print(f"{args.ranks} ranks, FSDP2, ~{args.mib:g} MiB of state, median of {args.repeats}")
    if args.resume:
        print(
            "| candidate | resume s (cold cache) | / dcp load | peak RSS above start, MiB "
            "| close() s, untimed |"
        )
        print("|---|---:|---:|---:|---:|")
        for row in rows:
            ratio = row["resume_s"] / reference["dcp load"]["resume_s"]
            peak, close = row["peak_mib"], row.get("close_s")
            closed = "" if close is None else f"{close:.4f}"
            print(
                f"| {row['candidate']} | {row['resume_s']:.4f} | {ratio:.2f} | {peak:.1f} "
                f"| {closed} |"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    print("| candidate | blocking s | durable s | durable / dcp save | blocking / dcp async |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        sync = row["durable_s"] / reference["dcp save"]["durable_s"]
        blocking = row["blocking_s"] / reference["dcp async_save"]["blocking_s"]
        print(
            f"| {row['candidate']} | {row['blocking_s']:.4f} | {row['durable_s']:.4f} | "
            f"{sync:.2f} | {blocking:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
