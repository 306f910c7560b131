"""Simulated nodes for tests: one torchrun agent per node, each in a mount namespace of its own.

A :class:`Nodes` job starts ``nodes`` torchrun agents (``--nnodes N --nproc-per-node P``, c10d
rendezvous on 127.0.0.1 at a free port), each as ``unshare --mount --propagation private sh -c
'mount --bind NODE_DIR MOUNT && exec torchrun ...'``: the same path (``mount``) is a different
directory (``node_dirs[i]``) on every node, as two machines with local disks would see it, and
no rank sees another node's files. Each node is a :class:`multirank.Job` (torchrun's ``--tee``
lines are the node's local ranks), so waits are bounded and leaving the ``with`` block kills
every process of every node, passing or failing. Needs root (the mount) and Linux.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multirank import (
    DEFAULT_TIMEOUT,
    Finished,
    Job,
    JobFailed,
    _environ,
    _kill_group,
    _parent,
    _proc_pids,
    free_port,
)

__all__ = ["NodeJob", "Nodes", "can_simulate_nodes"]


def can_simulate_nodes() -> bool:
    """Whether this machine lets a test give each node a mount namespace of its own."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "--bind", "/", "/mnt"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


class NodeJob(Job):
    """One node: a torchrun agent in its own mount namespace (``ranks``: its local ranks)."""

    def __init__(
        self,
        script: Path,
        args: Sequence[str],
        *,
        node_dir: Path,
        mount: Path,
        nodes: int,
        per_node: int,
        endpoint: int,
        timeout: float,
    ) -> None:
        super().__init__(script, *args, ranks=per_node, torchrun=True, timeout=timeout)
        self.node_dir, self.mount = node_dir, mount
        self.nodes, self.endpoint = nodes, endpoint

    def _launcher_command(self, log_dir: str) -> list[str]:
        torchrun = self._torchrun(
            log_dir,
            "--nnodes",
            str(self.nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.endpoint}",
            "--rdzv-conf",
            "join_timeout=60,read_timeout=60",
        )
        inside = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            inside,
            "node",
            str(self.node_dir),
            str(self.mount),
            *torchrun,
        ]

    def pid(self, rank: int) -> int:
        """The pid of this node's local rank ``rank`` (torchrun's worker)."""
        if rank in self._worker_pids:
            return self._worker_pids[rank]
        launcher = self.launcher_pid
        for pid in _proc_pids():
            if _parent(pid) == launcher and _environ(pid).get("LOCAL_RANK") == str(rank):
                self._worker_pids[rank] = pid
                return pid
        raise JobFailed(f"this node's torchrun has no worker for local rank {rank}")

    def global_rank(self, rank: int = 0) -> int:
        """The job-wide rank of this node's local rank ``rank`` (the rendezvous assigns it)."""
        return int(_environ(self.pid(rank))["RANK"])


class Nodes:
    """``len(node_dirs)`` simulated nodes running ``script args`` (a context manager)."""

    def __init__(
        self,
        script: Path,
        *args: str | os.PathLike[str],
        node_dirs: Sequence[Path],
        mount: Path,
        per_node: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        endpoint = free_port()
        mount.mkdir(parents=True, exist_ok=True)
        for directory in node_dirs:
            directory.mkdir(parents=True, exist_ok=True)
        self.nodes = [
            NodeJob(
                script,
                [str(a) for a in args],
                node_dir=directory,
                mount=mount,
                nodes=len(node_dirs),
                per_node=per_node,
                endpoint=endpoint,
                timeout=timeout,
            )
            for directory in node_dirs
        ]
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Nodes:
        with contextlib.ExitStack() as stack:
            for node in self.nodes:
                stack.enter_context(node)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)

    def __getitem__(self, node: int) -> NodeJob:
        return self.nodes[node]

    def wait(self, timeout: float | None = None) -> list[Finished]:
        """Every node's end (each bounded by ``timeout``)."""
        return [node.wait(timeout) for node in self.nodes]

    def describe(self) -> str:
        """Every node's ranks' output so far."""
        return "\n".join(f"=== node {i} ===\n{n.describe()}" for i, n in enumerate(self.nodes))

    def locate(self, rank: int) -> tuple[int, int]:
        """The node that runs job-wide rank ``rank`` and its local rank there (call once every
        node printed a line: its workers exist by then)."""
        for index, node in enumerate(self.nodes):
            for local in range(node.ranks):
                if node.global_rank(local) == rank:
                    return index, local
        raise JobFailed(f"no node runs rank {rank}\n{self.describe()}")

    def node_of(self, rank: int) -> int:
        """The node that runs job-wide rank ``rank`` (as :meth:`locate`)."""
        return self.locate(rank)[0]

    def kill(self, node: int) -> None:
        """SIGKILL node ``node``: its torchrun agent's process group and its workers'."""
        job = self.nodes[node]
        for rank in range(job.ranks):
            with contextlib.suppress(JobFailed):
                job.kill(rank)
        pid = job.launcher_pid
        if pid is not None:
            _kill_group(pid)
