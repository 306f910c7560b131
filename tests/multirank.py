"""Multi-process jobs for tests: N ranks as real processes, watched line by line, always ended.

A :class:`Job` launches one script as ``ranks`` processes, either directly (one
``sys.executable script args`` per rank, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` set) or through one ``torchrun``
(``python -m torch.distributed.run --nproc-per-node N --master-port P --max-restarts 0 ...``,
whose ``--tee`` prefixes tell the ranks' lines apart; torchrun's stdout and stderr are read
apart and each rebuilt into the ranks' whole lines by :class:`teejoin.TeeJoiner`, as torchrun
forwards a line in parts when it catches a worker in the middle of writing it). Every process
gets ``PYTHONUNBUFFERED=1`` and ``OMP_NUM_THREADS=1``. Reader threads collect each rank's
output (stdout and stderr together) as it comes, so a test can wait for a marker line::

    with Job(script, "--report", ranks=2) as job:
        job.wait_for(1, "step 5")        # returns as soon as rank 1 printed it
        job.signal(1, signal.SIGTERM)
        finished = job.wait()            # exit codes and outputs
    finished.check()                     # every rank exited 0, else the outputs in the message

Every wait has a timeout: a hang becomes a :class:`JobTimeout` (an ``AssertionError``) whose
message holds the ranks' output; output that ends before the marker arrives fails at once
(:class:`JobFailed`). Leaving the ``with`` block — normally or on a failure — kills every
process the job started that is still alive: each rank's process group, torchrun's group and
its workers' (each in its own session), and anything else that carries the job's marker in
its environment; then it joins the reader threads. Nothing here sleeps: waits are on a
condition variable, bounded by deadlines.

Linux only for torchrun's worker pids and the last-resort sweep (they read ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal as signals
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from teejoin import TeeJoiner

__all__ = [
    "DEFAULT_TIMEOUT",
    "DRAIN",
    "FAILURE_GRACE",
    "LAUNCHER",
    "Finished",
    "Job",
    "JobFailed",
    "JobTimeout",
    "alive",
    "free_port",
]

DEFAULT_TIMEOUT = 120.0
"""Seconds any one wait may take by default (a bound on a hang, never a timing assertion)."""
FAILURE_GRACE = 30.0
"""Seconds the other ranks get to end once one rank has failed, before they are killed."""
LAUNCHER = -1
"""The key of torchrun's own output (lines that no rank printed)."""

_MARKER = "MULTIRANK_JOB"  # environment variable that tags every process of one job
_REAP_TIMEOUT = 30.0  # seconds to reap a process after SIGKILL
DRAIN = 5.0
"""Seconds a rank's output may still arrive after its process exited (a child it left may
hold the pipe open, so the end of the output alone cannot tell)."""
_JOIN_TIMEOUT = 10.0  # seconds to join a reader thread once its process is gone
_TAIL = 80  # lines of each rank shown in a failure message


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class JobTimeout(AssertionError):
    """A wait ran past its timeout; the message holds every rank's output so far."""


class JobFailed(AssertionError):
    """A rank's output ended without the line a test waited for."""


def _render(
    lines: Mapping[int, Iterable[str]],
    codes: Mapping[int, int | None],
    killed: Iterable[int] = (),
    tail: int = _TAIL,
) -> str:
    killed = set(killed)
    parts = []
    for key in sorted(lines, key=lambda k: (k == LAUNCHER, k)):
        text = list(lines[key])
        if key == LAUNCHER and not text:
            continue
        name = "torchrun" if key == LAUNCHER else f"rank {key}"
        code = codes.get(key)
        state = "running" if code is None else f"exit {code}"
        if key in killed:
            state += ", killed by the harness after another rank failed"
        shown = text[-tail:]
        skipped = (
            f"  ... {len(text) - len(shown)} earlier line(s)\n" if len(shown) < len(text) else ""
        )
        body = "".join(f"  | {line}\n" for line in shown) or "  (no output)\n"
        parts.append(f"--- {name} ({state}) ---\n{skipped}{body}")
    return "".join(parts)


@dataclass(frozen=True)
class Finished:
    """How a job ended: each rank's exit code (negative: killed by that signal) and output.

    Under torchrun there is one process to wait for, so every rank's code is torchrun's.
    """

    codes: dict[int, int]
    outputs: dict[int, str]
    launcher_output: str = ""
    killed: frozenset[int] = field(default_factory=frozenset)
    """Ranks the harness killed because another rank had failed and they did not end."""

    def lines(self, rank: int) -> list[str]:
        """The lines rank ``rank`` printed."""
        return self.outputs[rank].splitlines()

    def describe(self) -> str:
        """Every rank's exit code and output, for a failure message."""
        lines = {rank: text.splitlines() for rank, text in self.outputs.items()}
        codes: dict[int, int | None] = dict(self.codes)
        if self.launcher_output:
            lines[LAUNCHER] = self.launcher_output.splitlines()
        return _render(lines, codes, self.killed)

    def check(self, expected: int = 0) -> Finished:
        """Raise an AssertionError with every output unless every rank exited ``expected``."""
        if any(code != expected for code in self.codes.values()) or self.killed:
            raise AssertionError(
                f"expected every rank to exit {expected}, got {self.codes}\n{self.describe()}"
            )
        return self


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _proc_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid``'s process group (never ours), then ``pid`` itself."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group != os.getpgrp():
            os.killpg(group, signals.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signals.SIGKILL)


def _await_exit(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait (up to ``timeout`` seconds in all) for processes that may not be our children to
    exit; return those still alive. Uses pidfds where the OS has them, else checks once."""
    deadline = time.monotonic() + timeout
    survivors = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        except (AttributeError, OSError):  # no pidfds here: one last look
            if alive(pid):
                survivors.append(pid)
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
        if alive(pid):
            survivors.append(pid)
    return survivors


class Job:
    """``ranks`` processes running ``script`` with ``args``; a context manager.

    ``torchrun=True`` launches them through one torchrun instead. ``env`` adds to (or, with a
    value of ``None``, removes from) the inherited environment. ``timeout`` is the default of
    every wait; ``drain`` how long output may trail its process's exit. The processes start
    on ``__enter__`` (or :meth:`start`).
    """

    def __init__(
        self,
        script: str | os.PathLike[str],
        *args: str | os.PathLike[str],
        ranks: int = 2,
        torchrun: bool = False,
        env: Mapping[str, str | None] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        cwd: str | os.PathLike[str] | None = None,
        drain: float = DRAIN,
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.script = Path(script)
        self.args = [str(a) for a in args]
        self.ranks = ranks
        self.torchrun = torchrun
        self.timeout = timeout
        self.drain = drain
        self.port = free_port()
        self.token = uuid.uuid4().hex
        self._cwd = cwd
        self._extra_env = dict(env or {})
        self._cond = threading.Condition()
        self._lines: dict[int, list[str]] = {r: [] for r in range(ranks)}
        self._lines[LAUNCHER] = []
        self._eof: set[int] = set()  # keys whose output has ended
        self._open_streams: dict[int, int] = {}  # process key -> its pipes not yet at their end
        self._codes: dict[int, int] = {}  # process key -> exit code
        self._exited: dict[int, float] = {}  # process key -> time.monotonic() at its exit
        self._procs: dict[int, subprocess.Popen[str]] = {}  # rank (or LAUNCHER) -> process
        self._threads: list[threading.Thread] = []
        self._worker_pids: dict[int, int] = {}
        self._killed: set[int] = set()
        self._log_dir: str | None = None
        self._started = False
        self._closed = False

    # --- lifetime -----------------------------------------------------------------------

    def __enter__(self) -> Job:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(raise_errors=exc_type is None)

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            **{_MARKER: self.token},
        )
        env.update(extra)
        for key, value in self._extra_env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _popen(
        self, command: list[str], env: dict[str, str], *, split: bool
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if split else subprocess.STDOUT,
            env=env,
            cwd=self._cwd,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # its own process group, killed as one
        )

    def start(self) -> None:
        """Launch the processes (``__enter__`` does this)."""
        if self._started:
            raise RuntimeError("this Job was already started")
        self._started = True
        try:
            if self.torchrun:
                self._log_dir = tempfile.mkdtemp(prefix="multirank-torchrun-")
                command = self._launcher_command(self._log_dir)
                # torchrun sets RANK and friends for each worker; none must leak in from here.
                env = self._env({})
                for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                    env.pop(key, None)
                self._launch(LAUNCHER, command, env)
            else:
                for rank in range(self.ranks):
                    env = self._env(
                        {
                            "RANK": str(rank),
                            "WORLD_SIZE": str(self.ranks),
                            "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(self.ranks),
                        }
                    )
                    self._launch(rank, [sys.executable, str(self.script), *self.args], env)
        except BaseException:
            self.close(raise_errors=False)
            raise

    def _launcher_command(self, log_dir: str) -> list[str]:
        """The torchrun command line of the job."""
        return self._torchrun(
            log_dir, "--master-addr", "127.0.0.1", "--master-port", str(self.port)
        )

    def _torchrun(self, log_dir: str, *rendezvous: str) -> list[str]:
        """torchrun of the job's script with ``rendezvous``'s options: no restarts, every
        rank's output teed into ``log_dir``."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            "--nproc-per-node",
            str(self.ranks),
            "--max-restarts",
            "0",
            "--tee",
            "3",
            "--log-dir",
            log_dir,
            str(self.script),
            *self.args,
        ]

    def _launch(self, key: int, command: list[str], env: dict[str, str]) -> None:
        proc = self._popen(command, env, split=key == LAUNCHER)
        self._procs[key] = proc
        streams = [proc.stdout] + ([proc.stderr] if key == LAUNCHER else [])
        self._open_streams[key] = len(streams)
        threads = [
            threading.Thread(target=self._read, args=(key, stream), name=f"multirank-read-{key}")
            for stream in streams
        ]
        threads.append(
            threading.Thread(target=self._reap, args=(key, proc), name=f"multirank-reap-{key}")
        )
        for thread in threads:
            thread.daemon = True  # a stuck pipe never blocks the interpreter's exit
            thread.start()
            self._threads.append(thread)

    def _read(self, key: int, stream: IO[str] | None) -> None:
        """Collect one pipe's lines: a rank's own, or (LAUNCHER) torchrun's stdout or stderr,
        whose lines are each rank's parts, joined back into the rank's lines."""
        assert stream is not None
        joiner = TeeJoiner(range(self.ranks), LAUNCHER) if key == LAUNCHER else None

        def add(lines: Iterable[tuple[int, str]]) -> None:
            with self._cond:
                for target, line in lines:
                    self._lines[target].append(line)
                self._cond.notify_all()

        try:
            for raw in stream:
                line = raw.rstrip("\r\n")
                add(joiner.feed(line) if joiner is not None else [(key, line)])
        except (OSError, ValueError):  # the pipe was closed under us at shutdown
            pass
        finally:
            if joiner is not None:
                add(joiner.close())
            with self._cond:
                self._open_streams[key] -= 1
                if not self._open_streams[key]:
                    self._eof.update(self._lines if key == LAUNCHER else (key,))
                self._cond.notify_all()

    def _reap(self, key: int, proc: subprocess.Popen[str]) -> None:
        code = proc.wait()
        with self._cond:
            self._codes[key] = code
            self._exited[key] = time.monotonic()
            self._cond.notify_all()

    def close(self, raise_errors: bool = True) -> None:
        """Kill every process of the job that is still alive; join the readers. Idempotent.

        With ``raise_errors``, a process that survives SIGKILL raises an AssertionError.
        """
        if self._closed:
            return
        self._closed = True
        # Collect everything first, while the process tree is intact: torchrun's workers are
        # each in their own session and would be orphaned once torchrun is gone.
        targets = {p.pid for p in self._procs.values()} | set(self._worker_pids.values())
        targets |= set(self._marked())
        for proc in self._procs.values():
            if proc.poll() is None:
                _kill_group(proc.pid)
        for pid in targets:
            if pid != os.getpid() and alive(pid):
                _kill_group(pid)
        survivors = []
        for proc in self._procs.values():
            try:
                proc.wait(timeout=_REAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                survivors.append(proc.pid)
        others = {pid for pid in targets if pid not in {p.pid for p in self._procs.values()}}
        survivors += _await_exit(others | set(self._marked()), _REAP_TIMEOUT)
        for thread in self._threads:
            thread.join(timeout=_JOIN_TIMEOUT)
        for proc in self._procs.values():
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        if survivors and raise_errors:
            raise AssertionError(f"processes {sorted(set(survivors))} survived SIGKILL")

    def _marked(self) -> list[int]:
        """Every live process whose environment carries this job's marker."""
        me = os.getpid()
        return [
            pid
            for pid in _proc_pids()
            if pid != me and _environ(pid).get(_MARKER) == self.token and alive(pid)
        ]

    # --- looking -------------------------------------------------------------------------

    def lines(self, rank: int) -> list[str]:
        """The lines rank ``rank`` printed so far (``LAUNCHER``: torchrun's own)."""
        with self._cond:
            return list(self._lines[rank])

    def output(self, rank: int) -> str:
        """What rank ``rank`` printed so far, as one string."""
        return "".join(f"{line}\n" for line in self.lines(rank))

    def _output_end(self, rank: int) -> float | None:
        """When rank ``rank``'s output is over: 0 at its end, ``drain`` after its exit."""
        if rank in self._eof:
            return 0.0
        exited = self._exited.get(LAUNCHER if self.torchrun else rank)
        return None if exited is None else exited + self.drain

    def _rank_codes(self) -> dict[int, int | None]:
        if self.torchrun:
            code = self._codes.get(LAUNCHER)
            return {**dict.fromkeys(range(self.ranks), code), LAUNCHER: code}
        return {r: self._codes.get(r) for r in range(self.ranks)}

    def running(self) -> bool:
        """Whether any process of the job has not exited yet."""
        with self._cond:
            return not all(key in self._codes for key in self._procs)

    def describe(self) -> str:
        """Every rank's state and output so far, for a failure message."""
        with self._cond:
            return _render(self._lines, self._rank_codes(), self._killed)

    def wait_for(
        self, rank: int, marker: str | re.Pattern[str], timeout: float | None = None
    ) -> str:
        """Wait until rank ``rank`` printed ``marker`` and return that line.

        A str matches a whole line (surrounding whitespace ignored), a compiled pattern is
        searched in each line. Lines printed before the call count. Raises :class:`JobFailed`
        as soon as the rank's output ends without it, :class:`JobTimeout` after ``timeout``.
        """
        if isinstance(marker, str):
            text = marker.strip()

            def matches(line: str) -> bool:
                return line.strip() == text
        else:

            def matches(line: str) -> bool:
                return marker.search(line) is not None

        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        seen = 0
        with self._cond:
            while True:
                lines = self._lines[rank]
                for line in lines[seen:]:
                    if matches(line):
                        return line
                seen = len(lines)
                now = time.monotonic()
                ended = self._output_end(rank)
                if ended is not None and now >= ended:
                    raise JobFailed(
                        f"rank {rank}'s output ended without {marker!r}\n{self.describe()}"
                    )
                if now >= deadline:
                    raise JobTimeout(
                        f"rank {rank} did not print {marker!r} within {limit:g} s\n"
                        f"{self.describe()}"
                    )
                self._cond.wait(min(deadline, ended if ended is not None else deadline) - now)

    @property
    def launcher_pid(self) -> int | None:
        """torchrun's pid (``None`` when the ranks were launched directly)."""
        return self._procs[LAUNCHER].pid if self.torchrun and LAUNCHER in self._procs else None

    # --- acting -------------------------------------------------------------------------

    def pid(self, rank: int) -> int:
        """The pid of rank ``rank``'s process.

        Under torchrun this is the worker torchrun started for the rank; call it once the
        rank has printed something (after :meth:`wait_for`), when the worker surely exists.
        """
        if not self.torchrun:
            return self._procs[rank].pid
        if rank in self._worker_pids:
            return self._worker_pids[rank]
        launcher = self._procs[LAUNCHER].pid
        for pid in _proc_pids():
            if _parent(pid) == launcher and _environ(pid).get("RANK") == str(rank):
                self._worker_pids[rank] = pid
                return pid
        raise JobFailed(f"torchrun has no live worker for rank {rank}\n{self.describe()}")

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to rank ``rank``'s process (only that process, not its children)."""
        os.kill(self.pid(rank), sig)

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank``: its process and its process group."""
        _kill_group(self.pid(rank))

    def wait(self, timeout: float | None = None, grace: float | None = FAILURE_GRACE) -> Finished:
        """Wait until every rank has exited; return their exit codes and outputs.

        Once a rank has exited non-zero the others get ``grace`` seconds (``None``: no limit
        but ``timeout``), then they are killed and reported in :attr:`Finished.killed`: a
        rank stuck in a collective with a dead peer fails the test instead of hanging it.
        Raises :class:`JobTimeout` with every output after ``timeout`` seconds.
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        failed_at: float | None = None
        keys = list(self._procs)
        with self._cond:
            while not all(k in self._codes for k in keys):
                now = time.monotonic()
                if failed_at is None and any(c != 0 for c in self._codes.values()):
                    failed_at = now
                end = deadline
                if failed_at is not None and grace is not None and not self._killed:
                    end = min(end, failed_at + grace)
                if now >= end:
                    if now >= deadline:
                        raise JobTimeout(
                            f"the job did not end within {limit:g} s\n{self.describe()}"
                        )
                    for key in keys:  # the grace is over: kill the ranks still running
                        if key not in self._codes:
                            self._killed.add(key)
                            _kill_group(self._procs[key].pid)
                    deadline = min(deadline, now + _REAP_TIMEOUT)
                    continue
                self._cond.wait(end - now)
        with self._cond:  # the output is complete at its end, or ``drain`` after the exit
            while True:
                ends = [self._output_end(r) for r in range(self.ranks)]
                last = max(e if e is not None else 0.0 for e in ends)
                now = time.monotonic()
                if now >= last:
                    break
                self._cond.wait(last - now)
            codes = self._rank_codes()
            return Finished(
                codes={r: c for r, c in codes.items() if r != LAUNCHER and c is not None},
                outputs={r: "".join(f"{x}\n" for x in self._lines[r]) for r in range(self.ranks)},
                launcher_output="".join(f"{x}\n" for x in self._lines[LAUNCHER]),
                killed=frozenset(self._killed),
            )
