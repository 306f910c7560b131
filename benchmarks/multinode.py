"""Nodes that share no directory: a save's blocking time on 2 nodes vs 1, and a replaced node's
catch-up vs a local resume of the same size.

Two worker processes (ranks 0 and 1, a gloo process group on 127.0.0.1 at a free port) hold the
same DDP-replicated state: a model of ``--tensors`` float32 parameters plus AdamW's two moments,
about ``--size-mib`` MiB in all. The nodes are simulated in-process, by the code path the
mount-namespace harness of the tests (tests/nodes.py) takes too: each rank is given a directory
of its own (``ROOT/node<R>/...``), so pitstop's probe finds that the ranks share no directory,
exactly as on two machines with local disks; "1 node" gives both ranks one directory. Both
share this machine's disk and CPUs (a real second node brings its own): each worker runs torch's
CPU work (a copy into staging buffers) on its node's half of the CPUs' threads, in both layouts,
as torchrun sets ``OMP_NUM_THREADS=1`` for several ranks on one machine. Two teams of all the
CPUs' OpenMP threads on the same cores oversubscribe them: a 64 MiB copy made by both ranks at
once then took 3-13x one made alone (one thread each: 1.0-1.3x; alone, 1 thread or 2 took the
same, 7-9 ms: the copy is memory-bound).

* *save, 1 node*: ``Checkpointer(ROOT/shared/...).save(p)`` on both ranks: rank 0 writes the
  one file (rank 1's per-rank part gathered to it);
* *save, 2 nodes*: the same on ``ROOT/node<R>/...``: each node's writer writes its own copy,
  in parallel, and the outcome is agreed; *pitstop's own share*: the call's time beyond the
  slower rank's write of its copy (planning, packing, the agreement rounds, the rename);
* *async save*: ``async_save=True``, the time the second ``save()`` holds the loop (the copy
  into the staging buffers the first one made; the write goes on in the background and is
  waited for outside the time) — what "save blocking" is for a background save;
* *resume, local*: a fresh ``Checkpointer(...).resume()`` on both ranks, each node holding its
  copy (each writer verifies and loads its own);
* *resume, catch-up*: the same after node 1's copy was deleted: rank 0 sends its copy to node 1
  at once over a direct TCP stream (1 MiB pieces, its manifest first), checking each piece
  against the manifest as it reads it, then loads it (no second check); node 1 checks each
  piece as it lands, writes it, and loads what it wrote (no second check) before publishing
  it; *catch-up, group*: the same, in turn with it, with
  streams off (``PITSTOP_PEER_STREAM=0``): the copy over the gloo group (8 MiB messages,
  double-buffered), as before the stream;
* *floor*: node 1 writing the same number of bytes to a file and fsyncing it — what any
  catch-up that keeps a durable copy pays at least.

* *parallel floor*: both ranks writing the same bytes durably at once (each its own file),
  against rank 0 alone — what two writers sharing this machine cost it, with no pitstop at all.

Each figure is the slower rank's time from a barrier to the call's return, the median of
``--repeats`` runs after one warm-up; the checkpoint files are dropped from the page cache
before each resume (``posix_fadvise(DONTNEED)``), so every resume reads from the disk.
``--dir /dev/shm`` keeps every file in memory (tmpfs: no disk, and no page cache to drop), so
that what is measured is pitstop's work and the ranks' traffic, not one shared disk.

Per phase (the second table): in the timed saves and the catch-up, each rank's time in the
calls that do the work — writing a copy, verifying (and loading) a copy, sending and receiving
one (``transfer``: without the receiver's load of it, counted as ``verify``) —
each counted without the phases it calls (medians; a phase on another thread counts too);
``collectives`` is the time in pitstop's agreement rounds (all-gathers, gathers,
broadcasts), waiting in them for the other rank's phases included; ``the rest`` is the call's
time outside the main thread's phases: planning, packing, scanning.

    .venv/bin/python benchmarks/multinode.py --size-mib 256 --repeats 5
    .venv/bin/python benchmarks/multinode.py --size-mib 64 --repeats 5 --dir /dev/shm

Both workers are ended: each has ``--timeout`` for the whole run, then is killed (its process
group), and the benchmark fails naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGETS = {"save": 1.1, "resume": 1.5}
"""The issue's targets: 2-node save ≤ 1.1x one node; catch-up ≤ 1.5x a local resume."""


def _evict(directory: Path) -> None:
    """Drop every checkpoint file under ``directory`` from the page cache (written back first)."""
    for path in directory.rglob("*.pitstop"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_durably(path: Path, size: int) -> None:
    """Write ``size`` bytes to ``path`` in 8 MiB pieces and fsync it, then remove it."""
    piece = b"\x01" * (8 << 20)
    with open(path, "wb") as file:
        for offset in range(0, size, len(piece)):
            file.write(piece[: min(len(piece), size - offset)])
        file.flush()
        os.fsync(file.fileno())
    path.unlink()


PHASES = {
    "pitstop.shell.format.fileformat:write": "write a copy",
    "pitstop.shell.state.staging:StagingPool.snapshot": "copy into staging (async_save)",
    "pitstop.shell.resumeread:ResumeRead.verify": "verify (+ load) a copy",
    "pitstop.shell.nodes:send_file": "transfer: send",
    "pitstop.shell.nodes:send_checked": "transfer: send",
    "pitstop.shell.nodes:receive_file": "transfer: receive + check + write",
    "pitstop.shell.state.restore:Restore.prepare": "restore the live state",
    "pitstop.shell.state.restore:Restore.commit": "restore the live state",
    "pitstop.shell.store.directory:CheckpointDirectory.rescan": "rescan, pointers",
    "pitstop.shell.ranks.distributed:Ranks.all_gather": "collectives (waits included)",
    "pitstop.shell.ranks.distributed:Ranks.broadcast": "collectives (waits included)",
    "pitstop.shell.ranks.distributed:Ranks.gather": "collectives (waits included)",
}
"""The calls each timed per phase (``module:attribute``) and the phase's name."""


class Phases:
    """Each rank's time in the :data:`PHASES` calls, each without the phases it calls (on
    every thread: a check that runs beside a send counts in both; ``main`` is this thread's)."""

    def __init__(self) -> None:
        import importlib

        self.spent: dict[str, float] = {}
        self.main = 0.0  # time in phases on the calling thread, outermost only
        self._local = threading.local()  # each thread's [phase, started, time in inner phases]
        self._owner = threading.get_ident()
        for where, phase in PHASES.items():
            module_name, _, attribute = where.partition(":")
            owner: Any = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, self._timed(getattr(owner, name), phase))

    def _timed(self, call: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append([phase, time.perf_counter(), 0.0])
            try:
                return call(*args, **kwargs)
            finally:
                _, started, inner = stack.pop()
                took = time.perf_counter() - started
                self.spent[phase] = self.spent.get(phase, 0.0) + took - inner
                if stack:
                    stack[-1][2] += took
                elif threading.get_ident() == self._owner:
                    self.main += took

        return timed

    def take(self) -> tuple[dict[str, float], float]:
        """The time per phase since the last take, and the calling thread's part of it."""
        spent, main, self.spent, self.main = self.spent, self.main, {}, 0.0
        return spent, main


def worker(rank: int, root: Path, size_mib: int, tensors: int, repeats: int, out: Path) -> None:
    """One rank: every measurement, in step with the other rank; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pitstop

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))  # its node's share
    dist.init_process_group("gloo", rank=rank, world_size=2)
    phases = Phases()
    split: dict[str, list[dict[str, float]]] = {"1 node": [], "2 nodes": [], "catch-up": []}
    own: dict[str, list[float]] = {"1 node": [], "2 nodes": []}  # pitstop's part of a save
    torch.manual_seed(0)
    per = max(1, size_mib * (1 << 20) // 4 // 3 // tensors)  # a third weights, two moments
    model = nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(tensors)])
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    progress = pitstop.Progress(step=1)

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value[0])

    def checkpointer(directory: Path) -> pitstop.Checkpointer:
        return pitstop.Checkpointer(directory, model=model, state={"optimizer": optimizer})

    def timed(directory: Path, call: str, case: str) -> float:
        ckpt = checkpointer(directory)
        try:
            dist.barrier()
            phases.take()
            started = time.perf_counter()
            ckpt.save(progress) if call == "save" else ckpt.resume()
            took = time.perf_counter() - started
            spent, main = phases.take()
            spent["the rest"] = took - main
            both: list[Any] = [None, None]
            dist.all_gather_object(both, spent)
            result = slowest(took)
            if case in split:
                split[case].append(
                    {f"{k}|{r}": v for r, d in enumerate(both) for k, v in d.items()}
                )
            if case in own:  # the call's time beyond the slower rank's write of its copy
                own[case].append(result - max(d.get("write a copy", 0.0) for d in both))
            return result
        finally:
            ckpt.close()

    def save_dir(layout: str, run: int) -> Path:
        return root / ("shared" if layout == "1 node" else f"node{rank}") / f"save{run}"

    def blocking(directory: Path) -> tuple[float, float]:
        """``async_save=True``: how long the second save holds the loop (the first made the
        staging buffers), the slower rank's; its write is waited for outside the time."""
        ckpt = pitstop.Checkpointer(
            directory, model=model, state={"optimizer": optimizer}, async_save=True
        )
        try:
            ckpt.save(progress)
            ckpt.wait()
            dist.barrier()
            phases.take()
            started = time.perf_counter()
            ckpt.save(pitstop.Progress(step=2))
            took = time.perf_counter() - started
            spent, _ = phases.take()
            ckpt.wait()
            both: list[Any] = [None, None]
            dist.all_gather_object(both, spent)
            result = slowest(took)
            copied = max(d.get("copy into staging (async_save)", 0.0) for d in both)
            return result, result - copied
        finally:
            ckpt.close()
            phases.take()

    def clear() -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / "shared", ignore_errors=True)
        shutil.rmtree(root / f"node{rank}", ignore_errors=True)
        dist.barrier()

    rows: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {"1 node": [], "2 nodes": []}
    background: dict[str, list[float]] = {"1 node": [], "2 nodes": []}
    own_async: dict[str, list[float]] = {"1 node": [], "2 nodes": []}  # beyond the slower copy
    for run in range(repeats + 1):  # the layouts take turns; run 0 is the warm-up
        for layout in times:
            seconds = timed(save_dir(layout, run), "save", layout if run else "")
            if run:
                times[layout].append(seconds)
            clear()
            seconds, beyond = blocking(save_dir(layout, run))
            if run:
                background[layout].append(seconds)
                own_async[layout].append(beyond)
            clear()
    rows += _medians("save", times)
    rows += _medians("own share", own)
    rows += _medians("async save", background)
    rows += _medians("async own share", own_async)

    directory = root / f"node{rank}" / "resume"
    ckpt = checkpointer(directory)
    ckpt.save(progress)
    ckpt.close()
    size = sum(p.stat().st_size for p in directory.glob("*.pitstop"))
    times = {"local": [], "catch-up": [], "catch-up, group": []}
    for run in range(repeats + 1):
        for case in times:
            if case.startswith("catch-up") and rank == 1:
                shutil.rmtree(directory)  # a replaced node: its directory is gone
            if directory.exists():
                _evict(directory)
            if case == "catch-up, group":  # the copy over pitstop's gloo group: no stream
                os.environ["PITSTOP_PEER_STREAM"] = "0"
            dist.barrier()
            seconds = timed(directory, "resume", case if run else "")
            os.environ.pop("PITSTOP_PEER_STREAM", None)
            if run:
                times[case].append(seconds)
    rows += _medians("resume", times)
    floors = []  # the catch-up's own floor: node 1 writing the same bytes durably
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        if rank == 1:
            _write_durably(root / "node1" / "floor", size)
        floors.append(slowest(time.perf_counter() - started if rank == 1 else 0.0))
    rows.append({"call": "floor", "case": "write", "median_s": statistics.median(floors)})
    wire = []  # the transfer's own floor: the same bytes over gloo alone, no file, no check
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        _gloo_alone(rank, size)
        wire.append(slowest(time.perf_counter() - started))
    rows.append({"call": "floor", "case": "gloo", "median_s": statistics.median(wire)})
    pairs: dict[str, list[float]] = {"one": [], "both": []}  # one writer, then two at once
    for _ in range(repeats):
        for case, writes in (("one", rank == 0), ("both", True)):
            dist.barrier()
            started = time.perf_counter()
            if writes:
                _write_durably(root / f"node{rank}" / "floor", size)
            pairs[case].append(slowest(time.perf_counter() - started))
    rows += _medians("parallel floor", pairs)
    for case, runs in split.items():
        for key in sorted({k for r in runs for k in r}):
            phase, rank_of = key.split("|")
            median = statistics.median(r.get(key, 0.0) for r in runs)
            rows.append(
                {
                    "call": "phase",
                    "case": case,
                    "phase": phase,
                    "rank": int(rank_of),
                    "median_s": median,
                }
            )
    if rank == 0:
        for row in rows:
            row["bytes"] = size
        out.write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _gloo_alone(rank: int, size: int, chunk: int = 8 << 20) -> None:
    """Rank 0 sends ``size`` bytes to rank 1 as a catch-up's messages travel (``chunk`` each,
    the next posted once the one before is done), from and into memory alone."""
    import torch
    import torch.distributed as dist

    buffers = [torch.ones(min(chunk, size), dtype=torch.uint8) for _ in range(2)]
    travelling = None
    for k, offset in enumerate(range(0, size, chunk)):
        part = buffers[k % 2][: min(chunk, size - offset)]
        if travelling is not None:
            travelling.wait()
        travelling = (dist.isend if rank == 0 else dist.irecv)(part, 1 - rank)
    if travelling is not None:
        travelling.wait()


def _medians(call: str, times: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [{"call": call, "case": k, "median_s": statistics.median(v)} for k, v in times.items()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_workers(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """Start both workers, wait for them (bounded), and return rank 0's rows."""
    out = root / "rows.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    command = [sys.executable, __file__, "--size-mib", str(args.size_mib)]
    command += ["--tensors", str(args.tensors), "--repeats", str(args.repeats)]
    procs = [
        subprocess.Popen(
            [*command, "--worker", str(rank), "--dir", str(root), "--out", str(out)],
            env=env,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"worker rank {rank} exited {code}")
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"a worker did not finish within {args.timeout} s") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return list(json.loads(out.read_text()))


def print_table(rows: list[dict[str, Any]]) -> None:
    """One row per call: the two cases' medians, their ratio and the target."""
    mib = rows[0]["bytes"] / (1 << 20)
    print(f"checkpoint: {mib:.0f} MiB; slower rank's time, median (s)")
    print("| call | 1 node / local | 2 nodes / catch-up | ratio | target |")
    print("|---|---|---|---|---|")
    named = {
        "save": "save (sync), blocking",
        "own share": "save (sync): pitstop's own share (beyond the slower write)",
        "async save": "save, `async_save=True`: blocking",
        "async own share": "save, `async_save=True`: own share (beyond the slower copy)",
        "resume": "resume",
    }
    for call, label in named.items():
        base, other, *_ = (r["median_s"] for r in rows if r["call"] == call)
        target = TARGETS.get(call.split()[-1]) if "own share" not in call else None
        bound = f"≤ {target}x" if target else ""
        print(f"| {label} | {base:.4f} | {other:.4f} | {other / base:.2f}x | {bound} |")
    local, _, group = (r["median_s"] for r in rows if r["call"] == "resume")
    print(
        f"catch-up with the copy over pitstop's gloo group (streams off): {group:.3f} s = "
        f"{group / local:.2f}x"
    )
    floor = {r["case"]: r["median_s"] for r in rows if r["call"] == "floor"}
    print(
        f"floors of the catch-up: node 1 writing the same bytes and fsyncing them: "
        f"{floor['write']:.3f} s; gloo alone moving them (8 MiB messages): {floor['gloo']:.3f} s"
    )
    one, both = (r["median_s"] for r in rows if r["call"] == "parallel floor")
    print(
        f"parallel floor: one rank writing them {one:.3f} s, both at once {both:.3f} s: "
        f"{both / one:.2f}x"
    )
    print("\nper phase, median s (rank 0 / rank 1)")
    print("| phase | 1-node save | 2-node save | catch-up |")
    print("|---|---|---|---|")
    phased = [r for r in rows if r["call"] == "phase"]
    for phase in dict.fromkeys(r["phase"] for r in phased):
        cells = []
        for case in ("1 node", "2 nodes", "catch-up"):
            got = {
                r["rank"]: r["median_s"] for r in phased if (r["phase"], r["case"]) == (phase, case)
            }
            cells.append(" / ".join(f"{got.get(k, 0.0):.3f}" for k in (0, 1)))
        print(f"| {phase} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table (``--json``: the rows too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--dir", type=Path, default=None, help="where the nodes' files go")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.size_mib < 1 or args.tensors < 1:
        parser.error("--size-mib, --tensors and --repeats must be at least 1")
    if args.worker is not None:
        worker(args.worker, args.dir, args.size_mib, args.tensors, args.repeats, args.out)
        return 0
    root = Path(tempfile.mkdtemp(prefix="pitstop-multinode-", dir=args.dir))
    try:
        rows = run_workers(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
