"""Rank processes started without importing torch each time: one process that has imported it
forks every rank, which then runs its script as ``python script args`` would.

Importing torch and torch.distributed costs a new Python process about 3 s of CPU, most of what
a short multi-rank test spends on 2 cores. The zygote (``python -u tests/zygote.py``) imports
them once, then serves requests on a Unix socket: each request is an ``argv``, an environment,
a working directory and the pipes the process writes to (passed as file descriptors). It forks;
the child becomes a session of its own (its own process group, killed as one), takes the pipes
as its stdout and stderr and ``/dev/null`` as its stdin, sets the environment, ``sys.argv`` and
``sys.path[0]`` as the interpreter would, and runs the script as ``__main__``: its exceptions,
``sys.exit`` codes, a KeyboardInterrupt's death by SIGINT, atexit handlers and the join of
non-daemon threads are the interpreter's own. The zygote reaps each child as it exits (a pidfd
per child) and reports its exit code as :class:`subprocess.Popen` would (negative: killed by
that signal).

A child is forked only when nothing read at the interpreter's start differs from the zygote's
own environment (``PYTHON*``, ``OMP_*``, ``LD_*``, ``TORCH_*`` ...); otherwise, and whenever the
zygote cannot serve, :func:`spawn` returns ``None`` and the caller starts a plain process. One
zygote per test process, started on first use, ended at exit (:func:`close`, an atexit hook) and
by itself when its client goes away. The zygote has one thread when it forks (checked).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["ZygoteProcess", "close", "run", "spawn"]

# torch._dynamo: every torch.optim.Optimizer() imports it (1.3 s); none of these starts a thread
# (checked before the first fork).
_PRELOAD = (
    "numpy",
    "yaml",
    "rich",
    "torch",
    "torch._dynamo",
    "torch.utils.data",
    "torch.optim.swa_utils",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "pitstop",
    "pitstop.shell.manager",
    "pitstop.cli",
    "pitstop.cli.listing",
    "pitstop.train.run",
)
# Read when an interpreter (or a library the zygote imports) starts: a child whose value differs
# is not forked from this zygote.
_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "TORCH_", "PYTORCH_", "CUDA_")
# ... but for these: every child is unbuffered, and takes its own stdout and stderr encoding.
_APPLIED = ("PYTHONUNBUFFERED", "PYTHONIOENCODING")
_START_TIMEOUT = 120.0  # seconds for the zygote to import torch and say it is ready
_REPLY_TIMEOUT = 30.0  # seconds for the zygote to fork and name the pid
_DISABLE = "PITSTOP_TESTS_NO_ZYGOTE"  # set (to anything) to start every rank as a new process


# --- the zygote ---------------------------------------------------------------------------------


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """The zygote's loop; returns a child's request in the child, ``None`` in the zygote when
    its client has gone."""
    import importlib

    for name in _PRELOAD:
        with contextlib.suppress(Exception):  # a child that needs it reports why it fails
            importlib.import_module(name)
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects are never scanned again: no child copies them
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        _send(sock, {"refused": f"the zygote has {threads} threads after its imports"})
        return None
    try:  # how the zygote learns of each child's exit: Linux 5.3 or newer
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        _send(sock, {"refused": f"no pidfd: {exc}"})
        return None
    _send(sock, {"ready": os.getpid()})
    children: dict[int, int] = {}  # pidfd -> pid
    buffer = b""
    pending: list[int] = []  # descriptors received with the request not yet whole
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for fd in readable:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data, received, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            if not data:
                return None
            buffer += data
            pending += received
            if b"\n" not in buffer:  # a request is one line, its descriptors with its start
                continue
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            fds, pending = pending, []
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                for pidfd in children:
                    os.close(pidfd)
                request["fds"] = fds
                return dict(request)
            for received in fds:
                os.close(received)
            children[os.pidfd_open(pid)] = pid
            _send(sock, {"pid": pid})


def _become(request: dict[str, Any]) -> None:
    """In the forked child: become ``python argv...`` with the request's pipes and environment;
    the script then runs at the module's top level, outside any frame of the zygote's loop."""
    os.setsid()
    fds = request["fds"]
    stdout, stderr = fds[0], fds[-1]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {null, *fds}:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    encoding, _, errors = os.environ.get("PYTHONIOENCODING", "").partition(":")
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(encoding=encoding or None, errors=errors or None)  # type: ignore[union-attr]
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    if request.get("umask") is not None:
        os.umask(request["umask"])
    argv = list(request["argv"])
    if argv[0] == "-m":  # python -m module: sys.path[0] is the working directory
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))


# --- the client ---------------------------------------------------------------------------------


class ZygoteProcess:
    """A process the zygote forked, as much of :class:`subprocess.Popen` as the tests use:
    ``pid``, ``stdout``, ``stderr``, ``returncode``, ``poll()``, ``wait(timeout)``."""

    def __init__(
        self, pid: int, argv: Sequence[str], stdout: IO[str] | None, stderr: IO[str] | None
    ) -> None:
        self.pid = pid
        self.args = list(argv)
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        """The exit code, or ``None`` while it runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once it exited; ``subprocess.TimeoutExpired`` after ``timeout``."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class _Zygote:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",  # numpy's pool: no thread of its own in the zygote
        }
        self.env = env
        self.process = subprocess.Popen(
            [sys.executable, "-u", __file__, str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._processes: dict[int, ZygoteProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the pid's process was made
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        ready = self._reply(_START_TIMEOUT)
        if ready is None or "ready" not in ready:
            self.close()
            raise RuntimeError(f"the zygote did not start: {ready}")

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                with self._cond:
                    if "exit" in message:
                        process = self._processes.pop(message["exit"], None)
                        if process is None:
                            self._early[message["exit"]] = message["code"]
                        else:
                            process._exited(message["code"])
                    else:
                        self._replies.append(message)
                    self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()
        self._orphans()

    def _orphans(self) -> None:
        """The zygote is gone: each process it left is watched through a pidfd of its own,
        its code unknown (reported as SIGKILL's)."""
        with self._cond:
            left = dict(self._processes)
            self._processes.clear()
        for pid, process in left.items():
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                process._exited(-9)
                continue
            select.select([pidfd], [], [])
            os.close(pidfd)
            process._exited(-9)

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._replies or self._gone, timeout)
            return self._replies.pop(0) if self._replies else None

    def compatible(self, env: Mapping[str, str]) -> bool:
        def start(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(_AT_START) and k not in _APPLIED}

        return start(env) == start(self.env)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        split: bool,
        fds: tuple[int, int] | None,
        umask: int | None,
    ) -> ZygoteProcess | None:
        pipes: list[tuple[int, int]] = []
        if fds is None:
            pipes = [os.pipe(), *([os.pipe()] if split else [])]
        given = list(fds) if fds is not None else [w for _, w in pipes]
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "umask": umask}
        with self._lock:
            try:
                socket.send_fds(self.sock, [(json.dumps(request) + "\n").encode()], given)
                reply = self._reply(_REPLY_TIMEOUT)
            except OSError:
                reply = None
            finally:
                for _, write in pipes:
                    os.close(write)
            if reply is None or "pid" not in reply:
                for read, _ in pipes:
                    os.close(read)
                return None
            pid = reply["pid"]

            def text(fd: int) -> IO[str]:
                return open(fd, encoding="utf-8", errors="replace", buffering=1)

            streams = [text(read) for read, _ in pipes]
            process = ZygoteProcess(
                pid, argv, streams[0] if streams else None, streams[1] if split else None
            )
            with self._cond:
                if pid in self._early:
                    process._exited(self._early.pop(pid))
                else:
                    self._processes[pid] = process
            return process

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        try:
            self.process.wait(timeout=_REPLY_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=_REPLY_TIMEOUT)


_zygote: _Zygote | None = None
_failed = False
_start = threading.Lock()


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None,
    *,
    split: bool = False,
    fds: tuple[int, int] | None = None,
    umask: int | None = None,
) -> ZygoteProcess | None:
    """Fork ``python argv...`` (``argv[0]`` a script, or ``-m`` and a module) from the zygote
    with ``env``, in ``cwd``: its stdout and stderr the descriptors ``fds``, or else pipes it
    returns (with ``split`` apart, else one); ``None`` where the zygote cannot (the caller
    starts a plain process). ``umask``: the child's, else the zygote's (the tests')."""
    global _zygote, _failed
    if os.environ.get(_DISABLE) or _failed or sys.platform != "linux":
        return None
    with _start:
        if _zygote is None:
            try:
                _zygote = _Zygote()
            except (OSError, RuntimeError):
                _failed = True
                return None
            atexit.register(close)
        zygote = _zygote
    if not zygote.compatible(env):
        return None
    return zygote.spawn(argv, env, None if cwd is None else str(cwd), split, fds, umask)


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, check=False)`` for
    ``argv = [sys.executable, script or "-m", ...]``, forked from the zygote where it can; a
    process past ``timeout`` is killed (with its group) and raises ``subprocess.TimeoutExpired``."""
    forkable = len(argv) > 1 and (argv[1] == "-m" or not argv[1].startswith("-"))
    if argv[0] == sys.executable and forkable:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = spawn(argv[1:], env, cwd, fds=(out.fileno(), err.fileno()))
            if process is not None:
                try:
                    code = process.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(_REPLY_TIMEOUT)
                    raise
                out.seek(0)
                err.seek(0)
                return subprocess.CompletedProcess(
                    list(argv),
                    code,
                    out.read().decode("utf-8", "replace"),
                    err.read().decode("utf-8", "replace"),
                )
    return subprocess.run(
        list(argv), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )


def close() -> None:
    """End the zygote (the processes it forked are their callers' to end)."""
    global _zygote
    with _start:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


def _run_as_main(module: bool) -> None:
    """Run the child's script (or ``module``) as ``__main__``, then end as an interpreter's exit
    does — non-daemon threads joined, atexit handlers run, garbage collected (open files
    flushed), streams flushed — but for tearing down every module (torch takes half a second);
    an uncaught KeyboardInterrupt ends it by SIGINT, as python's does."""
    import atexit
    import gc
    import runpy

    code: object = 0
    interrupted = False
    try:
        if module:
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = code or 1
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    _request = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _request is None:
        sys.exit(0)
    _module = _request["argv"][0] == "-m"
    _become(_request)
    del _request
    _run_as_main(_module)
