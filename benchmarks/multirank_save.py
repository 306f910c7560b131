"""A 2-rank save's blocking time: pitstop 1-rank, 2-rank sync / async, and DCP, same DDP state.

The state is a model of ``--tensors`` float32 parameters plus AdamW's two moments (one
optimizer step on fixed gradients creates them), about ``--size-mib`` MiB in all (a third
weights, two thirds moments). The 2-rank candidates run in a real 2-rank job: two processes,
a gloo process group on 127.0.0.1 (a free port), the model wrapped in
``DistributedDataParallel``; the 1-rank candidates in a third process with no process group
and the same state. Every candidate writes to its own directory under one root shared by the
ranks:

* ``pitstop 1-rank sync`` / ``async``: ``Checkpointer(async_save=False | True).save(p)`` in the
  single process;
* ``pitstop 2-rank sync`` / ``async``: the same calls on both ranks
  (``Checkpointer(model=ddp_model, ..., timeout_s=120)``): rank 0 writes the one file, rank 1
  hands its per-rank state (RNG) over and waits for the agreed outcome;
* ``dcp 2-rank save``: ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter`` on
  both ranks, of ``{"app": AppState}`` where ``AppState.state_dict()`` is
  ``torch.distributed.checkpoint.state_dict.get_state_dict(ddp_model, optimizer)`` (the DCP
  tutorial's pattern; DCP deduplicates the replicated tensors, so each rank writes part);
* ``dcp 2-rank async_save (default)``: ``dcp.async_save`` with a fresh ``FileSystemWriter``
  and no stager: the writer stages itself (``BlockingAsyncStager``, not cached: new CPU copies
  each call) and a thread uploads;
* ``dcp 2-rank async_save (cached stager)``: the same with one ``DefaultStager`` kept across
  saves (``StagingOptions`` all off on the CPU: no pinning, no shared memory, staged in the
  call; its CPU storages are cached and reused).

Both async DCP candidates get a gloo process group of their own (``dist.new_group``): their
upload thread runs collectives, which must not share a group with the loop's.

Figures per candidate and rank, in seconds from the call (the ranks leave a barrier just
before it):

* *blocking*: until the call returns — what the save holds the training loop on that rank;
* *durable*: until the checkpoint is on disk — pitstop: ``ckpt.wait()`` returns (it fsyncs the
  file and the directory itself); DCP: its future (or the call) returns on that rank, plus,
  on rank 0, an fsync of the checkpoint directory and of its parent (DCP fsyncs its files).

The table shows each rank's blocking time, the worse of the two, the worse rank's durable
time, the range of the worse blocking time over the repeats, and the ratio of the worse
blocking time to pitstop 1-rank sync's. Each figure is the median of ``--repeats`` runs after
one warm-up; the candidates take turns (one run of each per round, the order rotating from
one round to the next), so that the load of a shared machine hits all of them alike. Only one
candidate runs at a time. Between runs, untimed, what the previous run wrote is removed and
the new files are fsynced and dropped from the page cache.

    .venv/bin/python benchmarks/multirank_save.py --size-mib 64,256 --repeats 5
    .venv/bin/python benchmarks/multirank_save.py --size-mib 64 --json rows.json

Every child is ended: the workers leave on a command, are killed (their whole process group)
if they do not within the timeout, and every wait for a worker has ``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple, TextIO

MIB = 1 << 20
REPLY = "@@reply "  # a worker's protocol lines on its stdout start with this
SOLO, RANK0, RANK1 = "solo", "rank0", "rank1"
CANDIDATES: list[tuple[str, str, int]] = [  # (system, mode, ranks)
    ("pitstop", "sync", 1),
    ("pitstop", "async", 1),
    ("pitstop", "sync", 2),
    ("pitstop", "async", 2),
    ("dcp", "save", 2),
    ("dcp", "async_save (default)", 2),
    ("dcp", "async_save (cached stager)", 2),
]


def key(system: str, mode: str, ranks: int) -> str:
    return f"{system} {ranks}-rank {mode}"


# --- the workers (each a process running this file with --worker) ------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _evict(path: Path) -> None:
    """fsync every file under ``path`` and drop it from the page cache (untimed)."""
    if not path.exists():
        return
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        if file.is_symlink():
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Worker:
    """One process of the benchmark: the single process, or one rank of the 2-rank job."""

    def __init__(self, role: str, root: Path, tensors: int) -> None:
        import torch

        self.torch = torch
        self.role, self.root, self.tensors = role, root, tensors
        self.rank = {SOLO: 0, RANK0: 0, RANK1: 1}[role]
        self.many = role != SOLO
        self.dist = torch.distributed
        if self.many:
            self.dist.init_process_group(
                "gloo",
                init_method="env://",
                rank=self.rank,
                world_size=2,
                timeout=datetime.timedelta(seconds=300),
            )
        self.candidates: dict[str, Any] = {}
        self.model: Any = None
        self.optimizer: Any = None
        self.dcp_group: Any = None

    def barrier(self) -> None:
        if self.many:
            self.dist.barrier()

    def build(self, size_bytes: int) -> dict[str, Any]:
        """The state of about ``size_bytes`` (weights + AdamW moments) and this role's
        candidates; a collective on the ranks (DDP's broadcast, pitstop's groups)."""
        torch = self.torch
        from torch import nn

        self.drop()
        per = max(1, size_bytes // 3 // self.tensors // 4)
        generator = torch.Generator().manual_seed(0)
        holder = nn.Module()
        for i in range(self.tensors):
            weight = torch.randn(per, generator=generator)
            holder.register_parameter(f"p{i:02d}", nn.Parameter(weight))
        optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-3)
        for p in holder.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()  # creates exp_avg and exp_avg_sq
        optimizer.zero_grad(set_to_none=True)
        model: Any = holder
        if self.many:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(holder)
        self.model, self.optimizer = model, optimizer
        nbytes = sum(p.numel() * 4 for p in holder.parameters()) + sum(
            t.numel() * t.element_size()
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        for system, mode, ranks in CANDIDATES:
            if (ranks == 2) != self.many:
                continue
            name = key(system, mode, ranks)
            directory = self.root / name.replace(" ", "_").replace("(", "").replace(")", "")
            if system == "pitstop":
                self.candidates[name] = PitstopCandidate(self, directory, mode == "async")
            else:
                if mode != "save" and self.dcp_group is None:
                    self.dcp_group = self.dist.new_group(backend="gloo")
                self.candidates[name] = DcpCandidate(self, directory, mode)
        self.barrier()
        return {"nbytes": nbytes}

    def run(self, name: str) -> dict[str, Any]:
        candidate = self.candidates[name]
        if self.rank == 0:
            candidate.setup()
        self.barrier()
        blocking, durable = candidate.run()
        if self.rank == 0:
            candidate.evict()
        self.barrier()
        return {"blocking_s": blocking, "durable_s": durable}

    def drop(self) -> None:
        for candidate in self.candidates.values():
            candidate.close()
        self.candidates.clear()
        self.model = self.optimizer = None
        self.barrier()

    def exit(self) -> None:
        self.drop()
        if self.many:
            self.dist.destroy_process_group()


class PitstopCandidate:
    def __init__(self, worker: Worker, directory: Path, async_save: bool) -> None:
        import pitstop

        self.pitstop, self.worker, self.directory = pitstop, worker, directory
        self.ckpt = pitstop.Checkpointer(
            directory,
            model=worker.model,
            state={"optimizer": worker.optimizer},
            policy=pitstop.Policy(keep_last=None, save_final=False),
            async_save=async_save,
            timeout_s=120,
            overwrite=True,  # a scratch directory, reopened between rounds
        )
        self.step = 0

    def setup(self) -> None:
        # Keep only the newest file ("last" points at it); removing the older ones is not part
        # of the figure (retention is off: keep_last=None), as for every candidate.
        for old in sorted(self.directory.glob("step_*.pitstop"))[:-1]:
            old.unlink()

    def run(self) -> tuple[float, float]:
        self.step += 1
        start = time.perf_counter()
        self.ckpt.save(self.pitstop.Progress(step=self.step))
        blocking = time.perf_counter() - start
        self.ckpt.wait()
        return blocking, time.perf_counter() - start

    def evict(self) -> None:
        _evict(self.directory)

    def close(self) -> None:
        self.ckpt.close()


class AppState:
    """The DCP tutorial's Stateful: the DDP model's and the optimizer's state for DCP."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # never called here
        raise NotImplementedError


class DcpCandidate:
    def __init__(self, worker: Worker, directory: Path, mode: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from pitstop.shell.sharded.shardstage import stager_spent

        self.spent = stager_spent

        self.dcp, self.worker, self.directory, self.mode = dcp, worker, directory, mode
        self.state = {"app": AppState(worker.model, worker.optimizer)}
        self.stager: Any = None
        if mode == "async_save (cached stager)":
            # On the CPU: no pinned or shared memory, staged in the call (no staging thread);
            # kept across saves, so its CPU storages are cached and reused.
            self.make_stager = lambda: DefaultStager(StagingOptions(False, False, False, False))
            self.stager = self.make_stager()

    def setup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def run(self) -> tuple[float, float]:
        dcp, worker = self.dcp, self.worker
        writer = dcp.FileSystemWriter(self.directory)
        if self.stager is not None and self.spent(self.stager):
            # torch 2.11's stager closes itself after each stage (pytorch#183413): a new one
            # for each save there, as a user of that torch must make (its cache is lost).
            self.stager.close()
            self.stager = self.make_stager()
        start = time.perf_counter()
        if self.mode == "save":
            dcp.save(self.state, storage_writer=writer)
            blocking = time.perf_counter() - start
        else:
            result: Any = dcp.async_save(
                self.state,
                storage_writer=writer,
                process_group=worker.dcp_group,
                async_stager=self.stager,
            )
            blocking = time.perf_counter() - start
            upload = getattr(result, "upload_completion", result)  # an AsyncSaveResponse?
            upload.result()
        if worker.rank == 0:
            _fsync(self.directory)
            _fsync(self.directory.parent)
        return blocking, time.perf_counter() - start

    def evict(self) -> None:
        _evict(self.directory)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def worker_main(role: str, root: Path, tensors: int) -> int:
    """Serve the parent's commands (JSON lines on stdin), answer on stdout after ``REPLY``."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to stderr, never into the protocol

    def reply(payload: dict[str, Any]) -> None:
        out.write(REPLY + json.dumps(payload) + "\n")
        out.flush()

    try:
        worker = Worker(role, root, tensors)
        reply({"ok": True})
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "build":
                reply(worker.build(int(command["size_bytes"])))
            elif op == "run":
                reply(worker.run(command["name"]))
            elif op == "exit":
                worker.exit()
                reply({"ok": True})
                return 0
            else:
                raise ValueError(f"unknown command {op!r}")
    except BaseException:
        reply({"error": traceback.format_exc()})
        return 1
    return 0


# --- the parent --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class WorkerFailed(RuntimeError):
    pass


class Child:
    """A worker process, its replies on a queue (a reader thread), every wait bounded."""

    def __init__(self, role: str, command: list[str], env: dict[str, str], timeout: float):
        self.role, self.timeout = role, timeout
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: killed as one
        )
        self.thread = threading.Thread(target=self._read, name=f"read-{role}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        stream: TextIO = self.proc.stdout
        with contextlib.suppress(OSError, ValueError):
            for line in stream:
                if line.startswith(REPLY):
                    self.replies.put(json.loads(line[len(REPLY) :]))
                else:
                    sys.stderr.write(f"[{self.role}] {line}")
        self.replies.put(None)  # end of output

    def send(self, payload: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailed(f"{self.role} is gone ({exc})") from None

    def receive(self) -> dict[str, Any]:
        try:
            answer = self.replies.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerFailed(f"{self.role} did not answer within {self.timeout:g} s") from None
        if answer is None:
            code = self.proc.poll()
            raise WorkerFailed(f"{self.role} ended without an answer (exit {code})")
        if "error" in answer:
            raise WorkerFailed(f"{self.role} failed:\n{answer['error']}")
        return answer

    def leave(self) -> None:
        """Ask it to leave (every rank must be asked before any is waited for)."""
        if self.proc.poll() is None:
            with contextlib.suppress(WorkerFailed):
                self.send({"op": "exit"})

    def end(self, grace: float) -> None:
        """Kill its process group if it has not left within ``grace`` seconds."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # Anything the worker left behind in its group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.thread.join(timeout=10)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()


def ask(children: list[Child], payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Send ``payload`` to every child at once, then collect each one's answer."""
    for child in children:
        child.send(payload)
    return [child.receive() for child in children]


class Row(NamedTuple):
    system: str
    mode: str
    ranks: int
    size_bytes: int
    blocking_s: list[float | None]  # per rank (rank 1: None with one rank), median
    worst_blocking_s: float  # median over repeats of the worse rank's blocking time
    worst_blocking_min_s: float
    worst_blocking_max_s: float
    durable_s: float  # median over repeats of the worse rank's durable time
    repeats: int


def measure(
    children: dict[str, Child], size_bytes: int, repeats: int, only: list[str]
) -> tuple[int, list[Row]]:
    built = ask(list(children.values()), {"op": "build", "size_bytes": size_bytes})
    nbytes = int(built[0]["nbytes"])
    chosen = [
        c for c in CANDIDATES if not only or any(o in key(*c) for o in only)
    ]  # always in the same order: they take turns
    runs: dict[str, list[list[dict[str, Any]]]] = {key(*c): [] for c in chosen}
    for round_ in range(repeats + 1):  # round 0 is the warm-up
        shift = round_ % len(chosen)  # the order rotates: no candidate always follows another
        for system, mode, ranks in chosen[shift:] + chosen[:shift]:
            name = key(system, mode, ranks)
            who = [children[SOLO]] if ranks == 1 else [children[RANK0], children[RANK1]]
            answers = ask(who, {"op": "run", "name": name})
            if round_:
                runs[name].append(answers)
    rows = []
    for system, mode, ranks in chosen:
        name = key(system, mode, ranks)
        per_rank: list[float | None] = [
            statistics.median(run[r]["blocking_s"] for run in runs[name]) for r in range(ranks)
        ]
        per_rank += [None] * (2 - ranks)
        worst = [max(a["blocking_s"] for a in run) for run in runs[name]]
        rows.append(
            Row(
                system=system,
                mode=mode,
                ranks=ranks,
                size_bytes=nbytes,
                blocking_s=per_rank,
                worst_blocking_s=statistics.median(worst),
                worst_blocking_min_s=min(worst),
                worst_blocking_max_s=max(worst),
                durable_s=statistics.median(max(a["durable_s"] for a in run) for run in runs[name]),
                repeats=repeats,
            )
        )
    return nbytes, rows


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def print_table(rows: list[Row]) -> None:
    reference = next(
        (r for r in rows if (r.system, r.mode, r.ranks) == ("pitstop", "sync", 1)), None
    )
    print(
        "| candidate | ranks | blocking s, rank 0 | blocking s, rank 1 | blocking s, worse rank "
        "| range over repeats | durable s | x pitstop 1-rank sync |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = (
            "—" if reference is None else f"{r.worst_blocking_s / reference.worst_blocking_s:.2f}"
        )
        print(
            f"| {r.system} {r.mode} | {r.ranks} | {_fmt(r.blocking_s[0])} "
            f"| {_fmt(r.blocking_s[1])} | {_fmt(r.worst_blocking_s)} "
            f"| {r.worst_blocking_min_s:.3f}-{r.worst_blocking_max_s:.3f} "
            f"| {_fmt(r.durable_s)} | {ratio} |"
        )


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
        raise argparse.ArgumentTypeError(f"--size-mib: not a list of integers: {text!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--size-mib: sizes must be >= 1 MiB, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib", type=_sizes, default=[64], help="state sizes (weights + moments), e.g. 64,256"
    )
    parser.add_argument("--tensors", type=int, default=16, help="parameters (each with 2 moments)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any wait may take")
    parser.add_argument(
        "--only", default="", help="comma list: run only candidates whose name contains one"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, Path(args.dir), args.tensors)
    if args.repeats < 1 or args.tensors < 1:
        parser.error("--repeats and --tensors must be >= 1")
    only = [o.strip() for o in args.only.split(",") if o.strip()]

    own_root = args.dir is None
    root = Path(args.dir or tempfile.mkdtemp(prefix="pitstop-multirank-"))
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children: dict[str, Child] = {}
    rows: list[Row] = []
    try:
        import torch

        print(
            f"python {platform.python_version()}, torch {torch.__version__}; "
            f"{os.cpu_count()} CPUs ({_cpu_model()}); load average "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        print(f"directory: {root}; 2 ranks on gloo (127.0.0.1:{port}) + 1 single process")
        for role in (SOLO, RANK0, RANK1):
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if role != SOLO:
                rank = "0" if role == RANK0 else "1"
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=rank,
                    LOCAL_RANK=rank,
                    WORLD_SIZE="2",
                )
            else:
                for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                    env.pop(name, None)
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", role]
            command += ["--dir", str(root), "--tensors", str(args.tensors)]
            children[role] = Child(role, command, env, args.timeout)
        for child in children.values():
            child.receive()  # started (and, for the ranks, the process group is up)
        for size_mib in args.size_mib:
            nbytes, size_rows = measure(children, size_mib * MIB, args.repeats, only)
            rows += size_rows
            print()
            print(
                f"### {nbytes / MIB:.0f} MiB of state ({args.tensors} float32 parameters + "
                f"AdamW moments) per rank; median of {args.repeats} after a warm-up"
            )
            print()
            print_table(size_rows)
    finally:
        for child in children.values():
            child.leave()
        deadline = time.monotonic() + min(args.timeout, 60.0)
        for child in children.values():
            child.end(grace=max(1.0, deadline - time.monotonic()))
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"load average after the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        payload = [
            {
                "system": r.system,
                "mode": r.mode,
                "ranks": r.ranks,
                "size_bytes": r.size_bytes,
                "blocking_s": r.blocking_s,
                "worst_blocking_s": r.worst_blocking_s,
                "worst_blocking_min_s": r.worst_blocking_min_s,
                "worst_blocking_max_s": r.worst_blocking_max_s,
                "durable_s": r.durable_s,
                "repeats": r.repeats,
            }
            for r in rows
        ]
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
