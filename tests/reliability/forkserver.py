"""A fork server for the reliability suites: torch and pitstop are imported once, and every
worker is a fork of this process, so a kill -9 sweep can afford hundreds of real processes.

Protocol: one JSON object per line. On stdin, a command ``{"do": <worker>, ...}``; on stdout,
events, each ``{"event": ..., "pid": ...}``: ``pid`` when a worker is forked (always before
anything the worker reports: it waits for it), what the worker reports while it runs, and
``exit`` (with the raw wait ``status``) once it has been reaped.
Workers write their events straight to stdout (one ``os.write`` each, atomic on a pipe), so
every event a worker sent comes before its ``exit``. The server ends when stdin closes.

Workers:
* ``train`` — a Checkpointer (``mode``: sync, async or overlap) in ``dir``: resume, report
  ``resumed`` (with the weights' values), then save every step, reporting ``returned`` after
  each synchronous save and ``waited`` after each ``wait()`` of a background one. With
  ``kill_at = op`` it SIGKILLs itself just before its storage operation number ``op`` after
  resuming (a publish boundary, in whichever thread the write runs).
* ``race`` — ``count`` writers forked at once, released together, each opening ``dir`` for
  writing; each reports ``won`` or ``lost`` (with the DirectoryLocked message), and all hold
  on until every one has tried.
* ``hold`` — open ``dir`` for writing, report ``held``, then wait to be killed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

import pitstop
from pitstop.errors import DirectoryLocked
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.storage import LocalStorage

MODES: dict[str, bool | str] = {"sync": False, "async": True, "overlap": "overlap"}
_STORAGE_OPS = ("create_exclusive", "sync_file", "replace", "sync_directory", "symlink", "remove")


def emit(event: str, **fields: Any) -> None:
    os.write(1, (json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n").encode())


def _kill_at(op: int) -> None:
    """SIGKILL this process just before its storage operation number ``op`` (counted from the
    first save on, in whichever thread it runs)."""
    count = [0]
    lock = threading.Lock()
    for name in _STORAGE_OPS:
        real = getattr(LocalStorage, name)

        def wrapped(self: LocalStorage, *args: Any, _real: Callable[..., Any] = real) -> Any:
            with lock:
                count[0] += 1
                if count[0] == op:
                    os.kill(os.getpid(), signal.SIGKILL)
            return _real(self, *args)

        setattr(LocalStorage, name, wrapped)


def train(command: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    mode = MODES[command["mode"]]
    model = torch.nn.Linear(128, 127)  # 64 KiB of weights
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    policy = pitstop.Policy(keep_last=3)
    with pitstop.Checkpointer(
        command["dir"], model=model, state={"opt": opt}, policy=policy, async_save=mode
    ) as ckpt:
        step = ckpt.resume().step
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        values = sorted({float(weights.min()), float(weights.max())})
        emit("resumed", step=step, values=values[:4])
        if command.get("kill_at"):
            _kill_at(command["kill_at"])
        for _ in range(command.get("steps", 1_000_000)):
            for p in model.parameters():
                p.grad = torch.full_like(p, -1.0)
            opt.step()  # every weight is now step + 1
            step += 1
            ckpt.save(pitstop.Progress(step=step))
            if mode is False:
                emit("returned", step=step)
            elif step % 3 == 0:
                ckpt.wait()
                emit("waited", step=step)
    emit("done", step=step)


def hold(command: dict[str, Any]) -> None:
    directory = CheckpointDirectory(command["dir"], run_id=command["run_id"])
    directory.open()
    emit("held")
    while True:
        signal.pause()


def _racer(command: dict[str, Any], index: int, start: int, done: int, release: int) -> None:
    os.read(start, 1)  # every racer is released at once
    directory = CheckpointDirectory(command["dir"], run_id=f"racer{index}")
    try:
        directory.open()
    except DirectoryLocked as error:
        emit("lost", index=index, message=str(error))
    else:
        emit("won", index=index)
    os.write(done, b"x")
    os.read(release, 1)  # the winner holds the lock until every racer has tried
    directory.close()


def race(command: dict[str, Any]) -> list[int]:
    count = command["count"]
    start_r, start_w = os.pipe()
    done_r, done_w = os.pipe()
    release_r, release_w = os.pipe()
    pids = []
    for index in range(count):
        pid = os.fork()
        if pid == 0:
            _child(lambda c, i=index: _racer(c, i, start_r, done_w, release_r), command)
        pids.append(pid)
    os.write(start_w, b"x" * count)
    for _ in range(count):
        os.read(done_r, 1)
    os.write(release_w, b"x" * count)
    for fd in (start_r, start_w, done_r, done_w, release_r, release_w):
        os.close(fd)
    return pids


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {"train": train, "hold": hold}


def _child(work: Callable[[dict[str, Any]], None], command: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck worker shows its stack
    code = 0
    try:
        work(command)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stderr.flush()
        os._exit(code)


def _warm_up() -> None:
    """Import (once, here) what a worker's first optimizer, step and save would import."""
    torch.set_num_threads(1)  # no thread pool is running when this process forks
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # imports torch._dynamo: seconds
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.state_dict()
    import pitstop.shell.manager  # noqa: F401


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_up()
    while line := sys.stdin.readline():
        command = json.loads(line)
        if command["do"] == "race":
            pids = race(command)
        else:
            go_r, go_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(go_w)
                os.read(go_r, 1)  # the "pid" event comes first: wait until it is sent
                os.close(go_r)
                _child(WORKERS[command["do"]], command)
            os.close(go_r)
            emit("pid", child=pid)
            os.write(go_w, b"x")
            os.close(go_w)
            pids = [pid]
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            emit("exit", child=pid, status=status)


if __name__ == "__main__":
    main()
