"""The client side of tests/reliability/forkserver.py."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORKSERVER = Path(__file__).with_name("forkserver.py")


class ForkServer:
    """A client of tests/reliability/forkserver.py: send commands, read events with timeouts."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._stderr = open(log, "wb")  # noqa: SIM115  # closed in close()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen(
            [sys.executable, str(FORKSERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        assert self.process.stdout is not None
        self._fd = self.process.stdout.fileno()
        self._buffer = b""

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()

    def event(self, timeout: float) -> dict[str, Any] | None:
        """The next event, or None when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise AssertionError(f"the fork server died:\n{self.stderr()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def expect(self, name: str, timeout: float = 120.0, pid: int = 0) -> dict[str, Any]:
        """Read events until one named ``name``; fail on a worker's error exit on the way.

        ``pid``: the worker expected to send it; if it stays silent, its stack is dumped (the
        workers register faulthandler on SIGUSR1) into the failure message.
        """
        while True:
            event = self.event(timeout)
            if event is None:
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
                    self.event(5)  # give it a moment to write its stack (an event may come)
                raise AssertionError(f"no {name!r} event within {timeout} s:\n{self.stderr()}")
            if event["event"] == name:
                return event
            if event["event"] == "exit" and not _killed(event["status"]):
                raise AssertionError(f"a worker failed ({event}):\n{self.stderr()}")

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=60)
            if self.process.stdout is not None:
                self.process.stdout.close()
            self._stderr.close()


def _killed(status: int) -> bool:
    return os.WIFSIGNALED(status) or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
